"""Judgements as files: preference pairs for `rlhfkit rm` / `rlhfkit dpo`, and harmful flags for the red-team report.

Preferences (`--export FILE`): one JSON line per judgement that prefers a response, in the pairwise format the
preference stages read: `{"prompt", "chosen", "rejected"}` (text or messages, as the candidates hold them), with
`annotator`, `time` (ISO 8601, UTC), `item`, `chosen_model` and `rejected_model` beside them as metadata (the
stages read only the fields they know). Ties, "both bad" and skips say nothing about which response is better and
are left out; no margin is written, so `algo.margin_scale` has no effect on an export. Overlap items judged by two
annotators give one row per judgement (two people agreeing count twice, disagreeing cancel out).

Harmful flags (`--export-flags FILE`): one JSON line per response an annotator saw on a judged item (skips left out),
`{"prompt": TEXT or MESSAGES, "response": TEXT or MESSAGES, "model": NAME, "harmful": BOOL, "annotator": NAME,
"time": ISO 8601 UTC}`: `"harmful": true` for a response they flagged, false for one they saw and did not flag (so
that a harmful rate has its denominator). `model` is the name the candidates give the response's source (the model
path or hub name it was sampled from, the compared model or the reference in compare mode, or a candidates file's
"models" entry). A response two annotators judged gives two rows. `rlhfkit eval`'s red-team report
(`red_team.human_flags`) counts these rows as human red-team judgements.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

from rlhfkit.io import atomic_write_text
from rlhfkit.label.store import Judgement


def iso_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")


def preference_rows(judgements: Sequence[Judgement]) -> list[dict]:
    """A pairwise preference record per judgement that picked a response (module docstring)."""
    rows = []
    for j in judgements:
        if j.choice not in ("first", "second"):
            continue
        chosen, rejected = (j.pair.first, j.pair.second) if j.choice == "first" else (j.pair.second, j.pair.first)
        rows.append({"prompt": j.pair.prompt, "chosen": chosen.content, "rejected": rejected.content,
                     "annotator": j.annotator, "time": iso_time(j.time), "item": j.item,
                     "chosen_model": chosen.model, "rejected_model": rejected.model})
    return rows


def flag_rows(judgements: Sequence[Judgement]) -> list[dict]:
    """A row per response seen on a judged item, flagged harmful or not (module docstring)."""
    rows = []
    for j in judgements:
        if j.choice == "skip":
            continue
        for side, c in (("first", j.pair.first), ("second", j.pair.second)):
            rows.append({"prompt": j.pair.prompt, "response": c.content, "model": c.model, "harmful": side in j.harmful,
                         "annotator": j.annotator, "time": iso_time(j.time)})
    return rows


def write_jsonl(rows: list[dict], path: str) -> str:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
