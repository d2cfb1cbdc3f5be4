"""Supervised fine-tuning loss: next-token negative log-likelihood on labelled tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhfkit.losses.aggregate import aggregate


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token NLL of `labels` under `logits`, shifted so position t predicts token t+1.

    Args:
        logits: (B, T, V) model outputs.
        labels: (B, T) target ids, -100 where no loss is taken (prompt, padding).

    Returns:
        loss: (B, T-1) NLL in fp32, 0 at ignored positions — reduce it with `aggregate(..., "token-mean")` and the
            global token count so gradient accumulation equals one large batch.
        metrics: "mask" (B, T-1) float, 1 on scored tokens; "correct" (B, T-1) float, 1 where argmax == label.
    """
    shift_logits = logits[:, :-1].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    mask = shift_labels != -100
    safe_labels = shift_labels.masked_fill(~mask, 0)
    nll = F.cross_entropy(shift_logits.transpose(1, 2), safe_labels, reduction="none")  # (B, T-1)
    nll = nll * mask
    with torch.no_grad():
        correct = (shift_logits.argmax(-1) == shift_labels) & mask
    return nll, {"mask": mask.float(), "correct": correct.float()}


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, num_tokens: float | torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The SFT objective of one micro-batch: the summed `token_nll` over `num_tokens`, the labelled tokens of the whole
    optimiser step ("token-mean" with a global count), so gradient accumulation equals one large batch.

    Args:
        logits: (B, T, V) model outputs.
        labels: (B, T) target ids, -100 where no loss is taken (prompt, padding).
        num_tokens: labelled tokens over every micro-batch (and process) of the step.

    Returns:
        loss: scalar fp32.
        metrics: "loss" (this micro-batch's mean NLL per labelled token) and "mean_token_accuracy", detached.
    """
    nll, parts = token_nll(logits, labels)  # (B, T-1)
    mask = parts["mask"]
    n = mask.sum().clamp(min=1)  # 1: a micro-batch without a labelled token logs 0, not NaN
    return aggregate(nll, mask, "token-mean", num_tokens=num_tokens), {
        "loss": (nll.sum() / n).detach(),
        "mean_token_accuracy": parts["correct"].sum() / n,
    }
