"""Which policy objective: GRPO runs of the tiny model on the toy task's rule-checked reward, one per (objective,
seed), the same config but `algo.policy_loss`, and their figures as the docs' table (docs/objectives.md).

The task (`configs/grpo_tiny.yaml`, `rlhfkit.tasks.toy:vowel_reward`): review prompts, reward = the share of the
response's characters that are vowels, computed by a rule (no learned judge). Each rollout takes 2 epochs of 2
minibatches, so three of its four updates are off-policy: that is where the objectives differ. Each run is
`rlhfkit grpo` in its own process; "held-out reward" is the mean reward on the 64 held-out prompts
(data/tiny/prompts_eval.jsonl) after the last step, sampled at the training temperature; "KL to start" is the
held-out sequence KL to the reference (the starting weights); entropy is the last training step's mean per-token
-log π of the sampled tokens; wall time is the run's own.

    python bench/objectives.py run --out runs/objectives            # every objective x seed (skips finished runs)
    python bench/objectives.py table --out runs/objectives          # docs/results/objectives.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OBJECTIVES = ("ppo_clip", "gspo", "gspo_token", "luspo", "cispo", "sapo", "gmpo", "dppo_binary_tv", "dppo_binary_kl",
              "clip_cov", "kl_cov", "vespo")
SEEDS = (0, 1, 2)


def overrides(args, objective: str, seed: int) -> list[str]:
    """The run's config: configs/grpo_tiny.yaml, the same for every objective but `algo.policy_loss`."""
    return ["--config", os.path.join(ROOT, "configs", "grpo_tiny.yaml"),
            f"data.train={os.path.join(ROOT, 'data', 'tiny', 'prompts_train.jsonl')}",
            f"data.eval={os.path.join(ROOT, 'data', 'tiny', 'prompts_eval.jsonl')}", "algo.ppo_epochs=2",
            "algo.num_minibatches=2", "optim.per_device_batch_size=8", f"algo.policy_loss={objective}",
            f"max_steps={args.steps}", "logging.eval_steps=0", "logging.progress_bar=false", f"seed={seed}",
            f"output_dir={os.path.join(args.out, f'{objective}_seed{seed}')}", "overwrite=true"]


def run(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    for objective in args.objectives:
        for seed in args.seeds:
            run_dir = os.path.join(args.out, f"{objective}_seed{seed}")
            if os.path.exists(os.path.join(run_dir, "bench.json")):
                continue
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "rlhfkit.cli", "grpo", *overrides(args, objective, seed)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            load = os.getloadavg()
            with open(os.path.join(run_dir, "bench.json"), "w", encoding="utf-8") as f:
                json.dump({"objective": objective, "seed": seed, "wall_s": time.perf_counter() - t0,
                           "load": load, "steps": args.steps}, f)
            print(f"{objective} seed {seed}: {time.perf_counter() - t0:.0f} s, load {load[0]:.1f}", flush=True)


def figures(run_dir: str) -> dict[str, float]:
    """A finished run's figures: its last held-out evaluation and its last training step's entropy."""
    with open(os.path.join(run_dir, "bench.json"), encoding="utf-8") as f:
        out = json.load(f)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
    evals = [r for r in rows if "eval/objective/scores" in r]
    train = [r for r in rows if "objective/entropy" in r]
    out.update(held_out=evals[-1]["eval/objective/scores"], kl=evals[-1].get("eval/objective/kl", float("nan")),
               entropy=train[-1]["objective/entropy"] / max(train[-1]["response/length_avg"], 1.0),
               train_score=statistics.mean(r["objective/scores"] for r in train[-5:]))
    return out


def cell(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.mean(values))} ± {fmt.format(statistics.stdev(values))}" if len(values) > 1 \
        else fmt.format(values[0])


def table(args) -> None:
    sys.path.insert(0, HERE)
    from results import record

    rows, loads = [], []
    for objective in args.objectives:
        runs = [figures(os.path.join(args.out, f"{objective}_seed{s}")) for s in args.seeds]
        loads += [r["load"][0] for r in runs]
        rows.append([f"`{objective}`", cell([r["held_out"] for r in runs], "{:.3f}"),
                     cell([r["train_score"] for r in runs], "{:.3f}"), cell([r["kl"] for r in runs], "{:.3f}"),
                     cell([r["entropy"] for r in runs], "{:.3f}"), cell([r["wall_s"] for r in runs], "{:.0f} s"),
                     f"{statistics.mean(r['load'][0] for r in runs):.1f}"])
    steps = figures(os.path.join(args.out, f"{args.objectives[0]}_seed{args.seeds[0]}"))["steps"]
    record("objectives", "Which objective: GRPO on the tiny model's rule-checked toy reward, one objective per row",
           ["algo.policy_loss", "held-out reward", "train reward (last 5 steps)", "KL to start (held out, per sequence)",
            "entropy (nats/token)", "wall time", "load while it ran"], rows,
           command=f"python bench/objectives.py run --out {args.out} && python bench/objectives.py table --out {args.out}",
           notes=[f"Seeds {', '.join(map(str, args.seeds))}: mean ± sd over seeds. {steps} GRPO steps of 4 prompts x "
                  "4 samples, 2 epochs x 2 minibatches each, lr 1e-3, full fine-tuning of the tiny random model, "
                  "k3 KL 0.04 in the loss, every objective at its defaults.",
                  f"The machine was shared with other work while these ran (1-min load average {min(loads):.1f} to "
                  f"{max(loads):.1f} on 2 cores, the last column its mean at the end of each run): the wall times "
                  "measure the load more than the objective, and compare only between rows of similar load."])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--out", default="runs/objectives")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=25)
    args = parser.parse_args()
    (run if args.what == "run" else table)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
