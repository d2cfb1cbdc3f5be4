"""What every trainer shares: the run directory, accelerate, the optimizer and schedule, checkpoints, logging.

`Trainer.fit()` is the offline loop (SFT, reward model, preference methods): seeded batches, gradient
accumulation normalised by *global* item counts (so accumulation and data parallelism leave the loss unchanged),
clipping, logging, evaluation and atomic checkpoints. A stage subclass supplies the data kind, the model, the
collator and `compute_loss`; it never re-implements the loop. The online RL trainer writes its own loop and uses
the same services (`RunDir`, `MetricsLogger`, `save_checkpoint`, `load_checkpoint`).
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import math
import os
import random
import re
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from rlhfkit.config import TrainConfig, config_to_yaml
from rlhfkit.errors import UserError

logger = logging.getLogger("rlhfkit")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
RUN_MARKERS = ("config.yaml", "metrics.jsonl")


# 1. The run directory -------------------------------------------------------------------------------------------


class RunDir:
    """Guards `output_dir`: never overwrites another run unless asked, and finds checkpoints to resume from."""

    def __init__(self, cfg: TrainConfig):
        self.path = cfg.output_dir
        self.cfg = cfg

    def check(self) -> str | None:
        """Fail early (before any model loads, writing nothing) if the directory can't be used; return the
        checkpoint to resume from, if any."""
        path, cfg = self.path, self.cfg
        self.check_writable(path)
        entries = os.listdir(path) if os.path.isdir(path) else []
        holds_run = any(m in entries for m in RUN_MARKERS) or any(CHECKPOINT_RE.match(e) for e in entries)
        if cfg.resume:
            ckpt = latest_checkpoint(path)
            if ckpt is None:
                raise UserError(f"resume=true but output_dir '{path}' holds no complete checkpoint-N directory")
            return ckpt
        if entries and not holds_run:
            raise UserError(f"output_dir '{path}' is not empty and holds no rlhfkit run; choose a new or empty directory")
        if holds_run and not cfg.overwrite:
            raise UserError(
                f"output_dir '{path}' holds another run ({', '.join(sorted(e for e in entries if e in RUN_MARKERS)) or 'checkpoints'}); "
                "pass overwrite=true to replace it or resume=true to continue it"
            )
        return None

    @staticmethod
    def check_writable(path: str, key: str = "output_dir") -> None:
        """Fail (writing nothing) unless `path` is a directory, or can be created as one, that we may write into."""
        if os.path.exists(path) and not os.path.isdir(path):
            raise UserError(f"{key} '{path}' exists and is not a directory")
        existing = os.path.abspath(path)  # the nearest existing ancestor decides
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise UserError(f"{key} '{path}' cannot be created: '{existing}' is a file, not a directory")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise UserError(f"{key} '{path}' is not writable: no permission to write in '{existing}'")

    def prepare(self, resume_step: int | None) -> None:
        """Create the directory (clearing an old run when overwrite=true) and write the resolved config."""
        if self.cfg.overwrite and os.path.isdir(self.path):
            shutil.rmtree(self.path)
        os.makedirs(self.path, exist_ok=True)
        atomic_write_text(os.path.join(self.path, "config.yaml"), config_to_yaml(self.cfg))
        metrics = os.path.join(self.path, "metrics.jsonl")
        if resume_step is not None and os.path.exists(metrics):
            # Drop lines logged after the checkpoint by the interrupted run: the resumed run logs them again.
            with open(metrics, encoding="utf-8") as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            atomic_write_text(metrics, "".join(kept))


def atomic_write_text(path: str, text: str) -> None:
    """Write to a temporary file in the same directory, then rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# 2. Metrics ----------------------------------------------------------------------------------------------------


class MetricsLogger:
    """One JSON object per logged step in `metrics.jsonl`, mirrored to TensorBoard/W&B when configured."""

    def __init__(self, output_dir: str, accelerator, report_to: list[str]):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.accelerator = accelerator
        self.trackers = bool(report_to)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.accelerator.is_main_process:
            return
        record = {"step": step, **{k: _to_float(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers:
            self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)


def _to_float(v: Any) -> float:
    return float(v.item()) if isinstance(v, torch.Tensor) else float(v)


def check_report_to(report_to: list[str]) -> None:
    """Fail before training if a requested metric sink is not installed."""
    import importlib.util

    package = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for sink in report_to:
        if importlib.util.find_spec(package[sink]) is None:
            raise UserError(f"logging.report_to includes '{sink}' but it is not installed: pip install 'rlhfkit[{sink}]'")


# 3. Checkpoints ------------------------------------------------------------------------------------------------


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete checkpoint (one holding trainer_state.pt)."""
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        m = CHECKPOINT_RE.match(os.path.basename(path))
        if m and os.path.isfile(os.path.join(path, "trainer_state.pt")):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def rng_state() -> dict:
    state = {
        "python": list(random.getstate()[1]),
        "python_pos": random.getstate()[2] if random.getstate()[2] is not None else -1,
        "numpy": np.random.get_state()[1].tolist(),
        "numpy_pos": int(np.random.get_state()[2]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), None if state["python_pos"] == -1 else state["python_pos"]))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str, step: int, save_model: Callable[[str], None], state: dict, keep: int) -> str:
    """Write checkpoint-{step}/ atomically (model via `save_model(dir)` + trainer_state.pt), then prune old ones.

    `state` holds only tensors, numbers, strings, lists and dicts, so it loads with `torch.load(weights_only=True)`
    — resuming never unpickles arbitrary objects.
    """
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = tempfile.mkdtemp(dir=output_dir, prefix=f".tmp-checkpoint-{step}-")
    try:
        save_model(os.path.join(tmp, "model"))
        torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    steps = sorted(int(m.group(1)) for e in os.listdir(output_dir) if (m := CHECKPOINT_RE.match(e)))
    for old in steps[:-keep]:
        shutil.rmtree(os.path.join(output_dir, f"checkpoint-{old}"), ignore_errors=True)
    return final


def load_checkpoint(path: str) -> dict:
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True, map_location="cpu")


def load_model_weights(model: torch.nn.Module, model_dir: str) -> None:
    """Load a checkpoint's weights into `model` in place: a full model's safetensors, or a peft adapter."""
    from safetensors.torch import load_file

    adapter = os.path.join(model_dir, "adapter_model.safetensors")
    if os.path.isfile(adapter):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise UserError(f"checkpoint '{model_dir}' holds no safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied weights (e.g. lm_head = embed_tokens) are saved once; anything else missing is a real mismatch.
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise UserError(f"checkpoint '{model_dir}' does not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


# 4. Optimizer and schedule -------------------------------------------------------------------------------------


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over trainable parameters; biases and norm weights (1-D tensors) get no weight decay."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.adam_betas), eps=cfg.optim.adam_eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    from transformers import get_scheduler

    warmup = cfg.optim.warmup_steps or math.ceil(cfg.optim.warmup_ratio * total_steps)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optim.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


# 5. The offline loop -------------------------------------------------------------------------------------------


class Trainer:
    """Base of the offline trainers. Subclasses set `kind` and implement the four methods marked below."""

    kind: str = ""  # data kind for rlhfkit.data.build_datasets

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.run_dir = RunDir(cfg)
        self.resume_from = self.run_dir.check()
        check_report_to(cfg.logging.report_to)

    # -- to implement -----------------------------------------------------------------------------------------
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

    # -- shared -----------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Tokenizer, data, model, accelerate — in that order, so bad data fails before a model loads."""
        from accelerate.utils import set_seed

        from rlhfkit.data import build_datasets
        from rlhfkit.models import load_tokenizer

        cfg = self.cfg
        set_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model)
        train_set, self.eval_set = build_datasets(self.kind, cfg.data, self.tokenizer, cfg.seed)
        self.train_set = self.prepare_train_set(train_set)
        self.accelerator = self.make_accelerator()
        set_seed(cfg.seed)  # the same initial weights (new heads, LoRA) whatever the data loading consumed
        model = self.load_model(self.tokenizer)
        self.world = self.accelerator.num_processes
        per_step = cfg.optim.per_device_batch_size * self.world * cfg.optim.grad_accum_steps
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / per_step))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        # The scheduler is not prepared: accelerate would step it once per process, stretching warmup.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.start_step = 0
        if self.resume_from:
            state = load_checkpoint(self.resume_from)
            load_model_weights(self.accelerator.unwrap_model(self.model), os.path.join(self.resume_from, "model"))
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            self.start_step = int(state["step"])
            logger.info("resuming from %s (step %d)", self.resume_from, self.start_step)
        if self.accelerator.is_main_process:
            self.run_dir.prepare(self.start_step if self.resume_from else None)
        self.accelerator.wait_for_everyone()
        if cfg.logging.report_to:
            self.accelerator.init_trackers(cfg.logging.run_name or os.path.basename(os.path.abspath(cfg.output_dir)))
        self.metrics = MetricsLogger(cfg.output_dir, self.accelerator, cfg.logging.report_to)

    def make_accelerator(self):
        """accelerate with the run's mixed precision and metric sinks (every stage's setup starts with one)."""
        from accelerate import Accelerator

        cfg = self.cfg
        return Accelerator(mixed_precision=cfg.mixed_precision, log_with=cfg.logging.report_to or None,
                           project_dir=cfg.output_dir)

    def micro_batches(self, step: int) -> list:
        """This process's micro-batches for optimizer step `step`.

        Epoch e uses a permutation seeded by (seed, e), wrapped around to fill its last step, so the batches of any
        step are a pure function of the step: resuming needs no data-loader state.
        """
        o = self.cfg.optim
        per_micro = o.per_device_batch_size * self.world
        per_step = per_micro * o.grad_accum_steps
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch)
        perm = torch.randperm(len(self.train_set), generator=g)
        reps = math.ceil(self.steps_per_epoch * per_step / len(perm))
        order = perm.repeat(reps)[k * per_step : (k + 1) * per_step].tolist()
        rank = self.accelerator.process_index
        batches = []
        for a in range(o.grad_accum_steps):
            chunk = order[a * per_micro : (a + 1) * per_micro]
            mine = chunk[rank * o.per_device_batch_size : (rank + 1) * o.per_device_batch_size]
            batches.append(self.collate([self.train_set[i] for i in mine]))
        return batches

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the step's metrics."""
        acc, model = self.accelerator, self.model
        micro = self.micro_batches(step)
        counts = [self.count(b) for b in micro]
        total = acc.reduce(torch.tensor(float(sum(counts)), device=acc.device), reduction="sum").item()
        # DDP averages gradients over processes; scaling by world size turns that average back into the global sum.
        per_process = total / self.world
        sums: dict[str, float] = {}
        model.train()
        for i, (batch, n) in enumerate(zip(micro, counts)):
            sync = contextlib.nullcontext() if i == len(micro) - 1 else acc.no_sync(model)
            with sync:
                loss, metrics = self.compute_loss(model, batch.to(acc.device), per_process)
                acc.backward(loss)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
        out = {k: v / max(sum(counts), 1) for k, v in sums.items()}
        if self.cfg.optim.max_grad_norm is not None:
            out["grad_norm"] = float(acc.clip_grad_norm_(model.parameters(), self.cfg.optim.max_grad_norm))
        out["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Item-weighted means of `compute_loss` metrics over this process's shard of the eval set."""
        acc, model = self.accelerator, self.model
        model.eval()
        bs, rank = self.cfg.optim.per_device_batch_size, acc.process_index
        shard = self.eval_set[rank :: self.world]
        sums: dict[str, torch.Tensor] = {}
        for start in range(0, len(shard), bs):
            batch = self.collate(shard[start : start + bs])
            n = self.count(batch)
            loss, metrics = self.compute_loss(model, batch.to(acc.device), float(n))
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, torch.zeros((), device=acc.device)) + v.detach().float() * n
            sums["_n"] = sums.get("_n", torch.zeros((), device=acc.device)) + n
        keys = sorted(sums)
        totals = acc.reduce(torch.stack([sums[k] for k in keys]), reduction="sum")
        n = totals[keys.index("_n")].item()
        return {f"eval/{k}": totals[i].item() / n for i, k in enumerate(keys) if k != "_n"}

    def save_final(self) -> None:
        """Write the trained model into output_dir (model files beside config.yaml and metrics.jsonl)."""
        from rlhfkit.models import save_model

        acc = self.accelerator
        acc.wait_for_everyone()
        if not acc.is_main_process:
            return
        model = acc.unwrap_model(self.model)
        tmp = tempfile.mkdtemp(dir=self.cfg.output_dir, prefix=".tmp-model-")
        try:
            save_model(model, self.tokenizer, os.path.join(tmp, "model"), merge_lora=self.cfg.model.lora.merge_on_save)
            for name in os.listdir(os.path.join(tmp, "model")):
                os.replace(os.path.join(tmp, "model", name), os.path.join(self.cfg.output_dir, name))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def checkpoint(self, step: int) -> None:
        from rlhfkit.models import save_model

        acc = self.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            model = acc.unwrap_model(self.model)
            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
            save_checkpoint(
                self.cfg.output_dir, step, lambda d: save_model(model, self.tokenizer, d, merge_lora=False), state,
                self.cfg.logging.save_total_limit,
            )
        acc.wait_for_everyone()

    def fit(self) -> dict[str, float]:
        """Train to `total_steps`; returns the last logged training and eval metrics."""
        from tqdm.auto import tqdm

        self.setup()
        log = self.cfg.logging
        bar = tqdm(
            total=self.total_steps, initial=self.start_step, desc=f"{self.kind} training", dynamic_ncols=True,
            disable=not (log.progress_bar and self.accelerator.is_main_process),
        )
        window: list[dict[str, float]] = []
        last: dict[str, float] = {}
        t0 = time.time()
        for step in range(self.start_step, self.total_steps):
            metrics = self.train_step(step)
            window.append(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}")
            done = step + 1
            if done % log.logging_steps == 0 or done == self.total_steps:
                last = {k: sum(m[k] for m in window) / len(window) for k in window[0]}
                last.update(epoch=done / self.steps_per_epoch, elapsed_s=time.time() - t0)
                self.metrics.log(done, last)
                window = []
            if self.eval_set and ((log.eval_steps and done % log.eval_steps == 0) or done == self.total_steps):
                ev = self.evaluate()
                self.metrics.log(done, ev)
                last.update(ev)
                bar.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in ev.items()))
            if log.save_steps and done % log.save_steps == 0 and done < self.total_steps:
                self.checkpoint(done)
        bar.close()
        self.finish()
        return last

    def finish(self) -> None:
        """The end of every run: the final model, the trackers closed, then dashboard.png and report.html."""
        self.save_final()
        if self.cfg.logging.report_to:
            self.accelerator.end_training()
        if self.accelerator.is_main_process:
            from rlhfkit.evaluation.report import write_run_artifacts

            write_run_artifacts(self.cfg.output_dir)  # warns, never fails the run
