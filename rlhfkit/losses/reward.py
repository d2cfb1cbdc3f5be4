"""Reward-model loss: Bradley-Terry on chosen/rejected pairs, with optional margin and reward centering."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pairwise Bradley-Terry loss for reward models.

    loss_i = -log σ(r_c - r_r - m_i) + center_coef · (r_c + r_r)²

    - Bradley & Terry 1952; as an RM objective: Ouyang et al. 2022, arXiv 2203.02155, eq. 1.
    - The margin m_i is Llama 2's (Touvron et al. 2023, arXiv 2307.09288, eq. 2): a pair known to be far apart must be
      separated by at least m_i.
    - Reward centering (Eisenstein et al. 2023, arXiv 2312.09244, §3) pulls the pair's summed score towards 0, so
      scores stay comparable across reward models; TRL's `center_rewards_coefficient` is the same term.

    Args:
        chosen_scores, rejected_scores: (B,) scalar rewards.
        margin: (B,) or None (no margin).
        center_coef: weight of the centering term, >= 0.

    Returns:
        loss: (B,) per pair, unreduced.
        metrics: detached (B,) tensors "accuracy" (1 where r_c > r_r), "margin" (r_c - r_r), "chosen_score",
            "rejected_score".
    """
    chosen = chosen_scores.float()
    rejected = rejected_scores.float()
    diff = chosen - rejected  # (B,)
    logits = diff if margin is None else diff - margin.float()
    loss = -F.logsigmoid(logits)  # logsigmoid, not log(sigmoid): stable for large |diff|
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    metrics = {
        "accuracy": (diff > 0).float().detach(),
        "margin": diff.detach(),
        "chosen_score": chosen.detach(),
        "rejected_score": rejected.detach(),
    }
    return loss, metrics
