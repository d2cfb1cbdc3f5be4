"""`rlhfkit plan`: a stage's memory per process, part by part and phase by phase, and its time per step on a named
device, from its config and the model's config.json alone (no weights are read); whether it fits, what to change
so it does (each change planned again), and the smallest device it fits on.

    rlhfkit.plan("ppo", config="configs/ppo.yaml", device="H100")   # a Plan
    from rlhfkit.plan import plan_for                               # from an already validated config object

The module is callable (`rlhfkit.plan(...)` is `rlhfkit.plan.plan(...)`): the package and the function share the
name the issue gives both, and a package attribute would otherwise shadow the function once imported.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlhfkit.errors import UserError
from rlhfkit.plan.devices import DEVICES, GB, Device, device_named, memory_device
from rlhfkit.plan.layout import STAGES_PLANNED, Layout, layout_of
from rlhfkit.plan.memory import Phase, Precision, Sharding, model_bytes, phases
from rlhfkit.plan.suggest import Suggestion, suggestions
from rlhfkit.plan.timing import step_time

FIT_MARGIN = 0.95  # a plan fits when its peak is under 95% of the device: allocator fragmentation, CUDA context
SHARDINGS = ("none", "zero2", "zero3", "fsdp")


@dataclass(frozen=True)
class Plan:
    """A stage's plan. Memory in GB (2**30 bytes) per process; `phases` hold bytes per part."""

    stage: str
    model: str
    device: str | None  # the device planned for (None: none named)
    memory_gb: float | None  # its memory
    processes: int
    sharding: str
    phases: tuple[Phase, ...]  # "generation" (online stages, rft) and "update", each {part: bytes}
    peak_gb: float
    fits: bool | None  # None when no device or memory was named
    suggestions: tuple[Suggestion, ...]  # changes that lower the peak, largest saving first
    seconds_per_step: float | None  # an optimizer step (online: a rollout and its update); None without rates
    time_phases: dict[str, float]
    time_measured: bool  # the rates behind seconds_per_step were measured on this device (bench/plan_calibrate.py)
    time_basis: str  # where those rates come from: date, machine, commit and the thread count they assume
    steps: int | None  # max_steps, when the config sets it
    smallest_device: str | None  # the smallest device of the table it fits on (None: none)

    @property
    def hours(self) -> float | None:
        return None if self.seconds_per_step is None or self.steps is None else self.seconds_per_step * self.steps / 3600

    def to_dict(self) -> dict:
        """JSON-able: every field, the phases as {name: {"peak_gb", "parts_gb"}}."""
        out = dataclasses.asdict(self)
        out["phases"] = {ph.name: {"peak_gb": ph.total / GB, "parts_gb": {k: v / GB for k, v in ph.parts.items()}}
                         for ph in self.phases}
        out["hours"] = self.hours
        return out

    def summary(self) -> str:
        """The one line a run prints at its start."""
        where = f" on {self.device}" if self.device else ""
        verdict = "" if self.fits is None else " (fits)" if self.fits else f" (does not fit its {self.memory_gb:.1f} GB)"
        worst = max(self.phases, key=lambda ph: ph.total)
        return f"plan: {self.stage} peak {self.peak_gb:.2f} GB per process in {worst.name}{where}{verdict}"


def plan_for(stage: str, cfg: Any, *, device: str | Device | None = None, memory_gb: float | None = None,
             processes: int = 1, sharding: str = "none", offload: bool = False, shape=None,
             models: Mapping[str, Any] | None = None, suggest: bool = True) -> Plan:
    """The plan of `stage` run with the validated config `cfg` on `device` (a name of `devices.DEVICES`, "cpu", a
    `Device`) or a device of `memory_gb`; `shape`: the policy's `ModelShape` when the caller holds the model object;
    `models`: {path: ModelShape} for models named by a path that does not hold them yet (a pipeline's later stage
    reads an earlier stage's output, planned before that stage has run)."""
    if stage not in STAGES_PLANNED:
        raise UserError(f"rlhfkit plan: unknown stage '{stage}': one of {', '.join(STAGES_PLANNED)}")
    if sharding not in SHARDINGS:
        raise UserError(f"sharding: one of {', '.join(SHARDINGS)}, got {sharding!r}")
    if not isinstance(processes, int) or processes < 1:
        raise UserError(f"processes: expected a whole number >= 1, got {processes!r}")
    if device is not None and memory_gb is not None:
        raise UserError("give a device or memory_gb (--device or --memory), not both")
    dev = device if isinstance(device, Device) else device_named(device) if device else (
        memory_device(memory_gb) if memory_gb is not None else None)
    gpu = dev is not None and dev.name != "cpu" if dev is not None else False
    load = _loader(shape, models or {})
    lay = layout_of(stage, cfg, load)
    shard = Sharding(sharding if processes > 1 else "none", processes, offload)
    peak, planned = _peak(cfg, lay, gpu, shard)
    fits = None if dev is None else peak <= dev.memory_gb * FIT_MARGIN

    def replan(changed, zero3: int | None) -> tuple[float, bool | None]:
        new_shard = Sharding("zero3", zero3, offload) if zero3 else shard
        new_peak = _peak(changed, layout_of(stage, changed, load), gpu, new_shard)[0]
        return new_peak, None if dev is None else new_peak <= dev.memory_gb * FIT_MARGIN

    found = suggestions(cfg, lay, processes, peak, replan) if suggest else []
    precision = Precision.of(cfg, lay.policy, gpu)
    timing = step_time(lay, dev or Device("none", 0, 0, 0, ""), model_bytes(lay.policy, "lm", precision.weights,
                                                                               lay.quantized), precision.compute)
    smallest = next((d.name for d in sorted(DEVICES.values(), key=lambda d: d.memory_gb)
                     if _peak(cfg, lay, True, shard)[0] <= d.memory_gb * FIT_MARGIN), None)
    return Plan(stage=stage, model=cfg.model.name_or_path, device=dev.name if dev else None,
                memory_gb=dev.memory_gb if dev else None, processes=processes, sharding=shard.strategy,
                phases=planned, peak_gb=peak, fits=fits, suggestions=tuple(found), seconds_per_step=timing.seconds,
                time_phases=timing.phases, time_measured=timing.measured, time_basis=timing.basis,
                steps=cfg.max_steps if cfg.max_steps > 0 else None, smallest_device=smallest)


def _peak(cfg, lay: Layout, gpu: bool, shard: Sharding) -> tuple[float, tuple[Phase, ...]]:
    planned = phases(lay, Precision.of(cfg, lay.policy, gpu), shard)
    return max(ph.total for ph in planned) / GB, planned


def _loader(shape, models: Mapping[str, Any]):
    """`load_shape`, except that the policy's shape is `shape` when the caller gave one, and a name of `models` has
    that shape (cut to the config's num_layers, as a loaded model would be)."""
    from rlhfkit.plan.shape import cut, load_shape

    if shape is None and not models:
        return load_shape

    def load(name, where, gguf_file=None, revision=None, num_layers=None):
        if shape is not None and where == "model.name_or_path":
            return shape
        key = name if name in models else os.path.abspath(os.path.expanduser(name))
        if key in models:
            return cut(models[key], num_layers)
        return load_shape(name, where, gguf_file, revision, num_layers)

    return load


def plan(stage: str, *, config: Any = None, overrides: dict | list[str] | None = None, model: Any = None,
         device: str | None = None, memory_gb: float | None = None, processes: int = 1, sharding: str = "none",
         offload: bool = False) -> Plan:
    """`rlhfkit plan` from Python. `config` and `overrides` as `rlhfkit.train`'s (a YAML path, a dict or a config
    object; then {"key.sub": value} or ["key.sub=value"]); `model`: a hub name, directory or "tiny", or a transformers
    model object (its config is read, not its weights). data.train and output_dir may be left out: a plan reads
    neither. `device`: a name of the devices table or "cpu"; `memory_gb`: a device known by its memory."""
    from rlhfkit.config.fields import merge, parse_overrides
    from rlhfkit.stages import build_stage_config, config_data, override_list

    if stage not in STAGES_PLANNED:
        raise UserError(f"rlhfkit plan: unknown stage '{stage}': one of {', '.join(STAGES_PLANNED)}")
    shape = None
    data = merge({"data": {"train": "(not read by the plan)"}, "output_dir": "(not written by the plan)"},
                 config_data(stage, config))
    if model is not None and not isinstance(model, (str, os.PathLike)):
        from rlhfkit.plan.shape import shape_of

        config_dict = getattr(getattr(model, "config", None), "to_dict", None)
        if config_dict is None:
            raise UserError(f"model: expected a transformers model object, a hub name or a directory, got "
                            f"{type(model).__name__}")
        shape = shape_of(config_dict(), "model", model.get_input_embeddings().num_embeddings)
        data = merge(data, {"model": {"name_or_path": getattr(model, "name_or_path", None) or type(model).__name__}})
    elif model is not None:
        data = merge(data, {"model": {"name_or_path": os.fspath(model)}})
    cfg = build_stage_config(stage, merge(data, parse_overrides(override_list(overrides))))
    return plan_for(stage, cfg, device=device, memory_gb=memory_gb, processes=processes, sharding=sharding,
                    offload=offload, shape=shape)


class _CallablePackage(types.ModuleType):
    def __call__(self, stage: str, **kwargs) -> Plan:
        return plan(stage, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
