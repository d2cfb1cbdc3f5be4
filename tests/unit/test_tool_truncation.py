"""Tool definitions are never cut away silently. A prompt longer than data.max_prompt_length keeps its last tokens,
and the tool schemas and the system message are its first ones: a record with either is dropped instead of cut
(counted in the summary line), refused with data.truncation=error, and, as an online prompt, refused in one line
naming the record and the lengths.

On the char-level tiny tokenizer one character is one token (each ChatML special one token), so a rendered prompt's
length in tokens is its length in characters, with each special token counted once."""

import pytest

from rlhfkit.config import DataConfig, ModelConfig
from rlhfkit.data import tokenize_records
from rlhfkit.errors import DataError
from rlhfkit.models import load_tokenizer

LONG = {"type": "function", "function": {"name": "lookup", "description": "Looks a word up. " * 20, "parameters": {
    "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}
USER = {"role": "user", "content": "What does 'tool' mean?"}
SYSTEM = {"role": "system", "content": "You answer in one word. " * 10}
ANSWER = {"role": "assistant", "content": "An instrument."}
PLAIN_PROMPT = [{"role": "user", "content": "x" * 1500}]  # long, and without tools or a system message


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig(name_or_path="tiny", chat_template="chatml_tools"))


def prompt_length(tok, messages, tools=None) -> int:
    """Hand count: characters of the rendered prompt, each of the 2 ChatML special tokens ("<|im_start|>",
    "<|im_end|>") one token."""
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return len(text) - sum(text.count(s) * (len(s) - 1) for s in ("<|im_start|>", "<|im_end|>"))


def tokenize(records, kind, tok, **cfg):
    cfg = DataConfig(train="d.jsonl", **{"max_length": 2048, **cfg})
    return tokenize_records(records, kind, tok, cfg, "d.jsonl")


def test_the_hand_count_is_the_tokenizers(tok):
    text = tok.apply_chat_template([USER], tools=[LONG], tokenize=False, add_generation_prompt=True)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) == prompt_length(tok, [USER], [LONG]) > 400


@pytest.mark.parametrize("kind", ["sft", "preference", "unpaired"])
def test_a_record_whose_tools_would_be_cut_is_dropped_and_counted(tok, kind):
    n = prompt_length(tok, [USER], [LONG])
    response = {"sft": {"completion": [ANSWER]}, "unpaired": {"completion": [ANSWER], "label": True},
                "preference": {"chosen": [ANSWER], "rejected": [{"role": "assistant", "content": "A hammer."}]}}[kind]
    records = [{"prompt": [USER], **response, "tools": [LONG]},  # n tokens: fits
               {"prompt": [USER, {"role": "assistant", "content": "?"}, USER], **response, "tools": [LONG]},  # cut
               {"prompt": PLAIN_PROMPT, **response}]  # cut, keeping its last tokens, as before
    examples, stats = tokenize(records, kind, tok, max_prompt_length=n)
    assert (stats.records, stats.dropped, stats.tools_dropped, stats.prompts_truncated) == (3, 1, 1, 1)
    assert len(examples) == 2
    first = examples[0]["input_ids" if kind == "sft" else "prompt_ids"]
    assert tok.decode(first[:n]) == tok.apply_chat_template([USER], tools=[LONG], tokenize=False,
                                                             add_generation_prompt=True)  # whole, schemas first
    assert "1 record dropped: their tool definitions (or system message) did not fit data.max_prompt_length" in \
        stats.summary("d.jsonl")


def test_sft_messages_with_tools_or_a_system_message_are_dropped_not_cut(tok):
    long_user = {"role": "user", "content": "y" * 1200}
    records = [{"messages": [USER, ANSWER], "tools": [LONG]},  # fits
               {"messages": [long_user, ANSWER], "tools": [LONG]},  # its tools would be cut
               {"messages": [SYSTEM, long_user, ANSWER]},  # its system message would be cut
               {"messages": [long_user, ANSWER]}]  # cut, as before
    examples, stats = tokenize(records, "sft", tok, max_prompt_length=prompt_length(tok, [USER], [LONG]))
    assert (stats.dropped, stats.tools_dropped, stats.prompts_truncated, len(examples)) == (2, 2, 1, 2)
    assert "2 records dropped: their tool definitions (or system message)" in stats.summary("d.jsonl")


def test_truncation_error_refuses_naming_the_record_and_its_tools(tok):
    records = [{"prompt": [USER], "completion": [ANSWER], "tools": [LONG]}] * 2
    records[1] = {**records[1], "prompt": [SYSTEM, USER]}
    n = prompt_length(tok, [SYSTEM, USER], [LONG])
    with pytest.raises(DataError, match=rf"^d.jsonl record 1: prompt is {n} tokens, longer than "
                                        rf"data.max_prompt_length={n - 1}; cutting it would cut its tool definitions"):
        tokenize(records, "sft", tok, max_prompt_length=n - 1, truncation="error")


def test_an_online_prompt_with_tools_that_do_not_fit_is_refused_naming_the_record_and_lengths(tok):
    """A prompt record (the online stages' data) is never dropped quietly: the run would train on fewer prompts than
    its file holds. Refused in one line, whatever data.truncation says."""
    n = prompt_length(tok, [USER], [LONG])
    records = [{"prompt": [USER]}, {"prompt": [USER], "tools": [LONG]}]
    examples, _ = tokenize(records, "prompt", tok, max_prompt_length=n)
    assert len(examples[1]["prompt_ids"]) == n
    with pytest.raises(DataError, match=rf"^d.jsonl record 1: the prompt with its tool definitions \(or system message\) "
                                        rf"is {n} tokens, longer than data.max_prompt_length={n - 1}"):
        tokenize(records, "prompt", tok, max_prompt_length=n - 1)
    records = [{"prompt": PLAIN_PROMPT}]  # no tools, no system message: cut to its last tokens, as before
    examples, stats = tokenize(records, "prompt", tok, max_prompt_length=100)
    assert len(examples[0]["prompt_ids"]) == 100 and stats.prompts_truncated == 1


def lookup(word: str) -> str:
    """Looks a word up in the dictionary and returns its meaning, in a few words, or an empty string for a word it
    does not know; the meaning is the most common one, as a dictionary of everyday English gives it first.

    Args:
        word: The word to look up, in lower case, without punctuation.
    """
    return "an instrument"


@pytest.mark.parametrize("stage", ["grpo", "online_dpo"])
def test_the_tool_loop_refuses_at_start_a_prompt_whose_tools_do_not_fit(tmp_path, tok, stage):
    """The tool loop renders each prompt with its episode's tools (the run's, which the data layer never sees): one
    that does not fit data.max_prompt_length is refused before any model loads, naming the record and the lengths."""
    import rlhfkit
    from rlhfkit.tools import describe

    schemas = [describe(lookup).schema]
    prompts = [{"prompt": "Define 'tool'."}, {"prompt": [USER]}]
    n = prompt_length(tok, [USER], schemas)
    assert n > prompt_length(tok, [{"role": "user", "content": "Define 'tool'."}], schemas)
    with pytest.raises(DataError, match=rf"^train_dataset record 1: the prompt with its tools' definitions is {n} "
                                        rf"tokens, longer than data.max_prompt_length={n - 1}"):
        rlhfkit.train(stage, model="tiny", tools=[lookup], train_dataset=prompts, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                      config=f"configs/{stage}_tiny.yaml", output_dir=str(tmp_path / "run"),
                      overrides={"model.chat_template": "chatml_tools", "data.max_prompt_length": n - 1, "data.max_length": 2048, "data.eval": None,
                                 "reward.model": [], "max_steps": 1})
