"""The offline preference stages (DPO, IPO, SimPO, ORPO, KTO, and DPO with LoRA) through the real CLI on the shipped
tiny configs: the implicit reward learns the rule (positive adjectives are preferred), margins grow, and the saved
model reloads. Plus the warnings a user must see about their data."""

import json
import logging
import os

import pytest
import torch

from rlhfkit.cli import main

RUNS = {
    "dpo": ["dpo", "--config", "configs/dpo_tiny.yaml"],
    "ipo": ["dpo", "--config", "configs/ipo_tiny.yaml"],
    "simpo": ["dpo", "--config", "configs/simpo_tiny.yaml"],
    "orpo": ["orpo", "--config", "configs/orpo_tiny.yaml"],
    "kto": ["kto", "--config", "configs/kto_tiny.yaml"],
    "dpo_lora": ["dpo", "--config", "configs/dpo_tiny.yaml", "model.lora.enabled=true"],
}


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp(request.param) / "run")
    assert main(RUNS[request.param] + [f"output_dir={out}", "logging.progress_bar=false"]) == 0
    return request.param, out


def test_rewards_learn_the_rule_and_model_reloads(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, out = run
    metrics = read_metrics(out)
    train = [m for m in metrics if "loss" in m]
    evals = [m for m in metrics if "eval/loss" in m]
    assert train[-1]["rewards/accuracies"] > 0.8, (name, [m["rewards/accuracies"] for m in train])
    assert evals[-1]["eval/rewards/accuracies"] > 0.8, (name, evals[-1])
    assert train[-1]["rewards/margins"] > train[0]["rewards/margins"], (name, [m["rewards/margins"] for m in train])
    assert evals[-1]["eval/rewards/margins"] > 0
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"} <= set(train[-1])
    if name == "kto":
        assert "kl" in train[-1] and "eval/kl" in evals[-1]
    model = AutoModelForCausalLM.from_pretrained(out)  # LoRA runs save merged weights: plain transformers loads them
    tok = AutoTokenizer.from_pretrained(out)
    with torch.no_grad():
        logits = model(**tok(["Review the film Kalo."], return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def write(tmp_path, name, records):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_identical_pairs_are_dropped_with_a_warning(tmp_path, caplog):
    pairs = [{"prompt": f"Review the lamp K{i}.", "chosen": "It was good.", "rejected": "It was bad."} for i in range(8)]
    pairs.append({"prompt": "Review the lamp Z.", "chosen": "It was ok.", "rejected": "It was ok."})
    data = write(tmp_path, "pairs.jsonl", pairs)
    args = RUNS["dpo"] + [f"data.train={data}", "data.eval=null", "max_steps=2", f"output_dir={tmp_path / 'out'}"]
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        assert main(args) == 0
    assert any("dropped 1 pairs whose chosen and rejected tokens are identical" in r.message for r in caplog.records)


def test_kto_with_one_label_warns_and_stays_finite(tmp_path, caplog):
    rows = [{"prompt": f"Review the lamp K{i}.", "completion": "It was good.", "label": True} for i in range(8)]
    data = write(tmp_path, "good.jsonl", rows)
    out = tmp_path / "out"
    args = RUNS["kto"] + [f"data.train={data}", "data.eval=null", "max_steps=2", "logging.logging_steps=1", f"output_dir={out}"]
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        assert main(args) == 0
    assert any("all 8 examples are desirable" in r.message for r in caplog.records)
    for m in read_metrics(out):
        assert "rewards/rejected" not in m and all(v == v for v in m.values())  # no NaN anywhere
