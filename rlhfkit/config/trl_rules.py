"""The rules of `config.trl_args` that read several TRL fields at once, one function per concern, each returning the
rlhfkit keys it sets (dotted) or refusing in one line naming the field: precision, schedule, logging, the model's
loading, the batch layout (offline, and online where TRL counts completions per device and optimizer steps while
rlhfkit counts prompts per process and rollouts), and GRPO's objective."""

from __future__ import annotations

import json
from typing import Any

from rlhfkit.errors import UserError

Keys = dict[str, Any]


def whole(value, name: str) -> int:
    """A step count TRL allows as a ratio (< 1) or a float, as rlhfkit's whole number of steps."""
    if value < 1 or value != int(value):
        raise UserError(f"args.{name}={value}: rlhfkit counts it in whole steps (a ratio below 1 is not supported)")
    return int(value)


def _refuse(name: str, value, why: str):
    raise UserError(f"args.{name}={value!r}: {why}")


def precision(args) -> Keys:
    """bf16 / fp16 -> mixed_precision; use_cpu; gradient (activation) checkpointing."""
    import torch

    if args.bf16 and args.fp16:
        _refuse("fp16", True, "and bf16=True are exclusive")
    if args.use_cpu and torch.cuda.is_available():
        _refuse("use_cpu", True, "rlhfkit runs on the accelerator accelerate finds: hide it (CUDA_VISIBLE_DEVICES=) "
                "to train on the CPU")
    return {"mixed_precision": "bf16" if args.bf16 else "fp16" if args.fp16 else "no",
            "model.gradient_checkpointing": bool(args.gradient_checkpointing or args.activation_checkpointing)}


def schedule(args) -> Keys:
    """AdamW's betas, the schedule and its warmup (transformers 5: warmup_steps below 1 is a ratio)."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ("adamw_torch", "adamw_torch_fused"):
        _refuse("optim", optim, "rlhfkit trains with torch's AdamW (adamw_torch, adamw_torch_fused)")
    kind = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    warmup = args.warmup_steps or 0
    schedules = {"linear": "linear", "cosine": "cosine", "constant_with_warmup": "constant", "constant": "constant"}
    if kind not in schedules:
        _refuse("lr_scheduler_type", kind, "rlhfkit's schedules are linear, cosine, constant and constant_with_warmup")
    if kind == "constant" and warmup:
        _refuse("warmup_steps", warmup, "lr_scheduler_type='constant' ignores warmup in transformers: use "
                "constant_with_warmup, or no warmup")
    keys: Keys = {"optim.scheduler": schedules[kind], "optim.adam_betas": [args.adam_beta1, args.adam_beta2]}
    if 0 < warmup < 1:
        keys.update({"optim.warmup_ratio": float(warmup), "optim.warmup_steps": 0})
    else:
        keys.update({"optim.warmup_steps": whole(warmup, "warmup_steps") if warmup else 0, "optim.warmup_ratio": 0.0})
    return keys


def _strategy(value) -> str:
    return str(getattr(value, "value", value))


def logging(args) -> Keys:
    """Logging, saving and evaluation intervals, trackers, the hub."""
    if _strategy(args.logging_strategy) != "steps":
        _refuse("logging_strategy", _strategy(args.logging_strategy), "rlhfkit logs every logging_steps steps")
    save = _strategy(args.save_strategy)
    if save not in ("steps", "no"):
        _refuse("save_strategy", save, "rlhfkit saves every save_steps steps, or not at all ('no')")
    evaluate = _strategy(args.eval_strategy)
    if evaluate not in ("steps", "no"):
        _refuse("eval_strategy", evaluate, "rlhfkit evaluates every eval_steps steps, or only at the end ('no')")
    report = [r for r in (args.report_to or []) if r != "none"]
    if unknown := [r for r in report if r not in ("tensorboard", "wandb", "trackio")]:
        _refuse("report_to", unknown, "rlhfkit's trackers are tensorboard, wandb and trackio")
    hub = _strategy(args.hub_strategy)
    if hub == "every_save" and args.push_to_hub:
        _refuse("hub_strategy", hub, "rlhfkit pushes at the end, or the checkpoints too (checkpoint, all_checkpoints)")
    keys: Keys = {"logging.save_steps": whole(args.save_steps, "save_steps") if save == "steps" else 0,
                  "logging.eval_steps": whole(args.eval_steps or args.logging_steps, "eval_steps")
                  if evaluate == "steps" else 0,
                  "logging.report_to": report}
    if args.save_total_limit is not None:
        keys["logging.save_total_limit"] = args.save_total_limit
    if args.project != "huggingface":
        keys["logging.project"] = args.project
    if hub != "every_save":
        keys["logging.hub_strategy"] = hub
    return keys


def model_loading(args) -> Keys:
    """model_init_kwargs: dtype and attn_implementation only."""
    kwargs = dict(args.model_init_kwargs or {})
    keys: Keys = {}
    if "dtype" in kwargs or "torch_dtype" in kwargs:
        dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype")
        keys["model.dtype"] = str(dtype).removeprefix("torch.")
    if "attn_implementation" in kwargs:
        keys["model.attn_implementation"] = kwargs.pop("attn_implementation")
    if kwargs:
        _refuse("model_init_kwargs", sorted(kwargs), "rlhfkit maps dtype and attn_implementation only")
    return keys


def max_length(args) -> Keys:
    """data.max_length, and data.max_prompt_length kept below it (rlhfkit's own default 512 when it fits)."""
    if args.max_length is None:
        _refuse("max_length", None, "rlhfkit needs a length limit (data.max_length)")
    return {"data.max_length": args.max_length, "data.max_prompt_length": min(512, args.max_length // 2)}


def offline_batch(args) -> Keys:
    return {"optim.per_device_batch_size": args.per_device_train_batch_size,
            "optim.grad_accum_steps": args.gradient_accumulation_steps, "max_steps": args.max_steps}


def online_batch(args) -> Keys:
    """TRL generates `generation_batch_size` completions (all processes) every `steps_per_generation` micro-batches of
    `per_device_train_batch_size`, and takes an optimizer step every `gradient_accumulation_steps` of them, reusing a
    generation `num_iterations` times; `max_steps` counts optimizer steps. rlhfkit samples `rollout_batch_size`
    prompts per process per step, makes `num_minibatches` optimizer steps per pass over them, `ppo_epochs` passes;
    `max_steps` counts rollouts. The same run, when the counts divide."""
    k, micro, accum = args.num_generations, args.per_device_train_batch_size, args.gradient_accumulation_steps
    per_process = args.generation_batch_size // max(args.world_size, 1)  # completions per generation on a process
    if per_process % k:
        _refuse("generation_batch_size", args.generation_batch_size, f"rlhfkit keeps a prompt's samples on one process: "
                f"each process's share ({per_process} completions) must be a multiple of num_generations ({k})")
    if args.steps_per_generation % accum:
        _refuse("steps_per_generation", args.steps_per_generation, "must be a multiple of gradient_accumulation_steps "
                f"({accum}): rlhfkit steps the optimizer on whole minibatches of a rollout")
    minibatches = args.steps_per_generation // accum
    keys: Keys = {"algo.rollout_batch_size": per_process // k, "algo.num_minibatches": minibatches,
                  "optim.per_device_batch_size": micro, "optim.grad_accum_steps": 1}
    if args.max_steps > 0:
        per_rollout = minibatches * args.num_iterations  # optimizer steps per rollout
        if args.max_steps % per_rollout:
            _refuse("max_steps", args.max_steps, f"rlhfkit counts rollouts: max_steps must be a multiple of the "
                    f"{per_rollout} optimizer steps each generation makes")
        keys["max_steps"] = args.max_steps // per_rollout
    else:
        keys["max_steps"] = -1
    return keys


# GRPO's loss types: (rlhfkit's objective at token level, at sequence level, the loss reduction TRL applies)
LOSS_TYPES = {
    "grpo": ("ppo_clip", "gspo", "seq-mean-token-mean"), "dapo": ("ppo_clip", "gspo", "token-mean"),
    "bnpo": ("ppo_clip", "gspo", "token-mean"), "dr_grpo": ("ppo_clip", "gspo", "seq-mean-token-sum-norm"),
    "cispo": ("cispo", "cispo", "token-mean"), "sapo": ("sapo", "sapo", "seq-mean-token-mean"),
    "luspo": ("luspo", "luspo", "seq-mean-token-sum"), "vespo": ("vespo", "vespo", "token-mean"),
}
CLIPPED = ("grpo", "dapo", "bnpo", "dr_grpo", "luspo")  # TRL's clipped-ratio losses (epsilon, epsilon_high, delta)


def grpo_objective(args) -> Keys:
    """loss_type × importance_sampling_level -> the objective, its level and reduction; beta -> the algorithm."""
    loss, level = args.loss_type, args.importance_sampling_level
    if loss not in LOSS_TYPES:
        _refuse("loss_type", loss, f"TRL 1.16's loss types are {', '.join(LOSS_TYPES)}")
    token_form, sequence_form, agg = LOSS_TYPES[loss]
    keys: Keys = {"algo.algorithm": "grpo" if args.beta else "dapo", "kl.coef": args.beta, "algo.loss_agg": agg,
                  "algo.policy_loss": sequence_form if level == "sequence" else token_form,
                  "algo.importance_sampling_level": level, "algo.scale_rewards": args.scale_rewards}
    if loss == "vespo" and level == "sequence":
        if args.beta and args.use_bias_correction_kl:
            _refuse("importance_sampling_level", level, "with loss_type='vespo', TRL's sequence level changes only the "
                    "bias-corrected KL's weight, which rlhfkit computes per token: use 'token'")
        keys["algo.importance_sampling_level"] = "token"  # TRL's vespo weighs sequences itself: the level is unused
    if args.delta is not None and loss not in CLIPPED:
        _refuse("delta", args.delta, f"TRL applies it to the clipped losses ({', '.join(CLIPPED)}) only")
    keys["algo.delta"] = args.delta
    if loss == "cispo":  # TRL caps CISPO's importance weight at epsilon_high (epsilon when unset)
        keys["algo.ratio_cap"] = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    elif loss in CLIPPED:
        keys["algo.clip_eps_high"] = args.epsilon_high
    if args.beta:
        keys["algo.bias_corrected_kl"] = bool(args.use_bias_correction_kl)
    return keys


def rloo_objective(args) -> Keys:
    """RLOO: the leave-one-out baseline with the KL in the reward (β = beta); reward_clip_range. TRL's RLOO clips one
    ratio per sequence, exp(Σ_t log r_t), and averages over sequences; rlhfkit's clips per token, summed over each
    sequence's tokens and averaged over sequences (seq-mean-token-sum): the same gradient wherever the ratio is 1
    (every update of a rollout read once, TRL's default num_iterations=1), clipped differently off-policy, which is
    therefore refused."""
    # Off-policy (a generation read by more than one optimizer step) the two objectives differ: refused, not approximated.
    why = "TRL's RLOO clips one ratio per sequence off-policy, rlhfkit's one per token: keep every update on-policy"
    if args.num_iterations > 1:
        _refuse("num_iterations", args.num_iterations, f"{why} (num_iterations=1)")
    if args.steps_per_generation > args.gradient_accumulation_steps:
        _refuse("steps_per_generation", args.steps_per_generation,
                f"{why} (steps_per_generation = gradient_accumulation_steps, one optimizer step a generation)")
    keys: Keys = {"algo.algorithm": "rloo", "kl.coef": args.beta, "algo.clip_eps_high": args.epsilon_high,
                  "algo.loss_agg": "seq-mean-token-sum"}
    if args.reward_clip_range is not None:
        low, high = args.reward_clip_range
        if low != -high:
            _refuse("reward_clip_range", args.reward_clip_range, "rlhfkit clips symmetrically (reward.clip: (-c, c))")
        keys["reward.clip"] = high
    return keys


def dpo_loss(args) -> Keys:
    types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
    if len(types) != 1 or types[0] not in ("sigmoid", "ipo", "hinge"):
        _refuse("loss_type", args.loss_type, "rlhfkit's DPO takes one of sigmoid, ipo, hinge (SimPO: algo.loss_type)")
    return {"algo.loss_type": types[0]}


def sft_data(args) -> Keys:
    keys: Keys = {}
    if args.dataset_text_field != "text":
        keys["data.columns.text"] = args.dataset_text_field
    if args.completion_only_loss is False and not args.assistant_only_loss:
        keys["algo.completion_only"] = False
    return keys


def generation_kwargs(args) -> Keys:
    """generation_kwargs: its stop strings only, under transformers' name (`stop_strings`) or vLLM's (`stop`)."""
    kwargs = args.generation_kwargs or {}
    kwargs = dict(json.loads(kwargs) if isinstance(kwargs, str) else kwargs)
    stops = [kwargs.pop(name) for name in ("stop_strings", "stop") if name in kwargs]
    if kwargs:
        _refuse("generation_kwargs", sorted(kwargs), "rlhfkit samples with its own decode loop and maps stop_strings "
                "(or vLLM's stop) only; see generation.* for the rest")
    strings = [s for value in stops for s in ([value] if isinstance(value, str) else value or [])]
    return {"generation.stop_strings": strings} if strings else {}


COMMON = (precision, schedule, logging, model_loading)
RULES = {
    "grpo": (*COMMON, online_batch, grpo_objective, generation_kwargs),
    "rloo": (*COMMON, online_batch, rloo_objective, generation_kwargs),
    "dpo": (*COMMON, max_length, offline_batch, dpo_loss),
    "kto": (*COMMON, max_length, offline_batch),
    "rm": (*COMMON, max_length, offline_batch),
    "sft": (*COMMON, max_length, offline_batch, sft_data),
}
