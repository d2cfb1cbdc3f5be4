"""`rlhfkit eval` with tools on the tiny model (chatml_tools): both models play episodes with a calculator, eval.json
gets the agent figures and the gate before reward modelling; the agent and gate settings refused where they cannot
apply, and a format rule that cannot be imported, each in one line with exit status 2."""

import json

import pytest

from rlhfkit.cli import main
from rlhfkit.evaluation.report import write_report

TOOLS = "tests.smoke.agent_eval_tools"
PROMPTS = [("What is 12 + 30?", "42"), ("What is 7 + 8?", "15"), ("What is 50 + 50?", "100")]


def base(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": a}) + "\n"
                            for q, a in PROMPTS))
    return ["eval", "--config", "configs/eval_tiny.yaml", f"output_dir={tmp_path / 'eval'}", f"data.eval={path}",
            "model.chat_template=chatml_tools", "data.max_length=2048", "data.max_prompt_length=1024",
            f"reward.function={TOOLS}:exact_answer", f"judges=[done={TOOLS}:always]"]


def test_eval_with_a_calculator_reports_agent_figures_and_the_gate(tmp_path, capsys):
    """The random policy's turns never end within 16 tokens; the format rule `reject` makes format accuracy exactly 0
    whatever it writes, the judge `always` makes task completion exactly 1: the gate is not passed at its default
    thresholds (0.95, 0.8), and the console says so."""
    assert main(base(tmp_path) + [f"tools.functions=[{TOOLS}:calculator]", "tools.max_calls=2", "agent.task_judge=done",
                                  f"agent.format_check={TOOLS}:reject", "data.max_length=2048", "data.max_prompt_length=1024"]) == 0
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    agent = report["agent"]
    assert agent["format_check"] == f"{TOOLS}:reject" and agent["task_judge"] == "done"
    for side in ("policy", "reference"):
        figures = agent[side]
        assert figures["episodes"] == 3 and figures["format_accuracy"] == 0.0 and figures["formatted_turns"] == 0
        assert figures["task_completion"] == 1.0 and figures["judged"] == figures["completed"] == 3
        assert figures["turns"] >= 3 and figures["turns_per_episode"] == figures["turns"] / 3
    assert report["gate"] == {"format_accuracy": {"value": 0.0, "threshold": 0.95, "passed": False},
                              "task_completion": {"value": 1.0, "threshold": 0.8, "passed": True}, "passed": False}
    out = capsys.readouterr().out
    assert "gate before reward modelling: NOT PASSED: format accuracy 0 (>= 0.95), task completion 1 (>= 0.8)" in out
    assert "format accuracy" in out and "tool calls / episode" in out
    page = open(write_report(str(tmp_path / "eval"))).read()  # the report shows both sections
    assert "Agent figures (eval.json)" in page and "Gate before reward modelling: not passed" in page
    # Settable thresholds: the same episodes pass a gate that asks for no format accuracy.
    assert main(base(tmp_path) + [f"tools.functions=[{TOOLS}:calculator]", "agent.task_judge=done",
                                  f"agent.format_check={TOOLS}:reject", "gate.format_accuracy=0", "overwrite=true"]) == 0
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["gate"]["passed"] is True


@pytest.mark.parametrize("overrides, message", [
    (["agent.task_judge=done"], "config key 'agent.task_judge' applies only with tools"),
    (["gate.task_completion=0.5"], "config key 'gate' applies only with tools"),
    ([f"tools.functions=[{TOOLS}:calculator]", "agent.format_check=nowhere_at_all:check"],
     "config key 'agent.format_check' 'nowhere_at_all:check': cannot import module 'nowhere_at_all'"),
    ([f"tools.functions=[{TOOLS}:calculator]", f"agent.format_check={TOOLS}:missing"],
     f"module '{TOOLS}' has no function 'missing'"),
    ([f"tools.functions=[{TOOLS}:calculator]", "agent.task_judge=nobody"],
     "config key 'agent.task_judge' 'nobody' names no judge of this evaluation (judges: exact_answer, done)"),
    ([f"tools.functions=[{TOOLS}:calculator]", "agent.format_check=nocolon"], "config key 'agent.format_check' must be"),
])
def test_bad_agent_settings_are_one_line(tmp_path, capsys, overrides, message):
    code = main(base(tmp_path) + overrides)
    err = capsys.readouterr().err.strip().splitlines()  # the launch's log lines, then the error's one line
    assert code == 2 and message in err[-1] and "Traceback" not in "\n".join(err), err


def test_the_held_out_evaluation_during_grpo_plays_the_same_episodes(tmp_path):
    """grpo with a calculator and held-out prompts: the evaluation logs the agent figures under eval/agent/, task
    completion by a reward source (`always`: exactly 1), format accuracy from the same loop as rlhfkit eval's."""
    out = tmp_path / "grpo"
    prompts = base(tmp_path)[4].removeprefix("data.eval=")
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "logging.progress_bar=false",
                 "max_steps=1", "model.chat_template=chatml_tools", f"tools.functions=[{TOOLS}:calculator]",
                 f"reward.function=[{TOOLS}:always]", f"data.eval={prompts}", "agent.task_judge=always",
                 f"agent.format_check={TOOLS}:reject", "data.max_length=2048", "data.max_prompt_length=1024"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "eval/agent/format_accuracy" in r][-1]
    assert evaluated["eval/agent/format_accuracy"] == 0.0 and evaluated["eval/agent/task_completion"] == 1.0
    assert evaluated["eval/agent/turns_per_episode"] >= 1.0 and "eval/agent/calls_per_episode" in evaluated


def test_agent_settings_in_training_need_tools_and_held_out_prompts(tmp_path, capsys):
    for overrides, message in (
            (["agent.task_judge=always"], "config key 'agent.task_judge' applies only with tools"),
            ([f"tools.functions=[{TOOLS}:calculator]", "agent.task_judge=always", "data.eval=null"],
             "config key 'agent' applies to the held-out evaluation: give data.eval")):
        code = main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={tmp_path / 'x'}",
                     "model.chat_template=chatml_tools", f"reward.function=[{TOOLS}:always]", *overrides])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and message in err[-1] and "Traceback" not in "\n".join(err), err
