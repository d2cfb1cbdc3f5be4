"""Padded against padding-free batches (`data.padding_free`) for SFT, the reward model and DPO: seconds per optimizer
step and real tokens per second, on the tiny model with sequence lengths spread uniformly (default 32..256 tokens).

Each stage runs two real trainers (`SFTTrainer`, `RewardTrainer`, `PreferenceTrainer`) built from its tiny config,
one per layout, on the same synthetic data in the same order; their `train_step`s take turns (which goes first
alternates each step, so a drift in machine load hits both alike), and the figure is the median over the steps after
warm-up. "tokens" are the real tokens of the step's sequences (a DPO pair is two); the padded layout also computes its
pad positions, reported as "padded share".

What to expect: padding-free computes no pad token (the MLP, LM head and loss shrink by the padded share), and its
attention runs per sequence (`models.padding_free_attention`: Σ len² instead of B × T_max²). Without that — eager,
sliding-window attention, or `--dense-mask` here, transformers' block-diagonal mask over sdpa — attention is one
(N, N) product per row and, on a small model, costs more than the padding saved. Timings on a shared machine are
noisy: compare the ratios of one run, not figures across runs.

The table goes to docs/results/padding_free[_dense_mask].json and .md (bench/results.py), which the docs include.

    OMP_NUM_THREADS=1 python bench/padding_free.py                        # sft, rm, dpo; 8 sequences/pairs per step
    python bench/padding_free.py --stages dpo --steps 20 --batch 16 --max-len 512
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import random
import statistics
import string
import sys
import tempfile
import time

from results import record

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = {  # stage -> (config class, trainer, tiny config, data kind)
    "sft": ("SFTConfig", "rlhfkit.trainers.sft:SFTTrainer", "configs/sft_tiny.yaml", "sft"),
    "rm": ("RMConfig", "rlhfkit.trainers.reward:RewardTrainer", "configs/rm_tiny.yaml", "preference"),
    "dpo": ("DPOConfig", "rlhfkit.trainers.preference:PreferenceTrainer", "configs/dpo_tiny.yaml", "preference"),
}
PROMPT = (8, 24)  # prompt characters (the tiny tokenizer has one token per character, plus the chat template's)


def write_data(path: str, kind: str, n: int, min_len: int, max_len: int, seed: int) -> None:
    """n records whose prompt + response lengths (characters) are uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    text = lambda k: "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            p = rng.randint(*PROMPT)
            response = lambda: text(rng.randint(min_len, max_len) - p)  # noqa: E731
            record = {"prompt": text(p), "completion": response()} if kind == "sft" else \
                {"prompt": text(p), "chosen": response(), "rejected": response()}
            f.write(json.dumps(record) + "\n")


def build(stage: str, data: str, out: str, padding_free: bool, args):
    import importlib

    from rlhfkit.config import load_config

    cfg_name, trainer_ref, config, _ = STAGES[stage]
    cfg_cls = getattr(importlib.import_module("rlhfkit.config"), cfg_name)
    module, name = trainer_ref.split(":")
    overrides = [f"data.train={data}", "data.eval=null", f"data.max_length={args.max_len + 64}",
                 "data.max_prompt_length=64", f"optim.per_device_batch_size={args.batch}", "optim.warmup_steps=0",
                 f"max_steps={args.warmup + args.steps}", "logging.progress_bar=false", f"output_dir={out}",
                 f"data.padding_free={str(padding_free).lower()}"]
    trainer = getattr(importlib.import_module(module), name)(load_config(cfg_cls, config, overrides))
    with contextlib.redirect_stderr(io.StringIO()):  # tokenizer/weights progress bars
        trainer.setup()
    if padding_free and args.dense_mask:  # back to transformers' block-diagonal mask over sdpa
        models = [trainer.run.accelerator.unwrap_model(trainer.model), getattr(getattr(trainer, "reference", None), "model", None)]
        for model in filter(None, models):
            model.set_attn_implementation("sdpa")
    return trainer


def step_tokens(trainer, step: int) -> tuple[int, int]:
    """(real tokens, padded positions) of optimizer step `step`: Σ lengths, and Σ over micro-batches of B × T."""
    from rlhfkit.trainers.offline import micro_batch_positions

    order, positions = micro_batch_positions(trainer.run, step, len(trainer.train_set), trainer.steps_per_epoch)
    real = padded = 0
    for mine in positions:
        examples = [trainer.train_set[order[p]] for p in mine]
        if "input_ids" in examples[0]:
            lengths = [len(e["input_ids"]) for e in examples]
            width = max(lengths)
        else:
            lengths = [len(e["prompt_ids"]) + len(e[k]) for e in examples for k in ("chosen_ids", "rejected_ids")]
            width = max(lengths)  # chosen and rejected share one width
        real, padded = real + sum(lengths), padded + width * len(lengths)
    return real, padded


def bench_stage(stage: str, workdir: str, args) -> dict:
    data = os.path.join(workdir, f"{stage}.jsonl")
    write_data(data, STAGES[stage][3], args.batch * (args.warmup + args.steps), args.min_len, args.max_len, args.seed)
    trainers = {pf: build(stage, data, os.path.join(workdir, f"{stage}-{pf}"), pf, args) for pf in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens = []
    for step in range(args.warmup + args.steps):
        for pf in ((False, True) if step % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            trainers[pf].train_step(step)
            if step >= args.warmup:
                times[pf].append(time.perf_counter() - t0)
        if step >= args.warmup:
            tokens.append(step_tokens(trainers[False], step))
    real = statistics.median(r for r, _ in tokens)
    pad_share = 1 - sum(r for r, _ in tokens) / sum(p for _, p in tokens)
    for trainer in trainers.values():
        trainer.run.lock.release()
    s = {pf: statistics.median(t) for pf, t in times.items()}
    return {"stage": stage, "padded_s": s[False], "free_s": s[True], "tokens": real, "pad_share": pad_share,
            "padded_tok_s": real / s[False], "free_tok_s": real / s[True], "speedup": s[False] / s[True]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="sft,rm,dpo")
    parser.add_argument("--batch", type=int, default=8, help="sequences (SFT) or pairs (RM, DPO) per step")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per layout, after warm-up")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dense-mask", action="store_true",
                        help="padding-free with transformers' (N, N) block-diagonal mask over sdpa, not per-sequence attention")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.disable(logging.WARNING)  # the trainers' information lines
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; lengths uniform in [{args.min_len}, "
          f"{args.max_len}], {args.batch} per step, median of {args.steps} steps after {args.warmup} warm-up"
          + ("; padding-free attention: one (N, N) masked sdpa per row" if args.dense_mask else ""))
    print(f"{'stage':6} {'padded s/step':>13} {'free s/step':>11} {'padded tok/s':>12} {'free tok/s':>10} "
          f"{'padded share':>12} {'speedup':>7}")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for stage in args.stages.split(","):
            r = bench_stage(stage, workdir, args)
            print(f"{stage:6} {r['padded_s']:13.3f} {r['free_s']:11.3f} {r['padded_tok_s']:12.0f} {r['free_tok_s']:10.0f} "
                  f"{r['pad_share']:12.0%} {r['speedup']:6.2f}x", flush=True)
            rows.append([stage, f"{r['padded_s']:.3f}", f"{r['free_s']:.3f}", f"{r['pad_share']:.0%}", f"{r['speedup']:.2f}×"])
    record("padding_free" + ("_dense_mask" if args.dense_mask else ""),
           "Padded against padding-free batches (`data.padding_free`)",
           ["stage", "padded s/step", "padding-free s/step", "padded share", "speed-up"], rows,
           command=f"OMP_NUM_THREADS={torch.get_num_threads()} python " + " ".join(sys.argv),
           notes=[f"Tiny model, {args.batch} sequences (or pairs) per step, lengths uniform in [{args.min_len}, "
                  f"{args.max_len}]; median of {args.steps} steps after {args.warmup} warm-up, the two layouts taking "
                  "turns" + ("; padding-free attention as one (N, N) masked sdpa per row (`--dense-mask`)."
                             if args.dense_mask else "; padding-free attention per sequence.")])


if __name__ == "__main__":
    main()
