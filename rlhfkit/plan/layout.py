"""What a stage holds and runs, read from its validated config: which models are resident and trained, the rows and
lengths of its forwards, its generation. The one place the planner knows how each trainer is built; the byte counts
(`rlhfkit.plan.memory`) and FLOPs (`rlhfkit.plan.timing`) read this, never the config.

Every row is sized at its cap (data.max_length; max_prompt_length + generation.max_new_tokens): the worst batch a
run can meet. A batch of shorter rows needs less.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from rlhfkit.plan.shape import ModelShape, as_classifier, load_shape, shortest_prompt

ONLINE = ("ppo", "rloo", "grpo", "reinforce_pp")
STAGES_PLANNED = ("sft", "rm", "dpo", "orpo", "kto", *ONLINE, "online_dpo", "rft")


@dataclass(frozen=True)
class Forward:
    """One kind of forward per micro-batch: `rows` sequences of `length` tokens, logits (B·T·V) on `logit_len` of
    them (0: a score head), with gradient or not."""

    rows: int
    length: int
    logit_len: int
    grad: bool
    in_update: bool = False  # a no-grad forward of the update's micro-batch (a reference's), not of the sampling


@dataclass(frozen=True)
class Generation:
    """The sampling of an online step or an RFT round: `rows` sequences decoded at once."""

    rows: int
    prompt_len: int
    new_tokens: int
    static_cache: bool  # generation.compile: a StaticCache of the full length from the start
    top_p: bool  # nucleus sampling sorts the vocabulary per row
    prompts: int = 1  # distinct prompts, each prefilled once (its cache row then copied to its samples)
    # Time only, the tool loop (`rollout.tool_loop`): rounds of tool calls planned per episode (tools.max_calls, one
    # where unset), each appending at most `result_len` tokens (the result's cap within the completion's) that one
    # no-grad forward feeds through the KV cache before the next turn samples; 0 without tools.
    rounds: int = 0
    result_len: int = 0


@dataclass(frozen=True)
class Layout:
    stage: str
    policy: ModelShape
    head: str  # "lm" (a causal LM) or "score" (rm: a sequence classifier)
    train: str  # "full", "lora" or "head" (rm's head_only)
    quantized: bool  # the policy's base in 4 bits (QLoRA)
    adapters: int  # LoRA parameters: the policy's, plus the shared-base critic's adapter and head
    lora_rank: int  # the adapters' rank (0 without LoRA)
    lora_targets: tuple[str, ...]  # the adapted linears of a layer
    lora_dropout: bool  # LoRA dropout is on in the update (offline stages; the online ones disable dropout)
    reference: ModelShape | None  # a separate frozen reference (None: none, or the LoRA base with adapters off)
    reference_4bit: bool
    rewards: tuple[ModelShape, ...]  # frozen reward models (sequence classifiers)
    rewards_4bit: bool
    critic: ModelShape | None  # PPO's separate, fully trained critic (a sequence classifier)
    trained: Forward  # the update's forward with gradient (policy; with PPO the critic runs the same rows)
    frozen: tuple[Forward, ...]  # no-grad forwards per micro-batch (reference, KTO's z0, scoring)
    accum: int  # micro-batches per optimizer step
    generation: Generation | None
    checkpointing: bool
    attention: str  # sdpa, eager or flash_attention_2
    entropy: bool  # the update computes the entropy of the full distribution (algo.entropy_coef > 0)
    optimizer_steps: int  # optimizer steps per planned step (online: ppo_epochs × num_minibatches)
    micro_batches: int  # micro-batches per planned step
    release_reference: bool  # dpo's precompute_ref_logprobs: the reference is freed before training
    # Time only: how many times per planned step the `frozen` forwards and the `generation` run (online: the frozen
    # forwards once per rollout, not per epoch; RFT: an iteration's sampling spread over its SFT steps).
    frozen_batches: float = 1.0
    generations_per_step: float = 1.0
    # Time only, online stages but online DPO: where π_old comes from (`trainers.experience.old_logprob_source`):
    # "recompute" (the first of `frozen` runs), "free" (the update's or the sampler's log-probs), "free_in_fp32"
    # (the sampler's where the run computes in fp32: on the CPU, not under a GPU's bf16); "" elsewhere.
    pi_old: str = ""
    value_adapter: bool = False  # time only: PPO's critic is a second adapter on the policy's base (a pass of its own)


Loader = Callable[..., ModelShape]


def layout_of(stage: str, cfg: Any, load: Loader = load_shape) -> Layout:
    """The layout of `stage` run with the validated config `cfg`; `load(name, where, gguf_file, revision,
    num_layers)` reads a model's shape."""
    m = cfg.model
    policy = load(m.name_or_path, "model.name_or_path", m.gguf_file, m.revision, m.num_layers)
    if stage == "rm":
        as_classifier(policy, "model.name_or_path")
    head_only = stage == "rm" and cfg.algo.head_only
    train = "head" if head_only else "lora" if m.lora.enabled else "full"
    adapters = policy.lora_params(m.lora.r, m.lora.target_modules) if train == "lora" else 0
    targets = tuple(policy.linear_shapes()) if m.lora.target_modules == "all-linear" else tuple(
        dict.fromkeys(t.rpartition(".")[2] for t in m.lora.target_modules))
    no_dropout = getattr(getattr(cfg, "algo", None), "disable_dropout", False)
    if no_dropout:  # `models.disable_dropout` zeroes the attention dropout too
        policy = dataclasses.replace(policy, attn_dropout=False)
    rewards = tuple(as_classifier(load(r, f"reward.model[{i}]"), f"reward.model[{i}]")
                    for i, r in enumerate(getattr(getattr(cfg, "reward", None), "model", ())))
    base = dict(stage=stage, policy=policy, head="score" if stage == "rm" else "lm", train=train,
                quantized=m.quantization.load_in_4bit, adapters=adapters, lora_rank=m.lora.r if train == "lora" else 0,
                lora_targets=targets, lora_dropout=train == "lora" and m.lora.dropout > 0 and not no_dropout, reference=None, reference_4bit=False,
                rewards=(), rewards_4bit=False, critic=None, accum=cfg.optim.grad_accum_steps, generation=None,
                checkpointing=m.gradient_checkpointing, attention=m.attn_implementation or policy.attention, entropy=False,
                optimizer_steps=1, micro_batches=cfg.optim.grad_accum_steps, release_reference=False, frozen=())
    mb, length = cfg.optim.per_device_batch_size, cfg.data.max_length
    if stage in ("sft", "rm", "orpo"):
        rows = mb * (2 if stage in ("rm", "orpo") else 1)
        return Layout(**{**base, "trained": Forward(rows, length, 0 if stage == "rm" else length, True),
                         "frozen_batches": 0})
    if stage in ("dpo", "kto"):
        return _offline_reference(stage, cfg, base, policy, load)
    if stage == "rft":
        return _rft(cfg, base, policy, rewards, load)
    return _online(stage, cfg, base, policy, rewards, load)


def _reference(cfg: Any, ref_model: str | None, policy: ModelShape, load: Loader) -> ModelShape | None:
    """A separate frozen reference: `ref_model`, else a copy of the policy under full fine-tuning; None with LoRA
    and no `ref_model` (the base with the adapters disabled)."""
    if ref_model is not None:
        return load(ref_model, "algo.ref_model")
    return None if cfg.model.lora.enabled else policy


def _offline_reference(stage: str, cfg: Any, base: dict, policy: ModelShape, load: Loader) -> Layout:
    a, mb, length = cfg.algo, cfg.optim.per_device_batch_size, cfg.data.max_length
    uses_reference = stage == "kto" or a.loss_type != "simpo"
    reference = _reference(cfg, a.ref_model, policy, load) if uses_reference else None
    rows, scored = 2 * mb if stage == "dpo" else mb, scored_length(cfg)
    frozen = [Forward(rows, length, scored, False, True)] if uses_reference else []
    if stage == "kto":  # z0: the mismatched pairs through the policy and the reference, without gradient
        frozen = frozen + [Forward(mb, length, scored, False, True)] * 2
    precompute = stage == "dpo" and a.precompute_ref_logprobs
    return Layout(**{**base, "reference": reference, "trained": Forward(rows, length, scored, True),
                     "frozen": () if precompute else tuple(frozen), "release_reference": precompute,
                     "frozen_batches": base["micro_batches"]})


def scored_length(cfg: Any) -> int:
    """The positions whose logits a batch of prompts and responses at the cap computes (DPO's and KTO's pairs, RFT's
    kept samples; not SFT's, whose text rows take the loss on every token): from the last token of its shortest prompt
    on (`models.scored_logits` keeps none before the first scored position), a prompt being no shorter than what
    the chat template renders around an empty one (`shape.shortest_prompt`), nor than max_prompt_length where that
    is shorter (longer prompts are cut to it). A GGUF model's tokenizer is not read: whole rows."""
    m = cfg.model
    floor = 0 if m.gguf_file else shortest_prompt(m.name_or_path, m.revision, m.chat_template)
    return cfg.data.max_length - max(0, min(floor, cfg.data.max_prompt_length) - 1)


def _rft(cfg: Any, base: dict, policy: ModelShape, rewards: tuple, load: Loader) -> Layout:
    g, mb = cfg.generation, cfg.optim.per_device_batch_size
    evaluates = bool(cfg.data.eval or cfg.data.eval_fraction or cfg.data.capability)
    reference = policy if evaluates and not cfg.model.lora.enabled else None
    gen = Generation(cfg.algo.sampling_batch_size * g.num_samples, cfg.data.max_prompt_length, g.max_new_tokens,
                     g.compile, g.top_p < 1, cfg.algo.sampling_batch_size)
    score = Forward(mb, cfg.data.max_prompt_length + g.max_new_tokens, 0, False)
    # An iteration samples its prompts in batches, then trains max_steps SFT steps (else num_epochs over the kept
    # best samples, at most one a prompt); without prompts_per_iteration (every prompt) one batch is assumed.
    per_iteration = cfg.algo.prompts_per_iteration or cfg.algo.sampling_batch_size
    sft_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(
        cfg.num_epochs * math.ceil(per_iteration / (mb * cfg.optim.grad_accum_steps)))
    share = math.ceil(per_iteration / cfg.algo.sampling_batch_size) / max(1, sft_steps)
    return Layout(**{**base, "reference": reference, "rewards": rewards, "rewards_4bit": cfg.reward.quantization.load_in_4bit,
                     "trained": Forward(mb, cfg.data.max_length, scored_length(cfg), True), "generation": gen,
                     "frozen": (score,) * len(rewards), "generations_per_step": share,
                     "frozen_batches": share * math.ceil(gen.rows / mb)})


def _online(stage: str, cfg: Any, base: dict, policy: ModelShape, rewards: tuple, load: Loader) -> Layout:
    """ppo, rloo, grpo, reinforce_pp and online_dpo: a generation phase, then the update."""
    from rlhfkit.algorithms import ALGORITHMS

    g, a, mb = cfg.generation, cfg.algo, cfg.optim.per_device_batch_size
    length = cfg.data.max_prompt_length + g.max_new_tokens
    # A rollout's forwards compute the logits of its response's positions only (`forwards.response_logits`), whatever
    # its prompts' lengths: B·R·V.
    logit_len = g.max_new_tokens
    rows = a.rollout_batch_size * g.num_samples
    tools = cfg.tools if cfg.tools.enabled else None
    gen = Generation(g.num_samples if g.seed_per_prompt else rows, cfg.data.max_prompt_length, g.max_new_tokens,
                     g.compile, g.top_p < 1, 1 if g.seed_per_prompt else a.rollout_batch_size,
                     rounds=(tools.max_calls or 1) if tools else 0,
                     result_len=min(tools.max_result_tokens, g.max_new_tokens) if tools else 0)
    score = Forward(mb, length, 0, False)
    if stage == "online_dpo":
        reference = _reference(cfg, a.ref_model, policy, load)
        trained = Forward(2 * mb, length, logit_len, True)
        return Layout(**{**base, "reference": reference, "rewards": rewards, "generation": gen, "trained": trained,
                         "rewards_4bit": cfg.reward.quantization.load_in_4bit, "micro_batches": max(1, rows // (2 * mb)),
                         "frozen_batches": max(1, rows // (2 * mb)),
                         "accum": max(1, rows // (2 * mb)),  # the step's pairs, mb at a time, one optimizer step
                         "frozen": (Forward(2 * mb, length, logit_len, False),)  # π_ref: while sampling
                         + (score,) * len(rewards)})
    algo = ALGORITHMS[a.algorithm]
    monitor = cfg.kl.monitor if cfg.kl.monitor is not None else cfg.model.lora.enabled
    reference = _reference(cfg, None, policy, load) if algo.needs_reference or monitor else None
    critic = None
    adapters = base["adapters"]
    if algo.needs_value and cfg.model.lora.enabled and not a.value_model:
        adapters += adapters + policy.hidden + 1  # a second adapter and the value head on the policy's base
    elif algo.needs_value:
        critic = as_classifier(load(a.value_model, "algo.value_model"), "algo.value_model") if a.value_model else \
            rewards[0] if rewards else as_classifier(policy, "model.name_or_path (the critic starts from it)")
    logprobs = Forward(mb, length, logit_len, False)
    frozen = [logprobs] * (1 + (reference is not None or monitor))  # π_old, π_ref
    frozen += [score] * (len(rewards) + (critic is not None or algo.needs_value))
    steps = a.ppo_epochs * a.num_minibatches
    value_adapter = algo.needs_value and cfg.model.lora.enabled and not a.value_model
    return Layout(**{**base, "pi_old": _pi_old(cfg, algo), "value_adapter": value_adapter, "reference": reference, "rewards": rewards, "rewards_4bit": cfg.reward.quantization.load_in_4bit,
                     "critic": critic, "adapters": adapters, "generation": gen, "entropy": a.entropy_coef > 0,
                     "trained": Forward(mb, length, logit_len, True), "frozen": tuple(frozen),
                     "optimizer_steps": steps, "accum": max(1, rows // a.num_minibatches // mb),
                     "micro_batches": a.ppo_epochs * max(1, rows // mb), "frozen_batches": max(1, rows // mb)})


def _pi_old(cfg: Any, algo: Any) -> str:
    """`trainers.experience.old_logprob_source` resolved from the config alone (the precision is the device's)."""
    a = cfg.algo
    if a.old_logprob_source == "recompute":
        return "recompute"
    if a.ppo_epochs * a.num_minibatches == 1 and not algo.kl_in_reward or a.old_logprob_source == "sampler":
        return "free"
    exact = (cfg.generation.engine == "rlhfkit" and not cfg.model.quantization.load_in_4bit
             and not cfg.tools.functions and cfg.tools.environment is None)
    return "free_in_fp32" if exact and getattr(a, "rollout_correction", "none") == "none" else "recompute"


def with_changes(cfg: Any, changes: dict[str, Any]) -> Any:
    """`cfg` with dotted keys replaced ({"model.lora.enabled": True}), not validated again: the planner's what-ifs."""
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        cfg = dataclasses.replace(cfg, **{head: with_changes(getattr(cfg, head), {rest: value}) if rest else value})
    return cfg
