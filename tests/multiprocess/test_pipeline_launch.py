"""A pipeline stage marked `launch:` runs under `accelerate launch` as 2 processes (CPU, gloo) and ends as the same
stage run in the pipeline's own process on the same global batch: the same logged rows, the same weights, the same
figures for its gate. Both reward models are wired from the pipeline's SFT stage, so the launched one also shows the
wiring crossing into the launched process (its effective config written for `accelerate launch`).

On CPU, `accelerate launch --cpu --num_processes 2` starts one process (rlhfkit refuses it: tests/multiprocess/
test_launch_cli.py); `--multi_gpu` with ACCELERATE_USE_CPU=1 in the environment starts two through torchrun and joins
them with gloo, which is what the pipeline's own process passes on to the launcher here."""

import json
import os
import subprocess
import sys

import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from common import assert_same_rows, assert_same_weights, free_port, rows  # noqa: E402

pytestmark = pytest.mark.slow
TIMEOUT_S = 300  # the whole pipeline; a hang fails the test instead of blocking the suite
B = 4  # per-process batch of the 2-process stage; the 1-process stage uses 2B
RM = {"max_steps": 4, "logging.logging_steps": 1, "logging.eval_steps": 2, "logging.save_steps": 2,
      "logging.progress_bar": False, "data.max_samples": 64, "optim.warmup_steps": 1}


def test_a_stage_launched_on_two_processes_equals_the_same_stage_in_one(tmp_path):
    out = tmp_path / "run"
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    pipeline = {"output_dir": str(out), "stages": [
        {"stage": "sft", "config": "configs/sft_tiny.yaml",
         "overrides": {"max_steps": 2, "logging.eval_steps": 2, "logging.progress_bar": False}},
        {"stage": "rm", "name": "rm_here", "config": "configs/rm_tiny.yaml", "gate": False,
         "overrides": {**RM, "optim.per_device_batch_size": 2 * B}},
        {"stage": "rm", "name": "rm_launched", "config": "configs/rm_tiny.yaml", "gate": False, "launch": launch,
         "overrides": {**RM, "optim.per_device_batch_size": B}}]}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))  # this checkout's rlhfkit
    proc = subprocess.run([sys.executable, "-m", "rlhfkit.cli", "pipeline", "--config", str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    printed = proc.stdout + proc.stderr
    assert proc.returncode == 0, printed[-4000:]
    # Launched as the file says, on two processes joined by gloo; the other stages in the pipeline's own process.
    assert "accelerate.commands.launch " + " ".join(launch) + " -m rlhfkit.cli rm --config" in printed
    assert printed.count("launch: world size 2, backend gloo, distributed type MULTI_CPU") == 1, printed[-4000:]
    assert printed.count("launch: world size 1") == 2
    here, launched = out / "rm_here", out / "rm_launched"
    with open(launched / "config.yaml") as f:
        assert yaml.safe_load(f)["model"]["name_or_path"] == str(out / "sft")  # wired into the launched process
    # N processes == 1 on the same global batch: every logged row (written once), the weights, and the checkpoint.
    assert [r["step"] for r in rows(launched)] == [1, 2, 2, 3, 4, 4]
    assert_same_rows(rows(here), rows(launched))
    assert_same_weights(here, launched)
    assert_same_weights(here / "checkpoint-2" / "model", launched / "checkpoint-2" / "model")
    state = json.loads((out / "pipeline.json").read_text())
    figures = {r["name"]: r["figures"] for r in state["records"]}
    assert figures["rm_launched"]["eval/accuracy"] == pytest.approx(figures["rm_here"]["eval/accuracy"])
    assert [r["status"] for r in state["records"]] == ["ran", "ran", "ran"]
