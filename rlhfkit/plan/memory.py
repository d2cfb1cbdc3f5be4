"""Bytes per process, part by part, in each phase of a stage (`Layout`): the planner's memory model.

Parts: the weights of each model (in their dtype, or 4 bits for QLoRA's linears), the LoRA adapters, gradients, AdamW's
two moments, the activations the backward keeps (all layers, or with gradient checkpointing one input per layer plus
one layer recomputed), attention's T² scores where the kernel materialises them (eager; sdpa's fused kernels do not),
the logits with their fp32 copy for the log-softmax (B·T·V, `ops.logprobs_from_logits`), and in generation the KV
cache of every row plus the last position's logits. ZeRO-2 shards gradients and optimizer states over the processes,
ZeRO-3 and FSDP the trained weights too (and ZeRO-3 the frozen models); CPU offload moves the optimizer states out.

Phases: "generation" (sampling and the no-grad scoring forwards; online stages and rft) and "update" (forward and
backward of a micro-batch, then the optimizer step). Optimizer states are resident from the first step on and
gradients live from the first backward to the step (`optim.optimizer_step` sets them to None after it).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.plan.layout import Forward, Layout
from rlhfkit.plan.shape import ModelShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NF4/FP4 weights: half a byte, plus one absmax per block of 64 (fp32; with double quantization 8 bits plus an fp32
# constant per 256 blocks), as bitsandbytes stores them.
FOUR_BIT = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}
# Activations a decoder layer keeps for its backward, in elements per token, by the width they scale with: counted
# from the llama layer (two RMSNorms keep their fp32 input and normalised output, the projections their inputs, rotary
# positions their q and k, the gated MLP its gate, up and product), then fitted on the tiny model and SmolLM2-135M by
# bench/plan_grid.py.
ACTIVATION = {"hidden": 10.0, "q": 4.0, "kv": 5.0, "intermediate": 5.0}


@dataclass(frozen=True)
class Precision:
    """Bytes per element: trained weights, separately loaded frozen models, activations (and the KV cache)."""

    weights: float
    frozen: float
    compute: float

    @staticmethod
    def of(cfg, policy: ModelShape, gpu: bool) -> Precision:
        """`mixed_precision: auto` is bf16 on a GPU (all the table's GPUs compute in bf16) and none on a CPU; frozen
        models load in the mixed precision when there is one (`precision.frozen_model_dtype`)."""
        dtype = policy.dtype if cfg.model.dtype == "auto" else cfg.model.dtype
        weights = DTYPE_BYTES.get(dtype, 4)
        mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if gpu else "no")
        half = 2 if mixed in ("bf16", "fp16") else None
        return Precision(weights, half or weights, half or weights)


@dataclass(frozen=True)
class Sharding:
    """How N processes split the state: "none" (each holds all: DDP), "zero2", "zero3" or "fsdp"; `offload`: the
    optimizer states in CPU memory (DeepSpeed's offload_optimizer)."""

    strategy: str = "none"
    processes: int = 1
    offload: bool = False

    def states(self) -> int:
        return self.processes if self.strategy != "none" else 1

    def weights(self) -> int:
        return self.processes if self.strategy in ("zero3", "fsdp") else 1


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict[str, float]  # part -> bytes per process

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def model_bytes(shape: ModelShape, head: str, each: float, four_bit: bool, double_quant: bool = True,
                rest: float | None = None) -> float:
    """A model's weights: `each` bytes a parameter, or 4 bits for the linears of the layers with the rest in `rest`
    bytes (QLoRA's trained base: fp32, as peft's `prepare_model_for_kbit_training` casts them)."""
    if not four_bit:
        return shape.params(head) * each
    return shape.linear_params * FOUR_BIT[double_quant] + (shape.params(head) - shape.linear_params) * (rest or each)


def trainable_params(lay: Layout) -> int:
    """Parameters the optimizer trains."""
    if lay.train == "head":
        return lay.policy.hidden + 1
    if lay.train == "lora":
        return lay.adapters
    return lay.policy.params(lay.head) + (lay.critic.params("score") if lay.critic is not None else 0)


def resident(lay: Layout, p: Precision, shard: Sharding, q4_double: bool = True) -> dict[str, float]:
    """The weights of every resident model and the optimizer states: held in every phase."""
    parts = {"weights/policy": model_bytes(lay.policy, lay.head, p.weights, lay.quantized, q4_double, 4.0)
             / (shard.weights() if lay.train == "full" else 1)}
    if lay.adapters:
        parts["adapters"] = lay.adapters * 4.0  # peft keeps adapters in fp32
    if lay.reference is not None and not lay.release_reference:
        parts["weights/reference"] = model_bytes(lay.reference, "lm", p.frozen, lay.reference_4bit) / (
            shard.processes if shard.strategy == "zero3" else 1)
    if lay.rewards:
        parts["weights/reward"] = sum(model_bytes(r, "score", p.frozen, lay.rewards_4bit) for r in lay.rewards)
    if lay.critic is not None:
        parts["weights/critic"] = lay.critic.params("score") * p.weights / shard.weights()
    per_param = 4.0 if lay.train != "full" else p.weights
    states = 2 * trainable_params(lay) * per_param / shard.states()
    parts["optimizer"] = 0.0 if shard.offload else states
    return parts


def layer_activations(shape: ModelShape, tokens: float, p: Precision) -> float:
    """Bytes one decoder layer keeps for its backward over `tokens` tokens."""
    per_token = (ACTIVATION["hidden"] * shape.hidden + ACTIVATION["q"] * shape.heads * shape.head_dim
                 + ACTIVATION["kv"] * shape.kv_heads * shape.head_dim + ACTIVATION["intermediate"] * shape.intermediate)
    return tokens * per_token * p.compute


def attention_scores(shape: ModelShape, f: Forward, attention: str, p: Precision) -> float:
    """One layer's attention buffers: eager keeps softmax's fp32 output and its cast (B·H·T² each); sdpa's fused
    kernels and flash attention keep O(T)."""
    if attention != "eager":
        return 0.0
    return f.rows * shape.heads * f.length**2 * (4 + p.compute)


def logits_bytes(shape: ModelShape, f: Forward, p: Precision, entropy: bool = False) -> float:
    """The logits (B·T·V in the compute dtype) and their fp32 copy kept for the log-softmax's backward (one row at a
    time is computed, all rows are kept when training); the entropy keeps two more fp32 copies."""
    if f.logit_len == 0:
        return 0.0
    n = f.rows * f.logit_len * shape.vocab
    return n * (p.compute + 4 + (8 if entropy else 0)) if f.grad else n * p.compute + f.logit_len * shape.vocab * 8


def trained_forward(lay: Layout, p: Precision, shape: ModelShape, f: Forward) -> dict[str, float]:
    """Activations, attention buffers and logits of the update's forward with gradient of one model."""
    tokens = f.rows * f.length
    layer = layer_activations(shape, tokens, p)
    scores = attention_scores(shape, f, lay.attention, p)
    if lay.train == "head":  # a probe: the body runs without gradient
        return {"activations": layer, "attention": scores}
    if lay.checkpointing:  # each layer's input kept, one layer recomputed at a time during the backward
        acts = shape.layers * tokens * shape.hidden * p.compute + layer
        return {"activations": acts, "attention": scores}
    return {"activations": shape.layers * layer + 2 * tokens * shape.hidden * p.compute,
            "attention": shape.layers * scores}


def update_phase(lay: Layout, p: Precision, shard: Sharding) -> Phase:
    """The update's peak: the forward's end (activations and logits alive) or the optimizer step, whichever is
    higher, over the resident state; with accumulation the gradients of earlier micro-batches are alive too."""
    parts = resident(lay, p, shard)
    trainable = trainable_params(lay)
    grads = trainable * (4.0 if lay.train != "full" else p.weights) / shard.states()
    f = lay.trained
    fwd = trained_forward(lay, p, lay.policy, f)
    if lay.critic is not None:
        for key, value in trained_forward(lay, p, lay.critic, Forward(f.rows, f.length, 0, True)).items():
            fwd[key] += value
    fwd["logits"] = logits_bytes(lay.policy, f, p, lay.entropy)
    frozen = max((no_grad_forward(lay, p, g) for g in lay.frozen), default=0.0)
    fwd["no-grad forwards"] = max(0.0, frozen - sum(fwd.values()))  # before the trained forward, not during it
    step = {"optimizer step": grads}  # the step's temporaries: about one gradient-sized buffer
    if lay.accum > 1 or sum(fwd.values()) > grads + step["optimizer step"]:
        parts.update({"gradients": grads if lay.accum > 1 else 0.0, **fwd})
    else:
        parts.update({"gradients": grads, **step})
    return Phase("update", parts)


def no_grad_forward(lay: Layout, p: Precision, f: Forward) -> float:
    """A no-grad forward's own peak: one layer's working set, its attention scores, its logits."""
    shape = lay.policy
    return (layer_activations(shape, f.rows * f.length, p) + attention_scores(shape, f, lay.attention, p)
            + logits_bytes(shape, f, p))


def generation_phase(lay: Layout, p: Precision, shard: Sharding) -> Phase | None:
    """Sampling: the KV cache of every row over prompt and response (in the compute dtype), the last position's
    logits and the sampler's copies of them (a sort for top-p), the prefill's one-layer working set; then the
    no-grad scoring forwards, whichever is higher."""
    g = lay.generation
    if g is None:
        return None
    parts = resident(lay, p, shard)
    s = lay.policy
    length = g.prompt_len + g.new_tokens
    kv = 2 * s.layers * g.rows * s.kv_heads * s.head_dim * length * p.compute
    decode = g.rows * s.vocab * 4 * (3 + (3 if g.top_p else 0))
    prefill = layer_activations(s, g.rows * g.prompt_len, p) + attention_scores(
        s, Forward(g.rows, g.prompt_len, 0, False), lay.attention, p)
    scoring = max((no_grad_forward(lay, p, f) for f in lay.frozen), default=0.0)
    if kv + max(decode, prefill) >= scoring:
        parts.update({"kv cache": kv, "sampling": max(decode, prefill)})
    else:
        parts.update({"scoring forwards": scoring})
    return Phase("generation", parts)


def phases(lay: Layout, p: Precision, shard: Sharding) -> tuple[Phase, ...]:
    gen = generation_phase(lay, p, shard)
    return ((gen,) if gen is not None else ()) + (update_phase(lay, p, shard),)
