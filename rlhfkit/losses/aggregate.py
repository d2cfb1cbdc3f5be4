"""The one place a per-token loss is reduced to a scalar.

A policy loss returns (B, R); how to average it is a separate choice, and the choice is most of what separates GRPO,
DAPO and Dr. GRPO. Each mode divides a *sum* by a normaliser that the caller can fix to a global count: on one
process, pass the count over the whole optimiser step (all micro-batches) and the micro-batch losses add up to
exactly the loss, and gradient, of one big batch. The defaults (counts of this tensor alone) are right only when the
tensor is the whole batch.

Under data parallelism, DDP averages gradients over processes, so the callers pass the global count (every
micro-batch of every process) divided by the world size, each process's share (the offline `train_step` and the
online update both do): the average of the processes' gradients is then the gradient of the global sum over the
global count. Nothing here knows the world size.

This module imports only torch.
"""

from __future__ import annotations

import torch

from rlhfkit.ops import masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum")


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    max_len: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar.

    Modes:
      - "token-mean": Σ_{i,t} ℓ_{i,t} / num_tokens — every valid token weighs the same. DAPO's token-level policy
        gradient loss (Yu et al. 2025, arXiv 2503.14476, §3.3); TRL's "dapo" (global count) and "bnpo"
        (local count); TRL's PPO trainer.
      - "seq-mean-token-mean": Σ_i (Σ_t ℓ_{i,t} / |o_i|) / num_seqs — each sequence weighs the same. The 1/|o_i| of
        GRPO (Shao et al. 2024, arXiv 2402.03300, eq. 3); TRL's "grpo".
      - "seq-mean-token-sum-norm": Σ_{i,t} ℓ_{i,t} / (num_seqs · max_len) — a constant normaliser, so no length bias
        (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783); TRL's "dr_grpo" with max_len = max_completion_length.
      - "seq-mean-token-sum": Σ_{i,t} ℓ_{i,t} / num_seqs — each sequence weighs its length: the length-unbiased
        sequence loss of LUSPO (arXiv 2602.05261); TRL's "luspo". verl's mode of the same name.

    A sequence with no valid token contributes 0 to "seq-mean-token-mean" (its token count is clamped to 1) but still
    counts in num_seqs, as in TRL.

    Args:
        loss: (B, R) per-token loss.
        mask: (B, R) bool or 0/1, the tokens that count.
        mode: one of AGG_MODES.
        num_tokens: "token-mean" normaliser: valid tokens over the whole optimiser step; default mask.sum().
        num_seqs: sequences over the whole optimiser step; default B.
        max_len: "seq-mean-token-sum-norm" constant: the configured maximum response length; default R. Pass it
            explicitly: R varies between micro-batches padded to their own longest response.

    Returns:
        Scalar fp32 loss.
    """
    if mode == "token-mean":
        denominator = mask.bool().sum() if num_tokens is None else num_tokens
        return masked_sum(loss, mask) / denominator
    num_seqs = loss.shape[0] if num_seqs is None else num_seqs
    if mode == "seq-mean-token-mean":
        lengths = mask.bool().sum(-1).clamp(min=1)  # (B,)
        return (masked_sum(loss, mask, dim=-1) / lengths).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        max_len = loss.shape[-1] if max_len is None else max_len
        return masked_sum(loss, mask) / (num_seqs * max_len)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss, mask) / num_seqs
    raise ValueError(f"mode must be one of {AGG_MODES}, got {mode!r}")
