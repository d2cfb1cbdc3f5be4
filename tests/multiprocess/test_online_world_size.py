"""Online RL on two processes (torchrun, gloo, CPU) equals one process on the same global batch.

With `generation.seed_per_prompt` sampling is a function of (seed, step, prompt), so both layouts draw the same responses;
then the rewards, the global whitening and normalisation, the global-count loss normalisation and DDP's gradient
averaging must give the same updates: the same metrics (global means, logged once) and the same final weights.
The faults and resumes of 2-process online runs are in test_online_world_size_resume.py (a file of their own, so
that the two test workers run both files at once).
"""

import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 300  # a hang fails the test instead of the suite
sys.path.insert(0, HERE)
from common import free_port, rows, weights  # noqa: E402  (test_online_world_size_resume takes them from here)


def env(extra_path=None):
    e = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    if extra_path:
        e["PYTHONPATH"] = os.pathsep.join([str(extra_path), e.get("PYTHONPATH", "")])
    return e


def run(args, processes, extra_path=None):
    """The CLI on `processes` processes, each prompt's responses drawn under a seed of (seed, step, prompt)."""
    args = [*args, "generation.seed_per_prompt=true"]
    if processes == 1:
        cmd = [sys.executable, "-m", "rlhfkit.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "-m", "rlhfkit.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(extra_path), capture_output=True, text=True, timeout=TIMEOUT)


COMPARED = ("objective/scores", "objective/kl", "objective/entropy", "response/length_avg", "loss/policy_avg",
            "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio", "objective/kl_coef", "episodes",
            "loss/ptx_avg", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "objective/tie_rate", "share_with_a", "rewards/logs_things/mean", "dynamic_sampling/rounds",
            "dynamic_sampling/dropped_groups", "dynamic_sampling/filled_share", "clip_ratio/low_mean",
            "clip_ratio/high_mean", "policy/entropy_kept_frac", "policy/off_policy_masked_frac", "policy/entropy_coef",
            "policy/entropy_avg", "sampling/corrected_frac")


@pytest.mark.slow
@pytest.mark.parametrize("stage, micro, extra", [
    # 4 samples per prompt; the reward logs a metric through TRL's log_metric (the mean over calls and processes)
    ("grpo", 8, ["algo.num_minibatches=1", "reward.function=tests.smoke.reward_fns:logs_things"]),
    ("ppo", 4, ["algo.num_minibatches=1", "model.lora.enabled=true", "model.lora.r=4", "algo.ppo_epochs=2",
                "kl.controller=adaptive"]),
    ("grpo", 8, ["algo.num_minibatches=1", "data.ptx=data/tiny/sft_train.jsonl", "algo.ptx_coef=0.5"]),  # PPO-ptx
    ("online_dpo", 4, ["data.ptx=data/tiny/sft_train.jsonl", "algo.ptx_coef=0.5"]),  # micro-batches of pairs
    # the multi-turn tool loop as the rollout component (its episodes seeded per prompt as the single-turn ones)
    ("grpo", 8, ["algo.num_minibatches=1", "model.chat_template=chatml_tools", "tools.functions=[tests.smoke.agent_tools:add]",
                 "tools.max_calls=2", "data.max_length=2048", "data.max_prompt_length=1024"]),
    # DAPO's dynamic sampling: half the prompts give groups without signal, whose slots are sampled again
    ("grpo", 8, ["algo.num_minibatches=1", "algo.algorithm=dapo", "algo.dynamic_filtering=true",
                 "algo.max_sampling_rounds=3", "reward.function=tests.smoke.reward_fns:half_flat"]),
    # a sequence-level objective with the top-entropy tokens (the quantile over both processes' tokens: one
    # micro-batch per process, so the same tokens as one process's), the off-policy mask, the sampler correction
    # and adaptive entropy (the global entropy each step), two epochs so that the second is off-policy
    ("grpo", 16, ["algo.num_minibatches=1", "algo.ppo_epochs=2", "algo.policy_loss=gspo", "algo.top_entropy_quantile=0.5",
                  "algo.off_policy_mask_threshold=0.05", "algo.rollout_correction=token_truncate",
                  "algo.adaptive_entropy=true", "algo.entropy_coef=0.01", "algo.entropy_target=10"]),
], ids=["grpo", "ppo-lora-shared-critic", "grpo-ptx", "online-dpo-ptx", "grpo-tools", "dapo-dynamic-sampling",
        "gspo-masks-correction-adaptive-entropy"])
def test_two_processes_equal_one(stage, micro, extra, tmp_path):
    common = ["--config", f"configs/{stage}_tiny.yaml", "max_steps=3", "logging.progress_bar=false", "optim.lr=1e-2", "optim.adam_eps=1e-4",
              "generation.max_new_tokens=8", *extra]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    a = run([stage, *common, f"output_dir={one}", "algo.rollout_batch_size=4", f"optim.per_device_batch_size={micro}"], 1)
    assert a.returncode == 0, a.stderr[-3000:]
    b = run([stage, *common, f"output_dir={two}", "algo.rollout_batch_size=2", f"optim.per_device_batch_size={micro // 2}"], 2)
    assert b.returncode == 0, b.stderr[-3000:]
    single, double = rows(one), rows(two)
    assert [r["step"] for r in double] == [1, 2, 3]  # logged once, by the main process
    assert ("loss/ptx_avg" in single[0]) == any("ptx" in e for e in extra)
    assert ("share_with_a" in double[0]) == any("logs_things" in e for e in extra)
    assert ("dynamic_sampling/rounds" in single[0]) == ("algo.dynamic_filtering=true" in extra)
    for r1, r2 in zip(single, double):
        for key in COMPARED:
            if key in r1:
                assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), (r1["step"], key)
    w1, w2 = weights(one), weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        # Adam divides by sqrt(v) + eps: with the default eps a parameter whose gradient is ~0 turns float noise
        # into steps of up to lr; adam_eps=1e-4 keeps those below 1e-5, while a real difference moves weights ~lr.
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
