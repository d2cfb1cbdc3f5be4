"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792, Alg. 1;
TRL's experimental `OnlineDPOTrainer`): `rlhfkit online_dpo`.

Each step:
  1. roll out two responses per prompt from the current policy (the rollout component, `rlhfkit.rollout`);
  2. score them with the reward sources (`rewards.Rewards`: reward models, functions, several with weights), penalise
     a missing EOS, and rank each pair (`losses.online_preference.rank_pairs`); ties are dropped and counted;
  3. the reference's log-probs in a no-grad forward (the base with LoRA disabled, or a frozen copy);
  4. one optimizer step (`optimizer_step`) on the DPO family's loss over the fresh pairs
     (`online_pair_loss` → `preference_loss`: sigmoid, IPO or hinge), + PPO-ptx with data.ptx;
  5. log (TRL's online-DPO metric names), write samples, raise the alarms, checkpoint (`online_setup.StepLog`).
Steps 1-3 go through the parts the experience maker uses (`trainers.experience.Sampling`). The data, the prompt
stream and the step log are the services the other online loop calls too (`trainers.online_setup`).

Labels from a Bradley–Terry judge (P(y1 ≻ y2) = σ(r1 − r2)) make the fixed point π* ∝ π_ref · exp(r/β), the
KL-regularised optimum. Hard labels (the argmax of a deterministic r, as a reward model ranks) have another fixed
point: every unequal pair's label is then certain, so the sigmoid loss keeps widening its log-ratio margin and the
policy collapses toward r's argmax (IPO instead pulls each margin to 1/(2β)); tests/unit/test_online_dpo.py shows both.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from rlhfkit.advantages import penalize_missing_eos
from rlhfkit.config import OnlineDPOConfig
from rlhfkit.losses.online_preference import Pairs, online_pair_loss, rank_pairs
from rlhfkit.models import Reference, disable_dropout, load_causal_lm, rollout_logprobs
from rlhfkit.objects import Objects
from rlhfkit.reward_functions import trainer_state
from rlhfkit.rewards import Rewards
from rlhfkit.rollout.maker import environment_rewards, rollout_maker
from rlhfkit.trainers.experience import logged_means, rollout_stats
from rlhfkit.trainers.sampling import Sampling
from rlhfkit.trainers.held_out import HeldOutEval
from rlhfkit.trainers.online_setup import (PromptStream, Samples, StepLog, load_online_data, policy_is_finite,
                                           total_steps_of)
from rlhfkit.trainers.optim import Fault, build_optimizer, build_scheduler, optimizer_step
from rlhfkit.trainers.processes import global_share, sums_by_name
from rlhfkit.trainers.ptx import Ptx
from rlhfkit.trainers.run import Run
from rlhfkit.types import Rollout

PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected", "objective/scores_margin", "loss/policy_avg")


@dataclass(frozen=True)
class Sampled:
    """A step's pairs: the rollout (two rows per prompt), its (B,) raw scores, the (B, R) reference log-probs and the
    ranked pairs the update reads; each row's prompt example and the `log_extra` columns, for the sample rows."""

    rollout: Rollout
    scores: torch.Tensor  # (B,)
    ref_logprobs: torch.Tensor  # (B, R)
    pairs: Pairs
    examples: list[dict]
    extras: dict[str, list]


class OnlineDPOTrainer:
    def __init__(self, cfg: OnlineDPOConfig, objects: Objects | None = None):
        """`objects`: what the Python API was given (`rlhfkit.train`): model, tokenizer, reward sources, callbacks."""
        self.cfg, self.objects = cfg, objects or Objects()
        self.run = Run(cfg, "online_dpo", self.objects.callbacks)  # the lock taken and output_dir checked first

    def setup(self) -> None:
        """Tokenizer and data; accelerate, policy, reference, reward sources, optimizer; resume."""
        from accelerate.utils import set_seed

        cfg, run, a = self.cfg, self.run, self.cfg.algo
        set_seed(cfg.seed)
        data = load_online_data(cfg, self.objects)
        self.tokenizer = data.tokenizer
        acc = self.accelerator = run.make_accelerator()
        set_seed(cfg.seed)
        self.prompts = PromptStream(run, data.train_set, a.rollout_batch_size, self.tokenizer.pad_token_id)
        self.total_steps = total_steps_of(cfg, self.prompts.steps_per_epoch)
        policy = load_causal_lm(cfg.model, self.tokenizer, given=self.objects.model)
        self.ref = Reference(cfg.model, a.ref_model, policy, self.tokenizer, acc.device, run.frozen_dtype,
                             copy_of=self.objects.model)
        self.reward = Rewards(cfg.reward, self.tokenizer, acc.device, batch_size=cfg.optim.per_device_batch_size * 2,
                              policy_name=cfg.model.name_or_path, dtype=run.frozen_dtype, given=self.objects.reward_funcs,
                              given_weights=self.objects.reward_weights, attn_implementation=cfg.model.attn_implementation,
                              environment_rewards=environment_rewards(self.objects))
        if a.disable_dropout:
            disable_dropout(policy)
        optimizer = build_optimizer(policy, cfg)
        scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        self.model, optimizer = acc.prepare(policy, optimizer)
        self.optim = run.make_optim(optimizer, scheduler, [self.model])
        self.ptx = None if data.ptx_set is None else Ptx(data.ptx_set, a.ptx_coef, run, 2 * a.rollout_batch_size,
                                                        cfg.optim.per_device_batch_size, self.tokenizer.pad_token_id)
        self.parts = Sampling(rollout_maker(cfg, self.tokenizer, self.objects), self.reward, self.ref, run,
                              2 * cfg.optim.per_device_batch_size, cfg.generation.temperature)
        self.held_out = HeldOutEval(run, cfg, self.tokenizer, data.eval_prompts, data.capability, a.rollout_batch_size,
            self.objects)
        self.held_out.check_reference(self.ref)
        self.start_step = 0
        if run.resume_from:  # online DPO keeps no state beyond the run's own (β is fixed, scores are not normalised)
            state = run.resume([self.model], self.load_models, self.optim)
            self.start_step = int(state["step"])
            run.restore_rng(state)

    # 1-3. Roll out, score, rank, reference ----------------------------------------------------------------------------
    @torch.no_grad()
    def make_pairs(self, step: int) -> tuple[Sampled | None, dict[str, float]]:
        """Step `step`'s pairs, or None when the rollout, a score or a reference log-prob is not finite on any
        process; and the rollout's statistics (over every process)."""
        cfg, run = self.cfg, self.run
        prompts, examples = self.prompts(step)
        t0 = time.perf_counter()
        ro = self.parts.roll_out(self.model, prompts, examples, step)  # 1. roll out
        stats: dict[str, float] = {"time/generate_s": time.perf_counter() - t0}
        if not run.on_every_process(ro is not None):
            return None, stats
        rows = [e for e in examples for _ in range(2)]
        state = trainer_state(step, self.total_steps)
        scored, source_figures = self.parts.score(ro, rows, state)  # 2. score
        stats.update(source_figures)
        shaped = penalize_missing_eos(scored.total, ro.has_eos, cfg.reward.missing_eos_penalty)
        ref = self.parts.reference_logprobs(run.unwrap(self.model), ro)  # 3. the reference's forward
        stats.update(rollout_stats(run, self.reward, ro, scored.total, rows, state, cfg.algo.rollout_batch_size))
        logged, extras = self.reward.logs.take()  # log_metric / log_extra
        stats.update(logged_means(run, logged))
        if not run.on_every_process(bool(torch.isfinite(shaped).all() and torch.isfinite(ref).all())):
            return None, stats
        return Sampled(ro, scored.total, ref, rank_pairs(shaped), rows, extras), stats

    # 4. The update ---------------------------------------------------------------------------------------------------
    def update(self, s: Sampled, step: int) -> tuple[dict[str, float], Fault | None]:
        """One optimizer step on the step's kept pairs (micro-batches of per_device_batch_size pairs; step `step`
        1-based); its metrics over every process. With no pair kept anywhere the forwards run without gradient and
        the step applies nothing (no gradient) but advances the schedule. A pair's log-probs sum over the policy's
        own tokens (the action mask): a tool result is no part of what the policy chose."""
        cfg, run, a = self.cfg, self.run, self.cfg.algo
        kept_share = global_share(run, {"pairs": s.pairs.kept.float().sum()})["pairs"]
        train = kept_share > 0
        model = self.model if train else run.unwrap(self.model)
        model.train()
        if self.ptx is not None:
            self.ptx.start_step()
        pairs_per, n = cfg.optim.per_device_batch_size, s.pairs.kept.shape[0]
        sums: dict[str, torch.Tensor] = {k: torch.zeros((), device=s.scores.device) for k in (*PAIR_METRICS, "kl", "logps", "kept", "nonfinite")}
        for i in range(0, n, pairs_per):
            rows = torch.arange(2 * i, 2 * min(i + pairs_per, n), device=s.scores.device)
            pairs = micro_pairs(s.pairs, i, min(i + pairs_per, n))
            last = i + pairs_per >= n and self.ptx is None
            with torch.set_grad_enabled(train), run.no_sync(model, last or not train):
                ro = s.rollout.select(rows).trimmed()
                logprobs = rollout_logprobs(model, ro, cfg.generation.temperature)  # (2b, r)
                mask = ro.action_mask.float()
                seq, ref = (logprobs * mask).sum(1), (s.ref_logprobs[rows, : mask.shape[1]] * mask).sum(1)  # (2b,)
                # clamp: with no pair kept anywhere the loss is computed for its figures only
                loss, m = online_pair_loss(seq, ref, pairs, loss_type=a.loss_type, beta=a.beta, num_pairs=max(kept_share, 1e-8))
                if train:
                    run.backward(loss, last=last)
            m["objective/scores_margin"] = s.scores[pairs.chosen + 2 * i] - s.scores[pairs.rejected + 2 * i]
            m["loss/policy_avg"] = m.pop("loss")
            kept = pairs.kept.float()
            for k in PAIR_METRICS:
                sums[k] = sums[k] + (m[k].float() * kept).sum()
            sums["kl"] = sums["kl"] + (seq - ref).detach().sum()
            sums["logps"] = sums["logps"] + seq.detach().sum()
            sums["kept"] = sums["kept"] + kept.sum()
            sums["nonfinite"] = sums["nonfinite"] + float(not torch.isfinite(loss))
        if self.ptx is not None and train:
            sums["nonfinite"] = sums["nonfinite"] + self.ptx.backward(self.model, step - 1, last=True)
        (total,) = sums_by_name(run, sums)
        result = optimizer_step(self.optim, step, Fault.LOSS if total["nonfinite"] > 0 else None)
        samples = 2 * n * run.world
        metrics = {k: total[k] / max(total["kept"], 1.0) for k in PAIR_METRICS} if train else {}
        metrics.update({"objective/kl": total["kl"] / samples, "objective/entropy": -total["logps"] / samples,
                        "objective/tie_rate": 1.0 - total["kept"] / (samples / 2), "beta": a.beta})
        if self.ptx is not None and train:
            metrics.update(self.ptx.metrics())
        if result.grad_norm is not None and train:
            metrics["grad_norm"] = result.grad_norm
        return metrics, result.fault

    # The loop --------------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Each step: roll out two per prompt → score and rank → one DPO update → log, checkpoint."""
        a = self.cfg.algo
        with self.run as run:
            self.setup()
            run.begin(self.start_step, self.total_steps, self.prompts.steps_per_epoch)
            # After `begin`, which drops a resumed run's rows past its checkpoint: the alarms see the rows before it.
            self.log = StepLog(run, self.cfg, self.held_out, self.total_steps, self.start_step)
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
                stats.update(lr=lr, episodes=(step + 1) * a.rollout_batch_size * 2 * run.world,
                             **{"faults/skipped_total": self.optim.bad_steps, "time/rollout_s": t1 - t0,
                                "time/update_s": time.perf_counter() - t1})
                self.end_step(step + 1, sampled, stats, fault is not None)
                if run.stopping:  # a callback stopped the run (end_step wrote its checkpoint)
                    break
            run.finish(self.model, run.unwrap(self.model), self.tokenizer)
            return self.log.last

    def end_step(self, done: int, s: Sampled | None, stats: dict[str, float], bad: bool) -> None:
        samples = Samples(s.rollout, [e["prompt"] for e in s.examples], s.scores, None, s.extras) if s is not None else None
        self.log.record(done, stats, samples, lambda: self.held_out(done, self.model, self.ref, self.reward, self.total_steps))
        self.log.checkpoint(done, bad, lambda: policy_is_finite(self.run, self.model, s.rollout, 2 * self.cfg.optim.per_device_batch_size,
                                                                self.cfg.generation.temperature), self.checkpoint)

    def load_models(self, checkpoint: str) -> None:
        from rlhfkit.checkpoint import load_model_weights
        from rlhfkit.sharding import loaded_weights

        directory = os.path.join(checkpoint, "model")
        loaded_weights(self.accelerator, self.model, lambda m: load_model_weights(m, directory), self.run.unwrap(self.model))

    def checkpoint(self, step: int) -> None:
        from rlhfkit.models import save_model

        self.run.save_checkpoint(step, [self.model], lambda d, models: save_model(models[0], self.tokenizer, d, merge_lora=False),
                                 self.optim, {})


def micro_pairs(pairs: Pairs, start: int, stop: int) -> Pairs:
    """Pairs start..stop-1, their row indices made relative to the micro-batch's first row (2·start)."""
    return Pairs(chosen=pairs.chosen[start:stop] - 2 * start, rejected=pairs.rejected[start:stop] - 2 * start,
                 kept=pairs.kept[start:stop])
