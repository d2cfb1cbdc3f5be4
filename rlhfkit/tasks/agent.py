"""`rlhfkit demo --agent`: a tool-using agent trained offline, multi-digit products with a calculator tool.

The task: "What is 347 * 29?", where a 135M model cannot multiply a 3-digit by a 2-digit number in its head, but can
copy the factors into a call of `multiply` and the tool's result into its answer ("The answer is 10063.").
  0. prompts: tool-using traces (large factors: call `multiply`, read its result, answer) and direct-answer traces
     (single-digit factors, answered at once), all correct and generated here; the RL prompts and the held-out
     eval prompts (large factors, never in the SFT or RL data);
  1. SFT (LoRA) on the mixed traces, with the bundled tool template (model.chat_template: chatml_tools);
  2. GRPO (LoRA) with the tool (tools.functions: multiply) and the exact-answer reward (`exact_answer`);
  3. evaluation on the held-out prompts, greedy, through the same tool loop (`rollout.tool_loop.ToolLoop`): the SFT
     model, the RL model, and the RL model without tools (none rendered or callable: a call is malformed), each
     scored as `rlhfkit eval` scores agents (`evaluation.agent.agent_figures`: task completion by `exact_answer`,
     format accuracy, calls, failures, malformed calls and turns per episode).
`--quick` runs the same path on the tiny random model (plumbing only: its figures are meaningless).
"""

from __future__ import annotations

import json
import os
import random
import re
import time

import torch

from rlhfkit.io import atomic_write_text, read_jsonl_rows, write_jsonl_rows

SYSTEM_PROMPT = "You are a helpful assistant. Use the multiply tool for products of large numbers."
METHODS = ("sft", "grpo", "grpo_no_tools")  # what the evaluation scores (the last: the RL model, tools withheld)
_NUMBER = re.compile(r"-?\d+")


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class NoTools:
    """An environment with no tools (no public methods): episodes with it render no tools and can call none, so the
    evaluation's "without tools" runs the same loop, a call then counting as malformed."""

    def reset(self, **row) -> None:
        return None


def tool_schemas() -> list[dict]:
    """The JSON schemas of the task's tools, as the chat template renders them."""
    from rlhfkit.tools import describe

    return [describe(multiply).schema]


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def answer_text(value: int) -> str:
    return f"The answer is {value}."


def large_pairs(n: int, rng: random.Random, exclude: set = frozenset()) -> list[tuple[int, int]]:
    """`n` distinct (3-digit, 2-digit) factor pairs not in `exclude`: products the tool is needed for."""
    pairs: list[tuple[int, int]] = []
    seen = set(exclude)
    while len(pairs) < n:
        pair = (rng.randint(100, 999), rng.randint(11, 99))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def tool_trace(a: int, b: int) -> list[dict]:
    """A correct tool-using episode: the call, the tool's result, the answer."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return chat(question(a, b)) + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                   {"role": "tool", "name": "multiply", "content": str(a * b)},
                                   {"role": "assistant", "content": answer_text(a * b)}]


def direct_trace(a: int, b: int) -> list[dict]:
    """A correct direct answer (single-digit factors: no tool needed)."""
    return chat(question(a, b)) + [{"role": "assistant", "content": answer_text(a * b)}]


def make_splits(tool_traces: int, direct_traces: int, rl_prompts: int, eval_prompts: int, seed: int,
                guessed_traces: int = 0) -> dict:
    """The demo's data, disjoint factor pairs per split: "sft" (messages + tools records, shuffled: tool traces,
    direct answers to single-digit products, and `guessed_traces` direct answers to large products: a demonstrator
    who multiplied in their head, the right product that a 135M model can only imitate, not compute), "rl" and
    "eval" (prompt + answer records, large factors only)."""
    rng = random.Random(seed)
    held_out = large_pairs(eval_prompts, rng)
    rl = large_pairs(rl_prompts, rng, set(held_out))
    traces = large_pairs(tool_traces + guessed_traces, rng, set(held_out) | set(rl))
    small = [(rng.randint(2, 9), rng.randint(2, 9)) for _ in range(direct_traces)]
    schemas = tool_schemas()
    sft = [{"messages": tool_trace(a, b), "tools": schemas} for a, b in traces[:tool_traces]]
    sft += [{"messages": direct_trace(a, b), "tools": schemas} for a, b in traces[tool_traces:] + small]
    rng.shuffle(sft)
    prompts = lambda pairs: [{"prompt": chat(question(a, b)), "answer": str(a * b)} for a, b in pairs]  # noqa: E731
    return {"sft": sft, "rl": prompts(rl), "eval": prompts(held_out)}


def final_answer(completion) -> int | None:
    """The number an episode answers with: the last number of its last assistant message when that message calls no
    tool (an episode that ends on a call, or was cut off mid-call, answers nothing); a plain string's last number."""
    if isinstance(completion, str):
        text = completion
    else:
        turns = [m for m in completion if m.get("role") == "assistant"]
        if not turns or turns[-1].get("tool_calls"):
            return None
        text = turns[-1].get("content") or ""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def exact_answer(prompts: list, completions: list, answer: list, **kwargs) -> list[float]:
    """The reward: 1.0 where the episode's final answer (`final_answer`) is the record's `answer`, else 0.0. Use as
    `reward.function: rlhfkit.tasks.agent:exact_answer`."""
    return [float(final_answer(c) == int(a)) for c, a in zip(completions, answer)]


# The steps agent.yaml runs -----------------------------------------------------------------------------------


def write_data(ctx, tool_traces: int, direct_traces: int, guessed_traces: int, rl_prompts: int, eval_prompts: int,
               seed: int) -> dict:
    """The SFT traces, the RL prompts and the held-out prompts (`make_splits`), one JSONL file each."""
    splits = make_splits(tool_traces, direct_traces, rl_prompts, eval_prompts, seed, guessed_traces)
    for name, records in splits.items():
        write_jsonl_rows(ctx.path_out(f"{name}.jsonl"), records)
    print(f"{len(splits['sft'])} SFT traces ({tool_traces} with the tool), {len(splits['rl'])} RL prompts, "
          f"{len(splits['eval'])} held out")
    return {"sft_traces": len(splits["sft"]), "rl_prompts": len(splits["rl"]), "eval_prompts": len(splits["eval"])}


def evaluate_all(ctx, max_new_tokens: int, quick: bool, seed: int) -> dict:
    """The SFT model, the GRPO model, and the GRPO model without tools on the held-out prompts (greedy, through the
    tool loop): eval.json and one samples file per method in this folder."""
    records = read_jsonl_rows(ctx.path("prompts", "eval.jsonl"))
    methods = {}
    for method, stage, tools in (("sft", "sft", True), ("grpo", "grpo", True), ("grpo_no_tools", "grpo", False)):
        t0 = time.time()
        methods[method], samples = evaluate(ctx.path(stage), records, max_new_tokens, tools)
        write_jsonl_rows(ctx.path_out(f"eval_samples_{method}.jsonl"), samples)
        print(f"  {method}: {methods[method]} ({time.time() - t0:.0f}s)", flush=True)
    result = {"quick": quick, "seed": seed, "eval_prompts": len(records), "methods": methods,
              "acceptance": acceptance(methods)}
    atomic_write_text(ctx.path_out("eval.json"), json.dumps(result, indent=2))
    print(format_table(methods))
    return {f"{m}/{k}": v for m, f in methods.items() for k, v in f.items() if isinstance(v, (int, float))}


@torch.no_grad()
def evaluate(model_dir: str, records: list[dict], max_new_tokens: int, tools: bool) -> tuple[dict, list[dict]]:
    """Greedy episodes of the model in `model_dir` on `records`, one batch, through the tool loop, with the task's
    tools or none; -> (the figures of `rlhfkit eval`'s agent section: `evaluation.agent.agent_figures`, the task judge
    being `exact_answer`; one sample row per episode)."""
    from rlhfkit import templates
    from rlhfkit.config import GenerationConfig, ModelConfig
    from rlhfkit.evaluation.agent import agent_figures
    from rlhfkit.models import load_causal_lm, load_tokenizer
    from rlhfkit.config.sections import ToolsConfig
    from rlhfkit.rollout.maker import tool_loop
    from rlhfkit.tools import Toolbox
    from rlhfkit.types import PromptBatch

    cfg = ModelConfig(name_or_path=model_dir)
    tok = load_tokenizer(cfg)
    templates.load("chatml_tools").apply_to(tok)
    model = load_causal_lm(cfg, tok, trainable=False).eval()
    params = GenerationConfig(max_new_tokens=max_new_tokens, top_k=1)
    limits = ToolsConfig(max_calls=2, timeout_s=5.0, max_result_tokens=64)
    loop = tool_loop(tok, params, 0, Toolbox([multiply]) if tools else Toolbox([], NoTools), limits)
    seed_only = PromptBatch(torch.zeros(len(records), 1, dtype=torch.long), torch.ones(len(records), 1, dtype=torch.long))
    ro = loop(model, seed_only, [{"prompt": r["prompt"], "columns": {}} for r in records], 0)
    answers = [r["answer"] for r in records]
    figures = agent_figures(ro.tools, ro.completions, exact_answer([], list(ro.completions), answers))
    samples = [{"question": r["prompt"][-1]["content"], "answer": r["answer"], "episode": c,
                "answered": final_answer(c)} for r, c in zip(records, ro.completions)]
    return figures.as_dict(), samples


def acceptance(methods: dict) -> dict[str, bool]:
    """The issue's bars for one seed (the goal is over 3 seeds' means)."""
    done = {m: methods[m]["task_completion"] or 0.0 for m in ("grpo", "sft")}
    return {"grpo_task_completion>=0.80": done["grpo"] >= 0.80,
            "grpo_task_completion>=sft+0.15": done["grpo"] >= done["sft"] + 0.15,
            "grpo_format_accuracy>=0.95": (methods["grpo"]["format_accuracy"] or 0.0) >= 0.95}


def format_table(methods: dict) -> str:
    cols = [("task done", "task_completion"), ("format ok", "format_accuracy"), ("calls/ep", "calls_per_episode"),
            ("malformed/call", "malformed_per_call"), ("turns/ep", "turns_per_episode")]
    lines = [f"{'method':<15}" + "".join(f"{c:>12}" for c, _ in cols)]
    for m, f in methods.items():
        lines.append(f"{m:<15}" + "".join(f"{(f[k] or 0) * 100:>11.1f}%" if k in ("task_completion", "format_accuracy")
                                          else f"{f[k]:>12.2f}" for _, k in cols))
    return "\n".join(lines)
