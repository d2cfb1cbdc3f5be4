"""What every trainer shares: the run directory, accelerate, the optimizer and schedule, checkpoints, logging.

`Trainer.fit()` is the offline loop (SFT, reward model, preference methods): seeded batches, gradient
accumulation normalised by *global* item counts (so accumulation and data parallelism leave the loss unchanged),
clipping, logging, evaluation and atomic checkpoints. A stage subclass supplies the data kind, the model, the
collator and `compute_loss`; it never re-implements the loop. The online RL trainer writes its own loop and uses
the same services (`RunDir`, `MetricsLogger`, `save_checkpoint`, `load_checkpoint`).
"""

from __future__ import annotations

import contextlib
import functools
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
import warnings
from typing import Any, Callable

import numpy as np
import torch

from rlhfkit.config import TrainConfig, config_to_yaml
from rlhfkit.errors import UserError
from rlhfkit.io import TMP_PREFIX, atomic_dir, atomic_write_text, check_writable, read_jsonl_rows, remove_tree
from rlhfkit.launch import distributed_state, log_launch, start_run
from rlhfkit.sharding import (DEEPSPEED_STATE, configure_deepspeed, fsdp_classes, load_deepspeed_state,
                              load_optimizer_state, loaded_weights, optimizer_state, save_deepspeed_state, saved_weights,
                              weight_layout_of)

logger = logging.getLogger("rlhfkit")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
RUN_MARKERS = ("config.yaml", "metrics.jsonl")


# 1. The run directory -------------------------------------------------------------------------------------------


class RunDir:
    """Guards `output_dir`: never overwrites another run unless asked, and finds checkpoints to resume from."""

    def __init__(self, cfg: TrainConfig):
        self.path = cfg.output_dir
        self.cfg = cfg
        self.moved_aside = False  # this process moved a previous run aside (overwrite=true), not yet committed
        self.fresh = False  # this process started the run in an absent or empty output_dir (see `discard_failed_start`)

    def check(self) -> str | None:
        """Fail early (before any model loads, writing nothing) if the directory can't be used; return the
        checkpoint to resume from, if any."""
        path, cfg = self.path, self.cfg
        check_writable(path)
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

    def prepare(self, resume_step: int | None) -> None:
        """Create the directory and write the resolved config (main process only, once the model has loaded).

        1. overwrite=true: the old run is renamed to a hidden sibling (`replaced_path`), deleted once this run has
           written its first checkpoint or its final model (`commit_replacement`), and put back if this run stops
           before that (`restore_replaced`: at once on an exception, at the next start after a kill).
        2. What an interrupted run left behind is removed: temporary files and directories (`.tmp-*`: a save or a
           pruning cut short), checkpoints without trainer_state.pt, and — on resume — the checkpoints newer than
           the one resumed from (`latest_checkpoint` skipped them as damaged; this run writes those steps again).
        3. On resume, metrics.jsonl and samples.jsonl keep only the rows up to the resumed step (the resumed run logs
           the later ones again) and lose a half-written last line.
        """
        path = self.path
        if self.cfg.overwrite and os.path.isdir(path) and os.listdir(path):
            self.move_aside()
        self.fresh = resume_step is None and not (os.path.isdir(path) and os.listdir(path))
        os.makedirs(path, exist_ok=True)
        self.remove_leftovers(resume_step)
        atomic_write_text(os.path.join(path, "config.yaml"), config_to_yaml(self.cfg))
        if resume_step is not None:
            for name in ("metrics.jsonl", "samples.jsonl"):
                trim_jsonl(os.path.join(path, name), resume_step)

    def discard_failed_start(self) -> None:
        """A run started in an absent or empty output_dir failed before logging a step or writing a checkpoint: remove
        what it wrote (config.yaml, an empty metrics.jsonl), so that the same command, fixed, needs no overwrite=true."""
        path = self.path
        metrics = os.path.join(path, "metrics.jsonl")
        progress = checkpoint_dirs(path) or (os.path.isfile(metrics) and os.path.getsize(metrics) > 0)
        if not self.fresh or progress or not os.path.isdir(path):
            return
        remove_tree(path)
        logger.info("removed '%s': the run failed before its first step", path)

    def move_aside(self) -> None:
        path, aside = os.path.abspath(self.path), replaced_path(self.path)
        try:
            if os.path.commonpath([path, os.getcwd()]) == path:
                raise OSError("it holds the working directory")  # a rename would move the working directory along
            os.replace(path, aside)
        except OSError as exc:
            logger.warning("overwrite=true: deleting the previous run in '%s' now: it cannot be kept aside until this "
                           "run's first checkpoint (%s)", self.path, exc)
            shutil.rmtree(path)
            return
        self.moved_aside = True
        logger.info("overwrite=true: the previous run in '%s' is kept in %s until this run writes its first checkpoint "
                    "or its final model, and put back if it stops before", self.path, aside)

    def restore_replaced(self) -> None:
        """Put back the run that overwrite=true moved aside, unless this directory now holds a complete checkpoint of
        the new run (then finish replacing it). Called at every start and when a run fails."""
        aside, path = replaced_path(self.path), os.path.abspath(self.path)
        shutil.rmtree(aside + ".deleting", ignore_errors=True)  # a commit or a restore cut short: garbage
        if not os.path.isdir(aside):
            return
        if any(os.path.isfile(os.path.join(p, "trainer_state.pt")) for _, p in checkpoint_dirs(path)):
            commit_replacement(path)
            return
        # Two renames, so that at every moment the previous run is whole under one of its two names.
        if os.path.exists(path):
            os.replace(path, aside + ".deleting")
        os.replace(aside, path)
        shutil.rmtree(aside + ".deleting", ignore_errors=True)
        self.moved_aside = False
        logger.warning("put the previous run back in '%s': the run started with overwrite=true stopped before its "
                       "first checkpoint", self.path)

    def remove_leftovers(self, resume_step: int | None) -> None:
        removed = []
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            m = CHECKPOINT_RE.match(name)
            if name.startswith(TMP_PREFIX):
                removed.append(f"{name} (an interrupted save)")
            elif m and not os.path.isfile(os.path.join(full, "trainer_state.pt")):
                removed.append(f"{name} (incomplete: no trainer_state.pt)")
            elif m and resume_step is not None and int(m.group(1)) > resume_step:
                removed.append(f"{name} (damaged; resuming from step {resume_step})")
            else:
                continue
            remove_tree(full) if os.path.isdir(full) else os.unlink(full)
        if removed:
            logger.warning("removed what an interrupted run left in '%s': %s", self.path, ", ".join(removed))


def replaced_path(output_dir: str) -> str:
    """Where overwrite=true keeps the previous run until the new one commits: a hidden sibling of output_dir."""
    path = os.path.abspath(output_dir)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.rlhfkit-replaced")


def commit_replacement(output_dir: str) -> None:
    """The new run in `output_dir` has a checkpoint or its final model: delete the run it replaces, if any. The rename
    first makes the decision atomic: a kill during the deletion cannot make the next start put half of it back."""
    aside = replaced_path(output_dir)
    if os.path.isdir(aside):
        shutil.rmtree(aside + ".deleting", ignore_errors=True)
        os.replace(aside, aside + ".deleting")
        shutil.rmtree(aside + ".deleting", ignore_errors=True)
        logger.info("deleted the run that '%s' replaces (overwrite=true)", output_dir)


def trim_jsonl(path: str, step: int) -> None:
    """Keep the rows of `path` logged at or before `step`; drop a half-written line (a kill or a full disk)."""
    if os.path.exists(path):
        kept = [row for row in read_jsonl_rows(path) if row.get("step", 0) <= step]
        atomic_write_text(path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept))


# 2. Metrics ----------------------------------------------------------------------------------------------------


class MetricsLogger:
    """One JSON object per logged step in `metrics.jsonl`, mirrored to TensorBoard/W&B when configured.

    The file is strict JSON, which has no NaN or Infinity: a non-finite value (the loss of a skipped step) is written
    as null. The trackers receive the float itself.
    """

    def __init__(self, output_dir: str, accelerator, report_to: list[str]):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.accelerator = accelerator
        self.trackers = bool(report_to)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.accelerator.is_main_process:
            return
        record = {"step": step, **{k: _to_float(v) for k, v in metrics.items()}}
        strict = {k: v if math.isfinite(v) else None for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(strict, allow_nan=False) + "\n")
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


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-N` directory in `output_dir`, oldest first, complete or not."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(output_dir), "checkpoint-*")):
        m = CHECKPOINT_RE.match(os.path.basename(path))
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest intact checkpoint. A newer damaged one (a power cut or a full disk during its save, a pruning cut
    short) is skipped with a warning that says why."""
    for _, path in reversed(checkpoint_dirs(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None: its trainer_state.pt must load (memory-mapped,
    so the optimizer state is not read twice) and every safetensors file in it must open (a truncated one fails its
    header check) — model/ holding at least one."""
    from safetensors import safe_open

    state = os.path.join(path, "trainer_state.pt")
    if not os.path.isfile(state):
        return "no trainer_state.pt (a save or a pruning was cut short)"
    try:
        torch.load(state, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # noqa: BLE001 - any failure to load is a damaged file, whatever torch raises
        return f"trainer_state.pt does not load ({_first_line(exc)})"
    if not glob.glob(os.path.join(glob.escape(path), "model", "*.safetensors")):
        return "model/ holds no safetensors weights"
    for f in sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.safetensors"), recursive=True)):
        try:
            with safe_open(f, framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - as above
            return f"{os.path.relpath(f, path)} does not open ({_first_line(exc)})"
    return None


def last_checkpoint_note(output_dir: str) -> str:
    """What a run stopped by `max_bad_steps` leaves to resume from, for its error message."""
    complete = [p for _, p in checkpoint_dirs(output_dir) if os.path.isfile(os.path.join(p, "trainer_state.pt"))]
    if complete:
        return f"the last good checkpoint, {complete[-1]}, is intact"
    return f"'{output_dir}' holds no checkpoint of this run (see logging.save_steps)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def refuse_nonfinite_weights(model_dir: str, output_dir: str, what: str) -> None:
    """Raise a UserError (naming `output_dir`) if any tensor of the safetensors files under `model_dir` — the weights
    just written, before they are moved into place — holds NaN or inf. Reading the files back checks exactly what
    would be kept, whatever wrote them (a policy, a critic, merged LoRA weights)."""
    from safetensors import safe_open

    for f in sorted(glob.glob(os.path.join(glob.escape(model_dir), "**", "*.safetensors"), recursive=True)):
        with safe_open(f, framework="pt") as weights:
            for name in weights.keys():
                if not torch.isfinite(weights.get_tensor(name)).all():
                    raise UserError(
                        f"refusing to save {what} to '{output_dir}': the weights hold NaN/inf ('{name}' in "
                        f"{os.path.relpath(f, model_dir)}); what '{output_dir}' held before is intact")


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
    — resuming never unpickles arbitrary objects. Non-finite weights are refused (a UserError; the checkpoints
    already there are intact). The first checkpoint of a run started with overwrite=true deletes the run it replaces.
    """
    final = os.path.join(output_dir, f"checkpoint-{step}")
    with atomic_dir(final) as tmp:
        save_model(os.path.join(tmp, "model"))
        refuse_nonfinite_weights(tmp, output_dir, f"checkpoint-{step}")
        torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(tmp, "trainer_state.pt"))
    commit_replacement(output_dir)
    # Pruning renames each old checkpoint away before deleting it: a kill midway never leaves a partial checkpoint-N.
    for _, old in checkpoint_dirs(output_dir)[:-keep]:
        remove_tree(old)
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
    """AdamW over trainable parameters; biases and norm weights (1-D tensors) get no weight decay.

    torch's fused kernel (CPU and CUDA; one kernel for all parameters instead of a loop of small ops) — 5x faster
    per step than the default on this project's CPU (bench/vs_trl.py counts it in the step time) — except on Apple
    MPS, which it does not support."""
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
    from transformers import get_scheduler

    warmup = cfg.optim.warmup_steps or math.ceil(cfg.optim.warmup_ratio * total_steps)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[cfg.optim.scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)


# 5. The offline loop -------------------------------------------------------------------------------------------


def _restores_replaced_run(fit: Callable) -> Callable:
    """`fit` that, when it fails before the new run committed (see `RunDir.prepare`), puts the run it replaces back,
    or removes what a run started in an empty directory wrote before its first step."""

    @functools.wraps(fit)
    def guarded(self, *args, **kwargs):
        try:
            return fit(self, *args, **kwargs)
        except BaseException:
            self.run_dir.discard_failed_start()
            if self.run_dir.moved_aside:
                try:
                    self.run_dir.restore_replaced()
                except OSError as exc:
                    logger.warning("could not put the previous run back in '%s' (%s): it is in %s", self.run_dir.path,
                                   exc, replaced_path(self.run_dir.path))
            raise
        finally:
            self.run_lock.release()  # last: the cleanup above still runs under the lock

    return guarded


class Trainer:
    """Base of the offline trainers. Subclasses set `kind` and implement the four methods marked below."""

    kind: str = ""  # data kind for rlhfkit.data.build_datasets
    bad_steps: int = 0  # updates skipped for a non-finite loss or gradient, over the whole run (saved in checkpoints)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "fit" in vars(cls):  # the online and RFT trainers write their own loop: it gets the same guard
            cls.fit = _restores_replaced_run(cls.fit)

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self._unwrapped: dict[int, tuple] = {}  # id(prepared module) -> (it, its unwrapped module): see `unwrap`
        self.run_dir = RunDir(cfg)
        # The launch checked and output_dir locked (by the main process, until `fit` ends) before anything reads it.
        self.run_lock = start_run(cfg.output_dir)
        try:
            self.recover_run_dir()
            self.resume_from = self.run_dir.check()
            check_report_to(cfg.logging.report_to)
        except BaseException:
            self.run_lock.release()
            raise

    def recover_run_dir(self) -> None:
        """Before `check` looks at output_dir: put back a run that an overwrite=true run, killed before its first
        checkpoint, had moved aside (the main process does it; the others wait)."""
        state = distributed_state()
        if state.is_main_process:
            self.run_dir.restore_replaced()
        state.wait_for_everyone()

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

    # -- hooks with defaults (the online and RFT trainers override them) ---------------------------------------
    def load_data(self) -> None:
        """`train_set` (and `eval_set`) from `cfg.data`: bad data fails here, before any model loads."""
        from rlhfkit.data import build_datasets

        train_set, self.eval_set = build_datasets(self.kind, self.cfg.data, self.tokenizer, self.cfg.seed)
        self.train_set = self.prepare_train_set(train_set)

    def build(self) -> None:
        """Models, optimizer and schedule: sets `model`, `optimizer`, `scheduler`, `steps_per_epoch`, `total_steps`."""
        cfg = self.cfg
        model = self.load_model(self.tokenizer)
        if cfg.data.padding_free:
            self.padding_free_attention(model)
        per_step = cfg.optim.per_device_batch_size * self.world * cfg.optim.grad_accum_steps
        self.steps_per_epoch = max(1, math.ceil(len(self.train_set) / per_step))
        self.total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_epochs * self.steps_per_epoch)
        optimizer = build_optimizer(model, cfg)
        self.scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        # The scheduler is not prepared: accelerate would step it once per process, stretching warmup.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)

    def padding_free_attention(self, model) -> None:
        """data.padding_free: attention per sequence of a row (`models.use_padding_free_attention`), or a note that it
        is one masked (N, N) product over the whole row."""
        from rlhfkit.models import PADDING_FREE_ATTENTION, use_padding_free_attention

        attention = use_padding_free_attention(model)
        if attention != PADDING_FREE_ATTENTION and not attention.startswith("flash"):
            logger.info("data.padding_free with %s attention: each row's attention is one masked (N, N) product over all "
                        "its sequences, which can cost more than the padding it saves", attention)

    def trained_models(self) -> list:
        """The prepared models a checkpoint holds, the policy first; their optimizer is `self.optimizer`."""
        return [self.model]

    def save_models(self, directory: str, models: list) -> None:
        """Write the trained model(s) of a checkpoint into `directory` (its `model/` subdirectory); `models` are
        `trained_models`, whole (`saved_weights`), as the main process writes them."""
        from rlhfkit.models import save_model

        save_model(models[0], self.tokenizer, directory, merge_lora=False)

    def load_models(self, checkpoint: str) -> None:
        """Load the weights `save_models` wrote into checkpoint directory `checkpoint` (every process calls this:
        under FSDP and ZeRO-3 the main process reads them and every process takes its slice)."""
        model_dir = os.path.join(checkpoint, "model")
        loaded_weights(self.accelerator, self.model, lambda m: load_model_weights(m, model_dir), self.unwrap(self.model))

    def extra_state(self) -> dict:
        """What a checkpoint keeps besides optimizer, scheduler, step, RNG and the skipped-step count."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Restore what `extra_state` saved."""

    def prepare_run_dir(self) -> None:
        """Create output_dir and write the resolved config (main process): see `RunDir.prepare`."""
        self.run_dir.prepare(self.start_step if self.resume_from else None)

    # -- the skeleton every trainer shares ------------------------------------------------------------------------
    def unwrap(self, module):
        """The prepared `module` to call directly (no-grad forwards, attributes): `accelerator.unwrap_model(module)`
        — DDP's wrapper off (its forward may sync buffers with the other processes) — except an FSDP1 wrapper, which
        stays: only its forward gathers the root unit's weights (embeddings, final norm, head). Remembered per
        module: accelerate probes the installed packages at every call (12 ms with deepspeed installed), and the
        loops need it several times a micro-batch."""
        held = self._unwrapped.get(id(module))
        if held is None or held[0] is not module:
            fsdp1 = fsdp_classes()[0]
            inner = module if fsdp1 is not None and isinstance(module, fsdp1) else self.accelerator.unwrap_model(module)
            held = self._unwrapped[id(module)] = (module, inner)
        return held[1]

    def setup(self) -> None:
        """1. tokenizer and data, so bad data fails before a model loads; 2. accelerate, models, optimizer (seeded
        again, so initial weights do not depend on what data loading consumed); 3. resume; 4. run directory,
        trackers and metrics logger."""
        from accelerate.utils import set_seed

        from rlhfkit.models import load_tokenizer

        cfg = self.cfg
        set_seed(cfg.seed)
        with distributed_state().main_process_first():  # one process tokenises into the cache; the others then read it
            self.tokenizer = load_tokenizer(cfg.model)
            self.load_data()
        self.accelerator = self.make_accelerator()
        log_launch(self.accelerator)
        self.world = self.accelerator.num_processes
        set_seed(cfg.seed)
        self.build()
        self.start_step = 0
        if self.resume_from:
            self.resume(self.resume_from)
        if self.accelerator.is_main_process:
            self.prepare_run_dir()
        self.accelerator.wait_for_everyone()
        if cfg.logging.report_to:
            self.accelerator.init_trackers(cfg.logging.run_name or os.path.basename(os.path.abspath(cfg.output_dir)))
        self.metrics = MetricsLogger(cfg.output_dir, self.accelerator, cfg.logging.report_to)

    def resume(self, checkpoint: str) -> None:
        state = load_checkpoint(checkpoint)
        self.load_models(checkpoint)
        if self.accelerator.distributed_type == "DEEPSPEED" or state["optimizer"] == DEEPSPEED_STATE:
            load_deepspeed_state(self.accelerator, checkpoint, state["optimizer"])
        else:
            load_optimizer_state(self.accelerator, self.trained_models(), self.optimizer, state["optimizer"], checkpoint)
        self.scheduler.load_state_dict(state["scheduler"])
        self.start_step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))
        self.load_extra_state(state)
        set_rng_state(state["rng"])  # last: nothing after it may draw random numbers before training
        logger.info("resuming from %s (step %d)", checkpoint, self.start_step)

    def checkpoint(self, step: int) -> None:
        """checkpoint-{step}/: `save_models` + optimizer, scheduler, RNG, skipped steps and `extra_state`."""
        acc = self.accelerator
        acc.wait_for_everyone()
        trained = self.trained_models()
        deepspeed_dir = os.path.join(self.cfg.output_dir, f"{TMP_PREFIX}deepspeed-{step}")
        if acc.distributed_type == "DEEPSPEED":
            optimizer = save_deepspeed_state(acc, deepspeed_dir)  # every process writes its partition
        else:
            optimizer = optimizer_state(acc, trained, self.optimizer)  # collective under FSDP

        def save_models(directory: str) -> None:
            self.save_models(directory, models)
            if optimizer == DEEPSPEED_STATE:  # into the checkpoint being written: it appears with it, whole
                os.replace(deepspeed_dir, os.path.join(os.path.dirname(directory), "deepspeed"))

        # FSDP / ZeRO-3: the weights whole while the main process writes them (gathering is collective)
        with contextlib.ExitStack() as stack:
            models = [stack.enter_context(saved_weights(acc, m, self.unwrap(m))) for m in trained]
            if acc.is_main_process:
                state = {"optimizer": optimizer, "scheduler": self.scheduler.state_dict(), "bad_steps": self.bad_steps,
                         **self.extra_state()}
                save_checkpoint(self.cfg.output_dir, step, save_models, state, self.cfg.logging.save_total_limit)
        acc.wait_for_everyone()

    def permutation(self, n: int, epoch: int) -> torch.Tensor:
        """A permutation of range(n) seeded by (seed, epoch): data order is a function of the step alone, so
        resuming needs no data-loader state."""
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed * 100003 + epoch))

    def step_indices(self, step: int, n: int, per_step: int) -> list[int]:
        """The `per_step` dataset indices (all processes) of step `step`: epoch e's permutation, wrapped around to
        fill its last step."""
        epoch, k = divmod(step, self.steps_per_epoch)
        order = self.permutation(n, epoch).repeat(math.ceil(self.steps_per_epoch * per_step / n))
        return order[k * per_step : (k + 1) * per_step].tolist()

    def make_accelerator(self):
        """accelerate with the run's mixed precision and metric sinks (every stage's setup starts with one)."""
        from accelerate import Accelerator

        cfg = self.cfg
        acc = Accelerator(mixed_precision=cfg.mixed_precision, log_with=cfg.logging.report_to or None,
                          project_dir=cfg.output_dir)
        configure_deepspeed(acc, cfg.optim.per_device_batch_size)
        return acc

    def micro_batch_positions(self, step: int) -> tuple[list[int], list[range]]:
        """The dataset indices of optimizer step `step` over all processes (`step_indices`) and, per micro-batch, the
        positions in them that this process holds: micro-batch a is the a-th slice of per_device_batch_size × world
        positions, and process r holds its r-th part. Any world size with the same global batch (per-device batch ×
        processes × accumulation) trains on the same examples in the same steps."""
        o = self.cfg.optim
        per_micro = o.per_device_batch_size * self.world
        order = self.step_indices(step, len(self.train_set), per_micro * o.grad_accum_steps)
        first = self.accelerator.process_index * o.per_device_batch_size
        return order, [range(a * per_micro + first, a * per_micro + first + o.per_device_batch_size)
                       for a in range(o.grad_accum_steps)]

    def micro_batches(self, step: int) -> list:
        """This process's micro-batches for optimizer step `step`: a pure function of the step (see `step_indices`)."""
        order, positions = self.micro_batch_positions(step)
        return [self.collate([self.train_set[order[p]] for p in mine]) for mine in positions]

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the step's metrics: item-weighted means
        over the global batch (every micro-batch of every process), as one process holding it all would log them.

        A non-finite loss (on any process) or gradient norm skips the update: see `skip_step`.
        """
        acc, model = self.accelerator, self.model
        model.train()
        micro = self.micro_batches(step)
        counts = [self.count(b) for b in micro]
        total = acc.reduce(torch.tensor(float(sum(counts)), device=acc.device), reduction="sum").item()
        # DDP averages gradients over processes; scaling by world size turns that average back into the global sum.
        per_process = total / self.world
        sums: dict[str, torch.Tensor] = {}  # metric -> this process's item-weighted sum
        nonfinite_losses = torch.zeros((), device=acc.device)
        for i, (batch, n) in enumerate(zip(micro, counts)):
            sync = contextlib.nullcontext() if i == len(micro) - 1 else acc.no_sync(model)
            with sync:
                loss, metrics = self.compute_loss(model, batch.to(acc.device), per_process)
                self.backward(loss, last=i == len(micro) - 1)
            nonfinite_losses += (~torch.isfinite(loss.detach())).float()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + torch.as_tensor(v, dtype=torch.float32, device=acc.device).detach() * n
        # The gradient norm, clipped to optim.max_grad_norm when set (max_norm = inf only measures it): global already,
        # computed on the all-reduced gradients. Under fp16 an overflowing gradient is the loss scaler's business: it
        # skips that update itself and lowers the scale.
        max_norm = self.cfg.optim.max_grad_norm
        norm = acc.clip_grad_norm_(model.parameters(), max_norm if max_norm is not None else math.inf)
        bad_grad = norm is not None and acc.scaler is None and not math.isfinite(float(norm))
        # One sum over processes: the metric sums and the fault count. The skip is decided on it, so every process
        # skips the same steps and DDP replicas stay identical.
        keys = sorted(sums)
        totals = acc.reduce(torch.stack([sums[k] for k in keys] + [nonfinite_losses + float(bad_grad)]), reduction="sum")
        out = {k: totals[i].item() / max(total, 1) for i, k in enumerate(keys)}
        bad = totals[-1].item() > 0
        if max_norm is not None:
            out["grad_norm"] = float(norm)
        out["lr"] = self.scheduler.get_last_lr()[0]
        if bad:
            self.skip_step(step, bool(nonfinite_losses.item()), bad_grad)
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        out["faults/skipped_total"] = float(self.bad_steps)
        return out

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """accelerate's backward of one micro-batch of an optimizer step; `last`: the step's last backward. Under
        DeepSpeed accelerate runs the engine's step inside `backward` whenever gradients are to sync, and marks that
        backward as the end of an accumulation: only the last backward is, so several micro-batches make one
        DeepSpeed step over their summed gradients (they made one step each; rlhfkit does not use accelerate's
        `accumulate`). Elsewhere the flag changes nothing: DDP's sync is `no_sync`'s business."""
        acc = self.accelerator
        if acc.distributed_type != "DEEPSPEED" or last:
            acc.backward(loss)
            return
        acc.gradient_state._set_sync_gradients(False)
        try:
            acc.backward(loss)
        finally:
            acc.gradient_state._set_sync_gradients(True)

    def skip_step(self, step: int, bad_loss: bool, bad_grad: bool) -> None:
        """No update for step `step`: the gradients are dropped and the optimizer state is untouched, but the learning
        rate schedule advances — like the data, it is a function of the step number, so a skipped step only costs
        its batch, the run still ends at `total_steps`, and a resumed run matches an uninterrupted one. The
        `max_bad_steps`-th skipped step stops the run (a UserError: exit status 2)."""
        acc, cfg = self.accelerator, self.cfg
        if acc.scaler is not None:
            acc.scaler.update()  # fp16: close the unscale_ done by clip_grad_norm_, as the scaler's own skip would
        with warnings.catch_warnings():  # torch warns when the very first scheduler step has no optimizer step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
        self.bad_steps += 1
        what = " and ".join(w for w, bad in (("loss", bad_loss), ("gradient", bad_grad)) if bad) or "loss on another process"
        logger.warning("step %d: non-finite %s; optimizer step skipped (%d of max_bad_steps=%d)", step + 1, what,
                       self.bad_steps, cfg.max_bad_steps)
        if self.bad_steps >= cfg.max_bad_steps:
            raise UserError(f"stopping at step {step + 1}: {self.bad_steps} optimizer steps skipped for a non-finite loss "
                            f"or gradient (max_bad_steps={cfg.max_bad_steps}); {last_checkpoint_note(cfg.output_dir)}")

    def sharded(self) -> bool:
        """Whether the policy's weights are sharded (FSDP, ZeRO-3): every forward of it is then collective, so every
        process must run as many as the others."""
        return weight_layout_of(self.accelerator, self.model, self.unwrap(self.model)) != "whole"

    def eval_chunks(self) -> list[tuple[list[int], bool]]:
        """This process's eval examples (indices; every world-size-th one) in batches of per_device_batch_size, each
        with whether it counts. Sharded models (`sharded`): a process whose share holds fewer batches than another's
        also runs filler batches (example 0, not counted), so that every process runs as many forwards."""
        n, bs = len(self.eval_set), self.cfg.optim.per_device_batch_size
        mine = list(range(self.accelerator.process_index, n, self.world))
        chunks = [(mine[start : start + bs], True) for start in range(0, len(mine), bs)]
        if self.sharded():
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
        model = self.unwrap(self.model)
        self.model.eval()
        sums: dict[str, torch.Tensor] = {}
        for batch, counted in self.eval_batches():
            n = self.count(batch)
            loss, metrics = self.compute_loss(model, batch.to(acc.device), float(n))
            if not counted:  # a filler batch: its forwards only keep the processes in step
                continue
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + v.detach().float() * n
            sums["_n"] = sums.get("_n", 0.0) + torch.tensor(float(n), device=acc.device)
        # The main process names the metrics: a process whose share is empty (an eval set smaller than the world
        # size) adds zeros to the same sums.
        keys = broadcast_object_list([sorted(sums)])[0] if self.world > 1 else sorted(sums)
        zero = torch.zeros((), device=acc.device)
        totals = acc.reduce(torch.stack([sums.get(k, zero) for k in keys]), reduction="sum")
        n = totals[keys.index("_n")].item()
        return {f"eval/{k}": totals[i].item() / n for i, k in enumerate(keys) if k != "_n"}

    def save_final(self) -> None:
        """Write the trained model into output_dir (model files beside config.yaml and metrics.jsonl)."""
        from rlhfkit.models import save_model

        acc = self.accelerator
        acc.wait_for_everyone()
        with saved_weights(acc, self.model, self.unwrap(self.model)) as model:  # FSDP / ZeRO-3: whole (collective)
            if not acc.is_main_process:
                return
            tmp = tempfile.mkdtemp(dir=self.cfg.output_dir, prefix=f"{TMP_PREFIX}model-")
            try:
                save_model(model, self.tokenizer, os.path.join(tmp, "model"), merge_lora=self.cfg.model.lora.merge_on_save)
                refuse_nonfinite_weights(os.path.join(tmp, "model"), self.cfg.output_dir, "the final model")
                # File by file: output_dir also holds config.yaml, metrics.jsonl and the checkpoints.
                for name in os.listdir(os.path.join(tmp, "model")):
                    os.replace(os.path.join(tmp, "model", name), os.path.join(self.cfg.output_dir, name))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        commit_replacement(self.cfg.output_dir)

    @_restores_replaced_run
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
                last.update({"faults/skipped_total": float(self.bad_steps), "epoch": done / self.steps_per_epoch,
                             "elapsed_s": time.time() - t0})
                self.metrics.log(done, last)
                window = []
            if self.eval_set and ((log.eval_steps and done % log.eval_steps == 0) or done == self.total_steps):
                ev = self.evaluate()
                self.metrics.log(done, ev)
                last.update(ev)
                if self.accelerator.is_main_process:
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
