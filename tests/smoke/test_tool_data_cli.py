"""SFT and DPO on tool conversations through the real CLI (tiny model, bundled chatml_tools template), and the bad
inputs of tool data: exit status 2 and one line."""

import json
import math
import os

import pytest

from rlhfkit.cli import main

TOOL_SFT, TOOL_PREF = "data/tiny/tool_sft.jsonl", "data/tiny/tool_pref.jsonl"
SHORT = ["data.max_length=1024", "data.max_prompt_length=896", "optim.per_device_batch_size=4", "optim.warmup_steps=0",
         "logging.logging_steps=1", "data.eval=null"]


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tool_sft") / "run")
    args = ["sft", "--config", "configs/sft_tiny.yaml", "model.chat_template=chatml_tools", f"data.train={TOOL_SFT}",
            *SHORT, "max_steps=8", "optim.lr=1e-2", f"output_dir={out}"]
    assert main(args) == 0
    return out


def test_sft_on_tool_conversations_learns_and_saves_the_template(sft_run):
    """The loss falls; the saved tokenizer carries the bundled template and its response template, so a later stage
    (and transformers' parse_response) reads the model's tool calls without setting model.chat_template again."""
    from transformers import AutoTokenizer

    from rlhfkit import templates

    losses = [m["loss"] for m in read_metrics(sft_run) if "loss" in m]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    tok = AutoTokenizer.from_pretrained(sft_run)
    bundled = templates.load("chatml_tools")
    assert (tok.chat_template, tok.response_template) == (bundled.chat_template, bundled.response_template)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    assert tok.parse_response(reply, prefix=prompt)["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]


def test_dpo_on_tool_pairs_from_the_sft_model(sft_run, tmp_path):
    """DPO on pairs whose chosen side calls the tool (its tool result off the action mask), from the SFT model's
    directory: it starts at log 2 (policy = reference) and the loss falls."""
    out = str(tmp_path / "dpo")
    args = ["dpo", "--config", "configs/dpo_tiny.yaml", f"model.name_or_path={sft_run}", f"data.train={TOOL_PREF}",
            *SHORT, "max_steps=4", "optim.lr=5e-3", f"output_dir={out}"]
    assert main(args) == 0
    losses = [m["loss"] for m in read_metrics(out) if "loss" in m]
    assert len(losses) == 4 and losses[0] == pytest.approx(math.log(2), abs=1e-4) and losses[-1] < losses[0], losses


def run_cli(capsys, args):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if line.startswith("rlhfkit: error:")]


def test_a_template_without_tools_is_refused(capsys, tmp_path):
    """The tiny tokenizer's own template (like SmolLM2's) drops tools: refused in one line naming the fix."""
    code, errors = run_cli(capsys, ["sft", "--config", "configs/sft_tiny.yaml", f"data.train={TOOL_SFT}", *SHORT,
                                    "max_steps=1", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and len(errors) == 1, errors
    assert f"{TOOL_SFT} record 0: the tokenizer's chat template ignores `tools`" in errors[0]
    assert "set model.chat_template=chatml_tools" in errors[0]


def test_a_tools_column_that_is_not_json_is_refused(capsys, tmp_path):
    with open(TOOL_SFT) as f:
        records = [json.loads(line) for line in f][:3]
    records[2]["tools"] = '[{"type": "function", "function": {"name": "add"'
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, errors = run_cli(capsys, ["sft", "--config", "configs/sft_tiny.yaml", "model.chat_template=chatml_tools",
                                    f"data.train={path}", *SHORT, "max_steps=1", f"output_dir={tmp_path / 'out'}"])
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].endswith(f"{path} record 2: field 'tools' is not valid JSON (Expecting ',' delimiter: line 1 col 49)")
