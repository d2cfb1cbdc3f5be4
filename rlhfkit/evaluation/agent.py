"""The agent figures of an evaluation with tools (`rlhfkit eval` and the held-out evaluation during training), and the
gate an SFT model must pass before reward modelling: pure functions of the episodes a tool loop played
(`rollout.tool_loop`: their `ToolCounts` and TRL-shaped completions) and of a task judge's scores.

- Format accuracy: the share of assistant turns in the agent format. A turn is in it when it ended (EOS: a turn cut by
  the length limit is not), every tool call in it parsed (transformers' response parsing) and fits a tool of its
  episode (an exact name, arguments that fit the schema), and `agent.format_check`, when given, accepts it.
- Task completion: the share of episodes whose task-judge score reaches `agent.task_threshold`; an episode the judge
  returns None for is not judged and counts on neither side of the share.
- The tool figures: `types.ToolFigures`, the same object and definition training logs (a call is any call the policy
  made, malformed ones included; a failure a call without a result): calls and turns per episode, failures, malformed
  calls and timeouts per call, each tool's runs per episode.
- The gate (the agent recipe's rule before reward modelling): format accuracy >= `gate.format_accuracy` (0.95) and
  task completion >= `gate.task_completion` (0.80); undecided (None) when a figure is missing.

`agent.format_check` contract: `fn(message) -> bool`, called once per assistant turn with the turn as the loop parsed
it, TRL's message shape: {"role": "assistant", "content": str, "tool_calls": [{"type": "function", "function":
{"name": str, "arguments": dict}}]} ("tool_calls" only when the turn called a tool; a turn that does not parse is
{"role", "content"} with its raw text). True keeps the turn in the format; it never runs for a turn the loop already
found malformed. Whatever it raises stops the evaluation with one line naming it (it is the user's code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rlhfkit.errors import UserError, first_line
from rlhfkit.tools import import_ref
from rlhfkit.types import ToolCounts, ToolFigures


@dataclass(frozen=True)
class AgentFigures:
    """One model's agent figures over its episodes (counts, so that shares can be checked by hand)."""

    tools: ToolFigures  # what the episodes' tool calls did: training's definition (`ToolFigures`)
    formatted_turns: int  # of the assistant turns, those in the agent format
    judged: int  # episodes the task judge scored (0 without a judge)
    completed: int  # of them, episodes that reach the threshold

    @property
    def format_accuracy(self) -> float | None:
        return self.formatted_turns / self.tools.turns if self.tools.turns else None

    @property
    def task_completion(self) -> float | None:
        return self.completed / self.judged if self.judged else None

    def as_dict(self) -> dict:
        """eval.json's `agent.policy` / `agent.reference`: the two shares, the tool figures (`ToolFigures.as_dict`)
        and the counts."""
        t = self.tools
        return {"format_accuracy": self.format_accuracy, "task_completion": self.task_completion, **t.as_dict(),
                "episodes": t.episodes, "turns": t.turns, "calls": t.calls, "failures": t.failures,
                "malformed": t.malformed, "formatted_turns": self.formatted_turns, "judged": self.judged,
                "completed": self.completed}


def turn_formats(completions, well_formed, format_check: Callable | None = None) -> list[list[bool]]:
    """Per episode, per assistant turn: whether it is in the agent format (module docstring). `completions`: each
    episode's messages; `well_formed`: each episode's per-turn flags from the loop (`ToolCounts.well_formed`), one
    per assistant message."""
    out = []
    for i, (messages, flags) in enumerate(zip(completions, well_formed, strict=True)):
        turns = [m for m in messages if m.get("role") == "assistant"]
        if len(turns) != len(flags):
            raise ValueError(f"episode {i}: {len(turns)} assistant messages for {len(flags)} turn flags")
        out.append([bool(ok) and (format_check is None or _accepts(format_check, m)) for m, ok in zip(turns, flags)])
    return out


def _accepts(format_check: Callable, message: dict) -> bool:
    name = getattr(format_check, "__name__", repr(format_check))
    try:
        verdict = format_check(message)
    except Exception as exc:  # noqa: BLE001 - the user's rule failed on a model's turn: its code to fix
        raise UserError(f"agent.format_check '{name}' raised on an assistant turn ({first_line(exc, with_type=True)}); "
                        "it must return True or False for any message") from None
    if not isinstance(verdict, bool):
        raise UserError(f"agent.format_check '{name}' returned {type(verdict).__name__} {verdict!r}; it must return "
                        "True or False")
    return verdict


def agent_figures(counts: ToolCounts, completions, task_scores: list | None = None, threshold: float = 1.0,
                  format_check: Callable | None = None) -> AgentFigures:
    """The figures of B episodes: their tool counts, completions (message lists), the task judge's B scores (None per
    row it does not judge; no list without a judge), the pass threshold and the user's format rule."""
    formats = turn_formats(completions, counts.well_formed, format_check)
    scores = [s for s in (task_scores or []) if s is not None]
    return AgentFigures(tools=ToolFigures.of(counts), formatted_turns=sum(map(sum, formats)), judged=len(scores),
                        completed=sum(s >= threshold for s in scores))


def gate(format_accuracy: float | None, task_completion: float | None, min_format_accuracy: float,
         min_task_completion: float) -> dict:
    """eval.json's `gate`: the policy's two figures against their thresholds, and `passed` (None when a figure is
    missing: no turns, or no task judge)."""
    checks = {"format_accuracy": (format_accuracy, min_format_accuracy),
              "task_completion": (task_completion, min_task_completion)}
    out = {name: {"value": value, "threshold": threshold, "passed": None if value is None else value >= threshold}
           for name, (value, threshold) in checks.items()}
    verdicts = [c["passed"] for c in out.values()]
    out["passed"] = None if None in verdicts else all(verdicts)
    return out


def gate_lines(section: dict) -> list[str]:
    """The console's gate line."""
    def part(name: str, label: str) -> str:
        c = section[name]
        value = "-" if c["value"] is None else f"{c['value']:.3g}"
        return f"{label} {value} (>= {c['threshold']:.3g})"

    verdict = {True: "PASSED", False: "NOT PASSED", None: "UNDECIDED"}[section["passed"]]
    return [f"gate before reward modelling: {verdict}: {part('format_accuracy', 'format accuracy')}, "
            f"{part('task_completion', 'task completion')}"]


def load_format_check(ref: str | None, key: str = "agent.format_check") -> Callable | None:
    """The `module:function` of `agent.format_check`, imported (one line naming the key when it cannot be)."""
    if ref is None:
        return None
    fn = import_ref(ref, f"config key '{key}' '{ref}'", "function")
    if not callable(fn):
        raise UserError(f"config key '{key}' '{ref}' is not callable: give a function fn(message) -> bool")
    return fn


@dataclass(frozen=True)
class AgentOptions:
    """What an evaluation's agent figures use beyond the episodes: the user's format rule, the task judge's name
    (one of the evaluation's judges) and its pass threshold."""

    format_check: Callable | None = None
    task_judge: str | None = None
    task_threshold: float = 1.0

    def check_judge(self, judges) -> None:
        """A one-line UserError when `task_judge` names none of `judges` (name -> judge)."""
        if self.task_judge is not None and self.task_judge not in judges:
            raise UserError(f"config key 'agent.task_judge' '{self.task_judge}' names no judge of this evaluation "
                            f"(judges: {', '.join(judges) or 'none'}); name a reward function, a judges entry or reward_model")

    def figures(self, counts: ToolCounts, completions, scores: dict[str, list]) -> AgentFigures:
        """One model's figures; `scores`: judge name -> its scores of the episodes."""
        if self.task_judge is not None and self.task_judge not in scores:
            raise UserError(f"config key 'agent.task_judge' '{self.task_judge}' names none of the scores "
                            f"({', '.join(scores) or 'none'}): name a reward source (or gold, reward.gold_function)")
        task = scores[self.task_judge] if self.task_judge is not None else None
        return agent_figures(counts, completions, task, self.task_threshold, self.format_check)

    def section(self, policy, reference) -> dict:
        """eval.json's `agent`: each side's figures (`policy` / `reference`: a model's episodes, `samples.Samples`:
        their tool counts, completions and judges' scores; reference None without one) and what they were measured
        with."""
        check = self.format_check
        side = lambda s: self.figures(s.tools, s.completions, s.scores).as_dict()  # noqa: E731
        return {"format_check": None if check is None else f"{check.__module__}:{check.__qualname__}",
                "task_judge": self.task_judge, "task_threshold": self.task_threshold if self.task_judge else None,
                "policy": side(policy), "reference": side(reference) if reference is not None else None}
