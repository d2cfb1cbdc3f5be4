"""Sampling: the only place responses are generated, behind one `generate()` so a faster engine can replace it.

Uses transformers' `generate` with the KV cache on left-padded prompts. The log-probs it reports are kept only to
measure the gap to the training forward (`token_logprobs`), which is what PPO's ratio uses.
"""

from __future__ import annotations

import contextlib

import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.types import PromptBatch, Rollout


@contextlib.contextmanager
def seeded(seed: int):
    """Sample under `seed` without disturbing the caller's random state: a batch drawn under its own seed gives the
    same responses whichever process draws it, and after whatever was drawn before it."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def response_mask_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) ids -> mask of the tokens up to and including the first EOS (B, R), and whether one was found (B,)."""
    is_eos = response_ids == eos_token_id
    # Positions strictly after the first EOS: the running count of EOS tokens seen before this one is >= 1.
    after = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return (~after).long(), is_eos.any(-1)


@torch.no_grad()
def generate(model, prompts: PromptBatch, params: GenerationConfig, eos_token_id: int, pad_token_id: int) -> Rollout:
    """Sample `params.num_samples` responses per prompt; returns a `Rollout` (rows of one prompt adjacent)."""
    k = params.num_samples
    prompt_ids = prompts.input_ids.repeat_interleave(k, 0)  # (B*k, P)
    prompt_mask = prompts.attention_mask.repeat_interleave(k, 0)
    group_ids = torch.arange(prompts.input_ids.shape[0], device=prompt_ids.device).repeat_interleave(k)
    was_training = model.training
    model.eval()  # no dropout while sampling; and gradient checkpointing would disable the KV cache
    try:
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            do_sample=True,
            temperature=params.temperature,
            top_k=params.top_k or None,
            top_p=params.top_p,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=True,
        )
    finally:
        model.train(was_training)
    response_ids = out.sequences[:, prompt_ids.shape[1] :]  # (B, R)
    response_mask, has_eos = response_mask_from_eos(response_ids, eos_token_id)
    response_ids = response_ids.masked_fill(response_mask == 0, pad_token_id)
    # The sampler's view: raw logits / temperature (top-k/p truncation is not part of the policy's density).
    logits = torch.stack(out.logits, 1).float() / params.temperature  # (B, R, V)
    sampler_logprobs = torch.log_softmax(logits, -1).gather(-1, response_ids.unsqueeze(-1)).squeeze(-1)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=group_ids,
        has_eos=has_eos,
        sampler_logprobs=sampler_logprobs * response_mask,
    )
