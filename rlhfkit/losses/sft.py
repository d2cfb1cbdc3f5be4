"""Supervised fine-tuning loss: next-token negative log-likelihood on labelled tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
