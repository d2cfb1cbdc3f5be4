"""Each stage's effective config: its file or inline keys, the automatic wiring from the stages before it, its
overrides; validated as its own command validates it. The wiring is visible: every key it sets is a `Wire` naming the
stage it comes from, printed before the run and shown in the report.

The wiring (InstructGPT's three steps, Ouyang et al. 2022, arXiv 2203.02155, §3.1; 003 §1-§3):
- the SFT output initialises the reward model and every policy (`model.name_or_path`); with `iterations`, a round's
  policies start from the last kept round's policy, and its samples (`judge`, `label`) come from that policy;
- the newest reward model becomes `reward.model` of the online stages and of `eval`;
- the newest policy and its starting point (the reference) go to `eval` (`model.name_or_path`, `reference`, `run_dir`)
  and to a blind comparison (`label` with `mode: compare`: `model`, `compare`);
- the preference pairs of a `label` (collect) or `judge` stage become the next reward model's `data.train`; in a
  later round the reward model starts from the last round's and is extended on the round's new comparisons, or, with
  `retrain: true`, starts again from the SFT model (the init its config names when there is no SFT stage) and trains
  on every comparison so far, the pairs files joined in order into one (`output_dir/.pipeline/`);
- every stage writes to `output_dir/<name>` (later rounds: `output_dir/round_<r>/<name>`).
Precedence, later wins: the stage's config file, the wiring, its inline config keys, its overrides. An explicit key
(inline or an override) always beats the wiring; a config file is a template the wiring fills in.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.fields import MISSING, lookup, merge, read_yaml
from rlhfkit.errors import ConfigError, UserError
from rlhfkit.pipeline.spec import JUDGE, LABEL, PYTHON, StageSpec, nested

POLICY_STAGES = ("ppo", "rloo", "grpo", "reinforce_pp", "online_dpo", "dpo", "orpo", "kto", "rft")
REWARDED = ("ppo", "rloo", "grpo", "reinforce_pp", "online_dpo", "rft", "eval")  # stages whose reward.model is wired
PIPELINE_OWNED = ("overwrite", "resume")  # the pipeline decides these from the stage folder's state
LABEL_KEYS = ("mode", "prompts", "candidates", "num_samples", "seed", "batch_size", "max_prompts", "overlap", "host",
              "port", "token", "lease", "generation", "model", "compare", "poll_s", "allow_host", "annotators")
JUDGE_KEYS = ("model", "prompts", "num_samples", "seed", "batch_size", "max_prompts", "reward", "generation", "data")
PRIVATE = ".pipeline"  # the pipeline's own files under its output_dir (launched configs, joined comparisons)


@dataclass(frozen=True)
class Wire:
    """One key the pipeline set: `key` = `value`, from stage `source`."""

    key: str
    value: Any
    source: str
    parts: tuple[str, ...] = ()  # the files `value` joins, written when the stage runs (a retrained RM's comparisons)

    def __str__(self) -> str:
        return f"{self.key} <- {self.source} ({self.value})"


@dataclass
class Upstream:
    """What the stages so far produced, newest first in effect: each a (stage name, path)."""

    sft: tuple[str, str] | None = None
    rm: tuple[str, str] | None = None
    policy: tuple[str, str] | None = None  # the newest policy (what eval and a blind comparison judge)
    reference: tuple[str, str] | None = None  # the policy's starting point
    start: tuple[str, str] | None = None  # the policy a round starts from: the last kept round's (None: SFT)
    pairs: tuple[str, str] | None = None  # preference pairs (label collect, judge): the newest
    comparisons: tuple[tuple[str, str], ...] = ()  # every stage's pairs so far, in order (a retrained RM's data)
    fingerprint: str = ""  # the chain of every earlier stage's fingerprint

    def copy(self) -> "Upstream":
        return dataclasses.replace(self)


@dataclass(frozen=True)
class Resolved:
    """A stage ready to run: its kind, folder, effective config (`cfg`: the validated stage config, or a mapping for
    label, judge and python stages) and the wiring that went into it."""

    spec: StageSpec
    name: str  # the display name ("rm", "rm (round 2)")
    round: int
    dir: str
    cfg: Any
    data: dict  # the nested keys before validation: what the fingerprint hashes
    wires: tuple[Wire, ...] = field(default_factory=tuple)

    @property
    def stage(self) -> str:
        return self.spec.stage


def stage_dir(root: str, name: str, round_: int) -> str:
    return os.path.join(root, name) if round_ <= 1 else os.path.join(root, f"round_{round_}", name)


def private_file(root: str, out: str, suffix: str) -> str:
    """A file of the pipeline's own for the stage writing to `out`: `root/.pipeline/<its folder, flattened><suffix>`."""
    return os.path.join(root, PRIVATE, os.path.relpath(out, root).replace(os.sep, "_") + suffix)


def wires_for(spec: StageSpec, up: Upstream, root: str, out: str) -> list[Wire]:
    """The keys the pipeline sets for stage `spec` given what came before it (see the module's docstring)."""
    kind, w = spec.stage, [Wire("output_dir", out, "pipeline")] if spec.stage not in (LABEL, JUDGE, PYTHON) else []
    if kind == "rm":
        w += _rm_wires(spec, up, root, out)
    if kind in POLICY_STAGES and (up.start or up.sft):
        src = up.start or up.sft  # side-by-side policies all start from SFT; a later round's from the last kept one
        w.append(Wire("model.name_or_path", src[1], src[0]))
    if kind in REWARDED and kind != "eval" and up.rm:
        w.append(Wire("reward.model", [up.rm[1]], up.rm[0]))
    if kind == "eval":
        w += _eval_wires(up)
    if kind == LABEL:
        w += _label_wires(spec, up)
    if kind == JUDGE and (up.start or up.sft):
        src = up.start or up.sft
        w.append(Wire("model", src[1], src[0]))
    return w


def _rm_wires(spec: StageSpec, up: Upstream, root: str, out: str) -> list[Wire]:
    """Extend (default): a round's reward model starts from the last round's, on the newest pairs. Retrain: every
    round's starts from the SFT model, on every comparison so far (one file joining them when there are several)."""
    src = up.sft if spec.retrain or not (spec.round and up.rm) else up.rm
    w = [Wire("model.name_or_path", src[1], src[0])] if src else []
    if spec.retrain and len(up.comparisons) > 1:
        joined = private_file(root, out, "_comparisons.jsonl")
        w.append(Wire("data.train", joined, " + ".join(name for name, _ in up.comparisons),
                      tuple(path for _, path in up.comparisons)))
    elif up.pairs:
        w.append(Wire("data.train", up.pairs[1], up.pairs[0]))
    return w


def _eval_wires(up: Upstream) -> list[Wire]:
    w = []
    if up.policy:
        w += [Wire("model.name_or_path", up.policy[1], up.policy[0]), Wire("run_dir", up.policy[1], up.policy[0])]
        if up.reference:
            w.append(Wire("reference", up.reference[1], up.reference[0]))
    elif up.sft:
        w.append(Wire("model.name_or_path", up.sft[1], up.sft[0]))
    if up.rm:
        w.append(Wire("reward.model", [up.rm[1]], up.rm[0]))
    return w


def _label_wires(spec: StageSpec, up: Upstream) -> list[Wire]:
    mode = _inline(spec).get("mode", spec.overrides.get("mode", "collect"))
    src = up.start or up.sft
    if mode == "compare" and up.policy and up.reference:
        return [Wire("model", up.policy[1], up.policy[0]), Wire("compare", up.reference[1], up.reference[0])]
    return [Wire("model", src[1], src[0])] if src and mode == "collect" else []


def _inline(spec: StageSpec) -> dict:
    return spec.config if isinstance(spec.config, dict) else {}


def resolve(spec: StageSpec, up: Upstream, root: str, round_: int, where: str) -> Resolved:
    """Stage `spec`'s effective, validated config given `up`; a problem is one `ConfigError` naming `where` (the
    file and the stage) and the key."""
    out = stage_dir(root, spec.name, round_)
    name = spec.name if round_ <= 1 else f"{spec.name} (round {round_})"
    explicit = merge(_inline(spec), spec.overrides)
    owned = [k for k in PIPELINE_OWNED if k in explicit]
    if owned:
        raise ConfigError(f"{where}: config key '{owned[0]}': the pipeline sets it (a finished stage is skipped, an "
                          f"interrupted one resumed); use --from {spec.name} to rerun it")
    wires = [w for w in wires_for(spec, up, root, out) if lookup(explicit, w.key) is MISSING]
    try:
        base = read_yaml(spec.config) if isinstance(spec.config, str) else {}
        data = merge(merge(base, nested({w.key: w.value for w in wires})), explicit)
        cfg = _validate(spec, data, out)
    except UserError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if spec.stage not in (LABEL, JUDGE, PYTHON):
        out = cfg.output_dir
    return Resolved(spec, name, round_, out, cfg, data, tuple(wires))


def _validate(spec: StageSpec, data: dict, out: str) -> Any:
    """The stage's own validation: `rlhfkit <stage>`'s config; label and judge keys; a python stage's function."""
    from rlhfkit.stages import build_stage_config

    if spec.stage == PYTHON:
        return {"run": spec.run, "args": spec.args, "function": import_function(spec.run)}
    if spec.stage in (LABEL, JUDGE):
        known = LABEL_KEYS if spec.stage == LABEL else JUDGE_KEYS
        unknown = [k for k in data if k not in known]
        if unknown:
            raise ConfigError(f"config key '{unknown[0]}': not a {spec.stage} key (known: {', '.join(known)})")
        if spec.stage == LABEL and data.get("mode", "collect") not in ("collect", "compare"):
            raise ConfigError(f"config key 'mode': collect (preference pairs) or compare (a blind comparison), got "
                              f"{data.get('mode')!r}")
        if spec.stage == LABEL:
            from rlhfkit.label.command import check_serving

            check_serving(label_options(data, out))  # as `rlhfkit label` checks them, before anything runs
        needed = ("model", "prompts", "reward") if spec.stage == JUDGE else ()
        missing = [k for k in needed if not data.get(k)]
        if missing:
            raise ConfigError(f"config key '{missing[0]}' is required by a judge stage")
        return dict(data)
    return build_stage_config(spec.stage, data)


def label_options(cfg: dict, folder: str):
    """A label stage's keys as `rlhfkit label`'s options, its database in the stage's folder."""
    from rlhfkit.label.command import LabelOptions

    keys = {f.name for f in dataclasses.fields(LabelOptions)}
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in keys and k != "compare"}
    compare = cfg.get("compare") if cfg.get("mode") == "compare" else None
    overrides = tuple(f"generation.{k}={json.dumps(v)}" for k, v in (cfg.get("generation") or {}).items())
    return LabelOptions(db=os.path.join(folder, "labels.db"), compare=compare, overrides=overrides, **given)


def import_function(ref: str):
    module, _, name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"'run: {ref}' cannot be imported ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"'run: {ref}' is not a function")
    return fn


def produced(r: Resolved, up: Upstream) -> Upstream:
    """`up` after stage `r`: what later stages are wired to."""
    nxt = up.copy()
    if r.stage == "sft":
        nxt.sft = (r.name, r.dir)
    elif r.stage == "rm":
        nxt.rm = (r.name, r.dir)
    elif r.stage in POLICY_STAGES:
        nxt.policy = (r.name, r.dir)
        start = r.cfg.model.name_or_path
        nxt.reference = (_source_of(start, up, r.name), start)
    elif r.stage == JUDGE or r.stage == LABEL and r.cfg.get("mode", "collect") == "collect":
        nxt.pairs = (r.name, os.path.join(r.dir, "pairs.jsonl"))
        nxt.comparisons = (*up.comparisons, nxt.pairs)
    return nxt


def _source_of(path: str, up: Upstream, default: str) -> str:
    for entry in (up.policy, up.sft):
        if entry and entry[1] == path:
            return entry[0]
    return f"{default}'s model.name_or_path"
