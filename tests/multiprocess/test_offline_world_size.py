"""The offline stages, RFT and `rlhfkit eval` on 2 processes (torchrun, gloo, CPU) against 1 process, through the CLI.

Same global batch ⇒ same run: 2 processes × per_device_batch_size B and 1 process × 2B log the same metrics (global
means over the global batch, not one process's half) and end with the same weights. A NaN loss on ONE process skips
the step on both and `max_bad_steps` stops both (a timeout turns a hang into a failure). A run resumes from its
checkpoint at the same and at a different world size (1 → 2 and 2 → 1) and ends as the uninterrupted run. Every
shared file (metrics.jsonl, checkpoints, the model, rft_iter*.jsonl, eval.json) is written once.

All 2-process runs go through ONE torchrun (tests/multiprocess/driver.py runs them one after another, so the
process group starts once); the 1-process runs go through `rlhfkit.cli.main` in this process.
"""

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import assert_same_rows, assert_same_weights, free_port, rows  # noqa: E402
from driver import run_job  # noqa: E402

B = 4  # per-process batch of the 2-process runs; the 1-process runs use 2B
COMMON = ["max_steps=4", "logging.logging_steps=1", "logging.eval_steps=2", "logging.save_steps=2",
          "logging.progress_bar=false", "data.max_samples=64", "optim.warmup_steps=1"]
# name -> (CLI stage, config, overrides)
STAGES = {
    "sft": ("sft", "configs/sft_tiny.yaml", []),
    "rm": ("rm", "configs/rm_tiny.yaml", []),
    "dpo": ("dpo", "configs/dpo_tiny.yaml", []),
    # LoRA: the reference is the policy's own base with its adapters disabled (no adapter dropout: its masks would
    # differ with the world size, as any random draw per process does).
    "dpo-lora": ("dpo", "configs/dpo_tiny.yaml", ["model.lora.enabled=true", "model.lora.dropout=0"]),
    "dpo-precomputed": ("dpo", "configs/dpo_tiny.yaml", ["algo.precompute_ref_logprobs=true"]),
    "ipo": ("dpo", "configs/ipo_tiny.yaml", []),
    "simpo": ("dpo", "configs/simpo_tiny.yaml", []),
    "kto": ("kto", "configs/kto_tiny.yaml", []),
    "orpo": ("orpo", "configs/orpo_tiny.yaml", []),
}
RFT = ["rft", "--config", "configs/rft_tiny.yaml", "algo.prompts_per_iteration=32", "algo.sampling_batch_size=8",
       "generation.max_new_tokens=8", "logging.logging_steps=1", "logging.save_steps=1", "logging.progress_bar=false"]
# With red-teaming: the 16 red-team prompts' batches are shared out too, judged on the main process.
RED_TEAM = ["red_team.prompts=data/tiny/red_team.jsonl", "red_team.judge=tests.smoke.reward_fns:holds_a_vowel"]
EVAL = ["eval", "--config", "configs/eval_tiny.yaml", "max_prompts=40", "batch_size=8", "generation.num_samples=2",
        "generation.max_new_tokens=8", *RED_TEAM]
# Red-teaming alone (no data.eval): 5 prompts in batches of 2, so the processes get 2 batches and 1.
RED_TEAM_ALONE = ["eval", "--config", "configs/eval_tiny.yaml", "data.eval=null", "reward.function=null", "batch_size=2",
                  "generation.num_samples=2", "generation.max_new_tokens=8", "red_team.max_prompts=5", *RED_TEAM]
NAN = {"nan": {"steps": [2, 3]}, "stage": "sft", "extra": ["max_bad_steps=2"]}
TIMEOUT_S = 240  # every 2-process run together; a hang fails the test instead of blocking the suite


def stage_argv(name: str, out, world: int, *extra: str) -> list[str]:
    stage, config, overrides = STAGES[name]
    return [stage, "--config", config, f"output_dir={out}", f"optim.per_device_batch_size={B * 2 // world}", *COMMON,
            *overrides, *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file: 1-process runs in-process first, then all 2-process runs in one torchrun."""
    root = tmp_path_factory.mktemp("world")
    d = lambda name: str(root / name)  # noqa: E731
    timings = {}
    one_eval = root / "one_eval.jsonl"  # an eval set smaller than the world size: process 1's share is empty
    with open("data/tiny/unpaired_eval.jsonl", encoding="utf-8") as f:
        one_eval.write_text(f.readline())
    tiny_eval = [f"data.eval={one_eval}", "max_steps=2"]
    t0 = time.time()
    # 1. One process, per-device batch 2B.
    for name in STAGES:
        assert run_job({"argv": stage_argv(name, d(f"{name}-1"), 1)}) == 0, name
    assert run_job({"argv": stage_argv("kto", d("kto-tiny-eval-1"), 1, *tiny_eval)}) == 0
    assert run_job({"argv": stage_argv("sft", d("nan-1"), 1, *NAN["extra"]), "nan": {"rank": None, **NAN["nan"]}}) == 2
    assert run_job({"argv": RFT + [f"output_dir={d('rft-1')}", "optim.per_device_batch_size=8"]}) == 0
    assert run_job({"argv": EVAL + [f"output_dir={d('eval-1')}", f"model.name_or_path={d('sft-1')}"]}) == 0
    assert run_job({"argv": RED_TEAM_ALONE + [f"output_dir={d('red-team-1')}", f"model.name_or_path={d('sft-1')}"]}) == 0
    timings["1 process"] = time.time() - t0
    # 2. Two processes, per-device batch B: fresh runs, resumed copies of the 1-process runs (1 -> 2) and of a
    # 2-process run (2 -> 2), the NaN on rank 1 only, RFT and eval.
    jobs = [{"argv": stage_argv(name, d(f"{name}-2"), 2)} for name in STAGES]
    jobs += [{"copy": [d(f"{name}-1"), d(f"{name}-1to2")], "argv": stage_argv(name, d(f"{name}-1to2"), 2, "resume=true")}
             for name in STAGES]
    jobs += [{"copy": [d("sft-2"), d("sft-2to2")], "argv": stage_argv("sft", d("sft-2to2"), 2, "resume=true")}]
    jobs += [{"argv": stage_argv("kto", d("kto-tiny-eval-2"), 2, *tiny_eval)}]
    jobs += [{"argv": stage_argv("sft", d("nan-2"), 2, *NAN["extra"]), "nan": {"rank": 1, **NAN["nan"]}}]
    jobs += [{"argv": RFT + [f"output_dir={d('rft-2')}", f"optim.per_device_batch_size={B}"]}]
    jobs += [{"copy": [d("rft-1"), d("rft-1to2")], "argv": RFT + [f"output_dir={d('rft-1to2')}", f"optim.per_device_batch_size={B}", "resume=true"]}]
    jobs += [{"argv": EVAL + [f"output_dir={d('eval-2')}", f"model.name_or_path={d('sft-1')}"]}]
    jobs += [{"argv": RED_TEAM_ALONE + [f"output_dir={d('red-team-2')}", f"model.name_or_path={d('sft-1')}"]}]
    expected = [0] * (len(jobs) - 5) + [2, 0, 0, 0, 0]
    jobs_file, results = root / "jobs.json", root / "results"
    jobs_file.write_text(json.dumps(jobs))
    results.mkdir()
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", 
           "PYTHONPATH": os.pathsep.join([ROOT, HERE])}  # this checkout's rlhfkit, whatever is installed
    t1 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), os.path.join(HERE, "driver.py"), str(jobs_file), str(results)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    timings["2 processes"] = time.time() - t1
    codes = [json.loads((results / f"rank{r}.json").read_text()) if (results / f"rank{r}.json").exists() else None
             for r in (0, 1)]
    assert codes == [expected, expected], f"exit codes {codes}, expected {expected}\n{proc.stderr[-6000:]}"
    # 3. Resumed at 1 process from the 2-process runs' checkpoints (2 -> 1).
    t2 = time.time()
    for name in STAGES:
        job = {"copy": [d(f"{name}-2"), d(f"{name}-2to1")], "argv": stage_argv(name, d(f"{name}-2to1"), 1, "resume=true")}
        assert run_job(job) == 0, name
    timings["2 -> 1 resumes"] = time.time() - t2
    print("timings:", {k: f"{v:.1f}s" for k, v in timings.items()})
    return {"dir": d, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_two_processes_equal_one_with_the_same_global_batch(runs, name):
    one, two = runs["dir"](f"{name}-1"), runs["dir"](f"{name}-2")
    r1, r2 = rows(one), rows(two)
    # Every logged step once (one writer), a global mean on each.
    assert [r["step"] for r in r2] == [1, 2, 2, 3, 4, 4]
    assert_same_rows(r1, r2)
    assert_same_weights(one, two)
    assert sorted(e for e in os.listdir(two) if e.startswith("checkpoint-")) == ["checkpoint-2"]
    assert_same_weights(os.path.join(one, "checkpoint-2", "model"), os.path.join(two, "checkpoint-2", "model"))


@pytest.mark.parametrize("name", sorted(STAGES))
@pytest.mark.parametrize("how", ["1to2", "2to1"])
def test_resume_at_a_different_world_size(runs, name, how):
    """Data order is a function of the step and the global batch: resumed at the other world size, the run ends as
    the uninterrupted one."""
    target = runs["dir"](f"{name}-{how[-1]}")
    resumed = runs["dir"](f"{name}-{how}")
    assert_same_rows(rows(target), rows(resumed))
    assert_same_weights(target, resumed)


def test_eval_set_smaller_than_the_world(runs):
    """One eval example for two processes: the one with none adds zeros to the same sums (and joins KTO's z0)."""
    r1, r2 = rows(runs["dir"]("kto-tiny-eval-1")), rows(runs["dir"]("kto-tiny-eval-2"))
    assert [r["step"] for r in r2] == [1, 2, 2] and "eval/loss" in r2[-1]
    assert_same_rows(r1, r2)


def test_resume_at_the_same_world_size(runs):
    assert_same_rows(rows(runs["dir"]("sft-2")), rows(runs["dir"]("sft-2to2")), rel=0, abs_=0)
    assert_same_weights(runs["dir"]("sft-2"), runs["dir"]("sft-2to2"), atol=0)


def test_nan_on_one_process_skips_the_step_on_both(runs):
    """Rank 1 alone gets a NaN loss at steps 2 and 3: both processes skip both updates and max_bad_steps=2 stops
    both with exit status 2 (checked in the fixture), exactly like one process whose loss is NaN at those steps."""
    one, two = runs["dir"]("nan-1"), runs["dir"]("nan-2")
    r1, r2 = rows(one), rows(two)
    assert [r["step"] for r in r2] == [1, 2, 2]
    assert r2[1]["faults/skipped_total"] == 1 and r2[1]["grad_norm"] is None
    # The NaN enters through the embeddings' output (tests/hooks.py), so a skipped step's token accuracy is over NaN
    # logits on the poisoned process only: every row of the one-process run, rank 1's half with two. It is no figure
    # of the model; everything else of the step (skip count, lr, the loss's null) must match.
    skipped = lambda rs: [{k: v for k, v in r.items() if not (r["step"] == 2 and k == "mean_token_accuracy")} for r in rs]  # noqa: E731
    assert_same_rows(skipped(r1), skipped(r2))
    assert_same_weights(os.path.join(one, "checkpoint-2", "model"), os.path.join(two, "checkpoint-2", "model"))
    assert "stopping at step 3: 2 optimizer steps skipped" in runs["stderr"]


def test_rft_best_of_n_per_process_then_gathered(runs):
    """Sampling batch i is drawn under its own seed by whichever process holds it: the kept samples, the logged
    scores and the fine-tuned weights do not depend on the world size."""
    one, two = runs["dir"]("rft-1"), runs["dir"]("rft-2")
    for it in (1, 2):
        k1 = open(os.path.join(one, f"rft_iter{it}.jsonl")).read().splitlines()
        k2 = open(os.path.join(two, f"rft_iter{it}.jsonl")).read().splitlines()
        assert len(k1) == 32 and [json.loads(x)["completion"] for x in k1] == [json.loads(x)["completion"] for x in k2]
    assert_same_rows(rows(one), rows(two))
    assert_same_weights(one, two)
    resumed = runs["dir"]("rft-1to2")
    assert_same_rows(rows(two), rows(resumed))
    assert_same_weights(two, resumed)


def test_eval_report_written_once_over_every_prompt(runs):
    one, two = runs["dir"]("eval-1"), runs["dir"]("eval-2")
    r1 = json.load(open(os.path.join(one, "eval.json")))
    r2 = json.load(open(os.path.join(two, "eval.json")))
    assert r2["num_prompts"] == 40 and r2["num_samples"] == 80
    assert r1 == r2
    red = r2["red_team"]  # the red-team section too: the same responses, judged the same
    assert red["num_prompts"] == 16 and red["policy"]["responses"] == red["reference"]["responses"] == 32
    assert 0 < red["policy"]["harmful"] + red["reference"]["harmful"] < 64  # the judge tells responses apart
    assert runs["stdout"].count("KL(policy||ref) nats") == 1  # the summary table, printed by one process


def test_red_teaming_alone_at_two_processes_equals_one(runs):
    """`rlhfkit eval` red-teaming alone (no data.eval), its 3 batches shared out unevenly: the same eval.json."""
    r1, r2 = (json.load(open(os.path.join(runs["dir"](name), "eval.json"))) for name in ("red-team-1", "red-team-2"))
    assert r1 == r2 and r2["num_prompts"] == 0 and r2["red_team"]["num_prompts"] == 5
    assert r2["red_team"]["policy"]["responses"] == 10
