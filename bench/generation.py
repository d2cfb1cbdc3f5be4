"""Sampling speed of `rlhfkit.generation.generate`'s engines on the same rollouts: transformers' `generate` ("hf",
the reference), rlhfkit's decode loop ("rlhfkit"), and on a GPU the loop with a static cache and CUDA graphs
(`generation.compile`). Under one seed the engines draw the same tokens (tests/unit/test_generation.py), so each
call does the same work; the script checks that the token counts agree.

    python bench/generation.py                 # CPU shape: tiny 2-layer model, 8 rows, 16 new tokens
    python bench/generation.py --shape gpu     # SmolLM2-135M's shape (random weights), bf16, 64 rows, 128 new tokens

Engines take turns call by call (A B C, B C A, ...), so a shared machine's load falls on all; the figure is the
median seconds per call after the warm-up calls (the compiled engine's first calls compile), and new tokens per
second = rows × new positions / median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from results import record

SHAPES = {
    "cpu": {"model": "tiny", "rows": 8, "prompt_len": 24, "new_tokens": 16, "calls": 30, "warmup": 3},
    "gpu": {"model": "smollm2-135m-shape", "rows": 64, "prompt_len": 64, "new_tokens": 128, "calls": 10, "warmup": 3},
}


def build(shape: dict):
    """(model, prompt batch, eos id, pad id) for the shape, on the GPU when there is one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.types import PromptBatch

    cuda = torch.cuda.is_available()
    if shape["model"] == "tiny":
        cfg = ModelConfig(name_or_path="tiny")
        tok = load_tokenizer(cfg)
        model, eos, pad, vocab = load_causal_lm(cfg, tok), tok.eos_token_id, tok.pad_token_id, len(tok)
    else:  # SmolLM2-135M's shape: 30 layers of 576, vocabulary 49152
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                                             rope_theta=100000.0, tie_word_embeddings=True))
        eos, pad, vocab = 2, 0, 49152
    model = model.to("cuda", torch.bfloat16) if cuda else model
    model.eval()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(shape["prompt_len"] // 2, shape["prompt_len"] + 1, (shape["rows"],), generator=g)
    ids = torch.full((shape["rows"], shape["prompt_len"]), pad)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):  # left padding, as the trainers collate prompts
        ids[i, -n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, -n:] = 1
    device = "cuda" if cuda else "cpu"
    return model, PromptBatch(ids.to(device), mask.to(device)), eos, pad


def main() -> int:
    from rlhfkit.config import GenerationConfig
    from rlhfkit.generation import generate

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    model, batch, eos, pad = build(shape)
    engines = {"hf": dict(engine="hf"), "rlhfkit": dict(engine="rlhfkit")}
    if torch.cuda.is_available():
        engines["rlhfkit+compile"] = dict(engine="rlhfkit", compile=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, set[int]] = {name: set() for name in engines}
    names = list(engines)
    for call in range(shape["calls"]):
        order = names[call % len(names):] + names[: call % len(names)]
        for name in order:
            params = GenerationConfig(max_new_tokens=shape["new_tokens"], **engines[name])
            torch.manual_seed(call)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ro = generate(model, batch, params, eos, pad)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if call >= shape["warmup"]:
                times[name].append(time.perf_counter() - t0)
                tokens[name].add(int(ro.response_ids.numel()))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"shape {args.shape} ({device}): {shape['rows']} rows, prompts of {shape['prompt_len']} tokens (left-padded), "
          f"{shape['new_tokens']} new tokens; median of {shape['calls'] - shape['warmup']} calls")
    base = statistics.median(times["hf"])
    rows = []
    for name in names:
        med = statistics.median(times[name])
        work = max(tokens[name])
        print(f"  {name:<16} {med:8.4f} s/call  {work / med:10.0f} new tokens/s  {base / med:5.2f}x hf")
        rows.append([f"`generation.engine={engines[name]['engine']}`" + (", `compile=true`" if "compile" in engines[name] else ""),
                     f"{med:.4f}", f"{work / med:.0f}", f"{base / med:.2f}×"])
    if len({frozenset(v) for v in tokens.values()}) != 1:
        print("  (the engines' token counts differ: not the same work)", tokens)
        return 1
    record("generation" + ("" if args.shape == "cpu" else f"_{args.shape}"),
           "Sampling: rlhfkit's decode loop against transformers' `generate`",
           ["engine", "s per call", "new tokens/s", "speed-up over `generate`"], rows,
           command=f"python bench/generation.py --shape {args.shape}",
           notes=[f"{shape['rows']} rows, prompts of {shape['prompt_len']} tokens (left-padded), {shape['new_tokens']} new "
                  f"tokens, {device}; median of {shape['calls'] - shape['warmup']} calls after warm-up, engines taking "
                  "turns; the same tokens under one seed."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
