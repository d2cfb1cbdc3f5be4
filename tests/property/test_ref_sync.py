"""TR-DPO's reference sync (`algo.sync_ref_model`, arXiv 2404.09656) for DPO and online RL: the mix by hand, a hard
sync that makes the next step start from π = π_ref (DPO's loss ln 2, GRPO's KL 0), resume ≡ uninterrupted with the
moved reference in the checkpoint, and the settings it is refused with."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import TrainerCallback

from rlhfkit.config import DPOConfig, OnlineConfig, load_config
from rlhfkit.errors import ConfigError
from rlhfkit.models import mix_weights
from rlhfkit.stages import run_stage

DPO = ["max_steps=2", "logging.logging_steps=1", "logging.progress_bar=false", "data.eval=null", "optim.warmup_steps=0"]
GRPO = ["max_steps=2", "logging.progress_bar=false", "kl.coef=0.1"]
SYNC = ["algo.sync_ref_model=true", "algo.ref_model_mixup_alpha=1.0", "algo.ref_model_sync_steps=1"]


def rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_mix_weights_by_hand():
    target, source = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        target.weight.copy_(torch.tensor([[4.0, 8.0]])), target.bias.fill_(1.0)
        source.weight.copy_(torch.tensor([[0.0, 4.0]])), source.bias.fill_(5.0)
    mix_weights(target, source, 0.25)  # 0.25 · source + 0.75 · target
    assert target.weight.tolist() == [[3.0, 7.0]] and target.bias.tolist() == [2.0]
    mix_weights(target, source, 1.0)  # the hard update: a copy
    assert target.weight.tolist() == [[0.0, 4.0]] and target.bias.tolist() == [5.0]
    half = torch.nn.Linear(2, 1).to(torch.bfloat16)
    mix_weights(half, source, 1.0)
    assert half.weight.dtype == torch.bfloat16 and half.weight.tolist() == [[0.0, 4.0]]


def test_dpo_hard_sync_starts_the_next_step_at_ln2(tmp_path):
    synced, plain = str(tmp_path / "synced"), str(tmp_path / "plain")
    run_stage("dpo", "configs/dpo_tiny.yaml", DPO + SYNC + [f"output_dir={synced}"])
    run_stage("dpo", "configs/dpo_tiny.yaml", DPO + [f"output_dir={plain}"])
    # After step 1 the reference is the policy: step 2's forward sees log-ratios of 0, -log σ(0) = ln 2.
    second = rows(synced)[1]
    assert second["step"] == 2 and second["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert second["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert rows(plain)[1]["loss"] != pytest.approx(math.log(2), abs=1e-3)  # without it the policy has moved away


def test_grpo_hard_sync_zeroes_the_next_steps_kl(tmp_path):
    synced, plain = str(tmp_path / "synced"), str(tmp_path / "plain")
    run_stage("grpo", "configs/grpo_tiny.yaml", GRPO + SYNC + [f"output_dir={synced}"])
    run_stage("grpo", "configs/grpo_tiny.yaml", GRPO + [f"output_dir={plain}"])
    assert rows(synced)[1]["objective/kl"] == pytest.approx(0.0, abs=1e-7)
    assert rows(plain)[1]["objective/kl"] > 1e-4


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.mark.parametrize(("stage", "config", "args"), [
    ("dpo", "configs/dpo_tiny.yaml", DPO),
    ("grpo", "configs/grpo_tiny.yaml", GRPO + ["logging.logging_steps=1"]),
])
def test_resume_with_a_moved_reference_equals_the_uninterrupted_run(stage, config, args, tmp_path):
    soft = ["max_steps=4", "algo.sync_ref_model=true", "algo.ref_model_mixup_alpha=0.5", "algo.ref_model_sync_steps=1"]
    whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
    run_stage(stage, config, args + soft + [f"output_dir={whole}"])
    run_stage(stage, config, args + soft + [f"output_dir={stopped}"], callbacks=[StopAt(2)])
    assert os.path.isdir(os.path.join(stopped, "checkpoint-2", "ref_model"))
    run_stage(stage, config, args + soft + [f"output_dir={stopped}", "resume=true"])
    measured = ("elapsed_s", "memory/peak_rss_gb")  # wall clock and resident memory differ run to run
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k not in measured}  # noqa: E731
    assert [strip(r) for r in rows(stopped)] == [strip(r) for r in rows(whole)]


REQUIRED = ["model.name_or_path=tiny", "data.train=t.jsonl", "output_dir=o"]


@pytest.mark.parametrize(("cls", "extra", "key", "message"), [
    (DPOConfig, ["model.lora.enabled=true"], "algo.sync_ref_model", "is not supported with LoRA"),
    (DPOConfig, ["algo.precompute_ref_logprobs=true"], "algo.sync_ref_model", "are exclusive"),
    (DPOConfig, ["algo.loss_type=simpo"], "algo.sync_ref_model", "SimPO uses none"),
    (OnlineConfig, ["algo.algorithm=dapo", "generation.num_samples=2"], "algo.sync_ref_model", "trains no KL term"),
])
def test_sync_refused_where_it_cannot_be_honoured(cls, extra, key, message):
    reward = ["reward.function=m:f"] if cls is OnlineConfig else []
    with pytest.raises(ConfigError, match=f"config key '{key}' .*{message}"):
        load_config(cls, None, REQUIRED + reward + extra + ["algo.sync_ref_model=true"])


def test_sync_numbers_refused_without_sync():
    with pytest.raises(ConfigError, match="'algo.ref_model_sync_steps' applies only with algo.sync_ref_model=true"):
        load_config(DPOConfig, None, REQUIRED + ["algo.ref_model_sync_steps=4"])
