"""How this process was launched: accelerate's process state, a check that the launch does what was asked, the
one-line summary every stage logs at start, and the lock that keeps two runs out of one output_dir.

Two launches go wrong silently without these checks (accelerate 1.x, torch 2.x, seen on CPU):

- `accelerate launch --cpu --num_processes 2` starts ONE process: on CPU accelerate's plain launcher only forks
  several through MPI (`--mpirun_hostfile`). The child's environment holds `MASTER_ADDR`/`MASTER_PORT` (set only when
  several processes or machines were asked for) and `ACCELERATE_USE_CPU`, but no `WORLD_SIZE`.
- `accelerate launch --multi_gpu --num_processes 2` on a machine without GPUs starts two processes through torchrun
  (`WORLD_SIZE=2`, `RANK`, `LOCAL_WORLD_SIZE=2`, ...), but accelerate finds no backend to join them with, so each
  trains alone (world size 1) and both write the same output_dir; with `ACCELERATE_USE_CPU=1` in the launcher's
  environment, which it passes on, the two join over gloo (a pipeline stage's `launch` on CPU).

What works on CPU is `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N -m rlhfkit.cli <stage> ...` (gloo), or the
same variable before `accelerate launch --multi_gpu`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from collections.abc import Mapping

from rlhfkit.errors import UserError
from rlhfkit.io import check_writable

logger = logging.getLogger("rlhfkit")

HOW_TO_LAUNCH = (
    "launch on CPU with `ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N -m rlhfkit.cli <stage> ...`, on GPUs with "
    "`accelerate launch --config_file configs/accelerate/multi_gpu.yaml --num_processes N -m rlhfkit.cli <stage> ...` "
    "(docs/distributed.md: Several processes and machines)"
)

# Variables in which a launcher states how many processes it started; the first one present decides.
_SIZE_VARIABLES = (
    ("WORLD_SIZE", "torchrun / accelerate launch"),
    ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
    ("PMI_SIZE", "mpirun (MPICH, Intel MPI)"),
    ("MV2_COMM_WORLD_SIZE", "mpirun (MVAPICH2)"),
    ("SLURM_STEP_NUM_TASKS", "srun"),
)


# 1. The launch -------------------------------------------------------------------------------------------------


def requested_processes(env: Mapping[str, str]) -> tuple[int | None, str] | None:
    """When the launcher that started this process asked for several: how many (None: several, count unknown) and
    the evidence, e.g. `(2, "WORLD_SIZE=2, set by torchrun / accelerate launch")`. None when it asked for one."""
    for name, launcher in _SIZE_VARIABLES:
        with contextlib.suppress(KeyError, ValueError):
            n = int(env[name])
            return (n, f"{name}={n}, set by {launcher}") if n > 1 else None
    if "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env:
        # accelerate launch's plain launcher always sets ACCELERATE_USE_CPU, and MASTER_ADDR only when asked for
        # num_processes > 1 or num_machines > 1; torchrun and mpirun would have set one of the sizes above.
        return None, f"MASTER_ADDR={env['MASTER_ADDR']} is set, WORLD_SIZE is not"
    return None


def check_world_size(env: Mapping[str, str], world_size: int) -> None:
    """Refuse (one line, before any model loads) a process that trains alone although its launcher asked for several:
    it would be one of several independent runs writing the same output_dir."""
    requested = requested_processes(env)
    if requested is None or world_size > 1:
        return
    n, evidence = requested
    if n is None:
        raise UserError(f"`accelerate launch` was asked for several processes but started only this one ({evidence}): "
                        f"without --multi_gpu it starts one process, and on CPU several only through mpirun; "
                        f"{HOW_TO_LAUNCH}")
    raise UserError(f"the launch asked for {n} processes ({evidence}) but accelerate runs this one alone (world size 1, "
                    f"no GPU or gloo group to join): {n} separate runs would write one output_dir; {HOW_TO_LAUNCH}")


def distributed_state():
    """accelerate's process state, checked against the launch (`check_world_size`).

    `ACCELERATE_USE_CPU` is honoured here as `Accelerator` honours it: `PartialState()` alone ignores it, and the first
    state created decides for the whole process — a plain `PartialState()` made before the `Accelerator` leaves a
    torchrun CPU launch at world size 1 (no gloo group).
    """
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    check_world_size(os.environ, state.num_processes)
    return state


def end_process_group() -> None:
    """Destroy the process group (gloo, NCCL), if any, while the interpreter is whole. Left to the interpreter's exit,
    the group's C++ worker threads and pending work are torn down in no set order with the Python objects they hold,
    which can abort a process whose run has finished: "terminate called without an active exception"
    (pytorch/pytorch#190489; PyTorch's docs ask for `destroy_process_group` at the end of every process, as accelerate's
    `end_training` does). The command (`cli.entry`) calls it on its way out; `cli.main` and the Python API leave the group to the
    caller's script, which may run several stages in it."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and `rlhfkit --help` pays no torch import)
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def describe_launch(world_size: int, backend: str | None, distributed_type: str, mixed_precision: str,
                    local_world_size: int | None = None) -> str:
    """The one line every stage logs at start: world size (and machines when several), backend, distributed type,
    mixed precision."""
    local = local_world_size or world_size
    machines = f" ({world_size // local} machines x {local} process{'es' if local > 1 else ''})" if world_size > local else ""
    return (f"launch: world size {world_size}{machines}, backend {backend or 'none'}, distributed type "
            f"{distributed_type}, mixed precision {mixed_precision}")


def log_launch(accelerator_or_state) -> None:
    """Log `describe_launch` on the main process, from an `Accelerator` or (eval) a `PartialState`."""
    obj = accelerator_or_state
    if not obj.is_main_process:
        return
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    dtype = getattr(obj.distributed_type, "value", str(obj.distributed_type))
    logger.info(describe_launch(obj.num_processes, getattr(obj, "state", obj).backend, dtype,
                                getattr(obj, "mixed_precision", "no"), int(local) if local.isdigit() else None))


# 2. One run per output_dir -------------------------------------------------------------------------------------


def lock_path(output_dir: str) -> str:
    """The lock of `output_dir`: a hidden sibling, like overwrite=true's `.NAME.rlhfkit-replaced`. Outside the
    directory, so a refused run writes nothing into it and renaming the directory aside does not move the lock."""
    path = os.path.abspath(output_dir)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.rlhfkit-lock")


class RunLock:
    """An exclusive `fcntl.flock` on `lock_path(output_dir)`, held by the run's main process from before it looks at
    output_dir until the run ends (`release`). The kernel drops it when the process dies, however it dies, so a killed
    run never blocks the next; the file then stays behind, unlocked, and the next run takes it over. The file holds
    the holder's pid, host and start time, which a refused run names. flock works across the hosts sharing an NFS
    mount on Linux (emulated by byte-range locks); without fcntl (Windows) there is no lock."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = lock_path(output_dir)
        self.file = None
        self.created: list[str] = []  # parent directories this lock created, removed again on release if empty

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:
            return self
        check_writable(self.output_dir)
        parent = os.path.dirname(self.path)
        missing = parent
        while not os.path.exists(missing):
            self.created.append(missing)
            missing = os.path.dirname(missing)
        while True:
            f = self.open_file()
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                f.close()
                self.remove_created()
                raise UserError(f"output_dir '{self.output_dir}' is in use by another run ({holder}; lock file "
                                f"{self.path}): wait for it to finish or choose another output_dir") from None
            # A holder that was releasing may have deleted the file between our open and our lock: then we hold a
            # lock on a deleted file, and must lock the file now at that path instead.
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
            f.close()
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {socket.gethostname()}, started {started}\n")
        f.flush()
        self.file = f
        return self

    def open_file(self):
        """The lock file, opened for appending (its parent created if need be); a one-line UserError where the
        directory cannot hold it (a read-only or virtual file system such as /proc)."""
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return open(self.path, "a+", encoding="utf-8")
        except OSError as exc:
            self.remove_created()
            raise UserError(f"output_dir '{self.output_dir}' cannot be used: its lock file {self.path} cannot be "
                            f"created ({exc.strerror or type(exc).__name__})") from None

    def release(self) -> None:
        """Delete the lock file, then unlock (in that order: see `acquire`). Idempotent; a no-op on other processes."""
        if self.file is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.file.close()
        self.file = None
        self.remove_created()

    def remove_created(self) -> None:
        for directory in self.created:  # innermost first; stops at the first that another run (or this one) filled
            try:
                os.rmdir(directory)
            except OSError:
                break
        self.created = []


def start_run(output_dir: str) -> RunLock:
    """A training stage's first step, before it reads output_dir: the distributed state (checked against the launch),
    then output_dir's lock, taken by the main process. Every process raises the same UserError if the lock is held."""
    state = distributed_state()
    lock, error = RunLock(output_dir), None
    if state.is_main_process:
        try:
            lock.acquire()
        except UserError as exc:
            error = str(exc)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]  # every process stops, none waits for a main process that left
    if error is not None:
        raise UserError(error)
    return lock
