"""Steps 1-3 of an rft iteration (`rft.RFTTrainer`): sample n per prompt, score, keep the best per prompt.

`BestOfN` is built from what it uses: the parts every sampling loop samples and scores through
(`trainers.experience.Sampling`: the rollout component, the reward sources, the run), the config, the prompts and
the iteration's size; never from the trainer. Calling it is done by every process alike. The iteration's prompts
are cut into sampling batches of `algo.sampling_batch_size`; process r samples and scores batches r, r + world, ...
(each under its own seed, `sampling_seed`), and the kept samples are gathered back into batch order: any world size
keeps the same samples as one process.
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
from rlhfkit.errors import UserError
from rlhfkit.generation import seeded
from rlhfkit.io import atomic_write_text
from rlhfkit.reward_functions import extra_columns, source_stats, trainer_state
from rlhfkit.sharding import gathered_weights
from rlhfkit.trainers.experience import logged_means
from rlhfkit.trainers.sampling import Sampling
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


class BestOfN:
    """An rft iteration's steps 1-3 (module docstring)."""

    def __init__(self, parts: Sampling, cfg, prompts: list[dict], per_iteration: int, total_steps: int):
        self.parts, self.cfg, self.prompts = parts, cfg, prompts
        self.per_iteration, self.total_steps = per_iteration, total_steps

    def sample_batch(self, policy, examples: list[dict], iteration: int, b: int):
        """The Rollout of sampling batch `b` of `iteration` (its prompt records `examples`) by the rollout component,
        under its own seed; `policy`: the weights whole on this process."""
        prompts = collate_prompts(examples, self.parts.rewards.tokenizer.pad_token_id)
        with seeded(sampling_seed(self.cfg.seed, iteration, b)):
            ro = self.parts.rollout(policy, prompts.to(self.parts.run.accelerator.device), examples, iteration)
        if ro is None:
            raise UserError(f"iteration {iteration + 1}: the policy's next-token probabilities are not finite (inf or "
                            "nan): its weights are broken")
        return ro

    def keep_batch(self, tally: Tally, b: int, examples: list[dict], ro, state, iteration: int) -> None:
        """2-3. Score batch `b` (all sources, the gold judge, what they log) and keep each prompt's best sample."""
        cfg, rewards, min_score = self.cfg, self.parts.rewards, self.cfg.algo.min_score
        tok = rewards.tokenizer
        rows = [examples[g] for g in ro.group_ids.tolist()]  # each row's prompt record
        scored = rewards(ro, rows, state)  # per batch: each process scores as many batches as it sampled
        scores = penalize_missing_eos(scored.total, ro.has_eos, cfg.reward.missing_eos_penalty)  # (B,)
        for name, values in scored.per_source.items():
            tally.per_source.setdefault(name, []).extend(values.tolist())
        best = select_best(scores, ro.group_ids)  # (G,)
        finite, top = torch.isfinite(scores), scores[best]  # (B,), (G,)
        if not finite.all():
            logger.warning("iteration %d: %d non-finite scores ignored", iteration + 1, int((~finite).sum()))
        gold = rewards.gold(ro, rows, state)
        logged, extras = rewards.logs.take()  # log_metric / log_extra of this batch's calls
        for name, values in logged.items():
            tally.logged.setdefault(name, []).extend(values)
        added = {"score": float(scores[finite].sum()), "scored": float(finite.sum()),
                 "best": float(top[top.isfinite()].sum()), "prompts": float(top.isfinite().sum()),
                 "gold": float(gold.sum()) if gold is not None else 0.0}
        tally.sums = {k: tally.sums.get(k, 0.0) + v for k, v in added.items()}
        for i in best.tolist():
            s = float(scores[i])
            if not math.isfinite(s) or (min_score is not None and s < min_score):
                continue
            prompt = ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()
            response = ro.response_ids[i][ro.response_mask[i].bool()].tolist()
            tally.kept.append((b, {"input_ids": prompt + response, "labels": [IGNORE_INDEX] * len(prompt) + response,
                                   "prompt": tok.decode(prompt, skip_special_tokens=True),
                                   "completion": ro.texts[i] if ro.texts is not None else
                                   tok.decode(response, skip_special_tokens=True), "score": s,
                                   "extra": extra_columns(extras, i)}))

    @torch.no_grad()
    def __call__(self, model, iteration: int, step: int) -> tuple[list[dict], dict[str, float], list[dict]]:
        """(the SFT examples of every process — the same list on each, in prompt order —, the iteration's metrics with
        each reward source's `rewards/<name>/mean|std` over every sample, the first kept samples for samples.jsonl);
        writes the kept rows to rft_iter{iteration + 1}.jsonl. `model`: the prepared policy. The reward functions get
        `trainer_state` at `step` (SFT steps done)."""
        from accelerate.utils import gather_object

        cfg, run, rewards = self.cfg, self.parts.run, self.parts.rewards
        acc, size = run.accelerator, cfg.algo.sampling_batch_size
        chosen = run.permutation(len(self.prompts), iteration)[: self.per_iteration].tolist()  # a fresh subset each time
        starts = list(range(0, len(chosen), size))
        batch = lambda b: [self.prompts[i] for i in chosen[starts[b] : starts[b] + size]]  # noqa: E731
        mine = list(range(acc.process_index, len(starts), run.world))
        if run.sharded(model):
            # A frozen reward model in a ZeRO-3 engine runs collective forwards: every process scores as many
            # batches, a process with fewer scoring filler batches (batch 0 again, dropped).
            mine += [None] * (math.ceil(len(starts) / run.world) - len(mine))
        # FSDP / ZeRO-3: the policy's weights gathered once for all of this process's batches (collective).
        with gathered_weights(acc, model, run.unwrap(model)) as policy:
            sampled = [(b, self.sample_batch(policy, batch(b or 0), iteration, b or 0)) for b in mine]
        tally, state = Tally(per_source={name: [] for name in rewards.names}), trainer_state(step, self.total_steps)
        for b, ro in sampled:
            if b is None:
                rewards(ro, [batch(0)[g] for g in ro.group_ids.tolist()], state)  # the collective forwards, dropped
                rewards.logs.take()
                continue
            self.keep_batch(tally, b, batch(b), ro, state, iteration)
        return self.finish(tally, iteration)

    def finish(self, tally: Tally, iteration: int) -> tuple[list[dict], dict[str, float], list[dict]]:
        """The processes' tallies as one: the kept examples in batch order, the iteration's metrics, its samples."""
        from accelerate.utils import gather_object

        cfg, run = self.cfg, self.parts.run
        names = ("score", "scored", "best", "prompts", "gold")
        (sums,) = sums_by_name(run, {**{k: tally.sums.get(k, 0.0) for k in names}, "kept": len(tally.kept)})
        kept = [e for _, e in sorted(gather_object(tally.kept), key=lambda be: be[0])]  # batch order (a stable sort)
        gathered = gather_object([tally.per_source])  # one dict per process
        sources = source_stats({name: torch.tensor([v for d in gathered for v in d[name]], dtype=torch.float32)
                                for name in tally.per_source})
        samples = [{"iteration": iteration + 1, **{k: e[k] for k in ("prompt", "completion", "score")}, **e["extra"]}
                   for e in kept[:4]]
        if run.accelerator.is_main_process:
            rows = "".join(json.dumps({k: e[k] for k in ("prompt", "completion", "score")}) + "\n" for e in kept)
            atomic_write_text(os.path.join(cfg.output_dir, f"rft_iter{iteration + 1}.jsonl"), rows)
        kept_tokens = sum(len(e["labels"]) - e["labels"].count(IGNORE_INDEX) for e in kept)
        stats = {"rft/iteration": iteration + 1, "rft/mean_score_all": sums["score"] / max(sums["scored"], 1.0),
                 "rft/mean_score_best": sums["best"] / max(sums["prompts"], 1.0),
                 "rft/best_of_n_kl_bound": best_of_n_kl(cfg.generation.num_samples), "rft/kept": sums["kept"],
                 "rft/kept_length_avg": kept_tokens / max(len(kept), 1), **sources, **logged_means(run, tally.logged)}
        if self.parts.rewards.gold_function is not None:  # over all samples
            stats["objective/gold"] = sums["gold"] / (self.per_iteration * cfg.generation.num_samples)
        return [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in kept], stats, samples
