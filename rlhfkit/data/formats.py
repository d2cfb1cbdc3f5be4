"""Record formats per kind: detection from the first record's keys, validation record by record, and the canonical
form every format is turned into (`Canonical`). Each problem is a one-line `DataError` naming the source, the record
(its 0-based index among the loaded records) and the field.

Tool-calling conversations are read as TRL reads them: an assistant turn may carry `tool_calls`
([{"type": "function", "function": {"name", "arguments"}}], arguments an object or a JSON string of one), a
{"role": "tool", "name", "content"} turn holds a tool's result, and a record's `tools` column lists the JSON schemas
the chat template renders (a list, or a JSON string of one). Arguments and `tools` given as JSON strings are parsed
here, so the canonical record holds objects."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlhfkit.data.sources import type_of
from rlhfkit.errors import DataError

if TYPE_CHECKING:
    import datasets

KINDS = ("sft", "preference", "unpaired", "prompt")
ROLES = ("system", "user", "assistant", "tool")
HH_ASSISTANT = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")

# Per kind: (format name, required fields), in detection order: the first whose fields the first record has wins.
_FORMATS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "sft": (("prompt_completion", ("prompt", "completion")), ("messages", ("messages",)), ("text", ("text",))),
    "preference": (("pairwise", ("prompt", "chosen", "rejected")), ("implicit_prompt", ("chosen", "rejected"))),
    "unpaired": (("unpaired", ("prompt", "completion", "label")),),
    "prompt": (("prompt", ("prompt",)), ("messages", ("messages",))),
}


@dataclass
class Canonical:
    """One validated record in canonical form."""

    prompt: str | list[dict]  # the prompt turns (text or messages); for SFT "messages", the turns before the first answer
    responses: list[str | list[dict]]  # [completion], [chosen, rejected], or [] (prompt-only and SFT "messages")
    turns: list[dict] | None = None  # SFT "messages": the whole conversation; the loss covers every assistant turn
    hh: bool = False  # HH-RLHF transcripts: parsed into messages when the tokenizer has a chat template
    margin: float = 0.0
    desirable: bool = True
    columns: dict | None = None  # prompt-only: the record's other fields (all but "prompt" and "messages")
    text: str | None = None  # SFT language modelling: the whole text takes the loss (`prompt` is then "")
    tools: list[dict] | None = None  # the record's `tools` column: JSON schemas the chat template renders


def detect(records: list[dict] | datasets.Dataset, kind: str, source: str, columns: dict[str, str]) -> str:
    """The format of `records`, from the first record's keys once `columns` (data.columns) renamed them (no record
    is validated)."""
    if kind not in _FORMATS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
    if not records:
        raise DataError(f"{source}: no records (empty dataset)")
    formats = _FORMATS[kind]
    keys = rename_columns(records[0], columns, f"{source} record 0").keys()
    for fmt, required in formats:
        if all(name in keys for name in required):
            break
    else:
        # Report the first missing field of the format the record is closest to.
        _, required = max(formats, key=lambda f: sum(name in keys for name in f[1]))
        missing = next(name for name in required if name not in keys)
        shapes = " or ".join("{" + ", ".join(fields) + "}" for _, fields in formats)
        raise DataError(f"{source} record 0: missing field '{missing}' (expected {shapes})")
    return fmt


def canonical(record: dict, fmt: str, kind: str, source: str, i: int) -> Canonical:
    """Validates one record of format `fmt` and returns it in canonical form; raises DataError naming the field."""
    where = f"{source} record {i}"

    def get(name: str):
        if name not in record:
            raise DataError(f"{where}: missing field '{name}' (format '{fmt}', detected from record 0)")
        return record[name]

    example = _canonical(record, fmt, kind, where, get)
    if record.get("tools") is not None:  # a null cell of a tools column: no tools
        if fmt == "text":
            raise DataError(f"{where}: field 'tools' needs a conversation to render it (messages or prompt/completion); "
                            "a 'text' record is raw text, never a chat template")
        example.tools = _tools(record["tools"], where)
    return example


def _canonical(record: dict, fmt: str, kind: str, where: str, get) -> Canonical:
    if fmt == "messages":
        turns = _messages(get("messages"), "messages", where)
        if kind == "prompt":
            prompt = turns[:-1] if turns[-1]["role"] == "assistant" else turns
            if not prompt:
                raise DataError(f"{where}: field 'messages' has no turn before its final assistant turn (nothing to prompt with)")
            return Canonical(prompt=prompt, responses=[], columns=_columns(record))
        first = next((j for j, m in enumerate(turns) if m["role"] == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: field 'messages' has no assistant turn (nothing to learn from)")
        return Canonical(prompt=turns[:first], responses=[], turns=turns)
    if fmt == "text":
        text = get("text")
        if not isinstance(text, str) or not text:
            got = repr(text) if text == "" else type_of(text)
            raise DataError(f"{where}: field 'text' must be a non-empty string, got {got}")
        return Canonical(prompt="", responses=[], text=text)
    if fmt == "implicit_prompt":
        return _implicit_prompt(get("chosen"), get("rejected"), where, _margin(record, where))
    prompt = _text_or_messages(get("prompt"), "prompt", where)
    if fmt == "prompt":
        return Canonical(prompt=prompt, responses=[], columns=_columns(record))
    if fmt == "pairwise":
        responses = [_response(get(name), name, prompt, where) for name in ("chosen", "rejected")]
        return Canonical(prompt=prompt, responses=responses, margin=_margin(record, where))
    completion = _response(get("completion"), "completion", prompt, where)
    if fmt == "unpaired":
        label = get("label")
        if not isinstance(label, bool):
            raise DataError(f"{where}: field 'label' must be a bool (true = desirable), got {type_of(label)}")
        return Canonical(prompt=prompt, responses=[completion], desirable=label)
    return Canonical(prompt=prompt, responses=[completion])  # sft prompt_completion


def rename_columns(record: dict, columns: dict[str, str], where: str) -> dict:
    """`record` with each column that `columns` (data.columns: field -> column) maps under its field's name."""
    if not columns:
        return record
    for name, column in columns.items():
        if column not in record:
            raise DataError(f"{where}: data.columns.{name} names column '{column}', which the record does not have "
                            f"(its fields: {', '.join(sorted(record))})")
        if name in record and name not in columns.values():
            raise DataError(f"{where}: data.columns.{name} names column '{column}', but the record also has a field "
                            f"'{name}' (rename or drop one)")
    field_of = {column: name for name, column in columns.items()}
    return {field_of.get(key, key): value for key, value in record.items()}


def _implicit_prompt(chosen, rejected, where: str, margin: float) -> Canonical:
    """A pair with an implicit prompt: HH-RLHF transcripts (the prompt ends at their last shared "\n\nAssistant:"),
    or TRL's conversational form, two message lists whose shared first turns are the prompt."""
    if isinstance(chosen, str) and isinstance(rejected, str):
        end = os.path.commonprefix([chosen, rejected]).rfind(HH_ASSISTANT)
        if end < 0:
            raise DataError(
                f"{where}: fields 'chosen' and 'rejected' share no '\\n\\nAssistant:' turn "
                "(expected HH-RLHF transcripts '\\n\\nHuman: ...\\n\\nAssistant: ...')"
            )
        end += len(HH_ASSISTANT)
        return Canonical(prompt=chosen[:end], responses=[chosen[end:], rejected[end:]], hh=True, margin=margin)
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise DataError(f"{where}: fields 'chosen' and 'rejected' must both be message lists (an implicit prompt) or "
                        f"both HH-RLHF transcripts (strings), got {type_of(chosen)} and {type_of(rejected)}")
    chosen, rejected = _messages(chosen, "chosen", where), _messages(rejected, "rejected", where)
    sides = {"chosen": chosen, "rejected": rejected}
    n = next((j for j, (a, b) in enumerate(zip(chosen, rejected)) if not _same_turn(a, b)), min(len(chosen), len(rejected)))
    if len(chosen) == len(rejected) == n:  # one conversation twice: its last turn is both responses (dropped later)
        n -= 1
    if n == 0:
        raise DataError(f"{where}: fields 'chosen' and 'rejected' share no turn (an implicit prompt is their shared first turns)")
    for (name, turns), other in zip(sides.items(), ("rejected", "chosen")):
        if len(turns) == n:
            raise DataError(f"{where}: field '{name}' has no turn after the prompt it shares with '{other}' (nothing to prefer)")
        if turns[n]["role"] != "assistant":
            raise DataError(f"{where}: field '{name}' must continue the prompt it shares with '{other}' with an assistant "
                            f"turn (the response), got role '{turns[n]['role']}'")
        _ends_with_the_assistant(turns, name, where)
    return Canonical(prompt=chosen[:n], responses=[chosen[n:], rejected[n:]], margin=margin)


def _columns(record: dict) -> dict:
    """A prompt record's fields other than the prompt itself, passed on to reward functions."""
    return {k: v for k, v in record.items() if k not in ("prompt", "messages")}


def _text_or_messages(value, name: str, where: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _messages(value, name, where)
    raise DataError(f"{where}: field '{name}' must be a string or a list of {{role, content}} messages, got {type_of(value)}")


def _messages(value, name: str, where: str) -> list[dict]:
    """The validated messages; an assistant turn's tool calls with their JSON-string arguments parsed (a copy)."""
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else type_of(value)
        raise DataError(f"{where}: field '{name}' must be a non-empty list of {{role, content}} messages, got {got}")
    messages = []
    for j, message in enumerate(value):
        at = f"{where}: field '{name}' message {j}"
        if not isinstance(message, dict):
            raise DataError(f"{at} must be a {{role, content}} dict, got {type_of(message)}")
        role, calls = message.get("role"), message.get("tool_calls")
        if role not in ROLES:
            raise DataError(f"{at}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if calls is not None:  # a null cell of a tool_calls column (datasets fills absent keys with None): no calls
            if role != "assistant":
                raise DataError(f"{at}: only an assistant turn can have tool_calls, this one is role '{role}'")
            message = {**message, "tool_calls": [_tool_call(call, f"{at} tool call {k}") for k, call in enumerate(_list(calls, at))]}
            if message.get("content") is None:  # OpenAI's form of a turn that only calls tools
                message["content"] = ""
        if not isinstance(message.get("content"), str):
            raise DataError(f"{at}: content must be a string, got {type_of(message.get('content'))}")
        if role == "tool" and not isinstance(message.get("name", ""), (str, type(None))):
            raise DataError(f"{at}: a tool turn's name must be a string (the tool called), got {type_of(message['name'])}")
        messages.append(message)
    return messages


def _list(calls, at: str) -> list:
    if not isinstance(calls, list):
        raise DataError(f"{at}: tool_calls must be a list of {{type: function, function: {{name, arguments}}}} calls, "
                        f"got {type_of(calls)}")
    return calls


def _tool_call(call, at: str) -> dict:
    """A call as TRL writes it, {"type": "function", "function": {"name", "arguments"}}, its arguments an object."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise DataError(f"{at}: expected {{type: function, function: {{name, arguments}}}} with a non-empty name, got "
                        f"{json.dumps(call, default=str)[:120]}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _json(arguments, f"{at}: arguments")
    if not isinstance(arguments, dict):
        raise DataError(f"{at}: arguments must be an object (or a JSON string of one), got {type_of(arguments)}")
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


def _tools(value, where: str) -> list[dict]:
    """A `tools` column: a list of JSON schemas, or a JSON string of one (how TRL's datasets store it)."""
    if isinstance(value, str):
        value = _json(value, f"{where}: field 'tools'")
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise DataError(f"{where}: field 'tools' must be a list of JSON schemas (objects), or a JSON string of one, "
                        f"got {type_of(value)}")
    return value


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{what} is not valid JSON ({e.msg}: line {e.lineno} col {e.colno})") from None


def _response(value, name: str, prompt: str | list[dict], where: str) -> str | list[dict]:
    """A completion/chosen/rejected: text, or assistant-first messages (a leading copy of the prompt is removed)."""
    response = _text_or_messages(value, name, where)
    if isinstance(response, str):
        return response
    prompt_turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    n = len(prompt_turns)
    if len(response) > n and all(_same_turn(a, b) for a, b in zip(response[:n], prompt_turns)):
        response = response[n:]
    if response[0]["role"] != "assistant":
        raise DataError(f"{where}: field '{name}' must start with an assistant turn (the response), got role '{response[0]['role']}'")
    _ends_with_the_assistant(response, name, where)
    return response


def _ends_with_the_assistant(response: list[dict], name: str, where: str) -> None:
    """A response ends with the assistant's turn: its tokens stop at the last assistant turn's EOS, so a trailing
    tool result would be silently dropped (from the losses and the reward model alike): refused instead."""
    if response[-1]["role"] == "tool":
        raise DataError(f"{where}: field '{name}' ends with a tool turn; a response ends with the assistant's turn "
                        "(drop the trailing tool result, or add the assistant's reply to it)")


def _same_turn(a: dict, b: dict) -> bool:
    return all(a.get(key) == b.get(key) for key in ("role", "content", "tool_calls", "name"))


def _margin(record: dict, where: str) -> float:
    margin = record.get("margin")
    if margin is None:  # absent, or a null cell in a CSV/Parquet column
        return 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise DataError(f"{where}: field 'margin' must be a finite number, got {margin!r}")
    return float(margin)



def hh_messages(transcript: str) -> list[dict]:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> [user a, assistant b]; text before the first turn becomes a system turn."""
    parts = _HH_TURN.split(transcript)
    messages = [{"role": "system", "content": parts[0].strip()}] if parts[0].strip() else []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return messages


def is_conversational(prompt) -> bool:
    """Whether a prompt is a list of {role, content} messages (TRL's conversational format)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]
