"""Rewards for online RL: scalar scores of whole sequences from reward models and ensembles of them, or from Python
functions of the text.

A reward model scorer (`RewardFn`) takes token ids and their attention mask (B, T) and returns one float32 score per
sequence (B,). A Python reward function (`reward.function`, `reward.gold_function`, eval `judges`) follows
`RewardFunction`'s contract: `fn(prompts, completions, **kwargs)` with the dataset's own prompts and every other
field of the prompt records as keyword arguments, called once per rollout.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import Tensor

from rlhfkit.config import ModelConfig, QuantizationConfig
from rlhfkit.errors import UserError
from rlhfkit.models import load_reward_model, load_tokenizer, unwrap_model
from rlhfkit.ops import segment_sum
from rlhfkit.sharding import place_frozen


POOLING_ATTR = "rlhfkit_pooling"  # in a reward model's config: "last" (default) or "mean" (RMOptions.pooling)


class RewardFn(Protocol):
    def __call__(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor | None = None) -> Tensor:
        """(B, T), (B, T), optional (B, T) 1 on the response tokens -> (B,)."""
        ...


def pooling_of(model) -> str:
    """How `model`'s sequence score is read: "last" (its last real token) or "mean" (over the response tokens)."""
    return getattr(unwrap_model(model).config, POOLING_ATTR, None) or "last"


def token_scores(model, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None) -> Tensor:
    """The scalar head's output at every position of a sequence-classification model: (B, T), (B, T) -> (B, T).

    The model is called through its own forward (so peft, DDP and FSDP wrappers see an ordinary call) and the
    per-token scores (B, T, 1) are read from the `score` head with a forward hook; under a peft SEQ_CLS wrapper
    that head routes to the trained copy (modules_to_save), so LoRA + head training works. Position ids follow the
    mask (cumsum - 1), so left and right padding give the same values. A PPO critic reads its values here. A
    padding-free row (`types.PaddingFreeBatch`) comes with no mask and its own `position_ids`.
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
        mask = attention_mask.long() if attention_mask is not None else None
        if mask is not None:
            position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # clamp: left-pad positions get 0, and are never read
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    finally:
        handle.remove()
    scores = captured[-1][..., 0].float()  # (B, T, 1) -> (B, T)
    if scores.requires_grad:
        # The gradient must flow through the forward's own output too: an FSDP1 root unit finishes its backward
        # (resharding, gradient reduction) from a hook on its outputs, and a loss on the hooked scores alone never
        # reaches it ("expected to be in states [FORWARD_BACKWARD] but current state is TrainingState.IDLE").
        scores = scores + 0.0 * torch.nan_to_num(out.logits.float()).sum()
    return scores


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


def sequence_scores_padding_free(model, batch) -> Tensor:
    """`sequence_scores` of a `types.PaddingFreeBatch` (S sequences in one row, no padding): (S,) fp32, read at each
    sequence's last token, or (pooling "mean") averaged over its labelled (response) tokens."""
    scores = token_scores(model, batch.input_ids, None, batch.position_ids)[0]  # (N,)
    if pooling_of(model) == "mean":
        owner, n, response = batch.seq_ids, len(batch.seq_lens), (batch.labels[0] != -100).float()
        return segment_sum(scores * response, owner, n) / segment_sum(response, owner, n).clamp(min=1)
    return scores[batch.seq_lens.cumsum(0) - 1]


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
    quantization: QuantizationConfig | None = None,
) -> RewardModelScorer | EnsembleScorer:
    """Frozen reward model(s) saved by the reward stage: one path gives a scorer, several an ensemble; in 4 bits
    with `quantization.load_in_4bit` (`reward.quantization`)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    scorers = []
    for path in paths:
        cfg = ModelConfig(name_or_path=path, dtype=dtype, quantization=quantization or QuantizationConfig())
        tokenizer = load_tokenizer(cfg)
        scorers.append(RewardModelScorer(load_reward_model(cfg, tokenizer, trainable=False), tokenizer))
    return scorers[0] if len(scorers) == 1 else EnsembleScorer(scorers, reduce)


# Python reward functions and score post-processing --------------------------------------------------------------


def load_reward_function(ref: str, key: str = "reward.function") -> RewardFunction:
    """Import the function `ref` = "module:function", named in errors as `key` (its config key).

    Importing runs the module's code, so a config that names a function is code: load configs you trust. The
    working directory is importable while the module imports (as for `python -m`), then `sys.path` is restored, so
    the user's own modules never shadow later imports; import what the function needs at the module's top level.
    """
    import importlib
    import os
    import sys

    label = f"{key} '{ref}'"
    module_name, _, name = ref.partition(":")
    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{label}: cannot import module '{module_name}' ({_first_line(exc)})") from None
    except Exception as exc:  # the module's own code failed at import: the user's to fix
        raise UserError(f"{label}: cannot import module '{module_name}' ({type(exc).__name__}: {_first_line(exc)})") from None
    finally:
        sys.path[:] = saved
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{label}: module '{module_name}' has no function '{name}'")
    return RewardFunction(fn, label)


class RewardFunction:
    """A Python reward function under rlhfkit's calling contract (TRL's convention for reward functions).

    The function is called once per rollout batch, for all B rows at once:

        fn(prompts, completions, **kwargs) -> B numbers (a list, tuple, 1-D tensor or array), higher is better

    - prompts: each row's prompt as the dataset holds it (a string, or the prompt's message dicts); rows of the
      same prompt repeat it. Without dataset examples, the chat-rendered prompt text (special tokens dropped).
    - completions: each row's response text, special tokens dropped.
    - kwargs: every other field of the prompt records (e.g. `answer`, test cases) as a list over the rows (None for
      a row whose record lacks the field), and `completion_ids` (each row's response token ids, up to and including
      EOS). A keyword is passed only if the function names it or takes **kwargs, so `(prompts, completions)`
      functions keep working.

    Non-finite scores pass through (the trainers count the step as bad); anything else that is not one number
    per row, and any exception the function raises, is a one-line `UserError` that names the function (`label`).
    """

    def __init__(self, fn, label: str):
        import inspect

        self.fn = fn
        self.label = label
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # builtins without a signature: the two positional arguments only
            params = []
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        self.any_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        named = [p for p in params[2:] if p.kind in keyword]  # after (prompts, completions)
        self.keywords = {p.name for p in named}
        self.required = [p.name for p in named if p.default is inspect.Parameter.empty]

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]] | None = None,
                 columns: dict[str, list] | None = None) -> list[float]:
        """One float per completion; `columns` maps each record field to its values over the rows."""
        available = {**(columns or {}), **({"completion_ids": completion_ids} if completion_ids is not None else {})}
        for name in self.required:
            if name not in available:
                fields = ", ".join(sorted(columns or {})) or "none"
                raise UserError(f"{self.label} takes an argument '{name}', but the prompt records have no field "
                                f"'{name}' (fields: {fields})")
        kwargs = {k: v for k, v in available.items() if self.any_keyword or k in self.keywords}
        try:
            value = self.fn(prompts, completions, **kwargs)
        except Exception as exc:  # the user's code failed: name it and where, on one line
            raise UserError(f"{self.label} raised {type(exc).__name__}: {_first_line(exc)}{_where(exc)}") from None
        return _as_scores(value, len(completions), self.label)


def _as_scores(value, n: int, label: str) -> list[float]:
    """`value` as n python floats, or a UserError saying what it was instead."""
    import numbers

    expected = f"expected a list of {n} numbers (one per completion)"
    if hasattr(value, "shape") and hasattr(value, "tolist"):  # a tensor or an array
        if len(value.shape) != 1 or value.shape[0] != n:
            raise UserError(f"{label} returned a {type(value).__name__} of shape {tuple(value.shape)}, expected shape ({n},)")
        items = value.tolist()
    elif isinstance(value, (list, tuple)):
        items = list(value)
    elif value is None:
        raise UserError(f"{label} returned None, {expected}")
    else:
        raise UserError(f"{label} returned a {type(value).__name__} ({_short(value)}), {expected}")
    if len(items) != n:
        raise UserError(f"{label} returned a {type(value).__name__} of {len(items)} values, expected {n} (one per completion)")
    scores = []
    for i, v in enumerate(items):
        if hasattr(v, "shape") and hasattr(v, "item") and len(v.shape) == 0:  # a 0-d tensor or numpy scalar
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise UserError(f"{label} returned a non-number at row {i}: {_short(v)} ({type(v).__name__})")
        scores.append(float(v))  # NaN/inf stay: a non-finite step is the trainer's to count
    return scores


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:300]


def _where(exc: BaseException) -> str:
    """" (file.py:LINE)" of the innermost frame that raised, or ""."""
    import os
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if len(frames) > 1 else ""


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
    scores: Tensor, mode: str, running: RunningMoments | None = None, clip: float | None = None, eps: float = 1e-8,
    population: Tensor | None = None,
) -> Tensor:
    """Normalise then clip a batch of scores (B,).

    Modes: "none"; "batch" z-score over this batch; "running" z-score with moments of every score so far (updated
    with this batch first); "minmax" to [0, 1] over this batch. `clip` bounds the result to [-clip, clip].
    `population` (default: `scores`) is the batch whose statistics are used: under data parallelism, the scores of
    every process gathered, so each process normalises as one process holding the whole batch would.
    """
    x = scores.float()
    p = x if population is None else population.float()
    if mode == "batch":
        x = (x - p.mean()) / (p.std(unbiased=False) + eps)
    elif mode == "running":
        assert running is not None, "running normalisation needs a RunningMoments"
        running.update(p)
        x = (x - running.mean) / (running.var**0.5 + eps)
    elif mode == "minmax":
        x = (x - p.min()) / (p.max() - p.min() + eps)
    elif mode != "none":
        raise ValueError(f"unknown normalisation {mode!r}")
    return x.clamp(-clip, clip) if clip is not None else x


class RewardSource:
    """The reward of the sampling stages (online RL, rejection sampling): reward model(s) scoring a rollout's token
    ids, or a Python function (`RewardFunction`) of its text and its prompt records; plus an optional gold judge
    that is only logged.

    Python functions load first, so a bad `module:function` fails before any reward model loads. Reward models
    score `batch_size` rows per forward (None: the whole rollout at once).
    """

    def __init__(self, cfg, tokenizer, device, batch_size: int | None = None):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.function = load_reward_function(cfg.function) if cfg.function else None
        self.gold_function = load_reward_function(cfg.gold_function, "reward.gold_function") if cfg.gold_function else None
        self.scorer = load_reward_scorer(cfg.model, reduce=cfg.ensemble, quantization=cfg.quantization) if cfg.model else None
        for member in getattr(self.scorer, "scorers", [self.scorer] if self.scorer is not None else []):
            member.model = place_frozen(member.model, device)  # ZeRO-3: a sharded inference engine (rlhfkit.sharding)

    def __call__(self, rollout, examples: list[dict] | None = None) -> Tensor:
        """(B,) float32 scores of a `Rollout`, on its device; `examples[i]` is the prompt example (`data`'s prompt
        kind: "prompt", "columns") of row i, repeated for each sample of a prompt by the caller."""
        if self.scorer is None:
            return call_reward_function(self.function, self.tokenizer, rollout, examples)
        ids, mask, resp = rollout.input_ids, rollout.attention_mask, rollout.sequence_response_mask  # (B, P + R)
        step = self.batch_size or ids.shape[0]
        return torch.cat([self.scorer(ids[i : i + step], mask[i : i + step], resp[i : i + step])
                          for i in range(0, ids.shape[0], step)]).float()

    def gold(self, rollout, examples: list[dict] | None = None) -> Tensor | None:
        """(B,) float32 gold-judge scores (the same contract as the reward function), or None without one."""
        if self.gold_function is None:
            return None
        return call_reward_function(self.gold_function, self.tokenizer, rollout, examples)


def call_reward_function(fn: RewardFunction, tokenizer, rollout, examples: list[dict] | None = None) -> Tensor:
    """`fn` on all rows of `rollout` at once (the `RewardFunction` contract): (B,) float32 on the rollout's device.

    `examples[i]` is row i's prompt example; without examples, prompts are the decoded prompt text and no record
    field is passed.
    """
    n = rollout.response_ids.shape[0]
    if examples is not None and len(examples) != n:
        raise ValueError(f"{len(examples)} examples for a rollout of {n} rows: repeat each prompt's example per sample")
    completion_ids = [row[m.bool()].tolist() for row, m in zip(rollout.response_ids, rollout.response_mask)]
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if examples is None:
        prompts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True)
                   for row, m in zip(rollout.prompt_ids, rollout.prompt_mask)]
        columns = {}
    else:
        prompts = [e["prompt"] for e in examples]
        names = list(dict.fromkeys(k for e in examples for k in e["columns"]))  # first-seen order
        columns = {k: [e["columns"].get(k) for e in examples] for k in names}
    scores = fn(prompts, completions, completion_ids, columns)
    return torch.tensor(scores, dtype=torch.float32, device=rollout.response_ids.device)
