"""A run's report: one self-contained HTML file (figures embedded as base64 PNGs) to read, mail or archive.

It holds the resolved config, the dashboard and any extra figures, tables (final metrics, `eval.json`, whatever the
caller passes) and sample generations before and after training, side by side with their scores. Every piece of
text is HTML-escaped: generations are untrusted model output.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
from itertools import zip_longest

from rlhfkit.errors import UserError
from rlhfkit.evaluation.dashboard import (
    metric_series, read_config, read_metrics, run_title, write_dashboard,
)
from rlhfkit.io import atomic_write_bytes, read_jsonl_rows

logger = logging.getLogger("rlhfkit")
MAX_SAMPLES = 8  # sample pairs shown

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; max-width: 28em; font-family: ui-monospace, monospace; font-size: 0.9em; }
pre { background: #f7f7f7; padding: 1em; overflow: auto; font-size: 0.85em; }
img { max-width: 100%; }
"""


def write_report(run_dir: str, extra: dict | None = None, out_path: str | None = None) -> str:
    """Write `out_path` (default `run_dir/report.html`) and return its path.

    `extra` may hold `"tables"`: {title: [row dict, ...]}, `"figures"`: [PNG paths] and `"samples"`: [{"prompt",
    "before", "before_score", "after", "after_score"}] (which replace the ones read from samples.jsonl). The
    `dashboard.png` lying beside `out_path`, if any, is the first figure.
    """
    if not os.path.isdir(run_dir):
        raise UserError(f"run directory '{run_dir}' does not exist")
    extra = extra or {}
    out_path = out_path or os.path.join(run_dir, "report.html")
    config = read_config(run_dir)
    title = run_title(run_dir, config)
    parts = [f"<h1>{_esc(title)}</h1>", f"<p>Run directory: <code>{_esc(os.path.abspath(run_dir))}</code></p>"]

    dashboard = os.path.join(os.path.dirname(out_path) or ".", "dashboard.png")
    figures = ([dashboard] if os.path.isfile(dashboard) else []) + list(extra.get("figures", []))
    if figures:
        parts.append("<h2>Figures</h2>")
        parts += [_image(path) for path in figures]

    tables = {}
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        tables["Final metrics"] = [{"metric": k, "value": values[-1], "step": steps[-1]}
                                   for k, (steps, values) in metric_series(read_metrics(run_dir)).items()]
    plan_path = os.path.join(run_dir, "plan.json")  # `rlhfkit plan`'s plan of the run, its measured peak beside it
    if os.path.isfile(plan_path):
        tables["Memory: planned and measured (plan.json)"] = _plan_rows(plan_path)
    eval_path = os.path.join(run_dir, "eval.json")
    if os.path.isfile(eval_path):
        with open(eval_path, encoding="utf-8") as f:
            evaluation = json.load(f)
        red_team = evaluation.pop("red_team", None)
        agent, gate = evaluation.pop("agent", None), evaluation.pop("gate", None)
        tables["Evaluation (eval.json)"] = _rows(evaluation)
        tables.update(_red_team_tables(red_team) if red_team else {})
        tables.update(_agent_tables(agent, gate) if agent else {})
    human_path = os.path.join(run_dir, "human_eval.json")  # `rlhfkit label --result`: the blind human comparison
    if os.path.isfile(human_path):
        with open(human_path, encoding="utf-8") as f:
            tables["Blind human evaluation (human_eval.json)"] = _rows(json.load(f))
    tables.update(extra.get("tables", {}))
    for name, rows in tables.items():
        if rows:
            parts += [f"<h2>{_esc(name)}</h2>", _table(rows)]

    heading, samples = _samples(run_dir, extra)
    if samples:
        parts += [f"<h2>{_esc(heading)}</h2>", _samples_table(samples)]

    config_text = "(no config.yaml in the run directory)"
    if os.path.isfile(os.path.join(run_dir, "config.yaml")):
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            config_text = f.read()
    parts += ["<h2>Resolved config</h2>", f"<pre>{_esc(config_text)}</pre>"]

    page = (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{_esc(title)}</title>\n"
            f"<style>{STYLE}</style>\n</head>\n<body>\n" + "\n".join(parts) + "\n</body>\n</html>\n")
    atomic_write_bytes(out_path, page.encode("utf-8"))
    return out_path


def write_run_artifacts(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write `dashboard.png` and `report.html` (into `out_dir`, default `run_dir`); return the paths written.

    Called at the end of every run, after the model is saved: it never raises — a run with nothing logged, or a
    figure that fails to draw, costs a warning, not the run.
    """
    out_dir = out_dir or run_dir
    written = []
    for name, write in (("dashboard.png", write_dashboard), ("report.html", write_report)):
        try:
            written.append(write(run_dir, out_path=os.path.join(out_dir, name)))
        except Exception as exc:  # noqa: BLE001 - see the docstring: artifacts are never worth a failed run
            logger.warning(f"could not write {os.path.join(out_dir, name)}: {exc}")
    return written


# Pieces ---------------------------------------------------------------------------------------------------------


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _image(path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(os.path.basename(path))}"></figure>'


def _rows(obj) -> list[dict]:
    """Rows of a JSON value: a list of records as is, {name: record} with a "name" column, {key: value} as pairs."""
    if isinstance(obj, list):
        return [r if isinstance(r, dict) else {"value": r} for r in obj]
    if isinstance(obj, dict) and obj and all(isinstance(v, dict) for v in obj.values()):
        return [{"name": k, **v} for k, v in obj.items()]
    if isinstance(obj, dict):
        return [{"metric": k, "value": v} for k, v in obj.items()]
    return [{"value": obj}]


def _plan_rows(path: str) -> list[dict]:
    """The planned peak per phase and the measured figures of a run's plan.json, in GB per process."""
    with open(path, encoding="utf-8") as f:
        plan = json.load(f)
    rows = [{"figure": f"planned peak, {name}", "GB": phase["peak_gb"]} for name, phase in plan.get("phases", {}).items()]
    rows.append({"figure": "planned peak", "GB": plan.get("peak_gb")})
    rows += [{"figure": key.split("/")[1].replace("_gb", "").replace("_", " "), "GB": value}
             for key, value in (plan.get("measured") or {}).items() if key != "memory/planned_peak_gb"]
    return rows


def _agent_tables(agent: dict, gate: dict | None) -> dict[str, list[dict]]:
    """eval.json's `agent` section (`evaluation.agent`) as a table of each side's figures, and its `gate` as a table
    of the two thresholds and the verdict."""
    sides = {side: agent[side] for side in ("policy", "reference") if agent.get(side)}
    tables = {"Agent figures (eval.json)": [{"figure": name, **{side: figures[name] for side, figures in sides.items()}}
                                             for name in agent["policy"]]}
    if gate:
        rows = [{"figure": name, **gate[name]} for name in ("format_accuracy", "task_completion")]
        verdict = {True: "passed", False: "not passed", None: "undecided"}[gate["passed"]]
        tables[f"Gate before reward modelling: {verdict}"] = rows
    return tables


def _red_team_tables(section: dict) -> dict[str, list[dict]]:
    """eval.json's `red_team` section (`evaluation.red_team`) as tables: each side's harmful and refusal rates, the
    alarm, the responses that got worse (model output: escaped like every cell) and the human flags."""
    tables = {}
    rows = []
    for side in ("policy", "reference"):
        if s := section.get(side):
            lo, hi = s["harmful_interval"]
            rows.append({"model": side, "responses": s["responses"], "judged": s["judged"], "harmful": s["harmful"],
                         "harmful rate": s["harmful_rate"], "95% interval": f"[{lo:.3g}, {hi:.3g}]",
                         "refusals": s["refusals"], "refusal rate": s["refusal_rate"]})
    if rows:
        judge = f"judge: {section.get('judge')}, threshold {section.get('threshold')}"
        tables[f"Red-teaming ({section.get('num_prompts')} prompts; {judge})"] = rows
    if alarm := section.get("alarm"):
        tables["Red-team alarm"] = [{"fired": alarm["fired"], "intervals overlap": alarm["intervals_overlap"],
                                     "rule": alarm["rule"]}]
    if worse := section.get("worse"):
        title = f"Red-team responses that got worse ({worse['count']}; {worse['better_count']} got better)"
        tables[title] = [{"prompt": w["prompt"], "reference": w["reference"], "harmfulness": w["reference_harmfulness"],
                          "policy": w["policy"], "policy harmfulness": w["policy_harmfulness"]} for w in worse["prompts"]]
    human = section.get("human") or {}
    tables["Human red-team flags"] = [{"model": side, **h} for side, h in human.items() if side != "unmatched" and h]
    if human.get("unmatched"):
        other = ", ".join(f"{m} ({n} rows)" for m, n in human["unmatched"].items())
        tables["Human red-team flags"].append({"model": f"neither side: {other}"})
    return tables


def _table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))  # union of keys, in first-seen order
    head = "".join(f"<th>{_esc(c)}</th>" for c in columns)
    body = []
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "-")
            v = json.dumps(v) if isinstance(v, (dict, list)) else v
            cls = ' class="num"' if isinstance(v, (int, float)) and not isinstance(v, bool) else ""
            cells.append(f"<td{cls}>{_esc(_fmt(v))}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table>\n<tr>{head}</tr>\n" + "\n".join(body) + "\n</table>"


def _samples(run_dir: str, extra: dict) -> tuple[str, list[dict]]:
    """Before/after pairs: the caller's, or samples.jsonl's first logged step vs its last (training samples: the
    held-out evaluation's, marked `"split": "eval"`, are left out).

    When both steps sampled the same prompts, each prompt's responses are paired; otherwise the first rows of the
    first step face the first rows of the last step, each under its own prompt.
    """
    if "samples" in extra:
        return "Samples: before vs after training", extra["samples"][:MAX_SAMPLES]
    path = os.path.join(run_dir, "samples.jsonl")
    if not os.path.isfile(path):
        return "", []
    rows = [r for r in read_jsonl_rows(path) if r.get("split") != "eval"]
    if not rows:
        return "", []
    first, last = rows[0]["step"], rows[-1]["step"]
    before = [r for r in rows if r["step"] == first]
    after = [r for r in rows if r["step"] == last] if last != first else []
    if after and sorted(r["prompt"] for r in before) == sorted(r["prompt"] for r in after):
        order = [r["prompt"] for r in before]
        after.sort(key=lambda r: order.index(r["prompt"]))  # a stable sort: repeated prompts keep their order
    pairs = []
    for b, a in list(zip_longest(before, after, fillvalue={}))[:MAX_SAMPLES]:
        prompts = [p for p in dict.fromkeys((b.get("prompt"), a.get("prompt"))) if p is not None]
        pairs.append({"prompt": prompts[0] if len(prompts) == 1 else prompts,
                      "before": b.get("response", "-"), "before_score": b.get("score", "-"),
                      "after": a.get("response", "-"), "after_score": a.get("score", "-")})
    return f"Samples: step {first} (before) vs step {last} (after)", pairs


def _samples_table(samples: list[dict]) -> str:
    head = "<tr><th>prompt</th><th>before</th><th>score</th><th>after</th><th>score</th></tr>"
    body = []
    for s in samples:
        prompt = s.get("prompt", "-")
        # Different prompts before and after: show both, the before one first.
        prompt_html = "<hr>".join(_esc(p) for p in prompt) if isinstance(prompt, list) else _esc(prompt)
        body.append(f'<tr><td class="text">{prompt_html}</td>'
                    f'<td class="text">{_esc(s.get("before", "-"))}</td><td class="num">{_esc(_fmt(s.get("before_score", "-")))}</td>'
                    f'<td class="text">{_esc(s.get("after", "-"))}</td><td class="num">{_esc(_fmt(s.get("after_score", "-")))}</td></tr>')
    return f"<table>\n{head}\n" + "\n".join(body) + "\n</table>"
