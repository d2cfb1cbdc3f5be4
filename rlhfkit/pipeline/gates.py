"""The gates between stages: a figure a stage reported against a condition, with the seeds' defaults and what the
seeds suggest when one fails.

The defaults (each settable per stage with `gate: {figure: condition}`, a figure dropped with null, the gate removed
with `gate: false`):
- after SFT: the held-out loss is reported (`eval/loss`; give data.eval): 003 §2 evaluates SFT strictly before RM;
- after an `eval` of an SFT model with tools: format accuracy >= 0.95 and task completion >= 0.80 (003 §2), the
  thresholds of the eval stage's own `gate` section;
- after the reward model: held-out accuracy >= 0.70 (the usable-RM bar the issue quotes from the seeds' tuning guides);
- after an `eval` of a policy: the win rate against its reference (SFT) >= 0.60 by every judge (003 §7,
  "目标: >60%"),
  and no reward-hacking alarm (003 Q3);
- after a blind human comparison (`label`, mode compare): the human win rate's 95% interval above 0.5 (003 §7).
A figure is matched by name; `win_rate/*` matches every judge's.
"""

from __future__ import annotations

import fnmatch
import math
import operator
import re
from dataclasses import dataclass

from rlhfkit.errors import ConfigError, UserError

_CONDITION = re.compile(r"^\s*(>=|<=|==|>|<)\s*(-?[0-9.eE+-]+)\s*$")
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}
REPORTED = "reported"

# What the seeds suggest trying when a gate's figure fails (003_c02c45015bf5c27e.txt, 002_e43368e7d31954cf.txt).
SUGGESTIONS = {
    "eval/loss": "give SFT held-out data (data.eval or data.eval_fraction): the seeds evaluate SFT strictly before "
                 "the reward model, which learns on SFT's samples (003 §2)",
    "agent/format_accuracy": "more or cleaner tool-using demonstrations, or more SFT epochs: the seeds ask 95% format "
                             "accuracy before RM training, since the RM learns on SFT's samples (003 §2)",
    "agent/task_completion": "more demonstrations of the task solved, or more SFT epochs: the seeds ask 80% task "
                             "completion before RM training (003 §2)",
    "eval/accuracy": "more and more varied preference data (003 Q4: 10k-100k pairs, diversity over quantity: prompts "
                     "of every domain, difficulty and length), a lower reward-model learning rate (optim.lr), or "
                     "check the labels' agreement (rlhfkit label --figures)",
    "win_rate/*": "a larger KL coefficient (kl.coef; 003 §4: beta 0.05-0.2, adaptive) if the reward model is being "
                  "gamed, a better reward model (more varied preference data), or more policy steps",
    "alarms": "reward hacking (003 Q3): raise kl.coef (0.1 -> 0.2), judge with an evaluation reward model independent "
              "of the trained one, and watch length and diversity",
    "human/win_rate_low": "people do not prefer the policy (003 §7: RM reward up but human win rate down is reward "
                          "hacking): raise kl.coef, improve the reward model with more varied preference data",
    "alignment_tax/delta_nats": "003 Q8: a larger KL coefficient (0.1 -> 0.2), general data mixed into the policy's "
                                "training (algo.ptx_coef, data.ptx), or DPO, whose implicit KL constraint is stronger",
}


@dataclass(frozen=True)
class Verdict:
    """One figure of a gate against its condition."""

    stage: str
    figure: str
    value: float | None  # None: the stage did not report it
    condition: str
    passed: bool

    @property
    def suggestion(self) -> str:
        for pattern, text in SUGGESTIONS.items():
            if fnmatch.fnmatchcase(self.figure, pattern):
                return text
        return "see docs/pipeline.md, Gates"

    def line(self) -> str:
        shown = "not reported" if self.value is None else f"{self.value:.4g}"
        state = "passed" if self.passed else "FAILED"
        return f"gate after '{self.stage}' {state}: {self.figure} = {shown}, needs {self.condition}"


class GateFailed(UserError):
    """A gate stopped the pipeline (exit status 3: the input was fine, a stage's result was not)."""


def parse_condition(text: str, where: str) -> tuple[str, float | None]:
    if text.strip() == REPORTED:
        return REPORTED, None
    m = _CONDITION.match(text)
    if not m:
        raise ConfigError(f"{where}: gate condition {text!r}: expected '>= 0.7', '> 0.5', '<= 2', '== 0' or 'reported'")
    return m.group(1), float(m.group(2))


def default_gate(stage: str, cfg, evaluates_policy: bool) -> dict[str, str]:
    """The seeds' gate after a stage of kind `stage` (see the module's docstring); `evaluates_policy`: an eval whose
    policy is a trained policy (not the SFT model)."""
    if stage == "sft":
        return {"eval/loss": REPORTED}
    if stage == "rm":
        return {"eval/accuracy": ">= 0.70"}
    if stage == "eval" and evaluates_policy:
        return {"win_rate/*": ">= 0.60", "alarms": "== 0"}
    if stage == "eval" and (cfg.tools.functions or cfg.tools.environment):
        return {"agent/format_accuracy": f">= {cfg.gate.format_accuracy}",
                "agent/task_completion": f">= {cfg.gate.task_completion}"}
    if stage == "label" and cfg.get("mode") == "compare":
        return {"human/win_rate_low": "> 0.5"}
    return {}


def effective_gate(default: dict[str, str], given: dict | bool | None, where: str) -> dict[str, str]:
    """The default, replaced figure by figure by the file's `gate` (null drops a figure; false drops the gate)."""
    if given is False:
        return {}
    gate = dict(default)
    for figure, condition in (given or {}).items():
        if condition is None:
            gate.pop(figure, None)
        else:
            gate[figure] = condition
    for figure, condition in gate.items():
        parse_condition(condition, f"{where}: gate '{figure}'")
    return gate


def check(stage: str, gate: dict[str, str], figures: dict[str, float]) -> list[Verdict]:
    """Every figure of `gate` against `figures` (a pattern: every matching figure; none matching fails)."""
    out = []
    for pattern, condition in gate.items():
        op, threshold = parse_condition(condition, stage)
        names = sorted(k for k in figures if fnmatch.fnmatchcase(k, pattern)) or [pattern]
        for name in names:
            value = figures.get(name)
            ok = value is not None and math.isfinite(value) and (op == REPORTED or _OPS[op](value, threshold))
            out.append(Verdict(stage, name, value, condition, ok))
    return out
