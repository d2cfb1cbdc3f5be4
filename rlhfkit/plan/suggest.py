"""What to change so a stage fits: each candidate change is planned again by the planner (never a guessed saving),
kept when it lowers the peak, and the list ordered by what each saves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rlhfkit.plan.layout import Layout


@dataclass(frozen=True)
class Suggestion:
    text: str  # what to set, as config overrides or launch options
    saves_gb: float  # the planned peak minus the peak planned with the change
    peak_gb: float  # the peak planned with the change
    fits: bool | None  # whether the changed run fits the device (None: no device named)
    changes: dict[str, Any] = field(default_factory=dict)  # the config keys changed ({} for launch options)
    processes: int | None = None  # the launch option changed: processes sharding the state (ZeRO-3)


def candidates(cfg: Any, lay: Layout, processes: int) -> list[tuple[str, dict[str, Any], int | None]]:
    """(text, config changes, processes for ZeRO-3) of each change that applies to this run."""
    m, out = cfg.model, []
    if not m.gradient_checkpointing and lay.train != "head":
        out.append(("model.gradient_checkpointing=true", {"model.gradient_checkpointing": True}, None))
    if lay.train == "full":
        out.append(("model.lora.enabled=true (LoRA; the reference becomes the base with adapters off)",
                    {"model.lora.enabled": True}, None))
        out.append(("model.lora.enabled=true model.quantization.load_in_4bit=true (QLoRA)",
                    {"model.lora.enabled": True, "model.quantization.load_in_4bit": True}, None))
    elif lay.train == "lora" and not lay.quantized:
        out.append(("model.quantization.load_in_4bit=true (QLoRA: the base in 4 bits)",
                    {"model.quantization.load_in_4bit": True}, None))
    if lay.rewards and not lay.rewards_4bit:
        out.append(("reward.quantization.load_in_4bit=true (4-bit reward models)",
                    {"reward.quantization.load_in_4bit": True}, None))
    if m.dtype == "float32" and lay.train != "head":
        out.append(("model.dtype=bfloat16 (weights, gradients and optimizer states in bf16)",
                    {"model.dtype": "bfloat16"}, None))
    mb = cfg.optim.per_device_batch_size
    if mb > 1 and mb % 2 == 0 and lay.generation is None:
        out.append((f"optim.per_device_batch_size={mb // 2} optim.grad_accum_steps={cfg.optim.grad_accum_steps * 2} "
                    "(same batch per step)", {"optim.per_device_batch_size": mb // 2,
                                              "optim.grad_accum_steps": cfg.optim.grad_accum_steps * 2}, None))
    elif mb > 1 and mb % 2 == 0:
        out.append((f"optim.per_device_batch_size={mb // 2} (same rollout, smaller micro-batches)",
                    {"optim.per_device_batch_size": mb // 2}, None))
    if lay.generation is not None:
        g = cfg.generation
        if g.max_new_tokens > 1:
            out.append((f"generation.max_new_tokens={g.max_new_tokens // 2} (shorter responses)",
                        {"generation.max_new_tokens": g.max_new_tokens // 2}, None))
        rows = "algo.sampling_batch_size" if lay.stage == "rft" else "algo.rollout_batch_size"
        current = cfg.algo.sampling_batch_size if lay.stage == "rft" else cfg.algo.rollout_batch_size
        if current > 1 and not g.seed_per_prompt:
            out.append((f"{rows}={current // 2} (fewer rows sampled at once)", {rows: current // 2}, None))
    if lay.release_reference is False and lay.stage == "dpo" and lay.reference is not None:
        out.append(("algo.precompute_ref_logprobs=true (the reference freed before training)",
                    {"algo.precompute_ref_logprobs": True}, None))
    n = max(processes, 2)
    if lay.train == "full" or lay.critic is not None:
        out.append((f"ZeRO-3 over {n} processes (accelerate launch with DeepSpeed zero_stage 3)", {}, n))
    return out


def suggestions(cfg: Any, lay: Layout, processes: int, peak_gb: float,
                replan: Callable[[Any, int | None], tuple[float, bool | None]]) -> list[Suggestion]:
    """The changes that lower the peak, largest saving first; `replan(changed_cfg, processes)` returns the changed
    run's (peak GB, fits)."""
    from rlhfkit.plan.layout import with_changes

    found = []
    for text, changes, zero3 in candidates(cfg, lay, processes):
        new_peak, fits = replan(with_changes(cfg, changes), zero3)
        if new_peak < peak_gb - 1e-9:
            found.append(Suggestion(text, peak_gb - new_peak, new_peak, fits, changes, zero3))
    return sorted(found, key=lambda s: -s.saves_gb)
