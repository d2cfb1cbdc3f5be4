"""A prompt record's `tools` column naming a function the run did not register, through the real CLI: refused at
start in one line naming the file, the record and the tool, exit status 2, before any model loads."""

import json
import os

from rlhfkit.cli import main

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}}}}


def test_a_record_naming_an_unregistered_tool_is_refused(tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    records = [{"prompt": "What is 2 + 3?", "tools": json.dumps([ADD])}, {"prompt": "What is 2 * 3?"},
               {"prompt": "What is 4 * 5?", "tools": json.dumps([ADD, MUL])}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    code = main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={tmp_path / 'run'}", f"data.train={data}",
                 "data.max_length=1280", "data.max_prompt_length=1024", "model.chat_template=chatml_tools",
                 "tools.functions=[tests.smoke.agent_tools:add]"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error:")]
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"rlhfkit: error: {data} record 2: field 'tools' names 'mul', which is not one of the run's tools "
                      "(add): register it (tools.functions, or tools= in Python); only registered functions run")
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")


def test_rlhfkit_eval_refuses_such_a_record_too(tmp_path, capsys):
    """The held-out prompts of `rlhfkit eval` with tools are checked the same way, before the policy loads."""
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 * 3?", "tools": [MUL]}) + "\n")
    code = main(["eval", "--config", "configs/eval_tiny.yaml", f"output_dir={tmp_path / 'eval'}", f"data.eval={data}",
                 "data.max_length=2048", "data.max_prompt_length=1024", "model.chat_template=chatml_tools",
                 "tools.functions=[tests.smoke.agent_tools:add]"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlhfkit: error:")]
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"rlhfkit: error: {data} record 0: field 'tools' names 'mul', which is not one of the run's")
    assert not (tmp_path / "eval" / "eval.json").exists()
