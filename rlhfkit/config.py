"""Typed, nested run configs: YAML files plus `key.sub=value` overrides, validated once, frozen afterwards.

Every stage has one config class (`SFTConfig`, `RMConfig`, ...) built from the shared `TrainConfig` and a
stage-specific `algo` section. Each field is declared once, here, with its type, its range (`annotated_types`
constraints such as `Ge(1)`, read by the loader) and its documentation. `load_config(cls, path, overrides)` reads
the YAML, applies the overrides and builds each section, checking every key, type and range; the few rules that
join two fields are each section's `check()`. Any problem raises `ConfigError` naming the full key (`optim.lr`,
`data.train`) before a model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import yaml
from annotated_types import DocInfo, Ge, Gt, Interval, Le, Len, Lt, doc

from rlhfkit.errors import ConfigError

# Ranges used by many fields. A constraint on `X | None` applies to numbers; null stays allowed.
PosInt = Annotated[int, Ge(1)]
NonNegInt = Annotated[int, Ge(0)]
Positive = Annotated[float, Gt(0)]
NonNeg = Annotated[float, Ge(0)]
Fraction = Annotated[float, Interval(ge=0, lt=1)]
# numpy (seeded by accelerate's set_seed) takes seeds in [0, 2**32); torch would take a negative one silently.
Seed = Annotated[int, Interval(ge=0, lt=2**32)]


# 1. Sections shared by every stage ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False  # train LoRA adapters (peft) instead of the full model
    r: PosInt = 16  # adapter rank
    alpha: PosInt = 32  # scaling numerator: the update is scaled by alpha / r
    dropout: Fraction = 0.05  # dropout on the adapter input
    target_modules: str | list[str] = "all-linear"  # peft target modules; "all-linear" = every linear but the head
    merge_on_save: bool = True  # save merged full weights (loadable without peft); False saves the adapter only


@dataclass(frozen=True)
class QuantizationConfig:
    """QLoRA (Dettmers et al. 2023, arXiv 2305.14314): the frozen base held in 4 bits by bitsandbytes (the optional
    extra: `pip install 'rlhfkit[qlora]'`), each block dequantized to `bnb_4bit_compute_dtype` for its matmul; a
    trained model trains LoRA adapters on it. The names are those of transformers' `BitsAndBytesConfig`; the
    defaults are the paper's (NF4, double quantization), not transformers' (FP4, single). One process or DDP."""

    load_in_4bit: bool = False  # linear layers in 4 bits; embeddings, norms and the LM/score head stay in model.dtype
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"  # NormalFloat4 (the paper's data type) or plain FP4
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # matmul dtype; the paper's is bfloat16
    bnb_4bit_use_double_quant: bool = True  # quantize the per-block scales too (about 0.4 bit per weight saved)

    def check(self):
        if self.load_in_4bit and (problem := _bitsandbytes_problem()):
            yield "load_in_4bit", problem


def _bitsandbytes_problem() -> str | None:
    """Why 4-bit loading cannot run on this machine, or None."""
    try:
        import bitsandbytes
    except ImportError:
        return "needs bitsandbytes, which is not installed: pip install 'rlhfkit[qlora]'"
    import torch
    from packaging.version import Version

    if Version(bitsandbytes.__version__) < Version("0.46.1"):  # transformers' minimum, the first with a CPU backend
        return f"needs bitsandbytes >= 0.46.1, found {bitsandbytes.__version__}: pip install -U 'rlhfkit[qlora]'"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in bitsandbytes.supported_torch_devices:
        return (f"is not supported on this machine: bitsandbytes {bitsandbytes.__version__} runs 4-bit layers on "
                f"{', '.join(sorted(bitsandbytes.supported_torch_devices))}, not {device}")
    if any(os.environ.get(f"ACCELERATE_USE_{k}", "").lower() in ("1", "true") for k in ("FSDP", "DEEPSPEED")):
        return "works with one process or DDP, not FSDP or DeepSpeed (they shard 4-bit weights only when told how)"
    return None


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
    num_layers: PosInt | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)  # QLoRA: a 4-bit base

    def check(self):
        if not self.name_or_path:
            yield "name_or_path", "is required (a local directory, a hub name, or 'tiny')"


@dataclass(frozen=True)
class DataConfig:
    """Training stages read `train` (required there) and `eval`; `rlhfkit eval` reads its held-out prompts from
    `eval` (required there) with `eval_split`, `max_prompt_length`, `max_length` and `truncation`."""

    train: str = ""  # a local .jsonl/.json/.csv/.parquet file or a hub dataset name
    eval: str | None = None  # same forms as `train`; None = hold out `eval_fraction` of train (or no eval)
    train_split: str = "train"  # split used when `train` is a hub dataset
    eval_split: str = "test"  # split used when `eval` is a hub dataset
    eval_fraction: Fraction = 0.0  # with no `eval`: this fraction of train is held out (seeded) for evaluation
    # Tokens in prompt + response (eval: of a `preference_data` pair); longer responses are cut (counted, reported).
    max_length: Annotated[int, Ge(2)] = 1024
    max_prompt_length: int = 512  # tokens in the prompt; see `truncation`
    truncation: Literal["truncate", "error"] = "truncate"  # over-long prompt: keep its last tokens, or fail
    packing: bool = False  # SFT only: concatenate examples into full `max_length` rows (no padding waste)
    # SFT, RM, DPO/IPO/cDPO/SimPO and ORPO: each micro-batch's sequences end to end in one row, position ids restarting
    # at 0 per sequence and no attention mask, so no pad token is computed and no token attends across sequences (unlike
    # `packing`); loss, gradients, log-probs and rewards equal the padded batch's (the RM reads each sequence's score
    # at its last token). Attention runs per sequence (flash attention, or sdpa split by sequence); eager, sliding-window
    # or softcapped attention runs one masked (N, N) product over the row, which can cost more than the padding saved.
    padding_free: bool = False
    max_samples: PosInt | None = None  # use only the first N records of each split (quick experiments)

    def check(self):
        if not 1 <= self.max_prompt_length < self.max_length:
            yield "max_prompt_length", f"must be in [1, max_length={self.max_length}), got {self.max_prompt_length}"
        if self.padding_free and self.packing:
            yield "padding_free", "and data.packing are exclusive: packing lets attention cross example boundaries"


@dataclass(frozen=True)
class OptimConfig:
    lr: NonNeg = 1e-5  # peak learning rate (AdamW)
    weight_decay: NonNeg = 0.0
    adam_betas: Annotated[list[Fraction], Len(2, 2)] = field(default_factory=lambda: [0.9, 0.999])
    adam_eps: Positive = 1e-8
    scheduler: Literal["constant", "linear", "cosine"] = "linear"  # decay after warmup
    warmup_steps: NonNegInt = 0  # linear warmup steps; overrides warmup_ratio when > 0
    warmup_ratio: Fraction = 0.0  # warmup as a fraction of the total optimizer steps
    max_grad_norm: Positive | None = 1.0  # clip the global gradient norm; None = no clipping
    per_device_batch_size: PosInt = 8  # examples (pairs, for preference data) per micro-batch per process
    grad_accum_steps: PosInt = 1  # micro-batches per optimizer step


@dataclass(frozen=True)
class LoggingConfig:
    logging_steps: PosInt = 10  # write metrics every N optimizer steps
    eval_steps: NonNegInt = 0  # evaluate every N steps (0 = only at the end of training)
    save_steps: NonNegInt = 0  # write a resumable checkpoint every N steps (0 = none before the final save)
    save_total_limit: PosInt = 2  # keep the N newest checkpoints
    report_to: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)  # extra metric sinks
    progress_bar: bool = True  # tqdm bar with the live loss
    run_name: str | None = None  # name shown in TensorBoard/W&B (default: output_dir's name)


@dataclass(frozen=True)
class GenerationConfig:
    """How responses are sampled; `generation.generate` takes this section as its sampling parameters."""

    max_new_tokens: PosInt = 64  # response length cap; a response cut here has no EOS (see reward.missing_eos_penalty)
    temperature: Positive = 1.0  # applied identically to sampling and to old, new and reference log-probs
    top_k: Annotated[int, Ge(0), doc("0 = off")] = 0
    top_p: Annotated[float, Interval(gt=0, le=1), doc("1.0 = off")] = 1.0
    num_samples: PosInt = 1  # responses per prompt: the group size k of RLOO/GRPO (>= 2 there)
    # "rlhfkit": our decode loop over transformers' KV cache (samples the trained density only; the model's own
    # generation_config plays no part); "hf": transformers' `generate`, the reference it is tested against.
    engine: Literal["rlhfkit", "hf"] = "rlhfkit"
    # With engine "rlhfkit": a static KV cache and a compiled one-token step (on a GPU, CUDA graphs through
    # torch.compile mode "reduce-overhead"); each new batch shape compiles once, so it pays off over many steps.
    compile: bool = False

    def check(self):
        if self.compile and self.engine != "rlhfkit":
            yield "compile", "compiles rlhfkit's decode loop: needs generation.engine=rlhfkit"


@dataclass(frozen=True)
class RewardConfig:
    """The reward sources and their weights (TRL's `reward_funcs` and `reward_weights`): first the reward models of
    `model` (each a source named after its directory; with `ensemble` mean|min and several models, one source named
    `ensemble_<mean|min>`), then the functions of `function` (each named after the function). A row's reward is
    Σ weight · score over the sources that scored it (a function returns None for a row it does not apply to), and each
    source is logged as rewards/<name>/mean and rewards/<name>/std. `rlhfkit eval` makes each reward model a judge
    ("reward_model" when alone, else "reward_model/<directory name>", plus "reward_model/ensemble_<mean|min>" for
    several) and each function one named after the function; it reports raw scores (the last five fields are unused)."""

    model: list[str] = field(default_factory=list)  # reward-model directories; one with its own tokenizer scores re-tokenised text
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)  # the reward models in 4 bits (frozen)
    ensemble: Literal["mean", "min", "none"] = "mean"  # several reward models as one source (mean; min is conservative), or none: each its own
    function: str | list[str] | None = None  # "module:function" or a list of them, called under TRL's contract (rlhfkit.reward_functions)
    weights: list[float] | None = None  # one per source, in the order above; null = 1 each
    gold_function: str | None = None  # optional "module:function" gold judge: logged as objective/gold, never trained on
    missing_eos_penalty: Annotated[float, Ge(0), doc("subtracted, as in TRL, from the score of a response cut at "
                                                     "max_new_tokens: e.g. 1.0 penalises truncation")] | None = None
    normalize: Literal["none", "batch", "running", "minmax"] = "none"  # z-score per batch / running, or min-max
    clip: Positive | None = None  # clip scores to [-clip, clip] after normalisation

    @property
    def functions(self) -> list[str]:
        return [self.function] if isinstance(self.function, str) else list(self.function or [])

    @property
    def num_sources(self) -> int:
        return (1 if len(self.model) > 1 and self.ensemble != "none" else len(self.model)) + len(self.functions)

    def check(self):
        refs = [("gold_function", self.gold_function)] if self.gold_function else []
        refs += [("function" if isinstance(self.function, str) else f"function[{i}]", f) for i, f in enumerate(self.functions)]
        for name, ref in refs:
            if ":" not in ref:
                yield name, f"must be 'module:function', got {ref!r}"
        if self.weights is not None and len(self.weights) != self.num_sources:
            yield "weights", (f"must give one weight per reward source ({self.num_sources}: the reward models, or their "
                              f"ensemble, then the functions), got {len(self.weights)}")

    def check_has_source(self):
        if not self.model and not self.functions:
            yield "reward.model", ("give at least one reward source: reward.model (reward-model directories) and/or "
                                   "reward.function (module:function, or a list)")


@dataclass(frozen=True)
class TrainConfig:
    """Keys every training stage shares."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    output_dir: str = ""  # where the model, config.yaml, metrics.jsonl and checkpoints go
    seed: Seed = 42  # seeds data order, initialisation of new heads, dropout and sampling
    max_steps: int = -1  # optimizer steps; -1 = run `num_epochs` over the training set
    num_epochs: Positive = 1.0  # passes over the training set when max_steps is -1
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # autocast through accelerate
    resume: bool = False  # continue from the newest checkpoint in output_dir
    overwrite: bool = False  # allow writing into an output_dir that holds another run
    # A non-finite loss or gradient (online RL: also reward or log-prob) skips the update and is counted
    # (`faults/skipped_total`); this many stop the run with exit status 2, its checkpoints intact.
    max_bad_steps: PosInt = 3
    padding_free_supported: ClassVar[bool] = False  # the stage's trainer has a padding-free path (data.padding_free)
    packing_supported: ClassVar[bool] = False  # the stage's trainer packs examples (data.packing)

    def check(self):
        if self.data.padding_free and not self.padding_free_supported:
            yield "data.padding_free", "is supported by the sft, rm, dpo and orpo stages only"
        if self.data.packing and not self.packing_supported:
            yield "data.packing", "is supported by the sft stage only (for the others, data.padding_free saves the padding)"
        if not self.data.train:
            yield "data.train", "is required (a local file or a hub dataset name)"
        if not self.output_dir:
            yield "output_dir", "is required"
        if self.max_steps == 0 or self.max_steps < -1:
            yield "max_steps", f"must be >= 1 or -1 (use num_epochs), got {self.max_steps}"
        if self.resume and self.overwrite:
            yield "resume", "and overwrite=true are contradictory: resume continues the run overwrite would replace"
        if self.model.quantization.load_in_4bit and not self.model.lora.enabled:
            yield "model.quantization.load_in_4bit", ("needs model.lora.enabled=true: a 4-bit base stays frozen (QLoRA "
                                                      "trains LoRA adapters on it) and cannot be fine-tuned in full")


def _ref_model_check(key: str, value: str | None, null_means: str):
    if value is not None and not value.strip():
        yield key, f"must be a model path or hub name, or null ({null_means})"


# 2. Stage configs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SFTOptions:
    completion_only: bool = True  # loss on completion (assistant) tokens only; False = on every token


@dataclass(frozen=True)
class SFTConfig(TrainConfig):
    padding_free_supported = True
    packing_supported = True
    algo: SFTOptions = field(default_factory=SFTOptions)


@dataclass(frozen=True)
class RMOptions:
    # Bradley-Terry loss -log σ(r_c - r_r - m): m is the record's "margin" field (Llama 2, arXiv 2307.09288 eq. 2)
    # when the data has one, times `margin_scale`; 0 turns margins off.
    margin_scale: NonNeg = 1.0
    # Reward centering (Eisenstein et al. 2023, arXiv 2312.09244): + coef · (r_c + r_r)², keeping scores near 0.
    center_coef: NonNeg = 0.0
    # Where a sequence's score is read: "last" = at its last real token (the EOS; the usual reward model), "mean" =
    # the mean of the head over the response tokens (a linear head on mean-pooled states). Saved with the model
    # (config.json `rlhfkit_pooling`), so every later scorer reads it the same way. Mean pooling learns lexical
    # properties (sentiment, keywords) from far fewer pairs when the EOS state of a small model carries little.
    pooling: Literal["last", "mean"] = "last"
    # Train the score head only, on the frozen model (a linear probe): each step costs a forward, and a few hundred
    # pairs cannot overfit it the way they overfit LoRA or full fine-tuning. model.lora is then ignored.
    head_only: bool = False


@dataclass(frozen=True)
class RMConfig(TrainConfig):
    padding_free_supported = True
    algo: RMOptions = field(default_factory=RMOptions)

    def check(self):
        yield from super().check()
        if self.algo.head_only and self.model.quantization.load_in_4bit:
            yield "algo.head_only", ("and model.quantization.load_in_4bit are exclusive: the probe trains a head on a "
                                     "full-precision body; with a 4-bit base train LoRA adapters (head_only=false)")


@dataclass(frozen=True)
class DPOOptions:
    # "sigmoid" = DPO (Rafailov et al. 2023, arXiv 2305.18290; cDPO with label_smoothing > 0), "ipo" = IPO (Azar et al.
    # 2023, arXiv 2310.12036) on length-averaged log-probs as TRL does, "hinge" = SLiC-HF's hinge on the DPO log-ratio,
    # "simpo" = SimPO (Meng et al. 2024, arXiv 2405.14734): length-normalised and reference-free (no reference model).
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    beta: Positive = 0.1  # β: KL strength (DPO, hinge), IPO's τ, SimPO's reward scale (the paper uses 2.0-2.5)
    # ε: assumed label-flip probability (cDPO; "sigmoid" and "simpo" only)
    label_smoothing: Annotated[float, Interval(ge=0, lt=0.5)] = 0.0
    simpo_gamma: NonNeg = 0.5  # SimPO's target margin γ in reward units (the paper's γ, TRL's simpo_gamma)
    # Compute the reference log-probs of the train and eval sets once before training, then drop a separate reference
    # copy: no reference forward per step and, for full fine-tuning, no second model in memory while training.
    precompute_ref_logprobs: bool = False
    # The reference model; null = the policy's starting weights (with LoRA: the base with adapters disabled, no copy).
    ref_model: str | None = None

    def check(self):
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            yield "label_smoothing", f"applies only to loss_type sigmoid (cDPO) or simpo, got loss_type={self.loss_type}"
        if self.loss_type == "simpo" and self.ref_model is not None:
            yield "ref_model", "must be null with loss_type=simpo: SimPO uses no reference model"
        if self.loss_type == "simpo" and self.precompute_ref_logprobs:
            yield "precompute_ref_logprobs", "must be false with loss_type=simpo: SimPO uses no reference model"
        yield from _ref_model_check("ref_model", self.ref_model, "the policy's starting weights")


@dataclass(frozen=True)
class DPOConfig(TrainConfig):
    padding_free_supported = True
    algo: DPOOptions = field(default_factory=DPOOptions)


@dataclass(frozen=True)
class ORPOOptions:
    # ORPO (Hong et al. 2024, arXiv 2403.07691): chosen-response NLL + β · odds-ratio loss; no reference model.
    beta: NonNeg = 0.1  # the paper's λ, the odds-ratio weight (TRL's ORPO `beta`)


@dataclass(frozen=True)
class ORPOConfig(TrainConfig):
    padding_free_supported = True
    algo: ORPOOptions = field(default_factory=ORPOOptions)


@dataclass(frozen=True)
class KTOOptions:
    # KTO (Ethayarajh et al. 2024, arXiv 2402.01306) on unpaired completions labelled desirable or not.
    beta: Positive = 0.1  # β, the value function's sharpness
    desirable_weight: NonNeg = 1.0  # λ_D; the paper advises λ_D·n_D / (λ_U·n_U) in [1, 4/3]
    undesirable_weight: NonNeg = 1.0  # λ_U
    ref_model: str | None = None  # as DPO's algo.ref_model

    def check(self):
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            yield "desirable_weight", "and undesirable_weight are both 0: nothing would be learned"
        yield from _ref_model_check("ref_model", self.ref_model, "the policy's starting weights")


@dataclass(frozen=True)
class KTOConfig(TrainConfig):
    algo: KTOOptions = field(default_factory=KTOOptions)

    def check(self):
        yield from super().check()
        if self.optim.per_device_batch_size < 2:
            yield "optim.per_device_batch_size", (f"must be >= 2 for KTO, got {self.optim.per_device_batch_size}: KTO's "
                                                  "reference point z0 is estimated from mismatched pairs within a batch")


@dataclass(frozen=True)
class KLConfig:
    controller: Literal["fixed", "adaptive"] = "fixed"  # adaptive: Ziegler et al. 2019 proportional controller
    coef: NonNeg = 0.05  # β (the initial β when adaptive)
    target: Positive = 6.0  # adaptive: sequence KL (nats) to steer to
    horizon: PosInt = 10000  # adaptive: samples over which β moves by at most 20%

    def check(self):
        if self.controller == "adaptive" and self.coef == 0:
            yield "controller", "adaptive needs coef > 0"


@dataclass(frozen=True)
class OnlineOptions:
    algorithm: str = "ppo"  # a name in rlhfkit.algorithms: ppo, rloo, grpo, dr_grpo, dapo, reinforce_pp, ...
    rollout_batch_size: PosInt = 16  # prompts sampled per step (per process); samples = prompts × num_samples
    ppo_epochs: PosInt = 1  # passes over each rollout
    num_minibatches: PosInt = 1  # optimizer steps per pass (each split into micro-batches of per_device_batch_size)
    # Where π_old's log-probs come from when the experience is read more than once: "recompute" = a no-grad forward
    # of the policy after sampling; "sampler" = those the decode loop recorded (one policy forward fewer per step,
    # as TRL's PPO; they differ by numerics only: policy/sampler_logprob_gap, measured at the first update forward).
    # With one pass and no KL in the reward, π_old is the update forward's own log-probs either way.
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    clip_eps: Annotated[float, Interval(gt=0, lt=1)] = 0.2  # ratio clip ε (lower side)
    clip_eps_high: Positive | None = None  # upper side (DAPO's clip-higher, 0.28); None = clip_eps
    dual_clip: Annotated[float, Gt(1)] | None = None  # dual-clip constant c > 1 for negative advantages; None = off
    vf_coef: NonNeg = 0.1  # value-loss weight (PPO)
    clip_range_value: Positive | None = 0.2  # value clip (PPO); None = off
    entropy_coef: NonNeg = 0.0  # entropy bonus weight c: the loss subtracts c · H(π(·|s_t)), the full distribution's entropy
    disable_dropout: bool = True  # dropout off in policy and critic for the run (as TRL); false keeps it in the update forwards
    gamma: Annotated[float, Interval(ge=0, le=1)] = 1.0  # discount
    lam: Annotated[float, Interval(ge=0, le=1)] = 0.95  # GAE λ
    whiten_advantages: bool | None = None  # whiten advantages over the rollout; None = only for PPO (GAE)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None  # None = algorithm default
    target_kl: Positive | None = None  # stop a rollout's remaining epochs once approx-KL exceeds this
    dynamic_filtering: bool = False  # DAPO: drop groups whose samples all scored the same (no signal)
    mask_truncated: bool = False  # DAPO: responses without EOS take no loss
    value_model: str | None = None  # critic initialisation; None = the first reward model, else the policy
    # With `value_model` a causal LM (no trained score head): start the critic's value head at random instead of
    # refusing the directory. Off by default, so a causal LM given where a reward model was meant fails loudly.
    allow_new_value_head: bool = False
    sample_log_steps: PosInt = 10  # write sample generations to samples.jsonl every N steps
    table_steps: PosInt = 10  # print the Step | Reward | KL | ClipFrac | ValueLoss | PolicyLoss | LR table every N steps

    def check(self):
        if self.allow_new_value_head and not self.value_model:
            yield "allow_new_value_head", ("applies only with algo.value_model (without it the critic starts from the "
                                           "first reward model's trained head, or from the policy with a new head)")


@dataclass(frozen=True)
class OnlineConfig(TrainConfig):
    """PPO, RLOO, GRPO (Dr.GRPO, DAPO) and REINFORCE++: one loop. `max_steps` counts rollouts."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    algo: OnlineOptions = field(default_factory=OnlineOptions)

    def check(self):
        from rlhfkit.algorithms import ALGORITHMS

        yield from super().check()
        yield from self.reward.check_has_source()
        k, name = self.generation.num_samples, self.algo.algorithm
        if name not in ALGORITHMS:
            yield "algo.algorithm", f"must be one of {sorted(ALGORITHMS)}, got {name!r}"
        elif ALGORITHMS[name].advantage not in ("gae", "reinforce_pp") and k < 2:
            yield "generation.num_samples", f"{name} compares samples of one prompt: needs >= 2, got {k}"
        if self.algo.old_logprobs == "sampler" and self.generation.engine != "rlhfkit":
            yield "algo.old_logprobs", ("'sampler' reads rlhfkit's decode loop: needs generation.engine=rlhfkit "
                                        "(transformers' generate applies the model's own generation config)")
        samples = self.algo.rollout_batch_size * k
        if samples % self.algo.num_minibatches:
            yield "algo.num_minibatches", f"must divide the rollout's {samples} samples"
        elif (samples // self.algo.num_minibatches) % self.optim.per_device_batch_size:
            yield "optim.per_device_batch_size", f"must divide the minibatch of {samples // self.algo.num_minibatches} samples"


@dataclass(frozen=True)
class RFTOptions:
    iterations: PosInt = 1  # sample -> keep the best -> fine-tune rounds; each samples from the policy the last one trained
    prompts_per_iteration: PosInt | None = None  # a seeded random subset of the train prompts per iteration; None = all
    min_score: float | None = None  # drop a prompt whose best sample scores below this (None = keep every prompt)
    sampling_batch_size: PosInt = 16  # prompts per `generate` call (samples per call = this × generation.num_samples)


@dataclass(frozen=True)
class RFTConfig(TrainConfig):
    """Best-of-n / rejection-sampling fine-tuning, iterated. `generation.num_samples` is n. `max_steps` and
    `num_epochs` size the SFT of *each iteration* (optimizer steps, or passes over the kept samples); with
    `logging.save_steps` > 0 a resumable checkpoint is written after every iteration but the last."""

    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: RFTOptions = field(default_factory=RFTOptions)

    def check(self):
        yield from super().check()
        yield from self.reward.check_has_source()
        # Selection and min_score read the raw scores (plus reward.missing_eos_penalty): normalising would change
        # min_score's units and clipping would create ties, while neither can improve which sample is best.
        if self.reward.normalize != "none":
            yield "reward.normalize", f"must be 'none' for rft (the best sample is chosen on raw scores), got {self.reward.normalize!r}"
        if self.reward.clip is not None:
            yield "reward.clip", "must be null for rft (clipping only creates ties among the best samples)"


# Fields of the shared sections that only training reads: refused by eval rather than silently ignored.
_EVAL_UNUSED = {
    "data": (("train", "train_split", "eval_fraction", "packing", "padding_free", "max_samples"), "it reads data.eval; max_prompts limits it"),
    "reward": (("weights", "gold_function", "missing_eos_penalty", "normalize", "clip"),
               "it reports each judge's raw scores; add a gold judge to `judges`"),
}


@dataclass(frozen=True)
class EvalConfig:
    """`rlhfkit eval`: sample the policy and the reference on held-out prompts (same seed), score both with every
    judge, and write `output_dir/eval.json`. Scores are raw (no normalisation, clipping or EOS penalty)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the policy being evaluated
    # The reference policy (usually the policy's starting point): a model directory, hub name or "tiny". KL, win rates
    # and the reference's own figures need it; null evaluates the policy alone. It must share the policy's tokenizer.
    reference: str | None = None
    reference_gguf_file: str | None = None  # a .gguf file inside (or beside) `reference`, as model.gguf_file
    data: DataConfig = field(default_factory=DataConfig)  # held-out prompts: `data.eval` ({prompt} or {messages} records)
    preference_data: str | None = None  # pairwise preference records (a file or hub dataset): each reward model's accuracy
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # judges: each reward model (and their ensemble), the function
    judges: list[str] = field(default_factory=list)  # more Python judges, "name=module:function" (e.g. a gold judge)
    run_dir: str | None = None  # a training run whose metrics.jsonl the reward-hacking alarms also read
    max_prompts: PosInt | None = None  # evaluate only the first N prompts
    batch_size: PosInt = 16  # prompts per generation call (each gives generation.num_samples responses)
    num_examples: PosInt = 16  # side-by-side sample generations kept in eval.json
    output_dir: str = ""  # where eval.json and eval_config.yaml go (may be the training run's directory)
    seed: Seed = 42  # sampling seed: the policy and the reference draw with the same seed per batch
    overwrite: bool = False  # replace an existing eval.json in output_dir

    def check(self):
        if not self.data.eval:
            yield "data.eval", "is required (held-out prompts: a local file or a hub dataset name)"
        for section, (names, why) in _EVAL_UNUSED.items():
            value, default = getattr(self, section), type(getattr(self, section))()
            yield from ((f"{section}.{n}", f"is not used by eval ({why})")
                        for n in names if getattr(value, n) != getattr(default, n))
        if not self.output_dir:
            yield "output_dir", "is required"
        yield from _ref_model_check("reference", self.reference, "evaluate the policy alone")
        if self.reference_gguf_file and self.reference is None:
            yield "reference_gguf_file", "needs `reference`"
        if self.preference_data and not self.reward.model:
            yield "preference_data", "measures reward-model accuracy: it needs reward.model"
        names = [ref.rpartition(":")[2] for ref in self.reward.functions]
        for i, spec in enumerate(self.judges):
            name, sep, ref = spec.partition("=")
            if not sep or not name.strip() or ":" not in ref:
                yield f"judges[{i}]", f"must be 'name=module:function', got {spec!r}"
            names.append(name.strip())
        if duplicates := sorted({n for n in names if names.count(n) > 1}):
            yield "judges", f"judge names must be unique, got {', '.join(duplicates)} twice"


# 3. Loading ---------------------------------------------------------------------------------------------------


class _Refused(ConfigError):
    """A value of the right type refused (NaN/inf, out of range): reported as such even inside `X | None`."""


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0])}"
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _number(bound: Any) -> str:
    """A bound as written in the declaration: 4294967296 as 2**32."""
    power_of_two = isinstance(bound, int) and bound > 2**16 and not bound & (bound - 1)
    return f"2**{bound.bit_length() - 1}" if power_of_two else str(bound)


_OPS = {Gt: (">", operator.gt), Ge: (">=", operator.ge), Lt: ("<", operator.lt), Le: ("<=", operator.le)}


def _describe(c: Any) -> str:
    """`Ge(1)` -> ">= 1", `Interval(ge=0, lt=1)` -> "in [0, 1)"."""
    if isinstance(c, Interval):
        (lo, low), (hi, high) = [(type(p), dataclasses.astuple(p)[0]) for p in c]
        return f"in {'[' if lo is Ge else '('}{_number(low)}, {_number(high)}{']' if hi is Le else ')'}"
    return f"{_OPS[type(c)][0]} {_number(dataclasses.astuple(c)[0])}"


def _constrain(value: Any, meta: tuple, key: str, nullable: bool) -> Any:
    """Check `value` against the `annotated_types` constraints declared on its field; the message names `key`, and
    adds the field's `doc(...)` note."""
    notes = "".join(f" ({m.documentation})" for m in meta if isinstance(m, DocInfo))
    for c in meta:
        if isinstance(c, Len):
            if not c.min_length <= len(value) <= c.max_length:
                raise _Refused(f"config key '{key}' must have {c.min_length} items{notes}, got {value!r}")
        elif isinstance(c, Interval) or type(c) in _OPS:
            if not all(_OPS[type(b)][1](value, dataclasses.astuple(b)[0]) for b in (c if isinstance(c, Interval) else [c])):
                raise _Refused(f"config key '{key}' must be {_describe(c)}{' or null' * nullable}{notes}, got {value!r}")
        elif not isinstance(c, DocInfo):  # declared means enforced: a constraint the loader cannot read is a bug
            raise TypeError(f"config key '{key}': unsupported constraint {c!r}")
    return value


def _coerce(value: Any, tp: Any, key: str, nullable: bool = False) -> Any:
    """Return `value` as type `tp` within its declared constraints, or raise ConfigError naming `key`.

    Float fields take finite numbers only: YAML's `.nan` and `.inf` (or `1e999`) would otherwise train on NaN
    (`optim.lr`, `optim.max_grad_norm`) or never stop (`num_epochs`), and no range check can catch NaN.
    """
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return _constrain(_coerce(value, args[0], key), args[1:], key, nullable)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _coerce(value, arg, key, nullable=type(None) in args)
            except _Refused:
                raise
            except ConfigError:
                continue
    elif origin is list and isinstance(value, (list, tuple)):
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is Literal and value in args:
        return value
    elif tp is float and not isinstance(value, bool) and (isinstance(value, (int, float)) or (
            isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()))):
        # (YAML 1.1 reads `1e-5`, with no dot, as a string; users mean the number.)
        if not math.isfinite(float(value)):
            raise _Refused(f"config key '{key}': expected a finite number, got {value!r}")
        return float(value)
    elif tp in (bool, str, type(None)) and type(value) is tp or tp is int and type(value) is int:
        return value
    raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    # Absent sections are built too, so their checks run (e.g. a missing model.name_or_path).
    obj = cls(**{name: _coerce(data.get(name, {}), hints[name], prefix + name) for name in names
                 if name in data or dataclasses.is_dataclass(hints[name])})
    for name, message in obj.check() if hasattr(obj, "check") else ():
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
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' was already given a value")
        node[last] = value
    return tree


def _merge(base: dict, update: dict) -> dict:
    return {**base, **{k: _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in update.items()}}


class _DuplicateKeyError(yaml.MarkedYAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (SafeLoader silently keeps the last one)."""

    def construct_document(self, node):
        _refuse_duplicate_keys(node, "", set())
        return super().construct_document(node)


def _refuse_duplicate_keys(node: yaml.Node, path: str, seen: set) -> None:
    """Walk the composed tree with each mapping's dotted path, each node once (aliases share nodes). `<<` merge
    keys may be overridden, as YAML intends."""
    if id(node) in seen:
        return
    seen.add(id(node))
    children = []
    if isinstance(node, yaml.SequenceNode):
        children = [(item, f"{path.rstrip('.')}[{i}].") for i, item in enumerate(node.value)]
    if isinstance(node, yaml.MappingNode):
        first_line: dict = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = key_node.value
                if key in first_line:
                    raise _DuplicateKeyError(problem_mark=key_node.start_mark, problem=(
                        f"duplicate key '{path}{key}' (first given on line {first_line[key]}); give each key once"))
                first_line[key] = key_node.start_mark.line + 1
            children.append((value_node, f"{path}{key_node.value}."))
    for child, child_path in children:
        _refuse_duplicate_keys(child, child_path, seen)


def read_yaml(path: str) -> dict:
    """The mapping in the YAML file `path`; a missing file, non-UTF-8 bytes, bad YAML or a duplicate key is a
    ConfigError naming the file and line."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = yaml.load(raw.decode("utf-8-sig"), Loader=_StrictLoader)  # noqa: S506  a SafeLoader; a UTF-8 BOM is dropped
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"config file '{path}' line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
                          "save it as UTF-8") from None
    except _DuplicateKeyError as exc:
        raise ConfigError(f"config file '{path}' line {exc.problem_mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # one line (a ReaderError spans two)
        raise ConfigError(f"config file '{path}'{where}: not valid YAML ({problem})") from None
    if not isinstance(data, dict | None):
        raise ConfigError(f"config file '{path}': expected a mapping of keys at the top level, got {type(data).__name__}")
    return data or {}


C = typing.TypeVar("C")


def load_config(cls: type[C], path: str | None = None, overrides: list[str] | None = None, defaults: dict | None = None) -> C:
    """Build a validated, frozen `cls` from `defaults`, a YAML file and `key.sub=value` overrides (later wins)."""
    data = _merge(_merge(defaults or {}, read_yaml(path) if path else {}), parse_overrides(overrides or []))
    return _build(cls, data)


def config_to_yaml(cfg: Any) -> str:
    """The resolved config as YAML, loadable again by `load_config` (each run saves it as `config.yaml`)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
