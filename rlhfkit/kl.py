"""KL divergence to the reference, in one place: the per-token estimators, the per-token KL of a response and its
sum over the sequence. The controllers that set the KL coefficient β are in `rlhfkit.kl_control`.

Every function is pure and computes in fp32. This module imports only torch and `rlhfkit.ops`.
"""

from __future__ import annotations

import torch

from rlhfkit.ops import LOG_RATIO_CLAMP, masked_sum

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) from tokens sampled from π (Schulman 2020, "Approximating KL Divergence").

    With log r = log π_ref(y_t) - log π(y_t):
      - "k1": -log r = log π - log π_ref. Unbiased, can be negative per token; the RLHF reward penalty (Ziegler et al.
        2019, arXiv 1909.08593, eq. 2).
      - "k2": ½ (log r)². Biased, non-negative, low variance.
      - "k3": (r - 1) - log r. Unbiased, non-negative, low variance; the GRPO loss term (Shao et al. 2024,
        arXiv 2402.03300, eq. 4). log r is clamped to [-20, 20] before exp (see LOG_RATIO_CLAMP).
      - "abs": |log π - log π_ref|.

    Args:
        logprobs: (B, R) log π of the sampled tokens.
        ref_logprobs: (B, R) log π_ref of the same tokens.
        kind: one of KL_KINDS.

    Returns:
        (B, R) fp32, unmasked: mask or aggregate it with the response mask.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()  # (B, R) = log π - log π_ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        log_r = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(log_r) - log_r - 1
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")


def token_kl(logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """(B, R) k1 KL to the reference at each of the policy's own tokens (`mask`: the action mask), 0 elsewhere; None
    without a reference, or before π's log-probs are known. The per-token reward penalty and the logged KL both read
    it: log π − log π_ref is unbiased for the sequence KL when summed over tokens sampled from π."""
    if logprobs is None or ref_logprobs is None:
        return None
    return torch.where(mask.bool(), kl_penalty(logprobs, ref_logprobs, "k1"), 0.0)


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sampled estimate of KL(π || π_ref) per sequence, in nats: Σ_t (log π(y_t) - log π_ref(y_t)) over the response.

    The k1 estimator summed over tokens (Schulman 2020; `kl_penalty`): unbiased for the sequence KL when
    the responses are sampled from π, as `objective/kl` is during online RL. A single sequence's value can be negative.

    Args:
        logprobs, ref_logprobs: (B, R) log-probs of the sampled response tokens under π and π_ref.
        mask: (B, R) 1 on response tokens.

    Returns:
        (B,) fp32.
    """
    return masked_sum(kl_penalty(logprobs, ref_logprobs, "k1"), mask, dim=-1)  # (B, R) -> (B,)
