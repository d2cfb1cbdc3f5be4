"""TRL's config objects as rlhfkit keys (`rlhfkit.config.trl_args`): every field of every pinned TRL config is in the
tables (the test that fails when TRL gains a field), the mapping on hand values, refusals in one line, and the
generated docs page current."""

from __future__ import annotations

import dataclasses
import os

import pytest

trl = pytest.importorskip("trl")

from rlhfkit.config import trl_args  # noqa: E402
from rlhfkit.config.trl_args import CLASSES, Inert, Key, Refused, Rule, rule_of, trl_config_keys  # noqa: E402
from rlhfkit.errors import UserError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = {"use_cpu": True, "bf16": False, "output_dir": "out"}


@pytest.mark.parametrize("class_name", sorted(CLASSES))
def test_every_field_of_the_pinned_trl_config_is_mapped_or_refused(class_name):
    fields = [f.name for f in dataclasses.fields(getattr(trl, class_name))]
    unknown = [name for name in fields if not isinstance(rule_of(class_name, name), (Key, Rule, Refused, Inert))]
    assert not unknown, (f"trl {trl.__version__}'s {class_name} has fields rlhfkit neither maps nor refuses: {unknown}; "
                         "add each to a table in rlhfkit/config/trl_args.py")


def test_the_committed_page_is_what_the_code_generates():
    with open(os.path.join(ROOT, trl_args.PAGE), encoding="utf-8") as f:
        assert f.read() == trl_args.table_page(), f"{trl_args.PAGE} is out of date: run `{trl_args.COMMAND}`"


def test_grpo_batch_layout_by_hand():
    # 8 completions per micro-batch, 2 micro-batches per optimizer step, a generation every 4 micro-batches (32
    # completions = 8 prompts of 4 per process), reused twice: 2 optimizer steps per pass, 2 passes, so max_steps=8
    # optimizer steps are 2 rollouts.
    args = trl.GRPOConfig(**CPU, per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                          num_generations=4, num_iterations=2, max_steps=8, learning_rate=3e-6, beta=0.04,
                          loss_type="grpo", epsilon_high=0.28, warmup_steps=0.1, lr_scheduler_type="cosine")
    keys = trl_config_keys("grpo", args)
    assert keys["algo"]["rollout_batch_size"] == 8 and keys["algo"]["num_minibatches"] == 2
    assert keys["algo"]["ppo_epochs"] == 2 and keys["max_steps"] == 2
    assert keys["optim"]["per_device_batch_size"] == 8 and keys["generation"]["num_samples"] == 4
    assert keys["optim"]["lr"] == 3e-6 and keys["optim"]["scheduler"] == "cosine" and keys["optim"]["warmup_ratio"] == 0.1
    assert (keys["algo"]["algorithm"], keys["kl"]["coef"], keys["algo"]["loss_agg"]) == ("grpo", 0.04, "seq-mean-token-mean")
    assert keys["algo"]["clip_eps_high"] == 0.28 and keys["algo"]["bias_corrected_kl"] is True
    assert keys["mixed_precision"] == "no" and keys["model"]["gradient_checkpointing"] is True  # TRL's default: on


def test_trl_defaults_are_trls():
    keys = trl_config_keys("grpo", trl.GRPOConfig(**CPU))
    assert keys["optim"]["lr"] == 1e-6 and keys["generation"]["max_new_tokens"] == 512  # TRL's, not rlhfkit's
    assert keys["algo"]["algorithm"] == "dapo" and keys["algo"]["loss_agg"] == "token-mean"  # beta 0, loss_type dapo
    assert keys["algo"]["disable_dropout"] is False and keys["logging"]["save_steps"] == 500
    assert keys["num_epochs"] == 3.0 and keys["max_steps"] == -1


@pytest.mark.parametrize(("cls", "stage", "fields", "message"), [
    ("GRPOConfig", "grpo", {"use_vllm": True}, "args.use_vllm=True: rlhfkit samples with its own decode loop"),
    ("GRPOConfig", "grpo", {"optim": "sgd"}, "args.optim='sgd': rlhfkit trains with torch's AdamW"),
    ("GRPOConfig", "grpo", {"loss_type": "sapo", "delta": 2.0}, "args.delta=2.0: TRL applies it to the clipped losses"),
    ("GRPOConfig", "grpo", {"num_iterations": 2, "max_steps": 3}, "args.max_steps=3: rlhfkit counts rollouts"),
    ("DPOConfig", "dpo", {"loss_type": ["sigmoid", "sft"]}, "args.loss_type=['sigmoid', 'sft']: rlhfkit's DPO takes one"),
    ("DPOConfig", "dpo", {"f_divergence_type": "js_divergence"}, "args.f_divergence_type='js_divergence': not supported"),
    ("SFTConfig", "sft", {"neftune_noise_alpha": 5.0}, "args.neftune_noise_alpha=5.0: not supported by rlhfkit"),
    ("RLOOConfig", "rloo", {"normalize_advantages": True}, "args.normalize_advantages=True: TRL whitens"),
    # Off-policy, TRL's RLOO clips one ratio per sequence and rlhfkit one per token: a different objective.
    ("RLOOConfig", "rloo", {"num_iterations": 2}, "args.num_iterations=2: TRL's RLOO clips one ratio per sequence"),
    ("RLOOConfig", "rloo", {"steps_per_generation": 2}, "args.steps_per_generation=2: TRL's RLOO clips one ratio per"),
    ("RewardConfig", "rm", {"save_strategy": "epoch"}, "args.save_strategy='epoch': rlhfkit saves every"),
    ("SFTConfig", "dpo", {}, "args: `rlhfkit dpo` takes a DPOConfig, got a SFTConfig"),
])
def test_a_field_rlhfkit_cannot_honour_is_refused_in_one_line(cls, stage, fields, message):
    with pytest.raises(UserError) as exc:
        trl_config_keys(stage, getattr(trl, cls)(**CPU, **fields))
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_the_other_stages_map_their_own_fields():
    dpo = trl_config_keys("dpo", trl.DPOConfig(**CPU, beta=0.2, loss_type=["ipo"], max_length=256, sync_ref_model=True,
                                               ref_model_sync_steps=4, gradient_accumulation_steps=2))
    assert dpo["algo"] == {"beta": 0.2, "loss_type": "ipo", "precompute_ref_logprobs": False, "label_smoothing": 0.0,
                           "sync_ref_model": True, "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 4,
                           "disable_dropout": True}
    assert dpo["data"]["max_length"] == 256 and dpo["data"]["max_prompt_length"] == 128
    assert dpo["optim"]["grad_accum_steps"] == 2
    kto = trl_config_keys("kto", trl.KTOConfig(**CPU, desirable_weight=1.33))
    assert kto["algo"] == {"beta": 0.1, "desirable_weight": 1.33, "undesirable_weight": 1.0, "disable_dropout": True}
    rm = trl_config_keys("rm", trl.RewardConfig(**CPU, center_rewards_coefficient=0.01))
    assert rm["algo"] == {"center_coef": 0.01, "disable_dropout": True} and rm["optim"]["lr"] == 1e-4
    sft = trl_config_keys("sft", trl.SFTConfig(**CPU, dataset_text_field="body", packing=True))
    assert sft["data"]["columns"] == {"text": "body"} and sft["data"]["packing"] is True
    rloo = trl_config_keys("rloo", trl.RLOOConfig(**CPU, beta=0.1, reward_clip_range=(-3.0, 3.0)))
    assert rloo["algo"]["algorithm"] == "rloo" and rloo["kl"]["coef"] == 0.1 and rloo["reward"]["clip"] == 3.0
    assert rloo["algo"]["loss_agg"] == "seq-mean-token-sum"  # TRL's per-sequence loss, its gradient at ratio 1


def test_reward_weights_come_from_the_trl_config_once(tmp_path):
    import rlhfkit

    args = trl.GRPOConfig(**{**CPU, "output_dir": str(tmp_path)}, reward_weights=[0.5, 1.0])
    with pytest.raises(UserError, match=r"^args.reward_weights: the weights are given twice"):
        rlhfkit.train("grpo", model="tiny", reward_funcs=["m:f", "m:g"], reward_weights=[1.0, 1.0], args=args)
    with pytest.raises(UserError, match=r"^args.reward_weights: give reward_funcs too"):
        rlhfkit.train("grpo", model="tiny", args=args)
    with pytest.raises(UserError, match=r"^args: give the run's settings as args .* or as config, not both"):
        rlhfkit.train("grpo", model="tiny", args=args, config={"max_steps": 1})
