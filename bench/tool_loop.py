"""The tool loop's cost, side by side in one process, on the agent demo's task (`rlhfkit.tasks.agent`: "What is
347 * 29?" with a `multiply` tool) and its trained agent (SmolLM2-135M-Instruct after the demo's SFT and GRPO, which
calls the tool on every held-out prompt, so every episode has two turns):

  - rlhfkit's `ToolLoop` (multi-turn, the KV cache kept across turns: a turn feeds only the tool results and header;
    a prompt the rows of a group share is prefilled once, and the cache grows in place);
  - TRL 1.16's tool loop: `GRPOTrainer._generate` of a trainer built with `tools=[multiply]` (its whole generation
    phase: the first turn through transformers' `generate`, then `_tool_call_loop`, which re-prefills each episode's
    whole conversation, prompt + completion + tool results, before every further turn). The trainer is made once and
    only `_generate` is timed (no reward, no log-probs, no update; the per-rollout tool dicts that
    `_generate_and_score_completions` builds before calling it are built once, untimed);
  - a single-turn rollout of the same total length: rlhfkit's decode loop (`generation.generate`) on the same rendered
    prompts, sampling as many tokens per row as the longest multi-turn completion (EOS ignored), so it does the
    sampling of a multi-turn rollout with no turn boundaries.

Same weights, tokenizer and chat template (the bundled `chatml_tools`), the same prompts (held-out factor pairs, each
twice: a GRPO group of 2), greedy sampling on every side (top_k=1), `max_new_tokens` 64 over the whole completion and at
most 2 rounds of tool calls on both loops. The work is counted on both sides from what each returns: episodes, tool
calls run, the policy's tokens (action mask / TRL's tool mask) and the right answers; the script refuses to report a
ratio when the counts differ. The three take turns call by call (A B C, B C A, ...) so a shared machine's load falls
on all; the figure is the median over the calls after a warm-up call of each, with the spread (min-max).

    python bench/tool_loop.py                            # the GRPO model of runs/agent_bench (made first if missing)
    python bench/tool_loop.py --model runs/agent1/grpo   # the GRPO model of `rlhfkit demo --agent --seed 1`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from results import record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def agent_model(path: str | None) -> str:
    """The model to bench: `path`, or the agent demo's GRPO model, its stages run into runs/agent_bench (seed 1) if
    missing (about 40 minutes on 2 CPU cores)."""
    if path:
        return path
    from rlhfkit.tasks.demos import run_demo

    out = os.path.join(ROOT, "runs", "agent_bench")
    if not os.path.isdir(os.path.join(out, "grpo")):
        run_demo("agent", out, seed=1)  # the whole demo (its evaluation too): the same command resumes it
    return os.path.join(out, "grpo")


def load(model_dir: str):
    from rlhfkit import templates
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_causal_lm, load_tokenizer

    cfg = ModelConfig(name_or_path=model_dir)
    tok = load_tokenizer(cfg)
    templates.load("chatml_tools").apply_to(tok)
    return load_causal_lm(cfg, tok, trainable=False).eval(), tok


class Rlhfkit:
    """rlhfkit's ToolLoop on the prompts, `k` episodes each."""

    def __init__(self, model, tok, prompts, k, max_new_tokens):
        from rlhfkit.config import GenerationConfig
        from rlhfkit.rollout.tool_loop import ToolLoop
        from rlhfkit.tasks.agent import multiply
        from rlhfkit.tools import Toolbox
        from rlhfkit.types import PromptBatch

        params = GenerationConfig(max_new_tokens=max_new_tokens, top_k=1, num_samples=k)
        self.loop = ToolLoop(tok, params, 0, Toolbox([multiply]), 2, 60.0, 1024)
        self.model, self.examples = model, [{"prompt": p, "columns": {}} for p in prompts]
        self.seed_only = PromptBatch(torch.zeros(len(prompts), 1, dtype=torch.long),
                                     torch.ones(len(prompts), 1, dtype=torch.long))

    def __call__(self) -> dict:
        ro = self.loop(self.model, self.seed_only, self.examples, 0)
        return {"episodes": len(ro.completions), "calls": int(ro.tools.calls.sum()),
                "policy_tokens": int(ro.action_mask.sum()), "completion_tokens": int(ro.response_mask.sum()),
                "completions": list(ro.completions), "longest": int(ro.response_mask.sum(1).max())}


class Trl:
    """TRL 1.16's generation phase with tools: `GRPOTrainer._generate` on the prompts repeated `k` times (as its
    sampler hands them over), the trainer built once around the same model object."""

    def __init__(self, model, tok, prompts, k, max_new_tokens, workdir):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        from rlhfkit.tasks.agent import multiply

        def zero(completions, **kwargs):  # the trainer needs a reward function; _generate never calls it
            return [0.0] * len(completions)

        args = GRPOConfig(output_dir=workdir, per_device_train_batch_size=len(prompts) * k, num_generations=k,
                          max_completion_length=max_new_tokens, max_tool_calling_iterations=2, top_k=1,
                          temperature=1.0, beta=0.0, gradient_checkpointing=False, use_cpu=True, bf16=False,
                          report_to="none", max_steps=1, logging_steps=1, save_strategy="no")
        self.trainer = GRPOTrainer(model=model, reward_funcs=[zero], args=args, processing_class=tok,
                                   train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), tools=[multiply])
        self.prompts = [p for p in prompts for _ in range(k)]
        # `_generate_and_score_completions` builds each rollout's tool dicts before it calls `_generate` (per batch:
        # the environments' methods may differ); with standalone tools only, every rollout's dicts are the same.
        self.trainer._sync_tool_dicts = [{fn.__name__: fn for fn in self.trainer._standalone_tools}] * len(self.prompts)
        self.trainer._async_tool_dicts = [{}] * len(self.prompts)

    def __call__(self) -> dict:
        out = self.trainer._generate(self.prompts)
        completion_ids, tool_mask, completions = out[1], out[2], out[3]
        return {"episodes": len(completions), "calls": sum(m["role"] == "tool" for c in completions for m in c),
                "policy_tokens": sum(map(sum, tool_mask)), "completion_tokens": sum(map(len, completion_ids)),
                "completions": completions, "longest": max(map(len, completion_ids))}


class SingleTurn:
    """rlhfkit's decode loop on the same rendered prompts, `length` tokens per row (EOS never stops a row)."""

    def __init__(self, model, tok, prompts, k):
        from rlhfkit.tools import describe
        from rlhfkit.tasks.agent import multiply
        from rlhfkit.types import PromptBatch

        schemas = [describe(multiply).schema]
        ids = [tok.apply_chat_template(p, tools=schemas, add_generation_prompt=True, tokenize=True, return_dict=False)
               for p in prompts]
        width = max(map(len, ids))
        self.batch = PromptBatch(torch.tensor([[tok.pad_token_id] * (width - len(x)) + list(x) for x in ids]),
                                 torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]))
        self.model, self.tok, self.k, self.length = model, tok, k, None

    def __call__(self) -> dict:
        from rlhfkit.config import GenerationConfig
        from rlhfkit.generation import generate

        params = GenerationConfig(max_new_tokens=self.length, top_k=1, num_samples=self.k)
        ro = generate(self.model, self.batch, params, -1, self.tok.pad_token_id)  # eos -1: no row stops early
        n = int(ro.response_mask.sum())
        return {"episodes": ro.response_ids.shape[0], "calls": 0, "policy_tokens": n, "completion_tokens": n,
                "completions": [], "longest": ro.response_ids.shape[1]}


def right_answers(completions, answers) -> int:
    from rlhfkit.tasks.agent import exact_answer

    return int(sum(exact_answer([], completions, answers)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model directory (default: runs/agent_bench/grpo, trained if missing)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=2, help="episodes per prompt")
    parser.add_argument("--calls", type=int, default=5, help="timed calls of each, after one warm-up call")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    from rlhfkit.tasks.agent import make_splits

    model, tok = load(agent_model(args.model))
    records = make_splits(0, 0, 0, args.prompts, seed=1234)["eval"]
    prompts = [r["prompt"] for r in records]
    answers = [r["answer"] for r in records for _ in range(args.k)]
    sides = {"rlhfkit ToolLoop": Rlhfkit(model, tok, prompts, args.k, args.max_new_tokens),
             "TRL 1.16 GRPOTrainer._generate": Trl(model, tok, prompts, args.k, args.max_new_tokens,
                                                   os.path.join(ROOT, "runs", "agent_bench", "trl")),
             "single turn, same length": SingleTurn(model, tok, prompts, args.k)}
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    work: dict[str, dict] = {}
    for call in range(args.calls + 1):
        for name in names[call % 3:] + names[: call % 3]:
            if name == names[2] and sides[name].length is None:
                continue  # its length is the longest multi-turn completion: known once rlhfkit's loop has run
            t0 = time.perf_counter()
            out = sides[name]()
            elapsed = time.perf_counter() - t0
            if call:
                times[name].append(elapsed)
            completions = out.pop("completions")
            out["right"] = right_answers(completions, answers) if completions else 0
            work.setdefault(name, out)
            if name == names[0] and sides[names[2]].length is None:
                sides[names[2]].length = out["longest"]
            print(f"call {call} {name}: {elapsed:.2f}s {out}", flush=True)
    return report(args, names, times, work)


def report(args, names, times, work) -> int:
    rows, med = [], {n: statistics.median(times[n]) for n in names}
    for n in names:
        w, t = work[n], med[n]
        rows.append([n, w["episodes"], w["calls"], w["policy_tokens"], w["completion_tokens"], w["right"],
                     f"{t:.2f} ({min(times[n]):.2f}-{max(times[n]):.2f})", f"{w['episodes'] / t:.2f}",
                     f"{w['policy_tokens'] / t:.0f}", f"{w['completion_tokens'] / t:.0f}"])
    ours, trl = work[names[0]], work[names[1]]
    same = all(ours[key] == trl[key] for key in ("episodes", "calls", "policy_tokens", "right"))
    ratio = med[names[1]] / med[names[0]]
    spread = (min(times[names[1]]) / max(times[names[0]]), max(times[names[1]]) / min(times[names[0]]))
    single = med[names[2]] / med[names[0]]
    print(f"rlhfkit / TRL episodes/s: {ratio:.2f}x (worst-best pairing {spread[0]:.2f}-{spread[1]:.2f}x); "
          f"the same work: {same}; single turn / multi-turn time: {single:.2f}")
    if not same:
        print("  (the counts differ: not the same work, no ratio recorded)")
        return 1
    threads = torch.get_num_threads()
    record("tool_loop", "The tool loop's cost: rlhfkit's multi-turn rollout, TRL 1.16's, and one turn of the same length",
           ["rollout", "episodes", "tool calls", "policy tokens", "completion tokens", "right answers",
            "s per call (min-max)", "episodes/s", "policy tokens/s", "completion tokens/s"], rows,
           command="python bench/tool_loop.py" + (f" --model {args.model}" if args.model else ""),
           notes=[f"rlhfkit's episodes/s over TRL's: **{ratio:.2f}×** (medians; pairing the slowest rlhfkit call with "
                  f"the fastest TRL call and the reverse: {spread[0]:.2f}×-{spread[1]:.2f}×). The single turn of the "
                  f"same length (the longest multi-turn completion, {work[names[2]]['longest']} tokens a row, all "
                  f"sampled) takes {single:.2f}× the multi-turn rollout's time.",
                  f"The agent demo's task and model ({args.model or 'runs/agent_bench/grpo'}: SmolLM2-135M-Instruct after the "
                  f"demo's SFT and GRPO, `chatml_tools`): {args.prompts} "
                  f"held-out prompts × {args.k} episodes, greedy, max_new_tokens {args.max_new_tokens} over the whole "
                  f"completion, at most 2 rounds of calls; CPU, {threads} torch threads; median of {args.calls} calls "
                  "each after a warm-up, taking turns. TRL's side is `GRPOTrainer._generate` (generation and its "
                  "tool loop only); completion tokens count the tool results and headers, policy tokens the model's."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
