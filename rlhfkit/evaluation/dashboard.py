"""Training dashboards: one PNG of a run's curves, and the gold-reward vs KL frontier of several methods.

Reads only what every run writes (`config.yaml`, `metrics.jsonl`), so it works on a finished run, a crashed one or
a copy on another machine. Figures are drawn on a bare `matplotlib.figure.Figure` (the Agg renderer, never pyplot),
so no display and no global figure state are involved, and written atomically.
"""

from __future__ import annotations

import io
import logging
import math
import os

import yaml

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_bytes, read_jsonl_rows

logger = logging.getLogger("rlhfkit")

# (panel title, metrics drawn on it, metric on a twin y axis). A panel appears when any of its metrics was logged;
# online runs log the `objective/`, `policy/` and `loss/*_avg` names, offline ones `loss`, `accuracy`, ..., so one
# list serves both. Eval rows ("eval/...") are drawn beside their training curve.
PANELS = [
    ("Reward", ["objective/scores", "objective/gold", "rft/mean_score_all", "rft/mean_score_best"], None),
    ("KL", ["objective/kl"], "objective/kl_coef"),
    ("Clip fraction", ["policy/clipfrac_avg"], None),
    ("Value loss", ["loss/value_avg"], None),
    ("Policy loss", ["loss/policy_avg"], None),
    ("Loss", ["loss", "eval/loss"], None),
    ("Accuracy", ["rewards/accuracies", "eval/rewards/accuracies", "accuracy", "eval/accuracy"], None),
    ("Margin", ["rewards/margins", "eval/rewards/margins", "margin", "eval/margin"], None),
    ("Learning rate", ["lr"], None),
]

# The stage is not stored in config.yaml; each stage's `algo` section has a key no stage after it in this list has
# (online `algo` has `algorithm`, read first; DPO and KTO also have ORPO's `beta`, so they come before it).
STAGE_KEYS = [("loss_type", "dpo"), ("desirable_weight", "kto"), ("beta", "orpo"), ("iterations", "rft"),
              ("margin_scale", "rm"), ("completion_only", "sft")]


def read_metrics(run_dir: str) -> list[dict]:
    """The rows of `run_dir/metrics.jsonl`; a missing directory or file is a `UserError`.

    A line that is not JSON (the half-written last line of a killed run) is skipped with a warning.
    """
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory '{run_dir}' does not exist")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"'{run_dir}' has no metrics.jsonl: not an rlhfkit run directory, or the run logged nothing")
    return read_jsonl_rows(path)


def read_config(run_dir: str) -> dict:
    """The resolved config the run saved (`{}` if it has none)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def run_title(run_dir: str, config: dict) -> str:
    """"<run name> · <stage>": the run name is `logging.run_name` or the directory's name, as in TensorBoard/W&B."""
    name = (config.get("logging") or {}).get("run_name") or os.path.basename(os.path.abspath(run_dir))
    algo = config.get("algo") or {}
    stage = algo.get("algorithm") or next((s for key, s in STAGE_KEYS if key in algo), None)
    return f"{name} · {stage}" if stage else name


def metric_series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """metric -> (steps, values), in logged order; training and eval rows of one step are separate rows.

    A null (how metrics.jsonl writes a non-finite value, e.g. the loss of a skipped step) becomes NaN: a gap in the
    curve, not a point joined across."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and (value is None or isinstance(value, (int, float))):
                steps, values = series.setdefault(key, ([], []))
                steps.append(row.get("step", len(steps)))
                values.append(math.nan if value is None else float(value))
    return series


def write_dashboard(run_dir: str, out_path: str | None = None) -> str:
    """Draw one panel per logged metric of `PANELS` into `out_path` (default `run_dir/dashboard.png`); return the path."""
    series = metric_series(read_metrics(run_dir))
    panels = [(title, [k for k in keys if k in series], twin if twin in series else None)
              for title, keys, twin in PANELS if any(k in series for k in keys)]
    if not panels:
        raise UserError(f"'{run_dir}/metrics.jsonl' holds none of the metrics the dashboard draws "
                        f"({', '.join(k for _, keys, _ in PANELS for k in keys)})")
    from matplotlib.figure import Figure

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    height = 3.2 * nrows + 0.6
    fig = Figure(figsize=(5.2 * ncols, height))
    fig.suptitle(run_title(run_dir, read_config(run_dir)), fontsize=13)
    # Fixed margins, in inches, rather than constrained layout: it halves the drawing time of a dashboard.
    fig.subplots_adjust(left=0.8 / (5.2 * ncols), right=1 - 0.7 / (5.2 * ncols), top=1 - 0.7 / height,
                        bottom=0.5 / height, wspace=0.35, hspace=0.45)
    axes = fig.subplots(nrows, ncols, squeeze=False).flatten()
    for ax, (title, keys, twin) in zip(axes, panels):
        lines = [_plot(ax, series, key) for key in keys]
        if twin:
            lines.append(_plot(ax.twinx(), series, twin, color="tab:gray", linestyle="--"))
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(handles=lines, fontsize=8)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return save_figure(fig, out_path or os.path.join(run_dir, "dashboard.png"))


def _plot(ax, series: dict, key: str, **style):
    steps, values = series[key]
    # Markers keep a run of a few logged steps (or a lone eval row) visible; long curves read better without them.
    (line,) = ax.plot(steps, values, label=key, marker="o" if len(steps) <= 20 else None, markersize=3, **style)
    return line


def frontier_figure(points: dict[str, list[tuple[float, float]]]):
    """The gold reward vs KL(π‖π_ref) picture of the DPO paper (Rafailov et al. 2023, arXiv 2305.18290, Fig. 2 left):
    one curve per method (one point per run or checkpoint, sorted by KL), one legend entry per method."""
    if not points or not all(points.values()):
        raise ValueError("frontier plot needs at least one (kl, gold_reward) point for every method")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.5), layout="constrained")
    ax = fig.subplots()
    for method, pts in points.items():
        kl, gold = zip(*sorted(pts))
        ax.plot(kl, gold, marker="o", label=method)
    ax.set_xlabel("KL(π ‖ π_ref)")
    ax.set_ylabel("gold reward")
    ax.set_title("Reward vs KL frontier")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def write_frontier_plot(points: dict[str, list[tuple[float, float]]], out_path: str) -> str:
    """Write `frontier_figure(points)` as a PNG at `out_path`; return the path."""
    return save_figure(frontier_figure(points), out_path)


def save_figure(fig, path: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    atomic_write_bytes(path, buf.getvalue())
    return path


