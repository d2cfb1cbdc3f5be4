"""Datasets for every stage: loading, format detection, record-by-record validation, chat templates, tokenization
with truncation counts, and the collators that build the typed batches of `rlhfkit.types`.

Pipeline: `load_records` -> `detect_format` -> `tokenize_records` (validates each record, once) -> `collate_*`;
`build_datasets` runs the first three for the train and eval splits. `detect_format` alone validates every record
without tokenizing.

Tokenization is one `datasets.Dataset.map` over the records, so it can run in worker processes (the environment
variable RLHFKIT_DATA_NUM_PROC, default 1) and, in `build_datasets`, is cached on disk: the cache file is named by a
datasets fingerprint (`datasets.fingerprint.Hasher`) of the data (a local file's content hash, a hub dataset's own
fingerprint), the tokenizer (vocabulary, special tokens, chat template), the data.* settings that shape the ids and
this module's source, so a rerun with the same file, tokenizer and settings reads the ids back instead of
tokenizing again. The cache lives in $RLHFKIT_CACHE/data (default ~/.cache/rlhfkit/data); delete it to reclaim the
space, or turn caching off with `datasets.disable_caching()`.

Record formats per kind ("text|messages" = a string or a list of {role, content} dicts, role in system/user/assistant):
    sft         prompt_completion  {prompt: text|messages, completion: text|messages}
                messages           {messages}: the loss covers every assistant turn
    preference  pairwise           {prompt: text|messages, chosen: text|messages, rejected: text|messages, margin?: number}
                                   chosen/rejected are the assistant turn(s); a message list that repeats the prompt
                                   turns first (UltraFeedback-style full conversations) has them removed
                hh_rlhf            {chosen, rejected}: full "\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts; the prompt
                                   is their shared prefix up to and including the last "\\n\\nAssistant:"
    unpaired    unpaired           {prompt: text|messages, completion: text|messages, label: bool (true = desirable)}
    prompt      prompt             {prompt: text|messages}
                messages           {messages}: every turn is prompt; a final assistant turn is dropped

Every problem is a one-line `DataError` naming the source and where: parse errors name the 1-based line of a .jsonl
file; validation and tokenization errors name the record, its 0-based index among the loaded records. With worker
processes, the error reported is the first one a worker meets, not necessarily the earliest record's.

Tokenized examples are typed dicts of python int lists (`SFTExample`, `PreferenceExample`, `UnpairedExample`,
`PromptExample` below); the collators turn lists of them into tensors. They stay plain mutable dicts because
trainers index them (`train_set[i]`) and may add fields (the preference trainer's precomputed reference log-probs).
Prompts end with the generation prompt; responses are their own tokens only and end at the EOS token.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from rlhfkit.config import DataConfig
from rlhfkit.errors import DataError, UserError
from rlhfkit.io import cache_dir
from rlhfkit.types import PaddingFreeBatch, PaddingFreePairs, PreferenceBatch, PromptBatch, SFTBatch, UnpairedBatch

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger("rlhfkit")

KINDS = ("sft", "preference", "unpaired", "prompt")
IGNORE_INDEX = -100  # label of a token that takes no loss (torch cross_entropy's default ignore_index)
ROLES = ("system", "user", "assistant")
DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
HH_ASSISTANT = "\n\nAssistant:"

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")

# Per kind: (format name, required fields), in detection order: the first whose fields the first record has wins.
_FORMATS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "sft": (("prompt_completion", ("prompt", "completion")), ("messages", ("messages",))),
    "preference": (("pairwise", ("prompt", "chosen", "rejected")), ("hh_rlhf", ("chosen", "rejected"))),
    "unpaired": (("unpaired", ("prompt", "completion", "label")),),
    "prompt": (("prompt", ("prompt",)), ("messages", ("messages",))),
}

_RECORD = "_rlhfkit_record"  # the one column of a list of records handed to the map: each record as JSON text
_FLAGS = ("_prompt_truncated", "_response_truncated", "_dropped", "_plain")  # per map row; the statistics count them
_KEPT, _EMPTY, _IDENTICAL = 0, 1, 2  # "_dropped": kept, dropped for an empty response, dropped for chosen == rejected


# The typed examples of each kind, as `build_datasets` returns them (lists of token ids, no padding).


class SFTExample(TypedDict):
    input_ids: list[int]  # (T,) prompt + response tokens
    labels: list[int]  # (T,) -100 on prompt tokens, the token id on response tokens


class PreferenceExample(TypedDict):
    prompt_ids: list[int]  # (P,)
    chosen_ids: list[int]  # (R,) ends at EOS unless cut to data.max_length
    rejected_ids: list[int]  # (R',)
    margin: float  # the record's margin, 0.0 without one


class UnpairedExample(TypedDict):
    prompt_ids: list[int]  # (P,)
    completion_ids: list[int]  # (R,)
    desirable: bool


class PromptExample(TypedDict):
    prompt_ids: list[int]  # (P,) ends with the generation prompt
    prompt: str | list[dict]  # the record's own prompt: the string, or the message dicts of the prompt turns
    # Every other field of the record (all but "prompt" and "messages", e.g. a reference "answer" or test cases),
    # for reward functions (`rewards.RewardSource`); a value JSON cannot hold (a timestamp, bytes) arrives as its str().
    columns: dict


Example = SFTExample | PreferenceExample | UnpairedExample | PromptExample


# 1. Loading ----------------------------------------------------------------------------------------------------


def load_records(source: str, split: str = "train", max_samples: int | None = None) -> list[dict]:
    """Reads a local .jsonl/.json/.csv/.parquet file, or a hub dataset (or local dataset folder) through `datasets`.

    A source that looks like a path (a data extension, a "/" plus an extension, or a leading "." "/" "~") must exist;
    anything else shaped like "name" or "org/name" goes to `datasets.load_dataset(source, split=split)`.
    Keeps the first `max_samples` records; no records at all is an error.
    """
    _, read = _open(source, split, max_samples)
    records = read()
    return records if isinstance(records, list) else records.to_list()


def _open(source: str, split: str, max_samples: int | None) -> tuple[str, Callable[[], list[dict] | datasets.Dataset]]:
    """A fingerprint of `source`'s records (a local file's content hash, a hub dataset's own datasets fingerprint),
    and the function that reads them (`load_records`, with a hub dataset left a `datasets.Dataset`): a file is only
    read when its tokenized examples are not cached yet."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        fingerprint = f"{_file_hash(path)}{os.path.splitext(path)[1].lower()}-{max_samples}"
        return fingerprint, lambda: _nonempty(_read_file(path, source)[:max_samples], source)
    if os.path.isdir(path) or _is_hub_name(source):
        dataset = _nonempty(_load_hub(source, split, max_samples), f"{source} (split '{split}')")
        return dataset._fingerprint, lambda: dataset
    raise DataError(f"data file '{source}' not found")


def _nonempty(records, where: str):
    if not len(records):
        raise DataError(f"{where}: no records (empty dataset)")
    return records


def _file_hash(path: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_hub_name(source: str) -> bool:
    ext = os.path.splitext(source)[1]
    if source.startswith((".", "/", "~")) or ext.lower() in DATA_EXTENSIONS or ("/" in source and ext):
        return False
    return bool(_HUB_NAME.match(source))


def _load_hub(source: str, split: str, max_samples: int | None) -> datasets.Dataset:
    import datasets

    try:
        dataset = datasets.load_dataset(source, split=split)
    except Exception as e:  # datasets raises many types (network, missing split, bad files); all are the user's to fix
        raise DataError(f"dataset '{source}' (split '{split}') could not be loaded: {_one_line(e)}") from e
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def _read_file(path: str, source: str) -> list[dict]:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".csv", ".parquet"):
        return _read_arrow(path, source, ext)
    if ext not in (".jsonl", ".json"):
        raise DataError(f"data file '{source}': unsupported extension '{ext}' (expected .jsonl, .json, .csv or .parquet)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if ext == ".jsonl":
        return _parse_json_lines(text, source)
    if not text.strip():
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one JSON value: JSON lines in a .json file
            return _parse_json_lines(text, source)
        raise DataError(f"{source}: malformed JSON ({e.msg}: line {e.lineno} col {e.colno})") from None
    if isinstance(data, dict):
        return [data]
    if not isinstance(data, list):
        raise DataError(f"{source}: expected a list of records (JSON objects), got {_type_name(data)}")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{source} record {i}: expected a JSON object, got {_type_name(record)}")
    return data


def _parse_json_lines(text: str, source: str) -> list[dict]:
    records = []
    # split("\n"), not splitlines(): JSON strings may hold raw U+2028 and friends, which splitlines() breaks on.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{source} line {lineno}: malformed JSON ({e.msg}: col {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{source} line {lineno}: expected a JSON object (one record per line), got {_type_name(record)}")
        records.append(record)
    return records


def _read_arrow(path: str, source: str, ext: str) -> list[dict]:
    """CSV and Parquet as python records. CSV column types are inferred (true/false -> bool, numbers -> numbers,
    an empty numeric cell -> None), so a text column that holds only numbers reads as numbers."""
    import pyarrow
    import pyarrow.csv
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(path) if ext == ".parquet" else pyarrow.csv.read_csv(path)
    except pyarrow.ArrowException as e:
        if "Empty CSV file" in str(e):
            return []
        raise DataError(f"{source}: malformed {ext[1:].upper()} ({_one_line(e)})") from None
    return table.to_pylist()


# 2. Format detection and validation -------------------------------------------------------------------------------


@dataclass
class _Example:
    """One validated record in canonical form."""

    prompt: str | list[dict]  # the prompt turns (text or messages); for SFT "messages", the turns before the first answer
    responses: list[str | list[dict]]  # [completion], [chosen, rejected], or [] (prompt-only and SFT "messages")
    turns: list[dict] | None = None  # SFT "messages": the whole conversation; the loss covers every assistant turn
    hh: bool = False  # HH-RLHF transcripts: parsed into messages when the tokenizer has a chat template
    margin: float = 0.0
    desirable: bool = True
    columns: dict | None = None  # prompt-only: the record's other fields (all but "prompt" and "messages")


def detect_format(records: list[dict], kind: str, source: str) -> str:
    """Names the format of `records` from the first record's keys, then validates every record against it."""
    fmt = _detect(records, kind, source)
    for i, record in enumerate(records):
        _canonical(record, fmt, kind, source, i)
    return fmt


def _detect(records: list[dict] | datasets.Dataset, kind: str, source: str) -> str:
    """The format of `records`, from the first record's keys (no record is validated)."""
    if kind not in _FORMATS:
        raise ValueError(f"unknown data kind {kind!r}; expected one of {KINDS}")
    if not records:
        raise DataError(f"{source}: no records (empty dataset)")
    formats = _FORMATS[kind]
    keys = records[0].keys()
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


def _canonical(record: dict, fmt: str, kind: str, source: str, i: int) -> _Example:
    """Validates one record of format `fmt` and returns it in canonical form; raises DataError naming the field."""
    where = f"{source} record {i}"

    def get(name: str):
        if name not in record:
            raise DataError(f"{where}: missing field '{name}' (format '{fmt}', detected from record 0)")
        return record[name]

    if fmt == "messages":
        turns = _messages(get("messages"), "messages", where)
        if kind == "prompt":
            prompt = turns[:-1] if turns[-1]["role"] == "assistant" else turns
            if not prompt:
                raise DataError(f"{where}: field 'messages' has no turn before its final assistant turn (nothing to prompt with)")
            return _Example(prompt=prompt, responses=[], columns=_columns(record))
        first = next((j for j, m in enumerate(turns) if m["role"] == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: field 'messages' has no assistant turn (nothing to learn from)")
        return _Example(prompt=turns[:first], responses=[], turns=turns)
    if fmt == "hh_rlhf":
        chosen, rejected = get("chosen"), get("rejected")
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, str):
                raise DataError(f"{where}: field '{name}' must be a string (an HH-RLHF transcript), got {_type_name(value)}")
        end = os.path.commonprefix([chosen, rejected]).rfind(HH_ASSISTANT)
        if end < 0:
            raise DataError(
                f"{where}: fields 'chosen' and 'rejected' share no '\\n\\nAssistant:' turn "
                "(expected HH-RLHF transcripts '\\n\\nHuman: ...\\n\\nAssistant: ...')"
            )
        end += len(HH_ASSISTANT)
        return _Example(prompt=chosen[:end], responses=[chosen[end:], rejected[end:]], hh=True, margin=_margin(record, where))
    prompt = _text_or_messages(get("prompt"), "prompt", where)
    if fmt == "prompt":
        return _Example(prompt=prompt, responses=[], columns=_columns(record))
    if fmt == "pairwise":
        responses = [_response(get(name), name, prompt, where) for name in ("chosen", "rejected")]
        return _Example(prompt=prompt, responses=responses, margin=_margin(record, where))
    completion = _response(get("completion"), "completion", prompt, where)
    if fmt == "unpaired":
        label = get("label")
        if not isinstance(label, bool):
            raise DataError(f"{where}: field 'label' must be a bool (true = desirable), got {_type_name(label)}")
        return _Example(prompt=prompt, responses=[completion], desirable=label)
    return _Example(prompt=prompt, responses=[completion])  # sft prompt_completion


def _columns(record: dict) -> dict:
    """A prompt record's fields other than the prompt itself, passed on to reward functions."""
    return {k: v for k, v in record.items() if k not in ("prompt", "messages")}


def _text_or_messages(value, name: str, where: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _messages(value, name, where)
    raise DataError(f"{where}: field '{name}' must be a string or a list of {{role, content}} messages, got {_type_name(value)}")


def _messages(value, name: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else _type_name(value)
        raise DataError(f"{where}: field '{name}' must be a non-empty list of {{role, content}} messages, got {got}")
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f"{where}: field '{name}' message {j} must be a {{role, content}} dict, got {_type_name(message)}")
        if message.get("role") not in ROLES:
            raise DataError(f"{where}: field '{name}' message {j}: role must be one of system, user, assistant, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise DataError(f"{where}: field '{name}' message {j}: content must be a string, got {_type_name(message.get('content'))}")
    return value


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
    return response


def _same_turn(a: dict, b: dict) -> bool:
    return a["role"] == b["role"] and a["content"] == b["content"]


def _margin(record: dict, where: str) -> float:
    margin = record.get("margin")
    if margin is None:  # absent, or a null cell in a CSV/Parquet column
        return 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise DataError(f"{where}: field 'margin' must be a finite number, got {margin!r}")
    return float(margin)


# 3. Rendering and tokenization ------------------------------------------------------------------------------------


@dataclass
class TruncationStats:
    """What tokenization cut or dropped from one data source; each count is of records."""

    records: int  # records read
    prompts_truncated: int = 0  # prompts longer than max_prompt_length, cut to their last tokens
    responses_truncated: int = 0  # records with a response cut so that prompt + response fits max_length
    dropped: int = 0  # records left with an empty response, or with chosen == rejected

    def summary(self, source: str) -> str:
        return (
            f"{source}: {self.records} records -> {self.records - self.dropped} examples; "
            f"{self.prompts_truncated} prompts truncated to data.max_prompt_length (kept their last tokens), "
            f"{self.responses_truncated} responses cut to data.max_length, {self.dropped} dropped"
        )


class _Encoder:
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

    def render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        if not self.template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if generation_prompt else "")
        try:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises on conversations the template refuses (roles, order): bad data
            raise DataError(f"{where}: the tokenizer's chat template failed on this conversation: {_one_line(e)}") from e

    def as_messages(self, prompt, response, hh: bool) -> tuple[list[dict], list[dict]] | None:
        """The (prompt, response) messages to render, or None for the raw-text path (no template, all text)."""
        if not self.template and isinstance(prompt, str) and (response is None or isinstance(response, str)):
            return None
        self.plain = not self.template
        if isinstance(prompt, str):  # an HH prompt ends with an empty "Assistant:" turn: the generation prompt
            prompt = _hh_messages(prompt)[:-1] if hh else [{"role": "user", "content": prompt}]
        if isinstance(response, str):
            response = _hh_messages(HH_ASSISTANT + response) if hh else [{"role": "assistant", "content": response}]
        return prompt, response or []

    def prompt(self, example: _Example, where: str) -> list[int]:
        messages = self.as_messages(example.prompt, None, example.hh)
        if messages is None:
            return self.ids(example.prompt, special=True)
        return self.ids(self.render(messages[0], True, where), special=not self.template)

    def pair(self, example: _Example, response, where: str) -> tuple[list[int], list[int]]:
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


def _hh_messages(transcript: str) -> list[dict]:
    """'\\n\\nHuman: a\\n\\nAssistant: b' -> [user a, assistant b]; text before the first turn becomes a system turn."""
    parts = _HH_TURN.split(transcript)
    messages = [{"role": "system", "content": parts[0].strip()}] if parts[0].strip() else []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        messages.append({"role": "user" if speaker == "Human" else "assistant", "content": content.strip()})
    return messages


def tokenize_records(
    records: list[dict] | datasets.Dataset, fmt: str, kind: str, tokenizer, cfg: DataConfig, source: str,
    cache_file: str | None = None,
) -> tuple[list[Example], TruncationStats]:
    """Validates and tokenizes records of format `fmt` into typed examples (module docstring); counts what was cut
    or dropped, and warns about what the counts alone don't say.

    One `datasets.Dataset.map` of `_encode` over the records (RLHFKIT_DATA_NUM_PROC worker processes); with a
    `cache_file` (`build_datasets` names one per data, tokenizer and settings) it reads a finished map back from
    that file instead of tokenizing, or writes it there. Each map row is one record: its example's columns and the
    flags (`_FLAGS`) that the statistics are counted from, so a cached rerun reports the same statistics.
    """
    import datasets
    from datasets.fingerprint import generate_random_fingerprint

    encoder = _Encoder(tokenizer)
    if isinstance(records, list):  # arbitrary JSON records, one text column: Arrow needs one type per column
        records = datasets.Dataset.from_dict({_RECORD: [json.dumps(r, default=str) for r in records]})
    if cache_file:
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
    num_proc = _num_proc()
    features = _features(kind)
    rows = records.map(
        _encode_batch,
        batched=True,
        with_indices=True,
        remove_columns=records.column_names,
        features=features,
        fn_kwargs={"encoder": encoder, "fmt": fmt, "kind": kind, "cfg": cfg, "source": source, "names": list(features)},
        num_proc=num_proc if num_proc > 1 else None,
        cache_file_name=cache_file,
        new_fingerprint=os.path.basename(cache_file)[: -len(".arrow")] if cache_file else generate_random_fingerprint(),
        desc=f"tokenizing {source}",
    )
    return _examples(rows, kind, source)


def _features(kind: str) -> datasets.Features:
    """The Arrow types of a kind's map rows: its example's columns (token ids as int32 lists), then `_FLAGS`."""
    from datasets import Features, Sequence, Value

    ids = Sequence(Value("int32"))
    columns = {
        "sft": {"input_ids": ids, "labels": ids},
        "preference": {"prompt_ids": ids, "chosen_ids": ids, "rejected_ids": ids, "margin": Value("float64")},
        "unpaired": {"prompt_ids": ids, "completion_ids": ids, "desirable": Value("bool")},
        "prompt": {"prompt_ids": ids, "prompt": Value("string"), "columns": Value("string")},  # JSON text
    }[kind]
    flags = dict(zip(_FLAGS, (Value("bool"), Value("bool"), Value("int8"), Value("bool"))))
    return Features({**columns, **flags})


def _encode_batch(batch: dict[str, list], indices: list[int], *, encoder: _Encoder, fmt: str, kind: str,
                  cfg: DataConfig, source: str, names: list[str]) -> dict[str, list]:
    """The map function: a batch of records (a JSON text column, or a hub dataset's own columns) -> rows."""
    if _RECORD in batch:
        records = [json.loads(text) for text in batch[_RECORD]]
    else:
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
    rows = [_encode(encoder, record, i, fmt, kind, cfg, source) for record, i in zip(records, indices)]
    return {name: [row[name] for row in rows] for name in names}


def _encode(encoder: _Encoder, record: dict, i: int, fmt: str, kind: str, cfg: DataConfig, source: str) -> dict:
    """Validates and tokenizes record `i`: its example's columns plus the `_FLAGS` of what was cut or dropped.

    1. A prompt longer than cfg.max_prompt_length keeps its last tokens (truncation="truncate") or is an error.
    2. Responses are cut so that prompt + response <= cfg.max_length.
    3. A record whose response is then empty, or a pair whose chosen and rejected ids are equal, is dropped: its row
       stays, flagged, so that the statistics survive the cache; `_examples` leaves it out.
    """
    where = f"{source} record {i}"
    example = _canonical(record, fmt, kind, source, i)
    encoder.plain = False
    flags = {"_prompt_truncated": False, "_response_truncated": False, "_dropped": _KEPT}

    def fit_prompt(ids: list[int]) -> list[int]:
        if len(ids) <= cfg.max_prompt_length:
            return ids
        if cfg.truncation == "error":
            raise DataError(
                f"{where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={cfg.max_prompt_length} "
                "(set data.truncation=truncate to cut it)"
            )
        flags["_prompt_truncated"] = True
        return ids[-cfg.max_prompt_length :]

    if kind == "prompt":  # prompt and columns as JSON text: one Arrow type per column, whatever the records hold
        columns = {"prompt_ids": fit_prompt(encoder.prompt(example, where)), "prompt": json.dumps(example.prompt),
                   "columns": json.dumps(example.columns, default=str)}
    elif example.turns is not None:  # SFT conversation: the first segment is the prompt
        segments = encoder.conversation(example.turns, where)
        segments[0] = (fit_prompt(segments[0][0]), False)
        input_ids = [t for ids, _ in segments for t in ids]
        labels = [t if is_response else IGNORE_INDEX for ids, is_response in segments for t in ids]
        if len(input_ids) > cfg.max_length:
            flags["_response_truncated"] = True
            input_ids, labels = input_ids[: cfg.max_length], labels[: cfg.max_length]
        if all(label == IGNORE_INDEX for label in labels):
            flags["_dropped"] = _EMPTY
        columns = {"input_ids": input_ids, "labels": labels}
    else:
        encoded = [encoder.pair(example, response, where) for response in example.responses]
        prompt_ids = fit_prompt(encoded[0][0])
        room = cfg.max_length - len(prompt_ids)
        if any(len(response_ids) > room for _, response_ids in encoded):
            flags["_response_truncated"] = True
        responses = [response_ids[:room] for _, response_ids in encoded]
        if not all(responses):
            flags["_dropped"] = _EMPTY
        elif kind == "preference" and responses[0] == responses[1]:
            flags["_dropped"] = _IDENTICAL
        if kind == "preference":
            columns = {"prompt_ids": prompt_ids, "chosen_ids": responses[0], "rejected_ids": responses[1], "margin": example.margin}
        elif kind == "unpaired":
            columns = {"prompt_ids": prompt_ids, "completion_ids": responses[0], "desirable": example.desirable}
        else:
            columns = {"input_ids": prompt_ids + responses[0], "labels": [IGNORE_INDEX] * len(prompt_ids) + responses[0]}
    return {**columns, **flags, "_plain": encoder.plain}


def _examples(rows: datasets.Dataset, kind: str, source: str) -> tuple[list[Example], TruncationStats]:
    """The kept rows as python examples, the statistics counted from every row's flags, and the warnings."""
    table = rows.to_dict()
    dropped = table["_dropped"]
    stats = TruncationStats(
        records=len(dropped),
        prompts_truncated=sum(table["_prompt_truncated"]),
        responses_truncated=sum(table["_response_truncated"]),
        dropped=sum(reason != _KEPT for reason in dropped),
    )
    if any(table["_plain"]):
        logger.warning(f"{source}: the tokenizer has no chat template; rendering messages as plain 'role: content' lines")
    identical = sum(reason == _IDENTICAL for reason in dropped)
    if identical:
        logger.warning(f"{source}: dropped {identical} pairs whose chosen and rejected tokens are identical (after truncation)")
    names = [name for name in rows.column_names if name not in _FLAGS]
    examples = [dict(zip(names, values)) for values, reason in zip(zip(*(table[n] for n in names)), dropped) if reason == _KEPT]
    if kind == "prompt":
        for example in examples:
            example["prompt"], example["columns"] = json.loads(example["prompt"]), json.loads(example["columns"])
    if not examples:
        raise DataError(f"{source}: every record was dropped ({stats.summary(source)})")
    return examples, stats


def build_datasets(kind: str, cfg: DataConfig, tokenizer, seed: int) -> tuple[list[Example], list[Example] | None]:
    """Tokenized (train, eval) examples: eval from cfg.eval, else a seeded cfg.eval_fraction of train, else None.

    Each split is tokenized once per data, tokenizer and settings, then read back from the cache (module docstring).
    The held-out fraction is drawn from the tokenized train examples, so error messages keep the file's own record
    numbers; its truncation counts are part of the train file's summary.
    """
    train = _tokenized_split(kind, cfg.train, cfg.train_split, cfg, tokenizer)
    if cfg.eval:
        return train, _tokenized_split(kind, cfg.eval, cfg.eval_split, cfg, tokenizer)
    if cfg.eval_fraction <= 0:
        return train, None
    n_eval = max(1, round(cfg.eval_fraction * len(train)))
    if n_eval >= len(train):
        raise DataError(
            f"{cfg.train}: {len(train)} examples are too few to hold out data.eval_fraction={cfg.eval_fraction} "
            "and still train; add data or set data.eval"
        )
    held_out = set(random.Random(seed).sample(range(len(train)), n_eval))
    logger.info(f"{cfg.train}: held out {n_eval} of {len(train)} examples for eval (data.eval_fraction={cfg.eval_fraction}, seed={seed})")
    return [ex for j, ex in enumerate(train) if j not in held_out], [ex for j, ex in enumerate(train) if j in held_out]


def _tokenized_split(kind: str, source: str, split: str, cfg: DataConfig, tokenizer) -> list[Example]:
    import datasets

    fingerprint, read = _open(source, split, cfg.max_samples)
    cache_file = _cache_file(kind, fingerprint, cfg, tokenizer)
    if cache_file and os.path.exists(cache_file):  # tokenized before: the records need not even be read
        logger.info(f"{source}: reading the tokenized examples back from {cache_file}")
        examples, stats = _examples(datasets.Dataset.from_file(cache_file), kind, source)
    else:  # (a map cached by worker processes is in shard files: the map reads them back)
        records = read()
        examples, stats = tokenize_records(records, _detect(records, kind, source), kind, tokenizer, cfg, source, cache_file)
    cut = stats.prompts_truncated or stats.responses_truncated or stats.dropped
    logger.log(logging.WARNING if cut else logging.INFO, stats.summary(source))
    return examples


def _cache_file(kind: str, fingerprint: str, cfg: DataConfig, tokenizer) -> str | None:
    """Where the tokenized rows of these records are cached: a file named by a datasets fingerprint of everything
    that shapes them (the chat template renderer's and tokenizer library's versions too); None when datasets caching
    is off."""
    import datasets
    import tokenizers
    import transformers
    from datasets.fingerprint import Hasher

    if not datasets.is_caching_enabled():
        return None
    key = Hasher.hash([_source_hash(), transformers.__version__, tokenizers.__version__, kind, fingerprint,
                       cfg.max_length, cfg.max_prompt_length, cfg.truncation, tokenizer])
    return os.path.join(cache_dir(), "data", f"{kind}-{key}.arrow")


@functools.cache
def _source_hash() -> str:
    """This module's source: a change to the tokenization code names new cache files."""
    with open(__file__, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=16).hexdigest()


def _num_proc() -> int:
    value = os.environ.get("RLHFKIT_DATA_NUM_PROC", "1")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"environment variable RLHFKIT_DATA_NUM_PROC must be a positive integer, got {value!r}")
    return int(value)


# 4. Collators --------------------------------------------------------------------------------------------------


def _pad(rows: list[list[int]], value: int, width: int | None = None, left: bool = False) -> torch.Tensor:
    width = max(map(len, rows)) if width is None else width
    padded = [[value] * (width - len(r)) + r if left else r + [value] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long)


def _join(prompts: list[list[int]], responses: list[list[int]], pad_token_id: int, width: int | None = None):
    """Right-padded prompt + response rows: (input_ids, attention_mask, labels), labels -100 outside the response."""
    ids = [p + r for p, r in zip(prompts, responses)]
    labels = [[IGNORE_INDEX] * len(p) + r for p, r in zip(prompts, responses)]
    return _pad(ids, pad_token_id, width), _pad([[1] * len(x) for x in ids], 0, width), _pad(labels, IGNORE_INDEX, width)


def collate_sft(examples: list[SFTExample], pad_token_id: int) -> SFTBatch:
    """Right padding; labels padded with -100; attention_mask 1 on real tokens."""
    ids = [e["input_ids"] for e in examples]
    return SFTBatch(
        input_ids=_pad(ids, pad_token_id),  # (B, T)
        attention_mask=_pad([[1] * len(x) for x in ids], 0),  # (B, T)
        labels=_pad([e["labels"] for e in examples], IGNORE_INDEX),  # (B, T)
    )


def pack_sft(examples: list[SFTExample], max_length: int) -> list[SFTExample]:
    """Concatenates SFT examples and cuts the stream into rows of max_length tokens (the last row holds the rest).

    Labels travel with their ids, so completion-only masking survives. Classic packing (GPT pre-training, TRL's
    ConstantLengthDataset): attention crosses example boundaries, so a token also attends to the earlier examples
    of its row; the -100 labels on each prompt keep the loss off the boundary tokens.
    """
    ids = [t for e in examples for t in e["input_ids"]]
    labels = [t for e in examples for t in e["labels"]]
    return [{"input_ids": ids[s : s + max_length], "labels": labels[s : s + max_length]} for s in range(0, len(ids), max_length)]


def _padding_free(ids: list[list[int]], labels: list[list[int]]) -> PaddingFreeBatch:
    """Sequences end to end in one row, position ids restarting at 0 at each (see `PaddingFreeBatch`)."""
    return PaddingFreeBatch(
        input_ids=torch.tensor([[t for x in ids for t in x]], dtype=torch.long),  # (1, N)
        position_ids=torch.tensor([[t for x in ids for t in range(len(x))]], dtype=torch.long),  # (1, N)
        labels=torch.tensor([[t for x in labels for t in x]], dtype=torch.long),  # (1, N)
        seq_lens=torch.tensor([len(x) for x in ids], dtype=torch.long),  # (S,)
    )


def collate_sft_padding_free(examples: list[SFTExample]) -> PaddingFreeBatch:
    """`collate_sft` without padding (data.padding_free): the examples in one row, each attending to itself only."""
    return _padding_free([e["input_ids"] for e in examples], [e["labels"] for e in examples])


def collate_preference(examples: list[PreferenceExample], pad_token_id: int) -> PreferenceBatch:
    """prompt + chosen and prompt + rejected, both right-padded to ONE common length T so that the trainer can
    concatenate them into a single forward pass."""
    prompts = [e["prompt_ids"] for e in examples]
    chosen = [e["chosen_ids"] for e in examples]
    rejected = [e["rejected_ids"] for e in examples]
    width = max(len(p) + max(len(c), len(r)) for p, c, r in zip(prompts, chosen, rejected))
    chosen_ids, chosen_mask, chosen_labels = _join(prompts, chosen, pad_token_id, width)  # (B, T) each
    rejected_ids, rejected_mask, rejected_labels = _join(prompts, rejected, pad_token_id, width)  # (B, T) each
    return PreferenceBatch(
        chosen_input_ids=chosen_ids,
        chosen_attention_mask=chosen_mask,
        chosen_labels=chosen_labels,
        rejected_input_ids=rejected_ids,
        rejected_attention_mask=rejected_mask,
        rejected_labels=rejected_labels,
        margin=torch.tensor([float(e["margin"]) for e in examples], dtype=torch.float32),  # (B,)
    )


def collate_preference_padding_free(examples: list[PreferenceExample]) -> PaddingFreePairs:
    """`collate_preference` without padding (data.padding_free): the B prompt + chosen, then the B prompt + rejected
    sequences in one row, each attending to itself only."""
    sides = [[e["prompt_ids"] + e[side] for e in examples] for side in ("chosen_ids", "rejected_ids")]
    labels = [[[IGNORE_INDEX] * len(e["prompt_ids"]) + e[side] for e in examples] for side in ("chosen_ids", "rejected_ids")]
    return PaddingFreePairs(
        sequences=_padding_free(sides[0] + sides[1], labels[0] + labels[1]),  # 2B sequences
        margin=torch.tensor([float(e["margin"]) for e in examples], dtype=torch.float32),  # (B,)
    )


def collate_unpaired(examples: list[UnpairedExample], pad_token_id: int,
                     partners: list[UnpairedExample] | None = None) -> UnpairedBatch:
    """KTO batch. The kl_* rows pair prompt i with the completion of `partners[i]`: by default example (i + 1) % B of
    this batch, a cyclic shift (TRL pairs each prompt with the completions of a reversed/shifted batch). KTO's
    reference point z0 is estimated from these mismatched pairs (Ethayarajh et al. 2024, arXiv 2402.01306, §4.1); the
    KTO trainer passes partners drawn from a larger set (the step's global batch, the eval set), so that the pairs do
    not depend on how that set is split into micro-batches and processes. A KL row can be longer than
    data.max_length (prompt i with another prompt's room for its completion); it is only used for the z0 estimate."""
    if partners is None and len(examples) < 2:
        raise ValueError(
            f"collate_unpaired needs at least 2 examples per batch, got {len(examples)}: KTO's reference point z0 "
            "is estimated from mismatched (prompt, completion) pairs within the batch"
        )
    prompts = [e["prompt_ids"] for e in examples]
    completions = [e["completion_ids"] for e in examples]
    shifted = completions[1:] + completions[:1] if partners is None else [p["completion_ids"] for p in partners]
    input_ids, attention_mask, labels = _join(prompts, completions, pad_token_id)  # (B, T) each
    kl_input_ids, kl_attention_mask, kl_labels = _join(prompts, shifted, pad_token_id)  # (B, T') each
    return UnpairedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        desirable=torch.tensor([bool(e["desirable"]) for e in examples], dtype=torch.bool),  # (B,)
        kl_input_ids=kl_input_ids,
        kl_attention_mask=kl_attention_mask,
        kl_labels=kl_labels,
    )


def collate_prompts(examples: list[PromptExample], pad_token_id: int) -> PromptBatch:
    """LEFT padding, so that every prompt ends at the last column and generation continues from there."""
    ids = [e["prompt_ids"] for e in examples]
    return PromptBatch(
        input_ids=_pad(ids, pad_token_id, left=True),  # (B, P)
        attention_mask=_pad([[1] * len(x) for x in ids], 0, left=True),  # (B, P)
    )


# 5. Small helpers ----------------------------------------------------------------------------------------------


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:300]
