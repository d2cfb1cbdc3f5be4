"""DAPO's dynamic sampling in real runs of the tiny model (`rlhfkit grpo`, algo.algorithm=dapo): half the prompts give
groups without signal (tests.smoke.reward_fns:half_flat), so steps sample again; a run stopped and resumed equals the
uninterrupted one. N processes ≡ 1 is in tests/multiprocess/test_online_world_size.py."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback

from rlhfkit.stages import run_stage

ARGS = ["max_steps=4", "logging.progress_bar=false", "algo.algorithm=dapo", "algo.dynamic_filtering=true",
        "algo.max_sampling_rounds=4", "reward.function=tests.smoke.reward_fns:half_flat", "generation.max_new_tokens=8",
        "generation.num_samples=4", "optim.per_device_batch_size=8"]


def rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 2:
            control.should_training_stop = True


def test_steps_refill_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    whole, stopped = str(tmp_path / "whole"), str(tmp_path / "stopped")
    run_stage("grpo", "configs/grpo_tiny.yaml", ARGS + [f"output_dir={whole}"])
    logged = rows(whole)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert all(r["dynamic_sampling/rounds"] >= 2 and r["dynamic_sampling/dropped_groups"] >= 1 for r in logged)
    assert any(r["dynamic_sampling/filled_share"] == 1.0 for r in logged)
    run_stage("grpo", "configs/grpo_tiny.yaml", ARGS + [f"output_dir={stopped}"], callbacks=[StopAt()])
    run_stage("grpo", "configs/grpo_tiny.yaml", ARGS + [f"output_dir={stopped}", "resume=true"])
    measured = ("elapsed_s", "memory/peak_rss_gb")  # wall clock and resident memory differ run to run
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k not in measured}  # noqa: E731
    assert [strip(r) for r in rows(stopped)] == [strip(r) for r in logged]
