"""Sampling: the only place responses are generated, behind one `generate()`.

Two engines, chosen by `generation.engine`:

- "rlhfkit" (the default): a decode loop of our own over transformers' KV-cache classes. It prefills the left-padded
  prompts, then feeds one token per row per step, and stops when every row has emitted EOS. Each step samples from
  softmax(logits / τ) after top-k / top-p truncation, as transformers' warpers do, and records log p(token) under
  the untruncated softmax(logits / τ): the density the training forward computes. Only those (B,) values are kept per
  step, never (B, R, V) logits. The model's own `generation_config` (repetition penalty, extra EOS ids, ...) plays no
  part, so the tokens are drawn from exactly the policy that is trained. With `generation.compile` the cache is a
  `StaticCache` and the one-token step is compiled: on a GPU with `torch.compile(mode="reduce-overhead")` (CUDA
  graphs), every step marked as a new graph run and its logits copied out before the next replay.
- "hf": transformers' `generate`, the reference the loop is tested against (the same tokens under the same seed).
  Its log-probs are recorded one step at a time (`SampledLogprobs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math

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


def truncate_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(B, V) -> (B, V) with the tokens outside the top-k, then outside the nucleus of mass `top_p`, set to -inf; the
    most likely token always stays. The same rules as transformers' TopK / TopP warpers, so that the same logits and
    the same random state draw the same token (top_k=0 and top_p=1 are off)."""
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (B, 1) the k-th largest score
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1)
        # Drop the least likely tokens while what they hold together stays within 1 - top_p of the mass.
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p  # (B, V), in ascending order
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores


def sample_next(logits: torch.Tensor, params: GenerationConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step. logits (B, V) -> (token (B,), log p(token) under softmax(logits / τ) (B,), fp32).

    The token is drawn (`torch.multinomial`, as transformers does) from the truncated distribution; its log-prob is
    read from the untruncated one, as the training forward computes it (temperature applied identically)."""
    scores = logits.float() / params.temperature  # (B, V)
    probs = truncate_logits(scores, params.top_k, params.top_p).softmax(-1)
    token = torch.multinomial(probs, 1).squeeze(-1)  # (B,)
    return token, torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)


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


def _cache_argument(model) -> str:
    """The name the model's forward gives its KV cache: `cache` from transformers 5.24, `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _static_cache_length(width: int) -> int:
    """A static cache's length, rounded up to a multiple of 128 so that batches of nearby prompt widths share one
    compiled graph (each new length compiles again)."""
    return -(-width // 128) * 128


def _compiled_step(model, forward, cuda: bool):
    """The one-token step compiled once per model and kept on it (policy and reference alternating in an evaluation
    keep their own graphs): CUDA graphs on a GPU, inductor's fused kernels on CPU."""
    step = model.__dict__.get("_rlhfkit_decode_step")
    if step is None:
        step = torch.compile(forward, mode="reduce-overhead" if cuda else None, dynamic=False)
        model.__dict__["_rlhfkit_decode_step"] = step  # a plain attribute: no submodule, no state-dict entry
    return step


def decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: GenerationConfig,
           eos_token_id: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rlhfkit's decode loop. (B, P) left-padded prompts -> (response ids (B, R), sampler log-probs (B, R)); R is the
    step at which every row had emitted EOS, at most `max_new_tokens`. A finished row is fed `pad_token_id`.

    1. Cache: a DynamicCache, or with `params.compile` a StaticCache of a fixed length and a compiled step.
    2. Prefill the prompts (logits of the last position only); positions count real tokens, so left padding does not
       shift them, and the attention mask hides the pads.
    3. Each step samples a token per row (`sample_next`), stops when all rows are done, else feeds the tokens back
       at the next position.
    """
    from transformers import DynamicCache, StaticCache

    batch, width = prompt_ids.shape
    total = width + params.max_new_tokens
    static, cuda = params.compile, prompt_ids.is_cuda
    cache_len = _static_cache_length(total) if static else total
    cache = StaticCache(config=model.config, max_cache_len=cache_len) if static else DynamicCache(config=model.config)
    arg = _cache_argument(model)
    # (B, cache_len): the prompt's mask, then ones; a step reads the columns written so far (all of them with a
    # static cache, whose unwritten columns causality hides).
    mask = torch.ones(batch, cache_len, dtype=prompt_mask.dtype, device=prompt_mask.device)
    mask[:, :width] = prompt_mask

    def forward(ids, attention_mask, positions, kv):
        return model(input_ids=ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                     logits_to_keep=1, **{arg: kv}).logits[:, -1].float()  # (B, V)

    step = _compiled_step(model, forward, cuda) if static else forward
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, P)
    logits = forward(prompt_ids, mask if static else mask[:, :width], positions, cache)
    position = positions[:, -1:]  # (B, 1)
    done = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    tokens, logprobs = [], []
    for t in range(params.max_new_tokens):
        token, logprob = sample_next(logits, params)  # (B,), (B,)
        token = token.masked_fill(done, pad_token_id)
        tokens.append(token)
        logprobs.append(logprob)
        done = done | (token == eos_token_id)
        if t == params.max_new_tokens - 1 or bool(done.all()):
            break
        position = position + 1
        if static:
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()  # the previous replay's output is no longer read
            logits = step(token[:, None], mask, position, cache).clone()
        else:
            logits = step(token[:, None], mask[:, : width + t + 1], position, cache)
    return torch.stack(tokens, 1), torch.stack(logprobs, 1)


def _hf_generate(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: GenerationConfig,
                 eos_token_id: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `generate`: (response ids (B, R), sampler log-probs (B, R)), R as in `decode`."""
    from transformers import LogitsProcessorList

    recorder = SampledLogprobs(params.temperature)
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
    response_ids = out.sequences[:, prompt_ids.shape[1] :]  # (B, R)
    return response_ids, recorder.finish(response_ids)  # before padding overwrites tokens after the EOS


def prompt_seed(seed: int, step: int, prompt_ids: torch.Tensor) -> int:
    """A seed that is a function of (the run's seed, the step, the prompt's tokens) alone: not of the process that
    draws the prompt, nor of its neighbours in the batch."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_ids.tolist()}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch.manual_seed takes up to 2**64 - 1


def stack_rollouts(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rollouts of one prompt each as one rollout: prompts left-padded, responses right-padded to the widest, group
    ids renumbered in order."""
    width_p = max(p.prompt_ids.shape[1] for p in parts)
    width_r = max(p.response_ids.shape[1] for p in parts)
    left = lambda x, v: torch.nn.functional.pad(x, (width_p - x.shape[1], 0), value=v)  # noqa: E731
    right = lambda x, v: torch.nn.functional.pad(x, (0, width_r - x.shape[1]), value=v)  # noqa: E731
    group_ids = torch.cat([torch.full_like(p.group_ids, i) for i, p in enumerate(parts)])
    return Rollout(prompt_ids=torch.cat([left(p.prompt_ids, pad_token_id) for p in parts]),
                   prompt_mask=torch.cat([left(p.prompt_mask, 0) for p in parts]),
                   response_ids=torch.cat([right(p.response_ids, pad_token_id) for p in parts]),
                   response_mask=torch.cat([right(p.response_mask, 0) for p in parts]),
                   group_ids=group_ids, has_eos=torch.cat([p.has_eos for p in parts]),
                   sampler_logprobs=torch.cat([right(p.sampler_logprobs, 0.0) for p in parts]),
                   action_mask=torch.cat([right(p.action_mask, 0) for p in parts]))


@torch.no_grad()
def generate(model, prompts: PromptBatch, params: GenerationConfig, eos_token_id: int, pad_token_id: int,
             seeds: list[int] | None = None) -> Rollout:
    """Sample `params.num_samples` responses per prompt; returns a `Rollout` (rows of one prompt adjacent).

    With `seeds` (one per prompt), each prompt's responses are drawn alone, without its padding, under its own seed
    (the caller's random state untouched): they depend on the prompt and its seed only, whatever the batch."""
    if seeds is not None:
        parts = []
        for ids, mask, seed in zip(prompts.input_ids, prompts.attention_mask, seeds, strict=True):
            ids = ids[mask.bool()].unsqueeze(0)
            with seeded(seed):
                parts.append(generate(model, PromptBatch(ids, torch.ones_like(ids)), params, eos_token_id, pad_token_id))
        return stack_rollouts(parts, pad_token_id)
    k = params.num_samples
    prompt_ids = prompts.input_ids.repeat_interleave(k, 0)  # (B*k, P)
    prompt_mask = prompts.attention_mask.repeat_interleave(k, 0)
    group_ids = torch.arange(prompts.input_ids.shape[0], device=prompt_ids.device).repeat_interleave(k)
    engine = decode if params.engine == "rlhfkit" else _hf_generate
    was_training = model.training
    model.eval()  # no dropout while sampling; and gradient checkpointing would disable the KV cache
    try:
        response_ids, sampler_logprobs = engine(model, prompt_ids, prompt_mask, params, eos_token_id, pad_token_id)
    finally:
        model.train(was_training)
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
        action_mask=response_mask,  # single-turn: every response token is the policy's
    )
