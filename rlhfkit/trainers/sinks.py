"""Metric sinks: where a run's metrics and samples go. `Run` holds a list of them and calls each the same way."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Protocol

import torch

from rlhfkit.config import TrainConfig
from rlhfkit.errors import UserError


class MetricSink(Protocol):
    """Where a run's metrics go (metrics.jsonl, TensorBoard, W&B...). Called on the main process only."""

    def attach_config(self, cfg: TrainConfig) -> None: ...

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

    def attach_config(self, cfg: TrainConfig) -> None:
        """config.yaml is the run directory's (`RunDir.prepare`): nothing to add."""

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


class TrackerSink:
    """accelerate's trackers (`logging.report_to`: TensorBoard, W&B), which receive the floats themselves."""

    def __init__(self, accelerator):
        self.accelerator = accelerator  # its trackers initialised (`init_trackers`, on every process)

    def attach_config(self, cfg: TrainConfig) -> None:
        """The trackers are named after the run; the config stays in config.yaml."""

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.accelerator.log(metrics, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Samples stay in samples.jsonl."""

    def close(self) -> None:
        self.accelerator.end_training()


def check_report_to(report_to: list[str]) -> None:
    """Fail before training if a requested metric sink is not installed."""
    import importlib.util

    package = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for sink in report_to:
        if importlib.util.find_spec(package[sink]) is None:
            raise UserError(f"logging.report_to includes '{sink}' but it is not installed: pip install 'rlhfkit[{sink}]'")


def to_float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)
