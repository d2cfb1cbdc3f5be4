"""The on-disk checkpoint: `output_dir/checkpoint-N/` holds `model/` (plain Hugging Face weights: safetensors or a peft
adapter) and `trainer_state.pt` (optimizer, scheduler, step, RNG, skipped steps and what the trainer adds).

A checkpoint is written to a temporary directory renamed into place, so a kill leaves either the whole checkpoint or
a `.tmp-*` leftover; `trainer_state.pt` holds only tensors, numbers, strings, lists and dicts, so it loads with
`torch.load(weights_only=True)` and resuming never unpickles arbitrary objects. Discovery skips a damaged newest
checkpoint (a power cut or a full disk during its save) for the newest intact one.
"""

from __future__ import annotations

import glob
import logging
import os
import random
import re
from typing import Callable

import numpy as np
import torch

from rlhfkit.errors import UserError, first_line
from rlhfkit.io import atomic_dir, remove_tree

logger = logging.getLogger("rlhfkit")

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
TRAINER_STATE = "trainer_state.pt"


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

    state = os.path.join(path, TRAINER_STATE)
    if not os.path.isfile(state):
        return "no trainer_state.pt (a save or a pruning was cut short)"
    try:
        torch.load(state, weights_only=True, map_location="cpu", mmap=True)
    except Exception as exc:  # noqa: BLE001 - any failure to load is a damaged file, whatever torch raises
        return f"trainer_state.pt does not load ({first_line(exc, with_type=True)})"
    if not glob.glob(os.path.join(glob.escape(path), "model", "*.safetensors")):
        return "model/ holds no safetensors weights"
    for f in sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.safetensors"), recursive=True)):
        try:
            with safe_open(f, framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - as above
            return f"{os.path.relpath(f, path)} does not open ({first_line(exc, with_type=True)})"
    return None


def last_checkpoint_note(output_dir: str) -> str:
    """What a run stopped by `max_bad_steps` leaves to resume from, for its error message."""
    complete = [p for _, p in checkpoint_dirs(output_dir) if os.path.isfile(os.path.join(p, TRAINER_STATE))]
    if complete:
        return f"the last good checkpoint, {complete[-1]}, is intact"
    return f"'{output_dir}' holds no checkpoint of this run (see logging.save_steps)"


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
    already there are intact). Only the newest `keep` checkpoints are kept.
    """
    final = os.path.join(output_dir, f"checkpoint-{step}")
    with atomic_dir(final) as tmp:
        save_model(os.path.join(tmp, "model"))
        refuse_nonfinite_weights(tmp, output_dir, f"checkpoint-{step}")
        torch.save({**state, "step": step, "rng": rng_state()}, os.path.join(tmp, TRAINER_STATE))
    # Pruning renames each old checkpoint away before deleting it: a kill midway never leaves a partial checkpoint-N.
    for _, old in checkpoint_dirs(output_dir)[:-keep]:
        remove_tree(old)
    return final


def load_trainer_state(path: str) -> dict:
    """The trainer state `save_checkpoint` wrote into checkpoint directory `path` (no arbitrary unpickling)."""
    return torch.load(os.path.join(path, TRAINER_STATE), weights_only=True, map_location="cpu")


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


