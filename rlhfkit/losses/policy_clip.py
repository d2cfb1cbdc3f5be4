"""The ratio-clipping family: PPO's clipped surrogate at token or sequence level (GSPO, LUSPO), GSPO-token, GMPO's
geometric mean clipped in log space, and SAPO's soft gate in place of the clip. Conventions: `losses.objectives`.

This module imports only torch.
"""

from __future__ import annotations

import torch

from rlhfkit.losses.objectives import (Objective, ObjectiveParams, base_metrics, importance_log_weight, log_ratio,
                                       register_objective, sequence_advantage, sequence_mean)

_CLIP = frozenset({"clip_eps", "clip_eps_high", "dual_clip", "delta"})


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float,
                      dual_clip: float | None = None, delta: float | None = None
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """max(-A·min(ρ, δ), -A·clip(ρ, 1 - ε_low, 1 + ε_high)), then the dual clip: the clipped surrogate of PPO
    (Schulman et al. 2017, arXiv 1707.06347, eq. 7, negated to a loss) with
      - Clip-Higher ε_high ≠ ε_low (DAPO, Yu et al. 2025, arXiv 2503.14476, §3.1);
      - the two-sided clip δ > 1 (INTELLECT-2, arXiv 2505.07291, §3.3): the unclipped ratio is capped at δ, so a
        negative-advantage token whose ratio exploded contributes a bounded loss with no gradient;
      - the dual clip c > 1 (Ye et al. 2020, arXiv 1912.09729): for A < 0 the loss is capped at -c·A.

    `ratio` and `advantages` broadcast (a sequence-level ratio is (B, 1)). Metrics: "clip_low" (ρ < 1 - ε_low and
    A < 0), "clip_high" (ρ > 1 + ε_high and A > 0), "clipfrac" their union — TRL's clip_ratio/{low,high,region}; the
    union is exactly where the clipped term is the active one — and "dual_clipfrac".
    """
    if not 0 < eps_low < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {eps_low}")
    if not eps_high > 0:
        raise ValueError(f"clip_eps_high must be > 0, got {eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if delta is not None and not delta > 1:
        raise ValueError(f"delta must be > 1, got {delta}")
    adv = advantages.float()
    unclipped = -adv * (ratio if delta is None else ratio.clamp(max=delta))
    loss = torch.maximum(unclipped, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))
    dual_active = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip  # > 0 where A < 0
        dual_active = (adv < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    with torch.no_grad():
        low, high = (ratio < 1 - eps_low) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)
        metrics = {"clip_low": low.float(), "clip_high": high.float(), "clipfrac": (low | high).float(),
                   "dual_clipfrac": dual_active.float()}
    return loss, metrics


def ppo_clip(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """PPO's clipped surrogate (`clipped_surrogate`) on the importance ratio of `p.level`:
      - "token": ρ_t = π(y_t) / π_old(y_t), TRL's loss_type grpo/dapo/bnpo/dr_grpo;
      - "sequence": GSPO's s_i = exp(1/|o_i| Σ_t log ρ_t) (Zheng et al. 2025, arXiv 2507.18071, eq. 7), with one
        advantage per sequence, clipped per sequence (eq. 5); TRL's importance_sampling_level="sequence".

    Returns the (B, R) loss (at sequence level the (B, 1) loss broadcast over the row) and the metrics of
    `clipped_surrogate` — (B, 1) at sequence level — plus "ratio" and "approxkl".
    """
    log_rho = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(importance_log_weight(log_rho, mask, p.level))
    adv = sequence_advantage(advantages, mask) if p.level == "sequence" else advantages
    loss, m = clipped_surrogate(ratio, adv, p.clip_eps, p.eps_high, p.dual_clip, p.delta)
    return loss.expand_as(log_rho), {**base_metrics(log_rho, ratio, m["clipfrac"]), **m}


def gspo_token(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """GSPO-token (Zheng et al. 2025, arXiv 2507.18071, eq. 13-14): s_{i,t} = sg[s_i] · π(y_t) / sg[π(y_t)], whose
    value is the sequence ratio s_i at every token and whose gradient is the token's, so each token may carry its own
    advantage A_{i,t}; clipped per token as `clipped_surrogate`. With A_{i,t} = A_i it equals GSPO in value and
    gradient (eq. 15). Accepts per-token advantages (GAE, REINFORCE++)."""
    log_rho = log_ratio(logprobs, old_logprobs)
    lp = logprobs.float()
    log_s = sequence_mean(log_rho, mask).detach() + lp - lp.detach()  # (B, R): value log s_i, gradient ∇log π(y_t)
    ratio = torch.exp(log_s)
    loss, m = clipped_surrogate(ratio, advantages, p.clip_eps, p.eps_high, p.dual_clip, p.delta)
    return loss, {**base_metrics(log_rho, ratio, m["clipfrac"]), **m}


def gmpo(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673, eq. 4): the geometric mean of the token ratios, each clipped in log
    space to [-ε_low, ε_high] on the side that limits the update (for A > 0 the smaller of log ρ_t and its clip, for
    A < 0 the larger), then -A_i · exp(1/|o_i| Σ_t clip(log ρ_t)) per sequence. `clip_eps`/`clip_eps_high` are LOG-space
    bounds here (the paper uses 0.4, i.e. ratios within (e^-0.4, e^0.4)). Metrics as TRL's experimental GMPOTrainer:
    "clip_low"/"clip_high" per token where log ρ_t leaves the range on the limiting side."""
    log_rho = log_ratio(logprobs, old_logprobs)
    adv = sequence_advantage(advantages, mask)  # (B, 1)
    bounded = log_rho.clamp(-p.clip_eps, p.eps_high)
    clipped = torch.where(adv > 0, torch.minimum(log_rho, bounded), torch.maximum(log_rho, bounded))
    ratio = torch.exp(sequence_mean(clipped, mask))  # (B, 1)
    loss = (-adv * ratio).expand_as(log_rho)
    with torch.no_grad():
        low, high = (log_rho < -p.clip_eps) & (adv < 0), (log_rho > p.eps_high) & (adv > 0)
    return loss, {**base_metrics(log_rho, ratio, low | high), "clip_low": low.float(), "clip_high": high.float()}


def sapo(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """SAPO (Gao et al. 2025, arXiv 2511.20347, eq. 5-6): the hard clip replaced by a soft gate,
    -(4/τ) σ(τ (ρ - 1)) · A, τ = τ_pos for A > 0 and τ_neg otherwise. Its gradient is σ(τ(ρ-1))(1-σ(τ(ρ-1)))·4·ρ·A·∇log π:
    the plain policy gradient at ρ = 1, fading smoothly as ρ leaves 1 (faster for the negative side, τ_neg > τ_pos).
    Nothing is clipped ("clipfrac" is 0). At sequence level the gate acts on GSPO's s_i (TRL allows both)."""
    if not (p.sapo_temperature_pos > 0 and p.sapo_temperature_neg > 0):
        raise ValueError("SAPO's temperatures must be > 0")
    log_rho = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(importance_log_weight(log_rho, mask, p.level))
    adv = sequence_advantage(advantages, mask) if p.level == "sequence" else advantages.float()
    tau = torch.where(adv > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    return loss.expand_as(log_rho), base_metrics(log_rho, ratio, torch.zeros_like(ratio))


# gspo and luspo are the clipped surrogate at GSPO's sequence level (luspo may also run per token, as TRL's does); they
# differ in the reduction: each sequence weighs the same (GSPO, eq. 5), or its length (LUSPO).
register_objective(Objective("ppo_clip", ppo_clip, levels=("token", "sequence"), uses=_CLIP))
register_objective(Objective("gspo", ppo_clip, levels=("sequence",), uses=_CLIP, loss_agg="seq-mean-token-mean"))
register_objective(Objective("gspo_token", gspo_token, levels=("sequence",), uses=_CLIP, loss_agg="seq-mean-token-mean",
                             sequence_advantage_levels=()))
register_objective(Objective("luspo", ppo_clip, levels=("sequence", "token"), uses=_CLIP, loss_agg="seq-mean-token-sum"))
register_objective(Objective("gmpo", gmpo, uses=frozenset({"clip_eps", "clip_eps_high"}), loss_agg="seq-mean-token-mean",
                             sequence_advantage_levels=("token",), token_masks=False))
register_objective(Objective("sapo", sapo, levels=("token", "sequence"),
                             uses=frozenset({"sapo_temperature_pos", "sapo_temperature_neg"}),
                             loss_agg="seq-mean-token-mean"))
