"""Rewards for the sampling stages (online RL, rejection sampling, eval judges): reward models, ensembles of them and
Python reward functions, combined with weights into one score per sequence, as TRL's `GRPOTrainer` combines its
`reward_funcs`.

A reward source gives each row of a rollout a score, `score(rollout, inputs) -> ((B,) scores, (B,) applies)` (the
`RewardSource` protocol), whatever it is:
- a `RewardFunction`: a Python function under TRL's contract (`rlhfkit.reward_functions`), which may not apply to a
  row (it returned None);
- a `RewardModelSource`: one reward model, reading the rollout's own token ids, or the text re-tokenised when its
  tokenizer is not the policy's (its forward is a `RewardModelScorer`, token ids in, one score per sequence out);
- an `EnsembleSource`: several reward models as one source (mean or min).
`Rewards` is every source of a run with its weight: calling it on a rollout gives `Scores` (the weighted total and each
source's own scores, for `rewards/<name>/mean|std`), and `gold` the held-out judge's. Evaluation's judges are reward
sources under a name (`evaluation.judges`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from rlhfkit.config import ModelConfig, QuantizationConfig
from rlhfkit.data.formats import is_conversational
from rlhfkit.errors import TemplateError, UserError
from rlhfkit.forwards import attention_inputs, unwrap_model
from rlhfkit.models import load_reward_model, load_tokenizer
from rlhfkit.ops import segment_sum
from rlhfkit.reward_functions import (
    RewardFunction, RewardInputs, RewardLogs, load_reward_function, unique_names, warn_unscored_once,
    weighted_sum,
)
from rlhfkit.sharding import place_frozen
from rlhfkit.templates import support


POOLING_ATTR = "rlhfkit_pooling"  # in a reward model's config: "last" (default) or "mean" (RMOptions.pooling)
logger = logging.getLogger("rlhfkit")


class RewardSource(Protocol):
    """Scores a rollout's rows from the step's inputs: ((B,) fp32 scores, (B,) bool where the source applies)."""

    name: str

    def score(self, rollout, inputs: RewardInputs) -> tuple[Tensor, Tensor]:
        ...


def pooling_of(model) -> str:
    """How `model`'s sequence score is read: "last" (its last real token) or "mean" (over the response tokens)."""
    return getattr(unwrap_model(model).config, POOLING_ATTR, None) or "last"


def token_scores(model, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None = None) -> Tensor:
    """The scalar head's output at every position of a sequence-classification model: (B, T), (B, T) -> (B, T).

    The model is called through its own forward (so peft, DDP and FSDP wrappers see an ordinary call) and the
    per-token scores (B, T, 1) are read from the `score` head with a forward hook; under a peft SEQ_CLS wrapper
    that head routes to the trained copy (modules_to_save), so LoRA + head training works. A padded batch runs with
    `models.attention_inputs(attention_mask)` (left and right padding give the same values). A PPO critic reads its
    values here. A padding-free row (`types.PaddingFreeBatch`) comes with no mask and its own `position_ids`.
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
        inputs = attention_inputs(attention_mask) if attention_mask is not None else {"position_ids": position_ids}
        out = model(input_ids=input_ids, **inputs, use_cache=False)
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
    """A reward model's forward: token ids of its own `tokenizer` in, one score per sequence out."""

    def __init__(self, model, tokenizer=None):
        self.model = model
        self.tokenizer = tokenizer

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor | None = None) -> Tensor:
        return sequence_scores(self.model, input_ids, attention_mask, response_mask)


def reduce_ensemble(scores: Tensor, reduce: str) -> Tensor:
    """(K, B) the scores of K ensemble members -> (B,): their mean, or (reduce "min") the most pessimistic one."""
    return scores.mean(0) if reduce == "mean" else scores.min(0).values


def load_reward_scorer(
    path: str,
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32",
    quantization: QuantizationConfig | None = None,
) -> RewardModelScorer:
    """A frozen reward model saved by the reward stage, with its tokenizer; in 4 bits with
    `quantization.load_in_4bit` (`reward.quantization`)."""
    cfg = ModelConfig(name_or_path=path, dtype=dtype, quantization=quantization or QuantizationConfig())
    tokenizer = load_tokenizer(cfg)
    return RewardModelScorer(load_reward_model(cfg, tokenizer, trainable=False), tokenizer)


# Score post-processing ----------------------------------------------------------------------------------------


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

    def copy(self) -> "RunningMoments":
        """A copy to update tentatively (a step's moments are kept only if the step is)."""
        other = RunningMoments()
        other.load_state_dict(self.state_dict())
        return other

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


# Reward sources and their weighted sum ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    """The rewards of a rollout's B rows (`Rewards.__call__`)."""

    total: Tensor  # (B,) fp32: Σ_k weight_k · score_k over the sources that apply to the row; 0 where none does
    per_source: dict[str, Tensor]  # source name -> (B,) fp32 its own scores, NaN where it returned None
    unscored: Tensor  # (B,) bool: the rows every source returned None for


def reward_inputs(tokenizer, rollout, examples: list[dict] | None = None, trainer_state=None,
                  logs: RewardLogs | None = None) -> RewardInputs:
    """What the reward sources see of `rollout` (B rows), under TRL's contract (`rlhfkit.reward_functions`).

    `examples[i]` is row i's prompt example (`data.build_datasets("prompt", ...)`: "prompt", "columns"), repeated for
    each sample of a prompt by the caller. Without examples, prompts are the decoded prompt text and no record field
    is passed. A row whose prompt is a message list gets its completion as `[{"role": "assistant", "content": text}]`.
    """
    n = rollout.response_ids.shape[0]
    if examples is not None and len(examples) != n:
        raise ValueError(f"{len(examples)} examples for a rollout of {n} rows: repeat each prompt's example per sample")
    completion_ids = [row[m.bool()].tolist() for row, m in zip(rollout.response_ids, rollout.response_mask)]
    if examples is None:
        prompts = [tokenizer.decode(row[m.bool()], skip_special_tokens=True)
                   for row, m in zip(rollout.prompt_ids, rollout.prompt_mask)]
        columns = {}
    else:
        prompts = list(rollout.prompts) if rollout.prompts is not None else [e["prompt"] for e in examples]
        # First-seen order; TRL leaves a record's own completion and completion_ids out (the sampled ones are passed).
        names = list(dict.fromkeys(k for e in examples for k in e["columns"] if k not in ("completion", "completion_ids")))
        columns = {k: [e["columns"].get(k) for e in examples] for k in names}
    if rollout.completions is not None:  # decoded once, by the rollout component
        completions = list(rollout.completions)
    else:
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if is_conversational(p) else t for p, t in zip(prompts, texts)]
    environments = list(rollout.environments) if rollout.environments is not None else None
    return RewardInputs(prompts, completions, completion_ids, columns, trainer_state, logs, environments)


class RewardModelSource:
    """A reward model as a reward source, named `name` (its directory's name).

    When its tokenizer is the policy's (the same vocabulary and chat template), it scores the rollout's own token
    ids, exactly as sampled. Otherwise, as TRL does, it scores the text re-tokenised with its own tokenizer: the prompt followed by
    the completion on standard data, its own chat template over the prompt's messages and the assistant's reply on
    conversational data. Scores are read in chunks of `batch_size` rows (None: all at once).

    A tool episode (its completion a message list with tool calls and results) is a conversation, a text prompt its
    one user turn. The reward model reads it whole: with its own chat template when that renders the calls and the
    results, else (warned once) with the policy's, which `model.chat_template` set and the tool loop checked, and with
    the tool schemas the policy was shown (`Rollout.schemas`), so that it reads the calls against the tools' definitions
    as the policy wrote them. When neither template renders them, a UserError.
    """

    def __init__(self, scorer: RewardModelScorer, name: str, policy_tokenizer, batch_size: int | None = None,
                 given=None, reads_text: bool = False):
        """`given`: the model object the Python API was given (None: loaded from `name`'s directory or hub name);
        `reads_text`: always score the rows' text in its own tokens (texts without a rollout: `rlhfkit label`)."""
        self.scorer, self.name, self.batch_size, self.given = scorer, name, batch_size, given
        own = scorer.tokenizer
        self.own_vocabulary = own is not None and own.get_vocab() != policy_tokenizer.get_vocab()
        self.retokenize = own is not None and (reads_text or self.own_vocabulary or getattr(own, "chat_template", None)
                                               != getattr(policy_tokenizer, "chat_template", None))
        self.policy_template = getattr(policy_tokenizer, "chat_template", None)
        self.tool_template: str | None = None  # what tool episodes are rendered with, chosen at the first (`template_for`)

    @torch.no_grad()
    def score(self, rollout, inputs: RewardInputs) -> tuple[Tensor, Tensor]:
        """(B,) fp32 scores of the rollout's rows, on its device; a reward model applies to every row."""
        values = self.values(rollout, inputs)
        return values, torch.ones_like(values, dtype=torch.bool)

    def values(self, rollout, inputs: RewardInputs) -> Tensor:
        if self.retokenize:  # `rollout` None: texts alone, scored on the model's device
            device = rollout.input_ids.device if rollout is not None else next(self.scorer.model.parameters()).device
            ids, mask, resp = (t.to(device) for t in self.encode(inputs, rollout.schemas if rollout is not None else None))
        else:
            ids, mask, resp = rollout.input_ids, rollout.attention_mask, rollout.sequence_response_mask  # (B, P + R)
        step = self.batch_size or ids.shape[0]
        return torch.cat([self.scorer(ids[i : i + step], mask[i : i + step], resp[i : i + step])
                          for i in range(0, ids.shape[0], step)]).float()

    def encode(self, inputs: RewardInputs, schemas=None) -> tuple[Tensor, Tensor, Tensor]:
        """Each row's prompt + completion in the reward model's own tokens, right-padded: ids, attention mask and
        response mask (B, T'), the response being what follows the prompt's own tokens. `schemas` (B,): the tool
        schemas each row's prompt was rendered with (`Rollout.schemas`; None: none)."""
        tok = self.scorer.tokenizer
        texts, prompt_texts = [], []
        for i, (prompt, completion) in enumerate(zip(inputs.prompts, inputs.completions)):
            if is_conversational(prompt) or isinstance(completion, list):  # a list: an episode with tools
                turns = list(prompt) if is_conversational(prompt) else [{"role": "user", "content": prompt}]
                template = self.template_for(turns + list(completion))
                tools = schemas[i] if schemas is not None else None
                texts.append(tok.apply_chat_template(turns + list(completion), tools=tools, chat_template=template,
                                                     tokenize=False))
                prompt_texts.append(tok.apply_chat_template(turns, tools=tools, chat_template=template, tokenize=False,
                                                            add_generation_prompt=True))
            else:
                texts.append(prompt + completion)
                prompt_texts.append(prompt)
        enc = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        mask = enc["attention_mask"]
        response = mask.clone()
        for i, n in enumerate(len(ids) for ids in tok(prompt_texts, add_special_tokens=False)["input_ids"]):
            response[i, :n] = 0
        return enc["input_ids"], mask, response

    def template_for(self, conversation: list[dict]) -> str | None:
        """The chat template the reward model renders `conversation` with (None: its tokenizer's own); see the class
        docstring. The choice for tool episodes is made once, at the first one."""
        own = getattr(self.scorer.tokenizer, "chat_template", None)
        if not any(m.get("tool_calls") or m.get("role") == "tool" for m in conversation):
            if not own:
                raise TemplateError(f"reward model '{self.name}': its tokenizer has no chat template, which it needs "
                                    "to score conversational prompts in its own tokens")
            return None
        if self.tool_template is None:
            renders = lambda template: template and not support(self.scorer.tokenizer, template).missing(  # noqa: E731
                "calls", "results")
            if renders(own):
                self.tool_template = own
            elif renders(self.policy_template):
                logger.warning(f"reward model '{self.name}': its chat template does not render tool calls and results, "
                               "so tool episodes are rendered for it with the policy's chat template (model.chat_template)")
                self.tool_template = self.policy_template
            else:
                raise TemplateError(f"reward model '{self.name}': neither its chat template nor the policy's renders "
                                    "tool calls and results, so it cannot read the episodes whole; set "
                                    "model.chat_template: chatml_tools (or save the reward model with a template that "
                                    "renders them)")
        return self.tool_template


class EnsembleSource:
    """Several reward models as one source: the mean or the minimum of their scores (`reduce_ensemble`)."""

    def __init__(self, members: list[RewardModelSource], reduce: Literal["mean", "min"]):
        self.members, self.reduce, self.name = members, reduce, f"ensemble_{reduce}"

    def score(self, rollout, inputs: RewardInputs) -> tuple[Tensor, Tensor]:
        values = reduce_ensemble(torch.stack([m.values(rollout, inputs) for m in self.members]), self.reduce)
        return values, torch.ones_like(values, dtype=torch.bool)


def _has_own_tokenizer(path: str) -> bool:
    """Whether a reward model at `path` ships a tokenizer (a hub name is assumed to)."""
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return not os.path.isdir(path) or any(os.path.isfile(os.path.join(path, f)) for f in files)


def reads_ids_of(embeddings: int, tokenizer_size: int) -> bool:
    """Whether a model with `embeddings` input embeddings reads the ids of a tokenizer of `tokenizer_size` tokens:
    the same size, or a larger multiple of 64 (Qwen2.5's 151,936 embeddings read its 151,665-token tokenizer)."""
    return embeddings == tokenizer_size or (embeddings > tokenizer_size and embeddings % 64 == 0)


def load_reward_model_source(path: str, policy_tokenizer, policy_name: str, quantization: QuantizationConfig | None = None,
                             batch_size: int | None = None, dtype: str = "float32",
                             attn_implementation: str | None = None, tokenizer=None,
                             reads_text: bool = False) -> RewardModelSource:
    """The frozen reward model at `path` as a source scoring the policy's rollouts.

    A reward model saved without a tokenizer can only read the policy's token ids: it is refused (naming both) when
    its vocabulary is not the policy tokenizer's, since its scores of those ids would mean nothing. An embedding
    padded past the tokenizer to a multiple of 64 (as Qwen's is) counts as the same vocabulary.
    """
    from transformers import AutoConfig

    from rlhfkit.model_sources import from_pretrained, resolve_model_path

    cfg = ModelConfig(name_or_path=path, dtype=dtype, quantization=quantization or QuantizationConfig(),
                      attn_implementation=attn_implementation)
    where = resolve_model_path(cfg)
    if tokenizer is None:  # `tokenizer`: one given with the directory (the Python API's (directory, tokenizer) pair)
        tokenizer = load_tokenizer(cfg) if _has_own_tokenizer(where) else None
    if tokenizer is None:
        size, policy_size = from_pretrained(AutoConfig, where).vocab_size, len(policy_tokenizer)
        if not reads_ids_of(size, policy_size):
            raise UserError(f"reward model '{path}' has no tokenizer of its own and its vocabulary ({size} tokens) is not "
                            f"the policy tokenizer's ('{policy_name}', {policy_size} tokens): it cannot score the "
                            "policy's tokens; save the reward model with its tokenizer")
    model = load_reward_model(cfg, tokenizer if tokenizer is not None else policy_tokenizer, trainable=False)
    name = os.path.basename(os.path.normpath(path))
    return RewardModelSource(RewardModelScorer(model, tokenizer), name, policy_tokenizer, batch_size,
                             reads_text=reads_text)


def _reward_function(entry, key: str) -> RewardFunction:
    """A `module:function` reference, or a callable given from Python, as a `RewardFunction`."""
    if callable(entry):
        return entry if isinstance(entry, RewardFunction) else RewardFunction(entry, f"{key} {getattr(entry, '__name__', entry)!r}")
    return load_reward_function(entry, key)


def check_reward_pair(entry: tuple, key: str) -> None:
    """A tuple among `reward_funcs` is one (reward model, its tokenizer) pair: the model an object or a directory, the
    tokenizer a transformers tokenizer. Anything else (two functions in a tuple) is refused rather than half-read."""
    from transformers import PreTrainedTokenizerBase

    second = entry[1] if len(entry) > 1 else None
    if len(entry) != 2 or not isinstance(second, PreTrainedTokenizerBase):
        what = getattr(second, "__name__", type(second).__name__) if len(entry) > 1 else "nothing"
        raise UserError(f"{key}: a tuple is one (reward model, its tokenizer) pair, and {what} is not a tokenizer: pass "
                        "several reward sources as a list")
    if not isinstance(entry[0], (torch.nn.Module, str, os.PathLike)) or isinstance(entry[0], str) and ":" in entry[0]:
        raise UserError(f"{key}: a (reward model, its tokenizer) pair takes a sequence-classification model object or a "
                        f"reward-model directory first, got {entry[0]!r}")


def _padded(tokenizer, key: str):
    """`tokenizer`, or a copy of it that pads with its eos token when it has no pad token (as TRL does for a reward
    model's tokenizer; Llama's and Mistral's have none). The caller's object is left as it is."""
    if tokenizer is None or tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise UserError(f"{key}: the reward model's tokenizer has neither a pad token nor an eos token to pad with: "
                        "set tokenizer.pad_token")
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _given_source(entry, i: int, policy_tokenizer, policy_name: str, batch_size: int | None, dtype: str = "float32",
                  attn_implementation: str | None = None):
    """One of the Python API's `reward_funcs` as a source (see `Rewards`)."""
    key = f"reward_funcs[{i}]"
    if isinstance(entry, tuple):
        check_reward_pair(entry, key)
    model, tokenizer = entry if isinstance(entry, tuple) else (entry, None)
    tokenizer = _padded(tokenizer, key)
    if isinstance(model, torch.nn.Module):
        if tokenizer is None and not reads_ids_of(model.get_input_embeddings().num_embeddings, len(policy_tokenizer)):
            raise UserError(f"{key}: a reward model whose vocabulary ({model.get_input_embeddings().num_embeddings} "
                            f"tokens) is not the policy tokenizer's ('{policy_name}', {len(policy_tokenizer)} tokens): "
                            "pass it with its own tokenizer, as a (model, tokenizer) pair")
        model.eval()
        model.requires_grad_(False)
        where = getattr(model, "name_or_path", "") or ""
        name = os.path.basename(os.path.normpath(where)) if where else f"reward_model_{i}"
        return RewardModelSource(RewardModelScorer(model, tokenizer), name, policy_tokenizer, batch_size, given=model)
    if isinstance(model, (str, os.PathLike)) and ":" not in os.fspath(model):
        return load_reward_model_source(os.fspath(model), policy_tokenizer, policy_name, batch_size=batch_size, dtype=dtype,
                                        attn_implementation=attn_implementation, tokenizer=tokenizer)
    return _reward_function(model, key)


def as_list(value) -> list:
    """A config field that takes one value or a list of them, as a list (None: empty)."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


class Rewards:
    """Every reward source of a sampling stage with its weight, plus an optional gold judge that is only logged.

    The sources, in order (the order of `reward.weights`): the reward models of `reward.model`, each a source named
    after its directory (with `reward.ensemble` mean or min and several models, one source `ensemble_<mean|min>`),
    then the functions of `reward.function`, each named after the function (a repeated name gets its position
    appended). Weights default to 1 each. Functions load first, so a bad `module:function` fails before any reward
    model loads.
    """

    def __init__(self, cfg, tokenizer, device, batch_size: int | None = None, policy_name: str = "the policy",
                 dtype: str = "float32", given: Sequence = (), given_weights: Sequence[float] | None = None,
                 attn_implementation: str | None = None, environment_rewards: Sequence = ()):
        """`dtype`: the dtype the reward models load in (a run's `frozen_dtype`: its mixed precision). `given` (the
        Python API's `reward_funcs`): the sources in the caller's order, each a callable, a "module:function" name, a
        reward-model directory, a sequence-classification model object, or a (model object, its tokenizer) pair; they
        replace `cfg.model` and `cfg.function`, weighted by `given_weights` (None: 1 each). `attn_implementation`:
        the run's `model.attn_implementation`, which the reward models loaded here use too (None: transformers').
        `environment_rewards`: the reward functions of the run's environments that define `get_reward()`
        (`tools.Environments.reward_functions`), appended after the other sources with weight 1 each, as TRL does."""
        self.tokenizer = tokenizer
        self.gold_function = _reward_function(cfg.gold_function, "reward.gold_function") if cfg.gold_function else None
        if given:
            self.sources = [_given_source(entry, i, tokenizer, policy_name, batch_size, dtype, attn_implementation)
                            for i, entry in enumerate(given)]
            models = [s for s in self.sources if isinstance(s, RewardModelSource)]
        else:
            functions = [_reward_function(f, "reward.function") for f in as_list(cfg.function)]
            models = [load_reward_model_source(path, tokenizer, policy_name, cfg.quantization, batch_size, dtype,
                                               attn_implementation) for path in as_list(cfg.model)]
            self.sources = ([EnsembleSource(models, cfg.ensemble)] if len(models) > 1 and cfg.ensemble != "none"
                            else models) + functions
        for source in models:
            source.scorer.model = place_frozen(source.scorer.model, device)  # ZeRO-3: a sharded inference engine
        weights = list((given_weights if given else getattr(cfg, "weights", None)) or [1.0] * len(self.sources))
        if len(weights) != len(self.sources):
            raise UserError(f"config key 'reward.weights': {len(weights)} weights for {len(self.sources)} reward sources "
                            f"({', '.join(unique_names([s.name for s in self.sources]))}): give one per source")
        self.sources += [RewardFunction(fn, f"environment {fn.__name__}.get_reward", fn.__name__)
                         for fn in environment_rewards]
        if not self.sources:
            raise UserError("no reward source: give reward.model or reward.function, or an environment with a "
                            "get_reward() method")
        self.names = unique_names([s.name for s in self.sources])
        self.weights = torch.tensor(weights + [1.0] * len(environment_rewards), dtype=torch.float32)
        self._warned = [False]
        self.logs = RewardLogs()  # what the functions log through log_metric / log_extra, until the trainer takes it

    def __call__(self, rollout, examples: list[dict] | None = None, trainer_state=None) -> Scores:
        """The `Scores` of a `Rollout`'s rows, on its device; `examples[i]` is row i's prompt example (`data`'s prompt
        kind: "prompt", "columns"), repeated for each sample of a prompt by the caller."""
        inputs = reward_inputs(self.tokenizer, rollout, examples, trainer_state, self.logs)
        device = rollout.response_ids.device
        values, applies = zip(*[(v.to(device), a.to(device)) for v, a in (s.score(rollout, inputs) for s in self.sources)])
        total, unscored = weighted_sum(torch.stack(values, -1), torch.stack(applies, -1), self.weights)
        warn_unscored_once(unscored, inputs, self._warned)
        return Scores(total, dict(zip(self.names, values)), unscored)

    def first_model(self) -> RewardModelSource | None:
        """The first reward model among the sources (an ensemble's first member), or None."""
        for source in self.sources:
            if isinstance(source, EnsembleSource):
                return source.members[0]
            if isinstance(source, RewardModelSource):
                return source
        return None

    def gold(self, rollout, examples: list[dict] | None = None, trainer_state=None) -> Tensor | None:
        """(B,) float32 gold-judge scores (the same contract as the reward functions; NaN where it returned None),
        or None without one."""
        if self.gold_function is None:
            return None
        values, _ = self.gold_function.score(rollout, reward_inputs(self.tokenizer, rollout, examples, trainer_state, self.logs))
        return values
