"""Atomic writes: every file and directory rlhfkit writes appears whole under its name, or not at all.

A reader — a resumed run, `rlhfkit dashboard`, a browser tab on report.html — never sees half a file, and a kill
leaves only `.tmp-*` entries, which the next run in that directory removes (`trainers.rundir.RunDir`).

This module imports only the standard library (and `rlhfkit.errors`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from typing import Iterator

from rlhfkit.errors import UserError

logger = logging.getLogger("rlhfkit")

TMP_PREFIX = ".tmp-"  # every temporary file or directory rlhfkit writes (removed at the next start in output_dir)


def cache_dir() -> str:
    """Where rlhfkit caches what it builds once (converted GGUF models, the tiny model, tokenised datasets):
    $RLHFKIT_CACHE, else ~/.cache/rlhfkit."""
    return os.environ.get("RLHFKIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlhfkit")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to a temporary file beside `path`, then rename it into place."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=TMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """`atomic_write_bytes` of UTF-8 text."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_dir(target: str, *, replace: bool = True) -> Iterator[str]:
    """Yield an empty temporary directory beside `target`; when the block ends without an exception, rename it to
    `target`. An exception (or a kill) leaves `target` as it was.

    Args:
        target: the directory to write.
        replace: an existing `target` is replaced (moved aside, then deleted: `remove_tree`). With False, an existing
            `target` wins and the new copy is discarded — for caches that concurrent processes may all build.
    """
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f"{TMP_PREFIX}{os.path.basename(target)}-")
    try:
        yield tmp
        if os.path.exists(target):
            if not replace:
                return
            remove_tree(target)
        try:
            os.replace(tmp, target)
        except OSError:
            if replace or not os.path.isdir(target):  # not a lost race between processes building one cache: a failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_tree(path: str) -> None:
    """Delete a directory so that a kill midway leaves no half of it under its own name: rename it to a `.tmp-*`
    sibling, then delete that."""
    if not os.path.exists(path):
        return
    parent, name = os.path.split(os.path.abspath(path))
    trash = tempfile.mkdtemp(dir=parent, prefix=f"{TMP_PREFIX}removed-")
    os.replace(path, os.path.join(trash, name))
    shutil.rmtree(trash, ignore_errors=True)


def check_writable(path: str, key: str = "output_dir") -> None:
    """Fail (writing nothing) unless `path` is a directory, or can be created as one, that we may write into.

    `key` is the config key or option the path came from, named in the one-line `UserError`.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{key} '{path}' exists and is not a directory")
    existing = os.path.abspath(path)  # the nearest existing ancestor decides
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{key} '{path}' cannot be created: '{existing}' is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{key} '{path}' is not writable: no permission to write in '{existing}'")


def write_jsonl_rows(path: str, rows: list[dict]) -> str:
    """Write `rows` as JSON lines, atomically; returns `path`."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_jsonl_rows(path: str) -> list[dict]:
    """The JSON objects of a JSONL file (metrics.jsonl, samples.jsonl), skipping with a warning any line that is not
    JSON — the half-written last line of a run killed (or out of disk) while writing it."""
    rows, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    if bad:
        logger.warning("%s: skipped %d half-written or non-JSON line(s)", path, bad)
    return rows
