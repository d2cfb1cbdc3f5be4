"""A tiny synthetic task with a learnable rule, used by the `*_tiny.yaml` configs and the tests.

Prompts ask for a short review of an invented item; the "gold" rule prefers responses with a positive adjective.
Every split is generated from a fixed seed, so the shipped files in data/tiny/ can be regenerated exactly:
`python -m rlhfkit.tasks.toy data/tiny`.
"""

from __future__ import annotations

import json
import os
import random
import sys

POSITIVE = ["great", "good", "lovely", "superb", "fun", "wonderful", "bright", "warm"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring", "terrible", "grim", "cold"]
KINDS = ["film", "book", "song", "game", "lamp", "chair"]
SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sa", "vi", "nu", "pe", "do", "ri", "ma"]


def gold_score(text: str) -> float:
    """The toy task's judge: +1 per positive adjective, -1 per negative one."""
    words = [w.strip(".,!").lower() for w in text.split()]
    return float(sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words))


def _item(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _prompt(rng: random.Random) -> str:
    return f"Review the {rng.choice(KINDS)} {_item(rng)}."


def _review(rng: random.Random, words: list[str]) -> str:
    return f"It was {rng.choice(words)}."


def make_splits(seed: int = 0) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {}
    for name, n in (("train", 256), ("eval", 64)):
        splits[f"sft_{name}"] = [{"prompt": _prompt(rng), "completion": _review(rng, POSITIVE + NEGATIVE)} for _ in range(n)]
        splits[f"pref_{name}"] = [
            {"prompt": _prompt(rng), "chosen": _review(rng, POSITIVE), "rejected": _review(rng, NEGATIVE)} for _ in range(n)
        ]
        unpaired = []
        for _ in range(n):
            good = rng.random() < 0.5
            unpaired.append({"prompt": _prompt(rng), "completion": _review(rng, POSITIVE if good else NEGATIVE), "label": good})
        splits[f"unpaired_{name}"] = unpaired
        splits[f"prompts_{name}"] = [{"prompt": _prompt(rng)} for _ in range(n)]
    return splits


def write_splits(out_dir: str, seed: int = 0) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for name, records in make_splits(seed).items():
        with open(os.path.join(out_dir, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    write_splits(sys.argv[1] if len(sys.argv) > 1 else "data/tiny")


def vowel_reward(prompts: list, completions: list) -> list[float]:
    """A reward a random tiny model can learn within seconds: the fraction of the response that is a vowel
    (the `*_tiny.yaml` online RL configs use it through `reward.function: rlhfkit.tasks.toy:vowel_reward`). A
    conversational completion (a message list: an episode with tools) counts the text of all its messages."""
    from rlhfkit.reward_functions import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(ch in "aeiou" for ch in text) / max(len(text), 1) for text in texts]
