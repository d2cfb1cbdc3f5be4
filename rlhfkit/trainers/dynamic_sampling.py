"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, §3.2, eq. 11's constraint 0 < |{o_i correct}| < G):
a group whose samples all scored the same gives every sample a zero group-relative advantage, so it is dropped and
more prompts are sampled until the step holds `algo.rollout_batch_size` groups with signal (per process), or
`algo.max_sampling_rounds` rounds have been sampled.

The batch is a row of slots, one per prompt of the step. Round 0 fills each slot with the step's own prompt (the
prompt stream's order); each later round draws one fresh candidate prompt per slot from a permutation seeded by
(seed, step, round) and samples only the slots still without signal. A slot keeps the first group with signal it
gets; a slot still without one after the last round keeps its round-0 group, which the loss mask then drops
(`advantages.loss_mask`), so the batch's shape never changes. Equal in law to the paper's over-sample-and-truncate (each
kept group is a prompt drawn from the data, conditioned on having signal), at the cost of sampling only the missing
groups instead of a whole batch per round.

Why slots: slot i's candidates and their samples depend on (seed, step, round, i) alone, never on which process holds
the slot, so N processes ≡ 1 (with `generation.seed_per_prompt`) and a resumed run ≡ the uninterrupted one hold as
for a step without refills. Every process runs the same number of rounds: the decision to go on is taken on the
count of empty slots over every process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhfkit.advantages import penalize_missing_eos, zero_variance_groups
from rlhfkit.rewards import Scores
from rlhfkit.types import PromptBatch, Rollout


def refill_key(step: int, round_: int) -> int:
    """The key a refill round's samples are drawn under, in place of the step (`rollout.prompt_seeds`): negative, so
    it never equals a step's own key, and distinct for every (step, round < 1000)."""
    return -(step * 1000 + round_)


def refill_order(seed: int, step: int, round_: int, n: int, slots: int) -> list[int]:
    """The dataset indices of round `round_`'s candidates for the step's `slots` global slots: a permutation of
    range(n) seeded by (seed, step, round), repeated when the data holds fewer prompts than slots."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + round_)
    order = torch.randperm(n, generator=generator)
    return order.repeat(-(-slots // n))[:slots].tolist()


@dataclass(frozen=True)
class Filled:
    """A step's batch after dynamic sampling: the rollout, its scores and each row's example, slot by slot; the
    figures logged (over every process); and whether a round's sampling failed (non-finite) on some process."""

    rollout: Rollout | None
    scores: Scores | None
    rows: list[dict]
    stats: dict[str, float]
    logged: dict[str, list[float]]  # the reward functions' `log_metric` values of every round
    extras: dict[str, list]  # their `log_extra` columns, picked with the rows
    failed: bool = False


def signal_of(scores: Scores, rollout: Rollout, k: int, penalty: float | None) -> torch.Tensor:
    """(slots,) bool: the slot's group has samples that scored differently (after the EOS penalty, as its advantage
    sees them; the batch normalisations are affine and change no group's spread)."""
    shaped = penalize_missing_eos(scores.total, rollout.has_eos, penalty)
    return ~zero_variance_groups(shaped, rollout.group_ids)[::k].clone()


def fill(first: Rollout, scored: Scores, rows: list[dict], *, k: int, rounds: int, candidates: Callable,
         sample: Callable, score: Callable, run, pad_token_id: int, penalty: float | None,
         take: Callable[[], tuple[dict, dict]]) -> Filled:
    """Refill the slots whose group has no signal, for up to `rounds` rounds in all (see the module's docstring).

    `candidates(round)`: (PromptBatch, examples) of this process's slots for that round; `sample(prompts, examples,
    round)`: their rollout (None: non-finite sampling); `score(rollout, rows)`: its `Scores`; `take()`: the reward
    functions' `log_metric` values and `log_extra` columns logged since the step began (`RewardLogs.take`)."""
    slots = first.group_ids.numel() // k
    signal = signal_of(scored, first, k, penalty)
    parts, part_scores, part_rows = [first], [scored], [rows]
    chosen = [(0, slot) for slot in range(slots)]  # (part, group within it) of each slot
    dropped, used = int((~signal).sum()), 1
    for round_ in range(1, rounds):
        empty = (~signal).nonzero().flatten()
        if run.on_every_process(not empty.numel()):
            break
        used += 1
        ro = None
        if empty.numel():
            prompts, examples = candidates(round_)
            picked = [examples[i] for i in empty.tolist()]
            ro = sample(PromptBatch(prompts.input_ids[empty], prompts.attention_mask[empty]), picked, round_)
        if not run.on_every_process(ro is not None or not empty.numel()):
            return Filled(None, None, [], {}, *take(), failed=True)
        if ro is None:
            continue
        new_rows = [e for e in picked for _ in range(k)]
        new_scores = score(ro, new_rows)
        has = signal_of(new_scores, ro, k, penalty)
        dropped += int((~has).sum())
        for j, slot in enumerate(empty.tolist()):
            if has[j]:
                chosen[slot], signal[slot] = (len(parts), j), True
        parts.append(ro), part_scores.append(new_scores), part_rows.append(new_rows)
    device = first.has_eos.device
    counts = run.sum_over_processes(torch.tensor([float(dropped), float(signal.sum())], device=device))
    stats = {"dynamic_sampling/rounds": float(used), "dynamic_sampling/dropped_groups": float(counts[0]),
             "dynamic_sampling/filled_share": float(counts[1]) / (slots * run.world)}
    logged, extras = take()
    return assemble(parts, part_scores, part_rows, chosen, k, pad_token_id, logged, extras, stats)


def assemble(parts: list[Rollout], scores: list[Scores], rows: list[list[dict]], chosen: list[tuple[int, int]], k: int,
             pad_token_id: int, logged: dict[str, list[float]], extras: dict[str, list],
             stats: dict[str, float]) -> Filled:
    """The slots' chosen groups, in slot order, as one rollout (group ids = slot indices) with their scores, rows and
    `log_extra` values (a column with a value for every row scored is picked with its rows; another is left whole)."""
    starts = [0]
    for part in parts:
        starts.append(starts[-1] + part.group_ids.numel())
    index = torch.tensor([starts[p] + g * k + s for p, g in chosen for s in range(k)])
    rollout = Rollout.concat(parts, pad_token_id).select(index)
    rollout = dataclasses.replace(rollout, group_ids=torch.arange(len(chosen), device=rollout.group_ids.device)
                                  .repeat_interleave(k))
    total = torch.cat([s.total for s in scores])
    scored = Scores(total[index.to(total.device)],
                    {name: torch.cat([s.per_source[name] for s in scores])[index.to(total.device)]
                     for name in scores[0].per_source},
                    torch.cat([s.unscored for s in scores])[index.to(total.device)])
    flat_rows = [r for part in rows for r in part]
    picked = {column: [values[i] for i in index.tolist()] if len(values) == len(flat_rows) else values
              for column, values in extras.items()}
    return Filled(rollout, scored, [flat_rows[i] for i in index.tolist()], stats, logged, picked)
