"""A verifiable-reward task: single-digit sums checked against the record's reference answer (`configs/grpo_arithmetic.yaml`).

The worked example of the reward-function contract (`rewards.RewardFunction`): each prompt record carries an extra
field, `{"prompt": "3+4=", "answer": "7"}`, and `exact_match` receives it as its `answer` keyword argument, one value
per completion, next to the dataset's own prompts and the completions. The shipped data file is generated from a
fixed seed: `python -m rlhfkit.tasks.arithmetic data/tiny` rewrites `data/tiny/arithmetic_prompts.jsonl` exactly.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> float | None:
    """The first number written in `text` ("The sum is 7." -> 7.0), or None."""
    match = _NUMBER.search(text)
    return float(match.group()) if match else None


def exact_match(prompts: list, completions: list[str], answer: list, **kwargs) -> list[float]:
    """1.0 where the completion's first number equals the record's `answer` (compared as numbers, so "7", "7.0"
    and 7 agree), else 0.0. Use as `reward.function: rlhfkit.tasks.arithmetic:exact_match`."""
    return [float(first_number(c) == float(a)) for c, a in zip(completions, answer)]


def make_records(n: int = 32, seed: int = 0) -> list[dict]:
    """`n` prompts "a+b=" with a, b in 0..9 and their answers as strings (as GSM8K-style data ships them)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


if __name__ == "__main__":
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "data/tiny"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "arithmetic_prompts.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in make_records())
