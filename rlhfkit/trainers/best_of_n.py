"""Steps 1-3 of an rft iteration (`rft.RFTTrainer`): sample n per prompt, score, keep the best per prompt.

`best_of_n(t, iteration, step)` is called by every process alike. The iteration's prompts are cut into sampling
batches of `algo.sampling_batch_size`; process r samples and scores batches r, r + world, ... (each under its own
seed, `sampling_seed`), and the kept samples are gathered back into batch order: any world size keeps the same
samples as one process.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from rlhfkit.advantages import penalize_missing_eos
from rlhfkit.data import IGNORE_INDEX, collate_prompts
from rlhfkit.evaluation.metrics import best_of_n_kl
from rlhfkit.generation import generate, seeded
from rlhfkit.io import atomic_write_text
from rlhfkit.reward_functions import extra_columns, source_stats, trainer_state
from rlhfkit.sharding import gathered_weights
from rlhfkit.trainers.experience import logged_means
from rlhfkit.trainers.processes import sums_by_name

logger = logging.getLogger("rlhfkit")


def select_best(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Index of the best-scoring sample of each group: scores (B,), group_ids (B,) in 0..G-1 -> (G,) long.

    Ties go to the lowest index; a NaN score counts as -inf, so it is chosen only when its whole group is NaN.
    Every group id in 0..G-1 must occur.
    """
    scores = torch.where(torch.isnan(scores), -math.inf, scores.float())  # (B,)
    num_groups = int(group_ids.max()) + 1
    best = torch.full((num_groups,), -math.inf, device=scores.device).scatter_reduce(0, group_ids, scores, "amax")  # (G,)
    index = torch.arange(len(scores), device=scores.device)  # (B,)
    candidates = torch.where(scores == best[group_ids], index, len(scores))  # (B,) non-best samples out of range
    return torch.full((num_groups,), len(scores), device=scores.device).scatter_reduce(0, group_ids, candidates, "amin")


def sampling_seed(seed: int, iteration: int, batch: int) -> int:
    """The seed of sampling batch `batch` of iteration `iteration`: whichever process draws it, and whatever was drawn
    before, its responses are the same (so the world size and a resume change nothing)."""
    return int(np.random.SeedSequence([seed, iteration, batch]).generate_state(1)[0])


@dataclass
class Tally:
    """What one process's batches of an iteration add up to, before the processes are summed."""

    kept: list = field(default_factory=list)  # (batch, kept example) pairs
    sums: dict[str, float] = field(default_factory=dict)  # score, scored, best, prompts, gold: this process's sums
    per_source: dict[str, list[float]] = field(default_factory=dict)  # every sample's score per source (NaN: None)
    logged: dict[str, list[float]] = field(default_factory=dict)  # what the functions logged with log_metric


def sample_batch(t, policy, examples: list[dict], iteration: int, b: int):
    """The Rollout of sampling batch `b` of `iteration` (its prompt records `examples`), under its own seed."""
    cfg, tok = t.cfg, t.tokenizer
    with seeded(sampling_seed(cfg.seed, iteration, b)):
        return generate(policy, collate_prompts(examples, tok.pad_token_id).to(t.accelerator.device), cfg.generation,
                        tok.eos_token_id, tok.pad_token_id)


def keep_batch(t, tally: Tally, b: int, examples: list[dict], ro, state, iteration: int) -> None:
    """2-3. Score batch `b` (all sources, the gold judge, what they log) and keep each prompt's best sample."""
    cfg, tok, min_score = t.cfg, t.tokenizer, t.cfg.algo.min_score
    rows = [examples[g] for g in ro.group_ids.tolist()]  # each row's prompt record
    scored = t.reward(ro, rows, state)
    scores = penalize_missing_eos(scored.total, ro.has_eos, cfg.reward.missing_eos_penalty)  # (B,)
    for name, values in scored.per_source.items():
        tally.per_source.setdefault(name, []).extend(values.tolist())
    best = select_best(scores, ro.group_ids)  # (G,)
    finite, top = torch.isfinite(scores), scores[best]  # (B,), (G,)
    if not finite.all():
        logger.warning("iteration %d: %d non-finite scores ignored", iteration + 1, int((~finite).sum()))
    gold = t.reward.gold(ro, rows, state)
    logged, extras = t.reward.logs.take()  # log_metric / log_extra of this batch's calls
    for name, values in logged.items():
        tally.logged.setdefault(name, []).extend(values)
    added = {"score": float(scores[finite].sum()), "scored": float(finite.sum()), "best": float(top[top.isfinite()].sum()),
             "prompts": float(top.isfinite().sum()), "gold": float(gold.sum()) if gold is not None else 0.0}
    tally.sums = {k: tally.sums.get(k, 0.0) + v for k, v in added.items()}
    for i in best.tolist():
        s = float(scores[i])
        if not math.isfinite(s) or (min_score is not None and s < min_score):
            continue
        prompt = ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()
        response = ro.response_ids[i][ro.response_mask[i].bool()].tolist()
        tally.kept.append((b, {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response,
                               "prompt": tok.decode(prompt, skip_special_tokens=True),
                               "completion": tok.decode(response, skip_special_tokens=True), "score": s,
                               "extra": extra_columns(extras, i)}))


@torch.no_grad()
def best_of_n(t, iteration: int, step: int) -> tuple[list[dict], dict[str, float], list[dict]]:
    """(the SFT examples of every process — the same list on each, in prompt order —, the iteration's metrics with each
    reward source's `rewards/<name>/mean|std` over every sample, the first kept samples for samples.jsonl); writes the
    kept rows to rft_iter{iteration + 1}.jsonl. The reward functions get `trainer_state` at `step` (SFT steps done)."""
    from accelerate.utils import gather_object

    cfg, acc, run = t.cfg, t.accelerator, t.run
    chosen = run.permutation(len(t.prompts), iteration)[: t.per_iteration].tolist()  # a fresh subset each iteration
    starts = list(range(0, len(chosen), cfg.algo.sampling_batch_size))
    batch = lambda b: [t.prompts[i] for i in chosen[starts[b] : starts[b] + cfg.algo.sampling_batch_size]]  # noqa: E731
    mine = list(range(acc.process_index, len(starts), t.world))
    if run.sharded(t.model):
        # A frozen reward model in a ZeRO-3 engine runs collective forwards: every process scores as many batches,
        # a process with fewer scoring filler batches (batch 0 again, dropped).
        mine += [None] * (math.ceil(len(starts) / t.world) - len(mine))
    # FSDP / ZeRO-3: the policy's weights gathered once for all of this process's batches (collective).
    with gathered_weights(acc, t.model, run.unwrap(t.model)) as policy:
        sampled = [(b, sample_batch(t, policy, batch(b or 0), iteration, b or 0)) for b in mine]
    tally, state = Tally(per_source={name: [] for name in t.reward.names}), trainer_state(step, t.total_steps)
    for b, ro in sampled:
        if b is None:
            t.reward(ro, [batch(0)[g] for g in ro.group_ids.tolist()], state)  # the collective forwards, dropped
            t.reward.logs.take()
            continue
        keep_batch(t, tally, b, batch(b), ro, state, iteration)
    names = ("score", "scored", "best", "prompts", "gold")
    (sums,) = sums_by_name(run, {**{k: tally.sums.get(k, 0.0) for k in names}, "kept": len(tally.kept)})
    kept = [e for _, e in sorted(gather_object(tally.kept), key=lambda be: be[0])]  # batch order (a stable sort)
    gathered = gather_object([tally.per_source])  # one dict per process
    sources = source_stats({name: torch.tensor([v for d in gathered for v in d[name]], dtype=torch.float32)
                            for name in tally.per_source})
    samples = [{"iteration": iteration + 1, **{k: e[k] for k in ("prompt", "completion", "score")}, **e["extra"]}
               for e in kept[:4]]
    if acc.is_main_process:
        rows = "".join(json.dumps({k: e[k] for k in ("prompt", "completion", "score")}) + "\n" for e in kept)
        atomic_write_text(os.path.join(cfg.output_dir, f"rft_iter{iteration + 1}.jsonl"), rows)
    stats = {"rft/iteration": iteration + 1, "rft/mean_score_all": sums["score"] / max(sums["scored"], 1.0),
             "rft/mean_score_best": sums["best"] / max(sums["prompts"], 1.0),
             "rft/best_of_n_kl_bound": best_of_n_kl(cfg.generation.num_samples), "rft/kept": sums["kept"],
             "rft/kept_length_avg": sum(len(e["labels"]) - e["labels"].count(IGNORE_INDEX) for e in kept) / max(len(kept), 1),
             **sources, **logged_means(run, tally.logged)}
    if t.reward.gold_function is not None:
        stats["objective/gold"] = sums["gold"] / (t.per_iteration * cfg.generation.num_samples)  # all samples
    return [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in kept], stats, samples
