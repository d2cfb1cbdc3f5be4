"""The Hugging Face hub side of a run: the model card every final model directory gets, and the push of the final
model (and, when asked, its checkpoints) through `huggingface_hub`.

The card is written with `huggingface_hub.ModelCard`: YAML metadata (`base_model`, `library_name: rlhfkit`, tags for
the method, `datasets` where the data came from the hub) and a body with the method, the key config, the final
metrics and the evaluation figures. A reward model's card, and its config.json (`rlhfkit_score`), also say in one
line how its score is read, since transformers' own forward reads it elsewhere (see `score_reading`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from rlhfkit.config.fields import lookup
from rlhfkit.errors import UserError, first_line

# The method each stage (and each online algorithm) trains with, as the card names it.
METHODS = {
    "sft": "supervised fine-tuning (SFT)",
    "rm": "a reward model: Bradley-Terry loss on chosen/rejected pairs",
    "dpo": "DPO, Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290)",
    "orpo": "ORPO, odds-ratio preference optimization (Hong et al. 2024, arXiv 2403.07691)",
    "kto": "KTO, Kahneman-Tversky optimization (Ethayarajh et al. 2024, arXiv 2402.01306)",
    "rft": "rejection-sampling fine-tuning: best-of-n samples by reward, then SFT on them",
    "ppo": "PPO with a learned critic and GAE (Schulman et al. 2017, arXiv 1707.06347)",
    "rloo": "RLOO, REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740)",
    "grpo": "GRPO, group relative policy optimization (Shao et al. 2024, arXiv 2402.03300)",
    "dr_grpo": "Dr. GRPO (Liu et al. 2025, arXiv 2503.20783)",
    "dapo": "DAPO (Yu et al. 2025, arXiv 2503.14476)",
    "reinforce_pp": "REINFORCE++ (Hu 2025, arXiv 2501.03262)",
    "reinforce_pp_baseline": "REINFORCE++ with a group baseline (Hu 2025, arXiv 2501.03262)",
    "online_dpo": ("online DPO: two fresh samples per prompt ranked by the reward sources, the DPO loss on the pair "
                   "(Guo et al. 2024, arXiv 2402.04792)"),
}
ONLINE_STAGES = ("ppo", "rloo", "grpo", "reinforce_pp")

# Dotted config keys the card lists (where present and set), besides the whole `algo` and `kl` sections.
KEY_CONFIG = ("model.name_or_path", "model.dtype", "model.lora.enabled", "model.lora.r", "model.lora.alpha",
              "model.quantization.load_in_4bit", "mixed_precision", "optim.lr", "optim.scheduler", "optim.warmup_steps",
              "optim.per_device_batch_size", "optim.grad_accum_steps", "max_steps", "num_epochs", "seed",
              "data.train", "data.max_length", "generation.num_samples", "generation.temperature",
              "generation.max_new_tokens", "reward.model", "reward.function", "reward.ensemble", "reward.normalize")

# What a push leaves out of the output directory: checkpoints (pushed on their own by `logging.hub_strategy`),
# temporary and hidden files, and the trackers' local stores.
PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", ".*", ".*/**", "wandb/**", "runs/**"]
HUB_STRATEGIES = ("end", "checkpoint", "all_checkpoints")


# 1. The model card ---------------------------------------------------------------------------------------------


def score_reading(pooling: str, pad_is_eos: bool) -> str:
    """One line saying how a reward model's score is read, for its card and config.json."""
    if pooling == "mean":
        return ("rlhfkit score (pooling=mean): the mean of the `score` head's output over the response tokens (after "
                "the prompt); transformers' forward and pipeline('text-classification') return the head at the last "
                "non-pad token instead, which is not this model's reward")
    return ("rlhfkit score (pooling=last): the `score` head at the last token of the attention mask; transformers' "
            "forward reads the last token that is not pad_token_id, the same token unless the text ends with the pad "
            "token" + (" (pad = eos here: a text ending with eos is read one token early)" if pad_is_eos else ""))


DATA_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt", ".gguf")


def _is_hub_name(name: Any, owner_optional: bool = False) -> bool:
    """A hub repo id ("org/name", or with `owner_optional` a canonical dataset such as "imdb"): not a local path or
    data file, not the tiny test model."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or name.count("/") not in ((0, 1) if owner_optional else (1,)) or os.path.exists(name) \
            or name.lower().endswith(DATA_FILE_SUFFIXES):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _base_model(model_cfg: dict) -> str | None:
    """The hub model this one was trained from: its hub name, or the base_model in the card of the local directory it
    started from (a stage trained on an earlier stage's output keeps pointing at the hub model underneath)."""
    name = model_cfg.get("name_or_path")
    if _is_hub_name(name):
        return name
    card = os.path.join(str(name), "README.md")
    if os.path.isfile(card):
        base = ModelCard.load(card).data.to_dict().get("base_model")
        return base if _is_hub_name(base) else None
    return None


def _table(rows: list[tuple[str, Any]], header: tuple[str, str]) -> str:
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else json.dumps(v) if isinstance(v, (list, dict)) else str(v)
        return text.replace("|", "\\|")

    return "\n".join([f"| {header[0]} | {header[1]} |", "|---|---|"] + [f"| `{k}` | {cell(v)} |" for k, v in rows])


def write_model_card(model_dir: str, stage: str, cfg: dict, metrics: dict[str, float]) -> str:
    """Write `model_dir/README.md`, the model card of the model saved there; returns its path.

    `cfg` is the resolved config as a dict (`dataclasses.asdict`), `metrics` the final logged metrics (keys under
    `eval/` are listed as the evaluation). A reward model (config.json names a `...ForSequenceClassification`) gets
    `score_reading` in its card and, as `rlhfkit_score`, in its config.json.
    """
    config_path = os.path.join(model_dir, "config.json")
    model_config: dict = {}
    if os.path.isfile(config_path):  # absent when only a LoRA adapter was saved (model.lora.merge_on_save=false)
        with open(config_path, encoding="utf-8") as f:
            model_config = json.load(f)
    adapter: dict = {}
    if os.path.isfile(os.path.join(model_dir, "adapter_config.json")):
        with open(os.path.join(model_dir, "adapter_config.json"), encoding="utf-8") as f:
            adapter = json.load(f)
    reward_model = (any(a.endswith("ForSequenceClassification") for a in model_config.get("architectures") or [])
                    or adapter.get("task_type") == "SEQ_CLS")
    algorithm = lookup(cfg, "algo.algorithm", None) if stage in ONLINE_STAGES else None
    method = algorithm or stage
    pooling = model_config.get("rlhfkit_pooling") or lookup(cfg, "algo.pooling", None) or "last"
    pad_is_eos = model_config.get("pad_token_id") == model_config.get("eos_token_id") if model_config else False
    reading = score_reading(pooling, pad_is_eos)
    lora_adapter = bool(adapter)
    tags = ["rlhfkit", stage] + ([algorithm] if algorithm and algorithm != stage else [])
    if lora_adapter:
        tags += ["peft", "lora"]
    # A plain transformers model that TRL reads as it was trained: not a reward model whose score transformers' own
    # forward reads elsewhere (mean pooling; or pad = eos, when its texts end with the eos it was trained on).
    if not reward_model or (pooling == "last" and model_config and not pad_is_eos):
        tags.append("trl-compatible")
    datasets = [d for d in (lookup(cfg, "data.train", None), lookup(cfg, "data.eval", None))
                if _is_hub_name(d, owner_optional=True)]
    data = ModelCardData(base_model=_base_model(cfg.get("model", {})), library_name="rlhfkit", tags=tags,
                         datasets=list(dict.fromkeys(datasets)) or None,
                         pipeline_tag="text-classification" if reward_model else "text-generation")

    name = os.path.basename(os.path.abspath(model_dir))
    lines = [f"# {name}", "", f"Trained with [rlhfkit](https://pypi.org/project/rlhfkit/) (`rlhfkit {stage}`): "
             f"{METHODS.get(method, method)}."]
    if data.base_model:
        lines[-1] += f" Base model: [{data.base_model}](https://huggingface.co/{data.base_model})."
    if reward_model:
        lines += ["", "## Reading the score", "", reading + "."]
    config_rows = [(k, v) for k, v in sorted(_flat(cfg).items()) if k.startswith(("algo.", "kl.")) and v is not None]
    lora = bool(lookup(cfg, "model.lora.enabled", None))
    config_rows += [(k, lookup(cfg, k, None)) for k in KEY_CONFIG if lookup(cfg, k, None) not in (None, [], "")
                    and (lora or k not in ("model.lora.r", "model.lora.alpha"))]
    lines += ["", "## Key configuration", "", _table(config_rows, ("key", "value"))]
    train = [(k, v) for k, v in metrics.items() if not k.startswith("eval/")]
    evaluation = [(k, v) for k, v in metrics.items() if k.startswith("eval/")]
    if train:
        lines += ["", "## Final training metrics", "", _table(train, ("metric", "value"))]
    if evaluation:
        lines += ["", "## Evaluation", "", _table(evaluation, ("metric", "value"))]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
    path = os.path.join(model_dir, "README.md")
    card.save(path)
    if reward_model and model_config:
        model_config["rlhfkit_score"] = reading
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(model_config, f, indent=2, sort_keys=True)
            f.write("\n")
    return path


def _flat(cfg: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


# 2. The push ---------------------------------------------------------------------------------------------------


def check_hub(push_to_hub: bool, hub_model_id: str | None, hub_strategy: str = "end", create: bool = False) -> None:
    """Refuse at start, in one line, a push that cannot happen: no repo id, an unknown strategy, or offline mode; with
    `create` (the main process), then create the repo (`create_hub_repo`)."""
    if not push_to_hub:
        return
    from huggingface_hub import constants

    if not hub_model_id:
        raise UserError("config key 'logging.push_to_hub': needs logging.hub_model_id (the repo to push to, 'user/name')")
    if hub_strategy not in HUB_STRATEGIES:
        raise UserError(f"config key 'logging.hub_strategy': must be one of {', '.join(HUB_STRATEGIES)}, got {hub_strategy!r}")
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        raise UserError("config key 'logging.push_to_hub': the hub is offline (HF_HUB_OFFLINE is set); unset it or "
                        "pass logging.push_to_hub=false")
    if create:
        create_hub_repo(push_to_hub, hub_model_id)


def checkpoint_path_in_repo(hub_strategy: str, checkpoint_dir: str) -> str | None:
    """Where a checkpoint goes in the repo under `hub_strategy` (transformers' names): "checkpoint" keeps the latest
    in `last-checkpoint/`, "all_checkpoints" each in its own `checkpoint-N/`, "end" none (None)."""
    if hub_strategy == "checkpoint":
        return "last-checkpoint"
    if hub_strategy == "all_checkpoints":
        return os.path.basename(os.path.normpath(checkpoint_dir))
    return None


HUB_API_ENV = "RLHFKIT_HUB_API"


def hub_api():
    """The client a run's push goes through: huggingface_hub's `HfApi`, or the stand-in that the environment variable
    RLHFKIT_HUB_API names as "module:callable" (called with no argument, it returns an object with HfApi's
    `create_repo` and `upload_folder`): the seam for tests without network and for mirrors that speak HfApi."""
    ref = os.environ.get(HUB_API_ENV)
    if not ref:
        from huggingface_hub import HfApi

        return HfApi()
    import importlib

    module, _, name = ref.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise UserError(f"environment variable {HUB_API_ENV}={ref!r}: expected 'module:callable' ({exc})") from exc
    return factory()


def push_folder(folder: str, repo_id: str, *, path_in_repo: str | None = None, commit_message: str, api=None,
                ignore_patterns: list[str] | None = None, delete_patterns: list[str] | None = None) -> None:
    """Upload `folder` to the model repo `repo_id` (created if absent) through `huggingface_hub.HfApi`, or `api`: any
    object with HfApi's `create_repo` and `upload_folder`. Call from the main process only."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=folder, path_in_repo=path_in_repo, commit_message=commit_message,
                      repo_type="model", ignore_patterns=ignore_patterns, delete_patterns=delete_patterns)


def push_final_model(output_dir: str, repo_id: str, *, api=None) -> None:
    """Push the final model in `output_dir` (model files, card, config.yaml, metrics, report), not its checkpoints."""
    push_folder(output_dir, repo_id, commit_message="rlhfkit: final model", api=api, ignore_patterns=PUSH_IGNORE)


def push_checkpoint(checkpoint_dir: str, repo_id: str, hub_strategy: str, *, api=None) -> None:
    """Push `checkpoint_dir` as `hub_strategy` says (`checkpoint_path_in_repo`); nothing under "end"."""
    path = checkpoint_path_in_repo(hub_strategy, checkpoint_dir)
    if path is not None:
        # last-checkpoint/ is replaced whole: files the previous checkpoint had and this one lacks go
        push_folder(checkpoint_dir, repo_id, path_in_repo=path, api=api,
                    commit_message=f"rlhfkit: {os.path.basename(os.path.normpath(checkpoint_dir))}",
                    delete_patterns=["*"] if path == "last-checkpoint" else None)


# 3. A run's outputs --------------------------------------------------------------------------------------------


def publish(cfg: Any, stage: str, metrics: dict[str, float]) -> None:
    """The end of a run (main process): the model card of the final model in `cfg.output_dir`, then, with
    `logging.push_to_hub`, the push of that directory (through `hub_api`)."""
    import dataclasses

    write_model_card(cfg.output_dir, stage, dataclasses.asdict(cfg), metrics)
    if cfg.logging.push_to_hub:
        repo = cfg.logging.hub_model_id
        try:
            push_final_model(cfg.output_dir, repo, api=hub_api())
        except UserError:
            raise
        except Exception as exc:  # the network, the hub, the token: the model is saved, say how to send it
            raise UserError(f"logging.push_to_hub: the upload of {cfg.output_dir} to '{repo}' failed "
                            f"({first_line(exc, with_type=True)}); the trained model is saved there: upload it with "
                            f"`hf upload {repo} {cfg.output_dir}`") from exc


def create_hub_repo(push_to_hub: bool, hub_model_id: str | None) -> None:
    """At start (main process), as transformers' Trainer does: create the repo a run will push to, so that a token
    without write access, or a repo id the hub refuses, fails in one line before any training."""
    if not push_to_hub:
        return
    try:
        hub_api().create_repo(hub_model_id, repo_type="model", exist_ok=True)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"config key 'logging.hub_model_id': cannot create the repo '{hub_model_id}' "
                        f"({first_line(exc, with_type=True)})") from exc


def publish_checkpoint(cfg: Any, checkpoint_dir: str) -> None:
    """A checkpoint is complete (main process): pushed as `logging.hub_strategy` says, when `logging.push_to_hub`."""
    if cfg.logging.push_to_hub:
        try:
            push_checkpoint(checkpoint_dir, cfg.logging.hub_model_id, cfg.logging.hub_strategy, api=hub_api())
        except UserError:
            raise
        except Exception as exc:  # as transformers' Trainer: a failed checkpoint push does not stop the training
            import logging

            logging.getLogger("rlhfkit").warning(
                "logging.hub_strategy: pushing %s to '%s' failed (%s); training goes on, the checkpoint stays local",
                os.path.basename(checkpoint_dir), cfg.logging.hub_model_id, first_line(exc, with_type=True))
