"""KTO: Kahneman-Tversky optimisation on unpaired desirable/undesirable completions.

This module imports only torch.
"""

from __future__ import annotations

import torch


def kto_loss(
    policy_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logprobs: torch.Tensor | None,
    ref_kl_logprobs: torch.Tensor | None,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    z0: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO, Ethayarajh et al. 2024, arXiv 2402.01306, eq. 8 (the loss λ_y - v(x, y); TRL's code cites it as eq. 7).

    r = log π(y|x) - log π_ref(y|x)                                      # (B,)
    z0 = max(0, mean_batch(log π(y'|x) - log π_ref(y'|x))), detached     # the reference point, a scalar
    loss = λ_D · (1 - σ(β(r - z0)))   where y is desirable
           λ_U · (1 - σ(β(z0 - r)))   where y is undesirable

    z0 estimates KL(π‖π_ref) from mismatched pairs (x, y'): each prompt with another example's completion (§4.1).
    It is detached: the paper treats it as a constant baseline, and TRL computes it under no_grad.

    Estimating z0:
      - By default z0 is the mean over this micro-batch. Under data parallelism TRL all-gathers the KL term and
        averages across ranks; to reproduce that (or to use the global batch), compute the mean of
        (policy_kl_logprobs - ref_kl_logprobs) over the global batch and pass it as `z0`, with the KL log-probs None.
        A passed z0 is clamped at 0 and detached here too (both idempotent).
      - With B = 1 the estimate rests on a single mismatched pair; this function accepts it, the data layer is
        responsible for requiring larger batches.

    Args:
        policy_logprobs, ref_logprobs: (B,) log-probs of each completion, summed over its tokens.
        desirable: (B,) bool, True where the completion is desirable.
        policy_kl_logprobs, ref_kl_logprobs: (B',) summed log-probs of the mismatched (prompt, completion) pairs; None
            exactly when `z0` is given.
        beta: β > 0.
        desirable_weight, undesirable_weight: λ_D, λ_U >= 0. The paper advises λ_D n_D / (λ_U n_U) in [1, 4/3].
        z0: optional scalar tensor overriding the micro-batch estimate.

    Returns:
        loss: (B,) per example, unreduced, fp32, in the input order (TRL concatenates desirable rows then undesirable
            rows; the batch mean is the same).
        metrics: detached (B,) tensors. Per-class metrics are 0 on rows of the other class (never NaN, so sums over
            micro-batches and ranks are exact); average them as sum(x) / sum(mask) over the global batch:
            "desirable_mask" (1.0 on desirable rows), "rewards/chosen" = β r on desirable rows,
            "rewards/rejected" = β r on undesirable rows, "logps/chosen", "logps/rejected" (policy log-probs, same
            masking), and "kl" = z0 broadcast to (B,) (so its mean over any set of rows is z0).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if desirable_weight < 0 or undesirable_weight < 0:
        raise ValueError(
            f"desirable_weight and undesirable_weight must be >= 0, got {desirable_weight}, {undesirable_weight}"
        )
    kl_given = (policy_kl_logprobs is not None, ref_kl_logprobs is not None)
    if z0 is None and not all(kl_given):
        raise ValueError("policy_kl_logprobs and ref_kl_logprobs are required unless z0 is given")
    if z0 is not None and any(kl_given):
        raise ValueError("pass either z0 or the KL log-probs (policy_kl_logprobs, ref_kl_logprobs), not both")

    # 1. Reference point: mean KL estimate, clamped at 0 (KL >= 0; a negative sample mean is noise), no gradient.
    if z0 is None:
        z0 = (policy_kl_logprobs.float() - ref_kl_logprobs.float()).mean()  # type: ignore[union-attr]
    z0 = z0.detach().float().clamp(min=0)

    # 2. Implicit reward and the value of each completion relative to z0.
    policy = policy_logprobs.float()
    logratios = policy - ref_logprobs.float()  # (B,)
    is_desirable = desirable.bool()
    # 1 - σ(a) is written σ(-a): the same value, without cancellation when σ(a) is close to 1.
    loss = torch.where(
        is_desirable,
        desirable_weight * torch.sigmoid(beta * (z0 - logratios)),
        undesirable_weight * torch.sigmoid(beta * (logratios - z0)),
    )  # (B,)

    # 3. Metrics, masked per class.
    mask = is_desirable.float()
    rewards = (beta * logratios).detach()
    policy = policy.detach()
    metrics = {
        "desirable_mask": mask,
        "rewards/chosen": rewards * mask,
        "rewards/rejected": rewards * (1 - mask),
        "logps/chosen": policy * mask,
        "logps/rejected": policy * (1 - mask),
        "kl": z0.expand_as(logratios).clone(),
    }
    return loss, metrics
