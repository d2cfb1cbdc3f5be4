"""`rlhfkit eval` through the real CLI on tiny models: every figure of eval.json, and the identities that hold when
the policy is its own reference (same seed, so identical samples: KL 0 and every win rate exactly 0.5)."""

import json

import pytest

from rlhfkit.cli import main
from rlhfkit.tasks.toy import gold_score


def gold_judge(prompts, completions):
    """The toy task's gold rule as a judge (loaded by the CLI as `test_eval_cli:gold_judge`)."""
    return [gold_score(c) for c in completions]


BASE = ["eval", "--config", "configs/eval_tiny.yaml", "judges=['gold=test_eval_cli:gold_judge']"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("rm") / "run")
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={out}", "max_steps=5", "logging.progress_bar=false"]) == 0
    return out


def test_policy_against_itself(rm_dir, tmp_path, capsys):
    # A training run whose logged proxy reward rose while the gold judge fell: the run's alarm reaches eval.json.
    run = tmp_path / "run"
    run.mkdir()
    run.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "objective/scores": s / 8, "objective/gold": 1 - s / 8}) + "\n" for s in range(1, 9)))
    out = tmp_path / "eval"
    args = [f"output_dir={out}", f"reward.model=[{rm_dir}]", "preference_data=data/tiny/pref_eval.jsonl", f"run_dir={run}"]
    assert main(BASE + args) == 0
    report = json.loads((out / "eval.json").read_text())
    judges = {"reward_model", "vowel_reward", "gold"}
    assert report["num_prompts"] == report["num_samples"] == 64
    for side in ("policy", "reference"):
        figures = report[side]
        assert set(figures) == {"length", "distinct_1", "distinct_2", "words_avg", "top_share", "eos_rate", "truncation_rate",
                                "empty_rate", "reward", "logged"}
        assert set(figures["reward"]) == judges
        assert 0 < figures["length"]["mean"] <= 16 and 0 <= figures["distinct_2"] <= 1
        # 64 prompts; random 16-character responses never repeat across prompts
        assert figures["top_share"] == 1 / 64 and figures["words_avg"] > 0
        assert figures["eos_rate"] + figures["truncation_rate"] == pytest.approx(1.0)
    assert report["policy"] == report["reference"]
    assert report["kl"] == {"mean": 0.0, "std": 0.0}
    assert report["win_rate"] == {name: 0.5 for name in judges}
    assert 0 <= report["reward_model_accuracy"]["reward_model"] <= 1
    example = report["samples"][0]
    assert len(report["samples"]) == 8 and example["prompt"].strip()
    assert all(e["policy"]["response"] == e["reference"]["response"] for e in report["samples"])
    assert example["policy"]["response"] == example["reference"]["response"] and example["policy"]["kl"] == 0.0
    assert set(example["policy"]["scores"]) == judges
    assert [a["name"] for a in report["alarms"] if a["source"] == "run_dir"] == ["proxy_up_gold_down"]
    assert (out / "eval_config.yaml").exists()
    printed = capsys.readouterr().out
    assert "reward: gold" in printed and "RM accuracy: reward_model" in printed and "alarm proxy_up_gold_down" in printed
    # eval.json is never replaced unless asked.
    assert main(BASE + args) == 2
    assert "overwrite=true" in capsys.readouterr().err


def test_policy_against_another_model_and_alone(tmp_path):
    from rlhfkit.model_sources import build_tiny_model

    other = tmp_path / "other"
    build_tiny_model(str(other), seed=1)  # same tokenizer, different weights
    out = tmp_path / "eval"
    assert main(BASE + [f"output_dir={out}", f"reference={other}", "max_prompts=16"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["num_prompts"] == 16
    assert report["kl"]["mean"] > 0 and report["kl"]["std"] > 0
    # Near-uniform random models draw mostly the same tokens from the same seed, but not everywhere.
    assert any(e["policy"]["response"] != e["reference"]["response"] for e in report["samples"])
    assert set(report["win_rate"]) == {"vowel_reward", "gold"}

    alone = tmp_path / "alone"
    assert main(BASE + [f"output_dir={alone}", "reference=null", "max_prompts=16"]) == 0
    report = json.loads((alone / "eval.json").read_text())
    assert report["reference"] is None and report["kl"] is None and report["win_rate"] == {}
    assert report["samples"][0]["reference"] is None


@pytest.mark.parametrize("override, key", [
    ("preference_data=data/tiny/pref_eval.jsonl", "preference_data"),  # RM accuracy without a reward model
    ("judges=[gold]", "judges[0]"),
    ("judges=['vowel_reward=rlhfkit.tasks.toy:vowel_reward']", "judges"),  # the reward.function judge's name, twice
    ("data.eval=", "data.eval"),
])
def test_bad_config_fails_before_loading(override, key, tmp_path, capsys):
    assert main(["eval", "--config", "configs/eval_tiny.yaml", f"output_dir={tmp_path / 'e'}", override]) == 2
    assert f"'{key}'" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_alignment_tax_block_and_alarm(tmp_path):
    """capability_data: the policy's and the reference's per-token NLL of reference responses. The SFT run's own final
    eval loss on the same file is the policy's figure; against the untrained model the loss of NLL fires the alarm."""
    sft = tmp_path / "sft"
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={sft}", "max_steps=6", "logging.eval_steps=6",
                 "logging.progress_bar=false"]) == 0
    final_eval = [r for r in (json.loads(line) for line in (sft / "metrics.jsonl").read_text().splitlines()) if "eval/loss" in r][-1]
    # The SFT model scored against the random tiny model: it predicts the held-out reviews far better (negative tax).
    out = tmp_path / "gain"
    assert main(BASE + [f"output_dir={out}", f"model.name_or_path={sft}", "capability_data=data/tiny/sft_eval.jsonl",
                        "data.max_prompt_length=96"]) == 0
    tax = json.loads((out / "eval.json").read_text())["alignment_tax"]
    assert tax["policy_nll"] == pytest.approx(final_eval["eval/loss"], rel=1e-4)
    assert tax["delta_nats"] == pytest.approx(tax["policy_nll"] - tax["reference_nll"]) and tax["delta_nats"] < -0.1
    assert tax["tokens"] > 0
    assert not [a for a in json.loads((out / "eval.json").read_text())["alarms"] if a["name"] == "alignment_tax"]
    # The other way round, the random model has lost what the SFT model knew: the alarm fires, naming its threshold.
    out = tmp_path / "loss"
    assert main(BASE + [f"output_dir={out}", f"reference={sft}", "capability_data=data/tiny/sft_eval.jsonl",
                        "data.max_prompt_length=96"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["alignment_tax"]["delta_nats"] == pytest.approx(-tax["delta_nats"], rel=1e-4)
    alarm = [a for a in report["alarms"] if a["name"] == "alignment_tax"]
    assert alarm and "alarms.alignment_tax_nats=0.1" in alarm[0]["message"]
    # A higher threshold keeps it quiet.
    out = tmp_path / "quiet"
    assert main(BASE + [f"output_dir={out}", f"reference={sft}", "capability_data=data/tiny/sft_eval.jsonl",
                        "data.max_prompt_length=96", "alarms.alignment_tax_nats=100"]) == 0
    assert not [a for a in json.loads((out / "eval.json").read_text())["alarms"] if a["name"] == "alignment_tax"]


def test_capability_data_needs_a_reference(tmp_path, capsys):
    assert main(BASE + [f"output_dir={tmp_path / 'e'}", "reference=null", "capability_data=data/tiny/sft_eval.jsonl"]) == 2
    assert "capability_data" in capsys.readouterr().err
