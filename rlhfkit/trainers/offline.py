"""The offline loop (SFT, reward model, DPO/IPO/SimPO/ORPO, KTO): one base class, because these trainers are one loop.

Each step: this process's micro-batches of the step (a pure function of the step number, so resuming needs no
data-loader state), the loss of each normalised by the *global* item count (so accumulation and data parallelism
leave the loss unchanged), backward, then the one `optimizer_step` (clip, fp16 scaler, skip, schedule); logging,
evaluation and atomic checkpoints through the `Run`. A stage subclass supplies the data kind, the model, the collator,
the item count and `compute_loss`; it never re-implements the loop. The online trainers write their own loops with
the same services (`Run`, `optimizer_step`); RFT's loop of iterations is its own, and its fine-tuning step calls this
module's `train_step` and `micro_batch_positions`. Neither inherits from here.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Callable, Sequence

import torch

from rlhfkit.config import TrainConfig
from rlhfkit.objects import Objects
from rlhfkit.trainers.optim import Fault, Optim, build_optimizer, build_scheduler, optimizer_step
from rlhfkit.trainers.processes import global_share, sums_by_name
from rlhfkit.trainers.run import Run

logger = logging.getLogger("rlhfkit")


def micro_batch_positions(run: Run, step: int, n: int, steps_per_epoch: int) -> tuple[list[int], list[range]]:
    """The dataset indices of optimizer step `step` over all processes and, per micro-batch, the positions in them
    that this process holds: micro-batch a is the a-th slice of per_device_batch_size × world positions, and process
    r holds its r-th part. Any world size with the same global batch (per-device batch × processes × accumulation)
    trains on the same examples in the same steps."""
    o = run.cfg.optim
    per_micro = o.per_device_batch_size * run.world
    order = run.step_indices(step, n, per_micro * o.grad_accum_steps, steps_per_epoch)
    first = run.accelerator.process_index * o.per_device_batch_size
    return order, [range(a * per_micro + first, a * per_micro + first + o.per_device_batch_size)
                   for a in range(o.grad_accum_steps)]


def train_step(run: Run, optim: Optim, model, micro: list, count: Callable, compute_loss: Callable,
               step: int) -> dict[str, float]:
    """One optimizer step over this process's micro-batches `micro`; returns the step's metrics: item-weighted means
    over the global batch (every micro-batch of every process), as one process holding it all would log them.
    A non-finite loss on any process, or gradient norm, skips the update (`optimizer_step`). `step` is 1-based."""
    acc = run.accelerator
    # Switched only when some module is not in training mode (a model loaded in eval mode, an evaluation, a callback's
    # eval()): a real switch walks every module and makes transformers choose its kernels again.
    if not all(m.training for m in model.modules()):
        model.train()
    counts = [count(b) for b in micro]
    per_process = global_share(run, {"items": float(sum(counts))})["items"]  # this process's share of the global count
    total = per_process * run.world
    sums: dict[str, torch.Tensor] = {}  # metric -> this process's item-weighted sum
    nonfinite = 0.0
    for i, (batch, n) in enumerate(zip(micro, counts)):
        last = i == len(micro) - 1
        with run.no_sync(model, last):
            loss, metrics = compute_loss(model, batch.to(acc.device), per_process)
            run.backward(loss, last=last)
        nonfinite += float(not torch.isfinite(loss.detach()))
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float32, device=acc.device).detach() * n
    # One sum over processes: the metric sums and the non-finite losses. The skip is decided on it, so every process
    # skips the same steps and DDP replicas stay identical.
    totals, own = sums_by_name(run, sums, {"nonfinite": nonfinite})
    out = {k: v / max(total, 1) for k, v in totals.items()}
    out["lr"] = optim.lr
    result = optimizer_step(optim, step, Fault.LOSS if own["nonfinite"] > 0 else None)
    if optim.max_grad_norm is not None:
        out["grad_norm"] = result.grad_norm
    out["faults/skipped_total"] = float(optim.bad_steps)
    return out


class OfflineTrainer:
    """Base of the offline trainers. Subclasses set `kind` and implement the four methods marked below."""

    kind: str = ""  # data kind for rlhfkit.data.build_datasets

    def __init__(self, cfg: TrainConfig, objects: Objects | None = None):
        """`objects`: what the Python API was given (`rlhfkit.train`): model, tokenizer, TrainerCallbacks."""
        self.cfg, self.objects = cfg, objects or Objects()
        # The lock taken and output_dir checked, before anything loads; the callbacks called at the run's events.
        self.run = Run(cfg, f"{self.kind} training", self.objects.callbacks)

    # -- to implement -------------------------------------------------------------------------------------------
    def load_model(self, tokenizer) -> torch.nn.Module:
        raise NotImplementedError

    def collate(self, examples: list[dict]):
        raise NotImplementedError

    def count(self, batch) -> int:
        """How many loss items (tokens, pairs) the batch holds: the normaliser of the global mean."""
        raise NotImplementedError

    def compute_loss(self, model, batch, num_items: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's items and divided by `num_items` (the global count of the accumulation
        window, per process), and metrics as scalar means over this batch."""
        raise NotImplementedError

    def prepare_train_set(self, examples: list[dict]) -> list[dict]:
        """Hook for whole-dataset transforms (SFT packing); identity by default."""
        return examples

    model_task = "CAUSAL_LM"  # what `load_model` builds, for the structure check before the data is read

    def model_config(self):
        """The model settings `load_model` loads with (the structure check reads them before the data)."""
        return self.cfg.model

    # -- setup ----------------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """1. tokenizer, the model's structure checked from its config alone (LoRA targets, num_layers), then the
        data, so bad settings fail before a model loads; 2. accelerate, models, optimizer (seeded again, so initial
        weights do not depend on what data loading consumed); 3. resume."""
        from accelerate.utils import set_seed

        from rlhfkit.data import build_datasets
        from rlhfkit.launch import distributed_state
        from rlhfkit.models import check_model_structure, load_tokenizer

        cfg, run = self.cfg, self.run
        set_seed(cfg.seed)
        with distributed_state().main_process_first():  # one process tokenises into the cache; the others then read it
            self.tokenizer = load_tokenizer(cfg.model, given=self.objects.tokenizer)
            check_model_structure(self.model_config(), self.tokenizer, self.model_task, given=self.objects.model)
            train_set, self.eval_set = build_datasets(self.kind, cfg.data, self.tokenizer, cfg.seed)
            self.train_set = self.prepare_train_set(train_set)
        self.accelerator = run.make_accelerator()
        self.world = run.world
        set_seed(cfg.seed)
        self.build()
        self.start_step, self.window = 0, []
        if run.resume_from:
            state = run.resume([self.model], self.load_models, self.optim)
            self.start_step = int(state["step"])
            self.window = json.loads(state.get("log_window", "[]"))
            self.load_extra_state(state)
            run.restore_rng(state)

    def build(self) -> None:
        """Model, optimizer and schedule: sets `model`, `optim`, `steps_per_epoch`, `total_steps`."""
        cfg = self.cfg
        model = self.load_model(self.tokenizer)
        if cfg.data.padding_free:
            self.use_padding_free_attention(model)
        per_step = cfg.optim.per_device_batch_size * self.world * cfg.optim.grad_accum_steps
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / per_step))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        # The scheduler is not prepared: accelerate would step it once per process, stretching warmup.
        self.model, optimizer = self.accelerator.prepare(model, optimizer)
        self.optim = self.run.make_optim(optimizer, scheduler, [self.model])

    def use_padding_free_attention(self, model) -> None:
        """data.padding_free: attention per sequence of a row (`attention.use_padding_free_attention`), or a note that it
        is one masked (N, N) product over the whole row."""
        from rlhfkit.attention import PADDING_FREE_ATTENTION, use_padding_free_attention

        attention = use_padding_free_attention(model)
        if attention != PADDING_FREE_ATTENTION and not attention.startswith("flash"):
            logger.info("data.padding_free with %s attention: each row's attention is one masked (N, N) product over all "
                        "its sequences, which can cost more than the padding it saves", attention)

    # -- checkpoints -------------------------------------------------------------------------------------------------
    def save_models(self, directory: str, models: list) -> None:
        """Write the model of a checkpoint into `directory` (whole, as the main process writes it)."""
        from rlhfkit.models import save_model

        save_model(models[0], self.tokenizer, directory, merge_lora=False)

    def load_models(self, checkpoint: str) -> None:
        """Load the weights `save_models` wrote (every process: under FSDP and ZeRO-3 each takes its slice)."""
        import os

        from rlhfkit.checkpoint import load_model_weights
        from rlhfkit.sharding import loaded_weights

        model_dir = os.path.join(checkpoint, "model")
        loaded_weights(self.accelerator, self.model, lambda m: load_model_weights(m, model_dir), self.run.unwrap(self.model))

    def load_extra_state(self, state: dict) -> None:
        """Restore what a subclass added to the checkpoint; nothing by default."""

    def checkpoint(self, step: int) -> None:
        """checkpoint-{step}/ with the partial logging window (a resumed run logs the same means)."""
        extra = {"log_window": json.dumps(self.window)}
        self.run.save_checkpoint(step, [self.model], self.save_models, self.optim, extra)

    # -- the loop ------------------------------------------------------------------------------------------------
    def micro_batches(self, step: int) -> list:
        """This process's micro-batches for optimizer step `step`: a pure function of the step."""
        order, positions = micro_batch_positions(self.run, step, len(self.train_set), self.steps_per_epoch)
        return [self.collate([self.train_set[order[p]] for p in mine]) for mine in positions]

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step (0-based `step`) of the offline loop: see `train_step`."""
        return train_step(self.run, self.optim, self.model, self.micro_batches(step), self.count, self.compute_loss,
                          step + 1)

    def fit(self) -> dict[str, float]:
        """Train to `total_steps`; returns the last logged training and eval metrics."""
        with self.run as run:
            self.setup()
            run.begin(self.start_step, self.total_steps, self.steps_per_epoch)
            log, last, t0 = self.cfg.logging, {}, time.time()
            for step in range(self.start_step, self.total_steps):
                metrics = self.train_step(step)
                self.window.append(metrics)
                done = step + 1
                run.step_end(done, {"loss": metrics.get("loss", float("nan"))})
                if done % log.logging_steps == 0 or done == self.total_steps:
                    last = {k: sum(m[k] for m in self.window) / len(self.window) for k in self.window[0]}
                    last.update({"faults/skipped_total": float(self.optim.bad_steps),
                                 "epoch": done / self.steps_per_epoch, "elapsed_s": time.time() - t0})
                    run.log(done, last)
                    self.window = []
                if self.eval_set and ((log.eval_steps and done % log.eval_steps == 0) or done == self.total_steps):
                    last.update(self.evaluate_and_log(done))
                if run.checkpoint_due(done, self.total_steps):
                    self.checkpoint(done)
                if run.stopping:
                    break
            run.finish(self.model, self.run.unwrap(self.model), self.tokenizer)
            return last

    def evaluate_and_log(self, done: int) -> dict[str, float]:
        ev = self.evaluate()
        self.run.evaluated(done, ev)
        self.run.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in ev.items()))
        return ev

    # -- evaluation ------------------------------------------------------------------------------------------------
    def eval_chunks(self) -> list[tuple[list[int], bool]]:
        """This process's eval examples (indices; every world-size-th one) in batches of per_device_batch_size, each
        with whether it counts. Sharded models (`Run.sharded`): a process whose share holds fewer batches than
        another's also runs filler batches (example 0, not counted), so that every process runs as many forwards."""
        n, bs = len(self.eval_set), self.cfg.optim.per_device_batch_size
        mine = list(range(self.accelerator.process_index, n, self.world))
        chunks = [(mine[start : start + bs], True) for start in range(0, len(mine), bs)]
        if self.run.sharded(self.model):
            most = math.ceil(math.ceil(n / self.world) / bs)
            chunks += [([0], False)] * (most - len(chunks))
        return chunks

    def eval_batches(self):
        """(batch, counted) for each of `eval_chunks`."""
        return ((self.collate([self.eval_set[i] for i in c]), counted) for c, counted in self.eval_chunks())

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Item-weighted means of `compute_loss` metrics over the whole eval set (every process's share)."""
        from accelerate.utils import broadcast_object_list

        acc = self.accelerator
        # The module itself, not its DDP wrapper: a DDP forward may sync buffers with the other processes, whose shares
        # of the eval set can hold fewer batches (or none).
        model = self.run.unwrap(self.model)
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        items = torch.zeros((), device=acc.device)
        for batch, counted in self.eval_batches():
            n = self.count(batch)
            loss, metrics = self.compute_loss(model, batch.to(acc.device), float(n))
            if not counted:  # a filler batch: its forwards only keep the processes in step
                continue
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float() * n
            items += n
        # The main process names the metrics: a process whose share is empty (an eval set smaller than the world
        # size) adds zeros to the same sums.
        keys = broadcast_object_list([sorted(sums)])[0] if self.world > 1 else sorted(sums)
        totals, own = sums_by_name(self.run, {k: sums.get(k, 0.0) for k in keys}, {"items": items})
        return {f"eval/{k}": v / own["items"] for k, v in totals.items()}
