"""Tool-calling conversations in the data (rlhfkit.data with rlhfkit.templates): TRL's record shapes, the masks token
by token against hand-written spans, the `tools` column, and the one-line refusals.

On the char-level tiny tokenizer one character is one token (and each ChatML special one token), so the expected
ids of a hand-written span of text are its characters."""

import json
import re

import pytest

from rlhfkit.config import DataConfig, ModelConfig
from rlhfkit.data import build_datasets, collate_preference, collate_unpaired, tokenize_records
from rlhfkit.errors import DataError, TemplateError, UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.models import load_tokenizer

ADD = {"type": "function", "function": {"name": "add", "description": "Adds a and b.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
USER = {"role": "user", "content": "2+3?"}
CALLS = {"role": "assistant", "content": "", "tool_calls": [CALL]}
RESULT = {"role": "tool", "name": "add", "content": "5"}
ANSWER = {"role": "assistant", "content": "5"}
CONVERSATION = [USER, CALLS, RESULT, ANSWER]

# The assistant's own text (trained) and what lies around it (not), after the system turn with the tools.
PROMPT = "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
BETWEEN = '\n<|im_start|>tool\n<tool_response name="add">\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
ANSWER_TEXT = "5<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny", chat_template="chatml_tools"))


def system_turn(tok) -> str:
    """The system turn with ADD (its exact text is pinned in tests/unit/test_templates.py)."""
    text = tok.apply_chat_template([USER], tools=[ADD], tokenize=False)
    return text[: text.index("<|im_start|>user")]


def spans(tok, *parts: tuple[str, bool]) -> tuple[list[int], list[bool]]:
    """Token ids and per-token flags of hand-written (text, trained) spans."""
    ids, flags = [], []
    for text, trained in parts:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        flags += [trained] * len(piece)
    return ids, flags


def tokenize(records, kind, tok, **cfg):
    cfg = DataConfig(train="d.jsonl", **{"max_length": 2048, "max_prompt_length": 1024, **cfg})
    return tokenize_records(records, kind, tok, cfg, "d.jsonl")[0]


def test_sft_messages_train_the_calls_and_answers_not_the_results_or_headers(tok):
    (ex,) = tokenize([{"messages": CONVERSATION, "tools": [ADD]}], "sft", tok)
    expected, trained = spans(tok, (system_turn(tok) + PROMPT, False), (CALL_TEXT, True), (BETWEEN, False),
                              (ANSWER_TEXT, True))
    assert ex["input_ids"] == expected
    assert ex["labels"] == [t if m else -100 for t, m in zip(expected, trained)]


def test_sft_prompt_completion_masks_the_same_tokens(tok):
    """The completion's tool turn is not trained either; tools as TRL stores them, a JSON string, read the same."""
    (messages,) = tokenize([{"messages": CONVERSATION, "tools": [ADD]}], "sft", tok)
    (completion,) = tokenize([{"prompt": [USER], "completion": CONVERSATION[1:], "tools": json.dumps([ADD])}], "sft", tok)
    assert completion == messages


def test_preference_pair_action_mask_and_labels_token_by_token(tok):
    """DPO/IPO/ORPO's log-prob sums read the labels: the tool result and the next header never count."""
    rejected = [{"role": "assistant", "content": "6"}]
    (ex,) = tokenize([{"prompt": [USER], "chosen": CONVERSATION[1:], "rejected": rejected, "tools": [ADD]}], "preference", tok)
    prompt, _ = spans(tok, (system_turn(tok) + PROMPT, False))
    chosen, chosen_trained = spans(tok, (CALL_TEXT, True), (BETWEEN, False), (ANSWER_TEXT, True))
    assert ex["prompt_ids"] == prompt
    assert ex["chosen_ids"] == chosen and ex["chosen_action_mask"] == [int(m) for m in chosen_trained]
    assert tok.decode(ex["rejected_ids"]) == "6<|im_end|>" and ex["rejected_action_mask"] == [1, 1]
    batch = collate_preference([ex], tok.pad_token_id)
    width = len(prompt) + len(chosen)
    assert batch.chosen_labels[0].tolist() == [-100] * len(prompt) + [t if m else -100 for t, m in zip(chosen, chosen_trained)]
    assert batch.rejected_labels[0].tolist() == [-100] * len(prompt) + ex["rejected_ids"] + [-100] * (width - len(prompt) - 2)
    # The reward model reads the whole conversation: the tool result is in its response.
    whole = collate_preference([ex], tok.pad_token_id, actions_only=False)
    assert whole.chosen_labels[0].tolist() == [-100] * len(prompt) + chosen


def test_implicit_prompt_pairs_with_tool_turns_and_unpaired(tok):
    """TRL's conversational implicit prompt: the shared first turns are the prompt, even through a tool call; and
    KTO's completions carry the same action mask."""
    wrong = {"role": "assistant", "content": "6"}
    (pair,) = tokenize([{"chosen": [USER, CALLS, RESULT, ANSWER], "rejected": [USER, CALLS, RESULT, wrong],
                         "tools": [ADD]}], "preference", tok)
    prompt, _ = spans(tok, (system_turn(tok) + PROMPT + CALL_TEXT + BETWEEN, False))
    assert pair["prompt_ids"] == prompt and tok.decode(pair["chosen_ids"]) == ANSWER_TEXT
    records = [{"prompt": [USER], "completion": CONVERSATION[1:], "label": True, "tools": [ADD]},
               {"prompt": [USER], "completion": [wrong], "label": False, "tools": [ADD]}]
    good, bad = tokenize(records, "unpaired", tok)
    completion, trained = spans(tok, (CALL_TEXT, True), (BETWEEN, False), (ANSWER_TEXT, True))
    assert good["completion_ids"] == completion and good["completion_action_mask"] == [int(m) for m in trained]
    batch = collate_unpaired([good, bad], tok.pad_token_id)
    n = len(good["prompt_ids"])
    assert batch.labels[0].tolist()[n:] == [t if m else -100 for t, m in zip(completion, trained)]
    assert batch.kl_labels[1].tolist()[n:] == [t if m else -100 for t, m in zip(completion, trained)]  # bad's partner


def test_prompt_records_render_their_tools(tok, tmp_path):
    """A prompt record's tools column is rendered in its prompt (a JSON string as a list), and stays one of the
    columns reward functions receive, as TRL passes it; the example keeps it parsed (`tools`, which the tool loop
    renders) and the record's number (for errors found later)."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": [USER], "tools": json.dumps([ADD])}) + "\n" + json.dumps({"prompt": [USER]}) + "\n")
    (first, second), _ = build_datasets("prompt", DataConfig(train=str(path), max_prompt_length=1024), tok, 0)
    assert first["prompt_ids"] == spans(tok, (system_turn(tok) + PROMPT, False))[0]
    assert first["columns"] == {"tools": json.dumps([ADD])}
    assert (first["tools"], first["record"], second["tools"], second["record"]) == ([ADD], 0, None, 1)
    assert second["prompt_ids"] == spans(tok, (PROMPT, False))[0]


def test_a_tools_column_under_another_name(tok):
    """data.columns maps a dataset's own column onto `tools`, as onto any other field."""
    (renamed,) = tokenize([{"messages": CONVERSATION, "functions": [ADD]}], "sft", tok, columns={"tools": "functions"})
    assert renamed == tokenize([{"messages": CONVERSATION, "tools": [ADD]}], "sft", tok)[0]


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": CONVERSATION, "tools": '[{"type": "function",'},
         "d.jsonl record 0: field 'tools' is not valid JSON (Expecting property name enclosed in double quotes: line 1 col 22)"),
        ({"messages": CONVERSATION, "tools": {"name": "add"}},
         "d.jsonl record 0: field 'tools' must be a list of JSON schemas (objects), or a JSON string of one, got dict"),
        ({"messages": [USER, {**CALLS, "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{a: 2}"}}]}]},
         "d.jsonl record 0: field 'messages' message 1 tool call 0: arguments is not valid JSON (Expecting property name"),
        ({"messages": [USER, {**CALLS, "tool_calls": [{"function": {"arguments": {}}}]}]},
         "d.jsonl record 0: field 'messages' message 1 tool call 0: expected {type: function, function: {name, arguments}} "
         "with a non-empty name"),
        ({"messages": [{**USER, "tool_calls": [CALL]}, ANSWER]},
         "d.jsonl record 0: field 'messages' message 0: only an assistant turn can have tool_calls, this one is role 'user'"),
        ({"prompt": [USER], "completion": [CALLS, RESULT]},
         "d.jsonl record 0: field 'completion' ends with a tool turn; a response ends with the assistant's turn"),
        ({"text": "2+3=5", "tools": [ADD]}, "d.jsonl record 0: field 'tools' needs a conversation to render it"),
    ],
)
def test_bad_tool_records_are_one_line(tok, record, message):
    with pytest.raises(DataError) as err:
        tokenize([record], "sft", tok)
    assert message in str(err.value) and "\n" not in str(err.value)


FIX = re.escape("set model.chat_template=chatml_tools (rlhfkit's ChatML template with tools) or a template that renders them")


def test_a_template_that_drops_tools_or_calls_is_refused():
    """The tiny tokenizer's own ChatML template (like SmolLM2's) renders neither tools nor tool calls."""
    own = build_tiny_tokenizer()
    with pytest.raises(TemplateError, match=r"^d.jsonl record 0: the tokenizer's chat template ignores `tools` \(it renders "
                                            r"a conversation the same with and without them\); " + FIX):
        tokenize([{"messages": CONVERSATION, "tools": [ADD]}], "sft", own)
    with pytest.raises(TemplateError, match=r"^d.jsonl record 1: the tokenizer's chat template ignores the assistant "
                                            r"turns' tool_calls; " + FIX):
        tokenize([{"messages": [USER, ANSWER]}, {"messages": CONVERSATION}], "sft", own)
    with pytest.raises(TemplateError, match=r"^d.jsonl record 0: the tokenizer's chat template ignores `tools`"):
        tokenize([{"prompt": [USER], "tools": [ADD]}], "prompt", own)
    own.chat_template = None
    with pytest.raises(TemplateError, match=r"^d.jsonl record 0: the tokenizer has no chat template; " + FIX):
        tokenize([{"prompt": "2+3?", "completion": "5", "tools": [ADD]}], "sft", own)


def test_model_chat_template_setting(tmp_path):
    """model.chat_template: a bundled name, a .jinja file with its sibling response template, a tokenizer's
    directory; anything else, and a template that never writes the tokenizer's eos, is one line."""
    from rlhfkit import templates

    bundled = load_tokenizer(ModelConfig(name_or_path="tiny", chat_template="chatml_tools"))
    assert bundled.chat_template == templates.load("chatml_tools").chat_template
    assert bundled.response_template == templates.load("chatml_tools").response_template
    (tmp_path / "t.jinja").write_text(bundled.chat_template)
    (tmp_path / "t.response.json").write_text(json.dumps(bundled.response_template))
    from_file = load_tokenizer(ModelConfig(name_or_path="tiny", chat_template=str(tmp_path / "t.jinja")))
    assert (from_file.chat_template, from_file.response_template) == (bundled.chat_template, bundled.response_template)
    bundled.save_pretrained(tmp_path / "tok")
    from_dir = load_tokenizer(ModelConfig(name_or_path="tiny", chat_template=str(tmp_path / "tok")))
    assert (from_dir.chat_template, from_dir.response_template) == (bundled.chat_template, bundled.response_template)
    assert load_tokenizer(ModelConfig(name_or_path="tiny")).chat_template != bundled.chat_template  # None: its own

    (tmp_path / "bare.jinja").write_text("{% for m in messages %}{{ m['content'] }}</s>{% endfor %}")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    (tmp_path / "bad.response.json").write_text('{"fields": {}}')
    for setting, message in [
        ("chatml", "model.chat_template='chatml': not a bundled template (chatml_tools, smollm2_tools), a template file "
                   "or a tokenizer's directory"),
        (str(tmp_path / "bare.jinja"), f"model.chat_template='{tmp_path / 'bare.jinja'}': the template does not end an "
                                       "assistant turn with the tokenizer's eos token '<|im_end|>'"),
        (str(tmp_path / "bad.jinja"), f"model.chat_template='{tmp_path / 'bad.jinja'}': {tmp_path / 'bad.response.json'} "
                                      "is not a response template transformers can parse with"),
    ]:
        with pytest.raises(UserError) as err:
            load_tokenizer(ModelConfig(name_or_path="tiny", chat_template=setting))
        assert str(err.value).startswith(message) and "\n" not in str(err.value)
    (tmp_path / "bad.response.json").unlink()
    with pytest.raises(UserError, match=r"the template cannot render a user and an assistant turn: "):
        load_tokenizer(ModelConfig(name_or_path="tiny", chat_template=str(tmp_path / "bad.jinja")))


@pytest.mark.parametrize("stage", ["dpo", "rm"])
def test_the_trainers_collate_tool_pairs_as_their_loss_reads_them(tmp_path, stage):
    """The DPO trainer's batch labels the assistant's own tokens only; the reward model's labels the whole response
    (its mean pooling reads them), tool results included."""
    from rlhfkit.config import DPOConfig, RMConfig, load_config
    from rlhfkit.trainers.preference import PreferenceTrainer
    from rlhfkit.trainers.reward import RewardTrainer

    cfg_cls, trainer_cls = {"dpo": (DPOConfig, PreferenceTrainer), "rm": (RMConfig, RewardTrainer)}[stage]
    cfg = load_config(cfg_cls, f"configs/{stage}_tiny.yaml", [
        f"output_dir={tmp_path}", "logging.progress_bar=false", "model.chat_template=chatml_tools",
        "data.train=data/tiny/tool_pref.jsonl", "data.eval=null", "data.max_length=1024", "data.max_prompt_length=896"])
    trainer = trainer_cls(cfg)
    trainer.setup()
    (example,) = trainer.train_set[:1]
    batch = trainer.collate([example])
    n = len(example["prompt_ids"])
    labels = batch.chosen_labels[0, n : n + len(example["chosen_ids"])].tolist()
    chosen, mask = example["chosen_ids"], example["chosen_action_mask"]
    assert 0 < sum(mask) < len(mask)  # the calculator's result is in the response, off the action mask
    assert labels == ([t if m else -100 for t, m in zip(chosen, mask)] if stage == "dpo" else chosen)
