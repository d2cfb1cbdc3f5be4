"""A step's time on a device: FLOPs of the forwards and backwards (2N per token forward, 4N more backward, plus
attention's 4·T·d per token and layer), decode steps bounded by memory bandwidth (the weights and the KV cache read
once per token), each divided by the device's rate times the efficiency bench/ measured for that phase
(`devices.efficiency`; marked unmeasured where there is none).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.plan.devices import Device, efficiency
from rlhfkit.plan.layout import Forward, Layout
from rlhfkit.plan.shape import ModelShape


@dataclass(frozen=True)
class StepTime:
    seconds: float | None  # per planned step (an optimizer step; online: a rollout and its update); None: no rates
    phases: dict[str, float]  # phase -> seconds
    measured: bool  # every efficiency used was measured on this device


def matmul_params(shape: ModelShape, head: str) -> int:
    """Parameters a token multiplies through: the layers' linears and the head (the embedding is a lookup)."""
    return shape.linear_params + (shape.vocab * shape.hidden if head == "lm" else shape.hidden)


def forward_flops(shape: ModelShape, head: str, f: Forward) -> float:
    """2 FLOPs per parameter and token, plus attention's QKᵀ and AV (causal: half the T² square)."""
    tokens = f.rows * f.length
    attention = 2 * shape.layers * f.rows * f.length**2 * shape.heads * shape.head_dim
    return 2 * matmul_params(shape, head) * tokens + attention


def update_flops(lay: Layout) -> float:
    """One micro-batch of the update: forward, backward (2x the forward for full fine-tuning, 1x for LoRA and a frozen
    body: gradients of the activations only), a second forward under gradient checkpointing."""
    f = lay.trained
    fwd = forward_flops(lay.policy, lay.head, f)
    if lay.critic is not None:
        fwd += forward_flops(lay.critic, "score", f)
    backward = {"full": 2.0, "lora": 1.0, "head": 0.0}[lay.train] * fwd
    recompute = fwd if lay.checkpointing and lay.train != "head" else 0.0
    frozen = sum(forward_flops(lay.policy if g.logit_len else (lay.rewards[0] if lay.rewards else lay.policy),
                               "lm" if g.logit_len else "score", g) for g in lay.frozen)
    return fwd + backward + recompute + frozen


def decode_seconds(lay: Layout, device: Device, weight_bytes: float, compute_bytes: float) -> tuple[float, bool]:
    """Prefill (FLOP-bound) plus one step per new token, each reading the weights and the average KV cache (bytes)."""
    g, s = lay.generation, lay.policy
    prefill_eff, m1 = efficiency(device, "prefill")
    decode_eff, m2 = efficiency(device, "decode")
    prefill = forward_flops(s, "lm", Forward(g.rows, g.prompt_len, 1, False)) / (device.flops * prefill_eff)
    kv_per_token = 2 * s.layers * g.rows * s.kv_heads * s.head_dim * compute_bytes
    read = g.new_tokens * (weight_bytes + kv_per_token * (g.prompt_len + g.new_tokens / 2))
    flops = g.new_tokens * 2 * matmul_params(s, "lm") * g.rows
    step = max(read / device.bandwidth, flops / device.flops) / decode_eff
    return prefill + step, m1 and m2


def step_time(lay: Layout, device: Device, weight_bytes: float, compute_bytes: float) -> StepTime:
    """Seconds per planned step on `device`; None when it has no rates (a device named by its memory alone)."""
    if not device.flops:
        return StepTime(None, {}, False)
    eff, measured = efficiency(device, "forward_backward")
    phases = {"update": lay.micro_batches * update_flops(lay) / (device.flops * eff)}
    if lay.generation is not None:
        phases["generation"], gen_measured = decode_seconds(lay, device, weight_bytes, compute_bytes)
        measured = measured and gen_measured
    return StepTime(sum(phases.values()), phases, measured)
