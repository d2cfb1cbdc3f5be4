"""Every stage from the CLI on its `configs/*_tiny.yaml` (a tiny random model, a toy task): the wall time of each
`rlhfkit <stage>` command, start-up included, and the figure that shows it learned, first logged value → last.

The reward model and the stages that need one start from this run's SFT model; the online stages score with their
config's Python reward (a vowel-fraction toy). Each command runs in its own process in a temporary directory, one
after another, as a user would run them.

    python bench/stages_tiny.py                     # every stage, about 5 minutes on 2 CPU cores
    python bench/stages_tiny.py --stages sft rm     # some of them (the docs' table is written only for all)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from results import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# stage -> (config, the metric that shows learning, how it is summarised, needs the SFT model)
STAGES = {
    "sft": ("sft_tiny", "loss", "first → last", False),
    "rm": ("rm_tiny", "eval/accuracy", "last", True),
    "dpo": ("dpo_tiny", "rewards/accuracies", "last", False),
    "ipo": ("ipo_tiny", "rewards/accuracies", "last", False),
    "simpo": ("simpo_tiny", "rewards/accuracies", "last", False),
    "orpo": ("orpo_tiny", "rewards/accuracies", "last", False),
    "kto": ("kto_tiny", "rewards/accuracies", "last", False),
    "ppo": ("ppo_tiny", "objective/scores", "first → mean of the last 10", False),
    "rloo": ("rloo_tiny", "objective/scores", "first → mean of the last 10", False),
    "grpo": ("grpo_tiny", "objective/scores", "first → mean of the last 10", False),
    "reinforce_pp": ("reinforce_pp_tiny", "objective/scores", "first → mean of the last 10", False),
    "online_dpo": ("online_dpo_tiny", "objective/scores", "first → mean of the last 10", False),
    "rft": ("rft_tiny", "rft/mean_score_all", "first → last", False),
}
COMMAND = {"ipo": "dpo", "simpo": "dpo"}  # recipes of another command


def summarise(values: list[float], how: str) -> str:
    if not values:
        return "not logged"
    if how == "last":
        return f"{values[-1]:.3f}"
    if how == "first → last":
        return f"{values[0]:.3f} → {values[-1]:.3f}"
    return f"{values[0]:.3f} → {statistics.mean(values[-10:]):.3f}"


def run(stage: str, workdir: str) -> list:
    config, metric, how, from_sft = STAGES[stage]
    out = os.path.join(workdir, stage)
    cmd = [sys.executable, "-m", "rlhfkit.cli", COMMAND.get(stage, stage), "--config", f"configs/{config}.yaml",
           f"output_dir={out}", "logging.progress_bar=false"]
    cmd += [f"model.name_or_path={os.path.join(workdir, 'sft')}"] if from_sft else []
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        values = [row[metric] for row in map(json.loads, f) if row.get(metric) is not None]
    print(f"{stage:<13} {seconds:6.1f} s  {metric} {summarise(values, how)}", flush=True)
    return [f"`rlhfkit {COMMAND.get(stage, stage)} --config configs/{config}.yaml`", f"{seconds:.0f} s",
            f"`{metric}` {how}: {summarise(values, how)}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    args = parser.parse_args()
    stages = ["sft"] + [s for s in args.stages if s != "sft"] if any(STAGES[s][3] for s in args.stages) else args.stages
    with tempfile.TemporaryDirectory() as workdir:
        rows = [run(stage, workdir) for stage in stages]
    if stages == list(STAGES):
        record("stages_tiny", "Every stage on the tiny model", ["command", "wall time", "learning"], rows,
               command="python bench/stages_tiny.py",
               notes=["The tiny model is random: these show that each stage learns its toy task, not model quality. "
                      "Wall time includes start-up; the reward model starts from the SFT run's model."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
