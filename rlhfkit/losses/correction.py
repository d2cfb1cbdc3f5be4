"""Token and sequence masks and weights that apply to every policy objective: the sampler-mismatch correction, the
off-policy sequence mask, top-entropy token selection, and the adaptive entropy coefficient's update rule.

This module imports only torch.
"""

from __future__ import annotations

import math

import torch

from rlhfkit.ops import LOG_RATIO_CLAMP, masked_mean

CORRECTION_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_correction(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                       low: float | None, high: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights for the gap between the sampler and the training forward (truncated IS, Ionides 2008; the
    token/sequence truncate-or-mask family of Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training", and of TRL's `vllm_importance_sampling_mode`).

    The rollout was drawn from π_sampler (the decode loop's numerics, or stale weights) but π_old is the training
    forward's; w = π_old / π_sampler per token ("token_*") or Π_t over the sequence ("sequence_*"), then
      - "*_truncate": w clamped to [low, high] (a bound None is open);
      - "*_mask": w set to 0 outside [low, high] (the token or the whole sequence takes no loss).
    The per-token policy loss is multiplied by w (detached: a constant of the rollout).

    Args:
        old_logprobs, sampler_logprobs: (B, R) log π_old and log π_sampler of the sampled tokens.
        mask: (B, R) the tokens that count (others get log w = 0).
        mode: one of CORRECTION_MODES other than "none".
    Returns:
        weights: (B, R) for token modes, (B, 1) for sequence modes, detached fp32.
        metrics: detached figures over the tokens (B, R) or sequences (B, 1): "mismatch_kl" the k3 estimate of
        KL(π_sampler || π_old) per token, (w - 1) - log w with w = π_old/π_sampler; "logp_diff" |log π_old - log
        π_sampler|; "corrected" 1 where w was capped (truncate) or zeroed (mask); "is_ratio" the weight.
    """
    if mode not in CORRECTION_MODES[1:]:
        raise ValueError(f"mode must be one of {CORRECTION_MODES[1:]}, got {mode!r}")
    with torch.no_grad():
        m = mask.float()
        diff = ((old_logprobs.float() - sampler_logprobs.float()) * m).nan_to_num(nan=0.0)  # (B, R)
        token_log_w = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_w = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
        w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        lo, hi = -math.inf if low is None else low, math.inf if high is None else high
        outside = (w < lo) | (w > hi)
        weights = w.clamp(min=low, max=high) if mode.endswith("truncate") else w.masked_fill(outside, 0.0)
        metrics = {"mismatch_kl": (torch.exp(token_log_w) - 1 - token_log_w) * m, "logp_diff": diff.abs(),
                   "corrected": outside.float(), "is_ratio": weights}
    return weights, metrics


def off_policy_sequence_mask(advantages: torch.Tensor, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence masking (arXiv 2512.02556, §3.1, eq. 9): a sequence with a negative
    advantage whose mean per-token KL(π_sampler || π_θ), estimated as mean_t (log π_sampler - log π_θ), exceeds δ is
    masked out: learning from one's own far-off-policy mistakes destabilises training more than it teaches.
    Returns (B, 1), 1 = keep, detached. A NaN log-prob (a token the sampler could not score) counts as no evidence."""
    with torch.no_grad():
        gap = (sampler_logprobs.float() - logprobs.detach().float()).nan_to_num(nan=0.0)
        mean_kl = masked_mean(gap, mask, dim=-1).unsqueeze(-1)  # (B, 1)
        adv = advantages.float()
        adv = adv if adv.shape[-1] == 1 else masked_mean(adv, mask, dim=-1).unsqueeze(-1)
        return ((adv >= 0) | (mean_kl <= threshold)).float()


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float,
                     population: torch.Tensor | None = None) -> torch.Tensor:
    """Keep only the highest-entropy tokens ("Beyond the 80/20 Rule", Wang et al. 2025, arXiv 2506.01939): those
    whose entropy is at least the (1 - ρ) quantile of the masked tokens' entropies (ρ = `quantile`; the paper keeps
    the top 20%). `population`: the entropies the quantile is taken over when wider than this call's (every
    process's, as TRL gathers them); default the masked entries of `entropy`. Returns (B, R) bool, detached."""
    with torch.no_grad():
        values = entropy.detach().float()[mask.bool()] if population is None else population.float()
        if values.numel() == 0:
            return torch.zeros_like(mask, dtype=torch.bool)
        threshold = torch.quantile(values, 1 - quantile)
        return (entropy.detach().float() * mask.float() >= threshold) & mask.bool()
