"""Canonical examples to token ids: chat templates (or a plain rendering without one), prompt and response
tokenized separately so that the loss mask never shifts; the action mask of a response with tool turns."""

from __future__ import annotations

from rlhfkit.data.formats import HH_ASSISTANT, Canonical, hh_messages
from rlhfkit.errors import DataError, TemplateError, first_line
from rlhfkit.templates import TOOLS_TEMPLATE, support


class Encoder:
    """Turns canonical examples into token ids.

    With a chat template, text prompts/responses become user/assistant messages and the template renders them.
    Without one, text stays raw text (prompt with the tokenizer's special tokens, response + EOS) and message
    lists get a plain "{role}: {content}\\n" rendering (warned about once). Prompt and response are tokenized
    separately and their ids concatenated: re-tokenizing the joined text could merge across the boundary and
    shift the loss mask. `plain` records that the current record had messages rendered without a template (the
    caller resets it per record and warns once per source).

    A record's `tools` (JSON schemas) are rendered with each of its prefixes. A record with tools, tool calls or tool
    results is refused, in one line that names the fix, when the template would render them as if they were not there
    (`templates.support`, the one probe of what a template renders).
    """

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token: set one, so that every response can end at it")
        self.tok = tokenizer
        self.template = bool(getattr(tokenizer, "chat_template", None))
        self.plain = False

    def ids(self, text: str, special: bool = False) -> list[int]:
        return self.tok(text, add_special_tokens=special)["input_ids"]

    def text(self, text: str) -> list[int]:
        """Language modelling: the raw text (never a chat template) with the tokenizer's special tokens, then EOS."""
        return self.ids(text, special=True) + [self.tok.eos_token_id]

    def render(self, messages: list[dict], generation_prompt: bool, where: str, tools: list[dict] | None = None) -> str:
        if not self.template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if generation_prompt else "")
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises on conversations the template refuses (roles, order): bad data
            raise DataError(f"{where}: the tokenizer's chat template failed on this conversation: {first_line(e)}") from e

    def check_tools(self, messages: list[dict], tools: list[dict] | None, where: str) -> None:
        """Refuses a chat template that would drop the conversation's tools, its assistant turns' tool calls or its
        tool results (`templates.support`: probed once per tokenizer)."""
        needs = (["tools"] if tools else []) + (["calls"] if any(m.get("tool_calls") for m in messages) else []) + (
            ["results"] if any(m.get("role") == "tool" for m in messages) else [])
        if needs:
            fix = f"set model.chat_template={TOOLS_TEMPLATE} (rlhfkit's ChatML template with tools) or a template that renders them"
            support(self.tok).require("template", *needs, where=where, fix=fix)

    def as_messages(self, prompt, response, hh: bool) -> tuple[list[dict], list[dict]] | None:
        """The (prompt, response) messages to render, or None for the raw-text path (no template, all text)."""
        if not self.template and isinstance(prompt, str) and (response is None or isinstance(response, str)):
            return None
        self.plain = not self.template
        if isinstance(prompt, str):  # an HH prompt ends with an empty "Assistant:" turn: the generation prompt
            prompt = hh_messages(prompt)[:-1] if hh else [{"role": "user", "content": prompt}]
        if isinstance(response, str):
            response = hh_messages(HH_ASSISTANT + response) if hh else [{"role": "assistant", "content": response}]
        return prompt, response or []

    def prompt(self, example: Canonical, where: str) -> list[int]:
        messages = self.as_messages(example.prompt, None, example.hh)
        if messages is None:
            self.check_tools([], example.tools, where)
            return self.ids(example.prompt, special=True)
        self.check_tools(messages[0], example.tools, where)
        return self.ids(self.render(messages[0], True, where, example.tools), special=not self.template)

    def pair(self, example: Canonical, response, where: str) -> tuple[list[int], list[int], list[int]]:
        """(prompt ids, response ids, action mask) for one response of the example. The action mask is 1 on the
        tokens of the response's assistant turns (from the first token after each assistant header to its EOS),
        0 on what lies between them: tool results, other turns, and the headers that open the next assistant turn."""
        messages = self.as_messages(example.prompt, response, example.hh)
        if messages is None:
            self.check_tools([], example.tools, where)
            response_ids = self.ids(response) + [self.tok.eos_token_id]
            return self.ids(example.prompt, special=True), response_ids, [1] * len(response_ids)
        prompt, response = messages
        turns = prompt + response
        spans = [(j, j + 1) for j in range(len(prompt), len(turns)) if turns[j]["role"] == "assistant"]
        (prompt_ids, _), *segments = self.spans(turns, spans, where, example.tools)
        response_ids = [t for ids, _ in segments for t in ids]
        return prompt_ids, response_ids, [int(is_response) for ids, is_response in segments for _ in ids]

    def conversation(self, turns: list[dict], where: str, tools: list[dict] | None = None) -> list[tuple[list[int], bool]]:
        """Segments (ids, is_response) of a whole conversation, one response segment per assistant turn."""
        self.plain = not self.template
        return self.spans(turns, [(j, j + 1) for j, m in enumerate(turns) if m["role"] == "assistant"], where, tools)

    def spans(self, messages: list[dict], spans: list[tuple[int, int]], where: str,
              tools: list[dict] | None = None) -> list[tuple[list[int], bool]]:
        """Renders the prefixes incrementally: for each response span (start, end) of message indices, the prompt
        segment is render(messages[:start] + generation prompt) minus the text already consumed, and the response
        is render(messages[:end]) minus that prompt, up to and including its last EOS token (what the template
        renders after it, e.g. ChatML's "\\n", opens the next prompt segment); a response with no EOS gets one.
        Every prefix is rendered with `tools`, as the whole conversation is."""
        self.check_tools(messages, tools, where)
        eos = self.tok.eos_token
        segments: list[tuple[list[int], bool]] = []
        consumed, consumed_end = "", 0
        for start, end in spans:
            prompt_text = self.render(messages[:start], True, where, tools)
            full_text = self.render(messages[:end], False, where, tools)
            for shorter, longer, a, b in ((consumed, prompt_text, consumed_end, start), (prompt_text, full_text, start, end)):
                if not longer.startswith(shorter):
                    raise TemplateError(
                        f"{where}: the chat template is not prefix-stable: its text for messages[:{b}] does not start "
                        f"with its text for messages[:{a}], so prompt and response tokens can't be told apart"
                    )
            segments.append((self.ids(prompt_text[len(consumed):], special=not segments and not self.template), False))
            response_text = full_text[len(prompt_text):]
            cut = response_text.rfind(eos)
            if cut >= 0:
                response_text = response_text[: cut + len(eos)]
                segments.append((self.ids(response_text), True))
            else:
                segments.append((self.ids(response_text) + [self.tok.eos_token_id], True))
            consumed, consumed_end = prompt_text + response_text, end
        return segments

