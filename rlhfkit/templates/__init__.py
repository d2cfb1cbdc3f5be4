"""Bundled chat templates, each with the response template that transformers' response parsing reads, and the
`model.chat_template` setting that puts one on a tokenizer.

Bundled names (`BUNDLED`):
    chatml_tools    ChatML (<|im_start|>{role}\\n...<|im_end|>\\n) that renders `tools` in the system turn, assistant
                    `tool_calls` as <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, and
                    {"role": "tool", "name", "content"} turns; prefix-preserving. For any tokenizer whose eos token
                    is <|im_end|>: SmolLM2-Instruct, the tiny test tokenizer, Qwen2.x.
    smollm2_tools   chatml_tools with SmolLM2's own default system text for a conversation without a system turn.

Loading one:

    from rlhfkit import templates
    bundled = templates.load("chatml_tools")       # a ChatTemplate: .name, .chat_template, .response_template
    bundled.apply_to(tokenizer)                   # sets tokenizer.chat_template and tokenizer.response_template
    text = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    message = tokenizer.parse_response(generated_ids, prefix=prompt_ids, tools=schemas)
    # -> {"role": "assistant", "content": ..., "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}

In a config, `model.chat_template: chatml_tools` does the same when the tokenizer is loaded (`apply_setting`); it
also takes a .jinja file (its response template, if any, from a sibling `<stem>.response.json`) or a tokenizer's
directory (its chat template and response template). Parsing is transformers' own (`parse_response`, transformers
>= 5.13's `response_template`); `tools=` casts each argument to its tool's JSON schema (transformers >= 5.15).
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from importlib import resources

from rlhfkit.errors import TemplateError, UserError, first_line

TOOLS_TEMPLATE = "chatml_tools"  # the bundled template that error messages suggest for data with tools

# SmolLM2-Instruct's own template writes this system turn when a conversation has none.
_SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# name -> (template file in this package, default system text or None)
BUNDLED: dict[str, tuple[str, str | None]] = {
    "chatml_tools": ("chatml_tools.jinja", None),
    "smollm2_tools": ("chatml_tools.jinja", _SMOLLM2_SYSTEM),
}


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template (jinja source) and the response template transformers parses its replies with (None: the
    template's replies cannot be parsed)."""

    name: str  # a bundled name, or the file or directory it was read from
    chat_template: str
    response_template: dict | None

    def apply_to(self, tokenizer) -> None:
        """Sets the tokenizer's chat template and response template (both saved with it by `save_pretrained`)."""
        tokenizer.chat_template = self.chat_template
        tokenizer.response_template = self.response_template


def load(name: str) -> ChatTemplate:
    """The bundled template `name` (one of `BUNDLED`)."""
    if name not in BUNDLED:
        raise UserError(f"no bundled chat template '{name}' (bundled: {', '.join(BUNDLED)})")
    filename, default_system = BUNDLED[name]
    package = resources.files(__name__)
    source = package.joinpath(filename).read_text(encoding="utf-8")
    if default_system is not None:  # the template reads `default_system` when the conversation has no system turn
        source = "{%- set default_system = " + json.dumps(default_system) + " -%}\n" + source
    stem = filename[: -len(".jinja")]
    response = json.loads(package.joinpath(f"{stem}.response.json").read_text(encoding="utf-8"))
    return ChatTemplate(name, source, response)


def from_setting(setting: str) -> ChatTemplate:
    """The template `model.chat_template` names: a bundled name, a template file (a sibling `<stem>.response.json`
    is its response template), or a tokenizer's directory (its chat template and response template)."""
    if setting in BUNDLED:
        return load(setting)
    path = os.path.expanduser(setting)
    if os.path.isfile(path):
        return ChatTemplate(setting, _read(path, setting), _response_beside(path, setting))
    if os.path.isdir(path):
        from transformers import AutoTokenizer

        from rlhfkit.model_sources import from_pretrained

        tokenizer = from_pretrained(AutoTokenizer, path)
        if not tokenizer.chat_template:
            raise UserError(f"model.chat_template='{setting}': the tokenizer in that directory has no chat template")
        return ChatTemplate(setting, tokenizer.chat_template, getattr(tokenizer, "response_template", None))
    raise UserError(f"model.chat_template='{setting}': not a bundled template ({', '.join(BUNDLED)}), a template file "
                    "or a tokenizer's directory")


def apply_setting(tokenizer, setting: str | None) -> None:
    """Puts the template `model.chat_template` names on `tokenizer` (nothing when None), after checking that it
    renders a conversation and ends an assistant turn with the tokenizer's eos token, at which generation stops."""
    if setting is None:
        return
    template = from_setting(setting)
    template.apply_to(tokenizer)
    found = support(tokenizer)
    if found.failure is not None:
        raise TemplateError(f"model.chat_template='{setting}': the template cannot render a user and an assistant "
                            f"turn: {found.failure}")
    if not found.end_of_turn:
        raise TemplateError(f"model.chat_template='{setting}': the template does not end an assistant turn with the "
                            f"tokenizer's eos token {tokenizer.eos_token!r}, so generation would not stop at the end "
                            "of a turn; use a template made for this tokenizer")


def _read(path: str, setting: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"model.chat_template='{setting}': cannot read the file: {first_line(e)}") from e


def _response_beside(path: str, setting: str) -> dict | None:
    """The response template beside a template file: `<stem>.response.json`, or None when there is none."""
    response_path = os.path.splitext(path)[0] + ".response.json"
    if not os.path.isfile(response_path):
        return None
    try:
        response = json.loads(_read(response_path, setting))
    except json.JSONDecodeError as e:
        raise UserError(f"model.chat_template='{setting}': {response_path} is not valid JSON ({e.msg}: line {e.lineno} "
                        f"col {e.colno})") from None
    from transformers.utils.chat_parsing import ResponseParser

    try:  # transformers validates the template's shape, fields and patterns as it builds a parser
        ResponseParser(response, prefix="")
    except (ValueError, TypeError, AttributeError) as e:
        raise UserError(f"model.chat_template='{setting}': {response_path} is not a response template transformers "
                        f"can parse with: {first_line(e)}") from None
    return response


# What a chat template renders ---------------------------------------------------------------------------------------

# A conversation whose tool schema, tool call and tool result carry markers: a template that renders each shows its
# marker. The probe's own text, never a user's record, so that one answer holds for every conversation.
_PROBE_TOOL, _PROBE_RESULT, _PROBE_REPLY = "rlhfkit_probe_tool", "rlhfkit_probe_result", "rlhfkit_probe_reply"
_PROBE_SCHEMA = {"type": "function", "function": {"name": _PROBE_TOOL, "description": "A probe.", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "description": "a number"}}, "required": ["n"]}}}
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": _PROBE_TOOL, "arguments": {"n": 1}}}]}
_PROBE_USER = {"role": "user", "content": "x"}
_PROBE_RESULTS = [{"role": "tool", "name": _PROBE_TOOL, "content": _PROBE_RESULT}]


@dataclass(frozen=True)
class Support:
    """What a tokenizer's chat template renders, probed once (`support`). Every part of the package that needs one
    of these reads it here, and refuses with a `TemplateError` through `require`."""

    template: bool  # there is a chat template at all
    end_of_turn: bool  # an assistant turn ends with the tokenizer's eos token, where generation stops
    tools: bool  # the tools' JSON schemas (`tools=`) change what it renders
    calls: bool  # an assistant turn's `tool_calls` are rendered
    results: bool  # {"role": "tool"} results are rendered
    prefix_preserving: bool  # a conversation with tool results renders as an extension of the one before them
    parses_calls: bool  # a `response_template` that parses a rendered tool call back into the call
    failure: str | None = None  # what rendering a user and an assistant turn raised (first line); None: it renders

    NEEDS = {  # what each part of a run needs -> the sentence naming what is missing
        "template": "the tokenizer has no chat template",
        "end_of_turn": "the chat template does not end an assistant turn with the tokenizer's eos token",
        "tools": "the tokenizer's chat template ignores `tools` (it renders a conversation the same with and without them)",
        "calls": "the tokenizer's chat template ignores the assistant turns' tool_calls",
        "results": "the tokenizer's chat template does not render tool results",
        "prefix_preserving": ("the chat template does not render a conversation with tool results as an extension of "
                              "the conversation before them (not prefix-preserving)"),
        "parses_calls": "the tokenizer has no response_template that parses the model's tool calls",
    }

    def missing(self, *needs: str) -> list[str]:
        """Of `needs` (names of the fields above), those this template lacks, in the given order."""
        return [n for n in needs if not getattr(self, n)]

    def require(self, *needs: str, where: str, fix: str) -> None:
        """A one-line `TemplateError` (`where`: what asked, e.g. a record or "tools") naming the first of `needs`
        the template lacks and `fix`; nothing when it has them all."""
        if lacking := self.missing(*needs):
            raise TemplateError(f"{where}: {self.NEEDS[lacking[0]]}; {fix}")


# tokenizer -> {(chat template, response template, eos): Support}: a tokenizer is probed once per template it holds
_PROBED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def support(tokenizer, chat_template: str | None = None) -> Support:
    """What `tokenizer`'s chat template (or `chat_template`, rendered with the tokenizer) renders. Computed once per
    tokenizer and template: a setting that changes the template (`apply_setting`) is probed anew."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    response = getattr(tokenizer, "response_template", None)
    key = (template, json.dumps(response, sort_keys=True), tokenizer.eos_token)
    try:
        cached = _PROBED.setdefault(tokenizer, {})
    except TypeError:  # an object that takes no weak reference: probed each time
        cached = {}
    if key not in cached:
        cached[key] = _probe(tokenizer, template, response)
    return cached[key]


def _probe(tokenizer, template: str | None, response: dict | None) -> Support:
    if not template:
        return Support(*(False,) * 7)

    def strict(messages, tools=None, header=False, tokenize=False):
        return tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=tokenize,
                                             add_generation_prompt=header, **({"return_dict": False} if tokenize else {}))

    def render(*args, **kwargs):
        try:
            return strict(*args, **kwargs)
        except Exception:  # noqa: BLE001 - jinja's raise_exception on a role or field it refuses: it cannot render it
            return None

    try:
        turn = strict([{"role": "user", "content": "Hi."}, {"role": "assistant", "content": _PROBE_REPLY}])
    except Exception as e:  # noqa: BLE001 - jinja's TemplateSyntaxError, UndefinedError, a raise_exception()
        return Support(True, *(False,) * 6, failure=first_line(e))
    eos = tokenizer.eos_token
    end_of_turn = bool(eos and eos in turn[turn.rfind(_PROBE_REPLY):])
    with_tools, without = render([_PROBE_USER], [_PROBE_SCHEMA], True), render([_PROBE_USER], None, True)
    episode = render([_PROBE_USER, _PROBE_CALL, *_PROBE_RESULTS])
    uncalled = render([_PROBE_USER, {"role": "assistant", "content": ""}, *_PROBE_RESULTS])
    calls = episode is not None and episode != uncalled  # the call changes what it renders
    results = bool(episode and _PROBE_RESULT in episode)
    return Support(template=True, end_of_turn=end_of_turn, tools=with_tools is not None and with_tools != without,
                   calls=calls, results=results,
                   prefix_preserving=calls and results and _extends(render, tokenizer.eos_token_id),
                   parses_calls=response is not None and _parses(tokenizer, render, response))


def _extends(render, eos_id) -> bool:
    """Whether the conversation with the call's results and the next assistant header renders, in tokens, as an
    extension of the conversation up to the call's EOS (the point where a sampled turn ends)."""
    before = render([_PROBE_USER, _PROBE_CALL], tokenize=True)
    after = render([_PROBE_USER, _PROBE_CALL, *_PROBE_RESULTS], header=True, tokenize=True)
    if before is None or after is None:
        return False
    before, after = list(before), list(after)
    ends = [i for i, t in enumerate(before) if t == eos_id]
    before = before[: ends[-1] + 1] if ends else before
    return after[: len(before)] == before


def _parses(tokenizer, render, response: dict) -> bool:
    """Whether the response template reads the probe's rendered call back as that call."""
    prompt = render([_PROBE_USER], [_PROBE_SCHEMA], True, tokenize=True)
    whole = render([_PROBE_USER, _PROBE_CALL], [_PROBE_SCHEMA], tokenize=True)
    if prompt is None or whole is None or list(whole[: len(prompt)]) != list(prompt):
        return False
    saved = getattr(tokenizer, "response_template", None)
    try:
        tokenizer.response_template = response
        message = tokenizer.parse_response(list(whole[len(prompt):]), prefix=list(prompt), tools=[_PROBE_SCHEMA])
    except Exception:  # noqa: BLE001 - a response template that cannot read the template's own call
        return False
    finally:
        tokenizer.response_template = saved
    calls = (message or {}).get("tool_calls") or []
    fn = calls[0].get("function", {}) if calls and isinstance(calls[0], dict) else {}
    return fn.get("name") == _PROBE_TOOL and fn.get("arguments") == {"n": 1}
