"""Sampling: every response rlhfkit samples comes from `generate()` (one turn per row) or, for multi-turn episodes,
from the same engine's sessions (`generation.session.Session`, used by `rollout.tool_loop`).

Two engines, chosen by `generation.engine`:

- "rlhfkit" (the default): our decode engine over transformers' KV cache (`session`). It prefills each distinct
  prompt once, then feeds one token per live row per step; a row leaves the batch at its EOS, a stop string
  (`generation.stop_strings`, `stops`) or its budget, and with `generation.max_batch_rows` a waiting prompt takes its
  place (continuous refill). Each step samples from
  softmax(logits / τ) after top-k / top-p truncation, as transformers' warpers do, and records log p(token) under
  the untruncated softmax(logits / τ): the density the training forward computes. Only those (B,) values are kept per
  step, never (B, R, V) logits. The model's own `generation_config` (repetition penalty, extra EOS ids, ...) plays no
  part, so the tokens are drawn from exactly the policy that is trained. Under one seed it draws the tokens
  transformers' `generate` draws (tests/unit/test_generation.py). With `generation.compile` the cache is a
  `StaticCache` and the one-token step is compiled (on a GPU, CUDA graphs), every row kept to the end.
- "hf": transformers' `generate`, the reference the engine is tested against. Its log-probs are recorded one step
  at a time (`SampledLogprobs`). It takes no stop strings (the config refuses them there).
"""

from __future__ import annotations

import collections
import contextlib

import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.generation.sampling import (SampledLogprobs, prompt_seed, sample_next, seeded, seeded_generator,
                                         truncate_logits)
from rlhfkit.generation.session import Group, Session, Stream, Turn, cache_argument, sliding_window_of
from rlhfkit.generation.stops import StopStrings, stop_strings
from rlhfkit.types import PromptBatch, Rollout

__all__ = ["Group", "SampledLogprobs", "Session", "StopStrings", "Stream", "Turn", "cache_argument", "decode",
           "generate", "prompt_seed", "response_mask_from_eos", "sample_next", "sampling_mode", "seeded",
           "seeded_generator", "sliding_window_of", "stop_strings", "truncate_logits"]


@contextlib.contextmanager
def sampling_mode(model):
    """The model in eval mode while it samples (no dropout; gradient checkpointing would turn the KV cache off),
    without gradients, then back as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def response_mask_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) ids -> mask of the tokens up to and including the first EOS (B, R), and whether one was found (B,)."""
    is_eos = response_ids == eos_token_id
    # Positions strictly after the first EOS: the running count of EOS tokens seen before this one is >= 1.
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after).long(), is_eos.any(-1)


def decode(model, prompts: PromptBatch, params: GenerationConfig, eos_token_id: int, pad_token_id: int,
           seeds: list[int] | None = None, stop: StopStrings | None = None):
    """The engine on `params.num_samples` rows per prompt (a prompt's rows adjacent) -> (response ids (B*k, R),
    sampler log-probs (B*k, R), response mask (B*k, R), whether each row ended by itself, at its EOS or a stop
    string (B*k,)), R the longest response; a row is padded with `pad_token_id` after its end.

    `seeds` (one per prompt): each prompt's rows draw from a generator of their own, in the state `seeded(seed)`
    gives, so they are what that prompt would draw alone under its seed; None: every row from the default one."""
    k, device = params.num_samples, prompts.input_ids.device
    shared = Stream()
    groups = [Group(list(range(i * k, (i + 1) * k)), ids[mask.bool()].tolist(),
                    Stream(seeded_generator(seeds[i], device)) if seeds is not None else shared, params.max_new_tokens)
              for i, (ids, mask) in enumerate(zip(prompts.input_ids, prompts.attention_mask))]
    waiting, max_rows = collections.deque(groups), params.max_batch_rows or len(groups) * k
    session = Session(model, params, eos_token_id, pad_token_id, device, stop)
    session.start(session.admit(waiting, max_rows))
    turns = session.sample([params.max_new_tokens] * len(session.rows), waiting=waiting, max_rows=max_rows)
    width = max(len(turn.ids) for turn in turns.values())
    response_ids = torch.full((len(turns), width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros(len(turns), width, dtype=torch.float32)
    mask = torch.zeros(len(turns), width, dtype=torch.long)
    for row, turn in turns.items():
        response_ids[row, : len(turn.ids)] = torch.tensor(turn.ids, dtype=torch.long)
        logprobs[row, : len(turn.ids)] = torch.tensor(turn.logprobs, dtype=torch.float32)
        mask[row, : len(turn.ids)] = 1
    ended = torch.tensor([turns[row].ended(eos_token_id) for row in range(len(turns))])
    return response_ids.to(device), logprobs.to(device), mask.to(device), ended.to(device)


def hf_generate(model, prompts: PromptBatch, params: GenerationConfig, eos_token_id: int, pad_token_id: int,
                seeds: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `generate` on the same rows as `decode` -> (response ids (B*k, R), sampler log-probs (B*k, R));
    with `seeds`, each prompt alone (unpadded) under `seeded(seed)`."""
    from transformers import LogitsProcessorList

    if seeds is not None:
        parts = []
        for ids, mask, seed in zip(prompts.input_ids, prompts.attention_mask, seeds, strict=True):
            ids = ids[mask.bool()].unsqueeze(0)
            with seeded(seed):
                parts.append(hf_generate(model, PromptBatch(ids, torch.ones_like(ids)), params, eos_token_id, pad_token_id))
        width = max(p[0].shape[1] for p in parts)
        right = lambda x, v: torch.nn.functional.pad(x, (0, width - x.shape[1]), value=v)  # noqa: E731
        return torch.cat([right(p[0], pad_token_id) for p in parts]), torch.cat([right(p[1], 0.0) for p in parts])
    k = params.num_samples
    recorder = SampledLogprobs(params.temperature)
    out = model.generate(
        input_ids=prompts.input_ids.repeat_interleave(k, 0), attention_mask=prompts.attention_mask.repeat_interleave(k, 0),
        do_sample=True, temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p,
        max_new_tokens=params.max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id, use_cache=True,
        return_dict_in_generate=True, logits_processor=LogitsProcessorList([recorder]))
    response_ids = out.sequences[:, prompts.input_ids.shape[1]:]  # (B*k, R)
    return response_ids, recorder.finish(response_ids)  # before padding overwrites tokens after the EOS


def generate(model, prompts: PromptBatch, params: GenerationConfig, eos_token_id: int, pad_token_id: int,
             seeds: list[int] | None = None, stop: StopStrings | None = None) -> Rollout:
    """Sample `params.num_samples` responses per prompt; returns a `Rollout` (rows of one prompt adjacent).

    With `seeds` (one per prompt), each prompt's responses are drawn under its own seed (the caller's random state
    untouched): they depend on the prompt and its seed only, whatever the batch. `stop`: `params.stop_strings` read
    with the tokenizer (`stop_strings(params, tokenizer)`), needed when there are any; a row they end has `has_eos`
    true (it ended, it was not cut)."""
    k = params.num_samples
    if bool(params.stop_strings) != (stop is not None):
        raise ValueError("generate: give stop=stop_strings(params, tokenizer) exactly when params.stop_strings is set")
    with sampling_mode(model):
        if params.engine == "rlhfkit":
            response_ids, sampler_logprobs, response_mask, has_eos = decode(model, prompts, params, eos_token_id,
                                                                            pad_token_id, seeds, stop)
        else:
            response_ids, sampler_logprobs = hf_generate(model, prompts, params, eos_token_id, pad_token_id, seeds)
            response_mask, has_eos = response_mask_from_eos(response_ids, eos_token_id)
    return Rollout(
        prompt_ids=prompts.input_ids.repeat_interleave(k, 0),  # (B*k, P)
        prompt_mask=prompts.attention_mask.repeat_interleave(k, 0),
        response_ids=response_ids.masked_fill(response_mask == 0, pad_token_id),
        response_mask=response_mask,
        group_ids=torch.arange(prompts.input_ids.shape[0], device=prompts.input_ids.device).repeat_interleave(k),
        has_eos=has_eos,
        sampler_logprobs=sampler_logprobs * response_mask,
        action_mask=response_mask,  # single-turn: every response token is the policy's
    )
