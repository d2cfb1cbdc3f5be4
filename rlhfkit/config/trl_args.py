"""TRL's config objects as rlhfkit config keys: `rlhfkit.train(stage, args=GRPOConfig(...))`.

Every field of TRL 1.16's GRPOConfig, RLOOConfig, DPOConfig, KTOConfig, RewardConfig and SFTConfig (TrainingArguments'
included) is named here once, as data: `Key` (its value becomes one rlhfkit key, always: a TRL default that differs
from rlhfkit's is TRL's here), `Rule` (read with other fields by one of the stage's rule functions, which set the keys it
names), `Refused` (allowed only at TRL's default, else refused in one line saying why) or `Inert` (TRL itself ignores
it in every setting rlhfkit accepts, e.g. the vLLM knobs without `use_vllm`). `table_page()` renders the tables into
docs/reference/trl-args.md (`python -m rlhfkit.config.trl_args`); tests/unit/test_trl_args.py fails when TRL's config
gains a field that is in none of them.

Imports trl only inside functions (the tables are plain data).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhfkit.config.trl_rules import RULES, whole as _whole
from rlhfkit.errors import UserError


@dataclass(frozen=True)
class Key:
    key: str  # the rlhfkit key the value becomes
    convert: Callable[[Any], Any] | None = None
    note: str = ""


@dataclass(frozen=True)
class Rule:
    keys: str  # the rlhfkit keys the rule sets (for the table)
    note: str = ""


@dataclass(frozen=True)
class Refused:
    why: str


@dataclass(frozen=True)
class Inert:
    why: str


def _refused(why: str, *names: str) -> dict[str, Refused]:
    return {name: Refused(why) for name in names}


# TrainingArguments (transformers 5), for every stage ------------------------------------------------------------
TRAINING_ARGUMENTS: dict[str, Key | Rule | Refused | Inert] = {
    "output_dir": Key("output_dir"),
    "learning_rate": Key("optim.lr"),
    "weight_decay": Key("optim.weight_decay"),
    "adam_beta1": Rule("optim.adam_betas"), "adam_beta2": Rule("optim.adam_betas"),
    "adam_epsilon": Key("optim.adam_eps"),
    "max_grad_norm": Key("optim.max_grad_norm", lambda v: v or None, "0 turns clipping off (null)"),
    "lr_scheduler_type": Rule("optim.scheduler", "linear, cosine, constant (no warmup), constant_with_warmup"),
    "warmup_steps": Rule("optim.warmup_steps / optim.warmup_ratio", "a value below 1 is a ratio (transformers 5)"),
    "per_device_train_batch_size": Rule("optim.per_device_batch_size (online: see the batch layout)"),
    "gradient_accumulation_steps": Rule("optim.grad_accum_steps (online: see the batch layout)"),
    "max_steps": Rule("max_steps", "online stages: optimizer steps become rollouts (see the batch layout)"),
    "num_train_epochs": Key("num_epochs"),
    "seed": Key("seed"),
    "bf16": Rule("mixed_precision"), "fp16": Rule("mixed_precision"),
    "use_cpu": Rule("(none)", "accepted where there is no accelerator; refused on a machine that has one"),
    "gradient_checkpointing": Rule("model.gradient_checkpointing"),
    "activation_checkpointing": Rule("model.gradient_checkpointing", "transformers 5's name for the same"),
    "logging_steps": Key("logging.logging_steps", lambda v: _whole(v, "logging_steps")),
    "logging_strategy": Rule("logging.logging_steps", "steps only"),
    "save_strategy": Rule("logging.save_steps", "steps (every save_steps) or no (0)"), "save_steps": Rule("logging.save_steps"),
    "save_total_limit": Rule("logging.save_total_limit", "null (keep all) keeps rlhfkit's 2"),
    "eval_strategy": Rule("logging.eval_steps", "steps (every eval_steps, else logging_steps) or no (0)"),
    "eval_steps": Rule("logging.eval_steps"),
    "report_to": Rule("logging.report_to", "tensorboard, wandb, trackio"),
    "run_name": Key("logging.run_name"),
    "project": Rule("logging.project", "transformers' default 'huggingface' leaves rlhfkit's choice"),
    "push_to_hub": Key("logging.push_to_hub"), "hub_model_id": Key("logging.hub_model_id"),
    "hub_strategy": Rule("logging.hub_strategy", "end, checkpoint, all_checkpoints (every_save: refused)"),
    "metric_for_best_model": Key("logging.metric_for_best_model"), "greater_is_better": Key("logging.greater_is_better"),
    "disable_tqdm": Key("logging.progress_bar", lambda v: not v),
    "optim": Rule("(none)", "AdamW only: adamw_torch or adamw_torch_fused"),
    **_refused("a schedule's own arguments: rlhfkit's schedules take none", "lr_scheduler_kwargs"),
    **_refused("rlhfkit trains with AdamW (torch) only", "optim_args", "optim_target_modules"),
    **_refused("rlhfkit seeds the data order with `seed`", "data_seed", "full_determinism"),
    **_refused("rlhfkit reads tokenized rows without a DataLoader", "dataloader_drop_last", "dataloader_num_workers",
               "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
               "dataloader_multiprocessing_context", "dataloader_in_order", "remove_unused_columns", "label_names",
               "train_sampling_strategy", "length_column_name", "average_tokens_across_devices"),
    **_refused("rlhfkit's evaluation takes no such setting", "per_device_eval_batch_size", "eval_delay",
               "prediction_loss_only", "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object",
               "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics", "bf16_full_eval",
               "fp16_full_eval", "do_train", "do_eval", "do_predict", "load_best_model_at_end"),
    **_refused("launch with accelerate or torchrun and an accelerate config (docs/distributed.md)", "ddp_backend",
               "ddp_broadcast_buffers", "ddp_bucket_cap_mb", "ddp_find_unused_parameters", "ddp_static_graph",
               "ddp_timeout", "fsdp", "fsdp_config", "deepspeed", "accelerator_config", "parallelism_config",
               "local_rank", "save_on_each_node", "log_on_each_node"),
    **_refused("not supported by rlhfkit", "label_smoothing_factor", "neftune_noise_alpha", "tf32", "torch_compile",
               "torch_compile_backend", "torch_compile_mode", "use_liger_kernel", "liger_kernel_config",
               "torch_empty_cache_steps", "auto_find_batch_size", "gradient_checkpointing_kwargs",
               "activation_checkpointing_kwargs", "logging_first_step", "logging_nan_inf_filter",
               "include_num_input_tokens_seen", "log_level", "log_level_replica", "skip_memory_metrics", "debug",
               "save_only_model", "enable_jit_checkpoint", "restore_callback_states_from_checkpoint",
               "ignore_data_skip", "use_cache", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision",
               "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
    **_refused("resume with overrides={'resume': True} (rlhfkit resumes from output_dir's newest checkpoint)",
               "resume_from_checkpoint"),
}

# The fields TRL's own configs add, shared by several -------------------------------------------------------------
TRL_COMMON: dict[str, Key | Rule | Refused | Inert] = {
    "model_init_kwargs": Rule("model.dtype, model.attn_implementation", "those two keys only"),
    "trust_remote_code": Key("model.trust_remote_code"),
    **_refused("mixture-of-experts auxiliary loss: not supported by rlhfkit", "router_aux_loss_coef"),
    **_refused("not supported by rlhfkit", "activation_offloading", "pad_to_multiple_of", "dataset_num_proc",
               "pad_token", "eos_token", "precompute_ref_batch_size", "cast_lm_head_to_fp32"),
    "chat_template_path": Key("model.chat_template"),
    "max_length": Rule("data.max_length (data.max_prompt_length kept below it)"),
}

ONLINE: dict[str, Key | Rule | Refused | Inert] = {
    "disable_dropout": Key("algo.disable_dropout"),
    "num_generations": Key("generation.num_samples"),
    "max_completion_length": Key("generation.max_new_tokens"),
    "generation_batch_size": Rule("algo.rollout_batch_size", "the batch layout"),
    "steps_per_generation": Rule("algo.num_minibatches", "the batch layout"),
    "num_iterations": Key("algo.ppo_epochs"),
    "temperature": Key("generation.temperature"), "top_p": Key("generation.top_p"),
    "top_k": Key("generation.top_k", lambda v: v or 0),
    "beta": Rule("kl.coef, algo.algorithm", "beta 0: no KL term and no reference model"),
    "epsilon": Key("algo.clip_eps"), "epsilon_high": Rule("algo.clip_eps_high (cispo: algo.ratio_cap)"),
    "reward_weights": Rule("reward.weights", "as rlhfkit.train's reward_weights"),
    "mask_truncated_completions": Key("algo.mask_truncated"),
    "sync_ref_model": Key("algo.sync_ref_model"), "ref_model_mixup_alpha": Key("algo.ref_model_mixup_alpha"),
    "ref_model_sync_steps": Key("algo.ref_model_sync_steps"),
    **_refused("one generation setting per run: rlhfkit evaluates with the training's", "num_generations_eval"),
    "generation_kwargs": Rule("generation.stop_strings", "its stop_strings (transformers' name) or stop (vLLM's) only"),
    **_refused("rlhfkit samples with its own decode loop (generation.engine)", "use_vllm",
               "cache_implementation", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
               "use_transformers_paged", "ds3_gather_for_generation", "min_p", "repetition_penalty",
               "chat_template_kwargs"),
    **_refused("rlhfkit draws prompts in a seeded random order", "shuffle_dataset"),
    "log_completions": Inert("rlhfkit always writes sample generations (logging.sample_log_steps)"),
    "num_completions_to_print": Inert("console output only"), "log_unique_prompts": Inert("console output only"),
    "log_multimodal": Inert("rlhfkit trains text models"),
    **{name: Inert("TRL reads it only with use_vllm=True, which rlhfkit refuses") for name in (
        "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex", "vllm_server_base_url",
        "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
        "vllm_max_model_length", "vllm_tensor_parallel_size", "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap")},
}

GRPO: dict[str, Key | Rule | Refused | Inert] = {
    "loss_type": Rule("algo.policy_loss, algo.loss_agg", "every TRL 1.16 loss type (see below)"),
    "importance_sampling_level": Rule("algo.importance_sampling_level, algo.policy_loss"),
    "delta": Rule("algo.delta", "grpo, dapo, bnpo, dr_grpo, luspo (TRL applies it to those only)"),
    "sapo_temperature_neg": Key("algo.sapo_temperature_neg"), "sapo_temperature_pos": Key("algo.sapo_temperature_pos"),
    "vespo_k_pos": Key("algo.vespo_k_pos"), "vespo_lambda_pos": Key("algo.vespo_lambda_pos"),
    "vespo_k_neg": Key("algo.vespo_k_neg"), "vespo_lambda_neg": Key("algo.vespo_lambda_neg"),
    "multi_objective_aggregation": Key("algo.multi_objective_aggregation"),
    "scale_rewards": Rule("algo.scale_rewards"),
    "top_entropy_quantile": Key("algo.top_entropy_quantile"), "entropy_coef": Key("algo.entropy_coef"),
    "use_adaptive_entropy": Key("algo.adaptive_entropy"), "entropy_coef_min": Key("algo.entropy_coef_min"),
    "entropy_coef_max": Key("algo.entropy_coef_max"), "entropy_coef_delta": Key("algo.entropy_coef_delta"),
    "entropy_target": Key("algo.entropy_target"),
    "max_tool_calling_iterations": Key("tools.max_calls"),
    "off_policy_mask_threshold": Key("algo.off_policy_mask_threshold"),
    "use_bias_correction_kl": Rule("algo.bias_corrected_kl", "read only when beta != 0, as TRL"),
    **_refused("not supported by rlhfkit", "log_completions_hub_repo"),
}

RLOO: dict[str, Key | Rule | Refused | Inert] = {
    **_refused("TRL whitens each sequence's advantage, rlhfkit's algo.whiten_advantages every token's: not the same",
               "normalize_advantages"),
    "reward_clip_range": Rule("reward.clip", "symmetric ranges (-c, c) only"),
    "epsilon": Key("algo.clip_eps", note="TRL clips one ratio per sequence, rlhfkit per token (algo.loss_agg "
                   "seq-mean-token-sum: the same gradient on-policy)"),
}

PREFERENCE_REF: dict[str, Key | Rule | Refused | Inert] = {
    "beta": Key("algo.beta"),
    "precompute_ref_log_probs": Key("algo.precompute_ref_logprobs"),
}

DPO: dict[str, Key | Rule | Refused | Inert] = {
    **PREFERENCE_REF,
    "loss_type": Rule("algo.loss_type", "one of sigmoid, ipo, hinge"),
    "label_smoothing": Key("algo.label_smoothing"),
    "padding_free": Key("data.padding_free"),
    "disable_dropout": Key("algo.disable_dropout"),
    "sync_ref_model": Key("algo.sync_ref_model"), "ref_model_mixup_alpha": Key("algo.ref_model_mixup_alpha"),
    "ref_model_sync_steps": Key("algo.ref_model_sync_steps"),
    **_refused("rlhfkit truncates the prompt's start (data.truncation)", "truncation_mode"),
    **_refused("not supported by rlhfkit's DPO", "loss_weights", "ld_alpha", "f_divergence_type",
               "f_alpha_divergence_coef", "use_weighting", "discopop_tau"),
}

KTO: dict[str, Key | Rule | Refused | Inert] = {
    "beta": Key("algo.beta"), "desirable_weight": Key("algo.desirable_weight"),
    "undesirable_weight": Key("algo.undesirable_weight"),
    **_refused("only loss_type 'kto' is supported by rlhfkit", "loss_type"),
    **_refused("not supported by rlhfkit's KTO", "precompute_ref_log_probs", "sync_ref_model", "ref_model_mixup_alpha",
               "ref_model_sync_steps"),
    "disable_dropout": Key("algo.disable_dropout"),
}

REWARD: dict[str, Key | Rule | Refused | Inert] = {
    "center_rewards_coefficient": Key("algo.center_coef", lambda v: v or 0.0),
    "disable_dropout": Key("algo.disable_dropout"),
}

SFT: dict[str, Key | Rule | Refused | Inert] = {
    "dataset_text_field": Rule("data.columns.text", "a field other than 'text' is read as the text"),
    "packing": Key("data.packing"), "padding_free": Key("data.padding_free"),
    "completion_only_loss": Rule("algo.completion_only", "null: TRL's automatic choice, rlhfkit's default (true)"),
    "assistant_only_loss": Rule("algo.completion_only", "true: the assistant's tokens, rlhfkit's completion_only"),
    **_refused("only loss_type 'nll' is supported by rlhfkit", "loss_type"),
    **_refused("rlhfkit packs by concatenation (data.packing)", "packing_strategy", "eval_packing"),
    **_refused("rlhfkit truncates the sequence's end (data.max_length)", "truncation_mode"),
    **_refused("rlhfkit reads datasets in its own formats", "dataset_kwargs", "shuffle_dataset"),
}

# TRL config class -> (stage, the tables its fields are in)
CLASSES = {
    "GRPOConfig": ("grpo", (TRAINING_ARGUMENTS, TRL_COMMON, ONLINE, GRPO)),
    "RLOOConfig": ("rloo", (TRAINING_ARGUMENTS, TRL_COMMON, ONLINE, RLOO)),
    "DPOConfig": ("dpo", (TRAINING_ARGUMENTS, TRL_COMMON, DPO)),
    "KTOConfig": ("kto", (TRAINING_ARGUMENTS, TRL_COMMON, KTO)),
    "RewardConfig": ("rm", (TRAINING_ARGUMENTS, TRL_COMMON, REWARD)),
    "SFTConfig": ("sft", (TRAINING_ARGUMENTS, TRL_COMMON, SFT)),
}


def rule_of(class_name: str, field: str):
    """The rule of `field` of TRL's `class_name`: the last table that names it (a stage's own table first)."""
    for table in reversed(CLASSES[class_name][1]):
        if field in table:
            return table[field]
    return None


def trl_config_keys(stage: str, args) -> dict:
    """The rlhfkit config keys (a nested dict) of TRL config object `args` for `stage`; a field rlhfkit cannot honour
    is refused in one line naming it."""
    name = type(args).__name__
    if name not in CLASSES or not dataclasses.is_dataclass(args):
        raise UserError(f"args: expected one of TRL's {', '.join(CLASSES)}, got {name}")
    if CLASSES[name][0] != stage:
        takes = next((c for c, (s, _) in CLASSES.items() if s == stage), None)
        raise UserError(f"args: `rlhfkit {stage}` takes " + (f"a {takes}" if takes else "no TRL config object")
                        + f", got a {name}")
    default = _default_of(args)
    keys: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        value, rule = getattr(args, f.name), rule_of(name, f.name)
        differs = value != getattr(default, f.name)
        if rule is None and differs:
            raise UserError(f"args.{f.name}: a {name} field rlhfkit does not know; leave it at TRL's default")
        if isinstance(rule, Refused) and differs:
            raise UserError(f"args.{f.name}={value!r}: {rule.why}")
        if isinstance(rule, Key):
            keys[rule.key] = rule.convert(value) if rule.convert else value
    for rule_fn in RULES[stage]:
        keys.update(rule_fn(args))
    return _nested(keys)


_DEFAULTS: dict[tuple, Any] = {}


def _default_of(args):
    """TRL's defaults as its `__post_init__` leaves them for the device `args` chose (`use_cpu`, `bf16`, `fp16`: some
    defaults, such as `dataloader_pin_memory`, follow the device)."""
    device = (type(args), args.use_cpu, args.bf16, args.fp16)
    if device not in _DEFAULTS:
        _DEFAULTS[device] = type(args)(output_dir="trl-defaults", use_cpu=args.use_cpu, bf16=args.bf16, fp16=args.fp16)
    return _DEFAULTS[device]


def _nested(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for dotted, value in flat.items():
        *parents, leaf = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _cell(rule) -> tuple[str, str]:
    if isinstance(rule, Key):
        return f"`{rule.key}`", rule.note
    if isinstance(rule, Rule):
        return rule.keys, rule.note
    if isinstance(rule, Refused):
        return "refused unless at TRL's default", rule.why
    return "no effect", rule.why


def _rows(fields: list[str], class_name: str) -> list[str]:
    lines = ["| TRL field | rlhfkit | note |", "|---|---|---|"]
    for name in fields:
        keys, note = _cell(rule_of(class_name, name))
        lines.append(f"| `{name}` | {keys} | {note.replace('|', '/')} |")
    return lines


def table_page() -> str:
    """The docs page: TrainingArguments' fields, then each TRL config's own, with the rlhfkit key each becomes."""
    import trl
    from transformers import TrainingArguments

    base = [f.name for f in dataclasses.fields(TrainingArguments)]
    lines = ["# TRL config fields", "",
             f"<!-- Generated from rlhfkit/config/trl_args.py by `{COMMAND}`: edit the tables, not this page. -->", "",
             f"`rlhfkit.train(stage, args=...)` takes TRL {trl.__version__}'s config objects ([Python API]"
             "(../python-api.md)). Each field becomes the rlhfkit key named here, always (TRL's "
             "defaults are TRL's, not rlhfkit's); a field marked *refused* must keep TRL's default, or the run is "
             "refused in one line naming it; *no effect* fields are ones TRL itself ignores in every setting "
             "rlhfkit accepts. `overrides` apply on top. Keys: [config reference](config.md).", "",
             "## TrainingArguments (every config)", "", *_rows(sorted(base), "GRPOConfig")]
    for class_name, (stage, _) in CLASSES.items():
        own = sorted(f.name for f in dataclasses.fields(getattr(trl, class_name)) if f.name not in base)
        lines += ["", f"## {class_name} (`rlhfkit.train(\"{stage}\", args=...)`)", "", *_rows(own, class_name)]
    return "\n".join(lines) + "\n"


PAGE = os.path.join("docs", "reference", "trl-args.md")
COMMAND = "python -m rlhfkit.config.trl_args"


def main(argv: list[str] | None = None) -> int:
    """Write the TRL field table page (default) or, with `--check`, exit 1 when the committed one differs."""
    from rlhfkit.config.reference import write_page

    return write_page(PAGE, table_page(), COMMAND, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
