"""The labelling database: SQLite in WAL mode, from the standard library.

Tables: `meta` (what the items were made from), `items` (one `Pair` each, as JSON), `assignments` (which annotator
was handed which item, with a one-time token) and `judgements`. Every write is one `BEGIN IMMEDIATE` transaction,
committed (synchronous=FULL) before the caller answers the page, so a judgement the page was told is saved survives a
kill -9 of the server. Several processes may open one database: the server writes, `rlhfkit label --export` reads.

Who gets what: an annotator keeps at most one open (handed, not yet judged) item, which a restart or a page reload
hands back, so each resumes where they stopped. Otherwise they get the first item, in order, that they have not
held and that fewer annotators hold than it needs (one; two on the overlap). The choice and the assignment are one
transaction, so two annotators asking at once never get the same single-annotator item. An open item left alone
longer than the lease (someone went home) may be handed to another annotator; its first holder's submission is then
refused and they get a new item.

A submission names its item and the token it was handed with: a replayed submission (already judged) or a stale one
(the item was undone and handed again under a new token) is refused and changes nothing.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rlhfkit.errors import UserError
from rlhfkit.label.candidates import Pair, pair_from_json, pair_to_json

# What an annotator can answer, in terms of the pair (the page's left/right are mapped through `Pair.swap`).
CHOICES = ("first", "second", "tie", "both_bad", "skip")
SIDES = ("first", "second")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, pair TEXT NOT NULL, needed INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS assignments (
    item INTEGER NOT NULL REFERENCES items(id), annotator TEXT NOT NULL, token TEXT NOT NULL, time REAL NOT NULL,
    PRIMARY KEY (item, annotator));
CREATE TABLE IF NOT EXISTS judgements (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, item INTEGER NOT NULL REFERENCES items(id), annotator TEXT NOT NULL,
    choice TEXT NOT NULL, harmful TEXT NOT NULL, time REAL NOT NULL, UNIQUE (item, annotator));
"""


# SQL: assignment `a` has its judgement.
_JUDGED = "EXISTS (SELECT 1 FROM judgements j WHERE j.item = a.item AND j.annotator = a.annotator)"


class Rejected(Exception):
    """A submission refused with an HTTP status (404 unknown item, 409 replayed or stale, 422 bad value)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Handed:
    """An item handed to an annotator: submit its judgement with `token`."""

    item: int
    token: str
    pair: Pair


@dataclass(frozen=True)
class Judgement:
    item: int
    annotator: str
    choice: str  # one of CHOICES
    harmful: tuple[str, ...]  # the sides flagged harmful (SIDES)
    time: float  # seconds since the epoch
    pair: Pair


@dataclass(frozen=True)
class Progress:
    done: int  # judgements made
    total: int  # judgements the items need (one each, two on the overlap)
    per_annotator: dict[str, int]


class Store:
    """One labelling database. Thread-safe: one connection, one lock (the server's routes run in a thread pool)."""

    def __init__(self, path: str, lease_s: float = 1800.0):
        self.path, self.lease_s = path, lease_s
        self._lock = threading.Lock()
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
            # A read-only file opens without complaint and fails at the first judgement: write once now instead.
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', '1')")
        except (OSError, sqlite3.Error) as exc:
            raise UserError(f"database '{path}' cannot be opened for writing ({exc})") from None

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction, taken with the write lock at once (BEGIN IMMEDIATE), committed before returning."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # Items --------------------------------------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return rows[0][0] if rows else None

    def secret(self, key: str) -> str:
        """A random value kept in the database under `key`, made on first use: what the per-person links are derived
        from, so that a restart prints the same links (whoever can read the database can make them)."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (key, secrets.token_urlsafe(32)))
            return db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()[0]

    def is_empty(self) -> bool:
        return not self._read("SELECT 1 FROM items LIMIT 1")

    def check_made_for(self, fingerprint: str, what: str) -> bool:
        """True when the database holds items made from `fingerprint`, False when it holds none; a database made
        for other candidates is refused."""
        if self.is_empty():
            return False
        if self.meta("fingerprint") != fingerprint:
            raise UserError(f"database '{self.path}' was made for other candidates ({self.meta('source')}), not for "
                            f"{what}: use another --db, or the same inputs as before")
        return True

    def create(self, pairs: list[Pair], fingerprint: str, source: str, mode: str) -> None:
        """Stores the items once, with what they were made from."""
        if not pairs:
            raise UserError("no items to label")
        with self._write() as db:
            db.executemany("INSERT INTO items (id, pair, needed) VALUES (?, ?, ?)",
                           [(i, json.dumps(pair_to_json(p)), 2 if p.overlap else 1) for i, p in enumerate(pairs)])
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                           [("fingerprint", fingerprint), ("source", source), ("mode", mode)])

    def pairs(self) -> list[Pair]:
        return [pair_from_json(json.loads(p)) for (p,) in self._read("SELECT pair FROM items ORDER BY id")]

    def pair(self, item: int) -> Pair:
        """The item's pair; `Rejected` (404) for an unknown item."""
        with self._lock:
            return self._pair(self._db, item)

    def _pair(self, db: sqlite3.Connection, item: int) -> Pair:
        row = db.execute("SELECT pair FROM items WHERE id = ?", (item,)).fetchone()
        if row is None:
            raise Rejected(404, f"unknown item {item}")
        return pair_from_json(json.loads(row[0]))

    # Serving ------------------------------------------------------------------------------------------------------

    def next_item(self, annotator: str) -> Handed | None:
        """The annotator's open item, else a new one (module docstring); None when nothing is left for them."""
        with self._write() as db:
            return self._next(db, annotator)

    def _next(self, db: sqlite3.Connection, annotator: str) -> Handed | None:
        now = time.time()
        row = db.execute(f"""SELECT a.item, a.token FROM assignments a WHERE a.annotator = ? AND NOT {_JUDGED}
                             ORDER BY a.time DESC LIMIT 1""", (annotator,)).fetchone()
        if row is not None:  # still theirs: the lease starts again
            db.execute("UPDATE assignments SET time = ? WHERE item = ? AND annotator = ?", (now, row[0], annotator))
            return Handed(row[0], row[1], self._pair(db, row[0]))
        # Holders of an item: those who judged it, and those handed it within the lease.
        cutoff = now - self.lease_s
        free = db.execute(f"""SELECT i.id FROM items i WHERE
                                (SELECT COUNT(*) FROM assignments a WHERE a.item = i.id AND (a.time > ? OR {_JUDGED}))
                                < i.needed
                                AND NOT EXISTS (SELECT 1 FROM assignments a WHERE a.item = i.id AND a.annotator = ?)
                              ORDER BY i.id LIMIT 1""", (cutoff, annotator)).fetchone()
        if free is None:
            return None
        db.execute(f"DELETE FROM assignments WHERE item = ? AND time <= ? AND NOT {_JUDGED.replace('a.', 'assignments.')}",
                   (free[0], cutoff))
        token = secrets.token_urlsafe(12)
        db.execute("INSERT INTO assignments VALUES (?, ?, ?, ?)", (free[0], annotator, token, now))
        return Handed(free[0], token, self._pair(db, free[0]))

    def judge(self, annotator: str, item: int, token: str, choice: str, harmful: tuple[str, ...] = ()) -> Handed | None:
        """Records a judgement, committed before returning, and hands the annotator their next item. Raises
        `Rejected` (nothing written) for an unknown item or value, or a token that is not the open one."""
        if choice not in CHOICES:
            raise Rejected(422, f"unknown choice {choice!r}; expected one of {', '.join(CHOICES)}")
        if any(side not in SIDES for side in harmful):
            raise Rejected(422, f"unknown side in harmful {list(harmful)!r}; expected {', '.join(SIDES)}")
        with self._write() as db:
            self._pair(db, item)
            held = db.execute("SELECT token FROM assignments WHERE item = ? AND annotator = ?", (item, annotator)).fetchone()
            if held is None:
                raise Rejected(409, f"item {item} is not handed to {annotator!r} (or was left past the lease and handed "
                                    "to someone else: reload the page)")
            if db.execute("SELECT 1 FROM judgements WHERE item = ? AND annotator = ?", (item, annotator)).fetchone():
                raise Rejected(409, f"item {item} is already judged by {annotator!r} (a replayed submission)")
            if not secrets.compare_digest(held[0], token):
                raise Rejected(409, f"stale submission for item {item}: it was handed again since (reload the page)")
            db.execute("INSERT INTO judgements (item, annotator, choice, harmful, time) VALUES (?, ?, ?, ?, ?)",
                       (item, annotator, choice, json.dumps(sorted(set(harmful))), time.time()))
            return self._next(db, annotator)

    def undo(self, annotator: str) -> Handed | None:
        """Takes back the annotator's last judgement: its item is handed to them again, under a new token (so the old
        submission is stale), and the item they had open goes back to the pool. Returns what they see next."""
        with self._write() as db:
            last = db.execute("SELECT seq, item FROM judgements WHERE annotator = ? ORDER BY seq DESC LIMIT 1",
                              (annotator,)).fetchone()
            if last is None:
                return self._next(db, annotator)
            db.execute("""DELETE FROM assignments WHERE annotator = ? AND NOT EXISTS (
                            SELECT 1 FROM judgements j WHERE j.item = assignments.item AND j.annotator = ?)""",
                       (annotator, annotator))
            db.execute("DELETE FROM judgements WHERE seq = ?", (last[0],))
            db.execute("UPDATE assignments SET token = ?, time = ? WHERE item = ? AND annotator = ?",
                       (secrets.token_urlsafe(12), time.time(), last[1], annotator))
            return self._next(db, annotator)

    # Reading ------------------------------------------------------------------------------------------------------

    def progress(self) -> Progress:
        total = self._read("SELECT COALESCE(SUM(needed), 0) FROM items")[0][0]
        counts = dict(self._read("SELECT annotator, COUNT(*) FROM judgements GROUP BY annotator ORDER BY annotator"))
        return Progress(sum(counts.values()), total, counts)

    def judgements(self) -> list[Judgement]:
        """Every judgement, in the order they were made."""
        pairs = self.pairs()
        rows = self._read("SELECT item, annotator, choice, harmful, time FROM judgements ORDER BY seq")
        return [Judgement(item, who, choice, tuple(json.loads(harmful)), t, pairs[item])
                for item, who, choice, harmful, t in rows]
