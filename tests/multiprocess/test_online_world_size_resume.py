"""Online RL on two processes (torchrun, gloo, CPU), continued from test_online_world_size.py (same runner): a
non-finite reward on one process only skips the step on both and stops the run cleanly (no hang); a 2-process
checkpoint resumes on 2 processes or on 1 (same global batch) to the uninterrupted run's end."""

import shutil

import pytest
import torch

from test_online_world_size import COMPARED, rows, run, weights


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
