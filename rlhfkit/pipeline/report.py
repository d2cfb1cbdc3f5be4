"""The pipeline's one report, `report.html` at its root: every stage with its status and headline figure, the gates
(passed, failed, skipped with their stage), the rounds and their rollbacks, the wiring, links to each stage's own
report, and the reward-vs-KL frontier: each online stage's training trajectory (objective/kl against
objective/scores, one point per logged step) and each evaluated policy (its KL to the reference against its first
judge's mean reward), and the points a stage wrote to its `frontier_points.json` ({label: [[kl, reward], ...]}).
Text is escaped; links are relative, so the folder can be moved or archived whole."""

from __future__ import annotations

import html
import json
import logging
import os

from rlhfkit.io import atomic_write_text, read_jsonl_rows

logger = logging.getLogger("rlhfkit")

# The figure a stage's row shows first, by stage kind (the first of these it reported).
HEADLINE = {
    "sft": ("eval/loss", "loss"),
    "rm": ("eval/accuracy", "accuracy"),
    "eval": ("win_rate/*", "reward/*", "agent/task_completion", "alignment_tax/delta_nats"),
    "label": ("human/win_rate", "labels/pairs"),
}
ONLINE_HEADLINE = ("objective/scores", "objective/kl", "loss")
STYLE = """body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; } th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; }
th { background: #f3f3f3; } .failed { color: #b00; font-weight: bold; } .passed { color: #070; }
img { max-width: 100%; }"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def headline(stage: str, figures: dict) -> str:
    import fnmatch

    for pattern in HEADLINE.get(stage, ONLINE_HEADLINE):
        names = sorted(k for k in figures if fnmatch.fnmatchcase(k, pattern))
        if names:
            return ", ".join(f"{n} {figures[n]:.4g}" for n in names[:3])
    return "-"


def frontier_points(result) -> dict[str, list[tuple[float, float]]]:
    """Reward against KL: each online stage's logged steps, each evaluated policy's point."""
    points: dict[str, list[tuple[float, float]]] = {}
    for s in result.stages:
        metrics = os.path.join(s.dir, "metrics.jsonl")
        if s.stage != "eval" and os.path.isfile(metrics):
            rows = [r for r in read_jsonl_rows(metrics) if "objective/kl" in r and "objective/scores" in r]
            if rows:
                points[f"{s.name} (training)"] = [(r["objective/kl"], r["objective/scores"]) for r in rows]
        given = os.path.join(s.dir, "frontier_points.json")  # a stage's own points (the demo's methods, gold-judged)
        if os.path.isfile(given):
            with open(given, encoding="utf-8") as f:
                points.update({f"{s.name}: {m}": [tuple(p) for p in pts] for m, pts in json.load(f).items()})
        rewards = sorted(k for k in s.figures if k.startswith("reward/"))
        if s.stage == "eval" and "kl" in s.figures and rewards:
            points[f"{s.name}: {rewards[0]}"] = [(s.figures["kl"], s.figures[rewards[0]])]
    return points


def _frontier(result) -> str:
    points = frontier_points(result)
    if not points:
        return "<p>No reward-vs-KL points: the pipeline has no online stage or evaluated policy yet.</p>"
    from rlhfkit.evaluation.dashboard import frontier_figure, save_figure

    fig = frontier_figure(points)
    fig.axes[0].set_ylabel("mean reward (training: objective/scores; eval: its first judge)")
    save_figure(fig, os.path.join(result.output_dir, "frontier.png"))
    return '<p><img src="frontier.png" alt="reward vs KL frontier"></p>'


def _link(result, folder: str) -> str:
    for name in ("report.html", "eval.json", "human_win_rate.json", "pairs.jsonl", "metrics.jsonl"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            rel = os.path.relpath(path, result.output_dir)
            return f'<a href="{_esc(rel)}">{_esc(rel)}</a>'
    return _esc(os.path.relpath(folder, result.output_dir))


def _stage_rows(result) -> str:
    rows = []
    for s in result.stages:
        gate = "; ".join(f'<span class="{"passed" if v["passed"] else "failed"}">{_esc(v["figure"])} '
                         f'{"n/a" if v["value"] is None else format(v["value"], ".4g")} ({_esc(v["condition"])}): '
                         f'{"passed" if v["passed"] else "FAILED"}</span>' for v in s.gate) or "none"
        rows.append(f"<tr><td>{_esc(s.name)}</td><td>{_esc(s.stage)}</td><td>{_esc(s.status)}</td>"
                    f"<td>{_esc(headline(s.stage, s.figures))}</td><td>{gate}</td><td>{_link(result, s.dir)}</td>"
                    f"<td>{s.seconds:.1f}</td></tr>")
    head = "<tr><th>stage</th><th>kind</th><th>status</th><th>headline</th><th>gate</th><th>report</th><th>s</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


def _rounds(result) -> str:
    if not result.rounds:
        return ""
    rows = "".join(
        f"<tr><td>{r['round']}</td><td>{_esc(r.get('policy'))}</td><td>"
        f"{'-' if r.get('capability_loss_nats') is None else format(r['capability_loss_nats'], '+.4f')}</td><td>"
        + (f'<span class="failed">rolled back: the next round starts from {_esc(r.get("restored"))}</span>'
           if r.get("rolled_back") else "kept") + "</td></tr>" for r in result.rounds)
    return ("<h2>Rounds</h2><table><tr><th>round</th><th>policy</th><th>capability loss (nats/token)</th>"
            f"<th>outcome</th></tr>{rows}</table>")


def write_pipeline_report(result) -> str:
    failed = result.failed_gates
    summary = (f'<p class="failed">{len(failed)} gate figure(s) failed: ' + "; ".join(
        f"{_esc(v['stage'])}: {_esc(v['figure'])} needs {_esc(v['condition'])}. The seeds suggest: "
        f"{_esc(v['suggestion'])}" for v in failed) + "</p>") if failed else '<p class="passed">Every gate passed.</p>'
    wiring = "".join(f"<li>{_esc(s.name)}: {_esc(w)}</li>" for s in result.stages for w in s.wires
                     if not w.startswith("output_dir"))
    parts = [f"<!doctype html><meta charset='utf-8'><title>pipeline report</title><style>{STYLE}</style>",
             f"<h1>Pipeline: {_esc(os.path.abspath(result.output_dir))}</h1>", summary,
             "<h2>Stages</h2>", _stage_rows(result), _rounds(result),
             "<h2>Reward vs KL</h2>", _frontier(result), f"<h2>Wiring</h2><ul>{wiring or '<li>none</li>'}</ul>"]
    path = os.path.join(result.output_dir, "report.html")
    atomic_write_text(path, "\n".join(parts) + "\n")
    return path
