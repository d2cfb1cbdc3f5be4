"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792, Alg. 1;
TRL's experimental `OnlineDPOTrainer`): `rlhfkit online_dpo`.

Each step:
  1. sample two responses per prompt from the current policy (the online loop's `prompts_for` and `sample`);
  2. score them with the reward sources (`rewards.Rewards`: reward models, functions, several with weights), penalise
     a missing EOS, and rank each pair (`losses.online_preference.rank_pairs`); ties are dropped and counted;
  3. the reference's log-probs in a no-grad forward (the base with LoRA disabled, or a frozen copy);
  4. one optimizer step (`optimizer_step`) on the DPO family's loss over the fresh pairs
     (`online_pair_loss` → `preference_loss`: sigmoid, IPO or hinge), + PPO-ptx with data.ptx;
  5. log (TRL's online-DPO metric names), write samples, raise the alarms, checkpoint — the online loop's `end_step`.
Setup, checkpoints and resume are `OnlineModels`' (the online loop's).

Labels from a Bradley–Terry judge (P(y1 ≻ y2) = σ(r1 − r2)) make the fixed point π* ∝ π_ref · exp(r/β), the
KL-regularised optimum. Hard labels (the argmax of a deterministic r, as a reward model ranks) have another fixed
point: every unequal pair's label is then certain, so the sigmoid loss keeps widening its log-ratio margin and the
policy collapses toward r's argmax (IPO instead pulls each margin to 1/(2β)); tests/unit/test_online_dpo.py shows both.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from rlhfkit.advantages import penalize_missing_eos
from rlhfkit.config import OnlineDPOConfig
from rlhfkit.kl import FixedKLController
from rlhfkit.losses.online_preference import Pairs, online_pair_loss, rank_pairs
from rlhfkit.objects import Objects
from rlhfkit.models import Reference, disable_dropout, load_causal_lm, rollout_logprobs
from rlhfkit.reward_functions import source_stats, trainer_state
from rlhfkit.rewards import Rewards, RunningMoments
from rlhfkit.trainers.experience import logged_means, pad_to, rollout_stats
from rlhfkit.trainers.online_setup import OnlineModels
from rlhfkit.trainers.optim import Fault, build_optimizer, build_scheduler, optimizer_step
from rlhfkit.trainers.run import Run
from rlhfkit.types import Rollout

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "objective/scores_margin", "loss/policy_avg")


@dataclass(frozen=True)
class Sampled:
    """A step's samples as the online loop's logging reads them: the rollout (two rows per prompt) and its (B,) raw
    scores; with the (B, R) reference log-probs and the ranked pairs the update reads."""

    rollout: Rollout
    scores: torch.Tensor  # (B,)
    ref_logprobs: torch.Tensor  # (B, R)
    pairs: Pairs


class OnlineDPOTrainer(OnlineModels):
    cfg: OnlineDPOConfig

    def __init__(self, cfg: OnlineDPOConfig, objects: Objects | None = None):
        """`objects`: what the Python API was given (`rlhfkit.train`): model, tokenizer, reward sources, callbacks."""
        self.cfg, self.objects = cfg, objects or Objects()
        self.run = Run(cfg, "online_dpo", self.objects.callbacks)  # the lock taken and output_dir checked first

    def build(self) -> None:
        """Policy, reference, reward sources, optimizer and schedule (one optimizer step per rollout)."""
        cfg, a, acc = self.cfg, self.cfg.algo, self.accelerator
        policy = load_causal_lm(cfg.model, self.tokenizer, given=self.objects.model)
        frozen = self.run.frozen_dtype
        self.ref = Reference(cfg.model, a.ref_model, policy, self.tokenizer, acc.device, frozen, copy_of=self.objects.model)
        self.reward = Rewards(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size * 2,
                              policy_name=cfg.model.name_or_path, dtype=frozen, given=self.objects.reward_funcs,
                              given_weights=self.objects.reward_weights,
                              attn_implementation=cfg.model.attn_implementation)
        if a.disable_dropout:
            disable_dropout(policy)
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / (a.rollout_batch_size * self.world)))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        optimizer = build_optimizer(policy, cfg)
        scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        self.model, optimizer = acc.prepare(policy, optimizer)
        self.value, self.shares_base = None, False  # no critic
        self.optim = self.run.make_optim(optimizer, scheduler, [self.model])
        self.ptx = self.make_ptx(2 * a.rollout_batch_size)
        # β is fixed; the checkpoint keeps the KL controller and reward moments as the online loop's does.
        self.kl_ctl, self.moments = FixedKLController(a.beta), RunningMoments()

    # 1-3. Sample, score, rank, reference ---------------------------------------------------------------------------
    @torch.no_grad()
    def make_pairs(self, step: int) -> tuple[Sampled | None, dict[str, float]]:
        """Step `step`'s pairs, or None when the rollout, a score or a reference log-prob is not finite on any
        process; and the rollout's statistics (over every process)."""
        cfg, run = self.cfg, self.run
        prompts, examples = self.prompts_for(step)
        t0 = time.perf_counter()
        ro = self.sample(prompts.to(self.accelerator.device), step)
        stats: dict[str, float] = {"time/generate_s": time.perf_counter() - t0}
        if not run.on_every_process(ro is not None):
            return None, stats
        rows = [e for e in examples for _ in range(2)]
        state = trainer_state(step, self.total_steps)
        scored = self.reward(ro, rows, state)
        stats.update(source_stats({name: run.gather(v) for name, v in scored.per_source.items()}))
        shaped = penalize_missing_eos(scored.total, ro.has_eos, cfg.reward.missing_eos_penalty)
        policy, mb = run.unwrap(self.model), 2 * cfg.optim.per_device_batch_size
        policy.eval()
        ref = torch.cat([pad_to(self.ref.rollout_logprobs(policy, ro.select(slice(i, i + mb)).trimmed(), cfg.generation.temperature),
                                ro.response_ids.shape[1]) for i in range(0, ro.response_ids.shape[0], mb)])
        sampled = Sampled(ro, scored.total, ref, rank_pairs(shaped))
        stats.update(rollout_stats(self, sampled, rows, state))
        logged, self.sample_extras = self.reward.logs.take()  # log_metric / log_extra
        stats.update(logged_means(run, logged))
        if not run.on_every_process(bool(torch.isfinite(shaped).all() and torch.isfinite(ref).all())):
            return None, stats
        return sampled, stats

    # 4. The update ---------------------------------------------------------------------------------------------------
    def update(self, s: Sampled, step: int) -> tuple[dict[str, float], Fault | None]:
        """One optimizer step on the step's kept pairs (micro-batches of per_device_batch_size pairs; step `step`
        1-based); its metrics over every process. With no pair kept anywhere the forwards run without gradient and
        the step applies nothing (no gradient) but advances the schedule."""
        cfg, run, a = self.cfg, self.run, self.cfg.algo
        kept_total = float(run.sum_over_processes(s.pairs.kept.float().sum()))
        train = kept_total > 0
        model = self.model if train else run.unwrap(self.model)
        model.train()
        if self.ptx is not None:
            self.ptx.start_step()
        pairs_per, n = cfg.optim.per_device_batch_size, s.pairs.kept.shape[0]
        sums = torch.zeros(len(PAIR_METRICS) + 4, device=s.scores.device)  # the metrics, KL, entropy, kept, nonfinite
        for i in range(0, n, pairs_per):
            rows = torch.arange(2 * i, 2 * min(i + pairs_per, n), device=s.scores.device)
            pairs = micro_pairs(s.pairs, i, min(i + pairs_per, n))
            with torch.set_grad_enabled(train):
                ro = s.rollout.select(rows).trimmed()
                logprobs = rollout_logprobs(model, ro, cfg.generation.temperature)  # (2b, r)
                mask = ro.response_mask.float()
                seq, ref = (logprobs * mask).sum(1), (s.ref_logprobs[rows, : mask.shape[1]] * mask).sum(1)  # (2b,)
                loss, m = online_pair_loss(seq, ref, pairs, loss_type=a.loss_type, beta=a.beta,
                                           num_pairs=max(kept_total / self.world, 1e-8))
            if train:
                run.backward(loss, last=i + pairs_per >= n and self.ptx is None)
            m["objective/scores_margin"] = s.scores[pairs.chosen + 2 * i] - s.scores[pairs.rejected + 2 * i]
            m["loss/policy_avg"] = m.pop("loss")
            kept = pairs.kept.float()
            sums[: len(PAIR_METRICS)] += torch.stack([(m[k].float() * kept).sum() for k in PAIR_METRICS])
            kl = (seq - ref).detach()
            sums[-4:] += torch.stack([kl.sum(), -seq.detach().sum(), kept.sum(), (~torch.isfinite(loss)).float()])
        if self.ptx is not None and train:
            sums[-1] += self.ptx.backward(self.model, step - 1, last=True)
        sums = run.sum_over_processes(sums)
        result = optimizer_step(self.optim, step, Fault.LOSS if sums[-1] > 0 else None)
        samples = 2 * n * self.world
        metrics = {k: float(sums[j] / sums[-2].clamp(min=1)) for j, k in enumerate(PAIR_METRICS)} if train else {}
        metrics.update({"objective/kl": float(sums[-4]) / samples, "objective/entropy": float(sums[-3]) / samples,
                        "objective/tie_rate": 1.0 - float(sums[-2]) / (samples / 2), "beta": a.beta})
        if self.ptx is not None and train:
            metrics.update(self.ptx.metrics())
        if result.grad_norm is not None and train:
            metrics["grad_norm"] = result.grad_norm
        return metrics, result.fault

    # The loop --------------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Each step: sample two per prompt → score and rank → one DPO update → log, checkpoint."""
        a = self.cfg.algo
        with self.run as run:
            self.setup()
            run.begin(self.start_step, self.total_steps, self.steps_per_epoch)
            self.history, self.raised = self.logged_rows(), set()
            for step in range(self.start_step, self.total_steps):
                lr, t0 = self.optim.lr, time.perf_counter()
                sampled, stats = self.make_pairs(step)
                t1 = time.perf_counter()
                if sampled is None:
                    fault = optimizer_step(self.optim, step + 1, Fault.ROLLOUT).fault
                else:
                    metrics, fault = self.update(sampled, step + 1)
                    stats.update(metrics)
                    kl = stats["objective/kl"]
                    stats.update({"objective/non_score_reward": -a.beta * kl,
                                  "objective/rlhf_reward": stats["objective/scores"] - a.beta * kl})
                stats.update(lr=lr, episodes=(step + 1) * a.rollout_batch_size * 2 * self.world,
                             **{"faults/skipped_total": self.optim.bad_steps, "time/rollout_s": t1 - t0,
                                "time/update_s": time.perf_counter() - t1})
                self.end_step(step + 1, sampled, stats, fault is not None, None)
                if run.stopping:  # a callback stopped the run (end_step wrote its checkpoint)
                    break
            run.finish(self.model, run.unwrap(self.model), self.tokenizer)
            return self.last


def micro_pairs(pairs: Pairs, start: int, stop: int) -> Pairs:
    """Pairs start..stop-1, their row indices made relative to the micro-batch's first row (2·start)."""
    return Pairs(chosen=pairs.chosen[start:stop] - 2 * start, rejected=pairs.rejected[start:stop] - 2 * start,
                 kept=pairs.kept[start:stop])
