"""Datasets for every stage: loading, format detection, record-by-record validation, chat templates, tokenization
with truncation counts, and the collators that build the typed batches of `rlhfkit.types`.

Pipeline: `load_records` -> `detect_format` -> `tokenize_records` (validates each record, once) -> `collate_*`;
`build_datasets` runs the first three for the train and eval splits. `detect_format` alone validates every record
without tokenizing.

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
file; validation and tokenization errors name the record, its 0-based index among the loaded records.

Tokenized examples are dicts of python int lists (the collators turn them into tensors):
    sft         {"input_ids", "labels"}: labels -100 on prompt tokens, the token id on response tokens
    preference  {"prompt_ids", "chosen_ids", "rejected_ids", "margin": float}
    unpaired    {"prompt_ids", "completion_ids", "desirable": bool}
    prompt      {"prompt_ids", "prompt", "columns"}: "prompt" is the record's own prompt (the string, or the message
                dicts of the prompt turns), "columns" every other field of the record (all but "prompt" and "messages",
                e.g. a reference "answer" or test cases); reward functions receive both (`rewards.RewardSource`)
Prompts end with the generation prompt; responses are their own tokens only and end at the EOS token.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
from dataclasses import dataclass

import torch

from rlhfkit.config import DataConfig
from rlhfkit.errors import DataError
from rlhfkit.types import PreferenceBatch, PromptBatch, SFTBatch, UnpairedBatch

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


# 1. Loading ----------------------------------------------------------------------------------------------------


def load_records(source: str, split: str = "train", max_samples: int | None = None) -> list[dict]:
    """Reads a local .jsonl/.json/.csv/.parquet file, or a hub dataset (or local dataset folder) through `datasets`.

    A source that looks like a path (a data extension, a "/" plus an extension, or a leading "." "/" "~") must exist;
    anything else shaped like "name" or "org/name" goes to `datasets.load_dataset(source, split=split)`.
    Keeps the first `max_samples` records; no records at all is an error.
    """
    path = os.path.expanduser(source)
    where = source
    if os.path.isfile(path):
        records = _read_file(path, source)
    elif os.path.isdir(path) or _is_hub_name(source):
        records = _load_hub(source, split, max_samples)
        where = f"{source} (split '{split}')"
    else:
        raise DataError(f"data file '{source}' not found")
    if max_samples is not None:
        records = records[:max_samples]
    if not records:
        raise DataError(f"{where}: no records (empty dataset)")
    return records


def _is_hub_name(source: str) -> bool:
    ext = os.path.splitext(source)[1]
    if source.startswith((".", "/", "~")) or ext.lower() in DATA_EXTENSIONS or ("/" in source and ext):
        return False
    return bool(_HUB_NAME.match(source))


def _load_hub(source: str, split: str, max_samples: int | None) -> list[dict]:
    import datasets

    try:
        dataset = datasets.load_dataset(source, split=split)
    except Exception as e:  # datasets raises many types (network, missing split, bad files); all are the user's to fix
        raise DataError(f"dataset '{source}' (split '{split}') could not be loaded: {_one_line(e)}") from e
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset.to_list()


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


def _detect(records: list[dict], kind: str, source: str) -> str:
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
    shift the loss mask.
    """

    def __init__(self, tokenizer, source: str):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no eos_token: set one, so that every response can end at it")
        self.tok = tokenizer
        self.source = source
        self.template = bool(getattr(tokenizer, "chat_template", None))
        self.warned = False

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
        self.warn_plain()
        if isinstance(prompt, str):  # an HH prompt ends with an empty "Assistant:" turn: the generation prompt
            prompt = _hh_messages(prompt)[:-1] if hh else [{"role": "user", "content": prompt}]
        if isinstance(response, str):
            response = _hh_messages(HH_ASSISTANT + response) if hh else [{"role": "assistant", "content": response}]
        return prompt, response or []

    def warn_plain(self) -> None:
        if not self.template and not self.warned:
            logger.warning(f"{self.source}: the tokenizer has no chat template; rendering messages as plain 'role: content' lines")
            self.warned = True

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
        self.warn_plain()
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
    records: list[dict], fmt: str, kind: str, tokenizer, cfg: DataConfig, source: str
) -> tuple[list[dict], TruncationStats]:
    """Validates and tokenizes records of format `fmt` into per-example dicts (module docstring); counts what was
    cut or dropped.

    1. A prompt longer than cfg.max_prompt_length keeps its last tokens (truncation="truncate") or is an error.
    2. Responses are cut so that prompt + response <= cfg.max_length.
    3. A record whose response is then empty, or a pair whose chosen and rejected ids are equal, is dropped.
    """
    encoder = _Encoder(tokenizer, source)
    stats = TruncationStats(records=len(records))
    examples: list[dict] = []
    identical = 0

    def fit_prompt(ids: list[int], where: str) -> list[int]:
        if len(ids) <= cfg.max_prompt_length:
            return ids
        if cfg.truncation == "error":
            raise DataError(
                f"{where}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={cfg.max_prompt_length} "
                "(set data.truncation=truncate to cut it)"
            )
        stats.prompts_truncated += 1
        return ids[-cfg.max_prompt_length :]

    def fit_responses(prompt_ids: list[int], responses: list[list[int]]) -> list[list[int]]:
        room = cfg.max_length - len(prompt_ids)
        if any(len(r) > room for r in responses):
            stats.responses_truncated += 1
        return [r[:room] for r in responses]

    for i, record in enumerate(records):
        where = f"{source} record {i}"
        example = _canonical(record, fmt, kind, source, i)
        if kind == "prompt":
            examples.append({"prompt_ids": fit_prompt(encoder.prompt(example, where), where), "prompt": example.prompt,
                             "columns": example.columns})
        elif example.turns is not None:  # SFT conversation: the first segment is the prompt
            segments = encoder.conversation(example.turns, where)
            segments[0] = (fit_prompt(segments[0][0], where), False)
            input_ids = [t for ids, _ in segments for t in ids]
            labels = [t if is_response else IGNORE_INDEX for ids, is_response in segments for t in ids]
            if len(input_ids) > cfg.max_length:
                stats.responses_truncated += 1
                input_ids, labels = input_ids[: cfg.max_length], labels[: cfg.max_length]
            if all(label == IGNORE_INDEX for label in labels):
                stats.dropped += 1
                continue
            examples.append({"input_ids": input_ids, "labels": labels})
        else:
            encoded = [encoder.pair(example, response, where) for response in example.responses]
            prompt_ids = fit_prompt(encoded[0][0], where)
            responses = fit_responses(prompt_ids, [response_ids for _, response_ids in encoded])
            if not all(responses):
                stats.dropped += 1
            elif kind == "preference" and responses[0] == responses[1]:
                stats.dropped += 1
                identical += 1
            elif kind == "preference":
                examples.append(
                    {"prompt_ids": prompt_ids, "chosen_ids": responses[0], "rejected_ids": responses[1], "margin": example.margin}
                )
            elif kind == "unpaired":
                examples.append({"prompt_ids": prompt_ids, "completion_ids": responses[0], "desirable": example.desirable})
            else:
                examples.append({"input_ids": prompt_ids + responses[0], "labels": [IGNORE_INDEX] * len(prompt_ids) + responses[0]})
    if identical:
        logger.warning(f"{source}: dropped {identical} pairs whose chosen and rejected tokens are identical (after truncation)")
    if not examples:
        raise DataError(f"{source}: every record was dropped ({stats.summary(source)})")
    return examples, stats


def build_datasets(kind: str, cfg: DataConfig, tokenizer, seed: int) -> tuple[list[dict], list[dict] | None]:
    """Tokenized (train, eval) examples: eval from cfg.eval, else a seeded cfg.eval_fraction of train, else None.

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


def _tokenized_split(kind: str, source: str, split: str, cfg: DataConfig, tokenizer) -> list[dict]:
    records = load_records(source, split, cfg.max_samples)
    fmt = _detect(records, kind, source)
    examples, stats = tokenize_records(records, fmt, kind, tokenizer, cfg, source)
    cut = stats.prompts_truncated or stats.responses_truncated or stats.dropped
    logger.log(logging.WARNING if cut else logging.INFO, stats.summary(source))
    return examples


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


def collate_sft(examples: list[dict], pad_token_id: int) -> SFTBatch:
    """Right padding; labels padded with -100; attention_mask 1 on real tokens."""
    ids = [e["input_ids"] for e in examples]
    return SFTBatch(
        input_ids=_pad(ids, pad_token_id),  # (B, T)
        attention_mask=_pad([[1] * len(x) for x in ids], 0),  # (B, T)
        labels=_pad([e["labels"] for e in examples], IGNORE_INDEX),  # (B, T)
    )


def pack_sft(examples: list[dict], max_length: int) -> list[dict]:
    """Concatenates SFT examples and cuts the stream into rows of max_length tokens (the last row holds the rest).

    Labels travel with their ids, so completion-only masking survives. Classic packing (GPT pre-training, TRL's
    ConstantLengthDataset): attention crosses example boundaries, so a token also attends to the earlier examples
    of its row; the -100 labels on each prompt keep the loss off the boundary tokens.
    """
    ids = [t for e in examples for t in e["input_ids"]]
    labels = [t for e in examples for t in e["labels"]]
    return [{"input_ids": ids[s : s + max_length], "labels": labels[s : s + max_length]} for s in range(0, len(ids), max_length)]


def collate_preference(examples: list[dict], pad_token_id: int) -> PreferenceBatch:
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


def collate_unpaired(examples: list[dict], pad_token_id: int) -> UnpairedBatch:
    """KTO batch. The kl_* rows pair prompt i with completion (i + 1) % B, a cyclic shift (TRL pairs each prompt
    with the completions of a reversed/shifted batch); KTO's reference point z0 is estimated from these mismatched
    pairs (Ethayarajh et al. 2024, arXiv 2402.01306, §4.1). A KL row can be longer than data.max_length (prompt i
    with another prompt's room for its completion); it is only used for the z0 estimate."""
    if len(examples) < 2:
        raise ValueError(
            f"collate_unpaired needs at least 2 examples per batch, got {len(examples)}: KTO's reference point z0 "
            "is estimated from mismatched (prompt, completion) pairs within the batch"
        )
    prompts = [e["prompt_ids"] for e in examples]
    completions = [e["completion_ids"] for e in examples]
    shifted = completions[1:] + completions[:1]  # completion (i + 1) % B
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


def collate_prompts(examples: list[dict], pad_token_id: int) -> PromptBatch:
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
