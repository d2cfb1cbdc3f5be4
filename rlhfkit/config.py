"""Typed, nested run configs: YAML files plus `key.sub=value` overrides, validated once, frozen afterwards.

Every stage has one config class (`SFTConfig`, `RMConfig`, ...) built from the shared `TrainConfig` and a
stage-specific `algo` section. `load_config(cls, path, overrides)` reads the YAML, applies the overrides, checks
every key and type, then runs each section's `check()`; any problem raises `ConfigError` naming the full key
(`optim.lr`, `data.train`) before a model is loaded. Each field is documented once, here, where it is declared.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from rlhfkit.errors import ConfigError


# 1. Sections shared by every stage ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False  # train LoRA adapters (peft) instead of the full model
    r: int = 16  # adapter rank
    alpha: int = 32  # scaling numerator: the update is scaled by alpha / r
    dropout: float = 0.05  # dropout on the adapter input
    target_modules: str | list[str] = "all-linear"  # peft target modules; "all-linear" = every linear but the head
    merge_on_save: bool = True  # save merged full weights (loadable without peft); False saves the adapter only

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.r < 1:
            errors.append(("r", f"must be >= 1, got {self.r}"))
        if self.alpha < 1:
            errors.append(("alpha", f"must be >= 1, got {self.alpha}"))
        if not 0.0 <= self.dropout < 1.0:
            errors.append(("dropout", f"must be in [0, 1), got {self.dropout}"))
        return errors


@dataclass(frozen=True)
class ModelConfig:
    # A local directory, a hub name (e.g. "HuggingFaceTB/SmolLM2-135M-Instruct"), a directory or hub repo holding
    # `gguf_file`, or "tiny" for a tiny random model and tokenizer built offline (tests and *_tiny.yaml configs).
    name_or_path: str = ""
    gguf_file: str | None = None  # a .gguf file inside name_or_path (or a path); converted once to safetensors
    revision: str | None = None  # hub revision (branch, tag or commit)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"  # weights dtype on load
    gradient_checkpointing: bool = False  # trade compute for activation memory
    trust_remote_code: bool = False  # run model code from the hub; off unless you trust the repo
    # Keep only the first N transformer layers (None = all): a smaller, faster model from the bottom of a larger
    # one, e.g. a reward or value model initialised from the SFT model at a fraction of its cost.
    num_layers: int | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self) -> list[tuple[str, str]]:
        if not self.name_or_path:
            return [("name_or_path", "is required (a local directory, a hub name, or 'tiny')")]
        if self.num_layers is not None and self.num_layers < 1:
            return [("num_layers", f"must be >= 1 (or null for all layers), got {self.num_layers}")]
        return []


@dataclass(frozen=True)
class DataConfig:
    train: str = ""  # a local .jsonl/.json/.csv/.parquet file or a hub dataset name
    eval: str | None = None  # same forms as `train`; None = hold out `eval_fraction` of train (or no eval)
    train_split: str = "train"  # split used when `train` is a hub dataset
    eval_split: str = "test"  # split used when `eval` is a hub dataset
    eval_fraction: float = 0.0  # with no `eval`: this fraction of train is held out (seeded) for evaluation
    max_length: int = 1024  # tokens in prompt + response; longer responses are cut (counted and reported)
    max_prompt_length: int = 512  # tokens in the prompt; see `truncation`
    truncation: Literal["truncate", "error"] = "truncate"  # over-long prompt: keep its last tokens, or fail
    packing: bool = False  # SFT only: concatenate examples into full `max_length` rows (no padding waste)
    max_samples: int | None = None  # use only the first N records of each split (quick experiments)

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.train:
            errors.append(("train", "is required (a local file or a hub dataset name)"))
        if not 0.0 <= self.eval_fraction < 1.0:
            errors.append(("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}"))
        if self.max_length < 2:
            errors.append(("max_length", f"must be >= 2, got {self.max_length}"))
        if not 1 <= self.max_prompt_length < self.max_length:
            errors.append(("max_prompt_length", f"must be in [1, max_length={self.max_length}), got {self.max_prompt_length}"))
        if self.max_samples is not None and self.max_samples < 1:
            errors.append(("max_samples", f"must be >= 1, got {self.max_samples}"))
        return errors


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5  # peak learning rate (AdamW)
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    scheduler: Literal["constant", "linear", "cosine"] = "linear"  # decay after warmup
    warmup_steps: int = 0  # linear warmup steps; overrides warmup_ratio when > 0
    warmup_ratio: float = 0.0  # warmup as a fraction of the total optimizer steps
    max_grad_norm: float | None = 1.0  # clip the global gradient norm; None = no clipping
    per_device_batch_size: int = 8  # examples (pairs, for preference data) per micro-batch per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.lr < 0:
            errors.append(("lr", f"must be >= 0, got {self.lr}"))
        if self.weight_decay < 0:
            errors.append(("weight_decay", f"must be >= 0, got {self.weight_decay}"))
        if self.adam_eps <= 0:
            errors.append(("adam_eps", f"must be > 0, got {self.adam_eps}"))
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            errors.append(("adam_betas", f"must be two numbers in [0, 1), got {self.adam_betas}"))
        if not 0.0 <= self.warmup_ratio < 1.0:
            errors.append(("warmup_ratio", f"must be in [0, 1), got {self.warmup_ratio}"))
        if self.warmup_steps < 0:
            errors.append(("warmup_steps", f"must be >= 0, got {self.warmup_steps}"))
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            errors.append(("max_grad_norm", f"must be > 0 or null, got {self.max_grad_norm}"))
        if self.per_device_batch_size < 1:
            errors.append(("per_device_batch_size", f"must be >= 1, got {self.per_device_batch_size}"))
        if self.grad_accum_steps < 1:
            errors.append(("grad_accum_steps", f"must be >= 1, got {self.grad_accum_steps}"))
        return errors


@dataclass(frozen=True)
class LoggingConfig:
    logging_steps: int = 10  # write metrics every N optimizer steps
    eval_steps: int = 0  # evaluate every N steps (0 = only at the end of training)
    save_steps: int = 0  # write a resumable checkpoint every N steps (0 = none before the final save)
    save_total_limit: int = 2  # keep the N newest checkpoints
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)  # extra metric sinks
    progress_bar: bool = True  # tqdm bar with the live loss
    run_name: str | None = None  # name shown in TensorBoard/W&B (default: output_dir's name)

    def check(self) -> list[tuple[str, str]]:
        errors = []
        for name in ("logging_steps", "save_total_limit"):
            if getattr(self, name) < 1:
                errors.append((name, f"must be >= 1, got {getattr(self, name)}"))
        for name in ("eval_steps", "save_steps"):
            if getattr(self, name) < 0:
                errors.append((name, f"must be >= 0, got {getattr(self, name)}"))
        return errors


def _check_seed(seed: int) -> list[tuple[str, str]]:
    # numpy (seeded by accelerate's set_seed) takes seeds in [0, 2**32); torch would take a negative one silently.
    if not 0 <= seed < 2**32:
        return [("seed", f"must be in [0, 2**32), got {seed}")]
    return []


@dataclass(frozen=True)
class TrainConfig:
    """Keys every stage shares."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output_dir: str = ""  # where the model, config.yaml, metrics.jsonl and checkpoints go
    seed: int = 42  # seeds data order, initialisation of new heads, dropout and sampling
    max_steps: int = -1  # optimizer steps; -1 = run `num_epochs` over the training set
    num_epochs: float = 1.0  # passes over the training set when max_steps is -1
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # autocast through accelerate
    resume: bool = False  # continue from the newest checkpoint in output_dir
    overwrite: bool = False  # allow writing into an output_dir that holds another run
    # A non-finite loss or gradient (online RL: also reward or log-prob) skips the update and is counted
    # (`faults/skipped_total`); this many stop the run with exit status 2, its checkpoints intact.
    max_bad_steps: int = 3

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.output_dir:
            errors.append(("output_dir", "is required"))
        errors += _check_seed(self.seed)
        if self.max_steps == 0 or self.max_steps < -1:
            errors.append(("max_steps", f"must be >= 1 or -1 (use num_epochs), got {self.max_steps}"))
        if self.max_steps == -1 and self.num_epochs <= 0:
            errors.append(("num_epochs", f"must be > 0, got {self.num_epochs}"))
        if self.max_bad_steps < 1:
            errors.append(("max_bad_steps", f"must be >= 1, got {self.max_bad_steps}"))
        if self.resume and self.overwrite:
            errors.append(("resume", "and overwrite=true are contradictory: resume continues the run overwrite would replace"))
        return errors


# 2. Stage configs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SFTOptions:
    completion_only: bool = True  # loss on completion (assistant) tokens only; False = on every token


@dataclass(frozen=True)
class SFTConfig(TrainConfig):
    algo: SFTOptions = field(default_factory=SFTOptions)


@dataclass(frozen=True)
class RMOptions:
    # Bradley-Terry loss -log σ(r_c - r_r - m): m is the record's "margin" field (Llama 2, arXiv 2307.09288 eq. 2)
    # when the data has one, times `margin_scale`; 0 turns margins off.
    margin_scale: float = 1.0
    # Reward centering (Eisenstein et al. 2023, arXiv 2312.09244): + coef · (r_c + r_r)², keeping scores near 0.
    center_coef: float = 0.0
    # Where a sequence's score is read: "last" = at its last real token (the EOS; the usual reward model), "mean" =
    # the mean of the head over the response tokens (a linear head on mean-pooled states). Saved with the model
    # (config.json `rlhfkit_pooling`), so every later scorer reads it the same way. Mean pooling learns lexical
    # properties (sentiment, keywords) from far fewer pairs when the EOS state of a small model carries little.
    pooling: Literal["last", "mean"] = "last"
    # Train the score head only, on the frozen model (a linear probe): each step costs a forward, and a few hundred
    # pairs cannot overfit it the way they overfit LoRA or full fine-tuning. model.lora is then ignored.
    head_only: bool = False

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.margin_scale < 0:
            errors.append(("margin_scale", f"must be >= 0, got {self.margin_scale}"))
        if self.center_coef < 0:
            errors.append(("center_coef", f"must be >= 0, got {self.center_coef}"))
        return errors


@dataclass(frozen=True)
class RMConfig(TrainConfig):
    algo: RMOptions = field(default_factory=RMOptions)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64  # response length cap; a response cut here has no EOS (see reward.missing_eos_penalty)
    temperature: float = 1.0  # applied identically to sampling and to old, new and reference log-probs
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    num_samples: int = 1  # responses per prompt: the group size k of RLOO/GRPO (>= 2 there)

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.max_new_tokens < 1:
            errors.append(("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"))
        if self.temperature <= 0:
            errors.append(("temperature", f"must be > 0, got {self.temperature}"))
        if self.top_k < 0:
            errors.append(("top_k", f"must be >= 0 (0 = off), got {self.top_k}"))
        if not 0 < self.top_p <= 1:
            errors.append(("top_p", f"must be in (0, 1], got {self.top_p}"))
        if self.num_samples < 1:
            errors.append(("num_samples", f"must be >= 1, got {self.num_samples}"))
        return errors


@dataclass(frozen=True)
class RewardConfig:
    model: list[str] = field(default_factory=list)  # reward-model directories; several = an ensemble
    ensemble: Literal["mean", "min"] = "mean"  # how an ensemble combines its members ("min" is conservative)
    function: str | None = None  # "module:function": fn(prompts, completions, **record fields) -> one float per completion
    gold_function: str | None = None  # optional "module:function" gold judge: logged as objective/gold, never trained on
    missing_eos_penalty: float | None = None  # >= 0, SUBTRACTED from the score of a response cut at max_new_tokens (TRL's convention, e.g. 1.0)
    normalize: Literal["none", "batch", "running", "minmax"] = "none"  # z-score per batch / running, or min-max
    clip: float | None = None  # clip scores to [-clip, clip] after normalisation

    def check(self) -> list[tuple[str, str]]:
        if bool(self.model) == bool(self.function):
            return [("model", "give exactly one reward source: reward.model (reward-model directories) or reward.function (module:function)")]
        for name in ("function", "gold_function"):
            if getattr(self, name) and ":" not in getattr(self, name):
                return [(name, f"must be 'module:function', got {getattr(self, name)!r}")]
        if self.clip is not None and self.clip <= 0:
            return [("clip", f"must be > 0 or null, got {self.clip}")]
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            return [("missing_eos_penalty", f"must be >= 0: it is subtracted from the score of a response without EOS "
                                            f"(TRL's convention), got {self.missing_eos_penalty}; write "
                                            f"{-self.missing_eos_penalty} to penalise truncation")]
        return []


@dataclass(frozen=True)
class KLConfig:
    controller: Literal["fixed", "adaptive"] = "fixed"  # adaptive: Ziegler et al. 2019 proportional controller
    coef: float = 0.05  # β (the initial β when adaptive)
    target: float = 6.0  # adaptive: sequence KL (nats) to steer to
    horizon: int = 10000  # adaptive: samples over which β moves by at most 20%

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if self.coef < 0:
            errors.append(("coef", f"must be >= 0, got {self.coef}"))
        if self.controller == "adaptive" and (self.coef <= 0 or self.target <= 0 or self.horizon <= 0):
            errors.append(("controller", "adaptive needs coef, target and horizon > 0"))
        return errors


@dataclass(frozen=True)
class OnlineOptions:
    algorithm: str = "ppo"  # a name in rlhfkit.algorithms: ppo, rloo, grpo, dr_grpo, dapo, reinforce_pp, ...
    rollout_batch_size: int = 16  # prompts sampled per step (per process); samples = prompts × num_samples
    ppo_epochs: int = 1  # passes over each rollout
    num_minibatches: int = 1  # optimizer steps per pass (each split into micro-batches of per_device_batch_size)
    clip_eps: float = 0.2  # ratio clip ε (lower side)
    clip_eps_high: float | None = None  # upper side (DAPO's clip-higher, 0.28); None = clip_eps
    dual_clip: float | None = None  # dual-clip constant c > 1 for negative advantages; None = off
    vf_coef: float = 0.1  # value-loss weight (PPO)
    clip_range_value: float | None = 0.2  # value clip (PPO); None = off
    entropy_coef: float = 0.0  # entropy bonus weight c: the loss subtracts c · H(π(·|s_t)), the full distribution's entropy
    disable_dropout: bool = True  # dropout off in policy and critic for the run (as TRL); false keeps it in the update forwards
    gamma: float = 1.0  # discount
    lam: float = 0.95  # GAE λ
    whiten_advantages: bool | None = None  # whiten advantages over the rollout; None = only for PPO (GAE)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None  # None = algorithm default
    target_kl: float | None = None  # stop a rollout's remaining epochs once approx-KL exceeds this
    dynamic_filtering: bool = False  # DAPO: drop groups whose samples all scored the same (no signal)
    mask_truncated: bool = False  # DAPO: responses without EOS take no loss
    value_model: str | None = None  # critic initialisation; None = the first reward model, else the policy
    # With `value_model` a causal LM (no trained score head): start the critic's value head at random instead of
    # refusing the directory. Off by default, so a causal LM given where a reward model was meant fails loudly.
    allow_new_value_head: bool = False
    sample_log_steps: int = 10  # write sample generations to samples.jsonl every N steps
    table_steps: int = 10  # print the Step | Reward | KL | ClipFrac | ValueLoss | PolicyLoss | LR table every N steps

    def check(self) -> list[tuple[str, str]]:
        errors = []
        for name in ("rollout_batch_size", "ppo_epochs", "num_minibatches", "sample_log_steps", "table_steps"):
            if getattr(self, name) < 1:
                errors.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if not 0 < self.clip_eps < 1:
            errors.append(("clip_eps", f"must be in (0, 1), got {self.clip_eps}"))
        if self.dual_clip is not None and self.dual_clip <= 1:
            errors.append(("dual_clip", f"must be > 1 or null, got {self.dual_clip}"))
        if self.allow_new_value_head and not self.value_model:
            errors.append(("allow_new_value_head", "applies only with algo.value_model (without it the critic starts from the "
                                                   "first reward model's trained head, or from the policy with a new head)"))
        for name in ("clip_eps_high", "clip_range_value", "target_kl"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                errors.append((name, f"must be > 0 or null, got {getattr(self, name)}"))
        for name in ("vf_coef", "entropy_coef"):
            if getattr(self, name) < 0:
                errors.append((name, f"must be >= 0, got {getattr(self, name)}"))
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                errors.append((name, f"must be in [0, 1], got {getattr(self, name)}"))
        return errors


@dataclass(frozen=True)
class OnlineConfig(TrainConfig):
    """PPO, RLOO, GRPO (Dr.GRPO, DAPO) and REINFORCE++: one loop. `max_steps` counts rollouts."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    algo: OnlineOptions = field(default_factory=OnlineOptions)

    def check(self) -> list[tuple[str, str]]:
        from rlhfkit.algorithms import ALGORITHMS

        errors = super().check()
        if self.algo.algorithm not in ALGORITHMS:
            errors.append(("algo.algorithm", f"must be one of {sorted(ALGORITHMS)}, got {self.algo.algorithm!r}"))
        elif ALGORITHMS[self.algo.algorithm].advantage not in ("gae", "reinforce_pp") and self.generation.num_samples < 2:
            errors.append(("generation.num_samples", f"{self.algo.algorithm} compares samples of one prompt: needs >= 2, got {self.generation.num_samples}"))
        samples = self.algo.rollout_batch_size * self.generation.num_samples
        if samples % self.algo.num_minibatches:
            errors.append(("algo.num_minibatches", f"must divide the rollout's {samples} samples"))
        elif (samples // self.algo.num_minibatches) % self.optim.per_device_batch_size:
            errors.append(("optim.per_device_batch_size", f"must divide the minibatch of {samples // self.algo.num_minibatches} samples"))
        return errors


# 2b. Rejection-sampling fine-tuning -------------------------------------------------------------------------


@dataclass(frozen=True)
class RFTOptions:
    iterations: int = 1  # sample -> keep the best -> fine-tune rounds; each samples from the policy the last one trained
    prompts_per_iteration: int | None = None  # a seeded random subset of the train prompts per iteration; None = all
    min_score: float | None = None  # drop a prompt whose best sample scores below this (None = keep every prompt)
    sampling_batch_size: int = 16  # prompts per `generate` call (samples per call = this × generation.num_samples)

    def check(self) -> list[tuple[str, str]]:
        errors = []
        for name in ("iterations", "sampling_batch_size"):
            if getattr(self, name) < 1:
                errors.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if self.prompts_per_iteration is not None and self.prompts_per_iteration < 1:
            errors.append(("prompts_per_iteration", f"must be >= 1 or null (all prompts), got {self.prompts_per_iteration}"))
        return errors


@dataclass(frozen=True)
class RFTConfig(TrainConfig):
    """Best-of-n / rejection-sampling fine-tuning, iterated. `generation.num_samples` is n. `max_steps` and
    `num_epochs` size the SFT of *each iteration* (optimizer steps, or passes over the kept samples); with
    `logging.save_steps` > 0 a resumable checkpoint is written after every iteration but the last."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: RFTOptions = field(default_factory=RFTOptions)

    def check(self) -> list[tuple[str, str]]:
        errors = super().check()
        # Selection and min_score read the raw scores (plus reward.missing_eos_penalty): normalising would change
        # min_score's units and clipping would create ties, while neither can improve which sample is best.
        if self.reward.normalize != "none":
            errors.append(("reward.normalize", f"must be 'none' for rft (the best sample is chosen on raw scores), got {self.reward.normalize!r}"))
        if self.reward.clip is not None:
            errors.append(("reward.clip", "must be null for rft (clipping only creates ties among the best samples)"))
        return errors


# Evaluation (`rlhfkit eval`) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalDataConfig:
    eval: str = ""  # held-out prompts ({prompt} or {messages} records): a local file or a hub dataset
    eval_split: str = "test"  # split used when `eval` is a hub dataset
    max_prompt_length: int = 512  # tokens in a prompt; see `truncation`
    max_length: int = 1024  # tokens in prompt + response of a `preference_data` pair (longer responses are cut)
    truncation: Literal["truncate", "error"] = "truncate"  # over-long prompt: keep its last tokens, or fail

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.eval:
            errors.append(("eval", "is required (held-out prompts: a local file or a hub dataset name)"))
        if not 1 <= self.max_prompt_length < self.max_length:
            errors.append(("max_prompt_length", f"must be in [1, max_length={self.max_length}), got {self.max_prompt_length}"))
        return errors


@dataclass(frozen=True)
class EvalRewardConfig:
    # Reward-model directories: each is a judge ("reward_model" when alone, else "reward_model/<directory name>"),
    # and several are also judged as one `ensemble` ("reward_model/ensemble_<mean|min>"). They must share the
    # policy's tokenizer (they read the sampled token ids), as in online RL.
    model: list[str] = field(default_factory=list)
    ensemble: Literal["mean", "min"] = "mean"  # how the ensemble judge combines its members
    function: str | None = None  # a Python reward "module:function" (prompts, completions) -> floats; judge named after it

    def check(self) -> list[tuple[str, str]]:
        if self.function is not None and ":" not in self.function:
            return [("function", f"must be 'module:function', got {self.function!r}")]
        return []


@dataclass(frozen=True)
class EvalConfig:
    """`rlhfkit eval`: sample the policy and the reference on held-out prompts (same seed), score both with every
    judge, and write `output_dir/eval.json`. Scores are raw (no normalisation, clipping or EOS penalty)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the policy being evaluated
    # The reference policy (usually the policy's starting point): a model directory, hub name or "tiny". KL, win rates
    # and the reference's own figures need it; null evaluates the policy alone. It must share the policy's tokenizer.
    reference: str | None = None
    reference_gguf_file: str | None = None  # a .gguf file inside (or beside) `reference`, as model.gguf_file
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    preference_data: str | None = None  # pairwise preference records (a file or hub dataset): each reward model's accuracy
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: EvalRewardConfig = field(default_factory=EvalRewardConfig)
    judges: list[str] = field(default_factory=list)  # more Python judges, "name=module:function" (e.g. a gold judge)
    run_dir: str | None = None  # a training run whose metrics.jsonl the reward-hacking alarms also read
    max_prompts: int | None = None  # evaluate only the first N prompts
    batch_size: int = 16  # prompts per generation call (each gives generation.num_samples responses)
    num_examples: int = 16  # side-by-side sample generations kept in eval.json
    output_dir: str = ""  # where eval.json and eval_config.yaml go (may be the training run's directory)
    seed: int = 42  # sampling seed: the policy and the reference draw with the same seed per batch
    overwrite: bool = False  # replace an existing eval.json in output_dir

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.output_dir:
            errors.append(("output_dir", "is required"))
        if self.reference is not None and not self.reference.strip():
            errors.append(("reference", "must be a model path or hub name, or null (evaluate the policy alone)"))
        if self.reference_gguf_file and self.reference is None:
            errors.append(("reference_gguf_file", "needs `reference`"))
        if self.preference_data and not self.reward.model:
            errors.append(("preference_data", "measures reward-model accuracy: it needs reward.model"))
        names = []
        for i, spec in enumerate(self.judges):
            name, sep, ref = spec.partition("=")
            if not sep or not name.strip() or ":" not in ref:
                errors.append((f"judges[{i}]", f"must be 'name=module:function', got {spec!r}"))
            names.append(name.strip())
        if self.reward.function:
            names.append(self.reward.function.rpartition(":")[2])
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            errors.append(("judges", f"judge names must be unique, got {', '.join(duplicates)} twice"))
        for name in ("batch_size", "num_examples"):
            if getattr(self, name) < 1:
                errors.append((name, f"must be >= 1, got {getattr(self, name)}"))
        if self.max_prompts is not None and self.max_prompts < 1:
            errors.append(("max_prompts", f"must be >= 1 or null, got {self.max_prompts}"))
        return errors + _check_seed(self.seed)


# 3. Loading ---------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, getattr(tp, "__name__", str(tp)))


class _NotFinite(ConfigError):
    """A NaN or infinite number: reported as such even inside a union (`float | None`), not as a type mismatch."""


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming `key` and the expected type.

    Float fields take finite numbers only: YAML's `.nan` and `.inf` (or `1e999`) would otherwise train on NaN
    (`optim.lr`, `optim.max_grad_norm`) or never stop (`num_epochs`), and no range check can catch NaN.
    """
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except _NotFinite:
                raise
            except ConfigError:
                continue
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (item_tp,) = typing.get_args(tp)
            return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
            number = float(value)  # YAML 1.1 reads `1e-5` (no dot) as a string; users mean the number
        if number is not None:
            if not math.isfinite(number):
                raise _NotFinite(f"config key '{key}': expected a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    for name in names:  # absent sections are built too, so their checks run (e.g. a missing model.name_or_path)
        if name not in kwargs and dataclasses.is_dataclass(hints[name]):
            kwargs[name] = _build(hints[name], {}, f"{prefix}{name}.")
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    for name, message in check() if check else []:
        raise ConfigError(f"config key '{prefix}{name}' {message}")
    return obj


def parse_overrides(overrides: list[str]) -> dict:
    """`["optim.lr=1e-4", "data.train=x.jsonl"]` -> nested dict; values are parsed as YAML scalars/lists."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}': expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # not valid YAML: take the text as a string
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{part}' was already given a value")
            node = child
        node[parts[-1]] = value
    return tree


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


class _DuplicateKeyError(yaml.MarkedYAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (SafeLoader silently keeps the last one)."""

    def construct_document(self, node):
        # 1. Walk the composed tree (each mapping once: aliases share nodes) with each mapping's dotted path.
        stack, seen_nodes = [(node, "")], set()
        while stack:
            current, path = stack.pop()
            if id(current) in seen_nodes:
                continue
            seen_nodes.add(id(current))
            if isinstance(current, yaml.SequenceNode):
                stack.extend((item, f"{path.rstrip('.')}[{i}].") for i, item in enumerate(current.value))
            if not isinstance(current, yaml.MappingNode):
                continue
            # 2. Compare the keys written in this mapping; `<<` merge keys may be overridden, as YAML intends.
            first_line: dict = {}
            for key_node, value_node in current.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in first_line:
                    raise _DuplicateKeyError(
                        problem=f"duplicate key '{path}{key}' (first given on line {first_line[key]}); give each key once",
                        problem_mark=key_node.start_mark)
                first_line[key] = key_node.start_mark.line + 1
                stack.append((value_node, f"{path}{key}."))
        return super().construct_document(node)


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")  # a UTF-8 byte-order mark is dropped
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"config file '{path}' line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506  a SafeLoader subclass
    except _DuplicateKeyError as exc:
        raise ConfigError(f"config file '{path}' line {exc.problem_mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line (a ReaderError spans two)
        raise ConfigError(f"config file '{path}'{where}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}': expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


C = typing.TypeVar("C")


def load_config(cls: type[C], path: str | None = None, overrides: list[str] | None = None, defaults: dict | None = None) -> C:
    """Build a validated, frozen `cls` from `defaults`, a YAML file and `key.sub=value` overrides (later wins)."""
    data = _merge(defaults or {}, read_yaml(path) if path else {})
    data = _merge(data, parse_overrides(overrides or []))
    return _build(cls, data)


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


# 4. Offline preference stages ------------------------------------------------------------------------------


def _check_ref_model(ref_model: str | None) -> list[tuple[str, str]]:
    if ref_model is not None and not ref_model.strip():
        return [("ref_model", "must be a model path or hub name, or null (the policy's starting weights)")]
    return []


@dataclass(frozen=True)
class DPOOptions:
    # "sigmoid" = DPO (Rafailov et al. 2023, arXiv 2305.18290; cDPO with label_smoothing > 0), "ipo" = IPO (Azar et al.
    # 2023, arXiv 2310.12036) on length-averaged log-probs as TRL does, "hinge" = SLiC-HF's hinge on the DPO log-ratio,
    # "simpo" = SimPO (Meng et al. 2024, arXiv 2405.14734): length-normalised and reference-free (no reference model).
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    beta: float = 0.1  # β: KL strength (DPO, hinge), IPO's τ, SimPO's reward scale (the paper uses 2.0-2.5)
    label_smoothing: float = 0.0  # ε in [0, 0.5): assumed label-flip probability (cDPO; "sigmoid" and "simpo" only)
    simpo_gamma: float = 0.5  # SimPO's target margin γ in reward units (the paper's γ, TRL's simpo_gamma)
    # Compute the reference log-probs of the train and eval sets once before training, then drop a separate reference
    # copy: no reference forward per step and, for full fine-tuning, no second model in memory while training.
    precompute_ref_logps: bool = False
    # The reference model; null = the policy's starting weights (with LoRA: the base with adapters disabled, no copy).
    ref_model: str | None = None

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.beta > 0:
            errors.append(("beta", f"must be > 0, got {self.beta}"))
        if not 0.0 <= self.label_smoothing < 0.5:
            errors.append(("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}"))
        elif self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            errors.append(("label_smoothing", f"applies only to loss_type sigmoid (cDPO) or simpo, got loss_type={self.loss_type}"))
        if self.simpo_gamma < 0:
            errors.append(("simpo_gamma", f"must be >= 0, got {self.simpo_gamma}"))
        if self.loss_type == "simpo" and self.ref_model is not None:
            errors.append(("ref_model", "must be null with loss_type=simpo: SimPO uses no reference model"))
        if self.loss_type == "simpo" and self.precompute_ref_logps:
            errors.append(("precompute_ref_logps", "must be false with loss_type=simpo: SimPO uses no reference model"))
        return errors + _check_ref_model(self.ref_model)


@dataclass(frozen=True)
class DPOConfig(TrainConfig):
    algo: DPOOptions = field(default_factory=DPOOptions)


@dataclass(frozen=True)
class ORPOOptions:
    # ORPO (Hong et al. 2024, arXiv 2403.07691): chosen-response NLL + lam · odds-ratio loss; no reference model.
    lam: float = 0.1  # λ, the odds-ratio weight (TRL's ORPO `beta`)

    def check(self) -> list[tuple[str, str]]:
        if not self.lam >= 0:
            return [("lam", f"must be >= 0, got {self.lam}")]
        return []


@dataclass(frozen=True)
class ORPOConfig(TrainConfig):
    algo: ORPOOptions = field(default_factory=ORPOOptions)


@dataclass(frozen=True)
class KTOOptions:
    # KTO (Ethayarajh et al. 2024, arXiv 2402.01306) on unpaired completions labelled desirable or not.
    beta: float = 0.1  # β, the value function's sharpness
    desirable_weight: float = 1.0  # λ_D; the paper advises λ_D·n_D / (λ_U·n_U) in [1, 4/3]
    undesirable_weight: float = 1.0  # λ_U
    ref_model: str | None = None  # as DPO's algo.ref_model

    def check(self) -> list[tuple[str, str]]:
        errors = []
        if not self.beta > 0:
            errors.append(("beta", f"must be > 0, got {self.beta}"))
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) < 0:
                errors.append((name, f"must be >= 0, got {getattr(self, name)}"))
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            errors.append(("desirable_weight", "and undesirable_weight are both 0: nothing would be learned"))
        return errors + _check_ref_model(self.ref_model)


@dataclass(frozen=True)
class KTOConfig(TrainConfig):
    algo: KTOOptions = field(default_factory=KTOOptions)

    def check(self) -> list[tuple[str, str]]:
        errors = super().check()
        if self.optim.per_device_batch_size < 2:
            errors.append((
                "optim.per_device_batch_size",
                f"must be >= 2 for KTO, got {self.optim.per_device_batch_size}: "
                "KTO's reference point z0 is estimated from mismatched pairs within a batch",
            ))
        return errors
