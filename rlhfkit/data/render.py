"""Canonical examples to token ids: chat templates (or a plain rendering without one), prompt and response
tokenized separately so that the loss mask never shifts."""

from __future__ import annotations

from rlhfkit.data.formats import HH_ASSISTANT, Canonical, hh_messages
from rlhfkit.errors import DataError, first_line


class Encoder:
    """Turns canonical examples into token ids.

    With a chat template, text prompts/responses become user/assistant messages and the template renders them.
    Without one, text stays raw text (prompt with the tokenizer's special tokens, response + EOS) and message
    lists get a plain "{role}: {content}\\n" rendering (warned about once). Prompt and response are tokenized
    separately and their ids concatenated: re-tokenizing the joined text could merge across the boundary and
    shift the loss mask. `plain` records that the current record had messages rendered without a template (the
    caller resets it per record and warns once per source).
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

    def render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        if not self.template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if generation_prompt else "")
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises on conversations the template refuses (roles, order): bad data
            raise DataError(f"{where}: the tokenizer's chat template failed on this conversation: {first_line(e)}") from e

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
            return self.ids(example.prompt, special=True)
        return self.ids(self.render(messages[0], True, where), special=not self.template)

    def pair(self, example: Canonical, response, where: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) for one response of the example."""
        messages = self.as_messages(example.prompt, response, example.hh)
        if messages is None:
            return self.ids(example.prompt, special=True), self.ids(response) + [self.tok.eos_token_id]
        prompt, response = messages
        (prompt_ids, _), (response_ids, _) = self.spans(prompt + response, [(len(prompt), len(prompt) + len(response))], where)
        return prompt_ids, response_ids

    def conversation(self, turns: list[dict], where: str) -> list[tuple[list[int], bool]]:
        """Segments (ids, is_response) of a whole conversation, one response segment per assistant turn."""
        self.plain = not self.template
        return self.spans(turns, [(j, j + 1) for j, m in enumerate(turns) if m["role"] == "assistant"], where)

    def spans(self, messages: list[dict], spans: list[tuple[int, int]], where: str) -> list[tuple[list[int], bool]]:
        """Renders the prefixes incrementally: for each response span (start, end) of message indices, the prompt
        segment is render(messages[:start] + generation prompt) minus the text already consumed, and the response
        is render(messages[:end]) minus that prompt, up to and including its last EOS token (what the template
        renders after it, e.g. ChatML's "\\n", opens the next prompt segment); a response with no EOS gets one."""
        eos = self.tok.eos_token
        segments: list[tuple[list[int], bool]] = []
        consumed, consumed_end = "", 0
        for start, end in spans:
            prompt_text = self.render(messages[:start], True, where)
            full_text = self.render(messages[:end], False, where)
            for shorter, longer, a, b in ((consumed, prompt_text, consumed_end, start), (prompt_text, full_text, start, end)):
                if not longer.startswith(shorter):
                    raise DataError(
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

