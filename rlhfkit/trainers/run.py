"""A training run's services, used the same way by every loop: `with Run(cfg, name) as run:`.

The run owns the output_dir lock and its `RunDir` (with the failure guard), accelerate's `Accelerator`, the metric
sinks, the one progress bar and `finish`. Its methods `begin`, `step_end`, `log`, `log_samples`, `evaluated`, `saved`
and `finish` are the one place where each event of a run happens: each feeds the sinks (metrics.jsonl and the
trackers of `logging.report_to`, main process only) and the transformers `TrainerCallback`s the run was given
(`rlhfkit.trainers.callbacks`, every process), which may stop it after a step (`checkpoint_due`, `stopping`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Sequence

import torch

from rlhfkit.checkpoint import load_trainer_state, save_checkpoint, set_rng_state
from rlhfkit.config import TrainConfig
from rlhfkit.io import TMP_PREFIX
from rlhfkit.hub import check_hub, publish, publish_checkpoint
from rlhfkit.launch import distributed_state, log_launch, start_run
from rlhfkit.precision import check_attn_implementation, frozen_model_dtype, resolve_mixed_precision, supports_bf16
from rlhfkit.sharding import (DEEPSPEED_STATE, clip_grad_norm, configure_deepspeed, fsdp_classes, load_deepspeed_state,
                              load_optimizer_state, optimizer_state, save_deepspeed_state, saved_weights,
                              stepped_optimizer, weight_layout_of)
from rlhfkit.trackers import check_trackers
from rlhfkit.trainers.callbacks import Callbacks, RunArgs, stage_of
from rlhfkit.trainers.memory import MemoryCheck
from rlhfkit.trainers.optim import Optim
from rlhfkit.trainers.rundir import RunDir, commit_replacement
from rlhfkit.trainers.sinks import MetricSink, close_sinks, open_sinks, to_float

logger = logging.getLogger("rlhfkit")


class Run:
    """One training run in `cfg.output_dir`. Creating it takes the directory's lock and checks the directory and the
    settings that need no model (trackers, attention implementation, hub push: last, the main process creates the repo
    it will push to) before any model loads, writing nothing else: `resume_from` is the checkpoint to resume from, if any. `callbacks`: transformers `TrainerCallback`s
    (instances or classes)."""

    def __init__(self, cfg: TrainConfig, name: str, callbacks: Sequence[Any] = ()):
        self.cfg, self.name, self.stage = cfg, name, stage_of(cfg)
        self.callbacks = Callbacks(callbacks)
        self.run_dir = RunDir(cfg)
        self.lock = start_run(cfg.output_dir)  # by the main process, until the run ends
        self.sinks: list[MetricSink] = []
        self.final_metrics: dict[str, float] = {}  # the last logged value of every metric, for the model card
        self.stopping = False  # a callback set control.should_training_stop (see `checkpoint_due`): leave the loop
        self._unwrapped: dict[int, tuple] = {}  # id(prepared module) -> (it, its unwrapped module): see `unwrap`
        self.bar = None
        try:
            state = distributed_state()
            if state.is_main_process:  # a run that an overwrite=true run, killed early, had moved aside comes back
                self.run_dir.restore_replaced()
            state.wait_for_everyone()
            self.resume_from = self.run_dir.check()
            check_trackers(cfg.logging.report_to)
            check_attn_implementation(cfg.model.attn_implementation)
            check_hub(cfg.logging.push_to_hub, cfg.logging.hub_model_id, cfg.logging.hub_strategy, state.is_main_process)
            self.memory = MemoryCheck(cfg, self.stage, state.num_processes, state.is_main_process)  # before any model
        except BaseException:
            self.lock.release()
            raise

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self.run_dir.guard()
        finally:
            self.memory.close(say=exc_type is None)
            if self.bar is not None:
                self.bar.close()
            self.sinks = close_sinks(self.sinks)  # a failed run's tracker runs end too: a resume here reopens them
            self.lock.release()  # last: the cleanup above still runs under the lock

    def make_accelerator(self):
        """accelerate with the run's mixed precision ("auto" resolved for this device); sets `accelerator`, `world`,
        `mixed_precision` and `frozen_dtype` (the dtype reward models and a separate reference load in)."""
        from accelerate import Accelerator

        cfg, device = self.cfg, distributed_state().device
        self.mixed_precision = resolve_mixed_precision(cfg.mixed_precision, device.type, supports_bf16(device))
        self.frozen_dtype = frozen_model_dtype(self.mixed_precision, cfg.model.dtype)
        self.accelerator = Accelerator(mixed_precision=self.mixed_precision, project_dir=cfg.output_dir)
        configure_deepspeed(self.accelerator, cfg.optim.per_device_batch_size)
        log_launch(self.accelerator)  # its line names the mixed precision chosen
        self.world = self.accelerator.num_processes
        return self.accelerator

    # Services of the loops: modules, collectives, data order ---------------------------------------------------
    def unwrap(self, module):
        """The prepared `module` to call directly (no-grad forwards, attributes): `accelerator.unwrap_model(module)`
        — DDP's wrapper off (its forward may sync buffers with the other processes) — except an FSDP1 wrapper, which
        stays: only its forward gathers the root unit's weights (embeddings, final norm, head). Remembered per
        module: accelerate probes the installed packages at every call, and the loops need it several times a
        micro-batch."""
        held = self._unwrapped.get(id(module))
        if held is None or held[0] is not module:
            fsdp1 = fsdp_classes()[0]
            inner = module if fsdp1 is not None and isinstance(module, fsdp1) else self.accelerator.unwrap_model(module)
            held = self._unwrapped[id(module)] = (module, inner)
        return held[1]

    def sharded(self, model) -> bool:
        """Whether `model`'s weights are sharded (FSDP, ZeRO-3): every forward of it is then collective, so every
        process must run as many as the others."""
        return weight_layout_of(self.accelerator, model, self.unwrap(model)) != "whole"

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """accelerate's backward of one micro-batch of an optimizer step; `last`: the step's last backward. Under
        DeepSpeed accelerate runs the engine's step inside `backward` whenever gradients are to sync, and marks that
        backward as the end of an accumulation: only the last backward is, so several micro-batches make one
        DeepSpeed step over their summed gradients (rlhfkit does not use accelerate's `accumulate`). Elsewhere the
        flag changes nothing: DDP's sync is `no_sync`'s business."""
        acc = self.accelerator
        if acc.distributed_type != "DEEPSPEED" or last:
            acc.backward(loss)
            return
        acc.gradient_state._set_sync_gradients(False)
        try:
            acc.backward(loss)
        finally:
            acc.gradient_state._set_sync_gradients(True)

    def no_sync(self, model, last: bool):
        """DDP: no gradient all-reduce for a micro-batch's backward but the step's last."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def on_every_process(self, flag: bool) -> bool:
        """Whether `flag` holds on every process: every decision that changes control flow is taken on it, so the
        processes never fall out of step (one all-reduce)."""
        if self.world == 1:
            return bool(flag)
        return self.accelerator.reduce(torch.tensor(float(not flag), device=self.accelerator.device), "sum").item() == 0

    def sum_over_processes(self, x: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(x, "sum") if self.world > 1 else x
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(world·B, ...) the rows of every process, in process order (B is the same on every process)."""
        return self.accelerator.gather(x) if self.world > 1 else x

    def permutation(self, n: int, epoch: int) -> torch.Tensor:
        """A permutation of range(n) seeded by (seed, epoch): data order is a function of the step alone, so
        resuming needs no data-loader state."""
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch))

    def step_indices(self, step: int, n: int, per_step: int, steps_per_epoch: int) -> list[int]:
        """The `per_step` dataset indices (all processes) of step `step`: epoch e's permutation, wrapped around to
        fill its last step."""
        epoch, k = divmod(step, steps_per_epoch)
        order = self.permutation(n, epoch).repeat(math.ceil(steps_per_epoch * per_step / n))
        return order[k * per_step : (k + 1) * per_step].tolist()

    def make_optim(self, optimizer, scheduler, trained: list) -> Optim:
        """The run's `Optim`: gradients of the prepared models `trained` clipped together (one global norm). The
        callbacks receive the first model (the policy), the optimizer and the schedule from here on."""
        acc, cfg = self.accelerator, self.cfg
        self.callbacks.objects.update(model=self.unwrap(trained[0]), optimizer=optimizer, lr_scheduler=scheduler)
        return Optim(stepped_optimizer(acc, optimizer), scheduler, clip=lambda max_norm: clip_grad_norm(acc, trained, max_norm),
                     max_grad_norm=cfg.optim.max_grad_norm, scaler=acc.scaler, max_bad_steps=cfg.max_bad_steps,
                     output_dir=cfg.output_dir)

    # Checkpoints -------------------------------------------------------------------------------------------------
    def save_checkpoint(self, step: int, trained: list, save_models, optim, extra: dict) -> None:
        """checkpoint-{step}/: `save_models(directory, whole_models)` + optimizer, scheduler, RNG, skipped steps and
        `extra`. `trained` are the prepared models the optimizer trains, the policy first."""
        acc, out = self.accelerator, self.cfg.output_dir
        acc.wait_for_everyone()
        deepspeed_dir = os.path.join(out, f"{TMP_PREFIX}deepspeed-{step}")
        if acc.distributed_type == "DEEPSPEED":
            optimizer = save_deepspeed_state(acc, deepspeed_dir)  # every process writes its partition
        else:
            optimizer = optimizer_state(acc, trained, optim.optimizer)  # collective under FSDP

        def write_models(directory: str) -> None:
            save_models(directory, models)
            if optimizer == DEEPSPEED_STATE:  # into the checkpoint being written: it appears with it, whole
                os.replace(deepspeed_dir, os.path.join(os.path.dirname(directory), "deepspeed"))

        with contextlib.ExitStack() as stack:  # FSDP / ZeRO-3: the weights whole while the main process writes them
            models = [stack.enter_context(saved_weights(acc, m, self.unwrap(m))) for m in trained]
            if acc.is_main_process:
                state = {"optimizer": optimizer, "scheduler": optim.scheduler.state_dict(), "bad_steps": optim.bad_steps, **extra}
                save_checkpoint(out, step, write_models, state, self.cfg.logging.save_total_limit)
        acc.wait_for_everyone()
        self.saved(step)

    def resume(self, trained: list, load_models, optim) -> dict:
        """Load `resume_from` into the models (`load_models(checkpoint)`, every process), the optimizer, the schedule
        and the skipped-step count; return its trainer state (the caller restores its extra state, then calls
        `restore_rng`)."""
        checkpoint, state = self.resume_from, load_trainer_state(self.resume_from)
        load_models(checkpoint)
        if self.accelerator.distributed_type == "DEEPSPEED" or state["optimizer"] == DEEPSPEED_STATE:
            load_deepspeed_state(self.accelerator, checkpoint, state["optimizer"])
        else:
            load_optimizer_state(self.accelerator, trained, optim.optimizer, state["optimizer"], checkpoint)
        optim.scheduler.load_state_dict(state["scheduler"])
        optim.bad_steps = int(state.get("bad_steps", 0))
        logger.info("resuming from %s (step %d)", checkpoint, int(state["step"]))
        return state

    @staticmethod
    def restore_rng(state: dict) -> None:  # last of a resume: nothing after it may draw random numbers before training
        set_rng_state(state["rng"])

    # Events -------------------------------------------------------------------------------------------------------
    def begin(self, start_step: int, total_steps: int, steps_per_epoch: int | None = None) -> None:
        """Create the run directory (main process), open the sinks and the progress bar, call on_train_begin
        (`steps_per_epoch`: what the callbacks' `state.epoch` counts in; None: no epochs)."""
        acc, cfg = self.accelerator, self.cfg
        if acc.is_main_process:
            self.run_dir.prepare(start_step if self.resume_from else None)
        acc.wait_for_everyone()
        self.memory.started(total_steps)  # plan.json beside config.yaml
        args = RunArgs.of(cfg, self.stage, self.mixed_precision)
        if acc.is_main_process:
            self.sinks = open_sinks(cfg, self.stage, args.run_name)
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, initial=start_step, desc=self.name, dynamic_ncols=True,
                        disable=not (cfg.logging.progress_bar and acc.is_main_process))
        history = self.run_dir.logged_rows() if self.resume_from and self.callbacks else []
        self.callbacks.begin(args, start_step, total_steps, acc, history, steps_per_epoch)

    def step_end(self, step: int, postfix: dict[str, float]) -> None:
        """Optimizer step `step` (1-based) is done."""
        self.bar.update(1)
        self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()})
        self.callbacks.step_end(step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Metrics of step `step`, the same on every process: into the sinks (main process), then on_log."""
        floats = {k: to_float(v) for k, v in {**metrics, **self.memory.peaks_at(step, metrics)}.items()}
        self.final_metrics.update(floats)
        if self.accelerator.is_main_process:
            for sink in self.sinks:
                sink.log(step, floats)
        self.callbacks.logged(step, floats)

    def evaluated(self, step: int, metrics: dict[str, Any]) -> None:
        """The eval figures of step `step` (keys under eval/): logged, then on_evaluate."""
        self.log(step, metrics)
        self.callbacks.evaluated({k: to_float(v) for k, v in metrics.items()})

    def log_samples(self, step: int, rows: list[dict]) -> None:
        for sink in self.sinks if self.accelerator.is_main_process else ():
            sink.log_samples(step, rows)

    def checkpoint_due(self, step: int, total_steps: int) -> bool:
        """Whether the loop writes checkpoint-{step} after step `step`: every `logging.save_steps`, when a callback
        asked (`control.should_save`), and when a callback stops the run before its end (so that it can be resumed).
        Decided on every process alike; sets `stopping`."""
        self.stopping, asked = self.callbacks.requests(lambda t: self.sum_over_processes(t.to(self.accelerator.device)).cpu())
        save_steps = self.cfg.logging.save_steps
        return step < total_steps and (bool(save_steps and step % save_steps == 0) or asked or self.stopping)

    def write(self, line: str) -> None:
        """A line on the console above the progress bar (main process)."""
        if self.accelerator.is_main_process:
            self.bar.write(line)

    def saved(self, step: int) -> None:
        """checkpoint-{step} is complete: the run that overwrite=true replaces can go, the checkpoint is pushed as
        `logging.hub_strategy` says, on_save is called."""
        if self.accelerator.is_main_process:
            commit_replacement(self.cfg.output_dir)
            publish_checkpoint(self.cfg, os.path.join(self.cfg.output_dir, f"checkpoint-{step}"))
        self.callbacks.saved()

    def save_final(self, model, unwrapped, tokenizer) -> None:
        """Write the trained model into output_dir, beside config.yaml and metrics.jsonl (`RunDir.write_final_model`)."""
        from rlhfkit.models import save_model

        acc = self.accelerator
        acc.wait_for_everyone()
        with saved_weights(acc, model, unwrapped) as whole:  # FSDP / ZeRO-3: whole (collective)
            if acc.is_main_process:
                self.run_dir.write_final_model(lambda d: save_model(whole, tokenizer, d, merge_lora=self.cfg.model.lora.merge_on_save))

    def finish(self, model, unwrapped, tokenizer) -> None:
        """The end of every run: the final model, the sinks closed, dashboard.png, report.html and the model card
        (README.md), the push to the hub (`logging.push_to_hub`), then on_train_end."""
        self.memory.close()  # the training's peak (into plan.json), before the final save's copies
        self.save_final(model, unwrapped, tokenizer)
        self.bar.close()
        self.sinks = close_sinks(self.sinks)
        if self.accelerator.is_main_process:
            from rlhfkit.evaluation.report import write_run_artifacts

            write_run_artifacts(self.cfg.output_dir)  # warns, never fails the run
            publish(self.cfg, self.stage, self.final_metrics)
        self.callbacks.call("on_train_end")
