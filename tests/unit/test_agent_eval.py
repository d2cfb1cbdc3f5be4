"""The agent figures (`evaluation.agent`): format accuracy, task completion, per-episode tool figures and the gate,
computed by hand on hand-written episodes; the tool loop's per-turn format flags on scripted episodes."""

import pytest
import torch

from rlhfkit.errors import UserError
from rlhfkit.evaluation.agent import AgentFigures, agent_figures, gate, gate_lines, turn_formats
from rlhfkit.types import Rows, ToolCounts, ToolFigures
from tests.unit.test_tool_loop import END, add, call, fail, run, tiny  # noqa: F401 - tiny is a fixture

CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}


def episodes():
    """Three episodes: a call then an answer (both turns well formed); an answer cut by the length limit (1 turn, not
    well formed); a malformed call answered with an error, then an answer (2 turns, the first not well formed)."""
    completions = [
        [{"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "name": "add", "content": "5"},
         {"role": "assistant", "content": "5"}],
        [{"role": "assistant", "content": "the answer is"}],
        [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "nope"}}]},
         {"role": "tool", "name": "nope", "content": "{'error': 'unknown tool'}"}, {"role": "assistant", "content": "7"}],
    ]
    counts = ToolCounts(calls=torch.tensor([1, 0, 0]), failures=torch.tensor([0, 0, 0]), timeouts=torch.tensor([0, 0, 0]),
                        malformed=torch.tensor([0, 0, 1]), turns=torch.tensor([2, 1, 2]),
                        per_tool=torch.tensor([[1], [0], [0]]), tool_names=("add",),
                        well_formed=Rows([(True, True), (False,), (False, True)]))
    return counts, completions


def test_format_accuracy_task_completion_and_per_episode_figures_by_hand():
    counts, completions = episodes()
    figures = agent_figures(counts, completions, task_scores=[1.0, None, 0.5], threshold=1.0)
    # turns 2 + 1 + 2 = 5, well formed 2 + 0 + 1 = 3; judged 2 (the None row is not), completed 1 (0.5 < 1.0)
    # calls: 1 run + 1 malformed (a call is any call the policy made); failures: the malformed one (no result)
    tools = ToolFigures(episodes=3, turns=5, calls=2, failures=1, malformed=1, timeouts=0, per_tool=(("add", 1),))
    assert figures == AgentFigures(tools=tools, formatted_turns=3, judged=2, completed=1)
    d = figures.as_dict()
    assert d["format_accuracy"] == 3 / 5 and d["task_completion"] == 1 / 2
    assert d["calls_per_episode"] == 2 / 3 and d["malformed_per_call"] == 1 / 2 and d["turns_per_episode"] == 5 / 3
    assert d["failures_per_call"] == 1 / 2 and d["calls_per_episode/add"] == 1 / 3
    # A lower threshold passes the 0.5 episode too; no judge: no task completion.
    assert agent_figures(counts, completions, [1.0, None, 0.5], threshold=0.5).task_completion == 1.0
    assert agent_figures(counts, completions).task_completion is None


def test_format_check_adds_its_rule_and_never_sees_malformed_turns():
    counts, completions = episodes()
    seen = []

    def no_calls_in_final_answers(message):  # the user's rule: an answer turn must be a bare number
        seen.append(message)
        return bool(message.get("tool_calls")) or message["content"].isdigit()

    flags = turn_formats(completions, counts.well_formed, no_calls_in_final_answers)
    assert flags == [[True, True], [False], [False, True]]
    assert len(seen) == 3  # the malformed and the cut turns are not asked about
    assert agent_figures(counts, completions, format_check=lambda m: "tool_calls" in m).formatted_turns == 1
    with pytest.raises(UserError, match=r"agent.format_check '<lambda>' returned str 'yes'; it must return True or False"):
        turn_formats(completions, counts.well_formed, lambda m: "yes")
    with pytest.raises(UserError, match=r"raised on an assistant turn \(KeyError: 'missing'\)"):
        turn_formats(completions, counts.well_formed, lambda m: m["missing"])


def test_gate_passes_fails_or_is_undecided():
    ok = AgentFigures(tools=ToolFigures(episodes=10, turns=20, calls=11, failures=1, malformed=1, timeouts=0),
                      formatted_turns=19, judged=10, completed=8)
    g = gate(ok.format_accuracy, ok.task_completion, 0.95, 0.8)
    assert g == {"format_accuracy": {"value": 0.95, "threshold": 0.95, "passed": True},
                 "task_completion": {"value": 0.8, "threshold": 0.8, "passed": True}, "passed": True}
    assert gate_lines(g) == ["gate before reward modelling: PASSED: format accuracy 0.95 (>= 0.95), task completion 0.8 "
                             "(>= 0.8)"]
    low = AgentFigures(tools=ToolFigures(episodes=10, turns=20, calls=12, failures=2, malformed=2, timeouts=0),
                      formatted_turns=18, judged=10, completed=9)
    assert gate(low.format_accuracy, low.task_completion, 0.95, 0.8)["passed"] is False
    assert gate(low.format_accuracy, low.task_completion, 0.9, 0.8)["passed"] is True
    unjudged = AgentFigures(tools=ToolFigures(episodes=10, turns=20, calls=0, failures=0, malformed=0, timeouts=0),
                      formatted_turns=20, judged=0, completed=0)
    g = gate(unjudged.format_accuracy, unjudged.task_completion, 0.95, 0.8)
    assert g["passed"] is None and g["task_completion"]["passed"] is None and g["format_accuracy"]["passed"] is True
    assert "UNDECIDED" in gate_lines(g)[0] and "task completion - (>= 0.8)" in gate_lines(g)[0]


def test_the_tool_loop_flags_each_turn(tiny):
    """The loop's own flags on scripted episodes: a call then an answer, a direct answer, a call whose tool raises (a
    failure, still well formed), a call that does not parse, an unknown tool (its error read, then an answer), and a
    turn cut by the length limit."""
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    ro, _ = run(tiny, ["add 2 3", "hello", "raw " + call("fail", x=1)[:-len(END)], "raw " + broken,
                       "raw " + call("nope", x=1)[:-len(END)]], tools=(add, fail), max_new_tokens=400)
    assert list(ro.tools.well_formed) == [(True, True), (True,), (True, True), (False,), (False, True)]
    figures = agent_figures(ro.tools, ro.completions)
    # calls: 2 run + 2 malformed; failures: the raising call + the 2 malformed
    t = figures.tools
    assert (t.turns, figures.formatted_turns, t.calls, t.failures, t.malformed) == (8, 6, 4, 3, 2)
    cut, _ = run(tiny, ["add 2 3"], max_new_tokens=10)  # the call itself is longer than 10 tokens
    assert list(cut.tools.well_formed) == [(False,)] and agent_figures(cut.tools, cut.completions).format_accuracy == 0.0


def test_evaluation_plays_the_tool_loop_and_reports_the_agent_section(tiny):
    """`evaluate.sample` with a tool loop as its rollout component (a scripted policy), then `compare`: a call then the
    right answer, a direct wrong answer, a call that does not parse. Format accuracy 3 of 4 turns, task completion 1
    of 3 episodes (the judge: the answer in the last turn), 1 call run, 1 malformed."""
    from rlhfkit.config import GenerationConfig
    from types import SimpleNamespace

    from rlhfkit.evaluation.agent import AgentOptions
    from rlhfkit.evaluation.evaluate import compare
    from rlhfkit.evaluation.judges import python_judge
    from rlhfkit.evaluation.samples import sample
    from rlhfkit.objects import Objects
    from rlhfkit.rollout.maker import FreshRollout
    from rlhfkit.tools import Toolbox
    from tests.scripted import Scripted
    from tests.unit.test_tool_loop import BIAS, script

    model, tok = tiny
    params = GenerationConfig(max_new_tokens=200, top_k=1)
    cfg = SimpleNamespace(generation=params, seed=0, tools=SimpleNamespace(max_calls=3, timeout_s=2.0, max_result_tokens=100))
    loop = FreshRollout(cfg, tok, Objects(toolbox=Toolbox([add, fail])))
    broken = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    prompts = [{"prompt": p, "columns": {"answer": a}, "prompt_ids": tok(p, add_special_tokens=False)["input_ids"]}
               for p, a in (("add 2 3", "5"), ("hello", "1"), ("raw " + broken, "2"))]

    def answered(completions, answer, **kwargs):
        return [float(a in [m for m in c if m["role"] == "assistant"][-1]["content"]) for c, a in zip(completions, answer)]

    parts = sample(Scripted(model, tok, script, BIAS), None, tok, prompts, params, batch_size=2, rollout=loop)
    assert len(parts[0]) == 2  # two batches, concatenated by compare
    result = compare(*parts, tok, prompts, {"answered": python_judge(answered)}, params,
                     agent=AgentOptions(task_judge="answered", task_threshold=1.0))
    agent = result["agent"]
    assert agent["policy"] == {"format_accuracy": 0.75, "task_completion": 1 / 3, "calls_per_episode": 2 / 3,
                               "failures_per_call": 1 / 2, "malformed_per_call": 1 / 2, "timeouts_per_call": 0.0,
                               "turns_per_episode": 4 / 3, "calls_per_episode/add": 1 / 3, "calls_per_episode/fail": 0.0,
                               "episodes": 3, "turns": 4, "calls": 2, "failures": 1, "malformed": 1,
                               "formatted_turns": 3, "judged": 3, "completed": 1}
    assert agent["reference"] is None and agent["task_judge"] == "answered"
    assert result["policy"]["reward"]["answered"]["mean"] == 1 / 3
    # Lengths count the policy's tokens only: the first episode's tool result and header are not in it.
    turn1, turn2 = call("add", a=2, b=3), f"got 5{END}"
    assert result["samples"][0]["policy"]["length"] == len(tok(turn1 + turn2, add_special_tokens=False)["input_ids"])


def test_training_and_evaluation_report_the_same_tool_figures():
    """One definition: the held-out figures (eval.json's agent section, eval/agent/ in training) hold exactly the
    numbers training logs under tools/ for the same episodes, TRL's two names included as aliases."""
    counts, completions = episodes()
    evaluated = agent_figures(counts, completions).as_dict()
    trained = ToolFigures.of(counts).metrics("tools/")
    assert {f"tools/{k}": evaluated[k] for k in ToolFigures.of(counts).as_dict()} == {
        k: v for k, v in trained.items() if k not in ("tools/call_frequency", "tools/failure_frequency")}
    assert trained["tools/call_frequency"] == evaluated["calls_per_episode"] == 2 / 3
    assert trained["tools/failure_frequency"] == evaluated["failures_per_call"] == 1 / 2
