"""transformers' `TrainerCallback`s in an rlhfkit run: `Run(cfg, name, callbacks=[...])` calls them at its events.

Each callback receives, as under transformers' `Trainer`, `args`, `state` (a `TrainerState`: `global_step`,
`max_steps`, `epoch`, `log_history`, `best_metric` kept true) and `control` (a `TrainerControl`), plus `model`,
`optimizer` and `lr_scheduler` once the run has them. `args` is a `RunArgs`: the run's resolved config (`config`,
`stage`) and, under their `TrainingArguments` names, the fields that have a true counterpart in it.

A callback that raises stops the run with one line naming it (`UserError`, exit status 2); the checkpoints already
written stay as they are.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_utils import IntervalStrategy

from rlhfkit.errors import UserError, first_line

def stage_of(cfg) -> str:
    """The stage that runs `cfg` (sft, rm, dpo, orpo, kto, rft, or the online family: ppo, rloo, grpo, reinforce_pp)."""
    from rlhfkit.algorithms import ALGORITHMS

    name = type(cfg).__name__.removesuffix("Config").lower()
    return ALGORITHMS[cfg.algo.algorithm].family if name == "online" else name


# Offline stages evaluate a loss on their eval set: EarlyStoppingCallback watches it (see `RunArgs`).
LOSS_EVALUATED = ("sft", "rm", "dpo", "orpo", "kto")


@dataclasses.dataclass(frozen=True)
class RunArgs:
    """What a callback reads as `args`. The `TrainingArguments` fields below hold the run's true values; any other
    TrainingArguments field is absent (reading it raises AttributeError rather than returning a made-up value).

    Early stopping (transformers' `EarlyStoppingCallback`): the offline stages (sft, rm, dpo, orpo, kto) with an eval
    set and `logging.eval_steps` > 0 have `metric_for_best_model="eval_loss"` (lower is better) and
    `eval_strategy="steps"`; `on_evaluate` receives the eval figures under transformers' names (`eval/loss` as
    `eval_loss`). Elsewhere `metric_for_best_model` is None, and EarlyStoppingCallback refuses to start. rlhfkit
    keeps the final model, not the best one: `load_best_model_at_end` is False.
    """

    config: Any  # the resolved config (the frozen dataclass config.yaml is written from)
    stage: str  # the stage that runs it: sft, rm, dpo, orpo, kto, ppo, rloo, grpo, reinforce_pp, rft
    output_dir: str  # output_dir
    run_name: str  # logging.run_name, else output_dir's name
    learning_rate: float  # optim.lr
    per_device_train_batch_size: int  # optim.per_device_batch_size
    gradient_accumulation_steps: int  # optim.grad_accum_steps
    max_steps: int  # max_steps (-1: num_epochs decides; state.max_steps is the run's total)
    num_train_epochs: float  # num_epochs
    logging_steps: int  # logging.logging_steps
    save_steps: int  # logging.save_steps (0: no checkpoint before the final save)
    eval_steps: int  # logging.eval_steps (0: evaluate at the end only)
    seed: int  # seed
    report_to: list[str]  # logging.report_to
    eval_strategy: IntervalStrategy
    metric_for_best_model: str | None
    greater_is_better: bool | None
    load_best_model_at_end: bool = False

    @classmethod
    def of(cls, cfg, stage: str) -> RunArgs:
        log, o = cfg.logging, cfg.optim
        evaluates = bool(cfg.data.eval or cfg.data.eval_fraction) and log.eval_steps > 0
        watched = evaluates and stage in LOSS_EVALUATED
        return cls(config=cfg, stage=stage, output_dir=cfg.output_dir, learning_rate=o.lr,
                   run_name=log.run_name or os.path.basename(os.path.abspath(cfg.output_dir)),
                   per_device_train_batch_size=o.per_device_batch_size, gradient_accumulation_steps=o.grad_accum_steps,
                   max_steps=cfg.max_steps, num_train_epochs=cfg.num_epochs, logging_steps=log.logging_steps,
                   save_steps=log.save_steps, eval_steps=log.eval_steps, seed=cfg.seed, report_to=list(log.report_to),
                   eval_strategy=IntervalStrategy.STEPS if evaluates else IntervalStrategy.NO,
                   metric_for_best_model="eval_loss" if watched else None, greater_is_better=False if watched else None)



class Callbacks:
    """The run's callbacks with their shared `state` and `control`; `call(event, ...)` calls each in order."""

    def __init__(self, callbacks: Sequence[Any]):
        self.callbacks = []
        for i, cb in enumerate(callbacks):
            if isinstance(cb, type) and issubclass(cb, TrainerCallback):
                cb = cb()  # a class, as transformers' Trainer accepts it
            if not isinstance(cb, TrainerCallback):
                raise UserError(f"callbacks[{i}]: expected a transformers TrainerCallback, got {type(cb).__name__}")
            self.callbacks.append(cb)
        self.state, self.control, self.args = TrainerState(), TrainerControl(), None
        self.objects: dict[str, Any] = {}  # model, optimizer, lr_scheduler: passed to every call once known

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def begin(self, args: RunArgs, start_step: int, total_steps: int, accelerator, log_history: list[dict]) -> None:
        """The loop starts at `start_step` of `total_steps` (`log_history`: the rows a resumed run logged): on_train_begin."""
        s = self.state
        self.args = args
        s.global_step, s.max_steps, s.log_history = start_step, total_steps, log_history
        s.logging_steps, s.eval_steps, s.save_steps = args.logging_steps, args.eval_steps, args.save_steps
        s.train_batch_size, s.num_train_epochs = args.per_device_train_batch_size, args.num_train_epochs
        s.is_world_process_zero, s.is_local_process_zero = accelerator.is_main_process, accelerator.is_local_main_process
        self.call("on_train_begin")

    def step_end(self, step: int) -> None:
        self.state.global_step = step
        self.call("on_step_end")

    def requests(self, sum_over_processes) -> tuple[bool, bool]:
        """(stop, save): whether a callback on any process set `control.should_training_stop`, `should_save`."""
        if not self.callbacks:
            return False, False
        import torch

        c = self.control
        asked = sum_over_processes(torch.tensor([float(c.should_training_stop), float(c.should_save)]))
        return bool(asked[0] > 0), bool(asked[1] > 0)

    def call(self, event: str, **kwargs) -> None:
        """`event` on each callback in order (nothing without callbacks); a callback's returned control replaces the
        run's, as under transformers' CallbackHandler."""
        for cb in self.callbacks:
            try:
                result = getattr(cb, event)(self.args, self.state, self.control, **self.objects, **kwargs)
            except Exception as exc:
                raise UserError(f"callback {type(cb).__name__}.{event} raised {first_line(exc, with_type=True)}; the run "
                                f"stopped at step {self.state.global_step}") from exc
            if result is not None:
                self.control = result

    def logged(self, step: int, metrics: dict[str, float]) -> None:
        """The run logged `metrics` at `step`: into `state.log_history` (as transformers writes it), then on_log."""
        if self.callbacks:
            self.state.log_history.append({**metrics, "step": step})
            self.call("on_log", logs=dict(metrics))

    def evaluated(self, metrics: dict[str, float]) -> None:
        """on_evaluate with the figures under transformers' names (eval/x as eval_x), then `state.best_metric`
        follows `args.metric_for_best_model`, as transformers' Trainer updates it after each evaluation."""
        named = {"eval_" + k[len("eval/"):] if k.startswith("eval/") else k: v for k, v in metrics.items()}
        self.call("on_evaluate", metrics=named)
        key, s = self.args.metric_for_best_model if self.callbacks else None, self.state
        if key is None or key not in named:
            return
        value = named[key]
        if s.best_metric is None or (value > s.best_metric if self.args.greater_is_better else value < s.best_metric):
            s.best_metric, s.best_global_step = value, s.global_step

    def saved(self) -> None:
        self.call("on_save")
        self.control.should_save = False  # as transformers' CallbackHandler.on_save: the request is met
