"""Tokenization of validated records into typed examples through one `datasets.Dataset.map`, with truncation counts
and an on-disk cache, and `build_datasets`, the train and eval splits of a stage (see the package docstring)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from rlhfkit.config import DataConfig
from rlhfkit.data import formats, render, sources
from rlhfkit.data.formats import canonical, detect, rename_columns
from rlhfkit.data.render import Encoder
from rlhfkit.data.sources import is_local_file, open_source
from rlhfkit.errors import DataError, UserError
from rlhfkit.io import cache_dir

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger("rlhfkit")

IGNORE_INDEX = -100  # label of a token that takes no loss (torch cross_entropy's default ignore_index)
_RECORD = "_rlhfkit_record"  # the one column of a list of records handed to the map: each record as JSON text
_FLAGS = ("_prompt_truncated", "_response_truncated", "_dropped", "_plain")  # per map row; the statistics count them
# "_dropped": kept, or why not: an empty response, chosen == rejected, a prompt whose tools or system message would be cut
_KEPT, _EMPTY, _IDENTICAL, _TOOLS = 0, 1, 2, 3


# The typed examples of each kind, as `build_datasets` returns them (lists of token ids, no padding).


class SFTExample(TypedDict):
    input_ids: list[int]  # (T,) prompt + response tokens
    labels: list[int]  # (T,) -100 on prompt tokens, the token id on response tokens


class PreferenceExample(TypedDict):
    prompt_ids: list[int]  # (P,)
    chosen_ids: list[int]  # (R,) ends at EOS unless cut to data.max_length
    rejected_ids: list[int]  # (R',)
    # (R,) and (R',): 1 on the tokens the assistant wrote, 0 on tool results and the headers between turns (their
    # log-probs are never summed); all ones for a single-turn response
    chosen_action_mask: list[int]
    rejected_action_mask: list[int]
    margin: float  # the record's margin, 0.0 without one


class UnpairedExample(TypedDict):
    prompt_ids: list[int]  # (P,)
    completion_ids: list[int]  # (R,)
    completion_action_mask: list[int]  # (R,) as PreferenceExample's
    desirable: bool


class PromptExample(TypedDict):
    prompt_ids: list[int]  # (P,) ends with the generation prompt
    prompt: str | list[dict]  # the record's own prompt: the string, or the message dicts of the prompt turns
    # Every other field of the record (all but "prompt" and "messages", e.g. a reference "answer" or test cases),
    # for reward functions (`rewards.Rewards`); a value JSON cannot hold (a timestamp, bytes) arrives as its str().
    columns: dict
    tools: list[dict] | None  # the record's `tools` column, parsed (JSON schemas), or None without one
    record: int  # the record's 0-based index among its source's loaded records, for errors found after tokenising


Example = SFTExample | PreferenceExample | UnpairedExample | PromptExample



@dataclass
class TruncationStats:
    """What tokenization cut or dropped from one data source; each count is of records."""

    records: int  # records read
    prompts_truncated: int = 0  # prompts longer than max_prompt_length, cut to their last tokens
    responses_truncated: int = 0  # records with a response cut so that prompt + response fits max_length
    dropped: int = 0  # records left with an empty response, or with chosen == rejected, and those of `tools_dropped`
    tools_dropped: int = 0  # records whose prompt was too long and began with tool definitions or a system message

    def summary(self, source: str) -> str:
        tools = self.tools_dropped
        return (
            f"{source}: {self.records} records -> {self.records - self.dropped} examples; "
            f"{self.prompts_truncated} prompts truncated to data.max_prompt_length (kept their last tokens), "
            f"{self.responses_truncated} responses cut to data.max_length, {self.dropped} dropped"
            + (f"; {tools} record{'s' if tools != 1 else ''} dropped: their tool definitions (or system message) did "
               "not fit data.max_prompt_length" if tools else "")
        )


def tokenize_records(
    records: list[dict] | datasets.Dataset, kind: str, tokenizer, cfg: DataConfig, source: str,
    cache_file: str | None = None,
) -> tuple[list[Example], TruncationStats]:
    """Validates and tokenizes `kind` records into typed examples (package docstring): the format is detected from
    the first record's keys, each record is validated as it is tokenized. Counts what was cut or dropped, and warns
    about what the counts alone don't say; `source` names the data in every message.

    One `datasets.Dataset.map` of `_encode` over the records (RLHFKIT_DATA_NUM_PROC worker processes); with a
    `cache_file` (`build_datasets` names one per data, tokenizer and settings) it reads a finished map back from
    that file instead of tokenizing, or writes it there. Each map row is one record: its example's columns and the
    flags (`_FLAGS`) that the statistics are counted from, so a cached rerun reports the same statistics.
    """
    import datasets
    from datasets.fingerprint import generate_random_fingerprint

    fmt = detect(records, kind, source, cfg.columns)
    encoder = Encoder(tokenizer)
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

    ids, mask = Sequence(Value("int32")), Sequence(Value("int8"))
    columns = {
        "sft": {"input_ids": ids, "labels": ids},
        "preference": {"prompt_ids": ids, "chosen_ids": ids, "rejected_ids": ids, "chosen_action_mask": mask,
                       "rejected_action_mask": mask, "margin": Value("float64")},
        "unpaired": {"prompt_ids": ids, "completion_ids": ids, "completion_action_mask": mask, "desirable": Value("bool")},
        "prompt": {"prompt_ids": ids, "prompt": Value("string"), "columns": Value("string"),  # JSON text
                   "tools": Value("string"), "record": Value("int64")},
    }[kind]
    flags = dict(zip(_FLAGS, (Value("bool"), Value("bool"), Value("int8"), Value("bool"))))
    return Features({**columns, **flags})


def _encode_batch(batch: dict[str, list], indices: list[int], *, encoder: Encoder, fmt: str, kind: str,
                  cfg: DataConfig, source: str, names: list[str]) -> dict[str, list]:
    """The map function: a batch of records (a JSON text column, or a hub dataset's own columns) -> rows."""
    if _RECORD in batch:
        records = [json.loads(text) for text in batch[_RECORD]]
    else:
        records = [dict(zip(batch, values)) for values in zip(*batch.values())]
    rows = [_encode(encoder, record, i, fmt, kind, cfg, source) for record, i in zip(records, indices)]
    return {name: [row[name] for row in rows] for name in names}


def _encode(encoder: Encoder, record: dict, i: int, fmt: str, kind: str, cfg: DataConfig, source: str) -> dict:
    """Validates and tokenizes record `i`: its example's columns plus the `_FLAGS` of what was cut or dropped.

    1. A prompt longer than cfg.max_prompt_length keeps its last tokens (truncation="truncate") or is an error. A
       prompt with tool definitions or a system message is never cut, since they are its first tokens (the chat
       template renders them first): its record is dropped, or, a prompt record (the online stages' data, where a
       dropped prompt would go unnoticed), refused; with truncation="error" it is refused too.
    2. Responses are cut so that prompt + response <= cfg.max_length.
    3. A record whose response is then empty, or a pair whose chosen and rejected ids are equal, is dropped: its row
       stays, flagged, so that the statistics survive the cache; `_examples` leaves it out.
    """
    where = f"{source} record {i}"
    example = canonical(rename_columns(record, cfg.columns, where), fmt, kind, source, i)
    encoder.plain = False
    flags = {"_prompt_truncated": False, "_response_truncated": False, "_dropped": _KEPT}
    head = bool(example.tools) or _has_system_message(example)  # what a cut from the front would take away
    too_long = False

    def fit_prompt(ids: list[int]) -> list[int]:
        nonlocal too_long
        if len(ids) <= cfg.max_prompt_length:
            return ids
        if head and (kind == "prompt" or cfg.truncation == "error"):
            raise DataError(_head_cut(where, len(ids), cfg.max_prompt_length, kind))
        if head:  # kept whole: the record is dropped (flagged below, over any other reason)
            too_long = True
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
                   "columns": json.dumps(example.columns, default=str), "tools": json.dumps(example.tools), "record": i}
    elif example.text is not None:  # SFT language modelling: every token takes the loss
        input_ids = encoder.text(example.text)
        columns = _fit_sequence(input_ids, list(input_ids), cfg.max_length, flags)
    elif example.turns is not None:  # SFT conversation: the first segment is the prompt
        segments = encoder.conversation(example.turns, where, example.tools)
        segments[0] = (fit_prompt(segments[0][0]), False)
        input_ids = [t for ids, _ in segments for t in ids]
        labels = [t if is_response else IGNORE_INDEX for ids, is_response in segments for t in ids]
        columns = _fit_sequence(input_ids, labels, cfg.max_length, flags)
    else:
        encoded = [encoder.pair(example, response, where) for response in example.responses]
        prompt_ids = fit_prompt(encoded[0][0])
        room = cfg.max_length - len(prompt_ids)
        if any(len(response_ids) > room for _, response_ids, _ in encoded):
            flags["_response_truncated"] = True
        responses = [response_ids[:room] for _, response_ids, _ in encoded]
        masks = [mask[:room] for _, _, mask in encoded]  # (R,) each: 1 on the assistant's own tokens
        if not all(responses):
            flags["_dropped"] = _EMPTY
        elif kind == "preference" and responses[0] == responses[1]:
            flags["_dropped"] = _IDENTICAL
        if kind == "preference":
            columns = {"prompt_ids": prompt_ids, "chosen_ids": responses[0], "rejected_ids": responses[1],
                       "chosen_action_mask": masks[0], "rejected_action_mask": masks[1], "margin": example.margin}
        elif kind == "unpaired":
            columns = {"prompt_ids": prompt_ids, "completion_ids": responses[0], "completion_action_mask": masks[0],
                       "desirable": example.desirable}
        else:  # SFT prompt/completion: the loss on the completion's assistant turns
            labels = [t if m else IGNORE_INDEX for t, m in zip(responses[0], masks[0])]
            columns = {"input_ids": prompt_ids + responses[0], "labels": [IGNORE_INDEX] * len(prompt_ids) + labels}
    if too_long:
        flags["_dropped"] = _TOOLS
    return {**columns, **flags, "_plain": encoder.plain}


def _has_system_message(example) -> bool:
    messages = example.turns if example.turns is not None else example.prompt
    return isinstance(messages, list) and any(m.get("role") == "system" for m in messages)


def _head_cut(where: str, length: int, max_prompt_length: int, kind: str) -> str:
    """The refusal of a prompt that is too long and begins with tool definitions or a system message."""
    if kind == "prompt":
        return (f"{where}: the prompt with its tool definitions (or system message) is {length} tokens, longer than "
                f"data.max_prompt_length={max_prompt_length}, and cutting it would cut them away: raise "
                "data.max_prompt_length or shorten the record")
    return (f"{where}: prompt is {length} tokens, longer than data.max_prompt_length={max_prompt_length}; cutting it "
            "would cut its tool definitions (or system message), which come first: raise data.max_prompt_length (with "
            "data.truncation=truncate such a record is dropped, and counted)")


def _fit_sequence(input_ids: list[int], labels: list[int], max_length: int, flags: dict) -> SFTExample:
    """An SFT sequence cut to `max_length` tokens; flagged as dropped when no token is left to take the loss."""
    if len(input_ids) > max_length:
        flags["_response_truncated"] = True
        input_ids, labels = input_ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels):
        flags["_dropped"] = _EMPTY
    return {"input_ids": input_ids, "labels": labels}


def _examples(rows: datasets.Dataset, kind: str, source: str) -> tuple[list[Example], TruncationStats]:
    """The kept rows as python examples, the statistics counted from every row's flags, and the warnings."""
    table = rows.to_dict()
    dropped = table["_dropped"]
    stats = TruncationStats(
        records=len(dropped),
        prompts_truncated=sum(table["_prompt_truncated"]),
        responses_truncated=sum(table["_response_truncated"]),
        dropped=sum(reason != _KEPT for reason in dropped),
        tools_dropped=sum(reason == _TOOLS for reason in dropped),
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
            for name in ("prompt", "columns", "tools"):
                example[name] = json.loads(example[name])
    if not examples:
        raise DataError(f"{source}: every record was dropped ({stats.summary(source)})")
    return examples, stats


def build_datasets(kind: str, cfg: DataConfig, tokenizer, seed: int) -> tuple[list[Example], list[Example] | None]:
    """Tokenized (train, eval) examples: eval from cfg.eval, else a seeded cfg.eval_fraction of train, else None.

    Each split is tokenized once per data, tokenizer and settings, then read back from the cache (package docstring).
    The held-out fraction is drawn from the tokenized train examples, so error messages keep the file's own record
    numbers; its truncation counts are part of the train file's summary.
    """
    if cfg.subset and all(is_local_file(source) for source in (cfg.train, cfg.eval) if source):
        raise DataError(f"data.subset={cfg.subset!r} names a configuration of a hub dataset, but data.train '{cfg.train}' "
                        f"is a local file{f' and so is data.eval {cfg.eval!r}' if cfg.eval else ''}")
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

    fingerprint, read = open_source(source, cfg.subset, split, cfg.max_samples)
    cache_file = _cache_file(kind, fingerprint, cfg, tokenizer)
    if cache_file and os.path.exists(cache_file):  # tokenized before: the records need not even be read
        logger.info(f"{source}: reading the tokenized examples back from {cache_file}")
        examples, stats = _examples(datasets.Dataset.from_file(cache_file), kind, source)
    else:  # (a map cached by worker processes is in shard files: the map reads them back)
        examples, stats = tokenize_records(read(), kind, tokenizer, cfg, source, cache_file)
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
                       cfg.max_length, cfg.max_prompt_length, cfg.truncation, sorted(cfg.columns.items()), tokenizer])
    return os.path.join(cache_dir(), "data", f"{kind}-{key}.arrow")


@functools.cache
def _source_hash() -> str:
    """The source of the modules that shape the ids (reading, formats, rendering, tokenization): a change to them
    names new cache files."""
    digest = hashlib.blake2b(digest_size=16)
    for module in (sources, formats, render, sys.modules[__name__]):
        with open(module.__file__, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _num_proc() -> int:
    value = os.environ.get("RLHFKIT_DATA_NUM_PROC", "1")
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"environment variable RLHFKIT_DATA_NUM_PROC must be a positive integer, got {value!r}")
    return int(value)

