"""An online step's experience, made once from explicit parts (the shape of OpenRLHF's experience maker):
rollout → scores → shaped scores → no-grad forwards → KL → per-token rewards → advantages.

`ExperienceMaker` is built once per run from what it uses — the rollout component (`rlhfkit.rollout`), the reward
sources, the reference, the critic, the KL controller, the running reward moments, the config — never from the
trainer. `make` is the one place an `Experience` is built; nothing changes it afterwards. What a step measured about
it is computed over every process's rows, as one process holding the whole batch would, and returned as logged
figures plus the typed values the loop's control reads (`Made.kl`, never a metric name).

Every figure of the policy's tokens reads the rollout's `action_mask`: a token the policy did not choose (a tool
result in a multi-turn episode) takes no KL, no entropy, no value and no length.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from rlhfkit.advantages import AdvantageInput, compute_advantages, loss_mask, penalize_missing_eos, per_token_rewards
from rlhfkit.algorithms import Algorithm
from rlhfkit.config import OnlineConfig
from rlhfkit.critic import critic_values
from rlhfkit.evaluation.alarms import diversity_figures
from rlhfkit.evaluation.metrics import pearson
from rlhfkit.kl import token_kl
from rlhfkit.models import rollout_logprobs, set_training
from rlhfkit.reward_functions import source_stats, trainer_state
from rlhfkit.rewards import Rewards, RunningMoments, normalize_scores
from rlhfkit.rollout import RolloutMaker
from rlhfkit.errors import UserError
from rlhfkit.trainers.dynamic_sampling import Filled, fill, refill_key
from rlhfkit.trainers.optim import Fault
from rlhfkit.trainers.processes import sums_by_name
from rlhfkit.trainers.sampling import Sampling
from rlhfkit.types import Experience, PromptBatch, Rollout, ToolCounts, ToolFigures


@dataclass(frozen=True)
class Made:
    """What `ExperienceMaker.make` made of a step: its experience, or the fault that skips the step (a non-finite
    rollout, score, log-prob, value or advantage on some process); its logged figures (over every process); the mean
    sequence KL to the reference that the KL controller follows (None until π_old is known, or without a
    reference); and the `log_extra` columns of the step's rows (for the sample rows)."""

    experience: Experience | None
    fault: Fault | None
    stats: dict[str, float]
    kl: float | None = None
    extras: dict[str, list] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)  # (B,) each row's prompt example


@dataclass(frozen=True)
class PolicyFigures:
    """What π_old's log-probs measure over every process's rows: the logged figures, and the mean sequence KL to the
    reference (None without one)."""

    stats: dict[str, float]
    kl: float | None
    seq_kl: torch.Tensor | None  # (B,) this process's sequence KL, for the sample rows


OldSource = Literal["update", "sampler", "recompute"]  # where a run's π_old comes from, once resolved


def old_logprob_source(cfg: OnlineConfig, algo: Algorithm, sampler_is_exact: bool) -> OldSource:
    """Where π_old's log-probs come from, `algo.old_logprob_source` resolved for this run:
    - "update": the update forward's own, detached, when each rollout is read once (ppo_epochs × num_minibatches = 1)
      and no KL is in the reward (nothing needs π_old before the update): exact, the ratio is 1 by definition;
    - "sampler": the log-probs the decode loop recorded (`Rollout.sampler_logprobs`), asked for, or under "auto"
      where `sampler_is_exact`: the weights that sampled are the ones the update starts from (no stale rollout), and
      both compute in fp32 without dropout, so the two differ by summation order only (the KV cache's), as
      TRL's PPO takes them; the gap is measured at the first update forward (`policy/sampler_logprob_gap`);
    - "recompute": a no-grad forward of the policy after sampling, asked for, or where the sampler's may differ
      (transformers' `generate`, bf16/fp16, a rollout component the config did not make), or where
      `algo.rollout_correction` weighs the two against each other (it needs π_old from the training forward)."""
    a = cfg.algo
    if a.old_logprob_source == "recompute":
        return "recompute"
    if a.ppo_epochs * a.num_minibatches == 1 and not algo.kl_in_reward:
        return "update"
    if a.old_logprob_source == "sampler" or (sampler_is_exact and a.rollout_correction == "none"):
        return "sampler"
    return "recompute"


class ExperienceMaker:
    def __init__(self, rollout: RolloutMaker, rewards: Rewards, reference, critic, kl_control, moments: RunningMoments,
                 cfg: OnlineConfig, algo: Algorithm, run, old_source: OldSource, candidates=None):
        """`reference`: a `models.Reference` or None; `critic`: the prepared critic module or None; `kl_control`: the
        β controller (`rlhfkit.kl_control`); `moments`: the running reward moments (`reward.normalize: running`),
        updated only by a step that is kept; `run`: the run's process group and unwrapping (`trainers.run.Run`);
        `old_source`: where π_old comes from (`old_logprob_source`): only "recompute" runs a forward here;
        `candidates(step, round)`: this process's refill prompts and examples (`trainers.online_setup.PromptStream`),
        for dynamic sampling (`algo.dynamic_filtering` with `algo.max_sampling_rounds` > 1)."""
        self.rollout, self.rewards, self.reference, self.critic = rollout, rewards, reference, critic
        self.kl_control, self.moments, self.cfg, self.algo, self.run, self.old_source = \
            kl_control, moments, cfg, algo, run, old_source
        self.candidates = candidates
        self.parts = Sampling(rollout, rewards, reference, run, cfg.optim.per_device_batch_size, cfg.generation.temperature)
        if cfg.algo.dynamic_filtering and cfg.algo.max_sampling_rounds > 1:
            if candidates is None:
                raise ValueError("dynamic sampling with refills needs the prompt stream's candidates")
            if run.accelerator.distributed_type in ("FSDP", "DEEPSPEED"):
                raise UserError(f"algo.max_sampling_rounds: refill rounds sample on the processes that have empty slots "
                                f"only, which {run.accelerator.distributed_type}'s sharded weights cannot do; set "
                                "algo.max_sampling_rounds=1 (drop without refilling) or run on one process or DDP")

    @torch.no_grad()
    def make(self, policy, prompts: PromptBatch, examples: list[dict], step: int, total_steps: int) -> Made:
        """Step `step`'s (0-based) experience from this process's `prompts` and their dataset `examples`, with the
        prepared `policy`: 1. the rollout; 2. scores, once for the whole batch; 3. no-grad forwards (π_old, reference,
        critic) without dropout; 4. shaped scores, per-token rewards with the KL penalty, advantages."""
        cfg, run = self.cfg, self.run
        for module in (policy, self.critic):  # eval mode for the whole phase: one switch, not one around each part
            if module is not None:
                set_training(module, False)
        t0 = time.perf_counter()
        ro = self.parts.roll_out(policy, prompts, examples, step)  # 1. roll out
        stats: dict[str, float] = {"time/generate_s": time.perf_counter() - t0}
        if not run.on_every_process(ro is not None):
            return Made(None, Fault.ROLLOUT, stats)
        rows = [e for e in examples for _ in range(cfg.generation.num_samples)]  # the dataset example of each row
        state = trainer_state(step, total_steps)
        scored, source_figures = self.parts.score(ro, rows, state)  # 2. score
        taken = None  # the reward functions' logs, when dynamic sampling took them
        if cfg.algo.dynamic_filtering:  # DAPO: groups without signal dropped, more prompts sampled
            filled = self.refill(policy, ro, scored, rows, step, state)
            if filled.failed:
                return Made(None, Fault.ROLLOUT, stats)
            ro, scored, rows, taken = filled.rollout, filled.scores, filled.rows, (filled.logged, filled.extras)
            stats.update(filled.stats)
            source_figures = source_stats({name: run.gather(v) for name, v in scored.per_source.items()})
        scores = scored.total  # (B,) the weighted sum over the reward sources
        stats.update(source_figures)
        old_logprobs, ref_logprobs, values = self.forwards(run.unwrap(policy), ro)  # 3.
        finite = run.on_every_process(all(bool(torch.isfinite(x).all()) for x in (scores, old_logprobs, ref_logprobs, values)
                                          if x is not None))
        moments = self.moments.copy()  # kept only if the step is: a skipped step leaves no trace
        exp = self.estimate(ro, scores, old_logprobs, ref_logprobs, values, moments if finite else RunningMoments(),
                            scored.per_source)  # 4.
        stats.update(self.rollout_stats(exp, rows, state))
        logged, extras = taken or self.rewards.logs.take()  # log_metric / log_extra: the step's metrics, the rows' columns
        stats.update(logged_means(run, logged))
        figures = self.policy_figures(exp) if old_logprobs is not None else None
        if figures is not None:
            stats.update(figures.stats)
        if not run.on_every_process(finite and bool(torch.isfinite(exp.advantages).all())):
            return Made(None, Fault.ROLLOUT, stats)
        self.moments.load_state_dict(moments.state_dict())
        return Made(exp, None, stats, figures.kl if figures is not None else None, extras, rows)

    def refill(self, policy, ro: Rollout, scored, rows: list[dict], step: int, state) -> Filled:
        """DAPO's dynamic sampling (`trainers.dynamic_sampling`): the slots whose group has no signal sampled again
        from fresh prompts, up to `algo.max_sampling_rounds` rounds in all."""
        cfg, run = self.cfg, self.run

        def sample(prompts, examples, round_):
            return self.parts.roll_out(policy, prompts, examples, refill_key(step, round_))

        return fill(ro, scored, rows, k=cfg.generation.num_samples, rounds=cfg.algo.max_sampling_rounds,
                    candidates=lambda round_: self.candidates(step, round_), sample=sample,
                    score=lambda rollout, new_rows: self.rewards(rollout, new_rows, state), run=run,
                    pad_token_id=self.rewards.tokenizer.pad_token_id, penalty=cfg.reward.missing_eos_penalty,
                    take=self.rewards.logs.take)

    def forwards(self, policy, ro: Rollout):
        """(B, R) π_old, reference log-probs and critic values of the rollout's tokens (each None where not needed),
        in no-grad forwards without dropout on the unwrapped modules (no DDP collectives): with unchanged weights
        they give exactly the update forward's values. Each micro-batch is cut to its own longest response, its
        outputs padded back to the rollout's width."""
        cfg, parts = self.cfg, self.parts
        critic = self.run.unwrap(self.critic) if self.critic is not None else None  # both in eval mode (`make`)
        if self.old_source == "update":
            old = None  # the update forward's own, detached (`PolicyUpdate` returns them)
        elif self.old_source == "sampler":
            old = ro.sampler_logprobs
        else:
            old = parts.micro(ro, lambda c: rollout_logprobs(policy, c, cfg.generation.temperature))
        ref = parts.reference_logprobs(policy, ro)
        values = parts.micro(ro, lambda c: critic_values(critic, critic, c)) if critic is not None else None
        return old, ref, values

    def source_scores(self, per_source: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) each reward source's own scores (NaN where it returned None) and their (S,) weights, in the
        sources' order: GDPO's normalise-then-sum reads them instead of the weighted total."""
        values = torch.stack([per_source[name] for name in self.rewards.names], -1).float()
        return values, self.rewards.weights.to(values.device)

    def estimate(self, ro: Rollout, scores, old_logprobs, ref_logprobs, values, moments: RunningMoments,
                 per_source: dict[str, torch.Tensor] | None = None) -> Experience:
        """4. The EOS penalty, normalisation and clipping of the scores, the KL once per token, the per-token rewards
        and the advantages — statistics over the global batch, as one process would compute them."""
        cfg, algo, run = self.cfg, self.algo, self.run
        mask = ro.action_mask.float()
        shaped = penalize_missing_eos(scores, ro.has_eos, cfg.reward.missing_eos_penalty)
        shaped = normalize_scores(shaped, cfg.reward.normalize, moments, cfg.reward.clip,
                                  population=run.gather(shaped) if cfg.reward.normalize != "none" else None)
        kl = token_kl(old_logprobs, ref_logprobs, mask)  # (B, R) or None
        rewards = per_token_rewards(shaped, kl if kl is not None else torch.zeros_like(mask), mask,
                                    self.kl_control.value if algo.kl_in_reward else 0.0)
        whiten = cfg.algo.whiten_advantages if cfg.algo.whiten_advantages is not None else algo.whiten_by_default
        # Advantages see every response (`mask`): a sample excluded from the loss still counts in its group's baseline.
        sources = self.source_scores(per_source) if cfg.algo.multi_objective_aggregation == "normalize_then_sum" else None
        advantages, returns = compute_advantages(algo.advantage, AdvantageInput(
            rewards=rewards, scores=shaped, response_mask=mask, values=values, group_ids=ro.group_ids,
            gamma=cfg.algo.gamma, lam=cfg.algo.lam, whiten=whiten,
            all_reduce=(lambda x: run.accelerator.reduce(x, "sum")) if run.world > 1 else None,
            scale_rewards=None if sources else cfg.algo.scale_rewards or algo.scale_rewards,
            source_scores=sources[0] if sources else None, source_weights=sources[1] if sources else None))
        return Experience(
            rollout=ro, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values, scores=scores,
            shaped_scores=shaped, kl=kl.sum(1) if kl is not None else None, advantages=advantages, returns=returns,
            loss_mask=loss_mask(mask, ro.has_eos, shaped, ro.group_ids, mask_truncated=cfg.algo.mask_truncated,
                                drop_zero_variance_groups=cfg.algo.dynamic_filtering))

    def rollout_stats(self, exp: Experience, rows: list[dict], state=None) -> dict[str, float]:
        """What the rollout measured, over every process's rows (README: the online metric table)."""
        return rollout_stats(self.run, self.rewards, exp.rollout, exp.scores, rows, state, self.cfg.algo.rollout_batch_size)

    def policy_figures(self, exp: Experience, old_logprobs: torch.Tensor | None = None) -> PolicyFigures:
        """What π_old's log-probs (the experience's, or the one-pass update's `old_logprobs`) tell, over every
        process's rows: entropy, sampler gap (unless π_old is the sampler's own: the update measures it then), and —
        where there is a reference — the KL, β and the KL-regularised reward."""
        run, ro, mask = self.run, exp.rollout, exp.rollout.action_mask.float()
        old = old_logprobs if old_logprobs is not None else exp.old_logprobs
        kl = token_kl(old, exp.ref_logprobs, mask)
        seq_kl = kl.sum(1) if kl is not None else None
        per_row = {"entropy": (-old * mask).sum(1), "length": mask.sum(1),
                   "gap": ((ro.sampler_logprobs - old).abs() * mask).sum(1), "shaped": exp.shaped_scores}
        if seq_kl is not None:
            per_row["kl"] = seq_kl
        g = {k: run.gather(v.float()) for k, v in per_row.items()}  # (world·B,) each
        stats = {"objective/entropy": g["entropy"].mean()}
        if self.old_source != "sampler":
            stats["policy/sampler_logprob_gap"] = g["gap"].sum() / g["length"].sum().clamp(min=1)
        mean_kl = None
        if "kl" in g:
            beta = self.kl_control.value
            mean_kl = float(g["kl"].mean())
            stats.update({"objective/kl": mean_kl, "objective/kl_coef": beta,
                          "objective/rlhf_reward": (g["shaped"] - beta * g["kl"]).mean()})
        return PolicyFigures({k: float(v) for k, v in stats.items()}, mean_kl, seq_kl)


def rollout_stats(run, rewards: Rewards, ro: Rollout, scores: torch.Tensor, rows: list[dict], state,
                  rollout_batch_size: int) -> dict[str, float]:
    """What a rollout measured over every process's rows: score, the policy's tokens per completion, EOS rate, the
    reward-hacking evidence (`evaluation.alarms`), the gold judge's mean and, with tools, the tool figures. Reads the
    rollout's text as its rollout component decoded it (`Rollout.texts`)."""
    from accelerate.utils import gather_object

    mask = ro.action_mask.float()
    per_row = {"scores": scores, "length": mask.sum(1), "eos": ro.has_eos.float()}  # (B,) each
    gold = rewards.gold(ro, rows, state)
    if gold is not None:
        per_row["gold"] = gold.to(mask.device)
    g = {k: run.gather(v.float()) for k, v in per_row.items()}  # (world·B,) each
    texts = list(ro.texts) if ro.texts is not None else rewards.tokenizer.batch_decode(
        [r[m.bool()].tolist() for r, m in zip(ro.response_ids, ro.response_mask)], skip_special_tokens=True)
    groups = (ro.group_ids + run.accelerator.process_index * rollout_batch_size).tolist()
    if run.world > 1:
        texts, groups = gather_object(texts), gather_object(groups)
    stats = {
        "objective/scores": g["scores"].mean(),
        "response/length_avg": g["length"].mean(), "response/eos_rate": g["eos"].mean(),
        # Evidence for the reward-hacking alarms (rlhfkit.evaluation.alarms).
        "response/empty_rate": ((g["length"] - g["eos"]) <= 0).float().mean(),
        "response/score_length_corr": pearson(g["scores"].tolist(), g["length"].tolist()),
        **diversity_figures(texts, groups),  # distinct-2, words per response, top share
    }
    if "gold" in g:
        stats["objective/gold"] = g["gold"].mean()
    if ro.tools is not None:
        stats.update(ToolFigures.of(gather_counts(run, ro.tools)).metrics("tools/"))
    return {k: float(v) for k, v in stats.items()}


def gather_counts(run, counts: ToolCounts) -> ToolCounts:
    """The tool counts of every process's rows, in process order."""
    return dataclasses.replace(counts, **{f.name: run.gather(getattr(counts, f.name)) for f in dataclasses.fields(counts)
                                          if isinstance(getattr(counts, f.name), torch.Tensor)})


def logged_means(run, values: dict[str, list[float]]) -> dict[str, float]:
    """name -> the mean of every process's values under it (a name some process lacks counts none there), as TRL
    averages what reward functions log with `log_metric`. Collective: every process calls it."""
    names = sorted(values)
    if run.world > 1:
        from accelerate.utils import gather_object

        names = sorted(set(gather_object(names)))
    sums, counts = sums_by_name(run, {n: sum(values.get(n, [])) for n in names},
                                {n: len(values.get(n, [])) for n in names})
    return {n: sums[n] / counts[n] for n in names if counts[n]}
