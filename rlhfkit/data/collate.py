"""Collators: lists of tokenized examples to the typed, padded (or padding-free) batches of `rlhfkit.types`."""

from __future__ import annotations

import array

import torch

from rlhfkit.data.tokenize import IGNORE_INDEX, PreferenceExample, PromptExample, SFTExample, UnpairedExample
from rlhfkit.types import PaddingFreeBatch, PaddingFreePairs, PreferenceBatch, PromptBatch, SFTBatch, UnpairedBatch


def _real(lengths: list[int], width: int | None = None, left: bool = False) -> torch.Tensor:
    """(B, width) bool: where each row's `lengths[b]` real tokens go, on the right of its padding (`left`) or the left."""
    n = torch.tensor(lengths, dtype=torch.long)[:, None]
    cols = torch.arange(max(lengths, default=0) if width is None else width)
    return cols >= cols.numel() - n if left else cols < n


def _pad(rows: list[list[int]], value: int, width: int | None = None, left: bool = False) -> torch.Tensor:
    """The rows padded with `value` to `width` (the longest row's length by default): (B, width) long. The tokens
    are written in one masked copy of their concatenation (row-major order is the rows' order), read through a
    C array (several times faster than `torch.tensor` on a list of Python ints)."""
    real = _real([len(r) for r in rows], width, left)
    out = torch.full(real.shape, value, dtype=torch.long)
    flat = array.array("q", [t for r in rows for t in r])
    if flat:
        out[real] = torch.frombuffer(flat, dtype=torch.long)
    return out


def _labels(prompt: list[int], response: list[int], action_mask: list[int] | None) -> list[int]:
    """-100 on the prompt and, with an action mask, on the response tokens the assistant did not write (tool
    results, the headers between turns); the token ids elsewhere."""
    if action_mask is None:
        return [IGNORE_INDEX] * len(prompt) + response
    if len(action_mask) != len(response):  # an example edited without its mask: its labels would be shifted
        raise ValueError(f"an action mask of {len(action_mask)} tokens for a response of {len(response)}")
    return [IGNORE_INDEX] * len(prompt) + [t if m else IGNORE_INDEX for t, m in zip(response, action_mask)]


def _join(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int, width: int | None = None,
          action_masks: list[list[int]] | None = None):
    """Right-padded prompt + response rows: (input_ids, attention_mask, labels), labels -100 outside the response
    (and off its action mask, when given)."""
    ids = [p + r for p, r in zip(prompts, responses)]
    labels = [_labels(p, r, m) for p, r, m in zip(prompts, responses, action_masks or [None] * len(prompts))]
    return _pad(ids, pad_token_id, width), _real([len(x) for x in ids], width).long(), _pad(labels, IGNORE_INDEX, width)


def collate_sft(examples: list[SFTExample], pad_token_id: int) -> SFTBatch:
    """Right padding; labels padded with -100; attention_mask 1 on real tokens."""
    ids = [e["input_ids"] for e in examples]
    return SFTBatch(
        input_ids=_pad(ids, pad_token_id),  # (B, T)
        attention_mask=_real([len(x) for x in ids]).long(),  # (B, T)
        labels=_pad([e["labels"] for e in examples], IGNORE_INDEX),  # (B, T)
    )


def pack_sft(examples: list[SFTExample], max_length: int) -> list[SFTExample]:
    """Concatenates SFT examples and cuts the stream into rows of max_length tokens (the last row holds the rest).

    Labels travel with their ids, so completion-only masking survives. Classic packing (GPT pre-training, TRL's
    ConstantLengthDataset): attention crosses example boundaries, so a token also attends to the earlier examples
    of its row; the -100 labels on each prompt keep the loss off the boundary tokens.
    """
    ids = [t for e in examples for t in e["input_ids"]]
    labels = [t for e in examples for t in e["labels"]]
    return [{"input_ids": ids[s : s + max_length], "labels": labels[s : s + max_length]} for s in range(0, len(ids), max_length)]


def _padding_free(ids: list[list[int]], labels: list[list[int]]) -> PaddingFreeBatch:
    """Sequences end to end in one row, position ids restarting at 0 at each (see `PaddingFreeBatch`)."""
    return PaddingFreeBatch(
        input_ids=torch.tensor([[t for x in ids for t in x]], dtype=torch.long),  # (1, N)
        position_ids=torch.tensor([[t for x in ids for t in range(len(x))]], dtype=torch.long),  # (1, N)
        labels=torch.tensor([[t for x in labels for t in x]], dtype=torch.long),  # (1, N)
        seq_lens=torch.tensor([len(x) for x in ids], dtype=torch.long),  # (S,)
    )


def collate_sft_padding_free(examples: list[SFTExample]) -> PaddingFreeBatch:
    """`collate_sft` without padding (data.padding_free): the examples in one row, each attending to itself only."""
    return _padding_free([e["input_ids"] for e in examples], [e["labels"] for e in examples])


def _action_masks(examples: list[dict], side: str, actions_only: bool) -> list[list[int]] | None:
    return [e[f"{side}_action_mask"] for e in examples] if actions_only else None


def collate_preference(examples: list[PreferenceExample], pad_token_id: int, actions_only: bool = True) -> PreferenceBatch:
    """prompt + chosen and prompt + rejected, both right-padded to ONE common length T so that the trainer can
    concatenate them into a single forward pass. Labels are -100 on the prompt and, with `actions_only`, on the
    response tokens the assistant did not write (tool results): a log-prob sum over the labels is the policy's.
    The reward model passes actions_only=False: it reads the whole conversation."""
    prompts = [e["prompt_ids"] for e in examples]
    chosen = [e["chosen_ids"] for e in examples]
    rejected = [e["rejected_ids"] for e in examples]
    width = max(len(p) + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected))
    chosen_ids, chosen_mask, chosen_labels = _join(prompts, chosen, pad_token_id, width,
                                                   _action_masks(examples, "chosen", actions_only))  # (B, T) each
    rejected_ids, rejected_mask, rejected_labels = _join(prompts, rejected, pad_token_id, width,
                                                         _action_masks(examples, "rejected", actions_only))  # (B, T) each
    return PreferenceBatch(
        chosen_input_ids=chosen_ids,
        chosen_attention_mask=chosen_mask,
        chosen_labels=chosen_labels,
        rejected_input_ids=rejected_ids,
        rejected_attention_mask=rejected_mask,
        rejected_labels=rejected_labels,
        margin=torch.tensor([float(e["margin"]) for e in examples], dtype=torch.float32),  # (B,)
    )


def collate_preference_padding_free(examples: list[PreferenceExample], actions_only: bool = True) -> PaddingFreePairs:
    """`collate_preference` without padding (data.padding_free): the B prompt + chosen, then the B prompt + rejected
    sequences in one row, each attending to itself only."""
    sides = [[e["prompt_ids"] + e[f"{side}_ids"] for e in examples] for side in ("chosen", "rejected")]
    labels = [[_labels(e["prompt_ids"], e[f"{side}_ids"], e[f"{side}_action_mask"] if actions_only else None)
               for e in examples] for side in ("chosen", "rejected")]
    return PaddingFreePairs(
        sequences=_padding_free(sides[0] + sides[1], labels[0] + labels[1]),  # 2B sequences
        margin=torch.tensor([float(e["margin"]) for e in examples], dtype=torch.float32),  # (B,)
    )


def collate_unpaired(examples: list[UnpairedExample], pad_token_id: int,
                     partners: list[UnpairedExample] | None = None) -> UnpairedBatch:
    """KTO batch. The kl_* rows pair prompt i with the completion of `partners[i]`: by default example (i + 1) % B of
    this batch, a cyclic shift (TRL pairs each prompt with the completions of a reversed/shifted batch). KTO's
    reference point z0 is estimated from these mismatched pairs (Ethayarajh et al. 2024, arXiv 2402.01306, §4.1); the
    KTO trainer passes partners drawn from a larger set (the step's global batch, the eval set), so that the pairs do
    not depend on how that set is split into micro-batches and processes. A KL row can be longer than
    data.max_length (prompt i with another prompt's room for its completion); it is only used for the z0 estimate."""
    if partners is None and len(examples) < 2:
        raise ValueError(
            f"collate_unpaired needs at least 2 examples per batch, got {len(examples)}: KTO's reference point z0 "
            "is estimated from mismatched (prompt, completion) pairs within the batch"
        )
    prompts = [e["prompt_ids"] for e in examples]
    partners = examples[1:] + examples[:1] if partners is None else partners
    completions, masks = [e["completion_ids"] for e in examples], [e["completion_action_mask"] for e in examples]
    shifted, shifted_masks = [p["completion_ids"] for p in partners], [p["completion_action_mask"] for p in partners]
    input_ids, attention_mask, labels = _join(prompts, completions, pad_token_id, None, masks)  # (B, T) each
    kl_input_ids, kl_attention_mask, kl_labels = _join(prompts, shifted, pad_token_id, None, shifted_masks)  # (B, T') each
    return UnpairedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        desirable=torch.tensor([bool(e["desirable"]) for e in examples], dtype=torch.bool),  # (B,)
        kl_input_ids=kl_input_ids,
        kl_attention_mask=kl_attention_mask,
        kl_labels=kl_labels,
    )


def collate_prompts(examples: list[PromptExample], pad_token_id: int) -> PromptBatch:
    """LEFT padding, so that every prompt ends at the last column and generation continues from there."""
    ids = [e["prompt_ids"] for e in examples]
    return PromptBatch(
        input_ids=_pad(ids, pad_token_id, left=True),  # (B, P)
        attention_mask=_real([len(x) for x in ids], left=True).long(),  # (B, P)
    )
