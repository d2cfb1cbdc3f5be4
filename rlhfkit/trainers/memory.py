"""A run's check against its plan (`rlhfkit plan`; config section `plan`): on a GPU, a stop before any model loads when
the planned peak exceeds the free memory by more than `plan.margin`; once the models are loaded, the planned peak in
one line and plan.json in output_dir; at the end of a finished run the measured peak beside the planned one. (A run
refused for bad input prints its one line only: the plan's lines wait until the run has started.)"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import warnings

import torch

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text
from rlhfkit.plan import GB, Plan, plan_for
from rlhfkit.plan.devices import device_matching, memory_device
from rlhfkit.plan.measure import LiveTensors, Measured, peak_rss_gb

logger = logging.getLogger("rlhfkit")


def launch_sharding() -> str:
    """How accelerate was told to split the state: its launch environment (FSDP, DeepSpeed's ZeRO stage)."""
    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "fsdp"
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        return {"2": "zero2", "3": "zero3"}.get(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", ""), "none")
    return "none"


def this_gpu():
    """The devices table's entry for this process's GPU, or None."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return device_matching(props.name, props.total_memory / GB)


class MemoryCheck:
    """Plans the run from its config (never failing it for a model the planner does not know: it says so instead),
    stops a GPU run that cannot fit, tracks what the run holds, and reports both at the end."""

    def __init__(self, cfg, stage: str, processes: int, main: bool):
        self.cfg, self.main = cfg, main
        self.gpu = torch.cuda.is_available() and not os.environ.get("ACCELERATE_USE_CPU")
        self.plan: Plan | None = None
        self.tracker: LiveTensors | None = None
        self.closed, self.total_steps = False, None
        free, device = (torch.cuda.mem_get_info()[0] / GB, this_gpu()) if self.gpu else (None, "cpu")
        try:
            if self.gpu:  # planned against the free memory, timed with the table's rates when it knows this GPU
                device = dataclasses.replace(device, memory_gb=free) if device is not None else memory_device(free)
            self.plan = plan_for(stage, cfg, device=device, processes=processes, sharding=launch_sharding(),
                                 suggest=self.gpu)
        except UserError as exc:
            logger.info("plan: not planned (%s)", exc)
            return
        if self.gpu and cfg.plan.check and self.plan.peak_gb > free * (1 + cfg.plan.margin):
            first = self.plan.suggestions[0].text if self.plan.suggestions else "a larger device"
            raise UserError(f"plan: the planned peak of {self.plan.peak_gb:.1f} GB per process exceeds the "
                            f"{free:.1f} GB free on this GPU by more than {cfg.plan.margin:.0%}; try {first} "
                            "(`rlhfkit plan` lists every change; plan.check=false runs anyway)")
        self.tracker = LiveTensors() if not self.gpu and cfg.plan.measure else None
        if self.tracker is not None:
            self.tracker.__enter__()
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()

    def started(self, total_steps: int) -> None:
        """The models are loaded: count the tensors no op made (weights read from files), and write plan.json."""
        self.total_steps = total_steps
        if self.tracker is not None:
            with warnings.catch_warnings():  # isinstance on torch's deprecated module aliases warns
                warnings.simplefilter("ignore")
                self.tracker.add(*(o for o in gc.get_objects() if isinstance(o, torch.Tensor)))
        if self.plan is not None and self.main:
            logger.info("%s", self.plan.summary())
            atomic_write_text(os.path.join(self.cfg.output_dir, "plan.json"),
                              json.dumps(self.plan.to_dict(), indent=1) + "\n")

    def peaks_at(self, step: int, metrics: dict) -> dict[str, float]:
        """The planned and measured peaks, to log with the training metrics of the last step (once)."""
        return self.close() if step == self.total_steps and metrics and not any(k.startswith("eval/") for k in metrics) else {}

    def measured(self) -> Measured:
        if self.gpu:
            return Measured(torch.cuda.max_memory_allocated() / GB, None, "torch.cuda.max_memory_allocated")
        peak = self.tracker.peak / GB if self.tracker is not None else None
        return Measured(peak, peak_rss_gb(), "live tensor storage (plan.measure)")

    def close(self, say: bool = True) -> dict[str, float]:
        """Stop tracking; the planned and measured peaks, the first time (none without a plan), also written into
        plan.json beside the plan (a run stopped before its last step logs them there only); `say`: also in a line
        (not for a run that failed, whose error is its last line)."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
        result = self.measured().metrics(self.plan.peak_gb) if self.plan is not None and not self.closed else {}
        self.tracker, self.closed = None, True
        if result and self.main and os.path.isfile(path := os.path.join(self.cfg.output_dir, "plan.json")):
            atomic_write_text(path, json.dumps({**self.plan.to_dict(), "measured": result}, indent=1) + "\n")
        if result and self.main and say:
            logger.info("memory: planned peak %.3f GB, measured %s", result["memory/planned_peak_gb"],
                        ", ".join(f"{k.split('/')[1]} {v:.3f} GB" for k, v in result.items() if k != "memory/planned_peak_gb"))
        return result
