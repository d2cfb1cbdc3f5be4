"""The online update, read as CleanRL's `ppo.py` reads it: epochs → shuffle → minibatches → loss → backward → clip →
step → `algo.target_kl` break. Counting over processes is `trainers.processes`' (one global share of the tokens and
sequences per minibatch, sums by name); the arithmetic is `losses.policy`'s and `losses.aggregate`'s.

Only the policy's own tokens take a loss: the experience's `loss_mask` is 0 off the rollout's action mask, so a
tool result takes no policy loss, no KL term, no entropy bonus and no value loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from rlhfkit.critic import critic_values
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.policy import policy_objective, value_loss
from rlhfkit.models import rollout_logprobs
from rlhfkit.ops import masked_mean
from rlhfkit.trainers.experience import pad_to
from rlhfkit.trainers.optim import Fault, advance_schedule, optimizer_step
from rlhfkit.trainers.processes import global_share, sums_by_name
from rlhfkit.types import Experience


@dataclass
class Tally:
    """Loss-mask-weighted sums of an update's metrics on this process, and the sampler gap's sums."""

    sums: dict[str, float] = field(default_factory=dict)  # metric -> Σ value · weight
    weight: float = 0.0
    gap: float = 0.0  # Σ |log π − log π_sampler| over the first minibatch's action tokens
    gap_tokens: float = 0.0

    def add(self, metrics: dict[str, torch.Tensor], weight: float) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * weight
        self.weight += weight


@dataclass(frozen=True)
class Update:
    """What an update measured: the loss metrics (means over every process), π_old's log-probs when the update's own
    forward made them (one pass), whether `algo.target_kl` stopped it early, and the fault that skipped the rest of
    the step, if any."""

    metrics: dict[str, float]
    old_logprobs: torch.Tensor | None
    fault: Fault | None
    early_stopped: bool = False


class PolicyUpdate:
    def __init__(self, cfg, algo, run, model, critic, shares_base: bool, optim, ptx, kl_control, one_pass: bool):
        """`model`/`critic`: the prepared policy and critic (None without one); `shares_base`: the critic is a second
        adapter on the policy's base, backpropagated on its own; `ptx`: the PPO-ptx term (`trainers.ptx`) or None;
        `kl_control`: β's controller, read when the KL is in the loss; `one_pass`: π_old is this update's own forward."""
        self.cfg, self.algo, self.run, self.model, self.critic = cfg, algo, run, model, critic
        self.shares_base, self.optim, self.ptx, self.kl_control, self.one_pass = shares_base, optim, ptx, kl_control, one_pass

    def __call__(self, exp: Experience, step: int) -> Update:
        """`algo.ppo_epochs` passes of `algo.num_minibatches` optimizer steps over the experience (step `step`,
        1-based). The `algo.target_kl` early stop reads the approx-KL of the whole minibatch, all processes, and
        advances the schedule past the updates it skips, as a fault does."""
        a = self.cfg.algo
        n, total = exp.loss_mask.shape[0], a.ppo_epochs * a.num_minibatches
        tally, norms, done = Tally(), [], 0
        kept = torch.zeros_like(exp.loss_mask) if self.one_pass else None  # π_old = this pass's own log-probs
        if self.ptx is not None:
            self.ptx.start_step()
        for module in (self.model, self.critic):
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
                    advance_schedule(self.optim, total - done)  # as a skip does: the LR follows the step number
                    return self.finish(tally, norms, kept, early_stopped=True)
        return self.finish(tally, norms, kept, early_stopped=False)

    def finish(self, tally: Tally, norms: list[float], kept, early_stopped: bool) -> Update:
        sums, own = sums_by_name(self.run, tally.sums,
                                 {"weight": tally.weight, "gap": tally.gap, "gap_tokens": tally.gap_tokens})
        metrics = {k: v / max(own["weight"], 1.0) for k, v in sums.items()}
        if own["gap_tokens"] > 0:
            metrics["policy/sampler_logprob_gap"] = own["gap"] / own["gap_tokens"]
        if self.ptx is not None:
            metrics.update(self.ptx.metrics())
        if norms:
            metrics["grad_norm"] = sum(norms) / len(norms)  # the mean over the step's updates
        metrics["policy/early_stopped"] = float(early_stopped)
        return Update(metrics, kept, None, early_stopped)

    def minibatch(self, exp: Experience, idx: torch.Tensor, tally: Tally, kept, gap: bool, update: int) -> tuple[bool, float]:
        """Backward of one minibatch, micro-batch by micro-batch, then of the ptx batch of the run's `update`-th
        optimizer step (0-based) if any; returns (a loss was non-finite on some process, the minibatch's approx-KL
        over every process). Gradients are all-reduced once, in the minibatch's last backward (`no_sync`)."""
        micro, agg = self.cfg.optim.per_device_batch_size, self.cfg.algo.loss_agg or self.algo.default_loss_agg
        share = global_share(self.run, {"tokens": exp.loss_mask[idx].sum(), "seqs": float(len(idx))})
        # clamp: a minibatch whose tokens are all masked out (every sample truncated) normalises by 1, not 0
        num_tokens, num_seqs = max(share["tokens"], 1.0), max(share["seqs"], 1.0)
        nonfinite, kl_weighted, weight = 0.0, 0.0, 0.0
        apart = self.critic is not None and self.shares_base
        for i in range(0, len(idx), micro):
            rows = idx[i : i + micro]
            batch = exp.select(rows).trimmed()  # at its own longest response
            last = i + micro >= len(idx) and self.ptx is None
            with self.no_sync(last or apart):
                loss, parts, logprobs, approxkl = self.policy_loss(batch, agg, num_tokens, num_seqs)
                if self.critic is not None and not apart:  # one backward of the sum
                    value_part, value_metrics = self.critic_loss(batch, num_tokens)
                    loss = loss + value_part
                    parts.update(value_metrics)
                # Backward even when the loss is not finite: every process runs the same collectives.
                nonfinite += float(not torch.isfinite(loss))
                self.run.backward(loss, last=last and not apart)
            if apart:
                # A shared-base critic's loss is backpropagated on its own, after the policy's: gradient
                # checkpointing recomputes each forward under the adapter active at backward time.
                value_part, value_metrics = self.critic_loss(batch, num_tokens)
                parts.update(value_metrics)
                nonfinite += float(not torch.isfinite(value_part))
                self.run.backward(value_part, last=last)
            if kept is not None:
                kept[rows] = pad_to(logprobs, kept.shape[1])
            if gap:
                on = batch.rollout.action_mask.float()
                tally.gap += float(((logprobs - batch.old_logprobs).abs() * on).sum())
                tally.gap_tokens += float(on.sum())
            w = float(batch.loss_mask.sum())
            tally.add(parts, w)
            kl_weighted, weight = kl_weighted + approxkl * w, weight + w
        if self.ptx is not None:  # PPO-ptx: + ptx_coef · NLL of this optimizer step's ptx batch
            nonfinite += self.ptx.backward(self.model, update, last=True)
        (control,) = sums_by_name(self.run, {"nonfinite": nonfinite, "approxkl": kl_weighted, "tokens": weight})
        return control["nonfinite"] > 0, control["approxkl"] / max(control["tokens"], 1.0)

    def no_sync(self, sync: bool):
        """DDP: no gradient all-reduce in a micro-batch's forward and backward unless `sync` (the minibatch's last, as
        the offline loop does). A shared-base critic, backpropagated apart from the policy through the policy's own
        base, always syncs."""
        stack = contextlib.ExitStack()
        for module in (self.model, self.critic):
            if module is not None:
                stack.enter_context(self.run.no_sync(module, sync))
        return stack

    def policy_loss(self, batch: Experience, agg: str, num_tokens: float, num_seqs: float):
        """(loss, metrics, this forward's detached log-probs, approx-KL) of a micro-batch, normalised by its
        minibatch's global counts (see losses.aggregate); Dr. GRPO's constant is `generation.max_new_tokens`, whatever
        width this rollout was padded to."""
        a, mask, temperature = self.cfg.algo, batch.loss_mask, self.cfg.generation.temperature
        logprobs, entropy = rollout_logprobs(self.model, batch.rollout, temperature, with_entropy=True) if a.entropy_coef \
            else (rollout_logprobs(self.model, batch.rollout, temperature), None)
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        per_token, m = policy_objective(
            logprobs, old, batch.advantages, clip_eps=a.clip_eps, clip_eps_high=a.clip_eps_high,
            dual_clip=a.dual_clip, ref_logprobs=batch.ref_logprobs if self.algo.kl_in_loss else None,
            kl_coef=self.kl_control.value, entropy=entropy, entropy_coef=a.entropy_coef)
        loss = aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                         max_len=self.cfg.generation.max_new_tokens)
        approxkl = masked_mean(m["approxkl"], mask)
        metrics = {"loss/policy_avg": masked_mean(m["surrogate"], mask), "policy/approxkl_avg": approxkl,
                   "policy/clipfrac_avg": masked_mean(m["clipfrac"], mask), "val/ratio": masked_mean(m["ratio"], mask)}
        if entropy is not None:
            metrics["policy/entropy_avg"] = masked_mean(entropy.detach(), mask)
        return loss, metrics, logprobs.detach(), float(approxkl)

    def critic_loss(self, batch: Experience, num_tokens: float):
        """Clipped value loss of a micro-batch (token mean over the minibatch's global token count), times vf_coef."""
        a, mask = self.cfg.algo, batch.loss_mask
        values = critic_values(self.critic, self.run.unwrap(self.critic), batch.rollout)
        vl, vm = value_loss(values, batch.values, batch.returns, clip_range_value=a.clip_range_value)
        loss = a.vf_coef * aggregate(vl, mask, "token-mean", num_tokens=num_tokens)
        return loss, {"loss/value_avg": masked_mean(vl.detach(), mask), "val/clipfrac_avg": masked_mean(vm["clipfrac"], mask)}
