"""The online update, read as CleanRL's `ppo.py` reads it: epochs → shuffle → minibatches → loss → backward → clip →
step → `algo.target_kl` break. Counting over processes is `trainers.processes`' (one global share of the tokens and
sequences per minibatch, sums by name); the arithmetic is `losses.policy`'s and `losses.aggregate`'s.

The policy loss is the registered objective `algo.policy_loss` (`losses.objectives`), called through the registry;
its masks and weights (top-entropy tokens, the off-policy sequence mask, the sampler-mismatch correction) are
`losses.correction`'s, and the adaptive entropy coefficient is `kl_control.AdaptiveEntropyController`'s, updated after
each optimizer step with that step's mean token entropy over every process.

Only the policy's own tokens take a loss: the experience's `loss_mask` is 0 off the rollout's action mask, so a
tool result takes no policy loss, no KL term, no entropy bonus and no value loss.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from rlhfkit.config.objective_check import objective_params
from rlhfkit.critic import SharedBaseCritic, critic_values
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.correction import off_policy_sequence_mask, rollout_correction, top_entropy_mask
from rlhfkit.losses.policy import get_objective, policy_objective, value_loss
from rlhfkit.models import rollout_logprobs, set_training
from rlhfkit.ops import masked_mean
from rlhfkit.trainers.experience import OldSource
from rlhfkit.trainers.sampling import pad_to
from rlhfkit.trainers.optim import Fault, advance_schedule, optimizer_step
from rlhfkit.trainers.processes import global_share, sums_by_name
from rlhfkit.types import Experience


@dataclass
class Tally:
    """Weighted sums of an update's metrics on this process — each micro-batch's mean weighted by what it averaged
    over (its loss tokens, or its sequences for a sequence-level figure), so that the update's figure is the mean over
    all of them however the minibatch was cut — and the sampler gap's sums. The micro-batches' figures are kept as
    they come, 0-d tensors on the device, and read back together once the update ends (`read_back`): no device
    sync per micro-batch and metric, and the same Python sums as reading each back on the spot."""

    values: dict[str, list] = field(default_factory=dict)  # metric -> each micro-batch's value
    weights: dict[str, list] = field(default_factory=dict)  # metric -> each micro-batch's weight
    gap: list = field(default_factory=list)  # |log π − log π_sampler| summed over each micro-batch's action tokens
    gap_tokens: list = field(default_factory=list)  # (first minibatch only)

    def add(self, metrics: dict, weight) -> None:
        """`metrics`: name -> a mean over `weight` tokens, or a (mean, its own weight) pair (0-d tensors or floats)."""
        for k, v in metrics.items():
            value, w = v if isinstance(v, tuple) else (v, weight)
            self.values.setdefault(k, []).append(value)
            self.weights.setdefault(k, []).append(w)

    def sums(self) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
        """({metric: Σ value · weight}, {metric: Σ weight}, the gap's {"gap", "gap_tokens"} sums) on this process."""
        names = list(self.values)
        read = read_back([self.values[k] for k in names] + [self.weights[k] for k in names] + [self.gap, self.gap_tokens])
        values, weights = read[: len(names)], read[len(names) : 2 * len(names)]
        sums = {k: sum(v * w for v, w in zip(vs, ws)) for k, vs, ws in zip(names, values, weights)}
        return sums, {k: sum(ws) for k, ws in zip(names, weights)}, {"gap": sum(read[-2]), "gap_tokens": sum(read[-1])}


def read_back(lists: list[list]) -> list[list[float]]:
    """Lists of 0-d tensors and Python numbers as lists of Python floats, every tensor read back in one transfer: each
    the value `float()` of it alone gives (the stack widens them to a common dtype that holds each exactly)."""
    tensors = [x.detach().reshape(()) for xs in lists for x in xs if isinstance(x, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist() if tensors else [])
    return [[float(next(read)) if isinstance(x, torch.Tensor) else float(x) for x in xs] for xs in lists]


def minibatch_sums(control: dict[str, list]) -> dict[str, float]:
    """A minibatch's control sums on this process from its micro-batches' figures (`PolicyUpdate.minibatch`): the
    non-finite losses, the approx-KL weighted by each micro-batch's loss tokens, and the entropy over the kept tokens."""
    read = dict(zip(control, read_back(list(control.values()))))
    return {"nonfinite": sum(read["nonfinite"]), "tokens": sum(read["tokens"]),
            "approxkl": sum(k * w for k, w in zip(read["approxkl"], read["tokens"])),
            "entropy": sum(read["entropy"]), "entropy_tokens": sum(read["entropy_tokens"])}


@dataclass(frozen=True)
class Update:
    """What an update measured: the loss metrics (means over every process), π_old's log-probs when the update's own
    forward made them (one pass), whether `algo.target_kl` stopped it early, and the fault that skipped the rest of
    the step, if any."""

    metrics: dict[str, float]
    old_logprobs: torch.Tensor | None
    fault: Fault | None
    early_stopped: bool = False


# The objectives' metrics (losses.objectives) and the names they are logged under (TRL's where TRL has the figure).
LOGGED = {"surrogate": "loss/policy_avg", "approxkl": "policy/approxkl_avg", "clipfrac": "policy/clipfrac_avg",
          "ratio": "val/ratio", "clip_low": "clip_ratio/low_mean", "clip_high": "clip_ratio/high_mean",
          "dual_clipfrac": "policy/dual_clipfrac_avg", "covfrac": "policy/cov_selected_frac", "phi": "vespo/phi_seq_mean",
          "kl": "policy/kl_term_avg"}
CORRECTION_LOGGED = {"mismatch_kl": "sampling/mismatch_kl", "logp_diff": "sampling/sampling_logp_difference/mean",
                     "corrected": "sampling/corrected_frac", "is_ratio": "sampling/importance_sampling_ratio/mean"}


def figure(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | float]:
    """A metric's (mean, what it averaged over), both left on the device (`Tally`): over the masked tokens for a
    (B, R) one, over the sequences for a (B, 1) one (as TRL logs them)."""
    x = x.detach()
    if x.shape[-1] == 1:
        return x.float().mean(), float(x.shape[0])
    return masked_mean(x, mask), mask.sum()


class PolicyUpdate:
    def __init__(self, cfg, algo, run, model, critic, shares_base: bool, optim, ptx, kl_control, old_source: OldSource,
                 entropy_control=None):
        """`model`/`critic`: the prepared policy and critic (None without one); `shares_base`: the critic is a second
        adapter on the policy's base, backpropagated on its own; `ptx`: the PPO-ptx term (`trainers.ptx`) or None;
        `kl_control`: β's controller, read when the KL is in the loss; `old_source`: where π_old comes from
        (`trainers.experience.old_logprob_source`; "update": this update's own forward);
        `entropy_control`: the adaptive entropy coefficient's controller, or None (a fixed `algo.entropy_coef`)."""
        self.cfg, self.algo, self.run, self.model, self.critic = cfg, algo, run, model, critic
        self.shares_base, self.optim, self.ptx, self.kl_control, self.old_source = shares_base, optim, ptx, kl_control, old_source
        self.entropy_control, self.params = entropy_control, objective_params(cfg.algo)
        self.objective = get_objective(cfg.algo.policy_loss)

    def __call__(self, exp: Experience, step: int) -> Update:
        """`algo.ppo_epochs` passes of `algo.num_minibatches` optimizer steps over the experience (step `step`,
        1-based). The `algo.target_kl` early stop reads the approx-KL of the whole minibatch, all processes, and
        advances the schedule past the updates it skips, as a fault does."""
        a = self.cfg.algo
        n, total = exp.loss_mask.shape[0], a.ppo_epochs * a.num_minibatches
        tally, norms, done = Tally(), [], 0
        kept = torch.zeros_like(exp.loss_mask) if self.old_source == "update" else None  # π_old = this pass's own log-probs
        if self.ptx is not None:
            self.ptx.start_step()
        for module in (self.model, self.critic):
            if module is not None:
                set_training(module, True)
        for epoch in range(a.ppo_epochs):
            perm = torch.randperm(n, device=exp.loss_mask.device)
            for m in range(a.num_minibatches):
                idx = perm[m * (n // a.num_minibatches) : (m + 1) * (n // a.num_minibatches)]
                # π_old from the sampler: its gap to the training forward, read where the weights are still the
                # sampler's (the first minibatch of the first epoch).
                gap = self.old_source == "sampler" and epoch == m == 0
                nonfinite, approxkl, entropy = self.minibatch(exp, idx, tally, kept, gap, (step - 1) * total + done)
                result = optimizer_step(self.optim, step, Fault.LOSS if nonfinite else None, schedule_steps=total - done)
                done += 1
                if result.fault is not None:
                    return Update({}, None, result.fault)
                if self.entropy_control is not None:
                    self.entropy_control.update(entropy)
                if result.grad_norm is not None:
                    norms.append(result.grad_norm)  # global already: the same on every process
                if a.target_kl is not None and approxkl > a.target_kl:
                    advance_schedule(self.optim, total - done)  # as a skip does: the LR follows the step number
                    return self.finish(tally, norms, kept, early_stopped=True)
        return self.finish(tally, norms, kept, early_stopped=False)

    def finish(self, tally: Tally, norms: list[float], kept, early_stopped: bool) -> Update:
        sums, weights, own = sums_by_name(self.run, *tally.sums())
        metrics = {k: v / max(weights[k], 1.0) for k, v in sums.items()}
        if own["gap_tokens"] > 0:
            metrics["policy/sampler_logprob_gap"] = own["gap"] / own["gap_tokens"]
        if self.ptx is not None:
            metrics.update(self.ptx.metrics())
        if norms:
            metrics["grad_norm"] = sum(norms) / len(norms)  # the mean over the step's updates
        metrics["policy/early_stopped"] = float(early_stopped)
        if self.entropy_control is not None:
            metrics["policy/entropy_coef"] = self.entropy_control.coef
        return Update(metrics, kept, None, early_stopped)

    def minibatch(self, exp: Experience, idx: torch.Tensor, tally: Tally, kept, gap: bool, update: int) -> tuple[bool, float, float]:
        """Backward of one minibatch, micro-batch by micro-batch, then of the ptx batch of the run's `update`-th
        optimizer step (0-based) if any; returns (a loss was non-finite on some process, the minibatch's approx-KL
        over every process, its mean token entropy over every process). Gradients are all-reduced once, in the
        minibatch's last backward (`no_sync`)."""
        micro = self.cfg.optim.per_device_batch_size
        # the reduction: the config's, else the objective's own (the paper's), else the algorithm's default
        agg = self.cfg.algo.loss_agg or self.objective.loss_agg or self.algo.default_loss_agg
        share = global_share(self.run, {"tokens": exp.loss_mask[idx].sum(), "seqs": float(len(idx))})
        # clamp: a minibatch whose tokens are all masked out (every sample truncated) normalises by 1, not 0
        num_tokens, num_seqs = max(share["tokens"], 1.0), max(share["seqs"], 1.0)
        # Each micro-batch's control figures, as they come (0-d tensors): read back together at the minibatch's end.
        control = {"nonfinite": [], "approxkl": [], "tokens": [], "entropy": [], "entropy_tokens": []}
        apart = self.critic is not None and self.shares_base
        for i in range(0, len(idx), micro):
            rows = idx[i : i + micro]
            batch = exp.select(rows).trimmed()  # at its own longest response
            last = i + micro >= len(idx) and self.ptx is None
            with self.no_sync(last or apart):
                loss, parts, logprobs, approxkl, ent = self.policy_loss(batch, agg, num_tokens, num_seqs)
                if ent is not None:
                    control["entropy"].append(ent[0])
                    control["entropy_tokens"].append(ent[1])
                if self.critic is not None and not apart:  # one backward of the sum
                    value_part, value_metrics = self.critic_loss(batch, num_tokens)
                    loss = loss + value_part
                    parts.update(value_metrics)
                # Backward even when the loss is not finite: every process runs the same collectives.
                control["nonfinite"].append(~torch.isfinite(loss))
                self.run.backward(loss, last=last and not apart)
            if apart:
                # A shared-base critic's loss is backpropagated on its own, after the policy's, its adapter active
                # through the backward: gradient checkpointing recomputes each forward under the adapter active then.
                critic = self.run.unwrap(self.critic)
                with critic.active() if isinstance(critic, SharedBaseCritic) else contextlib.nullcontext():
                    value_part, value_metrics = self.critic_loss(batch, num_tokens)
                    parts.update(value_metrics)
                    control["nonfinite"].append(~torch.isfinite(value_part))
                    self.run.backward(value_part, last=last)
            if kept is not None:
                kept[rows] = pad_to(logprobs, kept.shape[1])
            if gap:
                on = batch.rollout.action_mask.float()
                tally.gap.append(((logprobs - batch.old_logprobs).abs() * on).sum())
                tally.gap_tokens.append(on.sum())
            w = batch.loss_mask.sum()
            tally.add(parts, w)
            control["approxkl"].append(approxkl)
            control["tokens"].append(w)
        if self.ptx is not None:  # PPO-ptx: + ptx_coef · NLL of this optimizer step's ptx batch
            control["nonfinite"].append(self.ptx.backward(self.model, update, last=True))
        (total,) = sums_by_name(self.run, minibatch_sums(control))
        return (total["nonfinite"] > 0, total["approxkl"] / max(total["tokens"], 1.0),
                total["entropy"] / max(total["entropy_tokens"], 1.0))

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
        """(loss, metrics as {name: (mean, what it averaged over)}, this forward's detached log-probs, approx-KL,
        (Σ entropy, tokens) over the tokens the loss keeps or None without entropy) of a micro-batch — the figures 0-d
        tensors, not read back (`Tally`) — normalised by its minibatch's global
        counts (see losses.aggregate); Dr. GRPO's constant is `generation.max_new_tokens`, whatever width this
        rollout was padded to."""
        a, mask, temperature = self.cfg.algo, batch.loss_mask, self.cfg.generation.temperature
        control = self.entropy_control
        if a.entropy_coef or control is not None or a.top_entropy_quantile < 1:
            logprobs, entropy = rollout_logprobs(self.model, batch.rollout, temperature, with_entropy=True)
        else:
            logprobs, entropy = rollout_logprobs(self.model, batch.rollout, temperature), None
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        terms, metrics = self.masks_and_weights(batch, logprobs, old, entropy)
        per_token, m = policy_objective(
            logprobs, old, batch.advantages, mask, objective=self.objective.name, params=self.params,
            ref_logprobs=batch.ref_logprobs if self.algo.kl_in_loss else None, kl_coef=self.kl_control.value,
            bias_corrected_kl=a.bias_corrected_kl, entropy=entropy,
            entropy_coef=control.value if control is not None else a.entropy_coef, **terms)
        loss = aggregate(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs,
                         max_len=self.cfg.generation.max_new_tokens)
        metrics.update({LOGGED[k]: figure(v, mask) for k, v in m.items() if k in LOGGED})
        ent = None
        if entropy is not None:
            metrics["policy/entropy_avg"] = figure(entropy.detach(), mask)
            kept = mask.float() if terms.get("token_keep") is None else mask.float() * terms["token_keep"].float()
            ent = ((entropy.detach() * kept).sum(), kept.sum())
        return loss, metrics, logprobs.detach(), metrics["policy/approxkl_avg"][0], ent

    def masks_and_weights(self, batch: Experience, logprobs, old, entropy) -> tuple[dict, dict[str, tuple]]:
        """The keyword terms of `policy_objective` this config asks for — the top-entropy tokens (the quantile over
        every process's tokens of this micro-batch, as TRL), DeepSeek-V3.2's off-policy sequence mask, the
        sampler-mismatch weights — and their logged figures."""
        a, mask, sampler = self.cfg.algo, batch.loss_mask, batch.rollout.sampler_logprobs
        terms, metrics = {}, {}
        if a.top_entropy_quantile < 1:
            values = entropy.detach().float()[mask.bool()]
            if self.run.world > 1:  # every process's tokens: pad to one length, gather, drop the padding
                values = self.run.accelerator.gather(self.run.accelerator.pad_across_processes(values, pad_index=-1.0))
                values = values[values >= 0]  # an entropy is never negative: -1 marks the padding
            terms["token_keep"] = top_entropy_mask(entropy, mask, a.top_entropy_quantile, population=values)
            metrics["policy/entropy_kept_frac"] = figure(terms["token_keep"], mask)
        if a.off_policy_mask_threshold is not None:
            terms["sequence_keep"] = off_policy_sequence_mask(batch.advantages, logprobs, sampler, mask,
                                                              a.off_policy_mask_threshold)
            metrics["policy/off_policy_masked_frac"] = figure(1.0 - terms["sequence_keep"], mask)
        if a.rollout_correction != "none":
            weights, cm = rollout_correction(old, sampler, batch.rollout.action_mask, a.rollout_correction,
                                             a.rollout_correction_min, a.rollout_correction_max)
            terms["is_weights"] = weights
            metrics.update({CORRECTION_LOGGED[k]: figure(v, mask) for k, v in cm.items()})
        return terms, metrics

    def critic_loss(self, batch: Experience, num_tokens: float):
        """Clipped value loss of a micro-batch (token mean over the minibatch's global token count), times vf_coef."""
        a, mask = self.cfg.algo, batch.loss_mask
        values = critic_values(self.critic, self.run.unwrap(self.critic), batch.rollout)
        vl, vm = value_loss(values, batch.values, batch.returns, clip_range_value=a.clip_range_value)
        loss = a.vf_coef * aggregate(vl, mask, "token-mean", num_tokens=num_tokens)
        return loss, {"loss/value_avg": masked_mean(vl.detach(), mask), "val/clipfrac_avg": masked_mean(vm["clipfrac"], mask)}
