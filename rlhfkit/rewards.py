"""Rewards for online RL: scalar scores of whole sequences from reward models and ensembles of them.

A reward function takes token ids and their attention mask (B, T) and returns one float32 score per sequence (B,).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import Tensor

from rlhfkit.config import ModelConfig
from rlhfkit.models import load_reward_model, load_tokenizer, unwrap_model


POOLING_ATTR = "rlhfkit_pooling"  # in a reward model's config: "last" (default) or "mean" (RMOptions.pooling)


class RewardFn(Protocol):
    def __call__(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor | None = None) -> Tensor:
        """(B, T), (B, T), optional (B, T) 1 on the response tokens -> (B,)."""
        ...


def pooling_of(model) -> str:
    """How `model`'s sequence score is read: "last" (its last real token) or "mean" (over the response tokens)."""
    return getattr(unwrap_model(model).config, POOLING_ATTR, None) or "last"


def token_scores(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The scalar head's output at every position of a sequence-classification model: (B, T), (B, T) -> (B, T).

    The model is called through its own forward (so peft, DDP and FSDP wrappers see an ordinary call) and the
    per-token scores (B, T, 1) are read from the `score` head with a forward hook; under a peft SEQ_CLS wrapper
    that head routes to the trained copy (modules_to_save), so LoRA + head training works. Position ids follow the
    mask (cumsum - 1), so left and right padding give the same values. A PPO critic reads its values here.
    """
    base = unwrap_model(model)
    head = getattr(base, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(
            f"{type(base).__name__} has no `score` head: load the reward model with rlhfkit.models.load_reward_model "
            "(AutoModelForSequenceClassification)"
        )
    captured: list[Tensor] = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        mask = attention_mask.long()
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # clamp: left-pad positions get 0, and are never read
        model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    return captured[-1][..., 0].float()  # (B, T, 1) -> (B, T)


def sequence_scores(model, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor | None = None) -> Tensor:
    """The score of a sequence-classification model per sequence: (B, T), (B, T) -> (B,) fp32.

    By default (pooling "last") the head is read at the last real token, the last position where `attention_mask`
    is 1. Transformers' own pooling instead looks for the last token that is not the pad id, which is wrong whenever
    pad == eos and a response ends with eos (SmolLM2, Llama 3, ...). A reward model trained with pooling "mean"
    (its config says so) scores the mean of the head over `response_mask` (B, T), which it then needs.
    """
    scores = token_scores(model, input_ids, attention_mask)  # (B, T)
    if pooling_of(model) == "mean":
        if response_mask is None:
            raise ValueError("this reward model pools over the response tokens (rlhfkit_pooling = mean): pass response_mask")
        weights = (response_mask * attention_mask).to(scores.dtype)
        return (scores * weights).sum(-1) / weights.sum(-1).clamp(min=1)
    mask = attention_mask.long()
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = (positions * mask).argmax(-1)  # (B,) the rightmost position whose mask is 1
    return scores.gather(1, last.to(scores.device).unsqueeze(1)).squeeze(1)


class RewardModelScorer:
    """A reward model as a `RewardFn`; `input_ids` must come from `tokenizer` (the reward model's own)."""

    def __init__(self, model, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor | None = None) -> Tensor:
        return sequence_scores(self.model, input_ids, attention_mask, response_mask)


class EnsembleScorer:
    """Several reward functions reduced to one score per sequence.

    `reduce="mean"` averages; `reduce="min"` takes the most pessimistic member, the conservative ensemble that
    curbs reward over-optimisation (Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization",
    arXiv 2310.02743, worst-case optimisation).
    """

    def __init__(self, scorers: list[RewardFn], reduce: Literal["mean", "min"] = "mean"):
        if not scorers:
            raise ValueError("EnsembleScorer needs at least one scorer")
        if reduce not in ("mean", "min"):
            raise ValueError(f"reduce must be 'mean' or 'min', got {reduce!r}")
        self.scorers = list(scorers)
        self.reduce = reduce

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor | None = None) -> Tensor:
        args = (input_ids, attention_mask) if response_mask is None else (input_ids, attention_mask, response_mask)
        scores = torch.stack([s(*args) for s in self.scorers])  # (K, B)
        return scores.mean(0) if self.reduce == "mean" else scores.min(0).values


def load_reward_scorer(
    paths: list[str] | str,
    reduce: Literal["mean", "min"] = "mean",
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32",
) -> RewardModelScorer | EnsembleScorer:
    """Frozen reward model(s) saved by the reward stage: one path gives a scorer, several an ensemble."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    scorers = []
    for path in paths:
        cfg = ModelConfig(name_or_path=path, dtype=dtype)
        tokenizer = load_tokenizer(cfg)
        scorers.append(RewardModelScorer(load_reward_model(cfg, tokenizer, trainable=False), tokenizer))
    return scorers[0] if len(scorers) == 1 else EnsembleScorer(scorers, reduce)


# Python reward functions and score post-processing --------------------------------------------------------------


def load_reward_function(ref: str):
    """Import `module:function` (the current directory is importable, as for `python -m`).

    The function takes `(prompts: list[str], completions: list[str])` and returns one float per completion.
    """
    import importlib
    import os
    import sys

    from rlhfkit.errors import UserError

    module_name, _, name = ref.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"reward.function '{ref}': cannot import module '{module_name}' ({exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward.function '{ref}': module '{module_name}' has no function '{name}'")
    return fn


class RunningMoments:
    """Running mean and variance of all scores seen (Chan et al. parallel update), for `normalize: running`."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: Tensor) -> None:
        n = x.numel()
        batch_mean, batch_var = x.float().mean().item(), x.float().var(unbiased=False).item()
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])


def normalize_scores(
    scores: Tensor, mode: str, running: RunningMoments | None = None, clip: float | None = None, eps: float = 1e-8
) -> Tensor:
    """Normalise then clip a batch of scores (B,).

    Modes: "none"; "batch" z-score over this batch; "running" z-score with moments of every score so far (updated
    with this batch first); "minmax" to [0, 1] over this batch. `clip` bounds the result to [-clip, clip].
    """
    x = scores.float()
    if mode == "batch":
        x = (x - x.mean()) / (x.std(unbiased=False) + eps)
    elif mode == "running":
        assert running is not None, "running normalisation needs a RunningMoments"
        running.update(x)
        x = (x - running.mean) / (running.var**0.5 + eps)
    elif mode == "minmax":
        x = (x - x.min()) / (x.max() - x.min() + eps)
    elif mode != "none":
        raise ValueError(f"unknown normalisation {mode!r}")
    return x.clamp(-clip, clip) if clip is not None else x


class RewardSource:
    """The reward of the sampling stages (online RL, rejection sampling): reward model(s) scoring a rollout's token
    ids, or a Python function of its text; plus an optional gold judge that is only logged.

    Python functions load first, so a bad `module:function` fails before any reward model loads.
    """

    def __init__(self, cfg, tokenizer, device):
        self.tokenizer = tokenizer
        self.function = load_reward_function(cfg.function) if cfg.function else None
        self.gold_function = load_reward_function(cfg.gold_function) if cfg.gold_function else None
        self.scorer = load_reward_scorer(cfg.model, reduce=cfg.ensemble) if cfg.model else None
        for member in getattr(self.scorer, "scorers", [self.scorer] if self.scorer is not None else []):
            member.model.to(device)

    def texts(self, rollout) -> tuple[list[str], list[str]]:
        """Prompts and responses as text (special tokens dropped)."""
        decode = lambda ids: self.tokenizer.batch_decode(ids, skip_special_tokens=True)  # noqa: E731
        return decode(rollout.prompt_ids), decode(rollout.response_ids)

    def __call__(self, rollout) -> Tensor:
        """(B,) scores of a `Rollout`."""
        if self.scorer is not None:
            return self.scorer(rollout.input_ids, rollout.attention_mask, rollout.sequence_response_mask)
        values = self.function(*self.texts(rollout))
        return torch.tensor([float(v) for v in values], device=rollout.response_ids.device)

    def gold(self, rollout) -> Tensor | None:
        """(B,) gold-judge scores, or None without a gold function."""
        if self.gold_function is None:
            return None
        return torch.tensor([float(v) for v in self.gold_function(*self.texts(rollout))], dtype=torch.float32)
