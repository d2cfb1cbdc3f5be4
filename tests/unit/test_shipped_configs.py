"""Every shipped config under configs/ loads with its stage's validation (`rlhfkit.stages.stage_config`), and every
reward function it names (reward.function, reward.gold_function, eval judges) imports: a recipe the docs show runs."""

import glob
import os

import pytest

from rlhfkit.reward_functions import load_reward_function
from rlhfkit.stages import STAGES, stage_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
VARIANT_OF = {"ipo": "dpo", "simpo": "dpo"}  # configs of a variant that a stage runs through its algo.loss_type


def stage_of(path: str) -> str:
    """The stage a config is named after: the longest stage (or variant) its file name starts with, then "_"."""
    name = os.path.basename(path)
    prefix = max((s for s in [*STAGES, *VARIANT_OF] if name.startswith(s + "_")), key=len, default="")
    return VARIANT_OF.get(prefix, prefix)


def test_every_config_has_a_stage():
    assert CONFIGS and all(stage_of(p) in STAGES for p in CONFIGS), [p for p in CONFIGS if stage_of(p) not in STAGES]


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_validates_and_its_reward_functions_import(path):
    cfg = stage_config(stage_of(path), path)
    reward = getattr(cfg, "reward", None)
    refs = [("reward.function", ref) for ref in (reward.functions if reward else [])]
    refs += [("reward.gold_function", reward.gold_function)] if reward is not None and reward.gold_function else []
    refs += [("judges", spec.partition("=")[2].strip()) for spec in getattr(cfg, "judges", [])]
    for key, ref in refs:
        assert callable(load_reward_function(ref, key).fn)


def test_the_grpo_recipe_weighs_a_format_and_a_quality_reward():
    from rlhfkit.tasks.summarize import format_reward, length_penalised_quality

    cfg = stage_config("grpo", os.path.join(ROOT, "configs", "grpo_smollm2.yaml"))
    assert cfg.reward.functions == ["rlhfkit.tasks.summarize:format_reward", "rlhfkit.tasks.summarize:length_penalised_quality"]
    assert cfg.reward.weights == [0.5, 1.0]
    post = "My landlord raised the rent twice this year and will not fix the heating."
    good = "Landlord raised the rent twice and will not fix the heating."
    assert format_reward([good, "no stop", "", "Two.\n\nParas."]) == [1.0, 0.0, 0.0, 0.0]
    assert format_reward([[{"role": "assistant", "content": good}]]) == [1.0]  # conversational completions too
    # 8 distinct words of 3+ letters, all in the post; 11 words, under the 30-word target: 1.0.
    invented = "Landlord bought a yacht."  # landlord in the post; bought, yacht not: 1/3
    long = " ".join(["rent"] * 45)  # grounded, 15 words past the target: 1 - 15/30
    assert length_penalised_quality([post] * 4, [good, invented, long, ""]) == pytest.approx([1.0, 1 / 3, 0.5, 0.0])
    assert length_penalised_quality(["..."], ["Anything."]) == [None]  # nothing to check against: not scored
