"""The run directory: `output_dir` is never overwritten unless asked, a run replaced with overwrite=true comes back if
the new one stops before its first checkpoint, and what an interrupted run left behind is cleaned up on resume."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Callable

from rlhfkit.checkpoint import CHECKPOINT_RE, TRAINER_STATE, checkpoint_dirs, latest_checkpoint, refuse_nonfinite_weights
from rlhfkit.config import TrainConfig, config_to_yaml
from rlhfkit.errors import UserError
from rlhfkit.io import TMP_PREFIX, atomic_write_text, check_writable, read_jsonl_rows, remove_tree

logger = logging.getLogger("rlhfkit")

RUN_MARKERS = ("config.yaml", "metrics.jsonl")


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
           the one resumed from (`latest_checkpoint` skipped them as damaged; this run writes those steps again) and
           those older than the newest `logging.save_total_limit` (a kill between a save and its pruning).
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

    def guard(self) -> None:
        """The run failed: remove what it wrote before its first step, or put back the run it was replacing."""
        self.discard_failed_start()
        if self.moved_aside:
            try:
                self.restore_replaced()
            except OSError as exc:
                logger.warning("could not put the previous run back in '%s' (%s): it is in %s", self.path, exc,
                               replaced_path(self.path))

    def write_final_model(self, save: Callable[[str], None]) -> None:
        """The final model, written by `save(directory)` into a temporary directory, checked for non-finite weights
        and moved into output_dir file by file (output_dir holds the run too); then the replaced run can go."""
        tmp = tempfile.mkdtemp(dir=self.path, prefix=f"{TMP_PREFIX}model-")
        try:
            save(os.path.join(tmp, "model"))
            refuse_nonfinite_weights(os.path.join(tmp, "model"), self.path, "the final model")
            for name in os.listdir(os.path.join(tmp, "model")):
                target = os.path.join(self.path, name)
                if os.path.isdir(target) and not os.path.islink(target):  # a directory (adapter/) from an earlier end
                    os.replace(target, os.path.join(tmp, f"old-{name}"))  # out of the way; removed with tmp
                os.replace(os.path.join(tmp, "model", name), target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        commit_replacement(self.path)

    def logged_rows(self) -> list[dict]:
        """The rows of metrics.jsonl (a resumed run's, already trimmed to its checkpoint by `prepare`)."""
        path = os.path.join(self.path, "metrics.jsonl")
        return read_jsonl_rows(path) if os.path.isfile(path) else []

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
        if any(os.path.isfile(os.path.join(p, TRAINER_STATE)) for _, p in checkpoint_dirs(path)):
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
        removed, keep = [], self.cfg.logging.save_total_limit
        # On resume, the checkpoints over the limit: a kill between a save and its pruning leaves one more, which the
        # next save would prune, but a resume from the last checkpoint saves none (the last step ends in the model).
        kept = [] if resume_step is None else [step for step, path in checkpoint_dirs(self.path)
                                               if step <= resume_step and os.path.isfile(os.path.join(path, TRAINER_STATE))]
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            m = CHECKPOINT_RE.match(name)
            if name.startswith(TMP_PREFIX):
                removed.append(f"{name} (an interrupted save)")
            elif m and not os.path.isfile(os.path.join(full, TRAINER_STATE)):
                removed.append(f"{name} (incomplete: no trainer_state.pt)")
            elif m and resume_step is not None and int(m.group(1)) > resume_step:
                removed.append(f"{name} (damaged; resuming from step {resume_step})")
            elif m and int(m.group(1)) in kept[:-keep]:
                removed.append(f"{name} (over logging.save_total_limit={keep}: a pruning cut short)")
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
