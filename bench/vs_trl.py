"""rlhfkit against TRL on the same work: seconds per step, tokens/s, peak memory and the ratio, per method.

DPO, reward model, GRPO and RLOO run against TRL 1.16 (the installed `trl`); PPO against TRL 1.12, the last release
with a PPO trainer, installed beside the repository (two TRL versions can't share a process, so it is put first on
`sys.path` in its own worker process):

    pip install --no-deps --target .bench-trl112 'trl==1.12.*'

Both libraries get the same weights and tokenizer (a model saved once to a temporary directory), the same data, batch
sizes, lengths, samples per prompt, epochs, learning rate, KL coefficient and reward, with gradient checkpointing off
and the same precision. The reward is a Python function for GRPO (`rlhfkit.tasks.toy:vowel_reward`) and a reward
model for RLOO and PPO (a sequence-classification copy of the policy with a seeded random head, which also
initialises PPO's critic). Each library keeps its own defaults for everything the work does not depend on (optimizer
implementation, padding, logging code).

The work is counted, to show it is the same: forward passes of every model (a pre-hook on each base model:
calls and positions, split into decoding steps inside `generate`, no-grad forwards and forwards with gradients),
generated tokens (rows × new positions of every `generate` call), backward calls and optimizer steps. Differences
that remain are printed under each method.

How it is measured:
  - one worker process per library × method (`_worker`), so peak memory is that process's own: the peak resident
    set size on CPU (VmHWM; shown beside it, "at import", the RSS once the library's trainer module is
    imported, before any model loads: the two libraries import different amounts, and import more while they set
    up, so the peak itself is compared), `torch.cuda.max_memory_allocated` on a GPU;
  - the workers of a method are alive together but take turns: each pauses at a step boundary and the parent
    resumes one at a time, in alternating order (A B, B A, ...), so that a shared machine's load falls on both;
  - a step is the time between two step boundaries (after the optimizer step(s) of a rollout or batch), pauses
    excluded: it includes data loading, generation, scoring, updates and per-step logging (every step, both sides);
  - s/step is the median over the steps after the warm-up steps; tokens/s is tokens per step / median s/step, where
    tokens are the non-pad tokens of the trained batch (DPO, RM: chosen + rejected) or the generated tokens (online:
    rows × new positions);
  - TRL 1.12's PPO runs twice: as shipped, and with its two per-step `gc.collect()` calls made no-ops.

    python bench/vs_trl.py                        # every method, CPU shape (tiny 2-layer Llama, batch 8, 16 new tokens)
    python bench/vs_trl.py --method grpo ppo      # some methods
    python bench/vs_trl.py --shape gpu            # the GPU shapes of issue 12 (random SmolLM2-135M shape, bf16)
    python bench/vs_trl.py --blocks 8 --block 10  # more measured steps
    python bench/vs_trl.py --shape gpu --set pairs=2 new_tokens=4   # change a shape's field
    python bench/vs_trl.py --shape gpu --compiled grpo --method-timeout 120 --json f.json  # as bench/device.sh runs it

The GPU shapes are written but not yet measured (no device so far); bench/DEVICE.md is the prepared run on a lent
H200 (bench/device.sh: wheels, TRL 1.12 and this script's GPU table in one call, with `--method-timeout`).

The figures, with the date, the machine, its load and the commit, are in docs/results/vs_trl.md (written by this
script's own `record_table` when it runs every method as shipped), and what keeps a method under 1.3x is in
docs/results.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL112_DIR = os.path.join(ROOT, ".bench-trl112")
METHODS = ["dpo", "rm", "grpo", "rloo", "ppo"]
LIBS = {m: ["rlhfkit", "trl"] for m in METHODS} | {"ppo": ["rlhfkit", "trl112", "trl112-nogc"]}
LABEL = {"rlhfkit": "rlhfkit", "trl": "TRL 1.16", "trl112": "TRL 1.12", "trl112-nogc": "TRL 1.12, no gc"}

# The shapes. Online: `prompts` × `samples` rows per step (PPO: `ppo_prompts` × 1), all in one micro-batch.
SHAPES = {
    "cpu": {"model": "tiny", "pairs": 8, "prompts": 2, "samples": 4, "ppo_prompts": 8, "new_tokens": 16, "ppo_epochs": 4,
            "max_length": 128, "max_prompt_length": 64, "pair_tokens": None, "precision": "no"},
    "gpu": {"model": "smollm2-135m-shape", "pairs": 16, "prompts": 16, "samples": 4, "ppo_prompts": 64,
            "new_tokens": 128, "ppo_epochs": 4, "max_length": 512, "max_prompt_length": 128, "pair_tokens": 256,
            "precision": "bf16"},
}
# Steps per library and shape: warm-up, then `blocks` blocks of `block` steps taking turns. CPU: each method under a
# minute on 2 loaded CPU cores, start-up included (PPO has fewer: TRL 1.12 as shipped takes ~0.6 s a step there).
# GPU: a lent device is quiet and its time is short (bench/DEVICE.md); the online steps take ~3-5 s each there, so
# the online methods measure 4 steps per library and the whole table fits in about 4 minutes.
STEPS = {
    "cpu": {"dpo": (4, 10, 6), "rm": (4, 10, 6), "grpo": (4, 8, 6), "rloo": (4, 8, 6), "ppo": (3, 5, 6)},
    "gpu": {"dpo": (3, 4, 3), "rm": (3, 4, 3), "grpo": (1, 2, 2), "rloo": (1, 2, 2), "ppo": (1, 2, 2)},
}
LR = 1e-4
BETA = {"dpo": 0.1, "grpo": 0.04, "rloo": 0.05, "ppo": 0.05}  # DPO's β; the online KL coefficients


# ---------------------------------------------------------------------------------------------------------------
# 1. Inputs both libraries share: model directories and data files.
# ---------------------------------------------------------------------------------------------------------------


def char_tokenizer(vocab_size: int | None = None):
    """rlhfkit's tiny character-level ChatML tokenizer; with `vocab_size`, padded with never-produced tokens up to it
    (a random model of that vocabulary samples any id, and every id must decode)."""
    from rlhfkit.model_sources import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    if vocab_size is not None and vocab_size > len(tok):
        tok.add_tokens([f"<|x{i}|>" for i in range(vocab_size - len(tok))])
    return tok


def build_models(root: str, shape: dict) -> tuple[str, str]:
    """Save the policy (and its tokenizer) and the reward model; return their directories."""
    import torch
    import transformers
    from transformers import (
        AutoModelForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    from rlhfkit.model_sources import build_tiny_model

    transformers.logging.set_verbosity_error()  # the reward model's new head is expected
    transformers.logging.disable_progress_bar()

    policy, rm = os.path.join(root, "policy"), os.path.join(root, "reward_model")
    if shape["model"] == "tiny":
        build_tiny_model(policy)  # rlhfkit's `model.name_or_path: tiny`: 2 layers of 64, vocab 103
        tok = char_tokenizer()
    else:  # SmolLM2-135M's shape (30 layers of 576, vocab 49152), random weights
        tok = char_tokenizer(49152)
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                             rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
        model.save_pretrained(policy)
        tok.save_pretrained(policy)
    torch.manual_seed(1)  # the reward model: the policy's weights and a seeded random score head
    reward = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1)
    reward.config.pad_token_id = tok.pad_token_id
    reward.save_pretrained(rm)
    tok.save_pretrained(rm)
    return policy, rm


def build_data(root: str, shape: dict) -> dict[str, str]:
    """The preference pairs and prompts: rlhfkit's data/tiny files, or (with `pair_tokens`) longer synthetic pairs
    of about that many tokens each (chosen and rejected sequences) with the tiny task's words."""
    files = {"pairs": os.path.join(ROOT, "data/tiny/pref_train.jsonl"), "prompts": os.path.join(ROOT, "data/tiny/prompts_train.jsonl")}
    if shape["pair_tokens"]:
        from rlhfkit.tasks import toy

        rng = random.Random(0)
        words = toy.POSITIVE + toy.NEGATIVE + toy.KINDS + ["the", "it", "was", "very", "and", "a"]

        def text(chars: int) -> str:
            out = ""
            while len(out) < chars:
                out += " ".join(rng.choice(words) for _ in range(8)).capitalize() + ". "
            return out[:chars].strip()

        files["pairs"] = os.path.join(root, "pairs.jsonl")
        n = shape["pair_tokens"]  # the char tokenizer: one token per character, ~20 for the ChatML markup
        with open(files["pairs"], "w") as f:
            for _ in range(256):
                f.write(json.dumps({"prompt": text(n * 2 // 5), "chosen": text(n // 2), "rejected": text(n // 2)}) + "\n")
    return files


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# 2. The worker: one library, one method; counts the work and pauses at step boundaries.
# ---------------------------------------------------------------------------------------------------------------


class Meter:
    """Step boundaries, the work counters and the pause/resume protocol with the parent (JSON lines on `out`,
    "go" lines on stdin)."""

    def __init__(self, out, total: int, pauses: set[int], cuda: bool):
        self.out, self.total, self.pauses, self.cuda = out, total, pauses, cuda
        self.steps = 0
        self.started = False
        self.t_resume = 0.0
        self.c_resume = 0.0
        self.in_generate = False
        self.counts: dict[str, float] = {}
        self.intervals: list[dict] = []
        self.rss_imports = rss_mb()

    def add(self, key: str, n: float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def send(self, **msg) -> None:
        self.out.write(json.dumps(msg) + "\n")
        self.out.flush()

    def wait(self, **msg) -> None:
        self.send(**msg)
        if sys.stdin.readline().strip() != "go":
            os._exit(3)

    def start(self) -> None:
        """Boundary 0, before the first step: hook every model, then wait for the parent."""
        if self.started:
            return
        self.started = True
        self.models = hook_models(self)
        self.wait(state="ready", models=self.models)
        self.resume()

    def resume(self) -> None:
        self.counts = {}
        self.sync()
        self.t_resume = time.perf_counter()
        self.c_resume = time.process_time()

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def boundary(self) -> None:
        """The end of a step: record it; pause where the parent asked; at the last step report and exit at once (so
        that nothing after the measured steps — a final save — runs beside another library's steps)."""
        self.sync()
        self.intervals.append({"s": time.perf_counter() - self.t_resume, "cpu_s": time.process_time() - self.c_resume,
                               **{k: float(v) for k, v in self.counts.items()}})
        self.steps += 1
        if self.steps >= self.total:
            self.send(state="done", intervals=self.intervals, peak_mb=peak_mb(self.cuda), rss_imports_mb=self.rss_imports,
                      models=self.models, threads=torch_threads())
            os._exit(0)
        if self.steps in self.pauses:
            self.wait(state="paused", steps=self.steps)
        self.resume()


def rss_mb() -> float:
    """This process's peak resident set size since it started (exec). Linux's VmHWM, not `ru_maxrss`: that one
    carries over the parent's peak across fork + exec."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB, macOS: bytes


def peak_mb(cuda: bool) -> float:
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return rss_mb()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def install_counters(meter: Meter) -> None:
    """Process-wide counters: generated tokens (every `generate`: transformers' and rlhfkit's own decode loop),
    backward calls, optimizer steps."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers.generation.utils import GenerationMixin

    generate = GenerationMixin.generate

    def counted_generate(self, *args, **kwargs):
        if meter.in_generate:  # inside rlhfkit's generate() (its "hf" engine): counted there
            return generate(self, *args, **kwargs)
        ids = kwargs.get("input_ids", args[0] if args else None)
        meter.in_generate = True
        try:
            out = generate(self, *args, **kwargs)
        finally:
            meter.in_generate = False
        seq = out if isinstance(out, torch.Tensor) else out.sequences
        meter.add("gen_calls")
        meter.add("gen_tokens", seq.shape[0] * (seq.shape[1] - ids.shape[1]))
        return out

    GenerationMixin.generate = counted_generate
    # rlhfkit samples through `rlhfkit.generation.generate` (its own decode loop by default, not transformers'
    # `generate`): wrapped under every name it was imported as. Tokens: rows x the rollout's response width.
    rl_generate = getattr(sys.modules.get("rlhfkit.generation"), "generate", None)
    if rl_generate is not None:
        def counted_rl_generate(*args, **kwargs):
            meter.in_generate = True
            try:
                rollout = rl_generate(*args, **kwargs)
            finally:
                meter.in_generate = False
            meter.add("gen_calls")
            meter.add("gen_tokens", rollout.response_ids.numel())
            return rollout

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("rlhfkit") and getattr(module, "generate", None) is rl_generate:
                module.generate = counted_rl_generate
    backward = torch.Tensor.backward

    def counted_backward(self, *args, **kwargs):
        meter.add("backward")
        return backward(self, *args, **kwargs)

    torch.Tensor.backward = counted_backward
    register_optimizer_step_post_hook(lambda *_: meter.add("opt_steps"))


def hook_models(meter: Meter) -> list[str]:
    """A forward pre-hook on every base model alive (the backbone of each policy, reference, reward and value model):
    calls and positions, as decoding steps ("gen"), no-grad forwards ("nograd") or forwards with gradients ("grad"),
    and the non-pad tokens of the forwards with gradients."""
    import torch
    from transformers import PreTrainedModel

    def hook(module, args, kwargs):
        if torch.compiler.is_compiling():  # inside a compiled step (generation.compile): not traced into its graph
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs["inputs_embeds"][..., 0]
        kind = "gen" if meter.in_generate else ("grad" if torch.is_grad_enabled() else "nograd")
        meter.add(f"fwd_{kind}")
        meter.add(f"pos_{kind}", ids.numel())
        mask = kwargs.get("attention_mask")
        if kind == "grad":
            # A tensor, read at the step boundary: no device sync inside the step.
            meter.add("tok_grad", mask.sum() if isinstance(mask, torch.Tensor) and mask.shape == ids.shape else ids.numel())

    names = []
    with warnings.catch_warnings():  # isinstance on deprecated module proxies, is_gradient_checkpointing
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, PreTrainedModel) and getattr(obj, "base_model", None) is obj:
                obj.register_forward_pre_hook(hook, with_kwargs=True)
                ckpt = " (gradient checkpointing)" if getattr(obj, "is_gradient_checkpointing", False) else ""
                names.append(f"{type(obj).__name__} {obj.dtype}".replace("torch.", "") + ckpt)
            elif isinstance(obj, torch.optim.Optimizer) and type(obj).__name__ != "AcceleratedOptimizer":
                impl = [k for k in ("fused", "foreach") if obj.defaults.get(k)] or ["for-loop"]
                names.append(f"{type(obj).__name__} ({impl[0]})")
    return sorted(names)


def worker(lib: str, method: str, spec: dict) -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' prints go to the log; stdout's copy carries the protocol
    sys.path.insert(0, ROOT)
    if lib.startswith("trl112"):
        sys.path.insert(0, TRL112_DIR)
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    # Import the library's trainer for this method before the "at import" RSS is read (TRL imports lazily).
    if lib == "rlhfkit":
        import importlib

        from rlhfkit.stages import STAGES

        importlib.import_module(STAGES[method][1].split(":")[0])
    else:
        import trl

        want = "1.12" if lib.startswith("trl112") else "1.16"
        if not trl.__version__.startswith(want):
            raise SystemExit(f"{lib}: expected trl {want}, imported {trl.__version__} from {trl.__file__}")
        if method == "ppo":
            import trl.experimental.ppo
        else:
            getattr(trl, {"dpo": "DPOTrainer", "rm": "RewardTrainer", "grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}[method])
    total = spec["warmup"] + spec["blocks"] * spec["block"]
    pauses = {spec["warmup"] + i * spec["block"] for i in range(spec["blocks"])}
    meter = Meter(out, total, pauses, torch.cuda.is_available())
    install_counters(meter)
    run = run_rlhfkit if lib == "rlhfkit" else run_trl
    run(lib, method, spec, meter, total)
    meter.send(state="error", message=f"training ended after {meter.steps} of {total} steps")


# 2a. rlhfkit: the real stage (`rlhfkit.stages.run_stage`), its `Run`'s step calls wrapped for the boundaries.


def run_rlhfkit(lib: str, method: str, spec: dict, meter: Meter, total: int) -> None:
    from rlhfkit.stages import run_stage, stage_config
    from rlhfkit.trainers.run import Run

    s = spec["shape"]
    o = [f"output_dir={spec['out']}", f"max_steps={total}", f"seed={spec['seed']}", f"optim.lr={LR}",
         "optim.scheduler=constant", "logging.logging_steps=1", "logging.progress_bar=false",
         f"mixed_precision='{s['precision']}'", f"data.max_length={s['max_length']}",
         f"data.max_prompt_length={s['max_prompt_length']}",
         f"model.name_or_path={spec['rm'] if method == 'rm' else spec['policy']}"]
    online = method in ("grpo", "rloo", "ppo")
    if not online:
        o += [f"data.train={spec['data']['pairs']}", f"optim.per_device_batch_size={s['pairs']}"]
        if method == "dpo":
            o += [f"algo.beta={BETA['dpo']}", "algo.loss_type=sigmoid"]
    else:
        prompts, samples = (s["ppo_prompts"], 1) if method == "ppo" else (s["prompts"], s["samples"])
        o += [f"data.train={spec['data']['prompts']}", f"generation.max_new_tokens={s['new_tokens']}",
              f"generation.num_samples={samples}", f"algo.rollout_batch_size={prompts}",
              f"optim.per_device_batch_size={prompts * samples}", "algo.num_minibatches=1",
              f"algo.ppo_epochs={s['ppo_epochs'] if method == 'ppo' else 1}", "kl.controller=fixed",
              f"kl.coef={BETA[method]}"]
        o += ["reward.function=rlhfkit.tasks.toy:vowel_reward"] if method == "grpo" else [f"reward.model=[{spec['rm']}]"]
        if method == "ppo":
            # TRL 1.12 takes π_old from the sampler's logits: so does rlhfkit's `auto` in fp32; in bf16 (the GPU shape)
            # `auto` recomputes, so the same work is asked for. TRL 1.12's PPO loop clips no gradient: neither does
            # rlhfkit here (it still measures the norm, its non-finite-gradient check).
            o += ["optim.max_grad_norm=null"] + (["algo.old_logprob_source=sampler"] if s["precision"] != "no" else [])
    cfg = stage_config(method, None, o + spec.get("rlhfkit_set", []))

    # A step's boundaries are the `Run` calls every rlhfkit loop makes: `begin` once its models are built, then
    # `step_end` after each step's optimizer step(s) (that step's logging falls in the next interval, as TRL's
    # `on_step_end` comes before its logging).
    begin, step_end = Run.begin, Run.step_end

    def at_begin(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        meter.start()

    def at_step_end(self, *args, **kwargs):
        step_end(self, *args, **kwargs)
        meter.boundary()

    Run.begin, Run.step_end = at_begin, at_step_end
    run_stage(method, cfg)


# 2b. TRL: the trainers as documented, a callback for the boundaries.


def run_trl(lib: str, method: str, spec: dict, meter: Meter, total: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    s = spec["shape"]
    bf16 = s["precision"] == "bf16"

    class Boundaries(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            meter.start()

        def on_step_end(self, args, state, control, **kwargs):
            meter.boundary()

    common = {"output_dir": spec["out"], "learning_rate": LR, "lr_scheduler_type": "constant", "logging_steps": 1,
              "report_to": "none", "save_strategy": "no", "bf16": bf16, "fp16": False, "gradient_checkpointing": False,
              "seed": spec["seed"], "disable_tqdm": True, "dataloader_pin_memory": False,
              "use_cpu": not torch.cuda.is_available()}
    tok = AutoTokenizer.from_pretrained(spec["policy"])
    # rlhfkit renders a plain-text prompt as a user turn of the chat template with the generation prompt, and a
    # response as its text and EOS. TRL gets that prompt text; it appends the EOS itself. (Given messages instead,
    # TRL would also train on the "\n" the template writes after each EOS.)
    render = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    callbacks = [Boundaries()]
    if method in ("dpo", "rm"):
        rows = [{"prompt": render(r["prompt"]), "chosen": r["chosen"], "rejected": r["rejected"]}
                for r in read_jsonl(spec["data"]["pairs"])]
        data = Dataset.from_list(rows)
        if method == "dpo":
            from trl import DPOConfig, DPOTrainer

            args = DPOConfig(**common, per_device_train_batch_size=s["pairs"], max_steps=total, beta=BETA["dpo"],
                             max_length=s["max_length"])
            model = AutoModelForCausalLM.from_pretrained(spec["policy"])
            ref = AutoModelForCausalLM.from_pretrained(spec["policy"])
            trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tok,
                                 callbacks=callbacks)
        else:
            from trl import RewardConfig, RewardTrainer

            args = RewardConfig(**common, per_device_train_batch_size=s["pairs"], max_steps=total, max_length=s["max_length"])
            model = AutoModelForSequenceClassification.from_pretrained(spec["rm"], num_labels=1)
            trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=callbacks)
        trainer.train()
        return
    prompts = [r["prompt"] for r in read_jsonl(spec["data"]["prompts"])]
    if method in ("grpo", "rloo"):
        from rlhfkit.tasks.toy import vowel_reward

        def reward(prompts, completions, **kwargs):
            return vowel_reward(prompts, completions)

        data = Dataset.from_list([{"prompt": render(p)} for p in prompts])
        batch = s["prompts"] * s["samples"]
        kw = dict(**common, per_device_train_batch_size=batch, num_generations=s["samples"], max_steps=total,
                  max_completion_length=s["new_tokens"], beta=BETA[method], num_iterations=1, temperature=1.0)
        model = AutoModelForCausalLM.from_pretrained(spec["policy"])
        if method == "grpo":
            from trl import GRPOConfig, GRPOTrainer

            trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(**kw), train_dataset=data,
                                  processing_class=tok, callbacks=callbacks)
        else:
            from trl import RLOOConfig, RLOOTrainer

            rm = AutoModelForSequenceClassification.from_pretrained(spec["rm"], num_labels=1)
            trainer = RLOOTrainer(model=model, reward_funcs=[rm], args=RLOOConfig(**kw), train_dataset=data,
                                  processing_class=tok, reward_processing_classes=[tok], callbacks=callbacks)
        trainer.train()
        return
    # PPO, TRL 1.12: prompts tokenized as rlhfkit does (chat template, generation prompt), left-padded.
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    if lib == "trl112-nogc":
        class NoCollect:
            @staticmethod
            def collect(*args, **kwargs):
                return 0

        ppo_module.gc = NoCollect  # the module's two per-step gc.collect() calls; nothing else changes

    tok.padding_side = "left"
    ids = [tok(render(p), add_special_tokens=False)["input_ids"][-s["max_prompt_length"]:] for p in prompts]
    data = Dataset.from_list([{"input_ids": i} for i in ids])
    n = s["ppo_prompts"]
    args = PPOConfig(**common, per_device_train_batch_size=n, gradient_accumulation_steps=1, num_mini_batches=1,
                     num_ppo_epochs=s["ppo_epochs"], total_episodes=total * n, response_length=s["new_tokens"],
                     local_rollout_forward_batch_size=n, kl_coef=BETA["ppo"], stop_token="eos", temperature=1.0,
                     num_sample_generations=0, vf_coef=0.1, missing_eos_penalty=None)
    load_cls = lambda: AutoModelForSequenceClassification.from_pretrained(spec["rm"], num_labels=1)
    trainer = PPOTrainer(args=args, processing_class=tok, model=AutoModelForCausalLM.from_pretrained(spec["policy"]),
                         ref_model=AutoModelForCausalLM.from_pretrained(spec["policy"]), reward_model=load_cls(),
                         value_model=load_cls(), train_dataset=data, eval_dataset=data.select(range(n)),
                         callbacks=callbacks)
    trainer.train()


# ---------------------------------------------------------------------------------------------------------------
# 3. The parent: start the workers of a method, take turns, summarise.
# ---------------------------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, lib: str, method: str, spec: dict, root: str, env: dict):
        self.lib, self.method = lib, method
        self.log_path = os.path.join(root, f"{method}-{lib}.log")
        spec = dict(spec, out=os.path.join(root, "runs", f"{method}-{lib}"))
        spec_path = os.path.join(root, f"{method}-{lib}.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        self.log = open(self.log_path, "w")  # noqa: SIM115 - open while the worker runs; closed in kill()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "_worker", lib, method.split("+")[0], spec_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     cwd=ROOT, env=env)
        self.result: dict | None = None

    def message(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"{self.method}/{self.lib} worker exited ({self.proc.returncode}); its log, "
                               f"{self.log_path}, ends with:\n{tail(self.log_path)}")
        msg = json.loads(line)
        if msg["state"] == "error":
            raise RuntimeError(f"{self.method}/{self.lib}: {msg['message']}\n{tail(self.log_path)}")
        if msg["state"] == "done":
            self.result = msg
            self.proc.wait()
        return msg

    def go(self) -> dict:
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # the worker is gone: message() reports how, with its log
            pass
        return self.message()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def tail(path: str, n: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def run_method(method: str, spec: dict, root: str, env: dict, libs: list[str] | None, timeout: float | None = None,
               tag: str = "") -> dict:
    """The workers of `method` take turns: the warm-up block, then `blocks` blocks in alternating order. After
    `timeout` seconds the workers are killed (the method then fails with their logs' tails, and the next one runs).
    `libs=[]` runs rlhfkit alone; `tag` names its files apart from an earlier run of the same method."""
    workers = [Worker(lib, method + tag, spec, root, env) for lib in LIBS[method]
               if lib == "rlhfkit" or libs is None or lib in libs]
    timer = threading.Timer(timeout, lambda: [w.proc.kill() for w in workers]) if timeout else None
    if timer:
        timer.daemon = True
        timer.start()
    try:
        for w in workers:
            w.message()  # "ready": models loaded and hooked, paused before the first step
        for w in workers:
            w.go()  # warm-up
        for b in range(spec["blocks"]):
            order = workers[b % len(workers):] + workers[: b % len(workers)]
            for w in order:
                w.go()
    except RuntimeError as exc:
        if timer and not timer.is_alive():
            raise RuntimeError(f"{method}: killed after the {timeout:.0f} s --method-timeout\n{exc}") from exc
        raise
    finally:
        if timer:
            timer.cancel()
        for w in workers:
            w.kill()
    return {w.lib: summarise(w.result, spec["warmup"]) for w in workers}


def summarise(result: dict, warmup: int) -> dict:
    steps = result["intervals"][warmup:]
    keys = sorted({k for s in steps for k in s if k not in ("s", "cpu_s")})
    work = {k: statistics.median(s.get(k, 0) for s in steps) for k in keys}
    times = sorted(s["s"] for s in steps)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]
    # The process's CPU seconds per step (all its threads): what a loaded machine's wait does not inflate, so the
    # ratio that still holds when other jobs share the cores (cache and memory-bandwidth contention aside).
    cpu = statistics.median(s.get("cpu_s", math.nan) for s in steps)
    return {"s_step": statistics.median(times), "p25": q(0.25), "p75": q(0.75), "n": len(times), "work": work, "cpu_s": cpu,
            "peak_mb": result["peak_mb"], "rss_imports_mb": result["rss_imports_mb"], "models": result["models"],
            "threads": result["threads"]}


def tokens(method: str, r: dict) -> float:
    """Tokens per step: the trained batch's non-pad tokens (DPO, RM) or the generated tokens (online)."""
    return r["work"].get("tok_grad", 0) if method in ("dpo", "rm") else r["work"].get("gen_tokens", 0)


WORK_KEYS = [("gen_tokens", "generated tokens"), ("fwd_gen", "generate forwards"), ("fwd_nograd", "no-grad forwards"),
             ("pos_nograd", "no-grad positions"), ("fwd_grad", "grad forwards"), ("pos_grad", "grad positions"),
             ("tok_grad", "grad non-pad tokens"), ("backward", "backward calls"), ("opt_steps", "optimizer steps")]


def report(method: str, res: dict, cuda: bool) -> list[str]:
    mem = "peak GPU MB" if cuda else "peak RSS MB (at import)"
    counts = ", ".join(f"{LABEL[k]}: {v['n']} steps" for k, v in res.items())
    lines = [f"\n== {method.upper()}  ({counts})",
             f"{'library':<18}{'s/step':>9}{'p25-p75':>16}{'CPU s/step':>11}{'tokens/s':>11}   {mem}"]
    for lib, r in res.items():
        m = f"{r['peak_mb']:.0f}" if cuda else f"{r['peak_mb']:.0f} ({r['rss_imports_mb']:.0f})"
        lines.append(f"{LABEL[lib]:<18}{r['s_step']:>9.4f}{r['p25']:>8.4f}-{r['p75']:<7.4f}{r['cpu_s']:>11.4f}"
                     f"{tokens(method, r) / r['s_step']:>11.0f}   {m}")
    ours = res["rlhfkit"]
    for lib, r in res.items():
        if lib == "rlhfkit":
            continue
        lines.append(f"ratio vs {LABEL[lib]}: step rate rlhfkit/TRL {r['s_step'] / ours['s_step']:.2f}x "
                     f"(>1: rlhfkit faster), CPU time {r['cpu_s'] / ours['cpu_s']:.2f}x; peak memory rlhfkit/TRL "
                     f"{ours['peak_mb'] / r['peak_mb']:.2f}x")
    for lib, r in res.items():
        counted = {m: r["models"].count(m) for m in r["models"]}
        lines.append(f"models, optimizer ({LABEL[lib]}): " + ", ".join(f"{n} × {m}" for m, n in counted.items()))
    lines.append("work per step (median):  " + " | ".join(f"{LABEL[k]}" for k in res))
    for key, name in WORK_KEYS:
        if key == "tok_grad" and method not in ("dpo", "rm"):
            continue  # online: the attention masks' bookkeeping after EOS differs, not the positions computed
        vals = [r["work"].get(key, 0) for r in res.values()]
        if any(vals):
            mark = "" if len(set(vals)) == 1 else "   <- differs"
            lines.append(f"  {name:<22}" + " | ".join(f"{v:>8g}" for v in vals) + mark)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", nargs="+", default=["all"], choices=METHODS + ["all"])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--warmup", type=int, help="steps per library before measuring (default: STEPS per method)")
    p.add_argument("--block", type=int, help="steps a library runs before the other takes its turn")
    p.add_argument("--blocks", type=int, help="measured blocks per library (alternating order)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: torch's default)")
    p.add_argument("--libs", nargs="+", choices=sorted(LABEL), help="run only these peers (rlhfkit always runs)")
    p.add_argument("--compiled", nargs="+", default=[], choices=["grpo", "rloo", "ppo"], metavar="METHOD",
                   help="after the table, run rlhfkit alone again on these online methods with generation.compile=true "
                        "(static KV cache, compiled decoding step: CUDA graphs on a GPU), compared with the peers' "
                        "figures from the method's own run; its first (warm-up) step compiles")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override a shape field, e.g. new_tokens=8")
    p.add_argument("--json", help="write the figures here as JSON (rewritten after each method)")
    p.add_argument("--method-timeout", type=float, help="seconds a method may take, start-up included; past it its "
                   "workers are killed, the method is reported as failed and the next one runs")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (models, data, logs)")
    args = p.parse_args(argv)
    methods = METHODS if "all" in args.method else args.method
    shape = dict(SHAPES[args.shape])
    for kv in args.set:
        k, _, v = kv.partition("=")
        shape[k] = type(shape[k])(v) if shape.get(k) is not None else (int(v) if v.isdigit() else v)
    if "ppo" in methods and not os.path.isdir(os.path.join(TRL112_DIR, "trl")):
        raise SystemExit(f"PPO needs TRL 1.12 in {TRL112_DIR}: pip install --no-deps --target {TRL112_DIR} 'trl==1.12.*'")
    if ROOT not in sys.path:  # rlhfkit from this checkout, also where it is not installed (the device machine)
        sys.path.insert(0, ROOT)
    import platform

    import torch

    cuda = torch.cuda.is_available()
    if args.shape == "gpu" and not cuda:
        print("note: --shape gpu without a GPU: figures are CPU figures", file=sys.stderr)
    root = tempfile.mkdtemp(prefix="vs-trl-")
    env = dict(os.environ, RLHFKIT_CACHE=os.path.join(root, "cache"), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    try:
        policy, rm = build_models(root, shape)
        spec = {"shape": shape, "policy": policy, "rm": rm, "data": build_data(root, shape), "threads": args.threads, "seed": args.seed}
        device = torch.cuda.get_device_name() if cuda else f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
        load0 = os.getloadavg()
        versions = package_versions()
        print(f"vs_trl: shape {args.shape} {shape}\n{device}; {time.strftime('%Y-%m-%d %H:%M')}; "
              f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; rlhfkit {git_state()}\n"
              + ", ".join(f"{k} {v}" for k, v in versions.items()))
        results, failed = {}, {}

        def save() -> None:  # after every method, so that a run stopped later keeps the figures so far
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"shape": args.shape, "params": shape, "device": device, "load_start": load0,
                               "load_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M"), "rlhfkit": git_state(),
                               "versions": versions, "results": results, "failed": failed}, f, indent=1)

        def steps(method: str) -> dict:  # warm-up, block, blocks: the options given, else the shape's STEPS
            given = (args.warmup, args.block, args.blocks)
            return dict(zip(("warmup", "block", "blocks"), (g if g is not None else d for g, d in zip(given, STEPS[args.shape][method]))))

        for method in methods:
            t0 = time.time()
            try:
                results[method] = run_method(method, dict(spec, **steps(method)), root, env, args.libs, args.method_timeout)
            except RuntimeError as exc:  # one method's failure (a worker's crash, the timeout) leaves the others to run
                failed[method] = str(exc)
                print(f"\n== {method.upper()} FAILED after {time.time() - t0:.0f} s: {exc}", flush=True)
            else:
                lines = report(method, results[method], cuda)
                any_r = next(iter(results[method].values()))
                lines.append(f"({time.time() - t0:.0f} s wall; torch threads per worker: {any_r['threads']}; "
                             f"load average now {os.getloadavg()[0]:.2f})")
                print("\n".join(lines), flush=True)
            save()
        for method in args.compiled:  # rlhfkit alone, compiled decoding; the peers' figures from the run above
            t0, name = time.time(), f"{method}+compile"
            try:
                ours = run_method(method, dict(spec, **steps(method), rlhfkit_set=["generation.compile=true"]), root, env,
                                  [], args.method_timeout, tag="+compile")
            except RuntimeError as exc:
                failed[name] = str(exc)
                print(f"\n== {name.upper()} FAILED after {time.time() - t0:.0f} s: {exc}", flush=True)
            else:
                results[name] = {**ours, **{k: v for k, v in results.get(method, {}).items() if k != "rlhfkit"}}
                lines = report(name, results[name], cuda)
                lines.insert(1, "(rlhfkit with generation.compile=true; the peers' figures are those of the run above; its "
                                "decoding steps run inside the compiled graph, which the forward hooks do not count)")
                lines.append(f"({time.time() - t0:.0f} s wall)")
                print("\n".join(lines), flush=True)
            save()
        print(summary(results, cuda))
        if failed:
            raise SystemExit(f"failed: {', '.join(failed)}")
        if "all" in args.method and not args.set and not args.libs:  # the docs' table: every method, as shipped
            record_table(results, cuda, args.shape, shape, device, (load0, os.getloadavg()))
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def package_versions() -> dict[str, str]:
    """The versions the workers import (TRL 1.12 from TRL112_DIR), read from the packages' metadata."""
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "trl", "datasets"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    found = metadata.distributions(path=[TRL112_DIR])
    out["trl (PPO)"] = next((d.version for d in found if d.metadata["Name"] == "trl"), "not installed")
    return out


def git_state() -> str:
    """The commit measured, and whether rlhfkit/ differs from it in the working tree."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "rlhfkit"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "(not a git checkout)"
    return f"at {head}" + (" + uncommitted changes in rlhfkit/" if dirty else "")


def work_difference(method: str, ours: dict, peer: dict) -> str:
    """The counted work per step where the peer's differs from rlhfkit's ("same" where none does)."""
    diffs = [f"{name} {peer['work'].get(key, 0):g} vs {ours['work'].get(key, 0):g}" for key, name in WORK_KEYS
             if not (key == "tok_grad" and method not in ("dpo", "rm"))
             and peer["work"].get(key, 0) != ours["work"].get(key, 0)]
    return "same" if not diffs else "peer: " + ", ".join(diffs)


def record_table(results: dict, cuda: bool, shape_name: str, shape: dict, device: str, load: tuple) -> None:
    """docs/results/vs_trl[_gpu].json and .md (bench/results.py): one row per method and peer."""
    from results import record

    rows = []
    for method, res in results.items():
        ours = res["rlhfkit"]
        rows += [[f"{method} ({LABEL[lib]})", f"{ours['s_step']:.4f}", f"{r['s_step']:.4f}",
                  f"{r['s_step'] / ours['s_step']:.2f}×", f"{r['cpu_s'] / ours['cpu_s']:.2f}×", work_difference(method, ours, r),
                  f"{ours['peak_mb']:.0f} / {r['peak_mb']:.0f}"]
                 for lib, r in res.items() if lib != "rlhfkit"]
    record("vs_trl" + ("" if shape_name == "cpu" else f"_{shape_name}"), "rlhfkit against TRL on the same work",
           ["method (peer)", "rlhfkit s/step", "TRL s/step", "TRL / rlhfkit (wall)", "TRL / rlhfkit (CPU time)",
            "work per step (forwards, positions, tokens, backwards, optimizer steps)",
            f"peak {'GPU' if cuda else 'RSS'} MB, rlhfkit / TRL"], rows,
           command="python bench/vs_trl.py" + ("" if shape_name == "cpu" else f" --shape {shape_name}"),
           notes=[f"Shape {shape_name} ({', '.join(f'{k}={v}' for k, v in shape.items())}) on {device}; medians after "
                  "warm-up, the libraries taking turns (A B, B A, ...); CPU time is each worker process's own CPU "
                  "seconds per step, which a loaded machine's waiting does not inflate. Load average (1, 5, 15 min) "
                  f"{load[0][0]:.1f} {load[0][1]:.1f} {load[0][2]:.1f} at the start, {load[1][0]:.1f} {load[1][1]:.1f} "
                  f"{load[1][2]:.1f} at the end."])


def summary(results: dict, cuda: bool) -> str:
    mem = "peak GPU MB" if cuda else "peak RSS MB"
    rows = [(f"\n{'method':<14}{'rlhfkit s/step':>15}{'TRL s/step':>13}{'ratio':>8}{'rlhfkit tok/s':>15}{'TRL tok/s':>11}"
            f"{'rlhfkit ' + mem:>22}{'TRL ' + mem:>18}")]
    for method, res in results.items():
        ours = res["rlhfkit"]
        for lib, r in res.items():
            if lib == "rlhfkit":
                continue
            name = method if lib in ("trl", "trl112") else f"{method} ({LABEL[lib].split(', ', 1)[1]})"
            rows.append(f"{name:<14}{ours['s_step']:>15.4f}{r['s_step']:>13.4f}{r['s_step'] / ours['s_step']:>7.2f}x"
                        f"{tokens(method, ours) / ours['s_step']:>15.0f}{tokens(method, r) / r['s_step']:>11.0f}"
                        f"{ours['peak_mb']:>22.0f}{r['peak_mb']:>18.0f}")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _, _, lib_, method_, spec_path_ = sys.argv
        with open(spec_path_) as f_:
            worker(lib_, method_, json.load(f_))
    else:
        main()
