"""Policy and value losses of the online RL methods: PPO's clipped surrogate (with DAPO's asymmetric clip and
dual clip) and the clipped value loss.

Both return `(loss, metrics)`: `loss` is per token, shape (B, R), UNREDUCED — reduce it with
`rlhfkit.losses.aggregate.aggregate` and global counts; `metrics` holds detached (B, R) tensors. All math is fp32.
`policy_objective` is the per-token objective of the online loop: the surrogate, plus GRPO's KL term
`β · kl_penalty(logprobs, ref_logprobs, "k3")` when the algorithm puts the KL in the loss, minus the entropy bonus.

This module imports only torch.
"""

from __future__ import annotations

import torch

from rlhfkit.kl import kl_penalty
from rlhfkit.ops import LOG_RATIO_CLAMP


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token: max(-A·ρ, -A·clip(ρ, 1 - ε_low, 1 + ε_high)), ρ = π / π_old.

    Schulman et al. 2017, arXiv 1707.06347, eq. 7 (L^CLIP, negated to a loss), with:
      - asymmetric clipping ε_high ≠ ε_low ("Clip-Higher", DAPO, Yu et al. 2025, arXiv 2503.14476, §3.1);
      - dual clip c > 1 (Ye et al. 2020, arXiv 1912.09729, their dual-clip objective): for A < 0 the loss is further
        capped at -c·A, so a token whose ratio has exploded cannot dominate the update.

    Deliberate deviation: log ρ is clamped to [-20, 20] before exp (see `rlhfkit.ops.LOG_RATIO_CLAMP`); inside that
    range — every sane rollout — the result equals TRL's.

    Args:
        logprobs: (B, R) log π_θ of the sampled tokens (requires grad).
        old_logprobs: (B, R) log π_old of the same tokens, from rollout time.
        advantages: (B, R) advantage per token.
        clip_eps: ε_low in (0, 1).
        clip_eps_high: ε_high > 0; None means ε_low (symmetric PPO).
        dual_clip: c > 1, or None for no dual clip.

    Returns:
        loss: (B, R) fp32, unreduced, not masked.
        metrics: detached (B, R) fp32 tensors, masked-mean them for logging:
          "clipfrac" 1 where the clipped term is the active one (TRL's `pg_losses2 > pg_losses`);
          "dual_clipfrac" 1 where the dual clip is active (all 0 without dual clip);
          "approxkl" ½ (log π - log π_old)², the k2 estimate of KL(π_old || π) that TRL logs as policy/approxkl_avg;
          "ratio" ρ.
    """
    clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    if not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if not clip_eps_high > 0:
        raise ValueError(f"clip_eps_high must be > 0, got {clip_eps_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")

    log_ratio = logprobs.float() - old_logprobs.float()  # (B, R)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (B, R)
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -adv * dual_clip  # > 0 where A < 0
        dual_active = (adv < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)

    with torch.no_grad():
        metrics = {
            "clipfrac": (clipped > unclipped).float(),
            "dual_clipfrac": dual_active.float(),
            "approxkl": 0.5 * log_ratio.detach() ** 2,
            "ratio": ratio.detach(),
        }
    return loss, metrics


def policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The online loop's per-token loss: `ppo_policy_loss` + β·k3(π, π_ref) - c·H(π(·|s_t)).

    - The KL term (GRPO, Shao et al. 2024, arXiv 2402.03300, eq. 3) is added only with `ref_logprobs` and β > 0.
    - The entropy bonus uses the entropy of the whole next-token distribution, `entropy` (B, R) from the same
      forward's logits (`rlhfkit.ops.entropy_from_logits`), as PPO's `c₂·S[π](s_t)` (Schulman et al. 2017, eq. 9).
      The sampled token's -log π(y_t) is an unbiased estimate of H but its gradient is zero in expectation, so it
      cannot serve as a bonus.

    Args:
        logprobs, old_logprobs, advantages: as `ppo_policy_loss`, (B, R).
        ref_logprobs: (B, R) log π_ref of the sampled tokens, or None (no KL term).
        kl_coef: β >= 0.
        entropy: (B, R) entropies of π at each response position (requires grad), or None (no bonus).
        entropy_coef: c >= 0.

    Returns:
        loss: (B, R) fp32, unreduced; metrics: those of `ppo_policy_loss`, plus "surrogate" (the clipped surrogate
        alone, detached).
    """
    loss, metrics = ppo_policy_loss(logprobs, old_logprobs, advantages, clip_eps=clip_eps,
                                    clip_eps_high=clip_eps_high, dual_clip=dual_clip)
    metrics["surrogate"] = loss.detach()
    if ref_logprobs is not None and kl_coef:
        loss = loss + kl_coef * kl_penalty(logprobs, ref_logprobs, "k3")
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy of the policy's distribution (entropy=...)")
        loss = loss - entropy_coef * entropy.float()
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    *,
    clip_range_value: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss per token: ½ max((V - R)², (clip(V, V_old - c, V_old + c) - R)²).

    Value clipping is not in the PPO paper; it comes from OpenAI baselines' PPO2 and is one of the code-level
    optimisations studied by Engstrom et al. 2020, arXiv 2005.12729 ("value function clipping"). TRL's PPO trainer
    uses this form, with the ½.

    Args:
        values: (B, R) V_θ at each response position (requires grad).
        old_values: (B, R) V at rollout time.
        returns: (B, R) regression targets (GAE advantages + old values).
        clip_range_value: c > 0, or None for the plain ½ (V - R)².

    Returns:
        loss: (B, R) fp32, unreduced, not masked.
        metrics: "clipfrac" (B, R) detached, 1 where the clipped term is the larger (TRL's val/clipfrac_avg).
    """
    if clip_range_value is not None and not clip_range_value > 0:
        raise ValueError(f"clip_range_value must be > 0 or None, got {clip_range_value}")
    v, ret = values.float(), returns.float()
    unclipped = (v - ret) ** 2
    if clip_range_value is None:
        return 0.5 * unclipped, {"clipfrac": torch.zeros_like(unclipped).detach()}
    old = old_values.float()
    v_clipped = torch.clamp(v, old - clip_range_value, old + clip_range_value)
    clipped = (v_clipped - ret) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, {"clipfrac": (clipped > unclipped).float().detach()}
