"""One sampling step and the random streams it draws from: the truncation rules (transformers' top-k / top-p
warpers), the token draw, its log-prob under the untruncated tempered density, and the per-prompt seeds."""

from __future__ import annotations

import contextlib
import hashlib
import math

import torch

from rlhfkit.config import GenerationConfig


@contextlib.contextmanager
def seeded(seed: int):
    """Sample under `seed` without disturbing the caller's random state: a batch drawn under its own seed gives the
    same responses whichever process draws it, and after whatever was drawn before it."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def prompt_seed(seed: int, step: int, prompt_ids: torch.Tensor) -> int:
    """A seed that is a function of (the run's seed, the step, the prompt's tokens) alone: not of the process that
    draws the prompt, nor of its neighbours in the batch."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_ids.tolist()}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # torch.manual_seed takes up to 2**64 - 1


def seeded_generator(seed: int, device) -> torch.Generator:
    """A generator in the state `seeded(seed)` leaves the device's default one in: a prompt drawn with it, beside
    others, draws what it would alone under `seeded(seed)`."""
    return torch.Generator(device=device).manual_seed(seed)


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


def sample_next(logits: torch.Tensor, params: GenerationConfig,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step. logits (B, V) -> (token (B,), log p(token) under softmax(logits / τ) (B,), fp32): the draw
    of `torch.multinomial` (as transformers does) from the truncated distribution, with `generator` (None: the default
    one); its log-prob read from the untruncated one, as the training forward computes it (temperature applied
    identically). `sample_slots` with every row in its own slot."""
    return sample_slots(logits, None, logits.shape[0], params, generator)


def sample_slots(logits: torch.Tensor, slots: list[int] | None, total: int, params: GenerationConfig,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step for n rows that hold `slots` (None: 0..n-1) of a draw over `total` slots, the others' rows
    gone (finished). logits (n, V) -> (token (n,), log p(token) (n,), fp32), each row's token the one
    `torch.multinomial` would draw for its slot with the other slots' rows given flat logits.

    `torch.multinomial` of one sample draws e ~ Exp(1) per (slot, token), from the generator in that order, and takes
    per row the argmax of p / e (torch's Distributions.cpp): a row's token depends on its probabilities and its slot
    only. On a CPU the exponentials are computed here, from the same uniforms (one float64 per (slot, token), the
    generator advanced exactly as `exponential_` advances it) by torch's formula -log1p(-u) (the same float32 values,
    bit for bit: tests/unit/test_generation.py), for the present slots only; a finished row's slot costs its uniforms,
    not a softmax and logarithms over the vocabulary. Elsewhere (CUDA's generator differs) `torch.multinomial` draws
    over every slot."""
    scores = logits.float() / params.temperature if params.temperature != 1.0 else logits.float()  # (n, V)
    probs = truncate_logits(scores, params.top_k, params.top_p).softmax(-1)
    if probs.device.type != "cpu":
        slots = None if slots == list(range(total)) else slots
        full = probs if slots is None else probs.new_full((total, probs.shape[1]), 1.0 / probs.shape[1])
        if slots is not None:
            full[slots] = probs
        token = torch.multinomial(full, 1, generator=generator).squeeze(-1)
        token = token if slots is None else token[slots]
    else:
        if not bool(probs.sum(-1).isfinite().all()):  # a softmax is never negative: torch.multinomial's check, words
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        uniforms = torch.empty(total, probs.shape[1], dtype=torch.float64).uniform_(generator=generator)  # (total, V)
        uniforms = uniforms if slots is None or slots == list(range(total)) else uniforms[slots]  # (n, V)
        exponentials = uniforms.neg_().log1p_().to(torch.float32).neg_()  # -log1p(-u), in place (a sign is exact)
        token = probs.div_(exponentials).argmax(-1)  # (n,): torch.multinomial's argmax of p / e
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
