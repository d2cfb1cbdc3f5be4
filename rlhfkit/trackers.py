"""Metric sinks beside metrics.jsonl: W&B, TensorBoard and trackio, each an optional extra
(`pip install 'rlhfkit[wandb]'`, `[tensorboard]`, `[trackio]`).

Every sink takes the same three calls — `log(step, metrics)`, `log_samples(step, rows)` (sampled completions, one
dict per row) and `close()` — and is built from the run's resolved config, which it attaches to the run the way its
ecosystem expects: W&B's run config, TensorBoard's hparams, trackio's run config. `build_sinks` makes them for the
main process only; `check_trackers` refuses an unknown or uninstalled tracker before any model loads.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any, Protocol

from rlhfkit.errors import UserError

TRACKERS = ("tensorboard", "wandb", "trackio")  # each is also the name of its extra and of the package it imports


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_samples(self, step: int, rows: list[dict]) -> None: ...

    def close(self) -> None: ...


def check_trackers(report_to: list[str]) -> None:
    """Refuse, in one line, a tracker rlhfkit does not know or whose package is not installed."""
    for name in report_to:
        if name not in TRACKERS:
            raise UserError(f"config key 'logging.report_to': unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        if importlib.util.find_spec(name) is None:
            raise UserError(f"config key 'logging.report_to' includes '{name}' but it is not installed: "
                            f"pip install 'rlhfkit[{name}]'")


def run_config(cfg: Any, stage: str) -> dict:
    """The resolved config as the trackers receive it: the nested sections, with the stage that ran them."""
    return {"stage": stage, **dataclasses.asdict(cfg)}


def flat_config(config: dict, prefix: str = "") -> dict[str, bool | int | float | str]:
    """`{"optim": {"lr": 1e-5}}` -> `{"optim.lr": 1e-5}`: scalars kept, None and lists as text (TensorBoard's hparams
    take only bool, number and string values)."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_config(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return flat


def _columns(rows: list[dict]) -> list[str]:
    """Every key of `rows`, in the order first seen."""
    return list(dict.fromkeys(k for row in rows for k in row))


class WandbSink:
    """A W&B run: `project` is the W&B project, `name` the run's display name, `config` the run's config.
    Samples go in as a `wandb.Table` under the key "samples", one table per call."""

    def __init__(self, project: str, name: str, config: dict, directory: str):
        import wandb

        os.makedirs(directory, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, config=config, dir=directory)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """An event file in `log_dir`: metrics as scalars, samples as a markdown table under the text tag "samples",
    and the config as hparams (the HParams dashboard) and as YAML text under "config"."""

    def __init__(self, log_dir: str, config: dict):
        import yaml
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=log_dir)
        # add_hparams would open a second event file in a subdirectory; these three summaries are what it writes there.
        writer = self.writer._get_file_writer()
        for summary in hparams(flat_config(config), {}):
            writer.add_summary(summary)
        self.writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)

        def cell(value: Any) -> str:  # one markdown table cell: pipes escaped, line breaks as <br>
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class TrackioSink:
    """A trackio run in its local store (the directory in the TRACKIO_DIR environment variable, else trackio's
    default): metrics, the config as the run's config, samples as a `trackio.Table` under "samples"."""

    def __init__(self, project: str, name: str, config: dict):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=name, config=config, embed=False, auto_log_gpu=False,
                                auto_log_cpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        table = self.trackio.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(report_to: list[str], config: dict, *, project: str, run_name: str, output_dir: str,
                is_main: bool) -> list[Sink]:
    """The sinks `report_to` names, for the main process (the others log nothing: an empty list).

    `config` is the resolved config (`run_config`); `project` the W&B and trackio project; `run_name` the run's name
    in each tracker. W&B keeps its offline files under `output_dir/wandb/`, TensorBoard its event file under
    `output_dir/runs/<run_name>/`; trackio writes to its own store (TRACKIO_DIR).
    """
    check_trackers(report_to)
    if not is_main:
        return []
    sinks: list[Sink] = []
    for name in report_to:
        if name == "wandb":
            sinks.append(WandbSink(project, run_name, config, output_dir))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(os.path.join(output_dir, "runs", run_name), config))
        else:
            sinks.append(TrackioSink(project, run_name, config))
    return sinks
