"""Sampling: the only place responses are generated, behind one `generate()` so a faster engine can replace it.

Uses transformers' `generate` with the KV cache on left-padded prompts. The log-probs it reports are kept only to
measure the gap to the training forward (`token_logprobs`), which is what PPO's ratio uses; they are read one step
at a time (`SampledLogprobs`), so no (B, R, V) logits are held for the rollout.
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


class SampledLogprobs:
    """A logits processor that records log p(sampled token) under softmax(scores / temperature), holding one step's
    (B, V) log-softmax at a time: the token drawn at step t is known at step t + 1 (the last column of `input_ids`),
    and the last step's in `finish`. transformers runs user processors before the temperature/top-k/top-p warpers, so
    `scores` are the model's logits (after any penalty the model's generation config applies): the density sampled
    from before truncation, as the training forward computes it."""

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # (B, V) log-softmax of the step whose token is not known yet
        self.values: list[torch.Tensor] = []  # (B,) per step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.values.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, -1)
        return scores

    def finish(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(B, R) log-probs of `response_ids`, the tokens generated (before any padding is written over them)."""
        if self.pending is not None:
            self.values.append(self.pending.gather(-1, response_ids[:, -1:]).squeeze(-1))
            self.pending = None
        if not self.values:
            return torch.zeros(response_ids.shape, dtype=torch.float32, device=response_ids.device)
        return torch.stack(self.values, 1)


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
    from transformers import LogitsProcessorList

    recorder = SampledLogprobs(params.temperature)
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
            logits_processor=LogitsProcessorList([recorder]),
        )
    finally:
        model.train(was_training)
    response_ids = out.sequences[:, prompt_ids.shape[1] :]  # (B, R)
    sampler_logprobs = recorder.finish(response_ids)  # (B, R), before padding overwrites tokens after the EOS
    response_mask, has_eos = response_mask_from_eos(response_ids, eos_token_id)
    response_ids = response_ids.masked_fill(response_mask == 0, pad_token_id)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        group_ids=group_ids,
        has_eos=has_eos,
        sampler_logprobs=sampler_logprobs * response_mask,
    )
