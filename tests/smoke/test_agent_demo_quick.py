"""`rlhfkit demo --agent --quick` through the real CLI: data, SFT on tool traces, GRPO with the tool, and the held-out
evaluation with and without tools, on the tiny model (the figures are meaningless on a random model; the artefacts and
the counts are checked)."""

import json
import os

import pytest

from rlhfkit.cli import main
from rlhfkit.pipeline.spec import read_spec
from rlhfkit.tasks.agent import METHODS
from rlhfkit.tasks.demos import pipeline_file

QUICK = read_spec(pipeline_file("agent"), ["variant=quick"]).vars  # the quick variant's sizes


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("agent") / "run")
    assert main(["demo", "--agent", "--quick", "--output-dir", out]) == 0
    return out


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_every_stage_ran_and_eval_json_has_every_figure(agent_run):
    with open(os.path.join(agent_run, "eval", "eval.json")) as f:
        result = json.load(f)
    assert result["quick"] is True and result["eval_prompts"] == QUICK['eval_prompts']
    assert set(result["methods"]) == set(METHODS)
    for figures in result["methods"].values():
        assert figures["episodes"] == figures["judged"] == QUICK['eval_prompts']  # exact_answer judges every episode
        assert figures["turns"] >= figures["episodes"]  # every episode has at least its first turn
        assert figures["task_completion"] == figures["completed"] / figures["judged"]
        assert figures["format_accuracy"] == figures["formatted_turns"] / figures["turns"]
    assert set(result["acceptance"]) == {"grpo_task_completion>=0.80", "grpo_task_completion>=sft+0.15",
                                         "grpo_format_accuracy>=0.95"}
    with open(os.path.join(agent_run, "pipeline.json")) as f:
        assert [r["name"] for r in json.load(f)["records"]] == ["prompts", "sft", "grpo", "eval"]
    assert len(read(os.path.join(agent_run, "prompts", "sft.jsonl"))) == QUICK['tool_traces'] + QUICK['direct_traces'] + QUICK['guessed_traces']


def test_grpo_ran_with_the_tool_and_the_samples_are_whole_episodes(agent_run):
    metrics = [r for r in read(os.path.join(agent_run, "grpo", "metrics.jsonl")) if "tools/call_frequency" in r]
    assert len(metrics) == QUICK['grpo_steps'] and "tools/calls_per_episode/multiply" in metrics[-1]
    for method in METHODS:
        samples = read(os.path.join(agent_run, "eval", f"eval_samples_{method}.jsonl"))
        assert len(samples) == QUICK['eval_prompts']
        assert all(s["episode"][0]["role"] == "assistant" for s in samples)


def test_agent_options_that_do_not_apply_are_refused(tmp_path, capsys):
    assert main(["demo", "--agent", "--full", "--quick", "--output-dir", str(tmp_path / "x")]) == 2
    assert main(["demo", "--agent", "--quick", "--from-stage", "rm", "--output-dir", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "--full" in err and "no stage named 'rm' (stages: prompts, sft, grpo, eval)" in err
