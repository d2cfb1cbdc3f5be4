"""Online DPO's two pure pieces: ranking each prompt's two fresh samples into a pair, and the DPO family's loss on
the pairs (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv 2402.04792, Alg. 1).

The loss itself is `losses.preference.preference_loss` (sigmoid = DPO, IPO, hinge), applied to summed sequence
log-probs, as TRL's experimental `OnlineDPOTrainer` does (its IPO, unlike its offline DPO, uses sums too).

This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.losses.preference import preference_loss


@dataclass(frozen=True)
class Pairs:
    """Each prompt's two samples as a pair: rows `chosen[i]` and `rejected[i]` of the rollout, and whether the pair
    counts (`kept`: its scores differ; a tie carries no preference and is dropped)."""

    chosen: torch.Tensor  # (P,) row index of the better-scored sample
    rejected: torch.Tensor  # (P,) row index of the other
    kept: torch.Tensor  # (P,) bool

    @property
    def tie_rate(self) -> torch.Tensor:
        return 1.0 - self.kept.float().mean()


def rank_pairs(scores: torch.Tensor) -> Pairs:
    """The pairs of a rollout whose rows 2i and 2i+1 are prompt i's two samples, ranked by `scores` (2P,).

    Deliberate difference from TRL's `OnlineDPOTrainer`: TRL makes the first sample the chosen one on a tie; here a
    tie is dropped (kept=False), since training on it would teach an arbitrary preference."""
    if scores.dim() != 1 or scores.shape[0] % 2:
        raise ValueError(f"scores must be (2P,): two samples per prompt, got shape {tuple(scores.shape)}")
    s = scores.view(-1, 2)  # (P, 2)
    first = torch.arange(0, scores.shape[0], 2, device=scores.device)  # (P,)
    first_wins = s[:, 0] > s[:, 1]
    return Pairs(chosen=torch.where(first_wins, first, first + 1), rejected=torch.where(first_wins, first + 1, first),
                 kept=s[:, 0] != s[:, 1])


def online_pair_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, pairs: Pairs, *, loss_type: str, beta: float,
                     num_pairs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DPO family's loss summed over the kept pairs and divided by `num_pairs`.

    Args:
        logprobs: (2P,) log π(y|x) of each row, summed over its response tokens (with gradient).
        ref_logprobs: (2P,) the same under the reference (no gradient).
        pairs: `rank_pairs` of the rows' scores.
        loss_type, beta: as `preference_loss` ("sigmoid", "ipo", "hinge"; β > 0).
        num_pairs: the normaliser: kept pairs of the whole optimizer step (all micro-batches and processes), so
            micro-batching and data parallelism leave the loss unchanged. Pass the count divided by the world size
            under DDP (which averages gradients over processes).

    Returns:
        loss: scalar fp32; 0 when no pair is kept.
        metrics: detached (P,) tensors of `preference_loss` ("rewards/chosen", ..., "logps/rejected") and "loss",
            for every pair (tied ones included: weigh them by `pairs.kept`).
    """
    loss, metrics = preference_loss(logprobs[pairs.chosen], logprobs[pairs.rejected], ref_logprobs[pairs.chosen],
                                    ref_logprobs[pairs.rejected], loss_type=loss_type, beta=beta)
    kept = pairs.kept.to(loss.dtype)
    return (loss * kept).sum() / num_pairs, {**metrics, "loss": loss.detach()}
