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
from dataclasses import dataclass
from importlib import resources

from rlhfkit.errors import UserError, first_line

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
    chat = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as e:  # jinja's TemplateSyntaxError, UndefinedError, a raise_exception(): a template that cannot render
        raise UserError(f"model.chat_template='{setting}': the template cannot render a user and an assistant turn: "
                        f"{first_line(e)}") from e
    eos = tokenizer.eos_token
    if eos is None or eos not in text[text.rfind("Hello.") :]:
        raise UserError(f"model.chat_template='{setting}': the template does not end an assistant turn with the "
                        f"tokenizer's eos token {eos!r}, so generation would not stop at the end of a turn; use a "
                        "template made for this tokenizer")


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
