"""An evaluation's judges: reward sources (`rewards.RewardSource`, `score(rollout, inputs)`), seen through a thin view.

A judge is nothing but a reward source under a name: a Python reward function under TRL's contract
(`reward_functions.RewardFunction`), a reward model (`rewards.RewardModelSource`, reading the rollout's own token ids,
or the text re-tokenised when its tokenizer is not the policy's) or an ensemble of them (`rewards.EnsembleSource`).
`judge` is the view: every source scores one model's rollout from ONE set of inputs (`rewards.reward_inputs`, which
reads the completions the rollout component decoded), and each source's values become one float per row, None where
it does not apply (TRL's convention), checked for their count and finiteness. What the Python functions log with
`log_metric` / `log_extra` comes back beside the scores.

The reward models' own figure, their accuracy on preference pairs (`rm_accuracy`), is here too: it is a property of
the judge, not of the samples.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlhfkit.data import build_datasets, collate_preference
from rlhfkit.errors import UserError
from rlhfkit.evaluation.metrics import mean_std, reward_model_accuracy, win_rate
from rlhfkit.reward_functions import RewardFunction, RewardLogs, trainer_state
from rlhfkit.rewards import EnsembleSource, RewardSource, load_reward_model_source, reduce_ensemble, reward_inputs
from rlhfkit.types import Rollout

logger = logging.getLogger("rlhfkit")


def python_judge(fn: Callable) -> RewardFunction:
    """A Python reward function under TRL's contract (e.g. `rlhfkit.tasks.toy:vowel_reward`) as a judge: the reward
    source itself. It gets `trainer_state` as a fresh `transformers.TrainerState` (global_step 0): there is no
    training here, and a TRL function that reads it must still run."""
    return fn if isinstance(fn, RewardFunction) else RewardFunction(fn, f"judge {getattr(fn, '__name__', fn)!r}")


@dataclass(frozen=True)
class Judged:
    """What the judges said of one model's rows."""

    scores: dict[str, list[float | None]]  # judge -> one score per row, None where it does not apply
    logged: dict[str, float] = field(default_factory=dict)  # log_metric name -> mean of its values
    extras: dict[str, list] = field(default_factory=dict)  # log_extra column -> one value per row


def verdicts(source: RewardSource, rollout: Rollout | None, inputs) -> list[float | None]:
    """The view: a reward source's scores of the rows of `inputs` as one float per row, None where it does not
    apply. `rollout`: the rows' rollout, or None for a source that reads the inputs alone (the red-team judges)."""
    values, applies = source.score(rollout, inputs)
    return [float(v) if a else None for v, a in zip(values.tolist(), applies.tolist())]


@torch.no_grad()
def judge(judges: dict[str, RewardSource], rollout: Rollout, examples: list[dict], tokenizer) -> Judged:
    """Every judge on all of `rollout`'s rows (each called once: a judge may batch its work or normalise over the
    batch), from one set of inputs. `examples[i]`: row i's prompt example."""
    logs = RewardLogs()
    inputs = reward_inputs(tokenizer, rollout, examples, trainer_state(0, 0), logs)
    n = rollout.response_ids.shape[0]
    scores = {}
    for name, source in judges.items():
        row = verdicts(source, rollout, inputs)
        if len(row) != n:
            raise UserError(f"judge '{name}' returned {len(row)} scores for {n} completions")
        bad = next(((i, s) for i, s in enumerate(row) if s is not None and not math.isfinite(s)), None)
        if bad is not None:
            raise UserError(f"judge '{name}' returned a non-finite score ({bad[1]}) at row {bad[0]}: return a number, "
                            "or None for a row the judge does not apply to")
        if all(s is None for s in row):
            logger.warning("judge '%s' returned None for all %d samples: it has no figures", name, n)
        scores[name] = row
    metrics, extras = logs.take()
    return Judged(scores, {name: sum(v) / len(v) for name, v in metrics.items() if v}, extras)


def judged(scores: list) -> dict:
    """{"mean", "std", "n"} of a judge's scores over the rows it applies to (not None); mean and std are None when
    it applies to none."""
    applied = [x for x in scores if x is not None]
    return {**(mean_std(applied) if applied else {"mean": None, "std": None}), "n": len(applied)}


def paired_win_rate(a: list, b: list) -> float | None:
    """`metrics.win_rate` over the pairs both sides have a score for (None when there are none)."""
    both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return win_rate([x for x, _ in both], [y for _, y in both]) if both else None


def reward_model_judges(cfg, tokenizer, device) -> dict[str, RewardSource]:
    """name -> reward-model source of an `EvalConfig`'s `reward.model`: each reward model, and their ensemble when
    there are several (and reward.ensemble is not none)."""
    r = cfg.reward
    members = {}
    for path in r.model:
        source = load_reward_model_source(path, tokenizer, cfg.model.name_or_path, r.quantization, cfg.batch_size,
                                          attn_implementation=cfg.model.attn_implementation)
        source.scorer.model.to(device)
        base = "reward_model" if len(r.model) == 1 else f"reward_model/{os.path.basename(os.path.normpath(path))}"
        name = base if base not in members else f"{base}_{len(members)}"  # two directories of the same name
        members[name] = source
    if len(members) > 1 and r.ensemble != "none":
        members[f"reward_model/ensemble_{r.ensemble}"] = EnsembleSource(list(members.values()), r.ensemble)
    return members


@torch.no_grad()
def rm_accuracy(source, pairs: list[dict], pad_token_id: int, device, batch_size: int,
                own_pairs: Callable[[object], list[dict]]) -> float:
    """The fraction of preference `pairs` whose chosen response the reward model (or ensemble) `source` scores above
    the rejected one. The pairs are in the policy's tokens: a reward model with a tokenizer of its own is given the
    pairs in its own tokens (`own_pairs(member)`)."""
    members = source.members if isinstance(source, EnsembleSource) else [source]
    chosen, rejected = [], []
    for member in members:
        c, r = [], []
        own = own_pairs(member) if member.retokenize else pairs
        pad = member.scorer.tokenizer.pad_token_id if member.retokenize else pad_token_id
        for start in range(0, len(own), batch_size):
            b = collate_preference(own[start : start + batch_size], pad, actions_only=False).to(device)
            c.append(member.scorer(b.chosen_input_ids, b.chosen_attention_mask, b.chosen_labels != -100))
            r.append(member.scorer(b.rejected_input_ids, b.rejected_attention_mask, b.rejected_labels != -100))
        chosen.append(torch.cat(c))
        rejected.append(torch.cat(r))
    if isinstance(source, EnsembleSource):
        return reward_model_accuracy(reduce_ensemble(torch.stack(chosen), source.reduce),
                                     reduce_ensemble(torch.stack(rejected), source.reduce))
    return reward_model_accuracy(chosen[0], rejected[0])


def pairs_in_tokens_of(data_config, seed: int) -> Callable[[object], list[dict]]:
    """`rm_accuracy`'s `own_pairs`: the preference data of `data_config` in a reward model's own tokens."""
    return lambda source: build_datasets("preference", data_config, source.scorer.tokenizer, seed)[0]
