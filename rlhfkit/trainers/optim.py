"""The optimizer, its learning-rate schedule, and the ONE optimizer step every loop calls.

`optimizer_step` is where an update is applied or skipped: gradient clipping, the fp16 loss scaler, the decision to
skip a step whose loss, rollout or gradient is not finite, the schedule's advance and the count of skipped steps. The
offline loop (SFT, reward model, DPO, KTO), the online loop (PPO, RLOO, GRPO, REINFORCE++) and RFT all call it, so a
skipped step behaves the same everywhere: the gradients are dropped, the optimizer state is untouched, the schedule
advances (like the data, the learning rate is a function of the step number: a skipped step costs only its batch, the
run still ends at its last step, and a resumed run matches an uninterrupted one), and the `max_bad_steps`-th skipped
step stops the run with a UserError (exit status 2).
"""

from __future__ import annotations

import enum
import logging
import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.checkpoint import last_checkpoint_note
from rlhfkit.config import TrainConfig
from rlhfkit.errors import UserError

logger = logging.getLogger("rlhfkit")


class Fault(enum.Enum):
    """Why a step was skipped. The value names what was not finite."""

    ROLLOUT = "rollout"  # scores, log-probs or advantages of an online step: no backward ran
    LOSS = "loss"  # a loss, on this process or another
    GRADIENT = "gradient"  # the gradient norm, with every loss finite


@dataclass
class Optim:
    """What every optimizer step of a run shares. `clip(max_norm)` unscales the gradients (fp16), clips them to
    `max_norm` (inf: only measures) and returns their global norm, or None where it cannot be measured; `scaler` is
    the fp16 loss scaler `clip` unscaled through (accelerate's `accelerator.scaler`), or None. An optimizer that
    carries that scaler itself (accelerate's wrapper) applies it in its own `step()`. `bad_steps` counts the skipped
    steps of the whole run (a checkpoint keeps it)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip: Callable[[float], torch.Tensor | None]
    max_grad_norm: float | None = None
    scaler: torch.amp.GradScaler | None = None
    max_bad_steps: int = 3
    output_dir: str | None = None  # named, with its last good checkpoint, when max_bad_steps stops the run
    bad_steps: int = 0

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


@dataclass(frozen=True)
class StepResult:
    """What `optimizer_step` did: the gradient norm before clipping (None when not measured) and the fault that
    skipped the step (None: the update was applied)."""

    grad_norm: float | None
    fault: Fault | None


def optimizer_step(optim: Optim, step: int, fault: Fault | None = None, schedule_steps: int = 1) -> StepResult:
    """Apply the gradients accumulated since the last step, or skip them; advance the schedule either way.

    `step` is the 1-based step number the warnings and the error name. `fault` is a fault already decided over every
    process (a non-finite loss anywhere, a non-finite rollout): it must be the same on all of them. The gradient
    norm is measured on the all-reduced gradients, so its verdict is the same everywhere too. Under fp16 a gradient
    that overflows is the scaler's business (it skips that update itself and lowers the scale), not a fault. A
    skipped step advances the schedule `schedule_steps` times: the updates it stands for (an online step that
    stops midway skips the rest of its updates).
    """
    norm = None
    if fault is not Fault.ROLLOUT:  # no backward ran for a rollout fault: nothing to clip, nothing unscaled
        max_norm = optim.max_grad_norm if optim.max_grad_norm is not None else math.inf
        measured = optim.clip(max_norm)
        norm = float(measured) if measured is not None else None
        if fault is None and norm is not None and optim.scaler is None and not math.isfinite(norm):
            fault = Fault.GRADIENT
    if fault is None:
        _apply(optim.optimizer, optim.scaler)
        optim.scheduler.step()
    else:
        if optim.scaler is not None and norm is not None:
            optim.scaler.update()  # close the unscale_ that clipping did, as the scaler's own skip would
        advance_schedule(optim, schedule_steps)
        _count(optim, step, fault)
    optim.optimizer.zero_grad(set_to_none=True)
    return StepResult(norm, fault)


def advance_schedule(optim: Optim, steps: int) -> None:
    """Advance the schedule past `steps` optimizer steps that were not made: the updates a skipped step stands for, or
    those after an online step's `algo.target_kl` early stop. The learning rate stays a function of the step number."""
    with warnings.catch_warnings():  # torch warns when the very first scheduler step has no optimizer step
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        for _ in range(steps):
            optim.scheduler.step()


def _apply(optimizer, scaler) -> None:
    if scaler is None or getattr(optimizer, "scaler", None) is scaler:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def _count(optim: Optim, step: int, fault: Fault) -> None:
    optim.bad_steps += 1
    logger.warning("step %d: non-finite %s; optimizer step skipped (%d of max_bad_steps=%d)", step, fault.value,
                   optim.bad_steps, optim.max_bad_steps)
    if optim.bad_steps >= optim.max_bad_steps:
        note = f"; {last_checkpoint_note(optim.output_dir)}" if optim.output_dir else ""
        raise UserError(f"stopping at step {step}: {optim.bad_steps} optimizer steps skipped for a non-finite rollout, "
                        f"loss or gradient (the last: {fault.value}; max_bad_steps={optim.max_bad_steps}){note}")


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norm weights (1-D tensors) get no weight decay. torch's fused
    kernel (one kernel for all parameters instead of a loop of small ops), except on Apple MPS, which lacks it."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            # A ZeRO-3 parameter built already partitioned (zero3_init_flag) is a 1-D placeholder: its shape is ds_shape.
            (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    # No empty group (LoRA has no 1-D trainable tensors): DeepSpeed drops empty groups from the optimizer it wraps,
    # and the learning-rate scheduler, built on the groups before, would then step one group too many.
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, cfg.optim.weight_decay), (no_decay, 0.0)) if ps]
    fused = not torch.backends.mps.is_available()
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.adam_betas), eps=cfg.optim.adam_eps,
                             fused=fused)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """transformers' schedule `optim.scheduler` over `total_steps` optimizer steps, with its warmup."""
    from transformers import get_scheduler

    warmup = cfg.optim.warmup_steps or math.ceil(cfg.optim.warmup_ratio * total_steps)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optim.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
