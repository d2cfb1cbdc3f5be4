"""Python reward functions under TRL's calling contract, and the pure arithmetic that combines several reward sources.

A reward function (`reward.function`, `reward.gold_function`, eval `judges`, or a callable given from Python) is
called once per rollout batch, for all B rows at once, with keywords only, as TRL's `GRPOTrainer` calls it:

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., **every other dataset column)
        -> B values (a list, tuple, 1-D tensor or array), higher is better; None for a row it does not apply to

- prompts: each row's prompt as the dataset holds it: a string, or (conversational data) its list of messages.
- completions: each row's response text, special tokens dropped; on conversational data the one-message list
  `[{"role": "assistant", "content": text}]`, as TRL gives it.
- completion_ids: each row's response token ids (the policy's), up to and including EOS.
- every other field of the prompt records (e.g. `solution`, test cases), as a list over the rows (None for a row
  whose record lacks it); as in TRL, a record's own `completion` and `completion_ids` fields are not passed.
- trainer_state: a `transformers.TrainerState` (`global_step` = optimizer steps done, `max_steps`) in training and in
  the evaluations during training, for rewards that change with progress; in `rlhfkit eval` a fresh one (step 0).

Unlike TRL, a function is given only the keywords it accepts (it names them, or takes `**kwargs`), so rlhfkit's
older `fn(prompts, completions)` functions keep working. An `async def` function is awaited. As TRL 1.16, it also
offers `log_extra(column, values)` and `log_metric(name, value)` (`RewardLogs`): a metric is logged under its name at the step
(eval/<name> in an evaluation during training), an extra column joins the rows of samples.jsonl and the trackers'
completions table; `rlhfkit eval` puts them in eval.json (each side's "logged", each sample's "extra").

None means "does not apply to this row" (TRL: NaN, dropped by `nansum`). Unlike TRL, a NaN the function returns
itself is not dropped: it passes through to the total, where the trainer counts the step as non-finite.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlhfkit.errors import UserError, first_line
from rlhfkit.tools import awaited

logger = logging.getLogger("rlhfkit")

CONTRACT_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")


class RewardLogs:
    """What reward functions log through TRL's two hooks, kept until the trainer takes them (`take`) after a step's
    scoring: `log_metric(name, value)` appends a scalar (the step logs the mean of its values, over every process, under
    `name`), `log_extra(column, values)` one value per row of the call (a column of the completions table)."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(str(name), []).append(float(value))

    def log_extra(self, column: str, values) -> None:
        self.extras.setdefault(str(column), []).extend(list(values))

    def take(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        """(metric name -> values, column -> values per row) logged since the last take; both emptied."""
        taken = self.metrics, self.extras
        self.metrics, self.extras = {}, {}
        return taken


def extra_columns(extras: dict[str, list], i: int) -> dict:
    """Row `i`'s values of the `log_extra` columns (those that have one for it)."""
    return {column: values[i] for column, values in extras.items() if i < len(values)}


@dataclass(frozen=True)
class RewardInputs:
    """What every reward function of one call sees, row i of each list being rollout row i (B rows)."""

    prompts: list  # (B,) strings, or message lists
    completions: list  # (B,) strings, or [{"role": "assistant", "content": text}]
    completion_ids: list[list[int]]  # (B,) each row's response ids, EOS included
    columns: dict[str, list] = field(default_factory=dict)  # every other record field -> (B,) values
    trainer_state: Any = None  # transformers.TrainerState (None when a caller has none)
    logs: RewardLogs | None = None  # where `log_metric` and `log_extra` write (None: the hooks are not offered)
    environments: list | None = None  # (B,) each episode's environment (`environment_factory`); None: not passed

    def keywords(self) -> dict[str, Any]:
        hooks = {"log_metric": self.logs.log_metric, "log_extra": self.logs.log_extra} if self.logs is not None else {}
        envs = {"environments": self.environments} if self.environments is not None else {}
        return {**self.columns, "prompts": self.prompts, "completions": self.completions,
                "completion_ids": self.completion_ids, "trainer_state": self.trainer_state, **hooks, **envs}


def completion_text(completion) -> str:
    """The text of one completion: the string itself, or the content of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


class RewardFunction:
    """A Python reward function under TRL's contract (module docstring), named `name` in metrics and `label` in
    errors. Calling it gives one float per row, None where the function returned None.

    An exception the function raises, a return value that is not one number (or None) per row, and a required
    argument no record field supplies each end the run with one line that names the function.
    """

    def __init__(self, fn, label: str, name: str | None = None):
        self.fn = fn
        self.label = label
        self.name = name or getattr(fn, "__name__", None) or type(fn).__name__
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: all keywords
            params = []
        self.any_keyword = not params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        named = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        self.keywords = {p.name for p in named}
        self.required = [p.name for p in named if p.default is inspect.Parameter.empty]
        positional_only = [p.name for p in params if p.kind == inspect.Parameter.POSITIONAL_ONLY]
        if positional_only:
            raise UserError(f"{label} takes positional-only arguments ({', '.join(positional_only)}): reward "
                            "functions are called with keywords (prompts=, completions=, ...)")

    def __call__(self, inputs: RewardInputs) -> list[float | None]:
        """One float per row of `inputs`, None where the function returned None (it does not apply to the row)."""
        available = inputs.keywords()
        for name in self.required:
            if name not in available:
                fields = ", ".join(sorted(inputs.columns)) or "none"
                raise UserError(f"{self.label} takes an argument '{name}', but the prompt records have no field "
                                f"'{name}' (fields: {fields})")
        kwargs = {k: v for k, v in available.items() if self.any_keyword or k in self.keywords}
        try:
            value = awaited(self.fn(**kwargs))
        except UserError:
            raise
        except Exception as exc:  # the user's code failed: name it and where, on one line
            raise UserError(f"{self.label} raised {first_line(exc, with_type=True)}{_where(exc)}") from None
        return _as_scores(value, len(inputs.completions), self.label)

    def score(self, rollout, inputs: RewardInputs) -> tuple[Tensor, Tensor]:
        """As a reward source (`rewards.RewardSource`): (B,) fp32 scores on the rollout's device, NaN where the function
        returned None, and (B,) bool where it did not."""
        raw = self(inputs)
        device = rollout.response_ids.device
        values = torch.tensor([math.nan if v is None else v for v in raw], dtype=torch.float32, device=device)
        return values, torch.tensor([v is not None for v in raw], device=device)


def trainer_state(global_step: int, max_steps: int):
    """The `trainer_state` reward functions receive in training: a `transformers.TrainerState`."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps)


def load_reward_function(ref: str, key: str = "reward.function") -> RewardFunction:
    """Import the function `ref` = "module:function", named in errors as `key` (its config key), with
    `tools.import_ref` (the working directory importable while the module imports: load configs you trust)."""
    from rlhfkit.tools import import_ref

    label = f"{key} '{ref}'"
    module_name, _, name = ref.partition(":")
    fn = import_ref(ref, label, "function")
    if not callable(fn):
        raise UserError(f"{label}: module '{module_name}' has no function '{name}'")
    return RewardFunction(fn, label, name)


def _as_scores(value, n: int, label: str) -> list[float | None]:
    """`value` as n python floats (or None), or a UserError saying what it was instead."""
    expected = f"expected a list of {n} numbers (one per completion)"
    if hasattr(value, "shape") and hasattr(value, "tolist"):  # a tensor or an array
        if len(value.shape) != 1 or value.shape[0] != n:
            raise UserError(f"{label} returned a {type(value).__name__} of shape {tuple(value.shape)}, expected shape ({n},)")
        items = value.tolist()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif value is None:
        raise UserError(f"{label} returned None, {expected}")
    else:
        raise UserError(f"{label} returned a {type(value).__name__} ({_short(value)}), {expected}")
    if len(items) != n:
        raise UserError(f"{label} returned a {type(value).__name__} of {len(items)} values, expected {n} (one per completion)")
    scores = []
    for i, v in enumerate(items):
        if hasattr(v, "shape") and hasattr(v, "item") and len(v.shape) == 0:  # a 0-d tensor or numpy scalar
            v = v.item()
        if v is None:
            scores.append(None)  # does not apply to this row
            continue
        if not isinstance(v, numbers.Real):
            raise UserError(f"{label} returned a non-number at row {i}: {_short(v)} ({type(v).__name__})")
        scores.append(float(v))
    return scores


def _where(exc: BaseException) -> str:
    """" (file.py:LINE)" of the innermost frame that raised, or ""."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if len(frames) > 1 else ""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# Several sources: the weighted sum and the per-source figures (pure) ----------------------------------------------


def weighted_sum(values: Tensor, applies: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """The total reward of each row over K sources, and which rows no source scored.

    Args:
        values: (B, K) each source's score of each row (anything where it does not apply).
        applies: (B, K) bool, False where a source returned None for the row (TRL's NaN).
        weights: (K,) each source's weight (TRL's `reward_weights`).

    Returns (total (B,) = Σ_k w_k · v_bk over the sources that apply, as TRL's `nansum`, so 0 for a row no source
    scored; unscored (B,) bool). A non-finite value of a source that applies stays in the total.
    """
    terms = torch.where(applies, values.float() * weights.to(values.device).float(), torch.zeros((), device=values.device))
    return terms.sum(-1), ~applies.any(-1)


def nanstd(x: Tensor) -> Tensor:
    """The standard deviation of the non-NaN entries of `x`, Bessel-corrected (TRL's `nanstd`); NaN for < 2 entries."""
    count = (~torch.isnan(x)).sum()
    variance = torch.nanmean((x - torch.nanmean(x)) ** 2)
    return (variance * count / (count - 1)).sqrt() if count > 1 else torch.tensor(math.nan)


def source_stats(per_source: dict[str, Tensor]) -> dict[str, float]:
    """`rewards/<name>/mean` and `rewards/<name>/std` of each source's (B,) scores over the rows it applies to (NaN
    where it returned None), as TRL logs them."""
    out = {}
    for name, scores in per_source.items():
        x = scores.detach().float().cpu()
        out[f"rewards/{name}/mean"] = float(torch.nanmean(x))
        out[f"rewards/{name}/std"] = float(nanstd(x))
    return out


def unique_names(names: list[str]) -> list[str]:
    """`names` with a repeat made unique by its position ("len", "len" -> "len", "len_1"), for metric keys."""
    out: list[str] = []
    for i, n in enumerate(names):
        out.append(n if n not in out else f"{n}_{i}")
    return out


def warn_unscored_once(unscored: Tensor, inputs: RewardInputs, warned: list[bool]) -> None:
    """Warn, once per run (`warned` holds the flag), that some row was scored by no source; it scores 0."""
    if warned[0] or not bool(unscored.any()):
        return
    warned[0] = True
    i = int(unscored.nonzero()[0, 0])
    logger.warning("every reward source returned None for %d row(s), which score 0 (first: prompt %r, completion %r); "
                   "make sure at least one source scores each row (this warning is not repeated)",
                   int(unscored.sum()), _short(inputs.prompts[i]), _short(completion_text(inputs.completions[i])))
