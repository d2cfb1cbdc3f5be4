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

import dataclasses
import json
import os
import random
import re
import time
from dataclasses import dataclass

import torch
import yaml

from rlhfkit.errors import UserError
from rlhfkit.io import atomic_write_text, check_writable

SYSTEM_PROMPT = "You are a helpful assistant. Use the multiply tool for products of large numbers."
STAGES = ("prompts", "sft", "grpo", "eval")
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


@dataclass(frozen=True)
class AgentSize:
    """How much of everything a run uses, budgeted for 2 shared CPU cores (about 15 minutes a seed), where a token
    costs most when trained (every prompt carries the tool's schema: about 280 of an SFT trace's 310 tokens)."""

    tool_traces: int = 40
    direct_traces: int = 8
    guessed_traces: int = 56
    sft_epochs: float = 3.0
    sft_lr: float = 1e-3
    # Decayed over 3 epochs, the first token's choice (call the tool, or answer) settles near the traces' share
    # (40 of 96 large products), where one epoch at a constant rate left it wherever the last batches pushed it
    sft_scheduler: str = "linear"
    rl_prompts: int = 64
    grpo_steps: int = 8
    grpo_batch: int = 4  # prompts per step
    num_samples: int = 4  # episodes per prompt (GRPO's group)
    grpo_lr: float = 3e-4
    temperature: float = 1.0  # the RL rollouts' (the evaluation is greedy)
    kl_coef: float = 0.0
    eval_prompts: int = 24
    # The whole completion: the call (~35 tokens: a digit is a token), the tool result and header (~25), the answer
    max_new_tokens: int = 96
    max_prompt_length: int = 320
    max_length: int = 448
    # LoRA on the top 8 of SmolLM2's 30 layers: the backward pass stops there (about half a full LoRA step's cost)
    lora_layers: str = r".*\.layers\.(2[2-9])\.(self_attn|mlp)\.\w+_proj"


QUICK = AgentSize(tool_traces=6, direct_traces=2, guessed_traces=2, rl_prompts=8, grpo_steps=2, grpo_batch=2, num_samples=2,
                  grpo_lr=1e-3, eval_prompts=4, max_new_tokens=12, max_prompt_length=960, max_length=1024,
                  lora_layers="all-linear")


def _write_jsonl(path: str, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class AgentDemo:
    """The agent demo's stages, in `STAGES` order; each reads what the earlier ones wrote to `output_dir`."""

    def __init__(self, output_dir: str = "runs/agent", quick: bool = False, seed: int = 0, size: AgentSize | None = None,
                 overwrite: bool = False):
        from rlhfkit.tasks.demo import GGUF_FILE, smollm2_dir

        self.output_dir, self.quick, self.seed, self.overwrite = output_dir, quick, seed, overwrite
        self.size = size or (QUICK if quick else AgentSize())
        self.base = {"model.name_or_path": "tiny"} if quick else {"model.name_or_path": smollm2_dir(),
                                                                   "model.gguf_file": GGUF_FILE}
        self.lora = {"model.lora.enabled": True, "model.lora.r": 16, "model.lora.alpha": 32, "model.lora.dropout": 0.0,
                     "model.lora.target_modules": self.size.lora_layers}
        self.common = {"seed": seed, "overwrite": overwrite, "logging.logging_steps": 1, "optim.scheduler": "constant",
                       "logging.progress_bar": False, "model.chat_template": "chatml_tools",
                       "data.max_length": self.size.max_length, "data.max_prompt_length": self.size.max_prompt_length}
        self.timings: dict[str, float] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.output_dir, name)

    def need(self, *names: str) -> None:
        missing = [n for n in names if not os.path.exists(self.path(n))]
        if missing:
            raise UserError(f"'{self.output_dir}' has no {', '.join(missing)}: run the earlier stages first "
                            f"(rlhfkit demo --agent{' --quick' if self.quick else ''} --output-dir {self.output_dir})")

    def run(self, from_stage: str = "prompts") -> dict:
        if from_stage not in STAGES:
            raise UserError(f"--from-stage must be one of {', '.join(STAGES)} with --agent, got '{from_stage}'")
        check_writable(self.output_dir, "--output-dir")
        if from_stage == "prompts" and not self.overwrite and os.path.isdir(self.output_dir) and os.listdir(self.output_dir):
            raise UserError(f"--output-dir '{self.output_dir}' is not empty: pass --overwrite to replace the demo in it, "
                            f"or --from-stage {'|'.join(STAGES[1:])} to rerun its later stages")
        self.common["overwrite"] = self.overwrite or from_stage != "prompts"
        os.makedirs(self.output_dir, exist_ok=True)
        atomic_write_text(self.path("config.yaml"), yaml.safe_dump(
            {"agent_demo": {"quick": self.quick, "seed": self.seed, "from_stage": from_stage, "system_prompt": SYSTEM_PROMPT,
                            **dataclasses.asdict(self.size)}, "model": self.base, "lora": self.lora}, sort_keys=False))
        t_start, result = time.time(), {}
        for name in STAGES[STAGES.index(from_stage):]:
            print(f"\n=== agent demo: {name} ===", flush=True)
            t0 = time.time()
            out = getattr(self, f"stage_{name}")()
            self.timings[name] = time.time() - t0
            print(f"--- {name}: {self.timings[name]:.1f}s (total {time.time() - t_start:.1f}s)", flush=True)
            result = out if name == "eval" else result
        self.timings["total"] = time.time() - t_start
        result["timings_s"] = self.timings
        if from_stage != "prompts":
            result["from_stage"] = from_stage  # the earlier stages' outputs (and times) are a previous run's
        atomic_write_text(self.path("eval.json"), json.dumps(result, indent=2))
        print(format_table(result["methods"]))
        return result

    def stage_prompts(self) -> None:
        s = self.size
        splits = make_splits(s.tool_traces, s.direct_traces, s.rl_prompts, s.eval_prompts, self.seed, s.guessed_traces)
        for name, records in splits.items():
            _write_jsonl(self.path(f"{name}.jsonl"), records)
        print(f"{len(splits['sft'])} SFT traces ({s.tool_traces} with the tool), {len(splits['rl'])} RL prompts, "
              f"{len(splits['eval'])} held out")

    def stage_sft(self) -> None:
        from rlhfkit.tasks.demo import _train

        self.need("sft.jsonl")
        _train("sft", {**self.base, **self.lora, **self.common, "data.train": self.path("sft.jsonl"),
                       "output_dir": self.path("sft"), "num_epochs": self.size.sft_epochs, "optim.lr": self.size.sft_lr,
                       "optim.scheduler": self.size.sft_scheduler,
                       "optim.per_device_batch_size": 8})

    def stage_grpo(self) -> None:
        from rlhfkit.tasks.demo import _train

        self.need("rl.jsonl", "sft")
        s = self.size
        _train("grpo", {
            **self.lora, **self.common, "model.name_or_path": self.path("sft"), "data.train": self.path("rl.jsonl"),
            "output_dir": self.path("grpo"), "max_steps": s.grpo_steps, "tools.functions": [f"{__name__}:multiply"],
            "tools.max_calls": 2, "tools.timeout_s": 5.0, "reward.function": f"{__name__}:exact_answer",
            "generation.max_new_tokens": s.max_new_tokens, "generation.temperature": s.temperature,
            "generation.num_samples": s.num_samples, "kl.coef": s.kl_coef, "algo.algorithm": "grpo",
            "algo.rollout_batch_size": s.grpo_batch, "algo.ppo_epochs": 1, "algo.num_minibatches": 2,
            "optim.lr": s.grpo_lr, "optim.per_device_batch_size": s.grpo_batch * s.num_samples // 2})

    def stage_eval(self) -> dict:
        self.need("eval.jsonl", "sft", "grpo")
        records = _read_jsonl(self.path("eval.jsonl"))
        methods = {}
        for method, model_dir, tools in (("sft", "sft", True), ("grpo", "grpo", True), ("grpo_no_tools", "grpo", False)):
            t0 = time.time()
            methods[method], samples = evaluate(self.path(model_dir), records, self.size, tools)
            _write_jsonl(self.path(f"eval_samples_{method}.jsonl"), samples)
            print(f"  {method}: {methods[method]} ({time.time() - t0:.0f}s)", flush=True)
        return {"quick": self.quick, "seed": self.seed, "eval_prompts": len(records), "methods": methods,
                "acceptance": acceptance(methods)}


@torch.no_grad()
def evaluate(model_dir: str, records: list[dict], size: AgentSize, tools: bool) -> tuple[dict, list[dict]]:
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
    params = GenerationConfig(max_new_tokens=size.max_new_tokens, top_k=1)
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


def run_agent_demo(output_dir: str = "runs/agent", quick: bool = False, seed: int = 0, from_stage: str = "prompts",
                   overwrite: bool = False) -> dict:
    return AgentDemo(output_dir, quick=quick, seed=seed, overwrite=overwrite).run(from_stage)
