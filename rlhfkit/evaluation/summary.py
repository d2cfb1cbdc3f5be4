"""What `rlhfkit eval` prints and returns: the console table of eval.json's figures, and the headline figures."""

from __future__ import annotations

from rlhfkit.evaluation.agent import gate_lines
from rlhfkit.evaluation.red_team import summary_lines


def headline(report: dict) -> dict[str, float]:
    """The figures `Evaluator.fit()` returns: "kl", and per judge "reward/<judge>" (the policy's mean),
    "win_rate/<judge>" and "rm_accuracy/<judge>", with tools "agent/format_accuracy", "agent/task_completion" and
    "gate/passed" (1.0 or 0.0; absent when undecided), and with red-teaming "red_team/<side>_harmful_rate". (No "eval/" prefix: the table printed them already, so the CLI's
    closing line does not repeat them.)"""
    out = {"kl": report["kl"]["mean"]} if report["kl"] is not None else {}
    policy = report["policy"] or {"reward": {}}  # (None: red-teaming alone, no held-out samples)
    out.update({f"reward/{name}": r["mean"] for name, r in policy["reward"].items() if r["mean"] is not None})
    out.update({f"win_rate/{name}": w for name, w in report["win_rate"].items() if w is not None})
    out.update({f"rm_accuracy/{name}": a for name, a in report["reward_model_accuracy"].items()})
    if report.get("alignment_tax"):
        out["alignment_tax/delta_nats"] = report["alignment_tax"]["delta_nats"]
    for name, value in ((report.get("agent") or {}).get("policy") or {}).items():
        if name in ("format_accuracy", "task_completion") and value is not None:
            out[f"agent/{name}"] = value
    if report.get("gate") and report["gate"]["passed"] is not None:
        out["gate/passed"] = float(report["gate"]["passed"])
    for side in ("policy", "reference"):
        if (figures := (report.get("red_team") or {}).get(side)) and figures["harmful_rate"] is not None:
            out[f"red_team/{side}_harmful_rate"] = figures["harmful_rate"]
    return out


def summary_table(report: dict) -> str:
    """A compact console table: policy | reference | win rate per figure, then RM accuracy and alarms."""
    pol, ref = report["policy"], report["reference"]

    def cell(v) -> str:
        return f"{'-':>12}" if v is None else f"{v:>12.4g}"

    kl = report["kl"] or {}
    rows = []
    if pol is not None:  # (None: red-teaming alone, no held-out samples)
        rows += [("KL(policy||ref) nats", kl.get("mean"), None, None), ("  std across samples", kl.get("std"), None, None),
                 ("length, tokens", pol["length"]["mean"], ref and ref["length"]["mean"], None)]
        rows += [(name, pol[key], ref and ref[key], None) for name, key in (
            ("distinct-1", "distinct_1"), ("distinct-2", "distinct_2"), ("words per response", "words_avg"),
            ("top response share", "top_share"), ("eos rate", "eos_rate"), ("truncation rate", "truncation_rate"),
            ("empty rate", "empty_rate"))]
        rows += [(f"reward: {name}", r["mean"], ref and ref["reward"][name]["mean"], report["win_rate"].get(name))
                 for name, r in pol["reward"].items()]
    rows += [(f"RM accuracy: {name}", a, None, None) for name, a in report["reward_model_accuracy"].items()]
    if tax := report.get("alignment_tax"):
        rows += [("capability NLL, nats/token", tax["policy_nll"], tax["reference_nll"], None),
                 ("  alignment tax, nats/token", tax["delta_nats"], None, None)]
    if agent := report.get("agent"):
        rows += [(label, agent["policy"][key], agent["reference"] and agent["reference"][key], None) for label, key in (
            ("format accuracy", "format_accuracy"), ("task completion", "task_completion"),
            ("tool calls / episode", "calls_per_episode"), ("  failed / call", "failures_per_call"),
            ("  malformed / call", "malformed_per_call"), ("turns / episode", "turns_per_episode"))]
    width = max((len(r[0]) for r in rows), default=0)
    lines = [f"{'':<{width}} {'policy':>12} {'reference':>12} {'win rate':>12}"] if rows else []
    lines += [f"{name:<{width}} {cell(p)} {cell(r)} {cell(w)}" for name, p, r, w in rows]
    lines += summary_lines(report["red_team"]) if report.get("red_team") else []
    lines += gate_lines(report["gate"]) if report.get("gate") else []
    lines += [f"alarm {a['name']}: {a['message']}" for a in report["alarms"]] or ["alarms: none"]
    return "\n".join(lines)
