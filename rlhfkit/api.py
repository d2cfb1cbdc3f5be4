"""The Python entry point: `rlhfkit.train(stage, ...)`, with TRL's argument names; objects or names in, a result out.

What a TRL user already holds goes in as it is: a model object (trained in place) and its tokenizer, a
`datasets.Dataset` (or IterableDataset, a list of dicts, a file or a hub name), reward functions under TRL's calling
convention mixed with reward models, a peft `LoraConfig`, transformers `TrainerCallback`s. The config comes from a
YAML path, a dict or a config object, with `overrides` on top; whatever its origin it goes through the same validation
as the CLI's, so a mistake is the same one-line `UserError`. The CLI (`rlhfkit <stage>`) is a thin shell over this.

Every object is also named in the run's saved `config.yaml`: a model object by its `name_or_path`, a dataset by the
JSON-lines file it is written to (once, in the cache: `$RLHFKIT_CACHE/datasets/<fingerprint>.jsonl`), a function as
`module:qualname`, a LoRA config by the `model.lora` keys it maps to.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Any

from rlhfkit.config import parse_overrides
from rlhfkit.config.fields import merge
from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text, cache_dir
from rlhfkit.objects import Objects
from rlhfkit.rewards import check_reward_pair
from rlhfkit.stages import STAGES, build_stage_config, config_class, config_data, override_list, trainer_of

# peft LoraConfig fields rlhfkit maps onto `model.lora` (the rest must keep peft's defaults: refused otherwise).
_LORA_FIELDS = {"r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "target_modules"}
_LORA_IGNORED = {"task_type", "peft_type", "base_model_name_or_path", "revision", "inference_mode"}


@dataclass(frozen=True)
class TrainResult:
    """What `train` returns: the last logged metrics, the run directory, and the trained model object."""

    metrics: dict[str, float]  # the last logged training (and eval) metrics; `rlhfkit eval`: its headline figures
    output_dir: str  # the run directory: the final model (a plain Hugging Face directory), config.yaml, metrics.jsonl
    model: Any  # the trained model object (the caller's own when one was given; a peft model with LoRA); None for eval


def train(stage: str, *, model: Any = None, tokenizer: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
          reward_funcs: Any = None, reward_weights: list[float] | None = None, peft_config: Any = None,
          callbacks: list | None = None, config: Any = None, overrides: dict | list[str] | None = None,
          output_dir: str | None = None, tools: list | None = None, environment_factory: Any = None,
          args: Any = None) -> TrainResult:
    """Run `rlhfkit <stage>` from Python and return its `TrainResult`.

    model: a transformers PreTrainedModel (trained in place), or a hub name / directory / "tiny".
    tokenizer: its tokenizer object; None loads the one of the model's name.
    train_dataset / eval_dataset: a datasets.Dataset or IterableDataset, a list of dicts, a file or a hub name, in any
        format the stage reads (TRL's included). For `eval`, `eval_dataset` holds the held-out prompts.
    reward_funcs: one source or a list (TRL's `reward_funcs`): callables under TRL's contract, "module:function",
        reward-model directories, sequence-classification model objects or (model, tokenizer) pairs.
    reward_weights: one per reward source, in the same order (TRL's `reward_weights`).
    peft_config: a peft LoraConfig (r, lora_alpha, lora_dropout, target_modules); other non-default fields are refused.
    callbacks: transformers TrainerCallback objects.
    config: a YAML path, a dict or a config object; overrides: {"kl.coef": 0.04} or ["kl.coef=0.04"], applied last.
    args: instead of `config`, TRL's config object of the stage (GRPOConfig, RLOOConfig, DPOConfig, KTOConfig,
        RewardConfig, SFTConfig): each field becomes its rlhfkit key (`rlhfkit.config.trl_args`), a field rlhfkit
        cannot honour is refused in one line naming it; `overrides` still apply on top.
    tools: functions the policy may call in multi-turn episodes (TRL's `tools`; online stages): each described to the
        model by its type hints and Google-style docstring (`rlhfkit.tools`).
    environment_factory: a class (or a dict name -> class, chosen by each row's `environment` column) making one
        environment per episode (TRL's `environment_factory`): reset(**row) before it, its public methods as tools, an
        optional get_reward() as a reward source.
    """
    if stage not in STAGES:
        raise UserError(f"unknown stage '{stage}': one of {', '.join(STAGES)}")
    _check_kinds(model, tokenizer, reward_funcs, reward_weights, callbacks, overrides)
    if reward_funcs is not None and "reward" not in {f.name for f in dataclasses.fields(config_class(stage))}:
        takes = [s for s in STAGES if s != "eval" and "reward" in {f.name for f in dataclasses.fields(config_class(s))}]
        raise UserError(f"reward_funcs: the {stage} stage learns from its data and takes no reward sources (stages "
                        f"that do: {', '.join(takes)})")
    tool_keys = _tool_keys(stage, tools, environment_factory)
    given: dict[str, str] = {}  # the cached file of a dataset object -> the argument that passed it
    if args is not None:
        base, reward_weights = _trl_args(stage, args, config, reward_funcs, reward_weights)
    else:
        base = config_data(stage, _not_trl(config))
    data = merge(merge(merge(base, tool_keys),
                       _arguments(model, train_dataset, eval_dataset, reward_funcs, reward_weights, peft_config,
                                  output_dir, given)),
                 parse_overrides(override_list(overrides)))
    try:
        return _train(stage, data, model, tokenizer, reward_funcs, reward_weights, callbacks,
                      (tuple(tools or ()), environment_factory))
    except UserError as exc:  # errors name a dataset object's records by the argument, not its cached file
        message = str(exc)
        for path, argument in given.items():
            message = message.replace(path, argument)
        if message == str(exc):
            raise
        raise type(exc)(message) from None


def _trl_args(stage: str, args, config, reward_funcs, reward_weights) -> tuple[dict, list[float] | None]:
    """The config keys of TRL config object `args`, and the reward weights (its `reward_weights`, when it has them,
    are TRL's way of passing the argument of that name)."""
    from rlhfkit.config.trl_args import trl_config_keys

    if config is not None:
        raise UserError("args: give the run's settings as args (a TRL config object) or as config, not both; "
                        "overrides apply on top of either")
    trl_weights = getattr(args, "reward_weights", None)
    if trl_weights is not None:
        if reward_weights is not None:
            raise UserError("args.reward_weights: the weights are given twice (also as reward_weights): give one")
        if reward_funcs is None:
            raise UserError("args.reward_weights: give reward_funcs too (one weight per reward source)")
        reward_weights = list(trl_weights)
    return trl_config_keys(stage, args), reward_weights


def _not_trl(config):
    """`config`, unless it is one of TRL's config objects, which go in as `args`."""
    if type(config).__module__.startswith("trl.") and dataclasses.is_dataclass(config):
        raise UserError(f"config: a TRL {type(config).__name__} goes in as args=..., not config=...")
    return config


def _is_tokenizer(x) -> bool:
    from transformers import PreTrainedTokenizerBase

    return isinstance(x, PreTrainedTokenizerBase)


def _check_kinds(model, tokenizer, reward_funcs, reward_weights, callbacks, overrides) -> None:
    """Refuse, in one line naming the argument, an argument of the wrong kind, before anything is read or loaded."""
    import torch

    def kind(x) -> str:
        return type(x).__name__

    if model is not None and not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise UserError(f"model: expected a transformers model object, a hub name or a directory, got {kind(model)}")
    if tokenizer is not None and not _is_tokenizer(tokenizer):
        raise UserError(f"tokenizer: expected a transformers tokenizer object (omit it to load the model's own), got "
                        f"{kind(tokenizer)}")
    if callbacks is not None and not isinstance(callbacks, (list, tuple)):
        raise UserError(f"callbacks: expected a list of transformers TrainerCallbacks, got {kind(callbacks)}")
    if overrides is not None and not (isinstance(overrides, dict) or isinstance(overrides, (list, tuple))
                                      and all(isinstance(o, str) for o in overrides)):
        raise UserError("overrides: expected a dict {'key.sub': value} or a list of 'key.sub=value' strings, got "
                        f"{kind(overrides)}")
    if reward_weights is not None and not (isinstance(reward_weights, (list, tuple)) and all(
            isinstance(w, (int, float)) and not isinstance(w, bool) for w in reward_weights)):
        raise UserError(f"reward_weights: expected a list of numbers, got {kind(reward_weights)}")
    if isinstance(reward_funcs, tuple):
        check_reward_pair(reward_funcs, "reward_funcs")
    for i, entry in enumerate(reward_funcs if isinstance(reward_funcs, list) else []):
        if isinstance(entry, tuple):
            check_reward_pair(entry, f"reward_funcs[{i}]")


def _train(stage: str, data: dict, model, tokenizer, reward_funcs, reward_weights, callbacks,
           tools: tuple = ((), None)) -> TrainResult:
    if stage == "eval" and any(x is not None and not isinstance(x, str) for x in (model, tokenizer)) or \
            stage == "eval" and (callbacks or any(not isinstance(f, str) for f in _as_list(reward_funcs))):
        raise UserError("rlhfkit.train('eval', ...) takes names (model, reward_funcs as 'module:function' or "
                        "directories), not objects or callbacks")
    if model is not None and not isinstance(model, str) and (data.get("model") or {}).get("num_layers") is not None:
        raise UserError("config key 'model.num_layers' cuts a model while loading it; a model object is already "
                        "loaded: cut it before passing it, or pass its name")
    cfg = build_stage_config(stage, data)
    # The run prepares its own copy of a given tokenizer (padding side, pad token, model.chat_template): the caller's
    # stays as it was. Copying is cheap; a tokenizer's vocabulary, once grown by a pad token, could not be restored.
    objects = Objects(model=None if isinstance(model, str) else model,
                      tokenizer=copy.deepcopy(tokenizer) if tokenizer is not None else None,
                      reward_funcs=tuple(_as_list(reward_funcs)),
                      reward_weights=tuple(reward_weights) if reward_weights is not None else None,
                      callbacks=tuple(callbacks or ()), tools=tools[0], environment_factory=tools[1])
    import torch

    given_models = [m for m in [model, *(f[0] if isinstance(f, tuple) else f for f in _as_list(reward_funcs))]
                    if isinstance(m, torch.nn.Module)]
    with as_found(given_models):
        trainer = trainer_of(stage, cfg, objects if stage != "eval" else None)
        metrics = trainer.fit()
        trained = trainer.run.unwrap(trainer.model) if hasattr(trainer, "model") else None
    return TrainResult(metrics=metrics, output_dir=cfg.output_dir, model=trained)


@contextlib.contextmanager
def as_found(models: list):
    """Gives the caller's model objects back as they were, when the run returns or raises: each module's train/eval
    mode, each parameter's `requires_grad`, its dropout rates (`algo.disable_dropout`), the KV-cache and pad-token
    settings of its config and gradient checkpointing, all of which the run sets while it prepares, trains, samples from or scores with them. Their
    weights are the run's business (a trained model is trained); so are the LoRA layers a run adds."""
    saved = [_model_state(m) for m in models]
    try:
        yield
    finally:
        for model, (modes, flags, config, checkpointing) in zip(models, saved):
            for module, training in modes:
                module.training = training
            for parameter, requires_grad in flags:
                parameter.requires_grad_(requires_grad)
            for owner, name, value in config:
                setattr(owner, name, value)
            if not checkpointing and getattr(model, "is_gradient_checkpointing", False):
                model.gradient_checkpointing_disable()
                if getattr(model, "_require_grads_hooks", None):  # set with checkpointing under LoRA (models._prepare)
                    model.disable_input_require_grads()


def _model_state(model) -> tuple:
    """(modes, requires_grad flags, attributes to set back, checkpointing) of a model object, for `as_found`."""
    import torch

    config = [(owner, name, getattr(owner, name)) for owner, names in (
        (getattr(model, "config", None), ("use_cache", "pad_token_id")),
        (getattr(model, "generation_config", None), ("pad_token_id",))) if owner is not None
        for name in names if hasattr(owner, name)]
    # The dropout rates models.disable_dropout sets to 0: a Dropout layer's p, an attention module's float rate.
    config += [(m, "p", m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    config += [(m, "attention_dropout", m.attention_dropout) for m in model.modules()
               if isinstance(getattr(m, "attention_dropout", None), float)]
    return ([(m, m.training) for m in model.modules()], [(p, p.requires_grad) for p in model.parameters()], config,
            getattr(model, "is_gradient_checkpointing", False))


# The config's origins ------------------------------------------------------------------------------------------


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


# The arguments as config keys ----------------------------------------------------------------------------------


def _arguments(model, train_dataset, eval_dataset, reward_funcs, reward_weights, peft_config, output_dir,
               given: dict[str, str]) -> dict:
    """The arguments as config keys; `given` gets each dataset object's cached file -> its argument's name."""
    data: dict = {}
    for key, argument, dataset in (("train", "train_dataset", train_dataset), ("eval", "eval_dataset", eval_dataset)):
        if dataset is not None:
            data.setdefault("data", {})[key] = path = _dataset_path(dataset, argument)
            if not isinstance(dataset, (str, os.PathLike)):
                given[path] = argument
    if model is not None:
        data["model"] = {"name_or_path": model if isinstance(model, str) else _model_name(model)}
        if not isinstance(model, str):
            data["model"]["gguf_file"] = None
    if reward_funcs is not None:
        data["reward"] = _reward_keys(_as_list(reward_funcs), reward_weights)
    elif reward_weights is not None:
        raise UserError("reward_weights: give reward_funcs too (one weight per reward source)")
    if peft_config is not None:
        data.setdefault("model", {})["lora"] = _lora_keys(peft_config, model)
    if output_dir is not None:
        data["output_dir"] = os.fspath(output_dir)
    return data


def _tool_keys(stage: str, tools, environment_factory) -> dict:
    """`tools.functions` / `tools.environment` naming the objects (as `module:qualname`, for config.yaml); the run
    itself uses the objects. A stage without episodes, or an argument of the wrong kind, is one line naming it."""
    if tools is None and environment_factory is None:
        return {}
    if "tools" not in {f.name for f in dataclasses.fields(config_class(stage))}:
        argument = "tools" if tools is not None else "environment_factory"
        raise UserError(f"{argument}: the {stage} stage samples no episodes; tools apply to the online stages (ppo, "
                        "rloo, grpo, reinforce_pp, online_dpo)")
    if tools is not None and (not isinstance(tools, (list, tuple)) or not all(callable(t) for t in tools)):
        raise UserError(f"tools: expected a list of functions, got {type(tools).__name__}"
                        + ("" if not isinstance(tools, (list, tuple)) else " holding something not callable"))
    factories = environment_factory if isinstance(environment_factory, dict) else {None: environment_factory}
    if environment_factory is not None and not all(callable(f) for f in factories.values()):
        raise UserError("environment_factory: expected a class (or a callable returning an environment), or a dict "
                        "name -> class")
    name = lambda obj: f"{getattr(obj, '__module__', None) or 'python'}:{getattr(obj, '__qualname__', type(obj).__name__)}"  # noqa: E731
    keys: dict = {"functions": [name(t) for t in tools or ()]}
    if environment_factory is not None:
        keys["environment"] = {k: name(f) for k, f in factories.items()} if None not in factories else name(
            environment_factory)
    return {"tools": keys}


def _model_name(model) -> str:
    """What config.yaml records for a model object: the name or directory it was loaded from."""
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    return name or type(model).__name__


def _reward_keys(sources: list, weights: list[float] | None) -> dict:
    """`reward.*` naming the sources (reward models first, then functions, each its own source: TRL's semantics) with
    the weights in that order; the run itself takes the sources in the caller's order (`Objects.reward_funcs`)."""
    if weights is not None and len(weights) != len(sources):
        raise UserError(f"reward_weights: {len(weights)} weights for {len(sources)} reward_funcs: give one per source")
    models, functions, model_weights, function_weights = [], [], [], []
    for i, source in enumerate(sources):
        target = source[0] if isinstance(source, tuple) else source
        weight = weights[i] if weights is not None else 1.0
        if isinstance(target, str) and ":" not in target:
            models.append(target), model_weights.append(weight)
        elif isinstance(target, str):
            functions.append(target), function_weights.append(weight)
        elif callable(target) and not hasattr(target, "get_input_embeddings"):
            functions.append(f"{getattr(target, '__module__', None) or 'python'}:"
                             f"{getattr(target, '__qualname__', None) or type(target).__name__}")
            function_weights.append(weight)
        elif hasattr(target, "get_input_embeddings"):
            models.append(_model_name(target)), model_weights.append(weight)
        else:
            raise UserError(f"reward_funcs[{i}]: expected a function, 'module:function', a reward-model directory or a "
                            f"model object, got {type(target).__name__}")
    return {"model": models, "function": functions or None, "ensemble": "none",
            "weights": model_weights + function_weights if weights is not None else None}


def _lora_keys(peft_config, model) -> dict:
    """`model.lora` from a peft LoraConfig; a field rlhfkit cannot honour is refused, never dropped."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise UserError(f"peft_config: rlhfkit trains LoRA adapters: expected a peft LoraConfig, got {type(peft_config).__name__}")
    default = LoraConfig()
    unsupported = sorted(f.name for f in dataclasses.fields(LoraConfig)
                         if f.name not in _LORA_FIELDS and f.name not in _LORA_IGNORED
                         and getattr(peft_config, f.name) != getattr(default, f.name))
    if unsupported:
        raise UserError(f"peft_config: {', '.join(unsupported)} set but not supported by rlhfkit's LoRA (it maps r, "
                        "lora_alpha, lora_dropout and target_modules); leave them at peft's defaults")
    targets = peft_config.target_modules
    if targets is None:
        raise UserError("peft_config.target_modules: name the modules to adapt (e.g. 'all-linear', or ['q_proj', 'v_proj'])")
    return {"enabled": True, "r": peft_config.r, "alpha": peft_config.lora_alpha, "dropout": peft_config.lora_dropout,
            "target_modules": targets if isinstance(targets, str) else sorted(targets)}


def _dataset_path(dataset, what: str) -> str:
    """A file or hub name as is; a Dataset, IterableDataset or list of dicts written once as JSON lines into the cache
    (named by its content), so the run reads it like any file and config.yaml names it."""
    if isinstance(dataset, (str, os.PathLike)):
        return os.fspath(dataset)
    import datasets

    if isinstance(dataset, datasets.DatasetDict):
        raise UserError(f"{what}: a DatasetDict holds several splits: pass one, e.g. dataset['train']")
    if isinstance(dataset, datasets.Dataset):
        name, write = dataset._fingerprint, lambda path: dataset.to_json(path, lines=True, force_ascii=False)
    elif isinstance(dataset, (datasets.IterableDataset, list, tuple)):
        rows = list(dataset) if isinstance(dataset, (list, tuple)) else list(itertools.islice(dataset, None))
        if any(not isinstance(r, dict) for r in rows):
            raise UserError(f"{what}: expected records (dicts), got a {type(next(r for r in rows if not isinstance(r, dict))).__name__}")
        text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows)
        name = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        write = lambda path: atomic_write_text(path, text)  # noqa: E731
    else:
        raise UserError(f"{what}: expected a datasets.Dataset, an IterableDataset, a list of dicts, a file or a hub "
                        f"name, got {type(dataset).__name__}")
    path = os.path.join(cache_dir(), "datasets", f"{name}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        write(tmp)
        os.replace(tmp, path)
    return path
