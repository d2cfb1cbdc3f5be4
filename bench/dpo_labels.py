"""What limits the demo's offline DPO: label noise, the number of labelled pairs, or the number of passes?

Run after `rlhfkit demo` (it reads the demo's directory and writes nothing into it):

    python bench/dpo_labels.py runs/demo [--out runs/dpo_labels]

Each variant trains DPO exactly as the demo's stage 3c does (LoRA on the SFT model, beta 0.1, lr 2e-4, batch 8), only
on other pairs or for more epochs, then samples the held-out prompts as the demo's evaluation does (same seed, one
response per prompt) and reports the gold judge's win rate against the demo's SFT samples (`eval_samples.jsonl`)
and the sequence KL to the SFT model:

- `annotators`: the demo's own DPO run (two disjoint pairs per train prompt, the annotators' noisy labels), evaluated
  again here as a check that this script reproduces the demo's figure;
- `gold`: the same pairs ordered by the gold judge (no label noise; gold ties dropped);
- `all-annotators` / `all-gold`: every labelled pair of the train prompts (six per prompt, overlapping);
- `annotators-3ep`: the demo's pairs for three epochs.

Figures go to stdout and OUT/dpo_labels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import yaml
from results import record

from rlhfkit.config import ModelConfig
from rlhfkit.evaluation.metrics import win_rate
from rlhfkit.io import read_jsonl_rows, write_jsonl_rows
from rlhfkit.stages import run_stage, stage_config
from rlhfkit.tasks import reviews
from rlhfkit.tasks.demo import Policy

LABELS = {"annotators": "the demo's: two disjoint pairs per train prompt, annotators' labels",
          "gold": "the same pairs ordered by the gold judge (gold ties dropped)",
          "annotators-3ep": "the demo's pairs, three epochs",
          "all-gold": "every labelled pair of the train prompts (six per prompt), gold order",
          "all-annotators": "every labelled pair of the train prompts, annotators' labels"}
SEED = 0  # the demo's default seed: its evaluation samples the trained policies under seed + 3


def relabel_by_gold(pairs: list[dict]) -> list[dict]:
    out = []
    for p in pairs:
        if p["gold_chosen"] == p["gold_rejected"]:
            continue
        if p["gold_chosen"] < p["gold_rejected"]:
            p = {**p, "chosen": p["rejected"], "rejected": p["chosen"], "gold_chosen": p["gold_rejected"],
                 "gold_rejected": p["gold_chosen"]}
        out.append(p)
    return out


def evaluate(model_dir, path, demo, sft, sft_gold, pairs, flips, epochs, train_s) -> dict:
    """The demo's evaluation of one DPO policy: one sample per held-out prompt under the demo's seed, the gold judge's
    win rate against the demo's SFT samples, the mean gold reward and the sequence KL to the SFT model."""
    policy = Policy(ModelConfig(name_or_path=model_dir), path("prompts", "prompts_eval.jsonl"))
    ros = policy.sample(1, demo["max_new_tokens"], demo["sample_batch"], SEED + 3)
    gold = torch.tensor(reviews.gold_judge([], policy.texts(ros)))
    figures = {"pairs": len(pairs), "pairs_against_gold": flips, "epochs": epochs,
               "win_rate_gold": win_rate(gold, sft_gold), "gold_reward": float(gold.mean()),
               "kl_to_sft": float(policy.sequence_kl(ros, sft).mean()), "train_s": round(train_s, 1)}
    print(os.path.basename(model_dir), json.dumps(figures), flush=True)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("demo_dir")
    ap.add_argument("--out", default="runs/dpo_labels")
    ap.add_argument("--only", nargs="*", help="variants to run (default: all)")
    args = ap.parse_args()
    demo, out = args.demo_dir, args.out
    os.makedirs(out, exist_ok=True)
    path = lambda *names: os.path.join(demo, *names)  # noqa: E731
    with open(path("eval", "config.yaml"), encoding="utf-8") as f:
        settings = yaml.safe_load(f)["demo"]  # the demo's vars, as its evaluation recorded them
    dpo_epochs = settings["dpo_epochs"]
    demo_pairs, train_pairs = read_jsonl_rows(path("pairs", "pairs_dpo.jsonl")), read_jsonl_rows(path("pairs", "pairs_train.jsonl"))
    variants = {
        "annotators": (demo_pairs, dpo_epochs),
        "gold": (relabel_by_gold(demo_pairs), dpo_epochs),
        "annotators-3ep": (demo_pairs, 3.0),
        "all-gold": (relabel_by_gold(train_pairs), dpo_epochs),
        "all-annotators": (train_pairs, dpo_epochs),
    }
    sft_gold = torch.tensor([r["gold_sft"] for r in read_jsonl_rows(path("eval", "eval_samples.jsonl"))])
    sft = Policy(ModelConfig(name_or_path=path("sft")), path("prompts", "prompts_eval.jsonl"))
    results = {}
    for name, (pairs, epochs) in variants.items():
        if args.only and name not in args.only:
            continue
        flips = sum(p["gold_chosen"] < p["gold_rejected"] for p in pairs)
        t0 = time.time()
        if name == "annotators":  # the demo's own DPO run: evaluated, not retrained
            results[name] = evaluate(path("dpo"), path, settings, sft, sft_gold, pairs, flips, epochs, 0.0)
            continue
        data = write_jsonl_rows(os.path.join(out, f"pairs_{name}.jsonl"), pairs)
        # The demo's own DPO config (its saved config.yaml), with this variant's pairs and epochs.
        run_stage("dpo", stage_config("dpo", path("dpo", "config.yaml"), [
            "logging.progress_bar=false", f"data.train={data}", f"output_dir={os.path.join(out, name)}",
            f"num_epochs={epochs}", "overwrite=true"]))
        results[name] = evaluate(os.path.join(out, name), path, settings, sft, sft_gold, pairs, flips, epochs, time.time() - t0)
    with open(os.path.join(out, "dpo_labels.json"), "w", encoding="utf-8") as f:
        json.dump({"demo_dir": demo, "variants": results}, f, indent=2)
    if not args.only:  # the docs' table holds every variant
        record("dpo_labels", "What holds the demo's offline DPO back",
               ["DPO variant", "pairs", "labels against the gold order", "epochs", "gold win rate vs SFT", "gold reward",
                "KL to SFT (nats)"],
               [[LABELS[name], r["pairs"], r["pairs_against_gold"], f"{r['epochs']:g}", f"{r['win_rate_gold']:.1%}",
                 f"{r['gold_reward']:.3f}", f"{r['kl_to_sft']:.3g}"] for name, r in results.items()],
               command=f"python bench/dpo_labels.py {demo}",
               notes=["DPO retrained on the demo's SFT model with the demo's settings, only the pairs, labels or epochs "
                      "changed, evaluated as the demo evaluates."])


if __name__ == "__main__":
    main()
