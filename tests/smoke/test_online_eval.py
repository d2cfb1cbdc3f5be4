"""Evaluation during online training and RFT (`data.eval`, `logging.eval_steps`, `data.capability`) through the real
CLI on tiny models. The figures logged under `eval/` at a step are those `rlhfkit eval` reports for that step's
weights (its checkpoint, or the final model) with the same seed, batch size and generation settings: the two share
their sampling and their figures, so they must agree to float precision."""

import json
import logging

import pytest

from rlhfkit.cli import main
from rlhfkit.tasks.toy import gold_score


def gold_judge(prompts, completions):
    """The toy task's gold rule (loaded by the CLI as `test_online_eval:gold_judge`)."""
    return [gold_score(c) for c in completions]


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# 16 train and 16 eval prompts, 4 samples each, eval batches of 4 prompts (the rollout batch).
GRPO = ["grpo", "--config", "configs/grpo_tiny.yaml", "logging.progress_bar=false", "max_steps=4", "optim.lr=1e-2",
        "data.eval=data/tiny/prompts_eval.jsonl", "data.max_samples=16", "reward.gold_function=test_online_eval:gold_judge",
        "data.max_prompt_length=96"]
# `rlhfkit eval` on the same prompts, judges and settings (grpo_tiny: 4 samples of 16 tokens, seed 0).
EVAL = ["eval", "--config", "configs/eval_tiny.yaml", "judges=['gold=test_online_eval:gold_judge']", "max_prompts=16",
        "batch_size=4", "generation.num_samples=4", "generation.max_new_tokens=16", "seed=0",
        "data.max_prompt_length=96"]
CAPABILITY = "data/tiny/sft_eval.jsonl"


def eval_rows(out):
    return [r for r in read_jsonl(out / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]


def assert_same_figures(row, report, tax=None):
    """A training run's eval row against eval.json of the same weights."""
    pol, n = report["policy"], report["num_samples"]
    expected = {
        "eval/rewards/vowel_reward/mean": pol["reward"]["vowel_reward"]["mean"],
        # The run logs a source's std as TRL does (Bessel-corrected, n - 1); eval.json's is the population std.
        "eval/rewards/vowel_reward/std": pol["reward"]["vowel_reward"]["std"] * (n / (n - 1)) ** 0.5,
        "eval/objective/scores": pol["reward"]["vowel_reward"]["mean"],  # one source, weight 1
        "eval/objective/gold": pol["reward"]["gold"]["mean"],
        "eval/objective/kl": report["kl"]["mean"],
        "eval/response/length_avg": pol["length"]["mean"],
        "eval/response/eos_rate": pol["eos_rate"],
        "eval/response/empty_rate": pol["empty_rate"],
        "eval/response/distinct_2": pol["distinct_2"],
        "eval/response/words_avg": pol["words_avg"],
        "eval/response/top_share": pol["top_share"],
    }
    if tax is not None:
        expected.update({"eval/capability/policy_nll": tax["policy_nll"], "eval/capability/reference_nll": tax["reference_nll"],
                         "capability/delta_nats": tax["delta_nats"]})
    for key, value in expected.items():
        assert row[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    code = main(GRPO + [f"output_dir={out}", "logging.eval_steps=2", "logging.save_steps=2", f"data.capability={CAPABILITY}"])
    assert code == 0
    return out


def test_eval_every_eval_steps_equals_rlhfkit_eval(grpo_run, tmp_path):
    rows = eval_rows(grpo_run)
    assert [r["step"] for r in rows] == [2, 4]
    assert rows[0]["eval/objective/kl"] != rows[1]["eval/objective/kl"]  # the weights moved between the two
    for step, model in ((2, grpo_run / "checkpoint-2" / "model"), (4, grpo_run)):
        out = tmp_path / f"eval{step}"
        assert main(EVAL + [f"output_dir={out}", f"model.name_or_path={model}", f"capability_data={CAPABILITY}"]) == 0
        report = json.loads((out / "eval.json").read_text())
        assert_same_figures(rows[step // 2 - 1], report, report["alignment_tax"])
    # Samples of the eval set are marked as such, beside the training samples.
    samples = read_jsonl(grpo_run / "samples.jsonl")
    evals = [s for s in samples if s.get("split") == "eval"]
    assert sorted({s["step"] for s in evals}) == [2, 4]
    assert {"prompt", "response", "score", "kl"} <= set(evals[0])
    assert any(s.get("split") != "eval" for s in samples)


def test_eval_only_at_the_end_without_eval_steps(tmp_path):
    out = tmp_path / "run"
    assert main(GRPO + [f"output_dir={out}", "max_steps=3"]) == 0
    assert [r["step"] for r in eval_rows(out)] == [3]


def test_alignment_tax_alarm_fires_at_its_threshold(grpo_run, tmp_path, caplog):
    """The run's final capability delta, threshold just below and just above it: the alarm fires in the first run only."""
    delta = [r for r in read_jsonl(grpo_run / "metrics.jsonl") if "capability/delta_nats" in r][-1]["capability/delta_nats"]
    assert delta > 0  # GRPO at lr 1e-2 on vowels costs the random model some of its (poor) fit to the reviews
    fired = []
    for name, threshold in (("below", delta * 0.99), ("above", delta * 1.01)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlhfkit"):
            assert main(GRPO + [f"output_dir={tmp_path / name}", f"data.capability={CAPABILITY}", "logging.eval_steps=2",
                                f"alarms.alignment_tax_nats={threshold}"]) == 0
        fired.append([r.getMessage() for r in caplog.records if "alarm alignment_tax" in r.getMessage()])
    assert len(fired[0]) == 1 and f"alarms.alignment_tax_nats={delta * 0.99:g}" in fired[0][0]
    assert fired[1] == []


def test_rft_evaluates_at_the_end(tmp_path):
    out = tmp_path / "rft"
    assert main(["rft", "--config", "configs/rft_tiny.yaml", f"output_dir={out}", "logging.progress_bar=false",
                 "algo.iterations=1", "algo.prompts_per_iteration=16", "algo.sampling_batch_size=4", "max_steps=2",
                 "data.eval=data/tiny/prompts_eval.jsonl", "data.max_samples=16",
                 "reward.gold_function=test_online_eval:gold_judge", "data.max_prompt_length=96"]) == 0
    rows = eval_rows(out)
    assert [r["step"] for r in rows] == [2]
    report_dir = tmp_path / "eval"
    assert main(EVAL + [f"output_dir={report_dir}", f"model.name_or_path={out}"]) == 0
    assert_same_figures(rows[0], json.loads((report_dir / "eval.json").read_text()))


@pytest.mark.parametrize("stage, extra, key", [
    ("grpo", ["logging.eval_steps=2"], "logging.eval_steps"),  # nothing to evaluate
    ("sft", [f"data.capability={CAPABILITY}"], "data.capability"),  # a stage that does not sample
])
def test_eval_settings_without_effect_are_refused(stage, extra, key, tmp_path, capsys):
    assert main([stage, "--config", f"configs/{stage}_tiny.yaml", f"output_dir={tmp_path / 'r'}", *extra]) == 2
    assert f"'{key}'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_held_out_evaluation_samples_through_the_python_apis_rollout(tmp_path):
    """`Objects.rollout`: the component the run trains with is the one its held-out prompts are evaluated with. A
    wrapper that steers every response to "aaa" shows in the eval figures: 3 tokens and EOS each."""
    from rlhfkit.config import OnlineConfig, load_config
    from rlhfkit.model_sources import build_tiny_tokenizer
    from rlhfkit.objects import Objects
    from rlhfkit.stages import trainer_of
    from tests.scripted import Scripted

    tok = build_tiny_tokenizer()
    calls = []

    def steer(made):
        def rollout(policy, prompts, examples, step):
            calls.append(len(examples))
            return made(Scripted(policy, tok, lambda text: "aaa<|im_end|>"), prompts, examples, step)
        return rollout

    out = tmp_path / "steered"
    cfg = load_config(OnlineConfig, "configs/grpo_tiny.yaml",
                      [f"output_dir={out}", "logging.progress_bar=false", "max_steps=1", "generation.top_k=1",
                       "data.eval=data/tiny/prompts_eval.jsonl", "data.max_samples=8", "data.max_prompt_length=96"])
    trainer_of("grpo", cfg, Objects(rollout=steer)).fit()
    (row,) = eval_rows(out)
    assert row["eval/response/length_avg"] == 4.0 and row["eval/response/eos_rate"] == 1.0
    assert len(calls) >= 2  # the training step's rollout and the evaluation's batches
