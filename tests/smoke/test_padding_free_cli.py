"""`data.padding_free=true` through the real CLI on the shipped tiny configs: SFT, RM, DPO and ORPO run and log what
the padded run logs (the first step's metrics equal, the last ones close after a few optimizer steps); stages that do
not support it refuse it with one line."""

import json
import os

import pytest

from rlhfkit.cli import main

RUNS = {
    "sft": ["sft", "--config", "configs/sft_tiny.yaml"],
    "rm": ["rm", "--config", "configs/rm_tiny.yaml"],
    "dpo": ["dpo", "--config", "configs/dpo_tiny.yaml"],
    "orpo": ["orpo", "--config", "configs/orpo_tiny.yaml"],
}
SHORT = ["max_steps=4", "logging.logging_steps=1", "logging.eval_steps=0", "logging.progress_bar=false"]


def read_metrics(run_dir):
    """Each logged line's metrics but the wall-clock time."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"} for line in f]


@pytest.mark.parametrize("stage", sorted(RUNS))
def test_padding_free_run_logs_what_the_padded_run_logs(tmp_path, stage):
    runs = {}
    for padding_free in (False, True):
        out = str(tmp_path / f"padding_free_{padding_free}")
        assert main(RUNS[stage] + SHORT + [f"output_dir={out}", f"data.padding_free={str(padding_free).lower()}"]) == 0
        runs[padding_free] = read_metrics(out)
    padded, flat = runs[False], runs[True]
    assert [m["step"] for m in flat] == [m["step"] for m in padded]
    for k, v in padded[0].items():  # step 1: the same weights, so the same loss and metrics
        assert flat[0][k] == pytest.approx(v, rel=1e-5, abs=1e-5), (stage, k)
    final = next(m for m in reversed(padded) if "eval/loss" in m)
    final_flat = next(m for m in reversed(flat) if "eval/loss" in m)
    for k, v in final.items():  # a few Adam steps later: close, not bit-equal (sums in another order)
        assert final_flat[k] == pytest.approx(v, rel=1e-3, abs=1e-4), (stage, k)


@pytest.mark.parametrize("args", [
    ["kto", "--config", "configs/kto_tiny.yaml"],
    ["grpo", "--config", "configs/grpo_tiny.yaml"],
    ["rft", "--config", "configs/rft_tiny.yaml"],
    ["eval", "--config", "configs/eval_tiny.yaml"],
    ["sft", "--config", "configs/sft_tiny.yaml", "data.packing=true"],
], ids=["kto", "grpo", "rft", "eval", "with_packing"])
def test_unsupported_stage_refuses_padding_free_in_one_line(tmp_path, capsys, args):
    assert main(args + [f"output_dir={tmp_path / 'run'}", "data.padding_free=true"]) == 2
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("rlhfkit: error:")]
    assert len(errors) == 1 and "config key 'data.padding_free'" in errors[0], errors
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("args", [
    ["rm", "--config", "configs/rm_tiny.yaml"],
    ["dpo", "--config", "configs/dpo_tiny.yaml"],
    ["kto", "--config", "configs/kto_tiny.yaml"],
    ["orpo", "--config", "configs/orpo_tiny.yaml"],
    ["grpo", "--config", "configs/grpo_tiny.yaml"],
    ["rft", "--config", "configs/rft_tiny.yaml"],
], ids=["rm", "dpo", "kto", "orpo", "grpo", "rft"])
def test_packing_outside_sft_is_refused_in_one_line(tmp_path, capsys, args):
    """data.packing packs SFT examples; the other stages ignored it silently (the run trained unpacked)."""
    assert main(args + [f"output_dir={tmp_path / 'run'}", "data.packing=true"]) == 2
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("rlhfkit: error:")]
    assert len(errors) == 1 and "config key 'data.packing' is supported by the sft stage only" in errors[0], errors
    assert not os.path.exists(tmp_path / "run")
