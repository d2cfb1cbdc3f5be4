"""Python reward functions through the real CLI: the worked arithmetic example, what a function receives (the
dataset's own prompts, every record field, one call per rollout batch) in grpo, rft and eval, TRL-shaped functions
(keywords only, None rows, async, trainer_state, several weighted), and a bad function or judge ending the run with
status 2 and one line that names it."""

import json
import os
import sys

import pytest

from rlhfkit.cli import main
from rlhfkit.rewards import load_reward_function
from rlhfkit.tasks.arithmetic import exact_match, first_number

FNS = "tests.smoke.reward_fns"
RECORDS = [json.loads(line) for line in open(os.path.join(os.path.dirname(__file__), "..", "..", "data", "tiny", "arithmetic_prompts.jsonl"))]
ANSWER = {r["prompt"]: r["answer"] for r in RECORDS}


@pytest.fixture
def calls():
    """The calls `tests.smoke.reward_fns:record` receives during the test."""
    load_reward_function(f"{FNS}:record")
    recorded = sys.modules[FNS].CALLS
    recorded.clear()
    yield recorded
    recorded.clear()


def run(capsys, args):
    code = main(args)
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("rlhfkit: error:")], err


# 1. The worked example -----------------------------------------------------------------------------------------


def test_exact_match_reads_the_first_number():
    completions = ["7", " 7.0 is it", "The sum is 7, not 8", "8", "seven", "-7", "", "17"]
    assert exact_match(["3+4="] * 8, completions, answer=["7"] * 8) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert exact_match(["9+9="], ["18"], answer=[18]) == [1.0]  # a numeric answer field works too
    assert first_number("x = -2.5;") == -2.5 and first_number("none") is None


def test_grpo_arithmetic_config_runs(tmp_path):
    out = tmp_path / "run"
    assert main(["grpo", "--config", "configs/grpo_arithmetic.yaml", "max_steps=2", f"output_dir={out}",
                 "logging.progress_bar=false"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scores = [r["objective/scores"] for r in rows if "objective/scores" in r]
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
    # The evidence of the distinct_collapse alarm (alarms.diversity_figures), logged per step: 4 prompts per step.
    for r in rows:
        if "objective/scores" in r:
            assert r["response/words_avg"] >= 0 and r["response/top_share"] in (0.0, 0.25, 0.5, 0.75, 1.0), r
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["score"] in (0.0, 1.0) for s in samples)


# 2. What the function receives, and how often ------------------------------------------------------------------


def test_grpo_passes_the_records_once_per_rollout(tmp_path, calls):
    out = tmp_path / "run"
    assert main(["grpo", "--config", "configs/grpo_arithmetic.yaml", "max_steps=2", f"output_dir={out}",
                 f"reward.function={FNS}:record", "algo.rollout_batch_size=4", "generation.num_samples=4",
                 "optim.per_device_batch_size=2", "logging.progress_bar=false"]) == 0
    assert [c["n"] for c in calls] == [16, 16]  # 4 prompts x 4 samples, one call per step (micro-batches are 2 rows)
    for c in calls:
        assert set(c["prompts"]) <= set(ANSWER)  # the dataset's prompts, not "user\n3+4=\nassistant\n"
        assert c["prompts"][::4] == c["prompts"][1::4] == c["prompts"][3::4]  # each prompt's 4 samples are adjacent
        assert c["kwargs"]["answer"] == [ANSWER[p] for p in c["prompts"]]
        assert len(c["kwargs"]["completion_ids"]) == 16


def test_rft_passes_the_records_once_per_sampling_batch(tmp_path, calls):
    out = tmp_path / "run"
    assert main(["rft", "--config", "configs/rft_tiny.yaml", "data.train=data/tiny/arithmetic_prompts.jsonl",
                 f"reward.function={FNS}:record", "algo.iterations=1", "algo.prompts_per_iteration=12",
                 "algo.sampling_batch_size=8", "generation.num_samples=2", "generation.max_new_tokens=4", "max_steps=1",
                 f"output_dir={out}", "logging.progress_bar=false"]) == 0
    assert [c["n"] for c in calls] == [16, 8]  # 8 + 4 prompts, 2 samples each
    assert all(c["kwargs"]["answer"] == [ANSWER[p] for p in c["prompts"]] for c in calls)
    assert len({p for c in calls for p in c["prompts"]}) <= 12 and sum(c["n"] for c in calls) == 24


def test_rft_subtracts_the_missing_eos_penalty(tmp_path):
    """TRL's convention, as the online stages: a positive penalty lowers a truncated response's score."""
    out = tmp_path / "run"
    assert main(["rft", "--config", "configs/rft_tiny.yaml", f"reward.function={FNS}:zeros", "reward.missing_eos_penalty=1.0",
                 "algo.iterations=1", "algo.prompts_per_iteration=8", "generation.max_new_tokens=2", "max_steps=1",
                 f"output_dir={out}", "logging.progress_bar=false"]) == 0
    kept = [json.loads(line)["score"] for line in (out / "rft_iter1.jsonl").read_text().splitlines()]
    assert kept and set(kept) <= {0.0, -1.0} and -1.0 in kept  # most 2-token responses are cut before EOS


def test_eval_judges_see_every_prompt_at_once(tmp_path, calls):
    out = tmp_path / "eval"
    assert main(["eval", "--config", "configs/eval_tiny.yaml", "data.eval=data/tiny/arithmetic_prompts.jsonl",
                 f"judges=['rec={FNS}:record']", "max_prompts=20", "batch_size=8", f"output_dir={out}"]) == 0
    assert [c["n"] for c in calls] == [20, 20]  # the policy's 20 samples, then the reference's; not 8 + 8 + 4 each
    for c in calls:
        assert c["prompts"] == [r["prompt"] for r in RECORDS[:20]]
        assert c["kwargs"]["answer"] == [r["answer"] for r in RECORDS[:20]]


# 3. Bad functions: status 2, one line naming the function, no traceback ----------------------------------------

BAD = {
    "returns_none": "returned None, expected a list of 16 numbers (one per completion)",
    "one_too_few": "returned a list of 15 values, expected 16 (one per completion)",
    "raises": "raised KeyError: 'answer' (reward_fns.py:",
}


@pytest.mark.parametrize("fn", sorted(BAD))
def test_bad_reward_function_in_grpo(fn, tmp_path, capsys):
    code, errors, err = run(capsys, ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=2", f"reward.function={FNS}:{fn}",
                                     f"output_dir={tmp_path / 'run'}", "logging.progress_bar=false"])
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith(f"rlhfkit: error: reward.function '{FNS}:{fn}' {BAD[fn]}"), errors[0]
    assert "Traceback" not in err


def test_bad_gold_function_in_grpo(tmp_path, capsys):
    code, errors, err = run(capsys, ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=2",
                                     f"reward.gold_function={FNS}:returns_none", f"output_dir={tmp_path / 'run'}",
                                     "logging.progress_bar=false"])
    assert code == 2 and len(errors) == 1 and "Traceback" not in err
    assert errors[0] == (f"rlhfkit: error: reward.gold_function '{FNS}:returns_none' returned None, expected a list of 16 "
                         "numbers (one per completion)")


@pytest.mark.parametrize("fn", sorted(BAD))
def test_bad_judge_in_eval(fn, tmp_path, capsys):
    code, errors, err = run(capsys, ["eval", "--config", "configs/eval_tiny.yaml", f"judges=['bad={FNS}:{fn}']",
                                     "max_prompts=16", f"output_dir={tmp_path / 'eval'}"])
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith(f"rlhfkit: error: judges '{FNS}:{fn}' {BAD[fn]}"), errors[0]
    assert "Traceback" not in err and not (tmp_path / "eval" / "eval.json").exists()


# 4. TRL's contract (issue 19): the shapes TRL users write, through `rlhfkit grpo` ------------------------------

ARITH = ["grpo", "--config", "configs/grpo_arithmetic.yaml", "max_steps=2", "logging.progress_bar=false"]


@pytest.mark.parametrize("fn", ["completions_only", "with_answer", "keyword_only", "none_for_some", "awaited"])
def test_trl_shaped_function_trains(fn, tmp_path):
    out = tmp_path / "run"
    assert main(ARITH + [f"reward.function={FNS}:{fn}", f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if f"rewards/{fn}/mean" in r]
    assert len(logged) == 2 and all(r[f"rewards/{fn}/mean"] == r[f"rewards/{fn}/mean"] for r in logged)  # not NaN
    if fn == "none_for_some":  # the odd rows are not scored: the mean is over the rows scored 1.0, the std is 0
        assert all(r[f"rewards/{fn}/mean"] == 1.0 and r[f"rewards/{fn}/std"] == 0.0 for r in logged)
        assert all(r["objective/scores"] == 0.5 for r in logged)  # Σ over sources: 1 on even rows, 0 on the odd


def test_trl_think_format_reward_trains_on_conversational_prompts(tmp_path):
    """TRL's own function reads `completion[0]["content"]`: it needs the completions as message lists."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}) + "\n"
                            for r in RECORDS))
    out = tmp_path / "run"
    assert main(ARITH + [f"data.train={chat}", "reward.function=trl.rewards:think_format_reward", f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rewards/think_format_reward/mean"] for r in rows if "objective/scores" in r] == [0.0, 0.0]  # no <think> yet


def test_trainer_state_counts_optimizer_steps(tmp_path):
    from tests.smoke import reward_fns

    reward_fns.STEPS.clear()
    assert main(ARITH + ["max_steps=3", f"reward.function={FNS}:by_step", f"output_dir={tmp_path / 'run'}"]) == 0
    assert reward_fns.STEPS == [0, 1, 2]


def test_several_functions_weighted_are_each_logged(tmp_path):
    out = tmp_path / "run"
    assert main(ARITH + [f"reward.function=[{FNS}:with_answer, {FNS}:none_for_some]", "reward.weights=[2.0, 0.5]",
                         f"output_dir={out}"]) == 0
    rows = [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "objective/scores" in r]
    assert len(rows) == 2
    for r in rows:  # 16 rows: with_answer on all, none_for_some (1.0) on the 8 even rows
        expected = 2.0 * r["rewards/with_answer/mean"] + 0.5 * 8 / 16
        assert abs(r["objective/scores"] - expected) < 1e-6, r
        assert r["rewards/none_for_some/mean"] == 1.0


def test_rows_no_source_scores_warn_once_and_score_zero(tmp_path, caplog):
    out = tmp_path / "run"
    caplog.set_level("WARNING", logger="rlhfkit")
    assert main(ARITH + [f"reward.function={FNS}:always_none", f"output_dir={out}"]) == 0
    assert len([r for r in caplog.records if "every reward source returned None" in r.getMessage()]) == 1
    rows = [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "objective/scores" in r]
    assert [r["objective/scores"] for r in rows] == [0.0, 0.0]


def test_trainer_state_reaches_functions_in_evaluation_during_training(tmp_path):
    """The held-out evaluation scores with the same contract: a function that reads trainer_state gets the step the
    evaluation follows (TRL passes its own state in evaluate too), not None."""
    from tests.smoke import reward_fns

    reward_fns.STEPS.clear()
    out = tmp_path / "run"
    assert main(ARITH + [f"reward.function={FNS}:by_step", "data.eval=data/tiny/arithmetic_prompts.jsonl",
                         "logging.eval_steps=1", f"output_dir={out}"]) == 0
    assert reward_fns.STEPS == [0, 1, 1, 2]  # train step 1, eval after it, train step 2, eval after it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/rewards/by_step/mean" in r] == [1, 2]


def test_rft_passes_trainer_state_and_logs_each_source(tmp_path):
    """rft scores under TRL's contract too: trainer_state counts the SFT steps done before each iteration's sampling,
    and each source's mean and std over every sample are logged as the online stages log them."""
    from tests.smoke import reward_fns

    reward_fns.STEPS.clear()
    out = tmp_path / "run"
    assert main(["rft", "--config", "configs/rft_tiny.yaml", "data.train=data/tiny/arithmetic_prompts.jsonl",
                 f"reward.function=[{FNS}:by_step, {FNS}:completions_only]", "reward.weights=[1.0, 0.5]",
                 "algo.iterations=2", "algo.prompts_per_iteration=8", "algo.sampling_batch_size=4",
                 "generation.num_samples=2", "generation.max_new_tokens=4", "optim.per_device_batch_size=4",
                 f"output_dir={out}", "logging.progress_bar=false"]) == 0
    assert reward_fns.STEPS == [0, 0, 2, 2]  # two sampling batches per iteration; 8 kept rows / 4 per step = 2 steps
    rows = [r for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
            if "rft/mean_score_all" in r]
    assert len(rows) == 2
    for r in rows:  # every sample: by_step scores 0, completions_only the length; the total is 0.5 x the length
        assert r["rewards/by_step/mean"] == 0.0 and r["rewards/by_step/std"] == 0.0
        assert r["rewards/completions_only/mean"] > 0
        assert abs(r["rft/mean_score_all"] - 0.5 * r["rewards/completions_only/mean"]) < 1e-5, r


def test_eval_judges_may_return_none_for_rows_they_do_not_apply_to(tmp_path):
    """None means "does not apply", as in training: the judge's figures are over the rows it scored, the win rate
    over the pairs both sides scored, and a sample it did not score shows null. trainer_state is a TrainerState
    (step 0), so a TRL function that reads it runs in eval too."""
    from tests.smoke import reward_fns

    reward_fns.STEPS.clear()
    out = tmp_path / "eval"
    assert main(["eval", "--config", "configs/eval_tiny.yaml", f"judges=['v={FNS}:vowels_or_none', 'step={FNS}:by_step']",
                 "max_prompts=16", "num_examples=16", f"output_dir={out}"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert reward_fns.STEPS == [0, 0]  # the policy's samples, then the reference's
    for side in ("policy", "reference"):
        scores = [s[side]["scores"]["v"] for s in report["samples"]]
        texts = [s[side]["response"] for s in report["samples"]]
        assert [x is None for x in scores] == [not any(ch in "aeiou" for ch in t) for t in texts]
        scored = [x for x in scores if x is not None]
        assert 0 < len(scored) < len(scores), scores  # the tiny model's samples: some with a vowel, some without
        assert report[side]["reward"]["v"]["mean"] == pytest.approx(sum(scored) / len(scored))
        assert report[side]["reward"]["v"]["n"] == len(scored)
    pairs = [(s["policy"]["scores"]["v"], s["reference"]["scores"]["v"]) for s in report["samples"]]
    both = [(a, b) for a, b in pairs if a is not None and b is not None]
    assert report["win_rate"]["v"] == pytest.approx(sum((a > b) + 0.5 * (a == b) for a, b in both) / len(both))


@pytest.mark.parametrize("stage,config", [("grpo", "configs/grpo_arithmetic.yaml"), ("online_dpo", "configs/online_dpo_tiny.yaml")])
def test_a_gold_judge_gets_the_trainer_state_in_training(stage, config, tmp_path):
    """The gold judge is a reward function under the same contract: it gets the training's state at each step."""
    from tests.smoke import reward_fns

    reward_fns.STEPS.clear()
    out = tmp_path / "run"
    assert main([stage, "--config", config, "max_steps=2", f"reward.gold_function={FNS}:by_step", f"output_dir={out}",
                 "logging.progress_bar=false"]) == 0
    assert reward_fns.STEPS == [0, 1]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["objective/gold"] for r in rows if "objective/gold" in r] == [0.0, 0.0]


# TRL 1.16's logging hooks: log_metric(name, value) and log_extra(column, values) --------------------------------


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_log_metric_and_log_extra_reach_the_metrics_and_the_samples_in_training_and_evaluation(tmp_path):
    out = tmp_path / "run"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=2", f"reward.function={FNS}:logs_things",
                 "data.eval=data/tiny/prompts_eval.jsonl", "logging.eval_steps=2", f"output_dir={out}",
                 "logging.progress_bar=false", "logging.sample_log_steps=1"]) == 0
    rows = [r for r in _jsonl(out / "metrics.jsonl") if "objective/scores" in r]
    assert len(rows) == 2  # the logged metric, averaged over the step's calls: here the function's own mean
    assert all(r["share_with_a"] == pytest.approx(r["rewards/logs_things/mean"]) for r in rows)
    (evaluated,) = [r for r in _jsonl(out / "metrics.jsonl") if "eval/objective/scores" in r]
    assert evaluated["eval/share_with_a"] == pytest.approx(evaluated["eval/rewards/logs_things/mean"])
    samples = _jsonl(out / "samples.jsonl")
    assert {s.get("split") for s in samples} == {None, "eval"}
    assert all(s["has_a"] == ("a" in s["response"]) for s in samples)


def test_log_metric_and_log_extra_in_rft_and_eval(tmp_path):
    out = tmp_path / "rft"
    assert main(["rft", "--config", "configs/rft_tiny.yaml", f"reward.function={FNS}:logs_things", "algo.iterations=1",
                 "algo.prompts_per_iteration=8", "generation.max_new_tokens=4", "max_steps=1", f"output_dir={out}",
                 "logging.progress_bar=false"]) == 0
    (row,) = [r for r in _jsonl(out / "metrics.jsonl") if "rft/iteration" in r and "rft/kept" in r]
    assert row["share_with_a"] == pytest.approx(row["rewards/logs_things/mean"])
    assert all(s["has_a"] == ("a" in s["completion"]) for s in _jsonl(out / "samples.jsonl"))

    ev = tmp_path / "eval"
    assert main(["eval", "--config", "configs/eval_tiny.yaml", f"judges=['a={FNS}:logs_things']", "max_prompts=8",
                 "num_examples=8", f"output_dir={ev}"]) == 0
    report = json.loads((ev / "eval.json").read_text())
    for side in ("policy", "reference"):
        assert report[side]["logged"]["share_with_a"] == pytest.approx(report[side]["reward"]["a"]["mean"])
        assert all(s[side]["extra"]["has_a"] == ("a" in s[side]["response"]) for s in report["samples"])
