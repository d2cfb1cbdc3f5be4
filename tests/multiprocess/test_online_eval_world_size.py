"""Evaluation during online training on two processes (torchrun, gloo, CPU): the eval prompts' batches are shared
out between the processes (5 batches: 3 and 2) and the capability set too, and the logged figures are global: those
`rlhfkit eval` reports on one process for the run's final weights, with the same seed, batch size and settings."""

import json
import os
import subprocess
import sys

import pytest

from rlhfkit.cli import main

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 300  # a hang fails the test instead of the suite
sys.path.insert(0, HERE)
from common import free_port, read_jsonl  # noqa: E402


@pytest.mark.slow
def test_two_process_eval_equals_one_process_rlhfkit_eval(tmp_path):
    out = str(tmp_path / "run")
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "rlhfkit.cli", "grpo", "--config", "configs/grpo_tiny.yaml",
           f"output_dir={out}", "logging.progress_bar=false", "max_steps=2", "optim.lr=1e-2", "algo.rollout_batch_size=2",
           "optim.per_device_batch_size=4", "generation.max_new_tokens=8", "data.eval=data/tiny/prompts_eval.jsonl",
           "data.max_samples=10", "data.capability=data/tiny/sft_eval.jsonl", "data.max_prompt_length=96"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [row for row in read_jsonl(os.path.join(out, "metrics.jsonl")) if "eval/objective/kl" in row]
    assert [row["step"] for row in rows] == [2]  # logged once, by the main process
    evals = [s for s in read_jsonl(os.path.join(out, "samples.jsonl")) if s.get("split") == "eval"]
    assert len(evals) == 8  # the first 8 of the 40 samples, once

    report_dir = tmp_path / "eval"
    assert main(["eval", "--config", "configs/eval_tiny.yaml", f"output_dir={report_dir}", f"model.name_or_path={out}",
                 "max_prompts=10", "batch_size=2", "generation.num_samples=4", "generation.max_new_tokens=8", "seed=0",
                 "data.max_prompt_length=96", "capability_data=data/tiny/sft_eval.jsonl"]) == 0
    report = json.loads((report_dir / "eval.json").read_text())
    pol, tax, row = report["policy"], report["alignment_tax"], rows[0]
    assert report["num_samples"] == 40
    expected = {"eval/rewards/vowel_reward/mean": pol["reward"]["vowel_reward"]["mean"], "eval/objective/kl": report["kl"]["mean"],
                "eval/response/length_avg": pol["length"]["mean"], "eval/response/eos_rate": pol["eos_rate"],
                "eval/response/distinct_2": pol["distinct_2"], "eval/response/top_share": pol["top_share"],
                "eval/capability/policy_nll": tax["policy_nll"], "eval/capability/reference_nll": tax["reference_nll"],
                "capability/delta_nats": tax["delta_nats"]}
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert [s["response"] for s in evals] == [s["policy"]["response"] for s in report["samples"][:8]]
