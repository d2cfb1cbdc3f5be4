"""The agent demo's held-out evaluation over seeds as the docs' table: reads `eval.json` of finished `rlhfkit demo
--agent --seed N` runs and writes docs/results/agent_demo.json and .md (bench/results.py), each figure as the mean ±
sample standard deviation over the runs, with every seed's own figure beside it.

    for s in 0 1 2; do rlhfkit demo --agent --seed $s --output-dir runs/agent$s; done
    python bench/agent_results.py runs/agent0 runs/agent1 runs/agent2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from results import record

NAMES = {"sft": "SFT", "grpo": "GRPO", "grpo_no_tools": "GRPO, without tools"}
FIGURES = (("task completion", "task_completion", True), ("format accuracy", "format_accuracy", True),
           ("calls per episode", "calls_per_episode", False), ("turns per episode", "turns_per_episode", False))


def cell(values: list[float], percent: bool) -> str:
    """"mean ± sd (each run's)", in percent or plain; one run: its value alone."""
    show = (lambda v: f"{v * 100:.1f}%") if percent else (lambda v: f"{v:.2f}")  # noqa: E731
    if len(values) == 1:
        return show(values[0])
    sd = statistics.stdev(values)
    spread = f"{sd * 100:.1f}" if percent else f"{sd:.2f}"
    return f"{show(statistics.mean(values))} ± {spread} ({', '.join(show(v) for v in values)})"


def rows(results: list[dict]) -> list[list[str]]:
    """One row per method: each figure over the runs."""
    return [[NAMES.get(m, m), *(cell([r["methods"][m][key] for r in results], pct) for _, key, pct in FIGURES)]
            for m in results[0]["methods"]]


def stage_seconds(run: str) -> dict[str, float | None]:
    """Each stage's wall seconds in this run, from the pipeline's record (`pipeline.json`, written by
    `rlhfkit.pipeline`); None for a stage skipped because an earlier command had done it."""
    with open(os.path.join(run, "pipeline.json"), encoding="utf-8") as f:
        records = json.load(f)["records"]
    return {r["name"]: (None if r["status"] == "skipped" else r["seconds"]) for r in records}


def wall_minutes(seconds: dict[str, float | None]) -> str:
    """"prompts 0.0, sft 21.0, ..., total 37.2" in minutes; the stages an earlier command ran are named apart."""
    ran = {k: v for k, v in seconds.items() if v is not None}
    text = ", ".join(f"{k} {v / 60:.1f}" for k, v in ran.items()) + f", total {sum(ran.values()) / 60:.1f}"
    skipped = [k for k, v in seconds.items() if v is None]
    return text + (f" ({', '.join(skipped)} done by an earlier command)" if skipped else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="agent demo --output-dirs, each holding eval/eval.json")
    args = parser.parse_args()
    results = []
    for run in args.runs:
        with open(os.path.join(run, "eval", "eval.json"), encoding="utf-8") as f:
            results.append(json.load(f))
    if any(r.get("quick") for r in results):
        sys.exit("agent_results: a --quick run (a tiny random model) is plumbing only")
    seeds = [r["seed"] for r in results]
    gain = [r["methods"]["grpo"]["task_completion"] - r["methods"]["sft"]["task_completion"] for r in results]
    passed = {k: sum(r["acceptance"][k] for r in results) for k in results[0]["acceptance"]}
    times = "; ".join(f"seed {r['seed']}: " + wall_minutes(stage_seconds(run)) for r, run in zip(results, args.runs))
    record("agent_demo", "`rlhfkit demo --agent`: held-out episodes, SFT against GRPO with and without the tool",
           ["model", *(name for name, _, _ in FIGURES)], rows(results),
           command=" && ".join(f"rlhfkit demo --agent --seed {s} --output-dir runs/agent{s}" for s in seeds)
           + " && python bench/agent_results.py " + " ".join(f"runs/agent{s}" for s in seeds),
           notes=[(f"Seeds {', '.join(map(str, seeds))}: mean ± sd (each seed's figure). " if len(seeds) > 1 else
                   f"One run, seed {seeds[0]}. ") + f"{results[0]['eval_prompts']} "
                  "held-out products of a 3-digit and a 2-digit number, greedy episodes through the tool loop.",
                  f"GRPO's task completion minus SFT's, in points: {cell([100 * g for g in gain], False)}.",
                  "Goal (issue 27): GRPO's task completion ≥ 80% and ≥ SFT's + 15 points, format accuracy ≥ 95%; runs "
                  "passing each: " + ", ".join(f"{k} {v}/{len(results)}" for k, v in passed.items()) + ".",
                  f"Wall time in minutes on a shared 2-core CPU, {times}."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
