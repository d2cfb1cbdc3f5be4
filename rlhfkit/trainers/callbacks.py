"""transformers' `TrainerCallback`s in an rlhfkit run: `Run(cfg, name, callbacks=[...])` calls them at its events.

Each callback receives, as under transformers' `Trainer`, `args`, `state` (a `TrainerState`: `global_step`,
`max_steps`, `log_history`, `best_metric` kept true, and `epoch`, global_step / steps per epoch, in every stage but
rft, whose iterations are not epochs: None there) and `control` (a `TrainerControl`), plus `model`,
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
from rlhfkit.ops import sums_by_name

def stage_of(cfg) -> str:
    """The stage (`rlhfkit <stage>`) that runs `cfg`: the one whose config class it is (sft, rm, dpo, orpo, kto, rft,
    online_dpo), or for the online family's shared class its algorithm's family (ppo, rloo, grpo, reinforce_pp)."""
    import re

    from rlhfkit.algorithms import ALGORITHMS

    if type(cfg).__name__ == "OnlineConfig":
        return ALGORITHMS[cfg.algo.algorithm].family
    # SFTConfig -> sft, OnlineDPOConfig -> online_dpo (the `rlhfkit <stage>` names of rlhfkit.stages.STAGES)
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "_", type(cfg).__name__.removesuffix("Config")).lower()


# Offline stages evaluate a loss on their eval set: EarlyStoppingCallback watches it (see `RunArgs`).
LOSS_EVALUATED = ("sft", "rm", "dpo", "orpo", "kto")


@dataclasses.dataclass(frozen=True)
class RunArgs:
    """What a callback reads as `args`. The `TrainingArguments` fields below hold the run's true values; any other
    TrainingArguments field is absent (reading it raises AttributeError rather than returning a made-up value).

    Early stopping (transformers' `EarlyStoppingCallback`): with evaluations during training (an eval set and
    `logging.eval_steps` > 0), `metric_for_best_model` is `logging.metric_for_best_model` under transformers' name
    (eval/objective/scores -> "eval_objective/scores"), by default "eval_loss" on the offline stages (sft, rm, dpo,
    orpo, kto); `greater_is_better` follows transformers' rule unless `logging.greater_is_better` says;
    `on_evaluate` receives the eval figures under those names. Without one, `metric_for_best_model` is None and
    EarlyStoppingCallback refuses to start. rlhfkit keeps the final model, not the best one:
    `load_best_model_at_end` is False.
    """

    config: Any  # the resolved config (the frozen dataclass config.yaml is written from)
    stage: str  # the stage that runs it: sft, rm, dpo, orpo, kto, ppo, rloo, grpo, reinforce_pp, online_dpo, rft
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
    logging_dir: str  # output_dir (metrics.jsonl, and the trackers' local files)
    per_device_eval_batch_size: int  # optim.per_device_batch_size (evaluation uses the training's)
    warmup_steps: int  # optim.warmup_steps
    warmup_ratio: float  # optim.warmup_ratio
    weight_decay: float  # optim.weight_decay
    lr_scheduler_type: str  # optim.scheduler: constant, linear or cosine
    max_grad_norm: float | None  # optim.max_grad_norm (None: no clipping)
    adam_beta1: float  # optim.adam_betas[0]
    adam_beta2: float  # optim.adam_betas[1]
    adam_epsilon: float  # optim.adam_eps
    bf16: bool  # the mixed precision the run resolved (mixed_precision; auto: bf16 where supported)
    fp16: bool
    save_total_limit: int  # logging.save_total_limit
    gradient_checkpointing: bool  # model.gradient_checkpointing
    push_to_hub: bool  # logging.push_to_hub
    hub_model_id: str | None  # logging.hub_model_id
    hub_strategy: str  # logging.hub_strategy
    eval_strategy: IntervalStrategy
    metric_for_best_model: str | None
    greater_is_better: bool | None
    load_best_model_at_end: bool = False

    @classmethod
    def of(cls, cfg, stage: str, mixed_precision: str = "no") -> RunArgs:
        """`mixed_precision`: what the run resolved `cfg.mixed_precision` to ("no", "bf16" or "fp16")."""
        log, o = cfg.logging, cfg.optim
        evaluates = bool(cfg.data.eval or cfg.data.eval_fraction or getattr(cfg.data, "capability", None)) \
            and log.eval_steps > 0
        metric = log.metric_for_best_model
        if metric:  # transformers' name of the figure on_evaluate passes: eval/x -> eval_x
            metric = "eval_" + metric.removeprefix("eval/").removeprefix("eval_")
        elif evaluates and stage in LOSS_EVALUATED:
            metric = "eval_loss"
        greater = log.greater_is_better if log.greater_is_better is not None or not metric else not metric.endswith("loss")
        return cls(config=cfg, stage=stage, output_dir=cfg.output_dir, learning_rate=o.lr,
                   run_name=log.run_name or os.path.basename(os.path.abspath(cfg.output_dir)),
                   per_device_train_batch_size=o.per_device_batch_size, gradient_accumulation_steps=o.grad_accum_steps,
                   max_steps=cfg.max_steps, num_train_epochs=cfg.num_epochs, logging_steps=log.logging_steps,
                   save_steps=log.save_steps, eval_steps=log.eval_steps, seed=cfg.seed, report_to=list(log.report_to),
                   logging_dir=cfg.output_dir, per_device_eval_batch_size=o.per_device_batch_size,
                   warmup_steps=o.warmup_steps, warmup_ratio=o.warmup_ratio, weight_decay=o.weight_decay,
                   lr_scheduler_type=o.scheduler, max_grad_norm=o.max_grad_norm, adam_beta1=o.adam_betas[0],
                   adam_beta2=o.adam_betas[1], adam_epsilon=o.adam_eps, bf16=mixed_precision == "bf16",
                   fp16=mixed_precision == "fp16", save_total_limit=log.save_total_limit,
                   gradient_checkpointing=cfg.model.gradient_checkpointing, push_to_hub=log.push_to_hub,
                   hub_model_id=log.hub_model_id, hub_strategy=log.hub_strategy,
                   eval_strategy=IntervalStrategy.STEPS if evaluates else IntervalStrategy.NO,
                   metric_for_best_model=metric, greater_is_better=greater)



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
        self.state, self.control, self.args, self.steps_per_epoch = TrainerState(), TrainerControl(), None, None
        self.objects: dict[str, Any] = {}  # model, optimizer, lr_scheduler: passed to every call once known

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def begin(self, args: RunArgs, start_step: int, total_steps: int, accelerator, log_history: list[dict],
              steps_per_epoch: int | None = None) -> None:
        """The loop starts at `start_step` of `total_steps` (`log_history`: the rows a resumed run logged): on_train_begin.
        With `steps_per_epoch`, `state.epoch` is transformers' fractional epoch, global_step / steps_per_epoch."""
        s = self.state
        self.args, self.steps_per_epoch = args, steps_per_epoch
        s.global_step, s.max_steps, s.log_history = start_step, total_steps, log_history
        s.epoch = start_step / steps_per_epoch if steps_per_epoch else None
        s.logging_steps, s.eval_steps, s.save_steps = args.logging_steps, args.eval_steps, args.save_steps
        s.train_batch_size, s.num_train_epochs = args.per_device_train_batch_size, args.num_train_epochs
        s.is_world_process_zero, s.is_local_process_zero = accelerator.is_main_process, accelerator.is_local_main_process
        self.call("on_train_begin")

    def step_end(self, step: int) -> None:
        self.state.global_step = step
        if self.steps_per_epoch:
            self.state.epoch = step / self.steps_per_epoch
        self.call("on_step_end")

    def requests(self, sum_over_processes) -> tuple[bool, bool]:
        """(stop, save): whether a callback on any process set `control.should_training_stop`, `should_save`."""
        if not self.callbacks:
            return False, False
        c = self.control
        (asked,) = sums_by_name({"stop": float(c.should_training_stop), "save": float(c.should_save)},
                                sum_over=sum_over_processes)
        return asked["stop"] > 0, asked["save"] > 0

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
        if key is None:
            return
        if key not in named:  # EarlyStoppingCallback would only warn, and never stop
            given = self.args.config.logging.metric_for_best_model or key
            raise UserError(f"config key 'logging.metric_for_best_model': {given!r} is not among the figures of the "
                            f"evaluation at step {s.global_step} (" + ", ".join(
                                k.removeprefix("eval_") for k in named if k.startswith("eval_")) + ")")
        value = named[key]
        if s.best_metric is None or (value > s.best_metric if self.args.greater_is_better else value < s.best_metric):
            s.best_metric, s.best_global_step = value, s.global_step

    def saved(self) -> None:
        self.call("on_save")
        self.control.should_save = False  # as transformers' CallbackHandler.on_save: the request is met
