"""The demo's held-out evaluation as the docs' table: reads `eval.json` of a finished `rlhfkit demo` (or
`rlhfkit demo --full`) and writes docs/results/demo.json and .md (bench/results.py).

    rlhfkit demo --full && python bench/demo_results.py runs/demo
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from results import record

NAMES = {"sft": "SFT", "ppo": "PPO", "online_dpo": "online DPO", "dpo": "DPO", "best_of_4": "best-of-4"}


def rows(methods: dict) -> list[list[str]]:
    """One row per method, in the demo's order, with eval.json's figures as the demo prints them."""
    out = []
    for method, f in methods.items():
        kl = "0" if method == "sft" else (f"≤ {f['kl_to_sft']:.2f}" if method.startswith("best_of") else f"{f['kl_to_sft']:.2f}")
        tax = f["alignment_tax_nats"]
        out.append([NAMES.get(method, method), f"{f['gold_reward']:.3f}", kl, f"{f['win_rate_gold']:.1%}",
                    f"{f['win_rate_rm']:.1%}", f"{f['distinct_2']:.3f}", f"{f['eos_rate']:.1%}", f"{f['mean_words']:.1f}",
                    "0" if method == "sft" else f"{tax:+.3f}"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demo_dir", help="the demo's --output-dir, holding eval/eval.json")
    args = parser.parse_args()
    with open(os.path.join(args.demo_dir, "eval", "eval.json"), encoding="utf-8") as f:
        result = json.load(f)
    if result.get("quick"):
        sys.exit("demo_results: this is a --quick demo (a tiny random model): its figures are plumbing only")
    rm = result["reward_model"]
    passed = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in result["acceptance"].items())
    record("demo", "`rlhfkit demo" + (" --full" if result.get("full") else "") + "`: held-out evaluation against the SFT model",
           ["method", "gold reward", "KL to SFT (nats)", "win rate vs SFT, gold", "win rate vs SFT, RM", "distinct-2",
            "EOS rate", "mean words", "alignment tax (nats/token)"], rows(result["methods"]),
           command="rlhfkit demo" + (" --full" if result.get("full") else "") + f" && python bench/demo_results.py {args.demo_dir}",
           notes=[f"Reward model accuracy against the gold order: {rm['rm_accuracy_gold_eval_prompts']:.3f} on the "
                  f"{rm['rm_gold_pairs_eval_prompts']} pairs of SFT samples to the {result['eval_prompts']} held-out "
                  f"prompts ({rm['rm_accuracy_gold']:.3f} on the {rm['rm_gold_pairs']} held-out annotated pairs).",
                  f"Acceptance bars (eval.json's `acceptance`): {passed}.",
                  f"KL of best-of-n: {result['kl_note']}."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
