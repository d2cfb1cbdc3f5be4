"""The rates `rlhfkit plan` turns FLOPs, bytes and counts into seconds with, measured on this machine.

    nice -n 19 env OMP_NUM_THREADS=1 python bench/plan_calibrate.py [--device cpu|cuda] [--out FILE] [--no-stages]

Every figure is the process's own CPU seconds (`time.process_time`, the median of several repeats after a warm-up)
on one thread, so a loaded machine changes it little; on a GPU, wall seconds after `torch.cuda.synchronize`. The
models are random Llama-style decoders built here, on shapes that are NOT those of bench/plan_grid.py's cells (the
grid checks the planner; this bench feeds it), loaded through `rlhfkit.models` as a stage loads them (LoRA, 4-bit
QLoRA, gradient checkpointing):

- the achieved FLOP/s of a training forward+backward and of a no-grad forward (a wide model, where the matmuls
  dominate), and the bytes per second a decode step reads (a 60M-parameter model, which no cache holds);
- the fixed cost of one decoder layer (the operators' dispatch, which dominates small models) in a training
  forward+backward, a no-grad forward and a decode step, per mode (full, LoRA, QLoRA, each with and without gradient
  checkpointing for training), and its cost per token; one model call's fixed cost and its cost per token with
  logits; fitted by least squares on the same narrow model at 1, 3 and 5 layers and three lengths;
- AdamW's step (with clipping and zeroing) per parameter and per parameter tensor;
- each stage's own per-step work beyond all of the above (batching, rewards, advantages, logging), as the median
  CPU seconds of a real `rlhfkit.train` step on a calibration model minus what the planner counts for that step.

The figures go to rlhfkit/plan/rates.json under the device's name (`cpu`, or the GPU's name in the devices table),
with the date, machine, commit, thread count and load average; `rlhfkit.plan.timing` reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402

RATES = os.path.join(ROOT, "rlhfkit", "plan", "rates.json")
MODES = {"full": (False, False), "lora": (True, False), "qlora": (True, True)}  # (LoRA, 4-bit base)
# Calibration shapes (hidden, intermediate, heads, kv heads, layers, vocab): none is a grid model's (tiny: 64/2
# layers; SmolLM2-135M: 576/30 layers).
NARROW = dict(hidden=48, intermediate=96, heads=4, kv_heads=2, vocab=160)
WIDE = dict(hidden=512, intermediate=1376, heads=8, kv_heads=4, layers=2, vocab=4096)
BIG = dict(hidden=768, intermediate=2048, heads=12, kv_heads=4, layers=8, vocab=8192)
# A GPU reaches its rates only on larger matmuls: 0.2B and 0.5B-parameter decoders, in bf16.
GPU_WIDE = dict(hidden=2048, intermediate=5632, heads=16, kv_heads=8, layers=4, vocab=32000)
GPU_BIG = dict(hidden=2048, intermediate=5632, heads=16, kv_heads=8, layers=8, vocab=32000)
REPEATS = 9


class Clock:
    """CPU seconds of this process (one thread), or wall seconds after a CUDA synchronize on a GPU. On the CPU each
    repeat is followed by bench/plan_grid.py's `Probe`, and its seconds are scaled by the probe's reference (taken at
    the start: `reference`) over the probe's seconds after it: the figures of a run that other jobs slowed by half
    come out as those of the machine in the reference's state, which the grid's time pass scales its cells to."""

    def __init__(self, device: str, reference: float | None = None):
        self.device = device
        self.probe = None if device == "cuda" else __import__("plan_grid").Probe()
        self.reference = reference or (self.probe.reference() if self.probe else None)

    def now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def median(self, fn, repeats: int = REPEATS) -> float:
        fn()  # warm-up: allocations, optimizer states, kernels
        times = []
        for _ in range(repeats):
            t0 = self.now()
            fn()
            t = self.now() - t0
            times.append(t * self.reference / self.probe() if self.probe else t)
        return statistics.median(times)


def build(directory: str, hidden: int, intermediate: int, heads: int, kv_heads: int, layers: int, vocab: int) -> str:
    """A random Llama decoder saved to `directory`, with the tiny model's tokenizer files (so it loads as a stage's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhfkit.config import ModelConfig
    from rlhfkit.model_sources import resolve_model_path

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, num_hidden_layers=layers, vocab_size=vocab,
                         max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2,
                         bos_token_id=1)
    model = LlamaForCausalLM(config)
    (model.to(torch.bfloat16) if hidden >= 2048 else model).save_pretrained(directory)  # the GPU's shapes: bf16
    tiny = resolve_model_path(ModelConfig(name_or_path="tiny"))
    for name in os.listdir(tiny):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(tiny, name), directory)
    return directory


def load(directory: str, mode: str, ckpt: bool, device: str, trainable: bool = True):
    """The model as a stage loads it (`rlhfkit.models.load_causal_lm`); on a GPU in bf16 (its tensor cores' rate)."""
    from rlhfkit.config import LoraConfig, ModelConfig, QuantizationConfig
    from rlhfkit.models import load_causal_lm

    lora, four_bit = MODES[mode]
    cfg = ModelConfig(name_or_path=directory, lora=LoraConfig(enabled=lora, r=8), gradient_checkpointing=ckpt,
                      quantization=QuantizationConfig(load_in_4bit=four_bit),
                      dtype="bfloat16" if device == "cuda" else "float32")
    model = load_causal_lm(cfg, trainable=trainable)
    return model if four_bit else model.to(device)


def shape_of(directory: str):
    from rlhfkit.plan.shape import load_shape

    return load_shape(directory, "calibration model")


def tokens(rows: int, length: int, vocab: int, device: str) -> torch.Tensor:
    return torch.randint(3, min(vocab, 100), (rows, length), generator=torch.Generator().manual_seed(0)).to(device)


def train_pass(model, ids):
    """A training forward and backward as the stages run theirs (`forwards.scoring_forward`: no KV cache), the model
    put in training mode once, as the loops do (a switch walks every module)."""
    model.train()

    def run():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    return run


def forward_pass(model, ids):
    """A no-grad forward as the stages' scoring forwards run (no KV cache), in eval mode set once."""
    model.eval()

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    return run


def decode_run(model, rows: int, prompt: int, new: int, device: str):
    """rlhfkit's decode engine, `new` tokens for each of `rows` rows (no row stops early: no EOS id is ever drawn)."""
    from rlhfkit.config import GenerationConfig
    from rlhfkit.generation import generate
    from rlhfkit.types import PromptBatch

    ids = tokens(rows, prompt, 100, device)
    batch = PromptBatch(ids, torch.ones_like(ids))
    params = GenerationConfig(max_new_tokens=new)
    return lambda: generate(model, batch, params, eos_token_id=-1, pad_token_id=0)


LAYERS, LENGTHS = (1, 3, 5), (32, 96, 192)  # the narrow model's depths and lengths the fixed costs are fitted on
# A second width, at 1 and 3 layers: a layer's cost per token is fitted as a part per token and a part per element of
# its widths, which one width cannot tell apart (a tiny model's per-token work is mostly dispatch, not its widths).
BROADER = dict(hidden=96, intermediate=256, heads=4, kv_heads=2, vocab=160)
BROADER_LAYERS = (1, 3)


def split_costs(t: dict) -> tuple[float, float, float, float, float]:
    """(per layer, per call, per layer-token, per layer-token and width element, per call-token) seconds, least
    squares over t[width, layers, tokens] (FLOPs already taken off): t = layers·(a + (c + e·width)·tokens) + b +
    d·tokens."""
    import numpy as np

    keys = [k for k in t if isinstance(k[2], int)]
    x = np.array([[n, 1.0, n * tok, n * tok * w, tok] for w, n, tok in keys])
    y = np.array([t[k] for k in keys])
    a, b, c, e, d = np.linalg.lstsq(x, y, rcond=None)[0]
    if e < 0:  # no part per width element at these widths (a cost cannot fall with the width): the fit without it
        a, b, c, d = np.linalg.lstsq(x[:, [0, 1, 2, 4]], y, rcond=None)[0]
        e = 0.0
    return float(a), float(b), float(c), float(e), float(d)


def layer_costs(clock: Clock, work: str, device: str, rates: dict) -> dict:
    """Per mode: one layer's fixed cost and its cost per token in a training forward+backward (with and without
    checkpointing) and a no-grad forward, its fixed cost in a decode step; one call's fixed cost and cost per token;
    from the narrow model at 1, 3 and 5 layers and a broader one at 1 and 3, each at three lengths (the FLOPs' share
    taken off at the rates measured on the wide model). A layer's cost per token is a part per token (`layer_token_*`:
    the dispatch of its norms, activations, rotary, residuals) and a part per element of its widths, hidden +
    intermediate (`token_*`: their memory traffic; small matmuls' shortfall); a call's per token is stored per
    vocabulary entry (the log-softmax and the loss over the logits). The decode step's from the narrow model."""
    from rlhfkit.plan.layout import Forward
    from rlhfkit.plan.timing import forward_flops

    models = [(NARROW, n) for n in LAYERS] + [(BROADER, n) for n in BROADER_LAYERS]
    dirs = {(s["hidden"] + s["intermediate"], n): build(os.path.join(work, f"narrow{s['hidden']}-{n}"), layers=n, **s)
            for s, n in models}
    shapes = {k: shape_of(d) for k, d in dirs.items()}
    rows, lengths, dec_rows, prompt, new = 3, LENGTHS, 6, 12, 24
    width, vocab = NARROW["hidden"] + NARROW["intermediate"], NARROW["vocab"]
    out = {k: {} for k in ("layer_train", "layer_token_train", "token_train", "layer_forward", "layer_token_forward",
                           "token_forward", "layer_decode", "calls")}
    for mode in MODES:
        for ckpt in (False, True):
            t, f = {}, {}
            for (w, n), d in dirs.items():
                model = load(d, mode, ckpt, device)
                backward = 2 if mode == "full" else 1
                for length in lengths:
                    ids, tok = tokens(rows, length, vocab, device), rows * length
                    flops = forward_flops(shapes[w, n], "lm", Forward(rows, length, length, True)) * (1 + backward + ckpt)
                    t[w, n, tok] = clock.median(train_pass(model, ids)) - flops / rates["train_flops"]
                    if not ckpt:
                        flops = forward_flops(shapes[w, n], "lm", Forward(rows, length, length, False))
                        f[w, n, tok] = clock.median(forward_pass(model, ids)) - flops / rates["forward_flops"]
                if not ckpt and w == width:
                    f[w, n, "dec"] = clock.median(decode_run(model, dec_rows, prompt, new, device), 3)
            key = mode + ("+ckpt" if ckpt else "")
            a, b, c, e, d = split_costs(t)
            out["layer_train"][key], out["layer_token_train"][key], out["token_train"][key] = a, c, e
            out["calls"][f"train {key}"], out["calls"][f"train token {key}"] = b, d / vocab
            if not ckpt:
                a, b, c, e, d = split_costs(f)
                out["layer_forward"][mode], out["layer_token_forward"][mode], out["token_forward"][mode] = a, c, e
                out["calls"][f"forward {mode}"], out["calls"][f"forward token {mode}"] = b, d / vocab
                # a decode run: the prefill (a no-grad forward of dec_rows x prompt tokens) and `new` steps
                per_token = c + e * width
                per_step = {n: (f[width, n, "dec"] - (n * (a + per_token * dec_rows * prompt) + b + d * dec_rows * prompt))
                            / new for n in LAYERS}
                slope = (per_step[LAYERS[-1]] - per_step[LAYERS[0]]) / (LAYERS[-1] - LAYERS[0])
                out["layer_decode"][mode] = slope
                out["calls"][f"decode {mode}"] = statistics.mean(per_step[n] - slope * n for n in LAYERS)
            print(json.dumps({"mode": key, "train": {str(k): round(v, 6) for k, v in t.items()},
                              "forward": {str(k): round(v, 6) for k, v in f.items()}}), flush=True)
    return out


def compute_rates(clock: Clock, work: str, device: str, overhead: dict) -> dict:
    """Achieved FLOP/s of training and no-grad forwards on the wide model and the cost per weight of one call (what a
    call spends on its weights whatever its tokens: reading them, and in training writing their gradients), from two
    sizes of batch, and decode bytes/s on the big one, each after its fixed costs (`overhead`: per layer and per call,
    zero on the first pass). At few tokens a large model's call is mostly its weights' traffic: SmolLM2-135M's
    backward over 32 tokens took three times its forward."""
    from rlhfkit.plan.layout import Forward
    from rlhfkit.plan.timing import forward_flops, matmul_params

    wide_shape, big_shape = (GPU_WIDE, GPU_BIG) if device == "cuda" else (WIDE, BIG)
    wide = build(os.path.join(work, "wide"), **wide_shape) if not os.path.isdir(os.path.join(work, "wide")) else \
        os.path.join(work, "wide")
    s = shape_of(wide)
    model = load(wide, "full", False, device)
    width, weights_n = s.hidden + s.intermediate, matmul_params(s, "lm")
    per_token = {kind: overhead.get(f"layer_token_{kind}", 0) + overhead.get(f"token_{kind}", 0) * width
                 for kind in ("train", "forward")}
    net = {}  # (kind, tokens) -> (FLOPs, seconds beyond the fixed costs)
    for rows, length in ((8, 512), (1, 64)) if device == "cuda" else ((2, 160), (1, 32)):
        ids, n = tokens(rows, length, wide_shape["vocab"], device), rows * length
        for kind, run, times in (("train", train_pass, 3), ("forward", forward_pass, 1)):
            fixed = s.layers * (overhead.get(f"layer_{kind}", 0) + per_token[kind] * n) + \
                overhead.get(f"call_{kind}", 0) + overhead.get(f"logit_{kind}", 0) * s.vocab * n
            flops = times * forward_flops(s, "lm", Forward(rows, length, length, kind == "train"))
            net[kind, n] = flops, clock.median(run(model, ids), 3) - fixed
    out = {}
    for kind in ("train", "forward"):  # seconds = FLOPs / rate + weights x per-weight cost, at both sizes
        (f1, t1), (f2, t2) = net[kind, max(n for k, n in net if k == kind)], net[kind, min(n for k, n in net if k == kind)]
        rate = (f1 - f2) / (t1 - t2)
        out[f"{kind}_flops"], out[f"param_{kind}"] = rate, max(0.0, (t2 - f2 / rate) / weights_n)
    train_flops, forward = out["train_flops"], out["forward_flops"]
    big = build(os.path.join(work, "big"), **big_shape) if not os.path.isdir(os.path.join(work, "big")) else \
        os.path.join(work, "big")
    b = shape_of(big)
    del model
    model = load(big, "full", False, device, trainable=False)
    dec_rows, prompt, new = 4, 8, 12
    t_dec = clock.median(decode_run(model, dec_rows, prompt, new, device), 3)
    prefill = forward_flops(b, "lm", Forward(dec_rows, prompt, 1, False)) / forward + b.layers * overhead.get(
        "layer_forward", 0) + overhead.get("call_forward", 0) + matmul_params(b, "lm") * out["param_forward"]
    per_step = (t_dec - prefill) / new - b.layers * overhead.get("layer_decode", 0) - overhead.get("decode_token", 0)
    each = 2 if device == "cuda" else 4  # bf16 on a GPU, fp32 on the CPU
    weights = each * b.params("lm")
    kv = 2 * b.layers * dec_rows * b.kv_heads * b.head_dim * each * (prompt + new / 2)
    return {**out, "decode_bytes": (weights + kv) / per_step}


def optimizer_costs(clock: Clock, work: str, device: str) -> dict:
    """AdamW's step with clipping and zeroing (as `rlhfkit.trainers.optim` makes it: fused), per parameter and per
    tensor, from two parameter sets: many small tensors and a few large ones."""
    def step_cost(tensors: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.zeros(numel, device=device)) for _ in range(tensors)]
        opt = torch.optim.AdamW(params, lr=1e-5, fused=True)

        def run():
            for p in params:
                p.grad = torch.ones_like(p)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return clock.median(run)

    small, large = (400, 64), (4, 2_000_000)
    t_small, t_large = step_cost(*small), step_cost(*large)
    # t = tensors * a + params * b, two equations
    (n1, p1), (n2, p2) = (small[0], small[0] * small[1]), (large[0], large[0] * large[1])
    per_param = (t_large - t_small * n2 / n1) / (p2 - p1 * n2 / n1)
    per_tensor = (t_small - p1 * per_param) / n1
    return {"optimizer_param": max(per_param, 0.0), "optimizer_tensor": max(per_tensor, 0.0)}


def tool_costs(clock: Clock) -> dict:
    """The tool loop's Python work per episode (`rollout.tool_loop`): its prompt rendered with a tool's schema by the
    chat template, and a sampled turn parsed for calls by the response template; the tiny model's tokenizer with the
    bundled chatml_tools template (which the calibration models share), a question of one line and a turn that calls
    the tool."""
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import load_tokenizer
    from rlhfkit.tasks.agent import multiply
    from rlhfkit.tools import describe

    tok = load_tokenizer(ModelConfig(name_or_path="tiny", chat_template="chatml_tools"))
    schemas, question = [describe(multiply).schema], [{"role": "user", "content": "What is 12 times 13? Use the tool."}]
    render = lambda messages, header: list(tok.apply_chat_template(  # noqa: E731
        messages, tools=schemas, add_generation_prompt=header, tokenize=True, return_dict=False))
    prompt = render(question, True)
    called = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 13}}}]}
    turn = render(question + [called], False)[len(prompt):]
    return {"tool_render": clock.median(lambda: render(question, True)),
            "tool_parse": clock.median(lambda: tok.parse_response(turn, prefix=prompt, tools=schemas))}


STAGE_CELLS = ["sft", "rm", "dpo", "kto", "ppo", "grpo", "online_dpo", "rft"]
STAGE_STEPS = 9  # steps of each stage run: the median of the 8 after the first


def averaged(entry: dict, paths: list[str], name: str) -> dict:
    """`entry`'s rates, each the mean of this run's and those of the same device in the rates files `paths` (earlier
    calibration runs: the load of a shared machine moves a single run's figures by a fifth or more)."""
    others = [json.load(open(p))[name] for p in paths]
    out = dict(entry)
    for key, value in entry.items():
        if key in ("threads", "source", "calls", "stage_step", "probe_s"):
            continue
        values = [value] + [o[key] for o in others]
        out[key] = ({m: statistics.mean(v[m] for v in values) for m in value} if isinstance(value, dict)
                    else statistics.mean(values))
    loads = [o["source"].split("(load ")[1].split(")")[0] for o in others if "(load " in o["source"]]
    out["source"] = entry["source"] + f", the mean of {len(paths) + 1} runs (the others at load {', '.join(loads)})"
    return out


STAGE_SHAPES = ((3, 80), (2, 48))  # (micro-batch, length) of the stage runs: none a grid cell's


def stage_costs(work: str, clock: Clock, stages: list[str] = STAGE_CELLS) -> tuple[dict, list]:
    """Each stage's own work per step, by mode (full, LoRA, QLoRA: the adapters' own bookkeeping, the reference as
    the base with its adapters off): real `rlhfkit.train` runs on the calibration model (3 narrow layers, micro-batch
    and length each of STAGE_SHAPES, rollouts of 3 prompts x 2 samples: none a grid cell's shape), CPU seconds per
    step as bench/plan_grid.py times them (scaled by the probe), minus the step the planner counts without it; the
    mean over the shapes, so that what the planner miscounts at one shape weighs less. RFT's from its SFT steps alone
    (its sampling is counted apart). A negative remainder (the planner counts more than the stage spends) is kept:
    it is what corrects the stage. Keys: the stage, "stage+lora", "stage+qlora"."""
    import rlhfkit
    from plan_grid import cell_config, normalised, run_time_cell, time_overrides, write_data

    model = build(os.path.join(work, "calib"), layers=3, **NARROW)
    data = write_data(work)
    costs, rows = {}, []
    for stage, mode in ((s, m) for s in stages for m in MODES):
        key = stage if mode == "full" else f"{stage}+{mode}"
        remainders = []
        for mb, length in STAGE_SHAPES:
            overrides = cell_config(stage, model, mode, False, mb, length, data, os.path.join(work, "run"))
            if stage in ("ppo", "grpo", "online_dpo"):
                overrides["algo.rollout_batch_size"] = 3
            timed = run_time_cell(stage, overrides, STAGE_STEPS, clock.probe)
            planned = rlhfkit.plan(stage, overrides=time_overrides(stage, overrides, STAGE_STEPS), device="cpu")
            measured = normalised({**timed, "stage": stage}, clock.reference)
            counted = planned.seconds_per_step - planned.time_phases.get("stage", 0.0)
            if stage == "rft":  # the first iteration's SFT steps after its first (which samples)
                steps = [t * clock.reference / p for t, p in zip(timed["steps_cpu_s"], timed["probe_cpu_s"])]
                measured, counted = statistics.median(steps[1:len(steps) // 2]), planned.time_phases["update"]
            remainders.append(measured - counted)
            rows.append([f"{key} ({mb}x{length})", f"{measured:.4f}", f"{counted:.4f}", f"{measured - counted:+.4f}"])
            print(json.dumps({"stage": key, "mb": mb, "length": length, "measured": measured, "counted": counted}),
                  flush=True)
        costs[key] = statistics.mean(remainders)
    return costs, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--name", help="the device's name in the table (default: cpu, or the GPU's as matched)")
    parser.add_argument("--out", default=RATES, help="the rates file to update (default: rlhfkit/plan/rates.json)")
    parser.add_argument("--no-stages", action="store_true", help="skip the per-stage remainder (real runs)")
    parser.add_argument("--average", nargs="*", default=[], help="rates files of earlier runs on this device: "
                                                                 "the rates are the mean of all the runs")
    parser.add_argument("--results", default=None, help="where plan_rates.{json,md} go (default: docs/results)")
    parser.add_argument("--only-stages", nargs="+", choices=STAGE_CELLS,
                        help="measure again only these stages' remainders (after a change to their loop or to what "
                             "the planner counts of them), at the rates and probe reference already in --out")
    parser.add_argument("--only-rates", action="store_true",
                        help="measure again only the FLOP rates, the per-weight costs and the decode bandwidth, at "
                             "the fixed costs and probe reference already in --out")
    args = parser.parse_args()
    if args.only_rates:
        return rerate(args.out, args.name or "cpu", args.results)
    if args.only_stages:
        return restage(args.out, args.name or "cpu", args.only_stages, args.results)
    device, name = args.device, args.name or "cpu"
    if device == "cuda" and not args.name:
        from rlhfkit.plan.devices import device_matching

        found = device_matching(torch.cuda.get_device_name(0), torch.cuda.mem_get_info()[1] / 2**30)
        name = found.name if found else torch.cuda.get_device_name(0)
    clock = Clock(device)
    work = tempfile.mkdtemp(prefix="plan-calibrate-")
    load0 = os.getloadavg()[0]
    rates = compute_rates(clock, work, device, {})
    print(json.dumps(rates), flush=True)
    fixed = layer_costs(clock, work, device, rates)
    calls = fixed.pop("calls")
    overhead = {"layer_train": fixed["layer_train"]["full"], "layer_forward": fixed["layer_forward"]["full"],
                "layer_decode": fixed["layer_decode"]["full"], "call_train": calls["train full"],
                "call_forward": calls["forward full"], "decode_token": calls["decode full"],
                "token_train": fixed["token_train"]["full"], "token_forward": fixed["token_forward"]["full"],
                "layer_token_train": fixed["layer_token_train"]["full"],
                "layer_token_forward": fixed["layer_token_forward"]["full"],
                "logit_train": calls["train token full"], "logit_forward": calls["forward token full"]}
    rates = compute_rates(clock, work, device, overhead)  # again, its fixed costs now known
    from results import commit

    threads = torch.get_num_threads() if device == "cpu" else None
    entry = {**rates, **fixed, "call_train": calls["train full"], "call_forward": calls["forward full"],
             "decode_token": calls["decode full"], "logit_train": calls["train token full"],
             "logit_forward": calls["forward token full"], **optimizer_costs(clock, work, device), **tool_costs(clock), "threads": threads,
             "calls": calls, **({"probe_s": clock.reference} if clock.reference else {})}
    stamp = (f"measured {time.strftime('%Y-%m-%d')} by bench/plan_calibrate.py on {os.cpu_count()} cores"
             f"{', ' + str(threads) + ' thread' + ('s' if threads != 1 else '') if threads else ''} "
             f"(load {load0:.1f}), rlhfkit {commit()}")
    entry["source"] = stamp
    entry = averaged(entry, args.average, name) if args.average else entry
    table = json.load(open(args.out)) if os.path.isfile(args.out) else {}
    table[name] = {**entry, "stage_step": {}}
    write(args.out, table)
    stage_rows = []
    if not args.no_stages:
        entry["stage_step"], stage_rows = stage_costs(work, clock) if device == "cpu" else ({}, [])
        table[name] = entry
        write(args.out, table)
    publish(name, entry, stage_rows, args.results)
    shutil.rmtree(work, ignore_errors=True)


def restage(path: str, name: str, stages: list[str], results: str | None) -> None:
    """`--only-stages`: the remainders of `stages` measured again on the CPU, scaled to the probe reference the rates
    in `path` were measured at; the other rates and remainders kept."""
    from results import commit

    table = json.load(open(path))
    entry = table[name]
    clock = Clock("cpu", entry["probe_s"])
    work = tempfile.mkdtemp(prefix="plan-calibrate-")
    costs, rows = stage_costs(work, clock, stages)
    entry["stage_step"].update(costs)
    entry["source"] = entry["source"].split("; the remainders of")[0] + (
        f"; the remainders of {', '.join(stages)} measured again {time.strftime('%Y-%m-%d')} at rlhfkit {commit()} "
        f"(load {os.getloadavg()[0]:.1f})")
    write(path, table)
    publish(name, entry, rows, results)
    shutil.rmtree(work, ignore_errors=True)


def rerate(path: str, name: str, results: str | None) -> None:
    """`--only-rates`: `compute_rates` again on the CPU at the fixed costs in `path`, scaled to its probe reference."""
    from results import commit

    table = json.load(open(path))
    entry = table[name]
    keys = ("layer_train", "layer_forward", "layer_decode", "token_train", "token_forward", "layer_token_train",
            "layer_token_forward")
    overhead = {k: entry[k]["full"] for k in keys if k in entry}
    overhead.update({k: entry[k] for k in ("call_train", "call_forward", "decode_token", "logit_train", "logit_forward")})
    work = tempfile.mkdtemp(prefix="plan-calibrate-")
    entry.update(compute_rates(Clock("cpu", entry["probe_s"]), work, "cpu", overhead))
    entry["source"] = entry["source"].split("; the FLOP rates")[0] + (
        f"; the FLOP rates and per-weight costs measured again {time.strftime('%Y-%m-%d')} at rlhfkit {commit()} "
        f"(load {os.getloadavg()[0]:.1f})")
    write(path, table)
    publish(name, entry, [], results)
    shutil.rmtree(work, ignore_errors=True)


def write(path: str, table: dict) -> None:
    with open(path, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
        f.write("\n")


def publish(name: str, e: dict, stage_rows: list, directory: str | None = None) -> None:
    """The rates as a table in docs/results/plan_rates.md (bench/results.py: date, machine, commit)."""
    from results import record

    ms = lambda v: f"{v * 1e3:.3f} ms"  # noqa: E731
    rows = [["training forward+backward", f"{e['train_flops'] / 1e9:.1f} GFLOP/s"],
            ["no-grad forward (prefill, scoring)", f"{e['forward_flops'] / 1e9:.1f} GFLOP/s"],
            *[[f"{what} call per million weights", ms(e[key] * 1e6)] for what, key in (
                ("training", "param_train"), ("no-grad", "param_forward")) if key in e],
            ["decode step reads", f"{e['decode_bytes'] / 1e9:.2f} GB/s"]]
    for kind in ("layer_train", "layer_forward", "layer_decode"):
        rows += [[f"{kind.replace('_', ' ')} ({mode})", ms(v)] for mode, v in e[kind].items()]
    us = lambda v: f"{v * 1e6:.4f} µs"  # noqa: E731
    for kind in ("train", "forward"):
        rows += [[f"layer {kind} per token ({mode})", f"{us(v)} + {us(e[f'token_{kind}'][mode])} per width element"]
                 for mode, v in e.get(f"layer_token_{kind}", {}).items()]
    rows += [["model call with gradient", ms(e["call_train"])], ["model call without gradient", ms(e["call_forward"])],
             ["decode step beyond its layers", ms(e["decode_token"])],
             ["optimizer per million parameters", ms(e["optimizer_param"] * 1e6)],
             ["optimizer per tensor", ms(e["optimizer_tensor"])]]
    rows += [[f"tool loop: {what}", ms(e[key])] for what, key in (("a prompt rendered", "tool_render"),
                                                                   ("a turn parsed", "tool_parse")) if key in e]
    rows += [["probe reference (bench/plan_grid.py's Probe)", ms(e["probe_s"])]] if "probe_s" in e else []
    for key, value in e["stage_step"].items():  # this run's shapes beside the remainders it measured
        shapes = "; ".join(f"{s.split('(')[1][:-1]}: measured {float(m) * 1e3:.2f}, counted {float(c) * 1e3:.2f}"
                           for s, m, c, _ in stage_rows if s.split(" (")[0] == key)
        rows.append([f"stage step remainder: {key}", f"{value * 1e3:+.2f} ms" + (f" ({shapes})" if shapes else "")])
    record("plan_rates", f"rlhfkit plan's measured rates for `{name}`", ["quantity", "value"], rows,
           command="nice -n 19 env OMP_NUM_THREADS=1 python bench/plan_calibrate.py",
           notes=[f"{e['source']}. CPU seconds of the process (time.process_time; on a GPU wall seconds after a "
                  "synchronize), median of repeats after a warm-up."],
           **({"directory": directory} if directory else {}))


if __name__ == "__main__":
    main()
