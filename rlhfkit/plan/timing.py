"""A step's time on a device: what its forwards, backwards, decode steps and optimizer steps cost at the rates
bench/plan_calibrate.py measured on that device (`rates.json`), or at the sheet's rates times a default efficiency,
marked unmeasured, where nothing was measured yet.

A step's seconds are the sum of
- compute: FLOPs (2N per token forward, 4N more backward for full fine-tuning, 2N for LoRA and a frozen body; a
  second forward under gradient checkpointing; attention's QKᵀ and AV) over the achieved FLOP/s of training or of
  no-grad forwards, and per call the weights' own traffic (read, and in full fine-tuning their gradients written),
  which a call of few tokens is mostly made of; a decode step reads the weights and the KV cache once (bytes over the achieved bytes/s), or is
  bound by its FLOPs, whichever is slower;
- fixed costs, the operators' own dispatch, which dominate small models: per decoder layer of each forward+backward,
  forward and decode step (by mode: full, LoRA, QLoRA; with gradient checkpointing), per layer and token (a part of
  its own and a part per element of the layer's widths), per model call (embedding,
  final norm, head, loss), per decode step (sampling, the cache's bookkeeping);
- the optimizer: AdamW with clipping and zeroing, per trained parameter and per trained tensor;
- the stage's own work per step (batching, rewards, advantages, logging), measured as what remains of a real step.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from rlhfkit.plan.devices import Device
from rlhfkit.plan.layout import Forward, Generation, Layout
from rlhfkit.plan.shape import ModelShape

RATES_FILE = os.path.join(os.path.dirname(__file__), "rates.json")
# Achieved / sheet rate for a device nothing was measured on: a rough figure, and said to be one.
DEFAULT_EFFICIENCY = {"train": 0.4, "forward": 0.4, "decode": 0.3}


@dataclass(frozen=True)
class Rates:
    """What one device achieves. Rates per second; costs in seconds."""

    train_flops: float  # FLOP/s of training forwards and backwards
    forward_flops: float  # FLOP/s of no-grad forwards (prefill, reference, scoring)
    decode_bytes: float  # bytes/s a decode step reads (the weights, the KV cache)
    # one call's cost per weight its tokens multiply through, whatever the tokens: a training call's (the weights read
    # in its forward and backward, their gradients written), a no-grad call's (the weights read once)
    param_train: float = 0.0
    param_forward: float = 0.0
    layer_train: dict[str, float] = field(default_factory=dict)  # one layer's forward+backward, by mode ("lora+ckpt")
    layer_forward: dict[str, float] = field(default_factory=dict)  # one layer's no-grad forward, by mode
    layer_decode: dict[str, float] = field(default_factory=dict)  # one layer's part of a decode step, by mode
    # one layer's cost per token: a part per token whatever its widths (`layer_token_*`: the dispatch of its norms,
    # activations, rotary, residuals) and a part per element of its widths, hidden + intermediate (`token_*`: their
    # memory traffic, and what small matmuls fall short of the FLOP rate); by mode
    layer_token_train: dict[str, float] = field(default_factory=dict)
    layer_token_forward: dict[str, float] = field(default_factory=dict)
    token_train: dict[str, float] = field(default_factory=dict)
    token_forward: dict[str, float] = field(default_factory=dict)
    call_train: float = 0.0  # one model call with gradient beyond its layers: embedding, final norm, head, loss
    call_forward: float = 0.0  # the same without gradient
    logit_train: float = 0.0  # per token with logits and per vocabulary entry: the log-softmax, the loss, casts
    logit_forward: float = 0.0
    decode_token: float = 0.0  # one decode step beyond its layers: the head, sampling, the cache's bookkeeping
    tool_render: float = 0.0  # the tool loop: one episode's prompt rendered with the tools' schemas (chat template)
    tool_parse: float = 0.0  # the tool loop: one sampled turn parsed for tool calls (the response template)
    optimizer_param: float = 0.0  # one optimizer step, per trained parameter
    optimizer_tensor: float = 0.0  # one optimizer step, per trained tensor
    stage_step: dict[str, float] = field(default_factory=dict)  # a stage's own work per step ("grpo", "grpo+lora")
    threads: int | None = None  # the threads the rates were measured with (None: a GPU)
    source: str = ""  # where the figures come from, in words
    measured: bool = False

    @classmethod
    def nominal(cls, device: Device) -> "Rates":
        """The sheet's rates times DEFAULT_EFFICIENCY, no fixed costs: unmeasured."""
        return cls(device.flops * DEFAULT_EFFICIENCY["train"], device.flops * DEFAULT_EFFICIENCY["forward"],
                   device.bandwidth * DEFAULT_EFFICIENCY["decode"],
                   source=f"unmeasured: {device.sheet} rates x default efficiency {DEFAULT_EFFICIENCY}")

    @classmethod
    def from_dict(cls, data: dict) -> "Rates":
        names = {f for f in cls.__dataclass_fields__ if f != "measured"}
        return cls(**{k: v for k, v in data.items() if k in names}, measured=True)


def measured_rates(path: str | None = None) -> dict[str, dict]:
    """{device name: the rates bench/plan_calibrate.py measured}: from `path`, else the file RLHFKIT_PLAN_RATES names
    (a machine's own calibration, `plan_calibrate.py --out FILE`), else the rates.json that ships."""
    path = path or os.environ.get("RLHFKIT_PLAN_RATES") or RATES_FILE
    if not os.path.isfile(path) and path == RATES_FILE:
        return {}
    from rlhfkit.plan.shape import read_json

    return read_json(path, "rates file (RLHFKIT_PLAN_RATES)" if path != RATES_FILE else "rates file")


def rates_for(device: Device, table: dict[str, dict] | None = None) -> Rates:
    """The measured rates of `device` (by its name), else its nominal ones."""
    table = measured_rates() if table is None else table
    return Rates.from_dict(table[device.name]) if device.name in table else Rates.nominal(device)


@dataclass(frozen=True)
class StepTime:
    seconds: float | None  # per planned step (an optimizer step; online: a rollout and its update); None: no rates
    phases: dict[str, float]  # phase -> seconds
    measured: bool  # the rates used were measured on this device
    basis: str = ""  # the rates' source: the date, machine and thread count they were measured with


def matmul_params(shape: ModelShape, head: str) -> int:
    """Parameters a token multiplies through: the layers' linears and the head (the embedding is a lookup)."""
    return shape.linear_params + (shape.vocab * shape.hidden if head == "lm" else shape.hidden)


def forward_flops(shape: ModelShape, head: str, f: Forward) -> float:
    """2 FLOPs per parameter and token, plus attention's QKᵀ and AV (causal: half the T² square)."""
    tokens = f.rows * f.length
    attention = 2 * shape.layers * f.rows * f.length**2 * shape.heads * shape.head_dim
    return 2 * matmul_params(shape, head) * tokens + attention


def mode_of(lay: Layout) -> str:
    """The policy's mode for the fixed costs: "qlora", "lora" or "full" (a head-only RM's body runs as full)."""
    return "qlora" if lay.quantized else "lora" if lay.train == "lora" else "full"


def layer_cost(table: dict[str, float], key: str) -> float:
    """The per-layer cost of `key` ("lora+ckpt"), falling back to the mode without checkpointing, then to full."""
    return table.get(key, table.get(key.split("+")[0], table.get("full", 0.0)))


def trained_seconds(lay: Layout, r: Rates) -> float:
    """One micro-batch's training forward and backward: the policy's, and PPO's separate critic on the same rows.
    Backward: 2x the forward's FLOPs for full fine-tuning, 1x for LoRA (activation gradients only), none for a
    head-only RM; a second forward under gradient checkpointing."""
    f, ckpt = lay.trained, "+ckpt" if lay.checkpointing else ""
    fwd = forward_flops(lay.policy, lay.head, f)
    backward = {"full": 2.0, "lora": 1.0, "head": 0.0}[lay.train]
    recompute = 1.0 if lay.checkpointing and lay.train != "head" else 0.0
    seconds = fwd * (1 + backward + recompute) / r.train_flops + fixed_train(lay.policy, f, mode_of(lay) + ckpt, r)
    # the weights' traffic: full fine-tuning's as measured; frozen weights are read in the forward and the backward
    # (LoRA) or in the forward only (a head-only RM's body), with no gradient written; once more when recomputed
    again = recompute * r.param_forward
    per_weight = {"full": r.param_train, "lora": 2 * r.param_forward, "head": r.param_forward}[lay.train] + again
    seconds += matmul_params(lay.policy, lay.head) * per_weight
    scores = dataclasses.replace(f, logit_len=0)
    if lay.critic is not None:
        seconds += forward_flops(lay.critic, "score", f) * (3 + recompute) / r.train_flops
        seconds += fixed_train(lay.critic, scores, "full" + ckpt, r) + matmul_params(lay.critic, "score") * (
            r.param_train + again)
    if lay.value_adapter:  # the critic's adapter on the policy's base: a LoRA pass of its own over the same rows
        seconds += forward_flops(lay.policy, "score", f) * (2 + recompute) / r.train_flops
        seconds += fixed_train(lay.policy, scores, mode_of(lay) + ckpt, r) + matmul_params(lay.policy, "score") * (
            2 * r.param_forward + again)
    return seconds


def fixed_train(s: ModelShape, f: Forward, key: str, r: Rates) -> float:
    """A training call's costs beyond its FLOPs: per layer, per layer-token, per call, per logit."""
    per_token = layer_cost(r.layer_token_train, key) + layer_cost(r.token_train, key) * (s.hidden + s.intermediate)
    per_layer = layer_cost(r.layer_train, key) + per_token * f.rows * f.length
    return s.layers * per_layer + r.call_train + r.logit_train * s.vocab * f.rows * f.logit_len


def fixed_forward(s: ModelShape, f: Forward, mode: str, r: Rates) -> float:
    """The same for a no-grad call."""
    per_token = layer_cost(r.layer_token_forward, mode) + layer_cost(r.token_forward, mode) * (s.hidden + s.intermediate)
    per_layer = layer_cost(r.layer_forward, mode) + per_token * f.rows * f.length
    return s.layers * per_layer + r.call_forward + r.logit_forward * s.vocab * f.rows * f.logit_len


def frozen_seconds(lay: Layout, r: Rates, compute_bytes: float) -> float:
    """One set of no-grad forwards (`lay.frozen`): the policy's (π_old; the reference as the LoRA base, adapters off)
    or a separate reference's for logits, a reward model's or the critic's for scores. π_old's is left out where
    the run takes the update's or the sampler's log-probs instead (`lay.pi_old`)."""
    seconds = 0.0
    free = lay.pi_old == "free" or (lay.pi_old == "free_in_fp32" and compute_bytes == 4)
    for g in lay.frozen[1:] if free else lay.frozen:
        if g.logit_len:
            model, mode = lay.policy, mode_of(lay) if lay.reference is None else "full"
        else:  # a reward model, the separate critic, or the critic's adapter on the policy's base
            model = lay.rewards[0] if lay.rewards else lay.critic or lay.policy
            mode = mode_of(lay) if lay.value_adapter and not lay.rewards else "full"
        head = "lm" if g.logit_len else "score"
        seconds += forward_flops(model, head, g) / r.forward_flops + fixed_forward(model, g, mode, r)
        seconds += matmul_params(model, head) * r.param_forward
    return seconds


def trained_tensors(lay: Layout) -> tuple[int, int]:
    """(parameters, tensors) the optimizer steps: LoRA's A and B per adapted linear, or every weight of the policy
    (and of PPO's separate critic)."""
    def full(s: ModelShape, head: str) -> tuple[int, int]:
        per_layer = s.layer_tensors
        top = 1 if head == "score" else 0 if s.tied else 1
        return s.params(head), s.layers * per_layer + 2 + top

    if lay.train == "head":
        params, tensors = lay.policy.hidden, 1
    elif lay.train == "lora":
        params, tensors = lay.adapters, 2 * len(lay.lora_targets) * lay.policy.layers
    else:
        params, tensors = full(lay.policy, lay.head)
    if lay.critic is not None:
        critic = full(lay.critic, "score")
        params, tensors = params + critic[0], tensors + critic[1]
    return params, tensors


def optimizer_seconds(lay: Layout, r: Rates) -> float:
    params, tensors = trained_tensors(lay)
    return params * r.optimizer_param + tensors * r.optimizer_tensor


def decode_seconds(lay: Layout, r: Rates, weight_bytes: float, compute_bytes: float) -> float:
    """Prefill (FLOP-bound) plus one step per new token, each reading the weights and the average KV cache (bytes),
    or bound by its FLOPs where those take longer."""
    g, s, mode = lay.generation, lay.policy, mode_of(lay)
    f = Forward(g.rows, g.prompt_len, 1, False)
    prefill = forward_flops(s, "lm", f) / r.forward_flops + fixed_forward(s, f, mode, r) + matmul_params(s, "lm") * \
        r.param_forward
    kv_per_token = 2 * s.layers * g.rows * s.kv_heads * s.head_dim * compute_bytes
    read = weight_bytes + kv_per_token * (g.prompt_len + g.new_tokens / 2)
    flops = forward_flops(s, "lm", Forward(g.rows, 1, 1, False))
    step = max(read / r.decode_bytes, flops / r.forward_flops) + s.layers * layer_cost(r.layer_decode, mode)
    return prefill + g.new_tokens * (step + r.decode_token) + tool_rounds_seconds(g, s, mode, r)


def tool_rounds_seconds(g: Generation, s: ModelShape, mode: str, r: Rates) -> float:
    """The tool loop's turns beyond the decode steps (which the results' tokens only replace: max_new_tokens bounds
    the whole completion): per round, one no-grad forward of each row's result through the KV cache (its attention
    over the cache at the turn's average position); per episode, its prompt rendered once and each turn parsed. The
    tools' own run time is the user's code and is not planned."""
    if not g.rounds:
        return 0.0
    f = Forward(g.rows, g.result_len, 1, False)
    context = g.prompt_len + g.new_tokens / 2
    cache = 4 * s.layers * g.rows * g.result_len * context * s.heads * s.head_dim  # QKᵀ and AV over the cache
    extend = (forward_flops(s, "lm", f) + cache) / r.forward_flops + fixed_forward(s, f, mode, r) + \
        matmul_params(s, "lm") * r.param_forward
    return g.rounds * extend + g.rows * (r.tool_render + (g.rounds + 1) * r.tool_parse)


def step_time(lay: Layout, device: Device, weight_bytes: float, compute_bytes: float,
              table: dict[str, dict] | None = None) -> StepTime:
    """Seconds per planned step on `device`; None when it has no rates (a device named by its memory alone).
    `table`: the measured rates by device name (default: rates.json)."""
    if not device.flops:
        return StepTime(None, {}, False)
    r = rates_for(device, table)
    update = lay.micro_batches * trained_seconds(lay, r) + lay.frozen_batches * frozen_seconds(lay, r, compute_bytes)
    phases = {"update": update + lay.optimizer_steps * optimizer_seconds(lay, r)}
    mode = mode_of(lay)
    stage = r.stage_step.get(lay.stage if mode == "full" else f"{lay.stage}+{mode}", r.stage_step.get(lay.stage))
    if stage is not None:
        phases["stage"] = stage
    if lay.generation is not None:
        phases["generation"] = lay.generations_per_step * decode_seconds(lay, r, weight_bytes, compute_bytes)
    return StepTime(sum(phases.values()), phases, r.measured, basis(device, r))


def basis(device: Device, r: Rates) -> str:
    """The rates' source; on the CPU, the threads the figure assumes when this process runs with another number."""
    import torch

    if device.name == "cpu" and r.threads and torch.get_num_threads() != r.threads:
        return f"{r.source}; assumes {r.threads} thread(s), this process has {torch.get_num_threads()}"
    return r.source
