"""The stages `rlhfkit <stage>` runs, and the one public way to run one: `run_stage(stage, config, overrides)`.

The CLI and the demo (`rlhfkit.tasks.demo`) both go through here. Config and trainer classes are named, not
imported, so `rlhfkit --help` stays instant and importing this module loads no trainer.
"""

from __future__ import annotations

import importlib
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


def stage_config(stage: str, config: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """The validated config of `rlhfkit <stage>`: the YAML file `config` (None: the defaults), then the
    `key.sub=value` overrides. An online stage fixes the algorithm family; the config may pick a variant within it."""
    from rlhfkit.algorithms import family_members
    from rlhfkit.config import load_config

    family = family_members(stage)  # the online commands: the algorithms registered under this family
    defaults = {"algo": {"algorithm": family[0]}} if family else None
    cfg = load_config(_load(STAGES[stage][0]), config, list(overrides), defaults)
    if family and cfg.algo.algorithm not in family:
        raise UserError(f"config key 'algo.algorithm': `rlhfkit {stage}` runs one of {', '.join(family)}, got {cfg.algo.algorithm!r}")
    return cfg


def run_stage(stage: str, config: Any = None, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, float]:
    """Run `rlhfkit <stage>` in this process: fit its trainer (or evaluator) and return its last metrics.

    `config` is a config object already built (then without `overrides`), or a YAML path (None: the defaults) to which
    `overrides` are applied, as on the command line.
    """
    if config is None or isinstance(config, str):
        config = stage_config(stage, config, overrides)
    elif overrides:
        raise ValueError("overrides apply to a YAML config, not to a config object")
    return _load(STAGES[stage][1])(config).fit()
