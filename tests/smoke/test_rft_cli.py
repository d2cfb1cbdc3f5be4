"""`rlhfkit rft` through the real CLI on the shipped tiny config: best-of-4 by a Python reward, two iterations."""

import json
import math
import shutil

import pytest

from rlhfkit.cli import main

CONFIG = "configs/rft_tiny.yaml"


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of the tiny config, with a checkpoint after iteration 1 (for the resume test)."""
    out = tmp_path_factory.mktemp("rft") / "run"
    assert main(["rft", "--config", CONFIG, f"output_dir={out}", "logging.progress_bar=false", "logging.save_steps=1",
                 "logging.save_total_limit=20"]) == 0
    return out


def iteration_rows(out):
    return [m for m in read_jsonl(out / "metrics.jsonl") if "rft/mean_score_all" in m]


def test_best_of_n_moves_the_policy(run):
    rows = iteration_rows(run)
    assert [m["rft/iteration"] for m in rows] == [1, 2]
    for m in rows:
        assert m["rft/mean_score_best"] >= m["rft/mean_score_all"]
        assert m["rft/best_of_n_kl_bound"] == pytest.approx(math.log(4) - 3 / 4, abs=1e-12)
        assert m["rft/kept"] == 128
    # Iterative RLHF: iteration 2 samples from the policy fine-tuned on iteration 1's best, and scores higher.
    assert rows[1]["rft/mean_score_all"] > rows[0]["rft/mean_score_all"], rows
    train = [m for m in read_jsonl(run / "metrics.jsonl") if "loss" in m]
    assert train and {"loss", "mean_token_accuracy", "lr", "grad_norm"} <= set(train[-1])


def test_kept_samples_are_written_per_iteration(run):
    rows = iteration_rows(run)
    for i, m in enumerate(rows, start=1):
        kept = read_jsonl(run / f"rft_iter{i}.jsonl")
        assert len(kept) == m["rft/kept"]
        assert set(kept[0]) == {"prompt", "completion", "score"}
        assert kept[0]["prompt"].strip() and kept[0]["completion"]
        # With no min_score every prompt keeps its best sample: their mean is the logged best-of-n mean.
        assert sum(r["score"] for r in kept) / len(kept) == pytest.approx(m["rft/mean_score_best"], rel=1e-5)


def test_final_model_reloads(run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run)
    tok = AutoTokenizer.from_pretrained(run)
    ids = tok("Review the lamp Sado.", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert (run / "config.yaml").exists()


def test_dashboard_and_report_are_written(run):
    from PIL import Image

    with Image.open(run / "dashboard.png") as im:
        assert im.format == "PNG" and im.width > 100
    page = (run / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 1  # the dashboard, embedded
    assert "rft/mean_score_best" in page and "iterations: 2" in page  # final metrics and the resolved config


@pytest.mark.parametrize("at", [8, 13], ids=["iteration_boundary", "mid_iteration"])
def test_resume_reproduces_the_run(run, tmp_path, at):
    """Resuming from checkpoint-8 (the end of iteration 1: 128 kept samples in batches of 16) logs iteration 2
    exactly as the whole run did; from checkpoint-13, the rest of iteration 2's fine-tuning."""
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    for d in resumed.glob("checkpoint-*"):
        if int(d.name.split("-")[1]) > at:
            shutil.rmtree(d)
    assert main(["rft", "--config", CONFIG, f"output_dir={resumed}", "logging.progress_bar=false", "logging.save_steps=1",
                 "logging.save_total_limit=20", "resume=true"]) == 0
    # Wall clock and resident memory are measurements of each process, not of the run.
    strip = lambda rows: [{k: v for k, v in m.items() if k not in ("elapsed_s", "memory/peak_rss_gb")} for m in rows]  # noqa: E731
    expected, got = strip(read_jsonl(run / "metrics.jsonl")), strip(read_jsonl(resumed / "metrics.jsonl"))
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(got, expected):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6) for k in a)


def test_min_score_drops_prompts(tmp_path):
    out = tmp_path / "run"
    assert main(["rft", "--config", CONFIG, f"output_dir={out}", "logging.progress_bar=false", "algo.iterations=1",
                 "algo.prompts_per_iteration=8", "generation.max_new_tokens=8", "algo.min_score=0.1"]) == 0
    (row,) = iteration_rows(out)
    kept = read_jsonl(out / "rft_iter1.jsonl")
    assert len(kept) == row["rft/kept"] < 8
    assert all(r["score"] >= 0.1 for r in kept)


def test_normalised_rewards_are_refused_before_loading(tmp_path, capsys):
    assert main(["rft", "--config", CONFIG, f"output_dir={tmp_path / 'x'}", "reward.normalize=batch"]) == 2
    assert "reward.normalize" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
