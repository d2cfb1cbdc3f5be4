"""A prompt record's own `tools` column in the online tool loop: the subset of the run's registered tools that its
episode sees (rendered with the record's schemas) and may call; a call of any other tool is malformed and never runs.
A record naming a function that is not registered, or describing one with other parameters, is refused at start
(`rollout.maker.check_row_tools`). The tiny model, the bundled chatml_tools template and the scripted policy of
`test_tool_loop`."""

import json

import pytest
import torch

from rlhfkit.config import GenerationConfig
from rlhfkit.errors import DataError
from rlhfkit.rollout.maker import check_row_tools
from rlhfkit.rollout.tool_loop import ToolLoop
from rlhfkit.tools import Toolbox
from rlhfkit.types import PromptBatch
from tests.scripted import Scripted
from tests.smoke.agent_tools import add, recording
from tests.unit.test_tool_loop import BIAS, END, call, ids, row, script, tiny, tool_turn  # noqa: F401 (tiny: fixture)

# A record's schema of `add`, in its own words (a dataset's description, not the function's docstring).
ROW_ADD = {"type": "function", "function": {"name": "add", "description": "Sum of a and b.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOTE = {"type": "function", "function": {"name": "note", "description": "Note it.", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
# chatml_tools's system turn around the schemas, written out by hand.
TOOLS_OPEN = ("<|im_start|>system\n# Tools\n\nYou can call these functions; their JSON schemas are between <tools> and "
              "</tools>:\n<tools>\n")
TOOLS_CLOSE = ("\n</tools>\n\nTo call a function, write its name and arguments as one JSON object between <tool_call> "
               "and </tool_call>:\n<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments object>}\n"
               "</tool_call><|im_end|>\n")


def play(tiny, rows, box):
    """Plays `rows` ((prompt text, the record's tools or None)) as one batch of episodes, scripted."""
    model, tok = tiny
    loop = ToolLoop(tok, GenerationConfig(max_new_tokens=400, top_k=1), 0, box, 3, 2.0, 100)
    examples = [{"prompt": p, "columns": {} if t is None else {"tools": json.dumps(t)}, "tools": t} for p, t in rows]
    batch = PromptBatch(torch.zeros(len(rows), 1, dtype=torch.long), torch.ones(len(rows), 1, dtype=torch.long))
    return loop(Scripted(model, tok, script, BIAS), batch, examples, 0)


def test_a_records_tools_are_the_episodes_tools(tiny):
    """Row 0 lists add in its own words: rendered with that schema only, its add call runs, its note call does not.
    Row 1 has no tools column: every registered tool, as the functions describe themselves. Row 2 lists none: no
    tools rendered, and its call is malformed. Only row 1's note call runs."""
    _, tok = tiny
    ran = []
    note = recording(ran)
    box = Toolbox([add, note])
    ro = play(tiny, [("raw " + call("add", a=2, b=3)[:-len(END)] + call("note", x=1)[:-len(END)], [ROW_ADD]),
                     ("raw " + call("note", x=7)[:-len(END)], None)], box)
    alone = play(tiny, [("raw " + call("note", x=9)[:-len(END)], [])], box)  # (a prompt without a system turn)
    prompts = [tok.decode(p[m.bool()]) for p, m in zip(ro.prompt_ids, ro.prompt_mask)] + [tok.decode(alone.prompt_ids[0])]
    user = lambda text: f"<|im_start|>user\nraw {text}<|im_end|>\n<|im_start|>assistant\n"  # noqa: E731
    assert prompts[0] == TOOLS_OPEN + json.dumps(ROW_ADD) + TOOLS_CLOSE + user(
        call("add", a=2, b=3)[:-len(END)] + call("note", x=1)[:-len(END)])
    schemas = "\n".join(json.dumps(box.functions[n].schema) for n in ("add", "note"))
    assert prompts[1] == TOOLS_OPEN + schemas + TOOLS_CLOSE + user(call("note", x=7)[:-len(END)])
    assert prompts[2] == user(call("note", x=9)[:-len(END)])
    assert ran == [7]  # note ran for row 1 only
    assert ro.tools.calls.tolist() == [1, 1] and ro.tools.malformed.tolist() == [1, 0]
    assert ro.tools.failures.tolist() == [0, 0] and ro.tools.per_tool.tolist() == [[1, 0], [0, 1]]
    assert (alone.tools.calls.tolist(), alone.tools.malformed.tolist()) == ([0], [1])
    assert [m for m in ro.completions[0] if m["role"] == "tool"] == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "note", "content": str({"error": "unknown tool 'note' (tools: add)"})}]
    assert alone.completions[0][1] == {"role": "tool", "name": "note",
                                       "content": str({"error": "unknown tool 'note' (tools: none)"})}
    assert list(ro.tools.well_formed) + list(alone.tools.well_formed) == [(False, True), (True, True), (False, True)]


class Tally:
    """An environment whose reset adds nothing to the prompt."""

    def reset(self, **row):
        self.count = 0

    def bump(self, by: int) -> int:
        """Add to the tally.

        Args:
            by: how much
        """
        self.count += by
        return self.count


def test_an_environments_methods_are_subset_too(tiny):
    """With an environment, a record's tools pick among the functions and its environment's methods alike."""
    bump = Toolbox([], Tally).environments.methods[None]["bump"].schema
    ro = play(tiny, [("raw " + call("bump", by=2)[:-len(END)] + call("add", a=1, b=1)[:-len(END)], [bump])],
              Toolbox([add], Tally))
    assert ro.tools.calls.tolist() == [1] and ro.tools.malformed.tolist() == [1]
    assert [m["content"] for m in ro.completions[0] if m["role"] == "tool"] == [
        "2", str({"error": "unknown tool 'add' (tools: bump)"})]


def example(tools, record=0, **columns):
    return {"prompt": "p", "columns": columns, "tools": tools, "record": record}


def test_records_whose_tools_cannot_be_played_are_refused_at_start():
    box = Toolbox([add], {"tally": Tally})
    bump = box.environments.methods["tally"]["bump"].schema
    check_row_tools(box, [example(None), example([ROW_ADD]), example([bump, ROW_ADD], environment="tally")], "d.jsonl")
    mul = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {}}}}
    renamed = {"type": "function", "function": {**ROW_ADD["function"], "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}
    cases = [
        (example([ROW_ADD, mul], record=3), "d.jsonl record 3: field 'tools' names 'mul', which is not one of the "
         "run's tools (add, bump): register it (tools.functions, or tools= in Python); only registered functions run"),
        (example([bump], record=4), "d.jsonl record 4: field 'tools' names 'bump', a method of environment 'tally', "
         "which is not this record's (its environment column: None)"),
        (example([renamed], record=5), "d.jsonl record 5: field 'tools' describes 'add' with parameters (x, y), but "
         "the registered add takes (a, b)"),
        (example([{"type": "function", "function": {"description": "?"}}], record=6),
         "d.jsonl record 6: field 'tools' item 0 names no function (expected {type: function, function: {name, ...}})"),
    ]
    for bad, message in cases:
        with pytest.raises(DataError) as caught:
            check_row_tools(box, [example(None), bad], "d.jsonl")
        assert str(caught.value) == message


def test_a_tools_column_in_a_run_without_tools_is_refused_at_start():
    """Without tools a record's `tools` column would be rendered into the prompt, showing the model tools nothing can
    run: refused in one line naming the record (the run does not guess functions from the schemas)."""
    check_row_tools(None, [example(None), example(None, record=1)], "d.jsonl")  # no column: nothing to say
    with pytest.raises(DataError) as caught:
        check_row_tools(None, [example(None), example([ROW_ADD], record=7)], "d.jsonl")
    assert str(caught.value) == (
        "d.jsonl record 7: a `tools` column, but the run has no tools, so no call could run: register them "
        "(tools.functions / tools.environment, or tools= / environment_factory= in Python), or remove the column")


def test_an_online_run_without_tools_refuses_a_tools_column(tmp_path):
    import rlhfkit

    records = [{"prompt": "What is 2+3?"}, {"prompt": [{"role": "user", "content": "2+3?"}], "tools": [ROW_ADD]}]
    with pytest.raises(DataError, match=r"^train_dataset record 1: a `tools` column, but the run has no tools"):
        rlhfkit.train("grpo", model="tiny", train_dataset=records, config="configs/grpo_tiny.yaml",
                      output_dir=str(tmp_path / "run"),
                      overrides={"model.chat_template": "chatml_tools", "data.max_length": 2048,
                                 "data.max_prompt_length": 1024, "data.eval": None, "max_steps": 1})


def test_a_reward_model_that_retokenises_reads_the_schemas_the_policy_saw(tiny):
    """The rollout carries each episode's schemas (`Rollout.schemas`) to the reward sources: a reward model with a
    template of its own re-renders the episode with them, the system turn holding them as the policy's prompt did.
    Row 0's own schema of add; row 1 every registered tool; row 2 none."""
    from rlhfkit.model_sources import build_tiny_tokenizer
    from rlhfkit.rewards import RewardModelSource, reward_inputs
    from tests.unit.test_reward_model_tools import Recorder

    _, tok = tiny
    box = Toolbox([add, recording([])])
    texts = ["raw " + call("add", a=a, b=b)[:-len(END)] for a, b in ((2, 3), (1, 1), (4, 4))]
    ro = play(tiny, list(zip(texts, ([ROW_ADD], None, []))), box)
    every = [box.functions[n].schema for n in ("add", "note")]
    assert list(ro.schemas) == [[ROW_ADD], every, None]
    assert list(ro.select(torch.tensor([2, 0])).schemas) == [None, [ROW_ADD]]
    rm_tok = build_tiny_tokenizer()  # its own template renders no tools: the policy's renders the episodes for it
    scorer = Recorder(rm_tok)
    source = RewardModelSource(scorer, "rm", tok)
    assert source.retokenize
    examples = [{"prompt": text, "columns": {}} for text in texts]
    source.score(ro, reward_inputs(tok, ro, examples))
    read = [rm_tok.decode(ids) for ids, _ in scorer.read]
    played = [tok.decode(p[m.bool()].tolist() + r[n.bool()].tolist())
              for p, m, r, n in zip(ro.prompt_ids, ro.prompt_mask, ro.response_ids, ro.response_mask)]
    assert read[0].startswith(TOOLS_OPEN + json.dumps(ROW_ADD) + TOOLS_CLOSE)
    assert read[1].startswith(TOOLS_OPEN + "\n".join(json.dumps(s) for s in every) + TOOLS_CLOSE)
    assert read[2].startswith("<|im_start|>user\n")
    assert [r.removesuffix("\n") for r in read] == played  # what the policy saw and wrote, token for token
