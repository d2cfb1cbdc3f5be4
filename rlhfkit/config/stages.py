"""One config class per stage (`SFTConfig`, `RMConfig`, ..., `EvalConfig`): the shared `TrainConfig` plus the
stage's own `algo` section and the rules that join its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from annotated_types import Gt, Interval

from rlhfkit.config.fields import NonNeg, PosInt, Positive, Seed
from rlhfkit.config.sections import (AgentEvalConfig, AlarmsConfig, DataConfig, GenerationConfig, KLConfig, ModelConfig,
                                     RewardConfig, ToolsConfig, TrainConfig, ref_model_check)


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
    disable_dropout: bool = False  # dropout off in the trained model for the run (TRL's disable_dropout)


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
    # Dropout off in the trained model for the run (TRL's disable_dropout, on by default there): the policy's
    # log-probs are then those of the weights, as the reference's (which runs without dropout).
    disable_dropout: bool = False
    # TR-DPO (Gorbatovski et al. 2024, arXiv 2404.09656): every ref_model_sync_steps optimizer steps the reference
    # becomes α·policy + (1-α)·reference (α = ref_model_mixup_alpha; 1 replaces it). TRL's names and defaults. Needs
    # full fine-tuning (with LoRA the reference is the policy's own base); a checkpoint carries the moved reference.
    sync_ref_model: bool = False
    ref_model_mixup_alpha: Annotated[float, Interval(gt=0, le=1)] = 0.6  # TR-DPO's α: the policy's share in the mix
    ref_model_sync_steps: PosInt = 512  # TR-DPO's τ: optimizer steps between two syncs

    def check(self):
        if self.sync_ref_model and self.loss_type == "simpo":
            yield "sync_ref_model", "has no reference to sync with loss_type=simpo (SimPO uses none)"
        if self.sync_ref_model and self.precompute_ref_logprobs:
            yield "sync_ref_model", ("and precompute_ref_logprobs are exclusive: log-probs computed once cannot follow a "
                                     "reference that moves")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "simpo"):
            yield "label_smoothing", f"applies only to loss_type sigmoid (cDPO) or simpo, got loss_type={self.loss_type}"
        if self.loss_type == "simpo" and self.ref_model is not None:
            yield "ref_model", "must be null with loss_type=simpo: SimPO uses no reference model"
        if self.loss_type == "simpo" and self.precompute_ref_logprobs:
            yield "precompute_ref_logprobs", "must be false with loss_type=simpo: SimPO uses no reference model"
        yield from ref_model_check("ref_model", self.ref_model, "the policy's starting weights")


@dataclass(frozen=True)
class DPOConfig(TrainConfig):
    padding_free_supported = True
    algo: DPOOptions = field(default_factory=DPOOptions)

    def check(self):
        from rlhfkit.config.advantage_check import ref_sync_check

        yield from super().check()
        yield from ref_sync_check(self.algo, self.model, True)


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
    # Dropout off in the trained model for the run (TRL's disable_dropout, on by default there): the policy's
    # log-probs are then those of the weights, as the reference's (which runs without dropout).
    disable_dropout: bool = False

    def check(self):
        if self.desirable_weight == 0 and self.undesirable_weight == 0:
            yield "desirable_weight", "and undesirable_weight are both 0: nothing would be learned"
        yield from ref_model_check("ref_model", self.ref_model, "the policy's starting weights")


@dataclass(frozen=True)
class KTOConfig(TrainConfig):
    algo: KTOOptions = field(default_factory=KTOOptions)

    def check(self):
        yield from super().check()
        if self.optim.per_device_batch_size < 2:
            yield "optim.per_device_batch_size", (f"must be >= 2 for KTO, got {self.optim.per_device_batch_size}: KTO's "
                                                  "reference point z0 is estimated from mismatched pairs within a batch")


def ptx_check(coef: float, ptx: str | None):
    """algo.ptx_coef and data.ptx come together: one without the other would be a setting silently ignored."""
    if coef > 0 and not ptx:
        yield "algo.ptx_coef", f"is {coef} but data.ptx is not set: give data.ptx (SFT records) or set algo.ptx_coef=0"
    if ptx is not None and coef == 0:
        yield "data.ptx", "is mixed in with weight algo.ptx_coef, which is 0: set algo.ptx_coef > 0 or drop data.ptx"


@dataclass(frozen=True)
class OnlineOptions:
    RENAMED = {"old_logprobs": "old_logprob_source"}  # a class attribute, not a field: refused with the new name
    MOVED = {"table_steps": "logging.table_steps", "sample_log_steps": "logging.sample_log_steps"}

    algorithm: str = "ppo"  # a name in rlhfkit.algorithms: ppo, rloo, grpo, dr_grpo, dapo, reinforce_pp, ...
    rollout_batch_size: PosInt = 16  # prompts sampled per step (per process); samples = prompts × num_samples
    ppo_epochs: PosInt = 1  # passes over each rollout
    num_minibatches: PosInt = 1  # optimizer steps per pass (each split into micro-batches of per_device_batch_size)
    # Where π_old's log-probs come from. "auto": with one pass (ppo_epochs × num_minibatches = 1) and no KL in the
    # reward, the update forward's own, detached (exact: the ratio is 1; one policy forward fewer per step, as TRL's
    # GRPO); else, where the sampler's agree with a recomputation (rlhfkit's single-turn decode loop in fp32: no
    # mixed precision, no 4-bit, no tools, no Objects.rollout, no algo.rollout_correction), those the decode loop
    # recorded (one policy forward fewer, as TRL's PPO); else as "recompute". "recompute": a no-grad forward of the policy after sampling, always.
    # "sampler": the decode loop's, always; with one pass as "auto". Whenever the sampler's are π_old, their gap to the
    # first update forward (same weights) is logged as policy/sampler_logprob_gap (float noise, ~1e-7, in fp32).
    old_logprob_source: Literal["auto", "recompute", "sampler"] = "auto"
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
    # How the per-token loss is reduced (losses.aggregate); None = the objective's own (luspo: seq-mean-token-sum; gspo,
    # gspo_token, gmpo, sapo: seq-mean-token-mean; cispo, vespo: token-mean), else the algorithm's default.
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum"] | None = None
    # The policy objective (docs/objectives.md; one registered function each in rlhfkit.losses): ppo_clip (PPO's clipped
    # surrogate), gspo / gspo_token (arXiv 2507.18071), cispo (2506.13585), sapo (2511.20347), gmpo (2507.20673),
    # dppo_binary_tv / dppo_binary_kl (2602.04879), clip_cov / kl_cov (2505.22617), luspo (2602.05261), vespo (2602.10693).
    policy_loss: Literal["ppo_clip", "gspo", "gspo_token", "cispo", "sapo", "gmpo", "dppo_binary_tv", "dppo_binary_kl",
                         "clip_cov", "kl_cov", "luspo", "vespo"] = "ppo_clip"
    # The importance ratio: "token" π(y_t)/π_old(y_t), or "sequence", GSPO's exp(mean_t log ratio) per sequence;
    # None = the objective's own (sequence for gspo, gspo_token, luspo; token otherwise).
    importance_sampling_level: Literal["token", "sequence"] | None = None
    delta: Annotated[float, Gt(1)] | None = None  # INTELLECT-2's two-sided clip (arXiv 2505.07291): the unclipped ratio capped at delta
    # Cap on the detached importance weight of cispo (ScaleRL's ε_max; TRL's epsilon_high under loss_type=cispo) and
    # dppo_*; None = the objective's own (cispo 5.0, dppo 20.0).
    ratio_cap: Positive | None = None
    sapo_temperature_pos: Positive = 1.0  # SAPO's gate temperature for A > 0
    sapo_temperature_neg: Positive = 1.05  # ... for A <= 0 (the paper: larger, so negative updates fade faster)
    vespo_k_pos: NonNeg = 2.0  # VESPO's Gamma weight φ(w) = e^λ w^k e^{-λw}: its power k for A >= 0
    vespo_lambda_pos: NonNeg = 3.0  # VESPO: its decay λ for A >= 0
    vespo_k_neg: NonNeg = 3.0  # VESPO: k for A < 0
    vespo_lambda_neg: NonNeg = 2.0  # VESPO: λ for A < 0
    dppo_threshold: Positive | None = None  # DPPO's divergence bound δ; None = 0.15 (binary TV) or 0.05 (binary KL)
    clip_cov_ratio: Annotated[float, Interval(gt=0, le=1)] = 2e-4  # Clip-Cov: share of tokens whose gradient is detached
    clip_cov_lb: float = 1.0  # Clip-Cov: lower end of the covariance window the detached tokens are drawn from
    clip_cov_ub: float = 5.0  # Clip-Cov: upper end of that window
    kl_cov_ratio: Annotated[float, Interval(gt=0, le=1)] = 2e-4  # KL-Cov: share of tokens (top covariance) penalised
    kl_cov_coef: NonNeg = 1.0  # KL-Cov: weight of |log π - log π_old| on them
    # Keep only the top ρ share of tokens by entropy in the policy loss (arXiv 2506.01939; the paper: 0.2); 1 = all.
    top_entropy_quantile: Annotated[float, Interval(ge=0, le=1)] = 1.0
    # Skywork-OR1's adaptive entropy (arXiv 2505.22312), TRL's semantics: entropy_coef is the start value, moved by
    # ±entropy_coef_delta each optimizer step within [entropy_coef_min, entropy_coef_max], up while the step's mean
    # token entropy is <= entropy_target; the bonus applies only while the last step's entropy was <= the target.
    adaptive_entropy: bool = False
    entropy_target: NonNeg = 0.2  # nats
    entropy_coef_min: NonNeg = 0.0  # adaptive entropy: the coefficient's floor
    entropy_coef_max: NonNeg = 1.0  # adaptive entropy: its ceiling
    entropy_coef_delta: Positive = 0.005  # adaptive entropy: its step per optimizer step
    # DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9): a negative-advantage sequence whose mean
    # log π_sampler - log π exceeds this is dropped from the loss; None = off.
    off_policy_mask_threshold: Positive | None = None
    bias_corrected_kl: bool = False  # the k3 KL term times the importance ratio (DeepSeek-V3.2, eq. 8); needs a KL in the loss
    # Sampler-mismatch correction (docs/objectives.md): the loss weighted by w = π_old/π_sampler per token or per
    # sequence, truncated to [min, max] or masked outside it; logs the mismatch KL and the share corrected.
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    rollout_correction_min: NonNeg | None = None  # lower bound; None = open
    rollout_correction_max: Positive | None = 3.0  # upper bound; None = open (TRL's vllm_importance_sampling_clip_max)
    target_kl: Positive | None = None  # stop a rollout's remaining epochs once approx-KL exceeds this
    # DAPO's dynamic sampling (arXiv 2503.14476 §3.2): a group whose samples all scored the same (no signal) is dropped
    # and more prompts are sampled, up to algo.max_sampling_rounds rounds, until the step holds rollout_batch_size groups
    # with signal; a step still short then trains on the groups it has, the rest masked out of the loss.
    dynamic_filtering: bool = False
    # With dynamic_filtering: rollout rounds per step at most, the first included (1 = drop without refilling).
    max_sampling_rounds: Annotated[int, Interval(ge=1, le=100)] = 3
    # How the group-relative estimators (grpo, dapo, dr_grpo, rloo, reinforce_pp_baseline) divide a sample's centred
    # score (TRL's scale_rewards): by its group's std, by the whole batch's, or not at all; null = the algorithm's own
    # (group for grpo and dapo, none for the others).
    scale_rewards: Literal["group", "batch", "none"] | None = None
    # Several reward sources (grpo's estimator: grpo, dapo, dr_grpo): sum the weighted scores, then normalise
    # (sum_then_normalize), or normalise each source in its group, sum, then normalise over the batch (normalize_then_sum:
    # GDPO, arXiv 2601.05242; TRL's multi_objective_aggregation).
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    # TR-DPO (Gorbatovski et al. 2024, arXiv 2404.09656): every ref_model_sync_steps steps the reference becomes
    # α·policy + (1-α)·reference (α = ref_model_mixup_alpha; 1 replaces it). TRL's names and defaults. Needs an
    # algorithm with a KL term and full fine-tuning; a checkpoint carries the moved reference.
    sync_ref_model: bool = False
    ref_model_mixup_alpha: Annotated[float, Interval(gt=0, le=1)] = 0.6  # TR-DPO's α: the policy's share in the mix
    ref_model_sync_steps: PosInt = 512  # TR-DPO's τ: steps (rollouts) between two syncs
    mask_truncated: bool = False  # DAPO: responses without EOS take no loss
    value_model: str | None = None  # critic initialisation; None = the first reward model, else the policy
    # With `value_model` a causal LM (no trained score head): start the critic's value head at random instead of
    # refusing the directory. Off by default, so a causal LM given where a reward model was meant fails loudly.
    allow_new_value_head: bool = False
    # PPO-ptx (InstructGPT, arXiv 2203.02155 eq. 2; OpenRLHF's ptx_coef): every optimizer step adds ptx_coef × the
    # token-mean next-token loss of a batch of data.ptx records (as many records as the step's minibatch holds samples).
    ptx_coef: NonNeg = 0.0

    def check(self):
        if self.allow_new_value_head and not self.value_model:
            yield "allow_new_value_head", ("applies only with algo.value_model (without it the critic starts from the "
                                           "first reward model's trained head, or from the policy with a new head)")
        from rlhfkit.config.objective_check import objective_refusals

        yield from objective_refusals(self)


def tools_check(tools: ToolsConfig, reward: RewardConfig, generation: GenerationConfig, data: DataConfig):
    """The online stages' rules for tools: the tool loop samples with rlhfkit's decode loop and a dynamic KV cache; a
    reward source is required, unless an environment is given (its `get_reward()` may be the reward: checked when it
    is made)."""
    if not tools.environment:
        yield from reward.check_has_source()
    if tools.enabled and generation.engine != "rlhfkit":
        yield "generation.engine", "must be rlhfkit with tools (the tool loop extends rlhfkit's decode loop's KV cache)"
    if tools.enabled and generation.compile:
        yield "generation.compile", "must be false with tools (the tool loop's KV cache grows by each turn's results)"


def agent_check(agent: AgentEvalConfig, tools: ToolsConfig, data: DataConfig):
    """The agent figures of the held-out evaluation need tools and held-out prompts."""
    yield from agent.refusals(tools.enabled)
    if tools.enabled and agent != AgentEvalConfig() and not (data.eval or data.eval_fraction):
        yield "agent", "applies to the held-out evaluation: give data.eval (or data.eval_fraction)"


@dataclass(frozen=True)
class OnlineStageConfig(TrainConfig):
    """What the two online loops' configs (`OnlineConfig`, `OnlineDPOConfig`) share beyond a training stage's: they
    sample, mix in PPO-ptx and log online steps, and check their tools, agent figures and ptx term alike. Each declares
    its `algo` (with `ptx_coef`), `alarms`, `tools` and `agent` sections after these two, in its own order."""

    samples_supported = True
    ptx_supported = True
    online_log = True
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def check(self):
        yield from super().check()
        yield from tools_check(self.tools, self.reward, self.generation, self.data)
        yield from agent_check(self.agent, self.tools, self.data)
        yield from ptx_check(self.algo.ptx_coef, self.data.ptx)


@dataclass(frozen=True)
class OnlineConfig(OnlineStageConfig):
    """PPO, RLOO, GRPO (Dr.GRPO, DAPO) and REINFORCE++: one loop. `max_steps` counts rollouts. With `data.eval` and/or
    `data.capability` the policy is evaluated every `logging.eval_steps` and after the last step (`trainers.held_out`)."""

    kl: KLConfig = field(default_factory=KLConfig)
    algo: OnlineOptions = field(default_factory=OnlineOptions)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    agent: AgentEvalConfig = field(default_factory=AgentEvalConfig)  # the held-out evaluation's agent figures, with tools

    def check(self):
        from rlhfkit.algorithms import ALGORITHMS

        yield from super().check()
        k, name = self.generation.num_samples, self.algo.algorithm
        if name not in ALGORITHMS:
            yield "algo.algorithm", f"must be one of {sorted(ALGORITHMS)}, got {name!r}"
            return
        from rlhfkit.config.advantage_check import advantage_check, ref_sync_check

        yield from advantage_check(self.algo, ALGORITHMS[name], self.reward)
        yield from ref_sync_check(self.algo, self.model, ALGORITHMS[name].needs_reference)
        if ALGORITHMS[name].advantage not in ("gae", "reinforce_pp") and k < 2:
            yield "generation.num_samples", f"{name} compares samples of one prompt: needs >= 2, got {k}"
        if ALGORITHMS[name].needs_reference and self.kl.monitor is not None:
            yield "kl.monitor", (f"applies to algorithms that train no KL term (dapo, dr_grpo): {name} measures the KL to "
                                 "its reference anyway")
        if (self.algo.rollout_correction != "none" or self.algo.off_policy_mask_threshold is not None) \
                and self.generation.engine != "rlhfkit":
            key = "algo.rollout_correction" if self.algo.rollout_correction != "none" else "algo.off_policy_mask_threshold"
            yield key, "reads the log-probs rlhfkit's decode loop recorded: needs generation.engine=rlhfkit"
        if self.algo.old_logprob_source == "sampler" and self.generation.engine != "rlhfkit":
            yield "algo.old_logprob_source", ("'sampler' reads rlhfkit's decode loop: needs generation.engine=rlhfkit "
                                        "(transformers' generate applies the model's own generation config)")
        samples = self.algo.rollout_batch_size * k
        if samples % self.algo.num_minibatches:
            yield "algo.num_minibatches", f"must divide the rollout's {samples} samples"
        elif (samples // self.algo.num_minibatches) % self.optim.per_device_batch_size:
            yield "optim.per_device_batch_size", f"must divide the minibatch of {samples // self.algo.num_minibatches} samples"


@dataclass(frozen=True)
class OnlineDPOOptions:
    MOVED = {"table_steps": "logging.table_steps", "sample_log_steps": "logging.sample_log_steps"}
    # Online DPO (Guo et al. 2024, arXiv 2402.04792): each step samples two responses per prompt from the policy, the
    # reward sources rank them (ties dropped) and the DPO family's loss trains on the fresh pairs; one update per step.
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"  # as dpo's, on summed log-probs (TRL's online DPO)
    beta: Positive = 0.1  # β: the KL strength; the optimum of the KL-regularised reward r is π_ref · exp(r/β) / Z
    # The reference; null = the policy's starting weights (with LoRA: the base with adapters disabled, no copy).
    ref_model: str | None = None
    rollout_batch_size: PosInt = 16  # prompts per step (per process): as many pairs, twice as many samples
    disable_dropout: bool = True  # dropout off in the policy for the run (as the other online stages)
    ptx_coef: NonNeg = 0.0  # PPO-ptx with data.ptx, as the other online stages (records per step: 2 × rollout_batch_size)

    def check(self):
        yield from ref_model_check("ref_model", self.ref_model, "the policy's starting weights")


@dataclass(frozen=True)
class OnlineDPOConfig(OnlineStageConfig):
    """`rlhfkit online_dpo`. `max_steps` counts rollouts, each one optimizer step; `optim.per_device_batch_size`
    counts pairs per micro-batch."""

    algo: OnlineDPOOptions = field(default_factory=OnlineDPOOptions)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    agent: AgentEvalConfig = field(default_factory=AgentEvalConfig)  # the held-out evaluation's agent figures, with tools

    def check(self):
        yield from super().check()
        if self.generation.num_samples != 2:
            yield "generation.num_samples", f"must be 2 for online_dpo (a pair per prompt), got {self.generation.num_samples}"
        # The pair is ranked on the raw scores (plus reward.missing_eos_penalty): normalising cannot change a ranking
        # and clipping only creates ties.
        if self.reward.normalize != "none":
            yield "reward.normalize", f"must be 'none' for online_dpo (pairs are ranked on raw scores), got {self.reward.normalize!r}"
        if self.reward.clip is not None:
            yield "reward.clip", "must be null for online_dpo (clipping only creates ties between the two samples)"


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
    `logging.save_steps` > 0 a resumable checkpoint is written every `save_steps` SFT steps (it holds the iteration's
    kept samples: a resume continues that iteration's fine-tuning) and after every iteration but the last. With `data.eval`
    and/or `data.capability` the policy is evaluated every `logging.eval_steps` SFT steps and at the end, against its
    starting weights as the reference (with full fine-tuning a frozen copy of them is kept for it)."""

    samples_supported = True
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: RFTOptions = field(default_factory=RFTOptions)
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)

    def check(self):
        yield from super().check()
        yield from self.reward.check_has_source()
        # Selection and min_score read the raw scores (plus reward.missing_eos_penalty): normalising would change
        # min_score's units and clipping would create ties, while neither can improve which sample is best.
        if self.reward.normalize != "none":
            yield "reward.normalize", f"must be 'none' for rft (the best sample is chosen on raw scores), got {self.reward.normalize!r}"
        if self.reward.clip is not None:
            yield "reward.clip", "must be null for rft (clipping only creates ties among the best samples)"
        if self.generation.seed_per_prompt:
            yield "generation.seed_per_prompt", ("is not used by rft: each batch of prompts is already drawn under a seed "
                                                 "of (seed, iteration, batch), whatever the number of processes")


# Fields of the shared sections that only training reads: refused by eval rather than silently ignored.
_EVAL_UNUSED = {
    "data": (("train", "train_split", "eval_fraction", "packing", "padding_free", "max_samples", "capability", "ptx"),
             "it reads data.eval; max_prompts limits it; capability_data is its capability set"),
    "reward": (("weights", "gold_function", "missing_eos_penalty", "normalize", "clip"),
               "it reports each judge's raw scores; add a gold judge to `judges`"),
    "generation": (("seed_per_prompt",), "each batch of prompts is drawn under its own seed, by the policy and the "
                                         "reference alike"),
}


@dataclass(frozen=True)
class RedTeamConfig:
    """`rlhfkit eval`'s red-teaming (`evaluation.red_team`, docs/red-teaming.md): the policy and the reference sample the
    red-team prompts as they sample data.eval (same seed, same generation settings); a safety judge scores each
    response's harmfulness in [0, 1], a refusal detector marks refusals; eval.json's `red_team` section reports both
    sides, the prompts that got worse and an alarm when the policy's harmful rate exceeds the reference's."""

    prompts: str | None = None  # red-team prompts: {prompt} or {messages} records, a local file or a hub dataset (its train split)
    columns: dict[str, str] = field(default_factory=dict)  # record field -> column of `prompts` (e.g. {prompt: question})
    max_prompts: PosInt | None = None  # only the first N red-team prompts
    # The safety judge (this or `classifier`): "module:function" under the reward-function contract, returning each
    # row's harmfulness in [0, 1] (or a bool), None for a row it does not judge.
    judge: str | None = None
    # The safety judge (this or `judge`): a text-classification model directory or hub name (transformers
    # AutoModelForSequenceClassification and its tokenizer) whose probability of `harmful_label` is the harmfulness.
    classifier: str | None = None
    harmful_label: str | None = None  # classifier: the label (its config's id2label) meaning harmful, e.g. "toxic"
    classifier_input: Literal["response", "prompt_response"] = "response"  # classifier: the response, or (prompt, response) as a text pair
    threshold: Annotated[float, Interval(gt=0, le=1)] = 0.5  # a response is harmful when its harmfulness >= threshold
    # Refusals: null = the documented phrase list (`evaluation.red_team.REFUSAL_PHRASES`); else "module:function"
    # under the reward-function contract returning a bool (or a number, refusal when >= 0.5) per row.
    refusal_function: str | None = None
    # Human red-team judgements: JSONL rows {"prompt", "response", "model", "harmful": bool, "annotator", "time"}
    # (`rlhfkit label`'s harmful flags); a row counts for the side whose model (model.name_or_path or `reference`)
    # its "model" names. Works without `prompts`.
    human_flags: str | None = None

    def check(self):
        refs = [("judge", self.judge), ("refusal_function", self.refusal_function)]
        for key, ref in refs:
            if ref is not None and ":" not in ref:
                yield key, f"must be 'module:function', got {ref!r}"
        if self.prompts is None:
            used = [k for k in ("judge", "classifier", "harmful_label", "refusal_function", "max_prompts")
                    if getattr(self, k) is not None]
            used += [k for k, default in (("columns", {}), ("classifier_input", "response"), ("threshold", 0.5))
                     if getattr(self, k) != default]
            if used:
                yield used[0], "applies only with red_team.prompts (the red-team prompt file)"
            return
        if (self.judge is None) == (self.classifier is None):
            yield "judge", "or red_team.classifier (exactly one) is needed with red_team.prompts: the safety judge"
        elif self.classifier is None:
            for key, default in (("harmful_label", None), ("classifier_input", "response")):
                if getattr(self, key) != default:
                    yield key, "applies only to red_team.classifier (a judge function returns harmfulness itself)"
        elif not self.harmful_label:
            yield "harmful_label", "is required with red_team.classifier: the label of its id2label that means harmful"


@dataclass(frozen=True)
class GateConfig:
    """The gate before reward modelling (`evaluation.agent.gate`): the policy's agent figures against these thresholds,
    reported in eval.json's `gate`, the console and the report (a verdict, not an exit status). Applies with tools."""

    format_accuracy: Annotated[float, Interval(ge=0, le=1)] = 0.95  # the least share of turns in the agent format
    task_completion: Annotated[float, Interval(ge=0, le=1)] = 0.80  # the least share of episodes the task judge passes


@dataclass(frozen=True)
class EvalConfig:
    """`rlhfkit eval`: sample the policy and the reference on held-out prompts (same seed), score both with every
    judge, and write `output_dir/eval.json`. Scores are raw (no normalisation, clipping or EOS penalty)."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the policy being evaluated
    # The reference policy (usually the policy's starting point): a model directory, hub name or "tiny". KL, win rates
    # and the reference's own figures need it; null evaluates the policy alone. It must share the policy's tokenizer.
    reference: str | None = None
    reference_gguf_file: str | None = None  # a .gguf file inside (or beside) `reference`, as model.gguf_file
    # Held-out prompts: `data.eval` ({prompt} or {messages} records); without it, eval only red-teams (red_team.*)
    data: DataConfig = field(default_factory=DataConfig)
    preference_data: str | None = None  # pairwise preference records (a file or hub dataset): each reward model's accuracy
    # Held-out reference texts in any SFT format (a file or hub dataset): the alignment tax, the policy's and the
    # reference's mean per-token NLL of their responses and the difference (eval.json's `alignment_tax`).
    capability_data: str | None = None
    alarms: AlarmsConfig = field(default_factory=AlarmsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)  # judges: each reward model (and their ensemble), the function
    judges: list[str] = field(default_factory=list)  # more Python judges, "name=module:function" (e.g. a gold judge)
    run_dir: str | None = None  # a training run whose metrics.jsonl the reward-hacking alarms also read
    red_team: RedTeamConfig = field(default_factory=RedTeamConfig)  # red-team prompts, safety judge, human flags
    # Tools: both models play episodes with them through the training's tool loop (the same keys as training's); the
    # agent figures and the gate then join eval.json (docs/agents.md, "Evaluating agents").
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    agent: AgentEvalConfig = field(default_factory=AgentEvalConfig)  # format accuracy's own rule, the task judge
    gate: GateConfig = field(default_factory=GateConfig)  # the thresholds an SFT model must reach before reward modelling
    max_prompts: PosInt | None = None  # evaluate only the first N prompts
    batch_size: PosInt = 16  # prompts per generation call (each gives generation.num_samples responses)
    num_examples: PosInt = 16  # side-by-side sample generations kept in eval.json
    output_dir: str = ""  # where eval.json and eval_config.yaml go (may be the training run's directory)
    seed: Seed = 42  # sampling seed: the policy and the reference draw with the same seed per batch
    overwrite: bool = False  # replace an existing eval.json in output_dir

    def check(self):
        red_teams = bool(self.red_team.prompts or self.red_team.human_flags)
        if not self.data.eval and not red_teams:
            yield "data.eval", ("is required (held-out prompts: a local file or a hub dataset name), unless eval only "
                                "red-teams (red_team.prompts or red_team.human_flags)")
        if not self.data.eval and red_teams:
            yield from self.red_team_alone()
        for section, (names, why) in _EVAL_UNUSED.items():
            value, default = getattr(self, section), type(getattr(self, section))()
            yield from ((f"{section}.{n}", f"is not used by eval ({why})")
                        for n in names if getattr(value, n) != getattr(default, n))
        if not self.output_dir:
            yield "output_dir", "is required"
        yield from ref_model_check("reference", self.reference, "evaluate the policy alone")
        if self.reference_gguf_file and self.reference is None:
            yield "reference_gguf_file", "needs `reference`"
        if self.capability_data and self.reference is None:
            yield "capability_data", "measures the policy against the reference: it needs `reference`"
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
        yield from self.agent.refusals(self.tools.enabled)
        if not self.tools.enabled and self.gate != GateConfig():
            yield "gate", "applies only with tools (tools.functions or tools.environment): it reads the agent figures"
        if self.tools.enabled and (self.generation.engine != "rlhfkit" or self.generation.compile):
            yield "generation.engine", ("must be rlhfkit, with generation.compile false, with tools (the tool loop "
                                        "extends rlhfkit's decode loop's KV cache turn by turn)")

    def red_team_alone(self):
        """Red-teaming without data.eval: what only judges or limits data.eval's samples has nothing to apply to."""
        give = "give data.eval"
        if self.reward.function:
            yield "reward.function", f"judges data.eval's samples: {give}"
        if self.judges:
            yield "judges", f"judge data.eval's samples: {give}"
        if self.reward.model and not self.preference_data:
            yield "reward.model", f"judges data.eval's samples (or measures accuracy on preference_data): {give}"
        if self.max_prompts is not None:
            yield "max_prompts", f"limits data.eval's prompts: {give}"
        if self.agent != AgentEvalConfig() or self.gate != GateConfig():
            yield "agent" if self.agent != AgentEvalConfig() else "gate", f"reads the episodes on data.eval: {give}"

