"""Online RL: one loop for PPO, RLOO, GRPO (Dr.GRPO, DAPO) and REINFORCE++.

Each step reads like the algorithm box of a paper:
  1. sample k responses per prompt (`generation.generate`);
  2. score them once per rollout batch (reward model(s) or a Python function), penalise a missing EOS, normalise
     and clip;
  3. old / reference log-probs and critic values in no-grad forwards without dropout (fp32 log-probs);
  4. per-token rewards with the KL penalty, then advantages from the algorithm's estimator (steps 1-4:
     `experience.make_experience`, the one place an `Experience` is built);
  5. `ppo_epochs` passes of minibatch updates of `losses.policy.policy_objective` (+ value loss, + the PPO-ptx term
     of `trainers.ptx` with data.ptx), each applied by `optimizer_step`, stopping early when approx-KL passes
     `algo.target_kl`; a non-finite rollout, loss or gradient skips the step's remaining updates (the schedule
     advances past them);
  6. update the KL controller, log, checkpoint.
What differs between methods is data in `rlhfkit.algorithms.Algorithm`; this file never branches on a name.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.policy import policy_objective, value_loss
from rlhfkit.models import SharedBaseCritic
from rlhfkit.ops import masked_mean
from rlhfkit.rewards import token_scores
from rlhfkit.trainers.experience import make_experience, pad_to, policy_stats, token_kl
from rlhfkit.trainers.online_setup import OnlineModels
from rlhfkit.trainers.optim import Fault, advance_schedule, optimizer_step
from rlhfkit.types import Experience, Rollout


@dataclass
class Tally:
    """Loss-mask-weighted sums of an update's metrics on this process, and the sampler gap's sums."""

    sums: dict[str, float] = field(default_factory=dict)  # metric -> Σ value · weight
    weight: float = 0.0
    gap: float = 0.0  # Σ |log π − log π_sampler| over the first minibatch's response tokens
    gap_tokens: float = 0.0

    def add(self, metrics: dict[str, torch.Tensor], weight: float) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * weight
        self.weight += weight


@dataclass(frozen=True)
class Update:
    """What `update` measured: the loss metrics (means over every process), π_old's log-probs when the update's own
    forward made them (one pass), and the fault that skipped the rest of the step, if any."""

    metrics: dict[str, float]
    old_logprobs: torch.Tensor | None
    fault: Fault | None


class OnlineTrainer(OnlineModels):
    """The online loop. Models, data, checkpoints and resume are `OnlineModels`' (the setup); this class is the step."""

    # 2-4. Forwards the experience reads ------------------------------------------------------------------------
    def values_of(self, critic, ro: Rollout):
        """(B, R) values V(s_t) of the state before each response token, from `critic` (the prepared critic for the
        update, its unwrapped module for no-grad forwards)."""
        if isinstance(self.run.unwrap(critic), SharedBaseCritic):
            v = critic(ro.input_ids, ro.attention_mask)  # (B, T)
        else:
            v = token_scores(critic, ro.input_ids, ro.attention_mask)  # (B, T)
        return v[:, ro.prompt_ids.shape[1] - 1 : -1] * ro.response_mask

    # 5. Updates -----------------------------------------------------------------------------------------------
    def update(self, exp: Experience, step: int) -> Update:
        """`algo.ppo_epochs` passes of `algo.num_minibatches` optimizer steps over the experience (step `step`,
        1-based). Early stopping on `algo.target_kl` reads the approx-KL of the whole minibatch, all processes."""
        a = self.cfg.algo
        n, total = exp.loss_mask.shape[0], a.ppo_epochs * a.num_minibatches
        tally, norms, early_stopped, done = Tally(), [], 0.0, 0
        kept = torch.zeros_like(exp.loss_mask) if self.one_pass else None  # π_old = this pass's own log-probs
        if self.ptx is not None:
            self.ptx.start_step()
        for module in (self.model, self.value):
            if module is not None:
                module.train()
        for epoch in range(a.ppo_epochs):
            perm = torch.randperm(n, device=exp.loss_mask.device)
            for m in range(a.num_minibatches):
                idx = perm[m * (n // a.num_minibatches) : (m + 1) * (n // a.num_minibatches)]
                # π_old from the sampler: its gap to the training forward, read where the weights are still the
                # sampler's (the first minibatch of the first epoch).
                gap = a.old_logprob_source == "sampler" and not self.one_pass and epoch == m == 0
                nonfinite, approxkl = self.minibatch(exp, idx, tally, kept, gap, (step - 1) * total + done)
                result = optimizer_step(self.optim, step, Fault.LOSS if nonfinite else None, schedule_steps=total - done)
                done += 1
                if result.fault is not None:
                    return Update({}, None, result.fault)
                if result.grad_norm is not None:
                    norms.append(result.grad_norm)  # global already: the same on every process
                if a.target_kl is not None and approxkl > a.target_kl:
                    early_stopped = 1.0
                    advance_schedule(self.optim, total - done)  # as a skip does: the LR follows the step number
                    break
            if early_stopped:
                break
        metrics = self.reduce_tally(tally)
        if self.ptx is not None:
            metrics.update(self.ptx.metrics())
        if norms:
            metrics["grad_norm"] = sum(norms) / len(norms)  # the mean over the step's updates
        return Update({**metrics, "policy/early_stopped": early_stopped}, kept, None)

    def minibatch(self, exp: Experience, idx: torch.Tensor, tally: Tally, kept, gap: bool, update: int) -> tuple[bool, float]:
        """Backward of one minibatch, micro-batch by micro-batch, then of the ptx batch of the run's `update`-th
        optimizer step (0-based) if any; returns (a loss was non-finite on some process, the minibatch's approx-KL
        over every process)."""
        micro, agg = self.cfg.optim.per_device_batch_size, self.cfg.algo.loss_agg or self.algo.default_loss_agg
        num_tokens, num_seqs = self.global_counts(exp.loss_mask[idx])
        control = torch.zeros(3, device=idx.device)  # non-finite losses, approx-KL · tokens, tokens (this process)
        for i in range(0, len(idx), micro):
            rows = idx[i : i + micro]
            batch = exp.select(rows).trimmed()  # at its own longest response
            loss, parts, logprobs = self.policy_loss(batch, agg, num_tokens, num_seqs)
            last, apart = i + micro >= len(idx) and self.ptx is None, self.value is not None and self.shares_base
            if self.value is not None and not apart:  # one backward of the sum
                value_part, value_metrics = self.critic_loss(batch, num_tokens)
                loss = loss + value_part
                parts.update(value_metrics)
            # Backward even when the loss is not finite: every process runs the same collectives.
            control[0] += float(not torch.isfinite(loss))
            self.run.backward(loss, last=last and not apart)
            if apart:
                # A shared-base critic's loss is backpropagated on its own, after the policy's: gradient
                # checkpointing recomputes each forward under the adapter active at backward time.
                value_part, value_metrics = self.critic_loss(batch, num_tokens)
                parts.update(value_metrics)
                control[0] += float(not torch.isfinite(value_part))
                self.run.backward(value_part, last=last)
            if kept is not None:
                kept[rows] = pad_to(logprobs, kept.shape[1])
            if gap:
                on = batch.rollout.response_mask.float()
                tally.gap += float(((logprobs - batch.old_logprobs).abs() * on).sum())
                tally.gap_tokens += float(on.sum())
            w = float(batch.loss_mask.sum())
            tally.add(parts, w)
            control[1:] += torch.tensor([float(parts["policy/approxkl_avg"]) * w, w], device=control.device)
        if self.ptx is not None:  # PPO-ptx: + ptx_coef · NLL of this optimizer step's ptx batch
            control[0] += self.ptx.backward(self.model, update, last=True)
        control = self.run.sum_over_processes(control)
        return bool(control[0] > 0), float(control[1] / control[2].clamp(min=1.0))

    def global_counts(self, mask: torch.Tensor) -> tuple[float, float]:
        """(tokens, sequences) of a minibatch over every process, divided by the world size: DDP averages gradients,
        so each process normalises by its share of the global counts."""
        counts = self.run.sum_over_processes(torch.stack([mask.sum(), torch.tensor(float(mask.shape[0]), device=mask.device)]))
        tokens, seqs = (counts / self.world).clamp(min=1).tolist()
        return tokens, seqs

    def reduce_tally(self, tally: Tally) -> dict[str, float]:
        """The tally's weighted means over every process (the same keys on every process)."""
        keys = sorted(tally.sums)
        totals = torch.tensor([tally.sums[k] for k in keys] + [tally.weight, tally.gap, tally.gap_tokens])
        totals = self.run.sum_over_processes(totals.to(self.accelerator.device)).tolist()
        out = {k: totals[i] / max(totals[-3], 1.0) for i, k in enumerate(keys)}
        if totals[-1] > 0:
            out["policy/sampler_logprob_gap"] = totals[-2] / totals[-1]
        return out

    def policy_loss(self, batch: Experience, agg: str, num_tokens: float, num_seqs: float):
        """(loss, metrics, this forward's detached log-probs) of a micro-batch, normalised by its minibatch's global
        counts (see losses.aggregate); Dr. GRPO's constant is `generation.max_new_tokens`, whatever width this rollout
        was padded to."""
        a, mask = self.cfg.algo, batch.loss_mask
        logprobs, entropy = self.response_logprobs(self.model, batch.rollout, with_entropy=True) if a.entropy_coef \
            else (self.response_logprobs(self.model, batch.rollout), None)
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        per_token, m = policy_objective(
            logprobs, old, batch.advantages, clip_eps=a.clip_eps, clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip, ref_logprobs=batch.ref_logprobs if self.algo.kl_in_loss else None,
            kl_coef=self.kl_ctl.value, entropy=entropy, entropy_coef=a.entropy_coef)
        loss = aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                         max_len=self.cfg.generation.max_new_tokens)
        metrics = {"loss/policy_avg": masked_mean(m["surrogate"], mask), "policy/approxkl_avg": masked_mean(m["approxkl"], mask),
                   "policy/clipfrac_avg": masked_mean(m["clipfrac"], mask), "val/ratio": masked_mean(m["ratio"], mask)}
        if entropy is not None:
            metrics["policy/entropy_avg"] = masked_mean(entropy.detach(), mask)
        return loss, metrics, logprobs.detach()

    def critic_loss(self, batch: Experience, num_tokens: float):
        """Clipped value loss of a micro-batch (token mean over the minibatch's global token count), times vf_coef."""
        a, mask = self.cfg.algo, batch.loss_mask
        vl, vm = value_loss(self.values_of(self.value, batch.rollout), batch.values, batch.returns, clip_range_value=a.clip_range_value)
        loss = a.vf_coef * aggregate(vl, mask, "token-mean", num_tokens=num_tokens)
        return loss, {"loss/value_avg": masked_mean(vl.detach(), mask), "val/clipfrac_avg": masked_mean(vm["clipfrac"], mask)}

    # The loop ------------------------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Each step: sample → score → advantages → K epochs of updates → β, log, checkpoint."""
        a = self.cfg.algo
        with self.run as run:
            self.setup()
            run.begin(self.start_step, self.total_steps, self.steps_per_epoch)
            self.history, self.raised = self.logged_rows(), set()  # the run's rows so far, for the alarms
            for step in range(self.start_step, self.total_steps):
                lr, kl_coef, t0 = self.optim.lr, self.kl_ctl.value, time.perf_counter()
                made = make_experience(self, step)  # 1-4. sample, score, no-grad forwards, advantages
                t1 = time.perf_counter()
                if made.fault is not None:
                    optimizer_step(self.optim, step + 1, made.fault, schedule_steps=a.ppo_epochs * a.num_minibatches)
                    update = Update({}, None, made.fault)
                else:
                    update = self.update(made.experience, step + 1)  # 5. updates
                stats, kl, seq_kl = dict(made.stats), made.kl, seq_kl_of(made, update)
                if update.old_logprobs is not None:  # π_old came from the update's forward
                    figures = policy_stats(run, made.experience, kl_coef, old_logprobs=update.old_logprobs, kl=seq_kl)
                    stats.update(figures.stats)
                    kl = figures.kl
                if update.fault is None and kl is not None:  # 6. β follows the KL over every process (adaptive)
                    self.kl_ctl.update(kl, made.experience.rollout.response_ids.shape[0] * self.world)
                stats.update(update.metrics, lr=lr, episodes=(step + 1) * a.rollout_batch_size
                             * self.cfg.generation.num_samples * self.world,
                             **{"faults/skipped_total": self.optim.bad_steps, "time/rollout_s": t1 - t0,
                                "time/update_s": time.perf_counter() - t1})
                self.end_step(step + 1, made.experience, stats, update.fault is not None, seq_kl)
                if run.stopping:  # a callback stopped the run (end_step wrote its checkpoint)
                    break
            run.finish(self.model, run.unwrap(self.model), self.tokenizer)
            return self.last


def seq_kl_of(made, update: Update) -> torch.Tensor | None:
    """(B,) the step's sequence KL for the samples file: the experience's, or the one-pass update's."""
    exp = made.experience
    if exp is None:
        return None
    if update.old_logprobs is None:
        return exp.kl
    kl = token_kl(update.old_logprobs, exp.ref_logprobs, exp.rollout.response_mask.float())
    return kl.sum(1) if kl is not None else None
