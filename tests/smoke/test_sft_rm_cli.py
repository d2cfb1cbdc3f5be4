"""The SFT and reward-model stages through the real CLI on the shipped tiny configs."""

import json
import os

import pytest
import torch

from rlhfkit.cli import main


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft") / "run")
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rm") / "run")
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={out}"]) == 0
    return out


def test_sft_loss_falls_and_model_loads(sft_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = [m for m in read_metrics(sft_run) if "loss" in m]
    assert train[-1]["loss"] < 0.6 * train[0]["loss"], [m["loss"] for m in train]
    evals = [m["eval/loss"] for m in read_metrics(sft_run) if "eval/loss" in m]
    assert evals[-1] < evals[0]
    model = AutoModelForCausalLM.from_pretrained(sft_run)
    tok = AutoTokenizer.from_pretrained(sft_run)
    with torch.no_grad():
        logits = model(**tok(["Review the film Kalo."], return_tensors="pt")).logits
    assert torch.isfinite(logits).all()
    assert os.path.isfile(os.path.join(sft_run, "config.yaml"))


def test_rm_heldout_accuracy_and_model_loads(rm_run):
    from transformers import AutoModelForSequenceClassification

    evals = [m for m in read_metrics(rm_run) if "eval/accuracy" in m]
    assert evals[-1]["eval/accuracy"] > 0.75
    assert evals[-1]["eval/margin"] > 0
    model = AutoModelForSequenceClassification.from_pretrained(rm_run)
    assert model.config.num_labels == 1


def test_metrics_are_one_object_per_logged_step(sft_run):
    steps = [m["step"] for m in read_metrics(sft_run) if "loss" in m]
    assert steps == sorted(set(steps)) and steps[0] == 5 and steps[-1] == 60
    first = read_metrics(sft_run)[0]
    assert {"loss", "lr", "grad_norm", "mean_token_accuracy", "epoch"} <= set(first)


def test_print_config(capsys):
    assert main(["rm", "--config", "configs/rm_tiny.yaml", "--print-config", "optim.lr=0.5", "output_dir=x"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "center_coef: 0.01" in out and "output_dir: x" in out
