"""The weighted-REINFORCE family: -sg(w) · A · log π, where a detached importance weight w replaces the clipped
ratio, so every token keeps a gradient (CISPO), or a binary trust-region mask decides which do (DPPO), or a smooth
sequence-level weight does (VESPO). Conventions: `losses.objectives`.

The loss VALUE of this family is -w·A·log π, not a surrogate near -A: only its gradient, w·A·∇log π, is meaningful.

This module imports only torch.
"""

from __future__ import annotations

import math

import torch

from rlhfkit.losses.objectives import (Objective, ObjectiveParams, base_metrics, importance_log_weight, log_ratio,
                                       register_objective, sequence_advantage)
from rlhfkit.ops import LOG_RATIO_CLAMP

CISPO_RATIO_CAP = 5.0  # ScaleRL's ε_max (Khatri et al. 2025, arXiv 2510.13786, §3), TRL's advice for cispo
DPPO_RATIO_CAP = 20.0  # the DPPO paper's truncation of the detached ratio (its code's clip_ratio_c)
DPPO_THRESHOLD = {"tv": 0.15, "kl": 0.05}  # the DPPO paper's divergence thresholds δ (its Qwen3-30B recipe)


def cispo(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): -sg(min(ρ, ε_max)) · A · log π. The importance weight is capped
    and detached rather than the token being clipped out of the gradient, so rare tokens that matter for reasoning
    (the paper's "fork" tokens) still learn. The cap is `p.ratio_cap` (default 5.0, ScaleRL's ε_max; TRL's
    `epsilon_high` under loss_type="cispo"); like the paper and TRL, no lower bound. At sequence level the weight is
    GSPO's s_i. "clipfrac": ρ > cap with A > 0 (TRL's cispo_clip_ratio)."""
    cap = CISPO_RATIO_CAP if p.ratio_cap is None else p.ratio_cap
    log_rho = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(importance_log_weight(log_rho, mask, p.level))
    adv = sequence_advantage(advantages, mask) if p.level == "sequence" else advantages.float()
    loss = -ratio.clamp(max=cap).detach() * adv * logprobs.float()
    return loss, base_metrics(log_rho, ratio, (ratio > cap) & (adv > 0))


def _dppo(logprobs, old_logprobs, advantages, p: ObjectiveParams, divergence: str):
    """DPPO ("Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879): the ratio clip replaced by
    a trust region on a divergence between π and π_old at the sampled token, reduced to the binary distribution
    {y_t, not y_t} (a 2-point approximation of the full-vocabulary divergence):
      - Binary-TV: |π(y_t) - π_old(y_t)|;
      - Binary-KL: p_old log(p_old/p) + (1 - p_old) log((1 - p_old)/(1 - p)), p = π(y_t).
    A token leaves the region (its gradient masked) when the divergence exceeds δ AND the update would push it further
    in its advantage's direction (π up for A > 0, down for A < 0). The rest learn by -sg(min(ρ, cap)) · A · log π.
    The ratio clip over-penalises rare tokens (1e-5 → 1e-3 is ρ = 100 but a negligible move) and under-penalises
    common ones (0.99 → 0.8 is ρ = 0.81); the divergence does not. "clipfrac": the share masked."""
    threshold = DPPO_THRESHOLD[divergence] if p.dppo_threshold is None else p.dppo_threshold
    cap = DPPO_RATIO_CAP if p.ratio_cap is None else p.ratio_cap
    log_rho = log_ratio(logprobs, old_logprobs)
    ratio, adv, lp = torch.exp(log_rho), advantages.float(), logprobs.float()
    with torch.no_grad():
        prob, old_prob = torch.exp(lp), torch.exp(old_logprobs.float())
        if divergence == "tv":
            up, down = prob - old_prob > threshold, prob - old_prob < -threshold
        else:
            # log(1 - p), floored at log(1e-8): a token of probability 1 has no mass outside it to compare; the floor
            # keeps its binary KL finite (and large, so it leaves the region when it moves).
            log_rest = torch.log((1 - prob).clamp(min=1e-8))
            log_old_rest = torch.log((1 - old_prob).clamp(min=1e-8))
            kl = old_prob * (old_logprobs.float() - lp) + (1 - old_prob) * (log_old_rest - log_rest)
            up, down = (kl > threshold) & (prob > old_prob), (kl > threshold) & (prob < old_prob)
        outside = torch.where(adv > 0, up, down)
    loss = -ratio.clamp(max=cap).detach() * adv * lp * (~outside).float()
    return loss, base_metrics(log_rho, ratio, outside)


def dppo_binary_tv(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """DPPO-Binary-TV (arXiv 2602.04879): see `_dppo`. δ = `p.dppo_threshold`, default 0.15."""
    return _dppo(logprobs, old_logprobs, advantages, p, "tv")


def dppo_binary_kl(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """DPPO-Binary-KL (arXiv 2602.04879): see `_dppo`. δ = `p.dppo_threshold`, default 0.05."""
    return _dppo(logprobs, old_logprobs, advantages, p, "kl")


def vespo(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams, is_weights: torch.Tensor | None = None):
    """VESPO (arXiv 2602.10693): a smooth, asymmetric Gamma-shaped weight of the sequence importance weight
    w_i = Π_t ρ_t (a product, not GSPO's geometric mean), φ(w) = e^λ · w^k · e^{-λ w}, normalised so φ(1) = 1, with
    (k, λ) = (k_pos, λ_pos) for A ≥ 0 and (k_neg, λ_neg) for A < 0; the loss is -sg(φ(w_i)) · A · log π.
    φ rises as w^k for small w (stale samples fade in) and decays as e^{-λw} for large w (runaway ratios fade out),
    with no hard edge. Computed in log space: log w clamped to [log 1e-8, 20] as TRL's, λ floored at 1e-4.
    `is_weights` (B, R): the rollout correction's per-token weights π_old/π_sampler, folded into w as VESPO does
    (the correction is then not applied again to the loss). "clipfrac" is 0; "phi" (B, 1) is the weight."""
    log_rho = log_ratio(logprobs, old_logprobs)
    adv = sequence_advantage(advantages, mask)  # (B, 1)
    floor = math.log(1e-8)
    with torch.no_grad():
        log_w = (log_rho * mask.float()).sum(-1, keepdim=True)
        if is_weights is not None:
            log_w = log_w + torch.log(is_weights.float()).clamp(floor, LOG_RATIO_CLAMP).sum(-1, keepdim=True)
        log_w = log_w.clamp(floor, LOG_RATIO_CLAMP)
        pos = adv >= 0
        k = torch.where(pos, p.vespo_k_pos, p.vespo_k_neg)
        lam = torch.where(pos, p.vespo_lambda_pos, p.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    loss = -phi * adv * logprobs.float()
    return loss, {**base_metrics(log_rho, torch.exp(log_w), torch.zeros_like(phi)), "phi": phi}


_CAP = frozenset({"ratio_cap"})
register_objective(Objective("cispo", cispo, levels=("token", "sequence"), uses=_CAP, loss_agg="token-mean"))
register_objective(Objective("dppo_binary_tv", dppo_binary_tv, uses=_CAP | {"dppo_threshold"}))
register_objective(Objective("dppo_binary_kl", dppo_binary_kl, uses=_CAP | {"dppo_threshold"}))
register_objective(Objective("vespo", vespo, loss_agg="token-mean", sequence_advantage_levels=("token",), takes_is_weights=True,
                             uses=frozenset({"vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"})))
