"""Padding-free attention: each sequence of a padding-free row (`types.PaddingFreeBatch`: batch 1, no mask, several
sequences end to end, position ids restarting at 0) attends only to itself, through transformers' attention and mask
interfaces (`data.padding_free`)."""

from __future__ import annotations

import torch

from rlhfkit.forwards import unwrap_model

PADDING_FREE_ATTENTION = "rlhfkit_padding_free"  # registered with transformers' attention and mask interfaces


def padding_free_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, except on a padding-free row (batch 1, no mask, several sequences end to end):
    there each sequence runs its own causal sdpa, a row of S sequences costing Σ len_s² instead of the (N, N) masked
    product of transformers' block-diagonal mask. query (1, H, N, D), key/value (1, H_kv, N, D) -> (1, N, H, D).

    The boundaries are where the row's `position_ids` restart at 0 (`types.PaddingFreeBatch`). `_padding_free_mask`
    builds no mask for such a row; every other batch gets sdpa's own mask and goes to transformers' sdpa unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None and query.shape[0] == 1 and query.shape[2] > 1:
        positions = kwargs.pop("position_ids", None)
        kwargs.pop("is_causal", None)  # each sequence is causal
        if positions is None or key.shape[2] != query.shape[2]:  # no boundaries to read, or a KV cache
            raise RuntimeError("padding-free attention needs the row's position_ids and no KV cache")
        starts = (positions[0] == 0).nonzero().flatten().tolist() + [query.shape[2]]
        if starts[0] != 0:
            raise RuntimeError("a padding-free row must start a sequence (position id 0) at its first token")
        outputs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, dropout=dropout,
                                          scaling=scaling, is_causal=True, **kwargs)[0] for a, b in zip(starts, starts[1:])]
        return torch.cat(outputs, 1), None  # (1, N, H, D)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _padding_free_mask(**kwargs):
    """sdpa's mask, but none for a batch of one row without a padding mask: `padding_free_attention` splits it."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None and kwargs["batch_size"] == 1:
        return None
    return sdpa_mask(**kwargs)


def use_padding_free_attention(model) -> str:
    """Give `model` `padding_free_attention` where it is exact — sdpa attention, no sliding window, no logit softcap —
    and return the attention implementation it then runs. Elsewhere transformers' own path stays: flash attention
    is already per sequence; sdpa/eager with a sliding window or softcap run one masked (N, N) product per row.
    Not saved with the model (transformers keeps the implementation out of config.json)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    config = unwrap_model(model).config
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if config._attn_implementation != "sdpa" or windowed or getattr(config, "attn_logit_softcapping", None):
        return config._attn_implementation
    AttentionInterface.register(PADDING_FREE_ATTENTION, padding_free_attention)
    AttentionMaskInterface.register(PADDING_FREE_ATTENTION, _padding_free_mask)
    model.set_attn_implementation(PADDING_FREE_ATTENTION)
    return PADDING_FREE_ATTENTION
