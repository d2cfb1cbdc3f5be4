"""Metric sinks beside metrics.jsonl: W&B, TensorBoard and trackio, each an optional extra
(`pip install 'rlhfkit[wandb]'`, `[tensorboard]`, `[trackio]`).

Every sink takes the same three calls — `log(step, metrics)`, `log_samples(step, rows)` (sampled completions, one
dict per row) and `close()` — and is built from the run's resolved config, which it attaches to the run the way its
ecosystem expects: W&B's run config, TensorBoard's hparams, trackio's run config. `build_sinks` makes them for the
main process only; `check_trackers` refuses an unknown or uninstalled tracker before any model loads.

Samples go under the key "samples", the held-out completions (rows marked "split": "eval") under "eval/samples" beside
the eval/ figures (`samples_key`): both are logged at an eval step, and a W&B history row keeps one value per key.
A resumed run (resume=true) continues its W&B run — the id its first start kept in output_dir/wandb/ (`WANDB_ID_FILE`)
— and its trackio run (the latest of its name); a new run, overwrite=true included, starts new ones.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Any, Protocol

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text

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


def samples_key(rows: list[dict]) -> str:
    """"eval/samples" for held-out completions (every row marked "split": "eval", `rlhfkit.trainers.held_out`), else
    "samples": the two are logged at the same step and must not share a key."""
    return "eval/samples" if rows and all(row.get("split") == "eval" for row in rows) else "samples"


def _columns(rows: list[dict]) -> list[str]:
    """Every key of `rows`, in the order first seen."""
    return list(dict.fromkeys(k for row in rows for k in row))


WANDB_ID_FILE = os.path.join("wandb", "rlhfkit-run-id")  # under output_dir: the id of the run's W&B run


class WandbSink:
    """A W&B run: `project` is the W&B project, `name` the run's display name, `config` the run's config.
    Samples go in as a `wandb.Table` under the key `samples_key(rows)`, one table per call.

    `resume`: this is a resumed run, which continues the W&B run of its first start — the id kept in
    `directory/WANDB_ID_FILE`, passed with resume="allow" as transformers' WandbCallback users pass WANDB_RUN_ID — so
    that one output_dir is one W&B run. Otherwise (or with no id kept) W&B makes a new id, which is kept. A
    WANDB_RUN_ID in the environment wins, as in W&B."""

    def __init__(self, project: str, name: str, config: dict, directory: str, resume: bool = False):
        import wandb

        os.makedirs(directory, exist_ok=True)
        self.wandb = wandb
        id_file = os.path.join(directory, WANDB_ID_FILE)
        kept = None
        if resume and not os.environ.get("WANDB_RUN_ID") and os.path.isfile(id_file):
            with open(id_file, encoding="utf-8") as f:
                kept = f.read().strip() or None
        continued = {"id": kept, "resume": "allow"} if kept else {}
        self.run = wandb.init(project=project, name=name, config=config, dir=directory, **continued)
        atomic_write_text(id_file, self.run.id + "\n")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({samples_key(rows): table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """An event file in `log_dir`: metrics as scalars, samples as a markdown table under the text tag
    `samples_key(rows)` ("samples", "eval/samples"), and the config as hparams (the HParams dashboard) and as YAML
    text under "config"."""

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
        self.writer.add_text(samples_key(rows), "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class TrackioSink:
    """A trackio run in its local store (the directory in the TRACKIO_DIR environment variable, else trackio's
    default): metrics, the config as the run's config, samples as a `trackio.Table` under `samples_key(rows)`.

    `resume`: this is a resumed run, which continues the latest trackio run named `name` in `project` (trackio's
    resume="allow"; trackio resumes by name only). Otherwise a new run is made, even beside one of the same name."""

    def __init__(self, project: str, name: str, config: dict, resume: bool = False):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=project, name=name, config=config, embed=False, auto_log_gpu=False,
                                auto_log_cpu=False, resume="allow" if resume else "never")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = _columns(rows)
        table = self.trackio.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({samples_key(rows): table}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_sinks(report_to: list[str], config: dict, *, project: str, run_name: str, output_dir: str,
                is_main: bool) -> list[Sink]:
    """The sinks `report_to` names, for the main process (the others log nothing: an empty list).

    `config` is the resolved config (`run_config`); `project` the W&B and trackio project; `run_name` the run's name
    in each tracker. W&B keeps its offline files under `output_dir/wandb/`, TensorBoard its event file under
    `output_dir/runs/<run_name>/` (a resumed run appends a new event file there); trackio writes to its own store
    (TRACKIO_DIR). `config["resume"]` true: W&B and trackio continue the run's earlier tracker runs.
    """
    check_trackers(report_to)
    if not is_main:
        return []
    sinks: list[Sink] = []
    resume = bool(config.get("resume"))
    for name in report_to:
        if name == "wandb":
            sinks.append(WandbSink(project, run_name, config, output_dir, resume=resume))
        elif name == "tensorboard":
            sinks.append(TensorBoardSink(os.path.join(output_dir, "runs", run_name), config))
        else:
            sinks.append(TrackioSink(project, run_name, config, resume=resume))
    return sinks
