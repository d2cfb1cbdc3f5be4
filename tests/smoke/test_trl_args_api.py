"""`rlhfkit.train(stage, args=<TRL config>)` on the tiny model, one step each: a GRPOConfig for every loss_type and
importance_sampling_level TRL 1.16 accepts, and an RLOOConfig, DPOConfig, KTOConfig, RewardConfig and SFTConfig through
their stages. Each run's saved config.yaml shows the keys the TRL fields became; `overrides` apply on top."""

from __future__ import annotations

import os

import pytest
import yaml

trl = pytest.importorskip("trl")

import rlhfkit  # noqa: E402
from rlhfkit.config.trl_rules import LOSS_TYPES  # noqa: E402
from rlhfkit.errors import UserError  # noqa: E402

# CPU runs, one step, short completions, TRL's logging every step; no gradient checkpointing (TRL's default is on).
FAST = {"use_cpu": True, "bf16": False, "max_steps": 1, "logging_steps": 1, "disable_tqdm": True,
        "gradient_checkpointing": False, "save_strategy": "no"}
ONLINE = {**FAST, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 4}


def saved(out) -> dict:
    with open(os.path.join(out, "config.yaml")) as f:
        return yaml.safe_load(f)


def test_every_grpo_loss_type_and_importance_sampling_level(tmp_path):
    runs = [(loss, level) for loss in LOSS_TYPES for level in ("token", "sequence")]
    assert len(runs) == 16  # TRL 1.16 accepts every pair (it warns about some)
    for loss, level in runs:
        out = str(tmp_path / f"{loss}-{level}")
        args = trl.GRPOConfig(output_dir=out, loss_type=loss, importance_sampling_level=level, epsilon_high=0.28,
                              **ONLINE)
        result = rlhfkit.train("grpo", model="tiny", train_dataset="data/tiny/prompts_train.jsonl",
                               reward_funcs="tests.smoke.reward_fns:completions_only", args=args)
        algo = saved(out)["algo"]
        token_form, sequence_form, agg = LOSS_TYPES[loss]
        expected = sequence_form if level == "sequence" else token_form
        assert (algo["policy_loss"], algo["loss_agg"], algo["algorithm"]) == (expected, agg, "dapo"), (loss, level)
        assert "loss/policy_avg" in result.metrics, (loss, level)


def test_grpo_with_a_kl_term_reward_weights_and_overrides_on_top(tmp_path):
    out = str(tmp_path / "run")
    args = trl.GRPOConfig(output_dir=out, beta=0.04, loss_type="grpo", learning_rate=1e-5, reward_weights=[0.5, 2.0],
                          **ONLINE)
    result = rlhfkit.train("grpo", model="tiny", train_dataset="data/tiny/prompts_train.jsonl",
                           reward_funcs=["tests.smoke.reward_fns:completions_only", "tests.smoke.reward_fns:zeros"],
                           args=args, overrides={"optim.lr": 2e-5})
    cfg = saved(out)
    assert cfg["algo"]["algorithm"] == "grpo" and cfg["kl"]["coef"] == 0.04 and cfg["optim"]["lr"] == 2e-5
    assert cfg["reward"]["weights"] == [0.5, 2.0]  # TRL's reward_weights, as rlhfkit.train's argument of that name
    assert "objective/kl" in result.metrics


@pytest.mark.parametrize(("stage", "cls", "data", "extra", "check"), [
    ("rloo", "RLOOConfig", "data/tiny/prompts_train.jsonl", ONLINE, lambda c: c["algo"]["algorithm"] == "rloo"),
    ("dpo", "DPOConfig", "data/tiny/pref_train.jsonl", {**FAST, "per_device_train_batch_size": 4, "beta": 0.2},
     lambda c: c["algo"]["beta"] == 0.2),
    ("kto", "KTOConfig", "data/tiny/unpaired_train.jsonl", {**FAST, "per_device_train_batch_size": 4,
                                                             "desirable_weight": 1.2},
     lambda c: c["algo"]["desirable_weight"] == 1.2),
    ("rm", "RewardConfig", "data/tiny/pref_train.jsonl", {**FAST, "per_device_train_batch_size": 4,
                                                           "center_rewards_coefficient": 0.01},
     lambda c: c["algo"]["center_coef"] == 0.01),
    ("sft", "SFTConfig", "data/tiny/sft_train.jsonl", {**FAST, "per_device_train_batch_size": 4, "max_length": 128},
     lambda c: c["data"]["max_length"] == 128),
])
def test_the_other_trl_configs_run_through_their_stages(stage, cls, data, extra, check, tmp_path):
    out = str(tmp_path / stage)
    rewards = {"reward_funcs": "tests.smoke.reward_fns:completions_only"} if stage == "rloo" else {}
    result = rlhfkit.train(stage, model="tiny", train_dataset=data, args=getattr(trl, cls)(output_dir=out, **extra),
                           **rewards)
    cfg = saved(out)
    assert check(cfg) and cfg["max_steps"] == 1 and cfg["optim"]["lr"] == getattr(trl, cls)(output_dir=out, **extra).learning_rate
    assert result.metrics


def test_a_trl_config_given_as_config_points_to_args(tmp_path):
    with pytest.raises(UserError, match=r"^config: a TRL GRPOConfig goes in as args=\.\.\., not config=\.\.\.$"):
        rlhfkit.train("grpo", model="tiny", config=trl.GRPOConfig(output_dir=str(tmp_path), **ONLINE))


@pytest.mark.parametrize("disable", [True, False])
def test_dpo_disable_dropout_is_trls(disable, tmp_path):
    """A policy with attention dropout, at lr 0, against its own copy as the reference: with dropout off (TRL's
    default) every log-ratio is 0 and the loss is ln 2 exactly; with it on, the policy's forward is noisy."""
    import math

    from transformers import AutoModelForCausalLM

    from rlhfkit.config import ModelConfig
    from rlhfkit.model_sources import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(ModelConfig(name_or_path="tiny")),
                                                 attention_dropout=0.5)
    args = trl.DPOConfig(output_dir=str(tmp_path), learning_rate=0.0, disable_dropout=disable, **{
        **FAST, "per_device_train_batch_size": 4})
    result = rlhfkit.train("dpo", model=model, train_dataset="data/tiny/pref_train.jsonl", args=args)
    assert (result.metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)) is disable
