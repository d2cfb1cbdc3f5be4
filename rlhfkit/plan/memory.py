"""Bytes per process, part by part, in each phase of a stage (`Layout`): the planner's memory model.

Parts: the weights of each model (in their dtype, or 4 bits for QLoRA's linears), the LoRA adapters, gradients, AdamW's
two moments, the activations the backward keeps (all layers, or with gradient checkpointing one input per layer plus
one layer recomputed; training and scoring batches run right-padded, without a mask: `models.attention_inputs`,
`models.moved_left`), attention's T² scores where the kernel materialises them (eager; sdpa's fused kernels do not),
the gradients in flight inside a layer's backward, the logits with their fp32 copy for the log-softmax (B·T·V,
`ops.logprobs_from_logits`), and in generation the KV cache of every row plus the last position's logits. ZeRO-2
shards gradients and optimizer states over the processes, ZeRO-3 and FSDP the trained weights too (and ZeRO-3 the
frozen models); CPU offload moves the optimizer states out.

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
# from the llama layer (each RMSNorm its input and normalised output; attention its rotated q and k, v, its output and
# the output's contiguous copy; the gated MLP its gate, activation, up and product), then checked against the live
# tensors of the tiny model and SmolLM2-135M (within 3%; docs/memory.md, "How the planner counts").
ACTIVATION = {"hidden": 5.0, "q": 3.0, "kv": 2.0, "intermediate": 4.0}
OUTSIDE_LAYERS = 4.0  # per token, in hidden widths: the embedding's output, the final norm's input and output
# An RMSNorm multiplies its normalised input by its weight; with the weight frozen (LoRA, QLoRA) autograd keeps no
# copy of that input for the weight's gradient: one hidden width less per norm, two a layer (and, outside the
# layers, the final norm's and the frozen head's input). Read from autograd's saved tensors of a llama layer, full
# against LoRA (tests/unit/test_plan_sizes.py).
FROZEN_NORM = 2.0
# Gradients in flight in one layer's backward over what the layer saved, in elements per token: the output's gradient
# (hidden) and, at the gated MLP's backward (the layer's widest moment), three intermediate-wide gradients while the
# product the down projection saved is already released (net two). Read from the live tensors of the tiny model's
# checkpointed backward (tests/unit/test_plan_sizes.py).
BACKWARD = {"hidden": 1.0, "intermediate": 2.0}
# Eager attention's backward (softmax's, and under Gemma 2's soft-capping tanh's) holds fp32 B·H·T² gradients beside
# the scores the layer saved: 1.05 to 1.75 of them over the MLP's moment on the tiny Llama, Gemma 2 and Gemma 3 at 128
# and 256 tokens, with and without checkpointing (tests/unit/test_plan_families.py); the layer's widest moment when
# they outweigh the MLP's gradients.
EAGER_BACKWARD = 1.5
# Beyond Llama's layer, per token, read from the live tensors of tiny random models of each family at two sets of
# widths (tests/unit/test_plan_families.py): each norm beyond two (Gemma 2/3) and the q/k norms (over q and kv widths,
# per head or whole) keep their input and normalised output, one of them with the weight frozen; Phi-3's fused
# projections keep their whole qkv output where Llama's v alone stays, and a q-wide copy more (2q + kv in all).
FUSED_QKV = {"q": 2.0, "kv": 1.0}
# LoRA with dropout keeps each adapted linear's dropped-out input (and its mask): measured 1.5 input widths per linear
# on a layer whose input needs a gradient (every layer but the first, whose 1.125 is left aside).
LORA_DROPOUT = 1.5


@dataclass(frozen=True)
class Precision:
    """Bytes per element: trained weights, separately loaded frozen models, activations (and the KV cache)."""

    weights: float
    frozen: float
    compute: float
    gpu: bool = False  # AdamW's foreach step on a GPU holds a gradient-sized temporary; the CPU's per-tensor one does not

    @staticmethod
    def of(cfg, policy: ModelShape, gpu: bool) -> Precision:
        """`mixed_precision: auto` is bf16 on a GPU (all the table's GPUs compute in bf16) and none on a CPU; frozen
        models load in the mixed precision when there is one (`precision.frozen_model_dtype`)."""
        dtype = policy.dtype if cfg.model.dtype == "auto" else cfg.model.dtype
        weights = DTYPE_BYTES.get(dtype, 4)
        mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if gpu else "no")
        half = 2 if mixed in ("bf16", "fp16") else None
        return Precision(weights, half or weights, half or weights, gpu)


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


def outside_layers(lay: Layout) -> float:
    """Hidden widths per token kept outside the layers (`OUTSIDE_LAYERS`); with the final norm and the head frozen
    (LoRA, QLoRA, a probe) none: the norm keeps no normalised copy, the head not its input (measured: under 0.2
    hidden widths, the rotary tables)."""
    return OUTSIDE_LAYERS if lay.train == "full" else 0.0


def layer_activations(shape: ModelShape, tokens: float, p: Precision, lora: int = 0, dropout: bool = False,
                      targets: tuple[str, ...] = (), norms_trained: bool = True) -> float:
    """Bytes one decoder layer keeps for its backward over `tokens` tokens; `lora`: the rank of the adapters on the
    linears `targets` (their outputs, and with `dropout` a dropped-out copy of each one's input); `norms_trained`:
    False when the norms' weights are frozen (LoRA), whose products then keep no normalised copy (`FROZEN_NORM`)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    hidden = ACTIVATION["hidden"] - (0.0 if norms_trained else FROZEN_NORM)
    per_token = (hidden * shape.hidden + ACTIVATION["q"] * q + ACTIVATION["kv"] * kv
                 + ACTIVATION["intermediate"] * shape.intermediate)
    norm_copies = 2.0 if norms_trained else 1.0
    per_token += norm_copies * ((shape.norms - 2) * shape.hidden + ((q + kv) if shape.qk_norm else 0))
    if shape.fused:
        per_token += FUSED_QKV["q"] * q + FUSED_QKV["kv"] * kv
    if lora:
        inputs = sum(shape.linear_shapes()[t][0] for t in targets)
        per_token += len(targets) * lora + (LORA_DROPOUT * inputs if dropout else 0.0)
    return tokens * per_token * p.compute


def attention_scores(shape: ModelShape, f: Forward, attention: str, p: Precision) -> float:
    """One layer's attention buffers: eager keeps softmax's fp32 output (B·H·T²) and, in half precision, its cast;
    sdpa's fused kernels and flash attention keep O(T). Under gradient eager also keeps the key and value repeated to
    the query heads (2·(q - kv) per token more than sdpa) and, soft-capping its scores (Gemma 2), tanh's output; with
    attention dropout (Granite's), the dropped weights and their mask, and on a CPU sdpa then runs its math path,
    eager's buffers (measured on the tiny models)."""
    dropout = shape.attn_dropout and f.grad
    if attention != "eager" and not (dropout and attention == "sdpa" and not p.gpu):
        return 0.0
    capped = p.compute if shape.attn_softcap and f.grad else 0
    dropped = 2 * p.compute if dropout else 0
    scores = f.rows * shape.heads * f.length**2 * (4 + (p.compute if p.compute != 4 else 0) + capped + dropped)
    repeated = 2 * (shape.heads - shape.kv_heads) * shape.head_dim * f.rows * f.length * p.compute if f.grad else 0
    return scores + repeated


def window_mask(shape: ModelShape, f: Forward, attention: str, p: Precision) -> float:
    """What a windowed layer keeps beyond a full one under sdpa with gradient when its rows are longer than the window
    (shorter ones need no mask: transformers then passes none, as to a full layer of a right-padded training batch):
    sdpa's float copy of the (B, 1, T, T) mask, saved for its backward, and the key and value repeated to the query
    heads (transformers repeats them itself when it passes a mask), except Phi-3's, whose repeated ones take the
    place of the fused qkv output the layer otherwise keeps (measured: from a kv width less to nothing more). Read
    from autograd's saved tensors and the live tensors of the tiny windowed models."""
    if attention != "sdpa" or not f.grad or shape.window is None or f.length <= shape.window:
        return 0.0
    repeated = 0 if shape.fused else 2 * (shape.heads - shape.kv_heads) * shape.head_dim
    return f.rows * f.length**2 * p.compute + repeated * f.rows * f.length * p.compute


def logits_bytes(shape: ModelShape, f: Forward, p: Precision, entropy: bool = False) -> float:
    """The logits' peak, at the start of the backward: the fp32 copy the log-softmax kept (B·T·V), its gradient row
    by row, and the logits' gradient in the compute dtype (measured: 4 x B·T·V x 4 bytes in fp32); without gradient
    the logits and one fp32 row. The entropy keeps two more fp32 copies. A family that transforms its logits in the
    model holds two while it does (Gemma 2's tanh soft-capping, Granite's division by logits_scaling: the no-grad
    peak when that is more than the row), and the backward keeps the output of tanh (one more B·T·V)."""
    if f.logit_len == 0:
        return 0.0
    n = f.rows * f.logit_len * shape.vocab
    if f.grad:
        return n * (8 + 2 * p.compute + (8 if entropy else 0) + (p.compute if shape.logit_softcap else 0))
    copy = n * p.compute if shape.logit_softcap or shape.logit_scaled else 0.0
    return n * p.compute + max(copy, f.logit_len * shape.vocab * 8)


def trained_forward(lay: Layout, p: Precision, shape: ModelShape, f: Forward) -> dict[str, float]:
    """Activations and attention buffers of the update's forward with gradient of one model, at the backward's
    start (with gradient checkpointing: each layer's input; "recompute": one layer's saved tensors, recomputed in
    the backward)."""
    tokens = f.rows * f.length
    lora = lay.lora_rank if lay.train == "lora" and shape is lay.policy else 0
    layer = layer_activations(shape, tokens, p, lora, lay.lora_dropout, lay.lora_targets, lay.train == "full")
    scores = attention_scores(shape, f, lay.attention, p)
    mask, windowed = window_mask(shape, f, lay.attention, p), sum(shape.sliding[:shape.layers])
    outside = outside_layers(lay) * tokens * shape.hidden * p.compute
    if lay.train == "head":  # a probe: the body runs without gradient
        return {"activations": layer, "attention": scores}
    if lay.checkpointing:
        inputs = shape.layers * tokens * shape.hidden * p.compute
        return {"activations": inputs + outside, "attention": 0.0,
                "recompute": layer + scores + (mask if windowed else 0.0)}
    return {"activations": shape.layers * layer + outside, "attention": shape.layers * scores + windowed * mask}


def layer_backward(lay: Layout, p: Precision, shard: Sharding, f: Forward) -> dict[str, float]:
    """The policy's backward inside a layer, at the top or the bottom layer, whichever holds more: the gradients in
    flight (`BACKWARD`, or eager attention's `EAGER_BACKWARD`); what the layers not yet done saved (with checkpointing their inputs, and the one layer
    recomputed) and the mask; the parameters' gradients of the head and of the layers done (all of them with
    accumulation: earlier micro-batches left them). Without checkpointing this stays below the backward's start."""
    s = lay.policy
    tokens = f.rows * f.length
    fwd = trained_forward(lay, p, s, f)
    grad = (4.0 if lay.train != "full" else p.weights) / shard.states()  # bytes per trained parameter
    if lay.train == "full":
        head = ((s.vocab * s.hidden if lay.head == "lm" else s.hidden + 1) + s.hidden) * grad  # and the final norm
        per_layer = (s.linear_params + s.other_layer_params - s.hidden) / s.layers * grad
    else:
        head, per_layer = 0.0, lay.adapters / s.layers * grad
    outside = outside_layers(lay) * tokens * s.hidden * p.compute
    # what one layer keeps until its backward: its input (checkpointing), or everything it saved
    one = tokens * s.hidden * p.compute if lay.checkpointing else (
        fwd["activations"] - outside + fwd["attention"]) / s.layers
    top, bottom = s.layers * one, one + (s.layers - 1) * per_layer
    if lay.accum > 1 or top >= bottom:
        saved, done = top, head
    else:
        saved, done = one, head + (s.layers - 1) * per_layer
    if lay.accum > 1:
        done = trainable_params(lay) * grad
    flight = tokens * (BACKWARD["hidden"] * s.hidden + BACKWARD["intermediate"] * s.intermediate) * p.compute
    if lay.attention == "eager":
        flight = max(flight, EAGER_BACKWARD * f.rows * s.heads * f.length**2 * 4)
    return {"activations": saved, "recompute": fwd.get("recompute", 0.0), "backward": flight, "gradients": done}


def update_phase(lay: Layout, p: Precision, shard: Sharding) -> Phase:
    """The update's peak over the resident state, at whichever moment is highest: the backward's start (activations
    and the logits' buffers alive; with accumulation the gradients of earlier micro-batches too), a layer's backward
    (`layer_backward`), the backward's end (every gradient, and for tied embeddings the head's and the embedding's
    gradients summed: two more V·H copies, three with accumulation), or the optimizer step (on a GPU a gradient-sized temporary)."""
    parts = resident(lay, p, shard)
    per_param = 4.0 if lay.train != "full" else p.weights
    grads = trainable_params(lay) * per_param / shard.states()
    f = lay.trained
    fwd = trained_forward(lay, p, lay.policy, f)
    critic = {}
    if lay.critic is not None:
        critic = trained_forward(lay, p, lay.critic, Forward(f.rows, f.length, 0, True))
        for key, value in critic.items():
            fwd[key] = max(fwd.get(key, 0.0), value) if key == "recompute" else fwd.get(key, 0.0) + value
    fwd.pop("recompute", None)
    # Over the saved activations, one after the other: the reference's forward of the same micro-batch (offline
    # stages), the logits' buffers at the backward's start.
    transient = {"logits": logits_bytes(lay.policy, f, p, lay.entropy),
                 "reference forward": max((no_grad_forward(lay, p, g) for g in lay.frozen if g.in_update), default=0.0)}
    top = max(transient, key=transient.get)
    fwd[top] = transient[top]
    tied_head = lay.train == "full" and lay.policy.tied and lay.head == "lm"
    # The head's and the embedding's gradients and their sum; with accumulation, the gradient the earlier
    # micro-batches left is alive beside them until the sum is added to it (tests/unit/test_plan_sizes.py).
    copies = 3 if lay.accum > 1 else 2
    tied = copies * lay.policy.vocab * lay.policy.hidden * per_param if tied_head else 0.0
    end = {"gradients": grads, "tied gradient sum": tied, "optimizer step": grads if p.gpu else 0.0}
    start = {"gradients": grads if lay.accum > 1 else 0.0, **fwd}
    middle = layer_backward(lay, p, shard, f) if lay.train != "head" else {}
    if critic:  # the critic's saved tensors wait for its own backward
        middle["critic activations"] = critic["activations"] + critic["attention"]
    best = max((start, middle, end), key=lambda m: sum(m.values()))
    parts.update({k: v for k, v in best.items() if v})
    return Phase("update", parts)


def no_grad_forward(lay: Layout, p: Precision, f: Forward) -> float:
    """A no-grad forward's own peak: one layer's working set (the MLP's gate, up and product beside the residual
    stream and its normalised copy), its attention scores, its logits."""
    shape = lay.policy
    working = f.rows * f.length * (3 * shape.intermediate + 2 * shape.hidden) * p.compute
    return working + attention_scores(shape, f, lay.attention, p) + logits_bytes(shape, f, p)


def prefill_bytes(s: ModelShape, prompts: int, length: int, attention: str, p: Precision) -> float:
    """The prefill's own peak, one layer at a time, over the distinct prompts (each prefilled once), left-padded to
    the longest: the (n, 1, P, P) mask transformers builds for the whole forward (sdpa: bool; eager: additive),
    beside the wider of the MLP's working set (gate, up and product beside the residual stream and its normalised
    copy) and attention's (the residual, its normalised copy and the layer input; the rotated queries, the output
    and the key and value expanded to the query heads, four query widths; SDPA's float copy of the mask, or eager's
    scores). A model mixing windowed and full layers has two masks, one a layer type (the engine's `window_masks`)."""
    tokens, q = prompts * length, s.heads * s.head_dim
    flash = attention not in ("sdpa", "eager")
    masks = 2 if s.window is not None and not all(s.sliding[:s.layers]) else 1
    mask = 0.0 if flash else masks * prompts * length**2 * (1.0 if attention == "sdpa" else p.compute)
    mlp = tokens * (3 * s.intermediate + 2 * s.hidden) * p.compute
    attend = tokens * (3 * s.hidden + (2 if flash else 4) * q) * p.compute + (
        prompts * length**2 * p.compute if attention == "sdpa" else 0.0) + attention_scores(
        s, Forward(prompts, length, 0, False), attention, p)
    return mask + max(mlp, attend)


def kv_cache_bytes(s: ModelShape, g, p: Precision) -> float:
    """The KV cache of every row sampled at once over prompt and response, in the compute dtype: all of it on every
    layer in the engine's DynamicCache (a sliding-window model's too: the engine masks the window itself), the
    window at most on a StaticCache's sliding layers (`ModelShape.kv_positions`)."""
    length = g.prompt_len + g.new_tokens
    if g.static_cache:  # generation.compile: a StaticCache of the whole length, rounded up, from the first token
        from rlhfkit.generation.session import static_cache_length

        length = static_cache_length(length)
    return 2 * s.kv_positions(length, g.static_cache) * g.rows * s.kv_heads * s.head_dim * p.compute


def generation_phase(lay: Layout, p: Precision, shard: Sharding) -> Phase | None:
    """Sampling: the KV cache of every row over prompt and response (in the compute dtype), the last position's
    logits and the sampler's copies of them (a sort for top-p), or the prefill's peak (`prefill_bytes`); then the
    no-grad scoring forwards, whichever is higher."""
    g = lay.generation
    if g is None:
        return None
    parts = resident(lay, p, shard)
    s = lay.policy
    kv = kv_cache_bytes(s, g, p)
    decode = g.rows * s.vocab * 4 * (3 + (3 if g.top_p else 0))
    prefill = prefill_bytes(s, g.prompts, g.prompt_len, lay.attention, p)
    scoring = max((no_grad_forward(lay, p, f) for f in lay.frozen if not f.in_update), default=0.0)
    if kv + max(decode, prefill) >= scoring:
        parts.update({"kv cache": kv, "sampling": max(decode, prefill)})
    else:
        parts.update({"scoring forwards": scoring})
    return Phase("generation", parts)


def phases(lay: Layout, p: Precision, shard: Sharding) -> tuple[Phase, ...]:
    gen = generation_phase(lay, p, shard)
    return ((gen,) if gen is not None else ()) + (update_phase(lay, p, shard),)
