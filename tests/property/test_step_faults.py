"""Faults that used to differ between the loops, each checked through a public seam.

- A skipped online step advances the learning-rate schedule as an offline skip does: the lr is a function of the step.
- Under fp16 a skipped step closes the loss scaler (`optimizer_step` with `torch.amp.GradScaler` on CPU).
- A resumed run logs the same windowed means as the uninterrupted one: the checkpoint carries the partial window.
- An output_dir whose parent cannot hold the lock file is one line, exit 2.
- Model-structure errors (LoRA targets, model.num_layers) come before the data is read.
"""

import json
import shutil

import pytest
import torch

from rlhfkit.cli import main

QUIET = ["logging.progress_bar=false"]


def rows(run_dir):
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error:")]


def test_skipped_online_step_advances_the_lr_schedule(tmp_path, monkeypatch):
    """GRPO, linear schedule over 6 steps, the reward NaN on the 3rd scoring call (step 3): the lr logged at every
    later step equals the run without the fault, and exactly one step was skipped."""
    (tmp_path / "nan_at_third_call.py").write_text(
        "calls = []\n"
        "def reward(prompts, completions):\n"
        "    calls.append(1)\n"
        "    return [float('nan') if len(calls) == 3 else float(len(c)) for c in completions]\n")
    (tmp_path / "plain.py").write_text(
        "def reward(prompts, completions):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=6", "optim.scheduler=linear", "optim.warmup_steps=0",
            "algo.rollout_batch_size=2", "optim.per_device_batch_size=8", "generation.max_new_tokens=8", *QUIET]
    assert main(args + [f"output_dir={tmp_path / 'clean'}", "reward.function=plain:reward"]) == 0
    assert main(args + [f"output_dir={tmp_path / 'fault'}", "reward.function=nan_at_third_call:reward"]) == 0
    clean, fault = rows(tmp_path / "clean"), rows(tmp_path / "fault")
    assert [r["faults/skipped_total"] for r in fault] == [0, 0, 1, 1, 1, 1]
    assert [r["lr"] for r in fault] == pytest.approx([r["lr"] for r in clean], rel=1e-9)
    assert fault[-1]["lr"] == pytest.approx(1e-3 / 6, rel=1e-6)  # 1e-3 · (1 − 5/6): five steps done of six


def test_skipped_step_closes_the_fp16_scaler():
    """A skipped step after the scaler unscaled the gradients (as clipping does), then a normal step: no
    "unscale_() has already been called", the schedule advanced twice, the weights moved once."""
    from rlhfkit.trainers.optim import Fault, Optim, optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (k + 1))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)

    def clip(max_norm):
        scaler.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    optim = Optim(optimizer, scheduler, clip, max_grad_norm=1.0, scaler=scaler, max_bad_steps=3)
    before = model.weight.detach().clone()
    x = torch.ones(2, 3)
    scaler.scale(model(x).sum() * float("nan")).backward()
    first = optimizer_step(optim, step=1, fault=Fault.LOSS)
    assert first.fault is Fault.LOSS and optim.bad_steps == 1
    assert torch.equal(model.weight, before) and all(p.grad is None for p in model.parameters())
    scaler.scale(model(x).sum()).backward()
    second = optimizer_step(optim, step=2)
    assert second.fault is None and optim.bad_steps == 1
    assert not torch.equal(model.weight, before)
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


def test_resumed_run_logs_the_same_window_as_the_uninterrupted_one(tmp_path):
    """logging_steps=4, save_steps=3: step 8's row is the mean over steps 5-8 whether or not the run was resumed
    from checkpoint-6 (which holds steps 5 and 6 of that window)."""
    args = ["sft", "--config", "configs/sft_tiny.yaml", "max_steps=8", "logging.logging_steps=4", "logging.save_steps=3",
            "data.eval=null", *QUIET]
    full = tmp_path / "full"
    assert main(args + [f"output_dir={full}"]) == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)  # what a run killed after checkpoint-6 left, plus files the resume rewrites
    assert main(args + [f"output_dir={resumed}", "resume=true"]) == 0
    a, b = rows(full), rows(resumed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [4, 8]
    assert b[-1]["loss"] == pytest.approx(a[-1]["loss"], abs=1e-6)


def test_output_dir_whose_lock_cannot_be_written_is_one_line(capsys):
    code = main(["sft", "--config", "configs/sft_tiny.yaml", "output_dir=/proc/rlhfkit-no-such-dir/run", "max_steps=1", *QUIET])
    errors = error_lines(capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "/proc/rlhfkit-no-such-dir/run" in errors[0]


@pytest.mark.parametrize("override, expected", [
    ("model.lora.target_modules=[qkv]", "config key 'model.lora.target_modules': ['qkv'] matches no module"),
    ("model.num_layers=99", "config key 'model.num_layers'"),
])
def test_model_structure_errors_come_before_the_data(override, expected, tmp_path, capsys):
    """The data file is malformed: had it been read first, its error would be the one reported."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    extra = ["model.lora.enabled=true"] if "lora" in override else []
    code = main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={tmp_path / 'run'}", f"data.train={bad}",
                 "data.eval=null", override, *extra, *QUIET])
    errors = error_lines(capsys)
    assert code == 2 and len(errors) == 1, errors
    assert expected in errors[0] and "bad.jsonl" not in errors[0]
