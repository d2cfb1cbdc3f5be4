"""Metric sinks: where a run's metrics and samples go. `Run` holds a list of them — `JsonlSink`, then the trackers of
`logging.report_to` (`rlhfkit.trackers.build_sinks`) — and calls each the same way, on the main process only."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Protocol

import torch


class MetricSink(Protocol):
    """Where a run's metrics go (metrics.jsonl, TensorBoard, W&B, trackio). Called on the main process only; a
    tracker receives the resolved config when it is built."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_samples(self, step: int, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """`metrics.jsonl` (one JSON object per logged step) and `samples.jsonl` (one per logged sample) in output_dir.

    The files are strict JSON, which has no NaN or Infinity: a non-finite value (the loss of a skipped step) is
    written as null.
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        strict = {k: v if math.isfinite(v) else None for k, v in record.items()}
        self._append("metrics.jsonl", [strict])

    def log_samples(self, step: int, rows: list[dict]) -> None:
        finite = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v  # noqa: E731
        self._append("samples.jsonl", [{"step": step, **{k: finite(v) for k, v in row.items()}} for row in rows])

    def _append(self, name: str, rows: list[dict]) -> None:
        with open(os.path.join(self.output_dir, name), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row, allow_nan=False) + "\n" for row in rows)

    def close(self) -> None:
        """Every row is written when logged: nothing to flush."""


def open_sinks(cfg, stage: str, run_name: str) -> list[MetricSink]:
    """The main process's sinks: `JsonlSink`, then the trackers of `logging.report_to`, each given the resolved
    config; W&B and trackio put the run `run_name` in the project `logging.project`."""
    from rlhfkit.trackers import build_sinks, run_config

    return [JsonlSink(cfg.output_dir)] + build_sinks(cfg.logging.report_to, run_config(cfg, stage), is_main=True,
                                                     project=cfg.logging.project, run_name=run_name,
                                                     output_dir=cfg.output_dir)


def close_sinks(sinks: list[MetricSink]) -> list[MetricSink]:
    """Close every sink (a failure to close one is a warning: the run's own outcome stands); returns the empty list
    the run keeps, so that each sink is closed once."""
    from rlhfkit.errors import first_line

    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 - closing must not mask the run's own error
            logging.getLogger("rlhfkit").warning("closing %s failed: %s", type(sink).__name__,
                                                 first_line(exc, with_type=True))
    return []


def to_float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)
