"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", arXiv 2505.22617, §5): entropy collapse is driven by the tokens whose log-probability and advantage covary
most, Cov(log π(y_t), A_t); these two objectives restrain only those few tokens. Conventions: `losses.objectives`.

Deviation, stated: the covariance is centred on the means of the tokens the call is given — a micro-batch, as verl
does — so under gradient accumulation the tokens chosen can differ from those one big batch would choose
(accumulation ≡ one batch holds when the micro-batch is the minibatch).

This module imports only torch.
"""

from __future__ import annotations

import torch

from rlhfkit.losses.objectives import Objective, ObjectiveParams, base_metrics, log_ratio, register_objective
from rlhfkit.losses.policy_clip import clipped_surrogate


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) per-token centred product (A_t - mean A)(log π(y_t) - mean log π) over the masked tokens (the paper's
    eq. 11 summands), detached; -inf off the mask so that it is never selected."""
    with torch.no_grad():
        m = mask.bool()
        n = m.sum().clamp(min=1)
        lp, adv = logprobs.detach().float(), advantages.float()
        cov = (adv - adv[m].sum() / n) * (lp - lp[m].sum() / n)
        return cov.masked_fill(~m, float("-inf"))


def clip_cov(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """Clip-Cov (arXiv 2505.22617, §5.2, eq. 12): PPO's clipped surrogate, with the gradient of a few high-covariance
    tokens detached: among the tokens the ratio clip left untouched whose covariance lies in (ω_low, ω_high) =
    (`clip_cov_lb`, `clip_cov_ub`), max(1, ⌊r·N⌋) are drawn at random (r = `clip_cov_ratio`, N the masked tokens;
    torch's global generator, seeded by the run) and their loss is set to 0. Metrics: those of `clipped_surrogate`,
    and "covfrac" (the share so detached)."""
    log_rho = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_rho)
    loss, m = clipped_surrogate(ratio, advantages, p.clip_eps, p.eps_high)
    with torch.no_grad():
        cov = token_covariance(logprobs, advantages, mask)
        candidates = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & mask.bool() & ~m["clipfrac"].bool()
        index = candidates.flatten().nonzero().squeeze(-1)
        count = max(int(p.clip_cov_ratio * int(mask.bool().sum())), 1)
        chosen = index[torch.randperm(len(index))[:count].to(index.device)]
        detached = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
        detached[chosen] = True
        detached = detached.view_as(cov)
    loss = loss * (~detached).float()
    return loss, {**base_metrics(log_rho, ratio, m["clipfrac"]), **m, "covfrac": detached.float()}


def kl_cov(logprobs, old_logprobs, advantages, mask, p: ObjectiveParams):
    """KL-Cov (arXiv 2505.22617, §5.2, eq. 13): the unclipped policy-gradient surrogate -A·ρ, plus
    β·|log π - log π_old| on the top max(1, ⌊k·N⌋) tokens by covariance (k = `kl_cov_ratio`, β = `kl_cov_coef`): a
    KL-like pull back to π_old on exactly the tokens that drive entropy down, and no clip anywhere else.
    "clipfrac" is 0; "covfrac" is the share penalised."""
    log_rho = log_ratio(logprobs, old_logprobs)
    ratio = torch.exp(log_rho)
    loss = -advantages.float() * ratio
    with torch.no_grad():
        cov = token_covariance(logprobs, advantages, mask).flatten()
        count = min(max(int(p.kl_cov_ratio * int(mask.bool().sum())), 1), int(mask.bool().sum()))
        penalised = torch.zeros_like(cov, dtype=torch.bool)
        penalised[torch.topk(cov, count).indices] = True
        penalised = penalised.view_as(log_rho)
    loss = loss + p.kl_cov_coef * log_rho.abs() * penalised.float()
    return loss, {**base_metrics(log_rho, ratio, torch.zeros_like(ratio)), "covfrac": penalised.float()}


register_objective(Objective("clip_cov", clip_cov, uses=frozenset({"clip_eps", "clip_eps_high", "clip_cov_ratio",
                                                                   "clip_cov_lb", "clip_cov_ub"})))
register_objective(Objective("kl_cov", kl_cov, uses=frozenset({"kl_cov_ratio", "kl_cov_coef"})))
