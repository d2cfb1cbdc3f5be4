"""The shape alphabet and the typed batches passed between modules.

Shape alphabet (used in `# (B, T)` comments throughout the package):
    B  batch (sequences in a micro-batch)      T  sequence length (prompt + response)
    P  prompt length                            R  response length
    V  vocabulary size                          G  group size (samples per prompt)
    H  hidden size                              N  number of tokens (flattened)

This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


class _TensorBatch:
    """Moves every tensor field to a device; dataclasses below inherit it."""

    def to(self, device: torch.device | str):
        kwargs = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kwargs[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return type(self)(**kwargs)


@dataclass
class SFTBatch(_TensorBatch):
    """Right-padded language-modelling batch; labels are -100 where no loss is taken (prompt, padding)."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    labels: torch.Tensor  # (B, T) long, -100 = ignored


@dataclass
class PreferenceBatch(_TensorBatch):
    """Pairs of (prompt + chosen) and (prompt + rejected), each right-padded to a common length T.

    `chosen_labels`/`rejected_labels` are -100 on the prompt and padding, so they mark the response tokens.
    `margin` is an optional per-pair margin (Llama 2's RM margin loss); zeros when the data has none.
    """

    chosen_input_ids: torch.Tensor  # (B, T)
    chosen_attention_mask: torch.Tensor  # (B, T)
    chosen_labels: torch.Tensor  # (B, T)
    rejected_input_ids: torch.Tensor  # (B, T)
    rejected_attention_mask: torch.Tensor  # (B, T)
    rejected_labels: torch.Tensor  # (B, T)
    margin: torch.Tensor  # (B,) float


@dataclass
class UnpairedBatch(_TensorBatch):
    """KTO batch: (prompt + completion) with a desirable/undesirable label, plus mismatched pairs for z0.

    `kl_*` hold each prompt paired with another example's completion (Ethayarajh et al. 2024, §4.1): the
    reference point z0 is estimated from them.
    """

    input_ids: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    labels: torch.Tensor  # (B, T), -100 outside the completion
    desirable: torch.Tensor  # (B,) bool
    kl_input_ids: torch.Tensor  # (B, T')
    kl_attention_mask: torch.Tensor  # (B, T')
    kl_labels: torch.Tensor  # (B, T')


@dataclass
class PromptBatch(_TensorBatch):
    """Left-padded prompts for generation."""

    input_ids: torch.Tensor  # (B, P)
    attention_mask: torch.Tensor  # (B, P)
