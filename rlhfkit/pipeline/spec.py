"""A pipeline file, read and checked whole before anything runs: its stages in order, each with its stage, config,
overrides, launch, gate and round membership; `vars` substituted; `key=value` overrides from the command line.

The file (docs/pipeline.md has the reference):

    output_dir: runs/my_pipeline
    vars: {model: HuggingFaceTB/SmolLM2-135M-Instruct}   # `${model}` anywhere in a stage's config, overrides or args;
                                                         # `${output_dir}` is the pipeline's folder
    variants: {small: {model: tiny}}                     # `variant=small` on the command line: these vars win
    device: H100-80GB                                    # every stage planned for it first (or memory_gb: 24)
    iterations: 1                                        # > 1 repeats the stages marked `round: true`
    capability: {data: general.jsonl, max_loss_nats: 0.05}   # the check after each round (iterations > 1)
    stages:
      - stage: sft                 # any `rlhfkit` stage, `label`, `judge`, or `python` (a function of a built-in task)
        name: sft                  # its folder under output_dir and its name in overrides (default: the stage)
        config: configs/sft.yaml   # a YAML file, or the keys inline as a mapping
        overrides: {max_steps: 100}  # applied last: an explicit key here beats the automatic wiring
        launch: [--num_processes, "2"]   # run under `accelerate launch` with these arguments
        gate: {"eval/loss": "<= 2.0"}    # replaces the default gate's figures; `gate: false` removes it
        round: true                # repeated by `iterations`; an `rm` here with `retrain: true` starts each round
                                   # from SFT on every comparison so far (default: extends the last round's)

Command-line overrides: `variant=NAME`, `output_dir=DIR`, `iterations=N`, `device=NAME`, `memory_gb=GB`,
`vars.NAME=VALUE`, `NAME.key.sub=VALUE` (into stage NAME's overrides), `NAME.gate.FIGURE=CONDITION` and
`NAME.retrain=true`. A problem is one `ConfigError` naming the file, the stage and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.fields import merge, parse_overrides, read_yaml
from rlhfkit.errors import ConfigError

# The stages a pipeline runs besides the `rlhfkit` training and evaluation stages (`rlhfkit.stages.STAGES`).
LABEL, JUDGE, PYTHON = "label", "judge", "python"
TOP_KEYS = ("output_dir", "vars", "variants", "iterations", "capability", "device", "memory_gb", "stages")
STAGE_KEYS = ("stage", "name", "config", "overrides", "launch", "gate", "round", "retrain", "enabled", "run", "args")
CAPABILITY_KEYS = ("data", "max_loss_nats", "config")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class StageSpec:
    """One stage as the file gives it: `config` is a path (str), a mapping (inline keys) or None."""

    index: int  # 1-based position in the file (error messages say "stage 4")
    name: str
    stage: str
    config: str | dict | None = None
    overrides: dict = field(default_factory=dict)  # nested keys, as `parse_overrides` makes them
    launch: tuple[str, ...] | None = None  # `accelerate launch` arguments; None: in this process
    gate: dict[str, str] | bool | None = None  # None: the default gate; False: none; a mapping: figure -> condition
    round: bool = False  # repeated by `iterations`
    # A reward model in the round block: False extends the last round's on the round's new comparisons; True trains
    # each round from the SFT model (or the init its config names) on every comparison so far.
    retrain: bool = False
    run: str | None = None  # `python` stages: "module:function"
    args: dict = field(default_factory=dict)  # `python` stages: the function's keyword arguments

    @property
    def where(self) -> str:
        return f"stage {self.index} ({self.name})"


@dataclass(frozen=True)
class Capability:
    """The check after each round: the alignment tax of the round's policy against the previous round's on `data`."""

    data: str
    max_loss_nats: float = 0.05  # a round whose per-token NLL grows by more than this is rolled back
    config: dict = field(default_factory=dict)  # more `rlhfkit eval` keys (data.max_length, batch_size, ...)


@dataclass(frozen=True)
class PipelineSpec:
    path: str  # the file (in messages)
    output_dir: str
    stages: tuple[StageSpec, ...]
    iterations: int = 1
    capability: Capability | None = None
    vars: dict = field(default_factory=dict)
    device: str | None = None  # where the stages are planned to run (`rlhfkit.plan`'s devices table)
    memory_gb: float | None = None  # or a device known by its memory alone

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise ConfigError(f"{self.path}: no stage named '{name}' (stages: {', '.join(s.name for s in self.stages)})")


def read_spec(path: str, overrides: list[str] | tuple[str, ...] = (), data: dict | None = None) -> PipelineSpec:
    """The pipeline in the YAML file `path` (or the mapping `data`, named `path` in messages) with the command line's
    `overrides` applied; every stage's own keys are checked later, against its stage (`plan_pipeline`)."""
    raw = dict(data) if data is not None else read_yaml(path)
    rest = [o for o in overrides if not o.startswith("variant=")]
    raw = _apply_overrides(_with_variant(raw, list(overrides), path), rest, path)
    unknown = [k for k in raw if k not in TOP_KEYS and not str(k).startswith("x-")]  # x-*: YAML anchors' holders
    if unknown:
        raise ConfigError(f"{path}: unknown key '{unknown[0]}' (known: {', '.join(TOP_KEYS)})")
    variables = raw.get("vars") or {}
    if not isinstance(variables, dict):
        raise ConfigError(f"{path}: 'vars' must be a mapping of names to values")
    # `${output_dir}`: the pipeline's folder, for a stage that reads a file an earlier `python` stage wrote
    variables = {**variables, "output_dir": substitute(raw.get("output_dir"), variables, f"{path}: output_dir")}
    entries = raw.get("stages")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: 'stages' must be a non-empty list of stages")
    stages = tuple(s for s in (_stage(path, i + 1, e, variables) for i, e in enumerate(entries)) if s is not None)
    seen: set[str] = set()
    for s in stages:
        if s.name in seen:
            raise ConfigError(f"{path}: {s.where}: the name '{s.name}' is used twice; give each stage its own `name`")
        seen.add(s.name)
    output_dir = substitute(raw.get("output_dir"), variables, f"{path}: output_dir")
    if not isinstance(output_dir, str) or not output_dir:
        raise ConfigError(f"{path}: 'output_dir' is required (the folder every stage's outputs go under)")
    iterations = raw.get("iterations", 1)
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ConfigError(f"{path}: 'iterations' must be an integer >= 1, got {iterations!r}")
    if iterations > 1 and not any(s.round for s in stages):
        raise ConfigError(f"{path}: iterations: {iterations} repeats the stages marked `round: true`, and none is")
    device, memory = raw.get("device"), raw.get("memory_gb")
    if device is not None and not isinstance(device, str) or memory is not None and (
            not isinstance(memory, (int, float)) or isinstance(memory, bool) or memory <= 0):
        raise ConfigError(f"{path}: 'device' must be a device's name (rlhfkit plan's table) and 'memory_gb' a positive "
                          "number")
    return PipelineSpec(path, output_dir, stages, iterations, _capability(path, raw.get("capability"), variables),
                        variables, device, float(memory) if memory is not None else None)


def _with_variant(raw: dict, overrides: list[str], path: str) -> dict:
    """`variant=NAME` on the command line: the file's `variants[NAME]` (a mapping of vars) over its `vars`, before the
    command line's own `vars.X=` (which win)."""
    chosen = [o.partition("=")[2] for o in overrides if o.startswith("variant=")]
    variants = raw.pop("variants", None) or {}
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        raise ConfigError(f"{path}: 'variants' must map each variant's name to a mapping of vars")
    if not chosen:
        return raw
    if chosen[-1] not in variants:
        raise ConfigError(f"variant={chosen[-1]}: {path} has no such variant (variants: "
                          f"{', '.join(variants) or 'none'})")
    return {**raw, "vars": merge(raw.get("vars") or {}, variants[chosen[-1]])}


def _apply_overrides(raw: dict, overrides: list[str], path: str) -> dict:
    """`output_dir=`, `iterations=`, `vars.X=` at the top; `NAME.key=` into stage NAME's overrides; `NAME.gate.F=` into
    its gate."""
    tree = parse_overrides(overrides)
    stages = [dict(s) if isinstance(s, dict) else s for s in raw.get("stages") or []]
    by_name = {(s.get("name") or s.get("stage")): s for s in stages if isinstance(s, dict)}
    for key, value in tree.items():
        if key in ("output_dir", "iterations", "vars", "capability", "device", "memory_gb"):
            raw = merge(raw, {key: value})
        elif key in by_name and isinstance(value, dict):
            entry = by_name[key]
            if "gate" in value:
                gate = value.pop("gate")
                entry["gate"] = merge(entry.get("gate") or {}, gate) if isinstance(gate, dict) else gate
            if "retrain" in value:
                entry["retrain"] = value.pop("retrain")
            if value:
                entry["overrides"] = merge(_as_tree(entry.get("overrides"), path, key), value)
        else:
            raise ConfigError(f"override '{key}': expected output_dir=, iterations=, vars.NAME= or STAGE.key= with a "
                              f"stage of {path} ({', '.join(by_name)})")
    return {**raw, "stages": stages} if stages else raw


def _as_tree(overrides: Any, path: str, where: str) -> dict:
    if overrides is None:
        return {}
    if isinstance(overrides, dict):
        return nested(overrides)
    if isinstance(overrides, list) and all(isinstance(o, str) for o in overrides):
        return parse_overrides(overrides)
    raise ConfigError(f"{path}: {where}: 'overrides' must be a mapping of keys or a list of 'key.sub=value' strings")


def nested(mapping: dict) -> dict:
    """Dotted keys as nested mappings (inline config keys, overrides, the wiring):
    `{"optim.lr": 1e-3, "model": {"lora.r": 8}}` -> `{"optim": {"lr": 1e-3}, "model": {"lora": {"r": 8}}}`."""
    out: dict = {}
    for key, value in mapping.items():
        value = nested(value) if isinstance(value, dict) else value
        *parents, last = str(key).split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = merge(node[last], value) if isinstance(node.get(last), dict) and isinstance(value, dict) else value
    return out


def substitute(value: Any, variables: dict, where: str) -> Any:
    """`${name}` replaced by `vars[name]`: a string that is exactly one reference takes the value itself (a number, a
    list, a mapping); inside a longer string, its text."""
    if isinstance(value, dict):
        return {k: substitute(v, variables, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, variables, where) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value
    for name in _VAR.findall(value):
        if name not in variables:
            raise ConfigError(f"{where}: '${{{name}}}' is not in vars (known: {', '.join(variables) or 'none'})")
    whole = _VAR.fullmatch(value)
    if whole:
        return variables[whole.group(1)]
    return _VAR.sub(lambda m: str(variables[m.group(1)]), value)


def _stage(path: str, index: int, entry: Any, variables: dict) -> StageSpec | None:
    """One entry of `stages`, checked (its stage's own keys are checked later); None when `enabled` is false."""
    from rlhfkit.stages import STAGES

    where = f"{path}: stage {index}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping with at least `stage:`, got {type(entry).__name__}")
    entry = substitute(entry, variables, where)
    unknown = [k for k in entry if k not in STAGE_KEYS]
    if unknown:
        raise ConfigError(f"{where}: unknown key '{unknown[0]}' (known: {', '.join(STAGE_KEYS)})")
    stage = entry.get("stage")
    kinds = (*STAGES, LABEL, JUDGE, PYTHON)
    if stage not in kinds:
        raise ConfigError(f"{where}: 'stage' must be one of {', '.join(kinds)}, got {stage!r}")
    name = entry.get("name", stage)
    where = f"{path}: stage {index} ({name})"
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: 'name' must be a word (letters, digits, _), got {name!r}")
    enabled = entry.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}: 'enabled' must be true or false, got {enabled!r}")
    if not enabled:
        return None
    config = entry.get("config")
    if config is not None and not isinstance(config, (str, dict)):
        raise ConfigError(f"{where}: 'config' must be a YAML file's path or a mapping of keys")
    launch = entry.get("launch")
    if launch is not None and not (isinstance(launch, list) and all(isinstance(a, (str, int)) for a in launch)):
        raise ConfigError(f"{where}: 'launch' must be a list of `accelerate launch` arguments, e.g. "
                          "[--num_processes, 2]")
    if launch is not None and stage in (LABEL, JUDGE, PYTHON):
        raise ConfigError(f"{where}: 'launch' runs an `rlhfkit` training or eval stage under accelerate; {stage} "
                          "runs here")
    gate = entry.get("gate")
    if gate is not None and gate is not False and not (isinstance(gate, dict) and all(
            v is None or isinstance(v, str) for v in gate.values())):
        raise ConfigError(f"{where}: 'gate' must be false or a mapping of figure -> condition ('>= 0.7'; null "
                          "drops it)")
    if gate is True:
        gate = None
    run, args = entry.get("run"), entry.get("args") or {}
    if (stage == PYTHON) != (run is not None):
        raise ConfigError(f"{where}: 'run: module:function' " + ("is required by a python stage" if stage == PYTHON
                                                                  else f"applies to python stages, not {stage}"))
    if run is not None and (not isinstance(run, str) or ":" not in run):
        raise ConfigError(f"{where}: 'run' must be 'module:function', got {run!r}")
    if not isinstance(args, dict):
        raise ConfigError(f"{where}: 'args' must be a mapping of keyword arguments")
    round_ = entry.get("round", False)
    if not isinstance(round_, bool):
        raise ConfigError(f"{where}: 'round' must be true or false")
    retrain = entry.get("retrain", False)
    if not isinstance(retrain, bool):
        raise ConfigError(f"{where}: 'retrain' must be true or false, got {retrain!r}")
    if retrain and not (stage == "rm" and round_):
        raise ConfigError(f"{where}: 'retrain' applies to an `rm` stage marked `round: true` (how its reward model "
                          "starts each round), not to this one")
    config = nested(config) if isinstance(config, dict) else config  # inline keys may be dotted, as overrides
    return StageSpec(index, name, stage, config, _as_tree(entry.get("overrides"), path, f"stage {index} ({name})"),
                     tuple(str(a) for a in launch) if launch is not None else None, gate, round_, retrain, run, args)


def _capability(path: str, raw: Any, variables: dict) -> Capability | None:
    if raw is None:
        return None
    raw = substitute(raw, variables, f"{path}: capability")
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), str):
        raise ConfigError(f"{path}: 'capability' must be a mapping with `data:` (reference texts in any SFT format)")
    unknown = [k for k in raw if k not in CAPABILITY_KEYS]
    if unknown:
        raise ConfigError(f"{path}: capability: unknown key '{unknown[0]}' (known: {', '.join(CAPABILITY_KEYS)})")
    bound = raw.get("max_loss_nats", 0.05)
    if not isinstance(bound, (int, float)) or isinstance(bound, bool) or bound < 0:
        raise ConfigError(f"{path}: capability.max_loss_nats must be a number >= 0, got {bound!r}")
    config = raw.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: capability.config must be a mapping of `rlhfkit eval` keys")
    return Capability(raw["data"], float(bound), nested(config))
