"""The stages `rlhfkit <stage>` runs, and the one public way to run one: `run_stage(stage, config, overrides)`.

The CLI and the demo (`rlhfkit.tasks.demo`) both go through here. Config and trainer classes are named, not
imported, so `rlhfkit --help` stays instant and importing this module loads no trainer.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
from typing import Any

from rlhfkit.errors import UserError

# stage -> (config class, trainer class, what it trains).
STAGES = {
    "sft": ("rlhfkit.config:SFTConfig", "rlhfkit.trainers.sft:SFTTrainer", "supervised fine-tuning on prompt/completion or chat data"),
    "rm": ("rlhfkit.config:RMConfig", "rlhfkit.trainers.reward:RewardTrainer", "reward model on chosen/rejected pairs (Bradley-Terry)"),
    "ppo": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "PPO with a critic, GAE and a KL penalty"),
    "rloo": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "RLOO: k samples per prompt, leave-one-out baseline"),
    "grpo": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "GRPO (algo.algorithm=dr_grpo|dapo for the variants)"),
    "reinforce_pp": ("rlhfkit.config:OnlineConfig", "rlhfkit.trainers.online:OnlineTrainer", "REINFORCE++ (algo.algorithm=reinforce_pp_baseline for the group baseline)"),
    "online_dpo": ("rlhfkit.config:OnlineDPOConfig", "rlhfkit.trainers.online_dpo:OnlineDPOTrainer", "online DPO: two samples per prompt from the policy, ranked by the reward sources, the DPO family's loss on the fresh pairs"),
    "dpo": ("rlhfkit.config:DPOConfig", "rlhfkit.trainers.preference:PreferenceTrainer", "direct preference optimisation on chosen/rejected pairs (algo.loss_type: sigmoid = DPO/cDPO, ipo, hinge, simpo)"),
    "orpo": ("rlhfkit.config:ORPOConfig", "rlhfkit.trainers.preference:PreferenceTrainer", "odds-ratio preference optimisation: SFT + odds-ratio loss on pairs, no reference model"),
    "kto": ("rlhfkit.config:KTOConfig", "rlhfkit.trainers.kto:KTOTrainer", "Kahneman-Tversky optimisation on unpaired completions labelled desirable or not"),
    "eval": ("rlhfkit.config:EvalConfig", "rlhfkit.evaluation.evaluate:Evaluator", "evaluate a policy against a reference: rewards per judge, KL, win rates, length, diversity, reward-hacking alarms"),
    "rft": ("rlhfkit.config:RFTConfig", "rlhfkit.trainers.rft:RFTTrainer", "best-of-n rejection-sampling fine-tuning: sample n per prompt, keep the best by the reward, SFT on them; iterated"),
}


def _load(ref: str):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def config_class(stage: str) -> type:
    """The config dataclass of `rlhfkit <stage>`."""
    return _load(STAGES[stage][0])


def stage_config(stage: str, config: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """The validated config of `rlhfkit <stage>`: the YAML file `config` (None: the defaults), then the
    `key.sub=value` overrides."""
    from rlhfkit.config import parse_overrides, read_yaml
    from rlhfkit.config.fields import merge

    return build_stage_config(stage, merge(read_yaml(config) if config else {}, parse_overrides(list(overrides))))


def build_stage_config(stage: str, data: dict) -> Any:
    """The validated, frozen config of `rlhfkit <stage>` from nested `data` (a YAML file's mapping, a dict, a config
    object's fields): one validation whatever the origin. An online stage fixes the algorithm family; the config may
    pick a variant within it."""
    from rlhfkit.algorithms import family_members
    from rlhfkit.config import load_config
    from rlhfkit.config.fields import merge

    if stage not in STAGES:
        raise UserError(f"unknown stage '{stage}': one of {', '.join(STAGES)}")
    family = family_members(stage)  # the online commands: the algorithms registered under this family
    defaults = {"algo": {"algorithm": family[0]}} if family else {}
    cfg = load_config(config_class(stage), defaults=merge(defaults, data))
    if family and cfg.algo.algorithm not in family:
        raise UserError(f"config key 'algo.algorithm': `rlhfkit {stage}` runs one of {', '.join(family)}, got {cfg.algo.algorithm!r}")
    return cfg


def trainer_of(stage: str, cfg: Any, objects=None):
    """The trainer (or evaluator) of `rlhfkit <stage>` for a validated `cfg`; `objects` (`rlhfkit.objects.Objects`)
    hold what the Python API was given instead of names, its callbacks included. `eval` trains nothing: it takes no
    objects and calls no TrainerCallback."""
    from rlhfkit.model_sources import check_model_paths

    cls = _load(STAGES[stage][1])
    given = () if objects is None else tuple(k for k, v in (("model.name_or_path", objects.model),
                                                            ("reward.model", objects.reward_funcs)) if v)
    check_model_paths(cfg, given)
    if stage == "eval":
        if objects is not None and objects.callbacks:
            raise UserError("callbacks: `eval` trains nothing, so it calls no TrainerCallback; pass none")
        return cls(cfg)
    from rlhfkit.objects import Objects
    from rlhfkit.rollout.maker import toolbox_of

    objects = objects if objects is not None else Objects()
    return cls(cfg, dataclasses.replace(objects, toolbox=toolbox_of(cfg, objects)))  # tools checked before any model loads


def config_data(stage: str, config: Any) -> dict:
    """`config` (None, a YAML path, a dict or a config object of the stage) as a plain nested dict, unvalidated: the
    stage's validation runs once, on the merged result (`rlhfkit.train`'s and `rlhfkit.plan`'s `config`)."""
    from rlhfkit.config import read_yaml

    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return read_yaml(os.fspath(config))
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        expected = STAGES[stage][0].rpartition(":")[2]
        if type(config).__name__ != expected:
            raise UserError(f"config: `rlhfkit {stage}` takes a {expected}, got a {type(config).__name__}")
        return dataclasses.asdict(config)
    raise UserError(f"config: expected a YAML path, a dict or a config object, got {type(config).__name__}")


def override_list(overrides: dict | list[str] | None) -> list[str]:
    """`overrides` ({"kl.coef": 0.04} or ["kl.coef=0.04"]) as `key.sub=value` strings."""
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]  # JSON is YAML: lists, null, numbers survive
    return list(overrides)


def run_stage(stage: str, config: Any = None, overrides: list[str] | tuple[str, ...] = (),
              callbacks: list | tuple = ()) -> dict[str, float]:
    """Run `rlhfkit <stage>` in this process: fit its trainer (or evaluator) and return its last metrics.

    `config` is a YAML path (None: the defaults) to which `overrides` are applied, as on the command line, or a config
    object, validated again as if it had been read from YAML (then without `overrides`). `callbacks`: transformers
    `TrainerCallback`s (instances or classes) the training stages call at their events (`rlhfkit.trainers.callbacks`).
    `rlhfkit.train` takes objects and dicts too.
    """
    if config is None or isinstance(config, str):
        config = stage_config(stage, config, overrides)
    elif overrides:
        raise ValueError("overrides apply to a YAML config, not to a config object")
    else:
        import dataclasses

        config = build_stage_config(stage, dataclasses.asdict(config))
    from rlhfkit.objects import Objects

    return trainer_of(stage, config, Objects(callbacks=tuple(callbacks))).fit()
