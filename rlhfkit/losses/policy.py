"""Policy and value losses of the online RL methods: the per-token policy loss of the online loop (a registered
objective, `losses.objectives`, with its masks, weights, KL term and entropy bonus), PPO's clipped surrogate, and the
clipped value loss.

Both return `(loss, metrics)`: `loss` is per token, shape (B, R), UNREDUCED — reduce it with
`rlhfkit.losses.aggregate.aggregate` and global counts; `metrics` holds detached (B, R) tensors. All math is fp32.
`policy_objective` is the per-token objective of the online loop: the surrogate, plus GRPO's KL term
`β · kl_penalty(logprobs, ref_logprobs, "k3")` when the algorithm puts the KL in the loss, minus the entropy bonus.

This module imports only torch.
"""

from __future__ import annotations

import torch

from rlhfkit.kl import kl_penalty
from rlhfkit.losses import policy_clip, policy_cov, policy_weighted  # noqa: F401 (they register the objectives)
from rlhfkit.losses.objectives import OBJECTIVES, ObjectiveParams, get_objective, importance_log_weight, log_ratio  # noqa: F401


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token: max(-A·ρ, -A·clip(ρ, 1 - ε_low, 1 + ε_high)), ρ = π / π_old — the token-level
    "ppo_clip" objective (`losses.policy_clip.clipped_surrogate`: Schulman et al. 2017, arXiv 1707.06347, eq. 7, with
    DAPO's Clip-Higher and the dual clip of arXiv 1912.09729), for callers that hold no mask.

    Args:
        logprobs: (B, R) log π_θ of the sampled tokens (requires grad).
        old_logprobs: (B, R) log π_old of the same tokens, from rollout time.
        advantages: (B, R) advantage per token.
        clip_eps: ε_low in (0, 1); clip_eps_high: ε_high > 0, None = ε_low; dual_clip: c > 1 or None.

    Returns:
        loss: (B, R) fp32, unreduced, not masked.
        metrics: detached (B, R) fp32 tensors: "clipfrac" 1 where the clipped term is the active one (TRL's
        clip_ratio/region), "clip_low", "clip_high", "dual_clipfrac", "approxkl" ½ (log π - log π_old)² (TRL's PPO
        policy/approxkl_avg), "ratio" ρ.
    """
    params = ObjectiveParams(clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip)
    return get_objective("ppo_clip").fn(logprobs, old_logprobs, advantages, torch.ones_like(advantages), params)


def policy_objective(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    objective: str = "ppo_clip",
    params: ObjectiveParams = ObjectiveParams(),
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    bias_corrected_kl: bool = False,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    token_keep: torch.Tensor | None = None,
    sequence_keep: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The online loop's per-token loss, in TRL's order (`GRPOTrainer._compute_loss`):
    objective × off-policy sequence mask × top-entropy token mask × rollout-correction weights, + β·KL, - c·H.

    - The objective is the registered `objective` (`losses.objectives`), reading `params`.
    - `sequence_keep` (B, 1): DeepSeek-V3.2's off-policy mask (`correction.off_policy_sequence_mask`); `token_keep`
      (B, R): the top-entropy tokens (`correction.top_entropy_mask`); `is_weights` (B, R) or (B, 1): the sampler-mismatch
      correction (`correction.rollout_correction`) — folded into VESPO's own weight instead of multiplying its loss.
    - The KL term (GRPO, Shao et al. 2024, arXiv 2402.03300, eq. 3-4) β·k3(π, π_ref) is added only with `ref_logprobs`
      and β > 0. `bias_corrected_kl`: k3 times the importance weight ρ (at `params.level`, with its gradient), so its
      gradient is the unbiased gradient of KL(π_θ || π_ref) for samples from π_old (DeepSeek-V3.2, arXiv 2512.02556,
      §3.1, eq. 8).
    - The entropy bonus uses the entropy of the whole next-token distribution, `entropy` (B, R) from the same
      forward's logits (`rlhfkit.ops.entropy_from_logits`), as PPO's `c₂·S[π](s_t)` (Schulman et al. 2017, eq. 9),
      on the same tokens as the loss (`token_keep`). The sampled token's -log π(y_t) is an unbiased estimate of H
      but its gradient is zero in expectation, so it cannot serve as a bonus.

    Args:
        logprobs, old_logprobs, advantages: (B, R), as `losses.objectives`; mask: (B, R) the tokens that count (the
        sequence-level pieces read it); None = all.
        ref_logprobs: (B, R) log π_ref, or None (no KL term); kl_coef: β >= 0.
        entropy: (B, R) entropies of π at each response position (requires grad), or None; entropy_coef: c >= 0.

    Returns:
        loss: (B, R) fp32, unreduced; metrics: the objective's, plus "surrogate" (the objective after the masks and
        weights, detached) and, with the KL term, "kl" (the KL term per token as added, bias-corrected or not: TRL's "kl").
    """
    mask = torch.ones_like(advantages) if mask is None else mask
    spec = get_objective(objective)
    folds = spec.takes_is_weights and is_weights is not None
    loss, metrics = spec.fn(logprobs, old_logprobs, advantages, mask, params, is_weights=is_weights) if folds \
        else spec.fn(logprobs, old_logprobs, advantages, mask, params)
    for factor in (sequence_keep, token_keep, None if folds else is_weights):
        if factor is not None:
            loss = loss * factor.float()
    metrics["surrogate"] = loss.detach()
    if ref_logprobs is not None and kl_coef:
        kl = kl_penalty(logprobs, ref_logprobs, "k3")
        if bias_corrected_kl:
            kl = kl * torch.exp(importance_log_weight(log_ratio(logprobs, old_logprobs), mask, params.level))
        metrics["kl"] = kl.detach()
        loss = loss + kl_coef * kl
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy of the policy's distribution (entropy=...)")
        bonus = entropy.float() if token_keep is None else entropy.float() * token_keep.float()
        loss = loss - entropy_coef * bonus
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
