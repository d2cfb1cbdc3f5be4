"""How a batch runs through a model to be scored: its attention inputs (`attention_inputs`), a rollout's rows moved
left past their prompts' padding (`moved_left`), the forward itself with no KV cache and only the logits it needs
(`scoring_forward`), and a rollout's logits at its response's positions alone (`response_logits`). The log-probs and
scores built on them are `rlhfkit.models`' and `rlhfkit.rewards`'.
"""

from __future__ import annotations

import functools
import inspect

import torch
from peft import PeftModel


def unwrap_peft(model):
    """The transformers model under a peft wrapper (LoRA layers stay injected), or `model` itself."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def unwrap_model(model):
    """The transformers model under DDP and/or a peft wrapper (LoRA layers stay injected)."""
    return unwrap_peft(model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model)


def scoring_forward(model, input_ids, inputs: dict, keep: int) -> torch.Tensor:
    """The logits of a forward that scores tokens: `keep` last positions where the model takes transformers'
    `logits_to_keep`, and never a KV cache (a model keeps `config.use_cache` on unless it trains with checkpointing,
    and a forward given a mask would otherwise build one that nobody reads: every layer's keys and values alive to
    the forward's end)."""
    cls = type(unwrap_model(model))
    kwargs = {"logits_to_keep": keep} if _accepts(cls, "logits_to_keep") else {}
    return model(input_ids=input_ids, **inputs, **kwargs, **no_cache(model, through_kwargs=True)).logits


def no_cache(model, through_kwargs: bool = False) -> dict[str, bool]:
    """{"use_cache": False} where `model`'s forward takes it (by name, or with `through_kwargs` through its **kwargs:
    a wrapper passing them on), else {} (an encoder classifier has no cache to refuse)."""
    return {"use_cache": False} if _accepts(type(unwrap_model(model)), "use_cache", through_kwargs) else {}


def attention_inputs(attention_mask: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The `attention_mask` and `position_ids` a padded batch (B, T) is run with.

    A batch with a pad before some real token (left-padded prompts) keeps its mask, with position ids that follow it
    (cumsum - 1), so left and right padding give the same values. A right-padded batch (each row its real tokens,
    then pads, or none: what every offline collator makes) needs neither: under causal attention no real token reads
    a later pad, and its positions 0..L-1 are the default ones. Without a mask, SDPA and flash attention run their
    causal kernels (no (B, 1, T, T) mask built or read, the blocks above the diagonal skipped) and the rotary
    embedding is computed for one row, not B: the same values on every real token (bit for bit with CPU SDPA:
    tests/unit/test_models.py), the pads' own outputs, which nothing reads, aside.
    """
    mask = attention_mask.long()
    if not bool((mask[:, 1:] > mask[:, :-1]).any()):  # no pad followed by a real token
        return {"attention_mask": None, "position_ids": None}
    return {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


@functools.lru_cache(maxsize=None)
def _accepts(cls: type, name: str, any_keyword: bool = False) -> bool:
    """Whether `cls.forward` takes `name` (or, with `any_keyword`, any keyword through its **kwargs)."""
    params = inspect.signature(cls.forward).parameters
    return name in params or any_keyword and any(p.kind is p.VAR_KEYWORD for p in params.values())


def moved_left(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) columns that move each row of a batch left past its left padding, the padding wrapped round to its end
    (`x.gather(1, cols)`), and (B,) each row's left padding. The same tokens at the same positions (`attention_inputs`
    counts them from the first real token either way), so the same outputs, but a rollout whose only gap was its
    prompts' left padding becomes right-padded and runs without a mask: the causal kernel, no (B, 1, T, T) mask."""
    lead = mask.long().argmax(1)  # the column of each row's first real token
    return (torch.arange(mask.shape[1], device=mask.device) + lead[:, None]) % mask.shape[1], lead


def moved_left_rollout(rollout, *rows: torch.Tensor):
    """A rollout's input ids and mask, and any more (B, T) tensors `rows`, `moved_left`, then (B, R) the positions
    that predict its response tokens there: P-1+k for response token k, less the row's left padding."""
    cols, lead = moved_left(rollout.attention_mask)
    moved = [x.gather(1, cols) for x in (rollout.input_ids, rollout.attention_mask, *rows)]
    start = rollout.prompt_ids.shape[1] - 1
    return (*moved, torch.arange(rollout.response_ids.shape[1], device=lead.device) + start - lead[:, None])


def response_logits(model, rollout) -> torch.Tensor:
    """(B, R, V) logits of the positions that predict a `Rollout`'s response tokens, and of no other position.

    The rows run `moved_left_rollout` (right-padded: no mask), so row i's response starts at P - lead_i and a single
    window of positions would span the longest row's prompt padding too: up to twice the B·R·V logits (and their
    log-softmax) the response needs. Instead the model's own forward runs, called as a whole (peft, DDP, FSDP and
    DeepSpeed see an ordinary call), and a forward pre-hook on its output embedding (`get_output_embeddings()`)
    hands the head each row's R hidden states at the response's positions, (B, R, H), in place of the (B, W, H) it
    was given. What the forward does to the head's output, per position (Gemma2's final soft-capping, Granite's
    `logits_scaling`, a tied head), still applies: the values are the full forward's at those positions.

    The rule: the hook gathers when the head is called once, on the last W positions' hidden states (B, W, H), W the
    `logits_to_keep` asked for (or T for a forward without it). Otherwise — no output embedding found, a head called
    on another shape, or never through that module — the forward's own logits are gathered after it (today's cost,
    same values); a head called twice in one forward is refused (which call scores the tokens is not known).
    """
    ids, mask, take = moved_left_rollout(rollout)  # take: (B, R) positions predicting the response
    inputs = attention_inputs(mask)
    total = ids.shape[1]
    keep = total - int(take.min())  # the window of positions that predict some response token
    width = keep if _accepts(type(unwrap_model(model)), "logits_to_keep") else total
    head, calls = output_embeddings(model), []

    def gather(module, args):
        hidden = args[0]
        calls.append(not calls and hidden.dim() == 3 and hidden.shape[:2] == (ids.shape[0], width))
        if calls[-1]:
            at = (take - (total - width)).unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (B, R, H)
            return (hidden.gather(1, at), *args[1:])
        return None

    handle = head.register_forward_pre_hook(gather) if head is not None else None
    try:
        logits = scoring_forward(model, ids, inputs, keep)
    finally:
        if handle is not None:
            handle.remove()
    if len(calls) > 1:
        raise RuntimeError(f"{type(unwrap_model(model)).__name__}'s forward calls its output embedding {len(calls)} "
                           "times: which call gives the logits is not known")
    if calls == [True]:
        return logits  # (B, R, V)
    at = (take - (total - logits.shape[1])).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return logits.gather(1, at)  # (B, W, V) -> (B, R, V)


def output_embeddings(model) -> torch.nn.Module | None:
    """The output embedding (the LM head) of `model` under its DDP, FSDP, DeepSpeed and peft wrappers, or None."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    get = getattr(unwrap_peft(model), "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, torch.nn.Module) else None
