"""`rlhfkit demo --quick` through the real CLI: the whole SFT -> RM -> PPO/DPO/best-of-n -> evaluation path on the
tiny model, checking every artefact (the figures themselves are meaningless on a random model)."""

import json
import math
import os

import pytest

from rlhfkit.cli import main
from rlhfkit.tasks.demo import METHODS

FIGURES = {"gold_reward", "rm_reward", "kl_to_sft", "win_rate_gold", "win_rate_rm", "distinct_2", "eos_rate", "mean_words",
           "alignment_tax_nats"}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo") / "run")
    assert main(["demo", "--quick", "--output-dir", out]) == 0
    return out


def test_eval_json_has_every_figure(demo_run):
    with open(os.path.join(demo_run, "eval", "eval.json")) as f:
        result = json.load(f)
    assert result["quick"] is True and result["eval_prompts"] == 8
    assert set(result["methods"]) == set(METHODS)
    for method, figures in result["methods"].items():
        assert set(figures) == FIGURES, method
        assert 0.0 <= figures["win_rate_gold"] <= 1.0 and 0.0 <= figures["win_rate_rm"] <= 1.0
        assert 0.0 <= figures["distinct_2"] <= 1.0
    sft = result["methods"]["sft"]
    assert sft["kl_to_sft"] == 0.0 and sft["win_rate_gold"] == 0.5 and sft["win_rate_rm"] == 0.5  # the baseline itself
    # Best-of-4 picks, per held-out prompt, the reward model's favourite of 4 SFT samples: measured against the SFT
    # sample, its reward-model score is higher (a pick by the wrong index, argmin or a misaligned group is not). Its
    # KL is analytic (checked against the exact best-of-n distribution in tests/unit/test_best_of_n.py); any
    # best-of-n's density ratio to its base is at most n, so its KL lies in (0, log n].
    best = result["methods"]["best_of_4"]
    assert best["rm_reward"] > sft["rm_reward"] and best["win_rate_rm"] > 0.5
    assert 0.0 < best["kl_to_sft"] <= math.log(4)
    assert {"rm_accuracy_noisy", "rm_accuracy_gold", "rm_eval_pairs", "rm_gold_pairs", "rm_accuracy_gold_eval_prompts",
            "rm_gold_pairs_eval_prompts"} <= set(result["reward_model"])
    assert result["reward_model"]["rm_gold_pairs_eval_prompts"] <= 8 * 10  # 5 samples per prompt: at most 10 pairs each
    assert set(result["acceptance"]) == {"ppo_win_rate_gold>0.65", "ppo_kl<10", "ppo_distinct_2>=sft/2", "rm_accuracy_gold>0.70"}
    with open(os.path.join(demo_run, "pipeline.json")) as f:  # the pipeline's record: every stage ran, timed
        records = json.load(f)["records"]
    assert [(r["name"], r["status"]) for r in records] == [(n, "ran") for n in (
        "prompts", "sft_data", "sft", "pairs", "rm", "ppo", "online_dpo", "dpo", "eval")]
    # The alignment tax against the SFT model on the general-knowledge answers: zero for SFT and best-of-n (the SFT
    # model itself), the difference of the two NLLs for every method.
    tax = result["alignment_tax"]
    assert tax["reference"] == "sft" and set(METHODS) <= set(tax)
    assert tax["sft"]["delta_nats"] == 0.0 and tax["best_of_4"]["delta_nats"] == 0.0 and tax["sft"]["tokens"] > 0
    for method in METHODS:
        block = tax[method]
        assert block["delta_nats"] == pytest.approx(block["policy_nll"] - block["reference_nll"])
        assert block["reference_nll"] == pytest.approx(tax["sft"]["policy_nll"])
        assert result["methods"][method]["alignment_tax_nats"] == block["delta_nats"]


def test_every_stage_wrote_its_run(demo_run):
    for stage in ("sft", "rm", "ppo", "online_dpo", "dpo"):
        stage_dir = os.path.join(demo_run, stage)
        for name in ("config.json", "config.yaml", "metrics.jsonl"):
            assert os.path.isfile(os.path.join(stage_dir, name)), (stage, name)
    for name in ("sft_data/sft_data.jsonl", "pairs/pairs_train.jsonl", "pairs/pairs_eval.jsonl", "pairs/pairs_dpo.jsonl",
                 "prompts/prompts_train.jsonl", "prompts/prompts_eval.jsonl"):
        assert os.path.getsize(os.path.join(demo_run, name)) > 0, name
    with open(os.path.join(demo_run, "pairs", "pairs_train.jsonl")) as f:
        pair = json.loads(f.readline())
    assert {"prompt", "chosen", "rejected", "gold_chosen", "gold_rejected"} <= set(pair)
    with open(os.path.join(demo_run, "rm", "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1  # the reward model keeps the SFT model's first layer(s) only
    with open(os.path.join(demo_run, "eval", "eval_samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 8 and set(METHODS) <= set(rows[0])


def test_frontier_plot_and_report(demo_run):
    with open(os.path.join(demo_run, "eval", "frontier.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(demo_run, "eval", "report.html"), encoding="utf-8") as f:
        html = f.read()
    assert "frontier" in html or "data:image/png;base64" in html
    assert all(m in html for m in METHODS)
    assert "best_of_n: 4" in html and "ppo_steps: 2" in html  # the demo's own settings, in the report
    # The pipeline's report at the root: every stage, the evaluation's gates, a link to the evaluation's own report.
    with open(os.path.join(demo_run, "report.html"), encoding="utf-8") as f:
        root = f.read()
    assert 'href="eval/report.html"' in root and "ppo/win_rate_gold" in root and 'src="frontier.png"' in root


def test_the_same_command_skips_the_done_stages_and_from_stage_reruns_the_later_ones(demo_run):
    """Last in this module: it reruns stages of the shared run in place."""
    ppo_weights, dpo_weights = (os.path.join(demo_run, m, "model.safetensors") for m in ("ppo", "dpo"))
    ppo_before, dpo_before = os.path.getmtime(ppo_weights), os.path.getmtime(dpo_weights)
    with open(os.path.join(demo_run, "eval", "eval.json")) as f:
        original = json.load(f)
    assert main(["demo", "--quick", "--output-dir", demo_run]) == 0  # everything done with the same settings
    assert os.path.getmtime(ppo_weights) == ppo_before and os.path.getmtime(dpo_weights) == dpo_before
    assert main(["demo", "--quick", "--output-dir", demo_run, "--from-stage", "dpo"]) == 0
    with open(os.path.join(demo_run, "pipeline.json")) as f:
        status = {r["name"]: r["status"] for r in json.load(f)["records"]}
    assert status["ppo"] == "skipped" and status["dpo"] == status["eval"] == "ran"
    assert os.path.getmtime(ppo_weights) == ppo_before  # the earlier stages' outputs were reused, not retrained
    assert os.path.getmtime(dpo_weights) != dpo_before
    with open(os.path.join(demo_run, "eval", "eval.json")) as f:
        result = json.load(f)
    assert result["methods"] == original["methods"]  # same seeds, same samples, same figures
