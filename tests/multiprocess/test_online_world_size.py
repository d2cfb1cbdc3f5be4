"""Online RL on two processes (torchrun, gloo, CPU) equals one process on the same global batch.

With `generation.seed_per_prompt` sampling is a function of (seed, step, prompt), so both layouts draw the same responses;
then the rewards, the global whitening and normalisation, the global-count loss normalisation and DDP's gradient
averaging must give the same updates: the same metrics (global means, logged once) and the same final weights.
A non-finite reward on one process only skips the step on both and stops the run cleanly (no hang). A 2-process
checkpoint resumes on 2 processes or on 1 (same global batch) to the uninterrupted run's end.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 300  # a hang fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def weights(out):
    return load_file(os.path.join(out, next(f for f in os.listdir(out) if f.endswith(".safetensors"))))


COMPARED = ("objective/scores", "objective/kl", "objective/entropy", "response/length_avg", "loss/policy_avg",
            "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio", "objective/kl_coef", "episodes",
            "loss/ptx_avg", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
            "logps/rejected", "objective/tie_rate")


@pytest.mark.slow
@pytest.mark.parametrize("stage, micro, extra", [
    ("grpo", 8, ["algo.num_minibatches=1"]),  # 4 samples per prompt
    ("ppo", 4, ["algo.num_minibatches=1", "model.lora.enabled=true", "model.lora.r=4", "algo.ppo_epochs=2",
                "kl.controller=adaptive"]),
    ("grpo", 8, ["algo.num_minibatches=1", "data.ptx=data/tiny/sft_train.jsonl", "algo.ptx_coef=0.5"]),  # PPO-ptx
    ("online_dpo", 4, ["data.ptx=data/tiny/sft_train.jsonl", "algo.ptx_coef=0.5"]),  # micro-batches of pairs
], ids=["grpo", "ppo-lora-shared-critic", "grpo-ptx", "online-dpo-ptx"])
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


@pytest.mark.slow
def test_nonfinite_reward_on_one_process_stops_both_cleanly(tmp_path):
    """Rank 1's reward is NaN at step 2: both processes skip it (no hang), and max_bad_steps=1 stops the run."""
    (tmp_path / "rank_nan.py").write_text(
        "import os\n"
        "calls = 0\n"
        "def reward(prompts, completions):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    bad = calls == 2 and os.environ.get('RANK') == '1'\n"
        "    return [float('nan') if bad else float(len(c)) for c in completions]\n")
    out = str(tmp_path / "run")
    r = run(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "max_steps=4", "max_bad_steps=1",
             "reward.function=rank_nan:reward", "logging.progress_bar=false", "algo.rollout_batch_size=2",
             "optim.per_device_batch_size=8", "generation.max_new_tokens=8"], 2, extra_path=tmp_path)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("rlhfkit: error:")]
    assert len(errors) == 2 and all("stopping at step 2" in e for e in errors), r.stderr[-3000:]
    assert [row["step"] for row in rows(out)] == [1]


RESUME_COMMON = ["grpo", "--config", "configs/grpo_tiny.yaml", "logging.progress_bar=false", "optim.lr=1e-2",
                 "optim.adam_eps=1e-4", "generation.max_new_tokens=8", "logging.save_steps=2"]
TWO = ["algo.rollout_batch_size=2", "optim.per_device_batch_size=4"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """An uninterrupted 4-step 2-process GRPO run, and one stopped after step 3 (its newest checkpoint: step 2)."""
    root = tmp_path_factory.mktemp("resume")
    full, cut = str(root / "full"), str(root / "cut")
    for out, steps in ((full, 4), (cut, 3)):
        r = run([*RESUME_COMMON, *TWO, f"output_dir={out}", f"max_steps={steps}"], 2)
        assert r.returncode == 0, r.stderr[-3000:]
    return full, cut


@pytest.mark.slow
@pytest.mark.parametrize("resume_processes", [2, 1], ids=["same-world-size", "two-to-one"])
def test_resume_of_a_two_process_run(resume_processes, two_process_runs, tmp_path):
    """The checkpoint of a 2-process run resumed — on 2 processes, or on 1 with the same global batch
    (rollout_batch_size 4 instead of 2 per process) — ends where the uninterrupted 2-process run ends."""
    full, cut = two_process_runs
    resumed_dir = str(tmp_path / "resumed")
    shutil.copytree(cut, resumed_dir)
    layout = TWO if resume_processes == 2 else ["algo.rollout_batch_size=4", "optim.per_device_batch_size=8"]
    resumed = run([*RESUME_COMMON, *layout, f"output_dir={resumed_dir}", "max_steps=4", "resume=true"], resume_processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = rows(full), rows(resumed_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for r1, r2 in zip(a, b):
        for key in COMPARED:
            if key in r1:
                assert r2[key] == pytest.approx(r1[key], rel=1e-4, abs=1e-6), (r1["step"], key)
    w1, w2 = weights(full), weights(resumed_dir)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
