"""`rlhfkit online_dpo` end to end on the tiny model: it logs TRL's online-DPO metrics and the tie rate, a resumed
run ends where the uninterrupted one ends, and its settings are refused in one line where they cannot apply."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main

ARGS = ["online_dpo", "--config", "configs/online_dpo_tiny.yaml", "max_steps=4", "logging.save_steps=2",
        "logging.progress_bar=false", "algo.rollout_batch_size=4", "optim.per_device_batch_size=2",
        "generation.max_new_tokens=8"]
LOGGED = ("objective/scores", "objective/kl", "objective/entropy", "rewards/chosen", "rewards/rejected",
          "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "beta", "objective/tie_rate",
          "loss/policy_avg")


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_resume_equals_uninterrupted(tmp_path):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    assert main([*ARGS, f"output_dir={full}"]) == 0
    # The config's reward, interrupted when step 4 is scored (tests/smoke/interrupted_reward.py): the run dies after
    # step 3, checkpoint-2 being its last.
    assert main([*ARGS, f"output_dir={cut}", "reward.function=tests.smoke.interrupted_reward:vowel_reward"]) == 130
    assert [r["step"] for r in rows(cut)] == [1, 2, 3]
    assert main([*ARGS, f"output_dir={cut}", "resume=true"]) == 0
    a, b = rows(full), rows(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in LOGGED:  # the pair metrics are absent from a step whose pairs all tied
        assert any(key in r for r in a), key
    assert all(0.0 <= r["objective/tie_rate"] <= 1.0 and r["beta"] == 0.1 for r in a)
    for r1, r2 in zip(a, b):
        assert r1.keys() == r2.keys()
        for k in (k for k in r1 if not k.startswith("time/")):
            assert r2[k] == pytest.approx(r1[k], abs=1e-6), (r1["step"], k)
    w1, w2 = load_file(os.path.join(full, "model.safetensors")), load_file(os.path.join(cut, "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("override, message", [
    ("generation.num_samples=4", "config key 'generation.num_samples' must be 2 for online_dpo"),
    ("reward.normalize=batch", "config key 'reward.normalize' must be 'none' for online_dpo"),
    ("algo.loss_type=simpo", "config key 'algo.loss_type'"),
    ("algo.ptx_coef=0.1", "config key 'algo.ptx_coef' is 0.1 but data.ptx is not set"),
])
def test_settings_that_cannot_apply_are_refused(override, message, tmp_path, capsys):
    assert main(["online_dpo", "--config", "configs/online_dpo_tiny.yaml", f"output_dir={tmp_path / 'run'}", override]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error:")]
    assert len(errors) == 1 and message in errors[0], errors


def test_online_dpo_evaluates_held_out_prompts(tmp_path):
    """data.eval with logging.eval_steps: online DPO evaluates like the other online stages (the alarms section it
    reads exists)."""
    out = str(tmp_path / "run")
    assert main([*ARGS, f"output_dir={out}", "data.eval=data/tiny/prompts_eval.jsonl", "logging.eval_steps=2",
                 "logging.save_steps=0"]) == 0
    evaluated = [r for r in rows(out) if "eval/objective/scores" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    assert all("eval/objective/kl" in r and "eval/response/length_avg" in r for r in evaluated)
