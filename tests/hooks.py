"""Faults injected into a whole training run through torch's public global hooks, not through a trainer's methods.

A trainer builds its models and optimizer inside `fit`, out of a test's reach; torch's global hooks see them anyway:
`register_module_forward_hook` fires after every module's forward, `register_optimizer_step_post_hook` after every
optimizer step that is applied. A test therefore drives the real CLI (or `fit`) and still chooses the step at which
a fault happens, and a refactor of the trainer's methods leaves the test as it was.

What counts as a *training forward* here: an `nn.Embedding` lookup with gradients enabled in train mode. Every model
of the tiny test configs (policy, reward model, critic) starts with exactly one embedding lookup, and every forward
of a reference model, of sampling and of evaluation runs under no_grad or in eval mode. A NaN put into the
embedding's output reaches every output of that forward (logits, a reward model's score head), as a NaN loss would.

Steps are 1-based, as logged. The training forwards of a step are counted on step 1 (those before the first
optimizer step), so step 1 must be applied (not poisoned) for `nan_in_steps` to know where later steps begin.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook


class RunWatch:
    """Counts the run's training forwards and applied optimizer steps; `on_forward(watch, output)` and
    `on_step(watch, optimizer)` (either may be None) run at each, after the count. `forwards_per_step` is known once
    step 1's optimizer step was applied."""

    def __init__(self, on_forward=None, on_step=None):
        self.on_forward, self.on_step = on_forward, on_step
        self.forwards = 0  # training forwards so far
        self.steps = 0  # applied optimizer steps so far
        self.forwards_per_step: int | None = None

    def step_of_forward(self) -> int | None:
        """The 1-based step the latest training forward belongs to (None while step 1 is still running)."""
        if self.forwards_per_step is None:
            return 1 if self.steps == 0 else None
        return (self.forwards - 1) // self.forwards_per_step + 1

    def _forward(self, module, args, output):
        if not (isinstance(module, torch.nn.Embedding) and module.training and torch.is_grad_enabled()):
            return None
        self.forwards += 1
        return self.on_forward(self, output) if self.on_forward else None

    def _step(self, optimizer, args, kwargs):
        self.steps += 1
        if self.forwards_per_step is None:
            self.forwards_per_step = self.forwards
        if self.on_step:
            self.on_step(self, optimizer)


@contextlib.contextmanager
def watching(on_forward=None, on_step=None):
    watch = RunWatch(on_forward, on_step)
    handles = [register_module_forward_hook(watch._forward), register_optimizer_step_post_hook(watch._step)]
    try:
        yield watch
    finally:
        for handle in handles:
            handle.remove()


def nan_in_steps(steps, gradient: bool = False, when=lambda: True):
    """NaN in every training forward of the 1-based `steps` (on a process where `when()` holds): a NaN output and so
    a NaN loss, or with `gradient` a finite output whose gradient is NaN (caught by the gradient norm alone)."""

    def poison(watch, output):
        if watch.step_of_forward() not in steps or not when():
            return None
        if gradient:
            assert output.requires_grad, "a NaN gradient needs a trained embedding (full fine-tuning)"
            output.register_hook(lambda g: g * float("nan"))
            return None
        return output * float("nan")

    return watching(on_forward=poison)


def interrupt_after_step(n: int):
    """KeyboardInterrupt (as a Ctrl-C) at the first training forward after `n` applied optimizer steps: step n + 1
    dies before its update, after step n was logged (and checkpointed, if its turn)."""

    def interrupt(watch, output):
        if watch.steps >= n:
            raise KeyboardInterrupt

    return watching(on_forward=interrupt)


def nan_weights_after_step(n: int):
    """The first trained tensor of the optimizer filled with NaN just after the `n`-th applied optimizer step."""

    def blow_up(watch, optimizer):
        if watch.steps == n:
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("nan"))

    return watching(on_step=blow_up)


@contextlib.contextmanager
def causal_lm_forwards():
    """The list of every causal-LM forward over whole sequences (a policy or reference log-prob forward; the decode
    loop's forwards, which ask for the KV cache with `use_cache=True`, are left out), each as (rows, whether the
    input's last column holds a real token in some row), appended as they run."""
    from transformers import PreTrainedModel

    seen: list[tuple[int, bool]] = []

    def record(module, args, kwargs, output):
        logits = getattr(output, "logits", None)
        if isinstance(module, PreTrainedModel) and logits is not None and logits.dim() == 3 and not kwargs.get("use_cache"):
            mask = kwargs.get("attention_mask")
            rows = kwargs["input_ids"].shape[0] if "input_ids" in kwargs else logits.shape[0]
            seen.append((rows, mask is None or bool(mask[:, -1].any())))

    handle = register_module_forward_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()
