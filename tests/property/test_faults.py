"""Faults in the offline stages and in the run directory.

- A non-finite loss or gradient skips the optimizer step in every offline stage (counted in `faults/skipped_total`);
  `max_bad_steps` of them stop the run with exit status 2 and the checkpoints intact.
- Non-finite weights are never saved, neither as a checkpoint nor as the final model.
- `metrics.jsonl` is strict JSON (non-finite values are null), and its readers tolerate null and a torn last line.
- Resuming a damaged run (a truncated newest checkpoint, stale temporary directories, an incomplete checkpoint, a
  half-written metrics line) falls back to the last intact checkpoint and reproduces the uninterrupted run.
- overwrite=true replaces an existing run only once the new run has written its first checkpoint.
"""

import hashlib
import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhfkit.cli import main
from rlhfkit.config import OnlineConfig, SFTConfig, load_config
from rlhfkit.errors import UserError
from rlhfkit.evaluation.dashboard import metric_series
from rlhfkit.evaluation.report import write_report
from rlhfkit.checkpoint import latest_checkpoint, save_checkpoint
from rlhfkit.trainers import rundir
from rlhfkit.trainers.rundir import RunDir
from rlhfkit.trainers.sinks import JsonlSink
from rlhfkit.trainers.sft import SFTTrainer
from tests.hooks import interrupt_after_step, nan_in_steps, nan_weights_after_step

FAST = ["logging.logging_steps=1", "logging.save_total_limit=10", "data.eval=null",
        "logging.progress_bar=false", "optim.per_device_batch_size=4", "optim.scheduler=constant", "optim.warmup_steps=0"]
STAGES = ["dpo", "kto", "orpo", "rm", "sft"]


def strict_rows(path):
    """The rows of a JSONL file under a strict parser: NaN, Infinity and -Infinity are not JSON."""

    def refuse(token):
        raise ValueError(f"{path}: non-standard JSON token {token}")

    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def weights(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def assert_same(a, b, atol=0.0):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def fingerprint(directory):
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            path = os.path.join(root, f)
            out[os.path.relpath(path, directory)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error:")]


# 1. Non-finite loss or gradient ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_nonfinite_step_is_skipped_in_every_offline_stage(stage, tmp_path):
    """Step 2 of 4 gets a NaN loss (a NaN in its forwards, so NaN gradients): its update is skipped — the weights and
    the optimizer state of checkpoint-2 equal checkpoint-1's, the schedule still advances — and the run goes on."""
    out = tmp_path / stage
    with nan_in_steps([2]):
        assert main([stage, "--config", f"configs/{stage}_tiny.yaml", f"output_dir={out}", "max_steps=4", *FAST,
                     "logging.save_steps=1"]) == 0

    rows = strict_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["faults/skipped_total"] for r in rows] == [0, 1, 1, 1]
    ckpt = {n: out / f"checkpoint-{n}" for n in (1, 2, 3)}
    assert_same(weights(ckpt[1] / "model"), weights(ckpt[2] / "model"))
    assert weights(ckpt[3] / "model").keys() == weights(ckpt[2] / "model").keys()
    assert any(not torch.equal(a, b) for a, b in zip(weights(ckpt[3] / "model").values(), weights(ckpt[2] / "model").values()))
    s1, s2 = (torch.load(ckpt[n] / "trainer_state.pt", weights_only=True) for n in (1, 2))
    for p, state in s1["optimizer"]["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(s2["optimizer"]["state"][p][k], v, rtol=0, atol=0)
    assert s2["scheduler"]["last_epoch"] == s1["scheduler"]["last_epoch"] + 1  # the schedule follows the step counter
    assert s2["bad_steps"] == 1
    assert all(torch.isfinite(t).all() for t in weights(out).values())


def test_nonfinite_gradient_with_finite_loss_is_skipped(tmp_path):
    """A finite loss whose gradient is NaN (caught by the gradient norm) is skipped too."""
    out = tmp_path / "run"
    with nan_in_steps([2], gradient=True):
        assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=3",
                     "optim.max_grad_norm=null", *FAST, "logging.save_steps=1"]) == 0
    rows = strict_rows(out / "metrics.jsonl")
    assert [r["faults/skipped_total"] for r in rows] == [0, 1, 1]
    assert math.isfinite(rows[1]["loss"])
    assert_same(weights(out / "checkpoint-1" / "model"), weights(out / "checkpoint-2" / "model"))


def test_infinite_rm_margin_stops_the_run_after_max_bad_steps(tmp_path, capsys):
    """A margin of 1e39 overflows float32: loss = inf on every step (with finite gradients). The run stops at the
    second bad step with one error line and writes no final model."""
    rows = [json.loads(line) for line in open("data/tiny/pref_train.jsonl")][:32]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({**r, "margin": 1e39}) + "\n" for r in rows))
    out = tmp_path / "rm"
    code = main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={out}", f"data.train={data}", "max_steps=6",
                 "max_bad_steps=2", *FAST, "logging.save_steps=1"])
    errors = error_lines(capsys)
    assert code == 2 and len(errors) == 1, errors
    assert "stopping at step 2" in errors[0] and "2 optimizer steps skipped" in errors[0] and "max_bad_steps=2" in errors[0]
    assert str(out) in errors[0] and "checkpoint-1" in errors[0]
    assert not (out / "model.safetensors").exists()
    assert [r["loss"] for r in strict_rows(out / "metrics.jsonl")] == [None]
    init = weights(out / "checkpoint-1" / "model")
    assert all(torch.isfinite(t).all() for t in init.values())


def test_diverged_sft_stops_without_saving_nonfinite_weights(tmp_path, capsys):
    """lr = 1e30: the first update blows the weights up, every later loss is non-finite. Exit 2, no final model."""
    out = tmp_path / "sft"
    code = main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=8", "optim.lr=1e30", *FAST, "logging.save_steps=1"])
    errors = error_lines(capsys)
    assert code == 2 and len(errors) == 1 and "max_bad_steps=3" in errors[0], errors
    assert not (out / "model.safetensors").exists()
    rows = strict_rows(out / "metrics.jsonl")
    assert rows[-1]["faults/skipped_total"] == 2  # the third bad step stops the run before it is logged
    for ckpt in out.glob("checkpoint-*"):
        assert all(torch.isfinite(t).all() for t in weights(ckpt / "model").values()), ckpt


def test_max_bad_steps_is_one_top_level_key():
    cfg = load_config(SFTConfig, "configs/sft_tiny.yaml", ["max_bad_steps=5"])
    assert cfg.max_bad_steps == 5
    assert load_config(OnlineConfig, "configs/ppo_tiny.yaml", ["max_bad_steps=2"]).max_bad_steps == 2
    with pytest.raises(UserError, match="algo.max_bad_steps"):
        load_config(OnlineConfig, "configs/ppo_tiny.yaml", ["algo.max_bad_steps=2"])
    with pytest.raises(UserError, match="max_bad_steps"):
        load_config(SFTConfig, "configs/sft_tiny.yaml", ["max_bad_steps=0"])


# 2. Non-finite weights are never saved ---------------------------------------------------------------------------


def _save_tensors(tensors):
    def save(directory):
        os.makedirs(directory)
        save_file(tensors, os.path.join(directory, "model.safetensors"))

    return save


def test_checkpoint_with_nonfinite_weights_is_refused(tmp_path):
    good = _save_tensors({"w": torch.ones(3)})
    save_checkpoint(str(tmp_path), 1, good, {"x": torch.zeros(1)}, keep=2)
    before = fingerprint(tmp_path)
    bad = _save_tensors({"w": torch.tensor([1.0, float("inf"), 0.0]), "v": torch.ones(2)})
    with pytest.raises(UserError) as info:
        save_checkpoint(str(tmp_path), 2, bad, {"x": torch.zeros(1)}, keep=1)
    assert str(tmp_path) in str(info.value) and "'w'" in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"] and fingerprint(tmp_path) == before


def test_final_model_with_nonfinite_weights_is_refused(tmp_path, capsys):
    """A run resumed from a finished one whose weights turn NaN in its last step: exit 2, and the model the earlier
    run saved in output_dir (and its checkpoints) are left as they were."""
    out = tmp_path / "sft"
    args = ["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", *FAST, "logging.save_steps=1"]
    assert main(args + ["max_steps=2"]) == 0
    before = fingerprint(out)
    capsys.readouterr()
    with nan_weights_after_step(1):  # the resumed run's one step, its last
        assert main(args + ["max_steps=2", "resume=true"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and str(out) in errors[0] and "final model" in errors[0], errors
    after = fingerprint(out)
    for name in ("model.safetensors", "checkpoint-1/trainer_state.pt", "checkpoint-1/model/model.safetensors"):
        assert after[name] == before[name], name
    assert not [e for e in os.listdir(out) if e.startswith(".tmp-")]


# 3. metrics.jsonl is strict JSON ---------------------------------------------------------------------------------


def test_metrics_jsonl_writes_nonfinite_values_as_null(tmp_path):
    logger = JsonlSink(str(tmp_path))
    logger.log(1, {"loss": 0.5, "grad_norm": float("nan")})
    logger.log(2, {"loss": float("inf"), "grad_norm": -float("inf")})
    logger.log(3, {"loss": 0.25, "grad_norm": 1.0})
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 1, "loss": 0.5, "grad_norm": None}, {"step": 2, "loss": None, "grad_norm": None},
                    {"step": 3, "loss": 0.25, "grad_norm": 1.0}]
    # The dashboard draws a null as a gap in its curve; the report reads the run.
    steps, values = metric_series(rows)["loss"]
    assert steps == [1, 2, 3] and values[0] == 0.5 and math.isnan(values[1]) and values[2] == 0.25
    (tmp_path / "config.yaml").write_text(f"output_dir: {tmp_path}\n")
    assert os.path.isfile(write_report(str(tmp_path)))


def test_report_tolerates_a_torn_samples_line(tmp_path):
    (tmp_path / "config.yaml").write_text(f"output_dir: {tmp_path}\n")
    (tmp_path / "samples.jsonl").write_text(
        json.dumps({"step": 1, "prompt": "p", "response": "r", "score": None, "kl": 0.0}) + "\n" + '{"step": 2, "pro')
    with open(write_report(str(tmp_path)), encoding="utf-8") as f:
        assert "step 1" in f.read()


# 4. Resume from a damaged run ------------------------------------------------------------------------------------


def _fake_checkpoint(out, step, files):
    """checkpoint-{step} with a loadable trainer_state.pt and the given safetensors files (relative path -> tensors)."""
    path = out / f"checkpoint-{step}"
    for rel, tensors in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / rel))
    torch.save({"step": step, "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}}}, path / "trainer_state.pt")
    return path


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model/adapter_model.safetensors", "value_model/critic.safetensors"])
def test_latest_checkpoint_skips_a_truncated_newest_one(damaged, tmp_path, caplog):
    files = {"model/adapter_model.safetensors": {"a": torch.ones(64, 64)}, "value_model/critic.safetensors": {"h": torch.ones(64)}}
    _fake_checkpoint(tmp_path, 2, files)
    newest = _fake_checkpoint(tmp_path, 4, files)
    _truncate(newest / damaged)
    (tmp_path / "checkpoint-6" / "model").mkdir(parents=True)  # pruning interrupted: no trainer_state.pt
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoint-4" in warning and damaged.split("/")[-1] in warning


def test_prepare_trims_metrics_and_samples_and_removes_leftovers(tmp_path, caplog):
    cfg = load_config(OnlineConfig, "configs/ppo_tiny.yaml", [f"output_dir={tmp_path}", "resume=true"])
    rows = "".join(json.dumps({"step": s, "loss": None if s == 2 else 1.0 / s}) + "\n" for s in (1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 5, "lo')  # the half-written line of a killed run
    samples = "".join(json.dumps({"step": s, "prompt": "p", "response": "r", "score": 1.0, "kl": 0.0}) + "\n" for s in (1, 1, 2, 4))
    (tmp_path / "samples.jsonl").write_text(samples + '{"step": 5, "prompt": "p", "resp')
    _fake_checkpoint(tmp_path, 2, {"model/model.safetensors": {"w": torch.ones(2)}})
    _fake_checkpoint(tmp_path, 4, {"model/model.safetensors": {"w": torch.ones(2)}})  # damaged: newer than the resume step
    (tmp_path / "checkpoint-3" / "model").mkdir(parents=True)  # interrupted pruning
    (tmp_path / ".tmp-checkpoint-5-abc" / "model").mkdir(parents=True)  # interrupted save
    (tmp_path / ".tmp-checkpoint-5-abc" / "model" / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".tmp-model-xyz").mkdir()
    RunDir(cfg).prepare(2)
    assert [r["step"] for r in strict_rows(tmp_path / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in strict_rows(tmp_path / "samples.jsonl")] == [1, 1, 2]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "config.yaml", "metrics.jsonl", "samples.jsonl"]
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert ".tmp-checkpoint-5-abc" in warning and "checkpoint-3" in warning and "half-written" in warning


def test_pruning_killed_midway_leaves_no_incomplete_checkpoint(tmp_path, monkeypatch):
    save = _save_tensors({"w": torch.ones(3)})
    save_checkpoint(str(tmp_path), 1, save, {"x": torch.zeros(1)}, keep=1)

    def killed_rmtree(path, ignore_errors=False):
        """Deletes trainer_state.pt (as a real rmtree may do first), then the process dies."""
        for root, _, files in os.walk(path):
            if "trainer_state.pt" in files:
                os.unlink(os.path.join(root, "trainer_state.pt"))
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir.shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), 2, save, {"x": torch.zeros(1)}, keep=1)
    for ckpt in tmp_path.glob("checkpoint-*"):
        assert (ckpt / "trainer_state.pt").is_file() and (ckpt / "model").is_dir(), sorted(os.listdir(ckpt))
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


@pytest.fixture(scope="module")
def finished_sft(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "full"
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=4", *FAST, "logging.save_steps=1"]) == 0
    return out


@pytest.mark.parametrize("damaged", ["trainer_state.pt", "model/model.safetensors"])
def test_resume_from_a_damaged_run_reproduces_the_uninterrupted_one(damaged, finished_sft, tmp_path, capsys):
    """The newest checkpoint truncated, a torn metrics line, a stale temporary checkpoint and model, an incomplete
    checkpoint: resume=true falls back to checkpoint-2, cleans up, and ends where the uninterrupted run ended."""
    out = tmp_path / "damaged"
    shutil.copytree(finished_sft, out)
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            os.unlink(out / name)  # the killed run never wrote its final model
    _truncate(out / "checkpoint-3" / damaged)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 0.')
    shutil.copytree(out / "checkpoint-2", out / ".tmp-checkpoint-4-q1w2")
    (out / ".tmp-model-e3r4" / "model").mkdir(parents=True)
    (out / "checkpoint-9" / "model").mkdir(parents=True)
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=4", "resume=true", *FAST, "logging.save_steps=1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any("checkpoint-3" in line and damaged.split("/")[-1] in line and "skipping" in line for line in err), err
    assert_same(weights(finished_sft), weights(out), atol=1e-6)
    # Wall clock and resident memory are measurements of each process, not of the run.
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("elapsed_s", "memory/peak_rss_gb")} for r in rows]  # noqa: E731
    assert strip(strict_rows(out / "metrics.jsonl")) == strip(strict_rows(finished_sft / "metrics.jsonl"))
    assert not [e for e in os.listdir(out) if e.startswith(".tmp-")] and not (out / "checkpoint-9").exists()


def test_resume_from_the_last_checkpoint_finishes_the_pruning_a_kill_cut_short(finished_sft, tmp_path, capsys):
    """A kill after the last checkpoint was renamed into place and before the oldest was pruned leaves one checkpoint
    over logging.save_total_limit=2. The resumed run saves no checkpoint after it (the last step ends in the final
    model), so resuming itself finishes the pruning: the run ends with the checkpoints the uninterrupted one keeps.
    (The kill test met this moment by chance: a stale checkpoint-2 beside checkpoint-3 and checkpoint-4.)"""
    out = tmp_path / "killed"
    shutil.copytree(finished_sft, out)  # checkpoint-1..3 (save_total_limit=10): what the kill leaves with a limit of 2
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            os.unlink(out / name)  # the killed run never wrote its final model
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=4", "resume=true", *FAST,
                 "logging.save_steps=1", "logging.save_total_limit=2"]) == 0
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    assert "checkpoint-1 (over logging.save_total_limit=2" in capsys.readouterr().err
    assert_same(weights(finished_sft), weights(out))


# 5. overwrite=true replaces a run only once the new one has a checkpoint -----------------------------------------


@pytest.fixture
def previous_run(tmp_path):
    out = tmp_path / "previous"
    (out / "checkpoint-7" / "model").mkdir(parents=True)
    (out / "checkpoint-7" / "trainer_state.pt").write_bytes(b"state")
    (out / "config.yaml").write_text("seed: 1\n")
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 2.0}\n')
    (out / "model.safetensors").write_bytes(b"weights")
    return out


def test_overwrite_keeps_the_previous_run_if_the_new_one_stops_before_a_checkpoint(previous_run):
    before = fingerprint(previous_run)
    with interrupt_after_step(1):
        code = main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={previous_run}", "overwrite=true", "max_steps=4",
                 *FAST, "logging.save_steps=2"])
    assert code == 130
    assert fingerprint(previous_run) == before
    assert sorted(os.listdir(previous_run.parent)) == ["previous"]


def test_overwrite_replaces_the_previous_run_at_the_first_checkpoint(previous_run):
    with interrupt_after_step(2):
        code = main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={previous_run}", "overwrite=true", "max_steps=4",
                 *FAST, "logging.save_steps=2"])
    assert code == 130
    assert sorted(os.listdir(previous_run)) == ["checkpoint-2", "config.yaml", "metrics.jsonl", "plan.json"]
    assert sorted(os.listdir(previous_run.parent)) == ["previous"]


def test_a_killed_overwrite_puts_the_previous_run_back_at_the_next_start(previous_run):
    """A kill -9 after the new run moved the old one aside (before its first checkpoint) runs no cleanup: the next
    start on that output_dir puts the previous run back before looking at it."""
    before = fingerprint(previous_run)
    RunDir(load_config(SFTConfig, "configs/sft_tiny.yaml", [f"output_dir={previous_run}", "overwrite=true"])).prepare(None)
    assert "model.safetensors" not in os.listdir(previous_run)  # the new run has started; the old one is aside
    with pytest.raises(UserError, match="holds another run"):
        SFTTrainer(load_config(SFTConfig, "configs/sft_tiny.yaml", [f"output_dir={previous_run}"]))
    assert fingerprint(previous_run) == before
    assert sorted(os.listdir(previous_run.parent)) == ["previous"]


# 6. A run that fails before its first logged step leaves nothing behind ------------------------------------------


def test_a_failure_before_the_first_step_writes_nothing(tmp_path, capsys, monkeypatch):
    """A reward function that raises at step 1: exit 2, and output_dir is as it was (absent), so the same command
    with the function fixed runs without overwrite=true."""
    (tmp_path / "bad_reward.py").write_text("def reward(prompts, completions):\n    raise KeyError('answer')\n")
    (tmp_path / "good_reward.py").write_text("def reward(prompts, completions):\n    return [1.0 * len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    args = ["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "max_steps=1", "logging.progress_bar=false",
            "algo.rollout_batch_size=2"]
    assert main(args + ["reward.function=bad_reward:reward"]) == 2
    errors = error_lines(capsys)
    assert len(errors) == 1 and "bad_reward:reward" in errors[0] and "KeyError" in errors[0], errors
    assert not out.exists()
    assert main(args + ["reward.function=good_reward:reward"]) == 0


def test_a_failure_after_logged_steps_keeps_the_run(tmp_path):
    out = tmp_path / "run"
    with interrupt_after_step(2):
        assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=4", *FAST]) == 130
    assert [r["step"] for r in strict_rows(out / "metrics.jsonl")] == [1, 2]
    assert (out / "config.yaml").is_file()
