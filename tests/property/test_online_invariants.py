"""Invariants of the online loop: lr=0 leaves the ratio at 1; resume reproduces the uninterrupted run; non-finite
rewards stop the run cleanly; LoRA and reward-model scoring paths run."""

import json
import math
import os

import pytest

from rlhfkit.cli import main

FAST = ["max_steps=2", "logging.progress_bar=false", "algo.rollout_batch_size=4", "optim.per_device_batch_size=4",
        "algo.num_minibatches=1"]


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_lr_zero_first_epoch_has_ratio_one(stage, tmp_path):
    out = tmp_path / "run"
    assert main([stage, "--config", f"configs/{stage}_tiny.yaml", f"output_dir={out}", "optim.lr=0", "algo.ppo_epochs=2", *FAST]) == 0
    for row in metrics(out):
        assert row["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-10)
        assert row["policy/clipfrac_avg"] == 0.0
        assert row["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    # The reference is the initial policy and nothing moved: zero KL.
    assert metrics(out)[-1]["objective/kl"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("extra", [[], ["model.lora.enabled=true", "model.lora.r=4"],
                                   ["model.chat_template=chatml_tools", "tools.functions=[tests.smoke.agent_tools:add]",
                                    "data.max_length=2048", "data.max_prompt_length=1024"],
                                   # the adaptive entropy coefficient (it grows each step here) is restored on resume
                                   ["algo.policy_loss=cispo", "algo.adaptive_entropy=true", "algo.entropy_coef=0.01",
                                    "algo.entropy_target=10"]],
                         ids=["full", "lora-shared-critic", "tools", "cispo-adaptive-entropy"])
def test_resume_reproduces_final_metrics(extra, tmp_path):
    args = ["ppo", "--config", "configs/ppo_tiny.yaml", "max_steps=4", "logging.save_steps=2", "logging.progress_bar=false",
            "algo.rollout_batch_size=4", "optim.per_device_batch_size=2", *extra]
    assert main(args + [f"output_dir={tmp_path / 'full'}"]) == 0
    # The configs' reward, interrupted when step 4 is scored: the run dies after step 3 (checkpoint-2 is the last).
    interrupted = "reward.function=tests.smoke.interrupted_reward:vowel_reward"
    assert main(args + [f"output_dir={tmp_path / 'cut'}", interrupted]) == 130
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2, 3]
    assert main(args + [f"output_dir={tmp_path / 'cut'}", "resume=true"]) == 0
    full, cut = metrics(tmp_path / "full"), metrics(tmp_path / "cut")
    assert len(cut) == len(full) == 4
    for a, b in zip(full, cut):
        assert a.keys() == b.keys()
        for k in (k for k in a if not k.startswith(("time/", "memory/"))):  # wall times and measured memory differ
            assert a[k] == pytest.approx(b[k], abs=1e-6), k


def test_nonfinite_rewards_stop_the_run_and_keep_the_checkpoint(tmp_path, capsys, monkeypatch):
    (tmp_path / "nan_reward.py").write_text("def reward(prompts, completions):\n    return [float('nan')] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    assert main(["rloo", "--config", "configs/rloo_tiny.yaml", f"output_dir={out}", "max_steps=2", "logging.save_steps=1",
                 "logging.progress_bar=false"]) == 0
    ckpt = out / "checkpoint-1" / "trainer_state.pt"
    before = ckpt.read_bytes()
    code = main(["rloo", "--config", "configs/rloo_tiny.yaml", f"output_dir={out}", "resume=true", "max_steps=6",
                 "reward.function=nan_reward:reward", "max_bad_steps=2",
                 "logging.progress_bar=false"])
    err = capsys.readouterr().err
    assert code == 2
    line = [l for l in err.splitlines() if l.startswith("rlhfkit: error:")][0]
    assert "2 optimizer steps skipped for a non-finite rollout" in line and "max_bad_steps=2" in line
    assert ckpt.read_bytes() == before


def test_reward_model_ensemble_scores_and_initialises_the_critic(tmp_path):
    rm = tmp_path / "rm"
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={rm}", "max_steps=3", "data.eval=null",
                 "logging.progress_bar=false"]) == 0
    out = tmp_path / "ppo"
    assert main(["ppo", "--config", "configs/ppo_tiny.yaml", f"output_dir={out}", "reward.function=null",
                 f"reward.model=[{rm}, {rm}]", "reward.ensemble=min", *FAST]) == 0
    assert all(math.isfinite(m["objective/scores"]) for m in metrics(out))


def test_stage_fixes_the_algorithm_family(capsys):
    assert main(["ppo", "--config", "configs/grpo_tiny.yaml", "output_dir=x"]) == 2
    assert "`rlhfkit ppo` runs one of ppo" in capsys.readouterr().err


def test_dapo_variant_runs_with_filtering_truncation_mask_and_clip_higher(tmp_path):
    out = tmp_path / "dapo"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "algo.algorithm=dapo", "algo.dynamic_filtering=true",
                 "algo.mask_truncated=true", "algo.clip_eps_high=0.28", "reward.missing_eos_penalty=0.1",
                 "reward.normalize=batch", *FAST]) == 0
    rows = metrics(out)
    assert len(rows) == 2 and all(math.isfinite(m["objective/scores"]) for m in rows)
    assert "objective/kl" not in rows[-1]  # DAPO has no reference: no KL is measured, none is logged
