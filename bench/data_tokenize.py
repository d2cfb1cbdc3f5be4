"""Tokenizing a preference file the size of HH-RLHF's train split (160k pairs): the first run, which validates and
tokenizes every record through `datasets.Dataset.map`, against a rerun with the same file, tokenizer and settings,
which reads the ids back from the on-disk cache (`rlhfkit.data`, module docstring).

The file is synthetic HH-RLHF: "\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts of one to three exchanges whose
chosen and rejected answers share the conversation before them, written to a temporary directory with a fresh
cache. Both runs are `build_datasets("preference", ...)` with the tiny character-level ChatML tokenizer that the
tests use, each in its own process (as two training runs would be), timed after the imports from the call to the
returned lists: hashing the file; reading, parsing and tokenizing it (first run) or reading the cache (rerun); the
python example lists that the trainers use.

    python bench/data_tokenize.py                  # 160k pairs, one process
    python bench/data_tokenize.py --num-proc 4     # tokenize in 4 worker processes (RLHFKIT_DATA_NUM_PROC)
    python bench/data_tokenize.py --pairs 20000    # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from results import record

WORDS = ["the", "a", "film", "book", "song", "lamp", "chair", "game", "story", "plan", "recipe", "was", "is", "very",
         "quite", "rather", "bright", "dull", "warm", "cold", "good", "bad", "how", "why", "what", "can", "you", "tell",
         "me", "about", "please", "thanks", "sure", "here", "it"]


def write_pairs(path: str, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))).capitalize() + "."

    with open(path, "w") as f:
        for _ in range(n):
            history = "".join(f"\n\nHuman: {text(6, 20)}\n\nAssistant: {text(8, 30)}" for _ in range(rng.randint(0, 2)))
            prompt = f"{history}\n\nHuman: {text(6, 20)}\n\nAssistant:"
            f.write(json.dumps({"chosen": f"{prompt} {text(10, 40)}", "rejected": f"{prompt} {text(10, 40)}"}) + "\n")


def build(path: str) -> None:
    """One run, in this process: print the seconds `build_datasets` took and what it returned, as JSON."""
    import datasets  # noqa: F401  (imports stay outside the clock)

    from rlhfkit.config import DataConfig
    from rlhfkit.data import build_datasets
    from rlhfkit.model_sources import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    start = time.perf_counter()
    train, _ = build_datasets("preference", DataConfig(train=path), tokenizer, seed=0)
    seconds = time.perf_counter() - start
    tokens = sum(len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in train)
    print(json.dumps({"seconds": seconds, "examples": len(train), "tokens": tokens}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=160_000)
    parser.add_argument("--num-proc", type=int, default=1)
    parser.add_argument("--build", help=argparse.SUPPRESS)  # internal: one timed run on this file
    args = parser.parse_args()
    if args.build:
        return build(args.build)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hh_synthetic.jsonl")
        write_pairs(path, args.pairs)
        env = {**os.environ, "RLHFKIT_CACHE": os.path.join(tmp, "cache"), "RLHFKIT_DATA_NUM_PROC": str(args.num_proc),
               "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
        runs = []
        for _ in ("first", "cached"):
            out = subprocess.run([sys.executable, __file__, "--build", path], env=env, check=True, capture_output=True, text=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        first, cached = runs
        assert (first["examples"], first["tokens"]) == (cached["examples"], cached["tokens"])
        size = os.path.getsize(path) / 2**20
        print(f"{args.pairs} pairs ({size:.0f} MiB, {first['tokens'] / 1e6:.1f}M tokens), num_proc={args.num_proc}")
        print(f"first run (tokenize): {first['seconds']:7.1f} s")
        print(f"cached rerun:         {cached['seconds']:7.1f} s")
        print(f"ratio:                {first['seconds'] / cached['seconds']:7.1f}x")
        record("data_tokenize", "Tokenising a preference file the size of HH-RLHF", ["run", "wall time"],
               [[f"first run: read, validate and tokenise {args.pairs} synthetic HH-RLHF pairs ({size:.0f} MiB, "
                 f"{first['tokens'] / 1e6:.0f}M tokens, {args.num_proc} process(es))", f"{first['seconds']:.1f} s"],
                ["rerun: the same file and settings, read from the cache",
                 f"{cached['seconds']:.1f} s ({first['seconds'] / cached['seconds']:.0f}× faster)"]],
               command="python bench/data_tokenize.py" + (f" --pairs {args.pairs}" if args.pairs != 160_000 else "")
               + (f" --num-proc {args.num_proc}" if args.num_proc != 1 else ""),
               notes=["Tiny character-level tokenizer; each run in its own process, timed after the imports."])


if __name__ == "__main__":
    main()
