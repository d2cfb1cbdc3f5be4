"""Where records come from: a local .jsonl/.json/.csv/.parquet file, or a hub dataset (or a local dataset folder)
through `datasets`. Parse errors name the file and its 1-based line."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlhfkit.errors import DataError, first_line

if TYPE_CHECKING:
    import datasets

DATA_EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "name" or "org/name"


def open_source(source: str, subset: str | None, split: str, max_samples: int | None) -> tuple[str, Callable[[], list[dict] | datasets.Dataset]]:
    """A fingerprint of `source`'s records (a local file's content hash, a hub dataset's own datasets fingerprint),
    and the function that reads them (a file's records as a list, a hub dataset as a `datasets.Dataset`), keeping
    the first `max_samples`: a file is only read when its tokenized examples are not cached yet.

    A source that looks like a path (a data extension, a "/" plus an extension, or a leading "." "/" "~") must exist;
    anything else shaped like "name" or "org/name" goes to `datasets.load_dataset(source, subset, split=split)`.
    """
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        fingerprint = f"{_file_hash(path)}{os.path.splitext(path)[1].lower()}-{max_samples}"
        return fingerprint, lambda: _read_file(path, source)[:max_samples]
    if os.path.isdir(path) or _is_hub_name(source):
        dataset = _load_hub(source, subset, split, max_samples)
        return dataset._fingerprint, lambda: dataset
    raise DataError(f"data file '{source}' not found")


def is_local_file(source: str) -> bool:
    return os.path.isfile(os.path.expanduser(source))


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


def _load_hub(source: str, subset: str | None, split: str, max_samples: int | None) -> datasets.Dataset:
    import datasets

    try:
        dataset = datasets.load_dataset(source, subset, split=split)
    except Exception as e:  # datasets raises many types (network, missing split, bad files); all are the user's to fix
        which = f"subset '{subset}', split '{split}'" if subset else f"split '{split}'"
        raise DataError(f"dataset '{source}' ({which}) could not be loaded: {first_line(e)}") from e
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
        raise DataError(f"{source}: expected a list of records (JSON objects), got {type_of(data)}")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{source} record {i}: expected a JSON object, got {type_of(record)}")
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
            raise DataError(f"{source} line {lineno}: expected a JSON object (one record per line), got {type_of(record)}")
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
        raise DataError(f"{source}: malformed {ext[1:].upper()} ({first_line(e)})") from None
    return table.to_pylist()



def type_of(value) -> str:
    """The type of a value read from a record, as an error message names it: "null", "str", "list", ..."""
    return "null" if value is None else type(value).__name__
