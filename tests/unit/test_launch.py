"""rlhfkit.launch: what a launcher's environment asks for, the world-size refusal, the start line, and the
output_dir lock (pid and host of the holder, nothing written by a refused run, a killed holder's lock taken over).

The environments below are what the launchers set in their children (accelerate 1.15, torch 2.x; printed from a
script started by each)."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from rlhfkit.errors import UserError
from rlhfkit.launch import RunLock, check_world_size, describe_launch, lock_path, requested_processes

ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}
# accelerate launch --cpu --num_processes 2: its plain launcher starts ONE process
ACCELERATE_CPU_2 = {**ACCELERATE, "ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
# accelerate launch --cpu --num_processes 1
ACCELERATE_CPU_1 = {**ACCELERATE, "ACCELERATE_USE_CPU": "True"}
# accelerate launch --multi_gpu --num_processes 2 (through torchrun), child of rank 1
TORCHRUN_2 = {**ACCELERATE, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
              "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}
# ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 1
TORCHRUN_1 = {"ACCELERATE_USE_CPU": "1", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    (ACCELERATE_CPU_1, None),
    (TORCHRUN_1, None),
    (TORCHRUN_2, (2, "WORLD_SIZE=2, set by torchrun / accelerate launch")),
    (ACCELERATE_CPU_2, (None, "MASTER_ADDR=127.0.0.1 is set, WORLD_SIZE is not")),
    ({"OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "h", "ACCELERATE_USE_CPU": "1"}, (4, "OMPI_COMM_WORLD_SIZE=4, set by mpirun (Open MPI)")),
    ({"SLURM_STEP_NUM_TASKS": "8"}, (8, "SLURM_STEP_NUM_TASKS=8, set by srun")),
    ({"SLURM_STEP_NUM_TASKS": "8", "WORLD_SIZE": "1"}, None),  # srun starting torchrun agents: torchrun's count decides
])
def test_requested_processes(env, expected):
    assert requested_processes(env) == expected


@pytest.mark.parametrize("env, phrase", [
    (TORCHRUN_2, "the launch asked for 2 processes (WORLD_SIZE=2"),
    (ACCELERATE_CPU_2, "`accelerate launch` was asked for several processes but started only this one"),
])
def test_world_size_one_is_refused_with_the_way_to_launch(env, phrase):
    with pytest.raises(UserError) as err:
        check_world_size(env, 1)
    message = str(err.value)
    assert phrase in message and "\n" not in message
    assert "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N -m rlhfkit.cli" in message
    assert "accelerate launch --config_file configs/accelerate/multi_gpu.yaml" in message
    check_world_size(env, 2)  # the same environment is right once the processes are joined


def test_describe_launch():
    assert describe_launch(1, None, "NO", "no") == "launch: world size 1, backend none, distributed type NO, mixed precision no"
    assert describe_launch(2, "gloo", "MULTI_CPU", "no", 1) == (
        "launch: world size 2 (2 machines x 1 process), backend gloo, distributed type MULTI_CPU, mixed precision no")
    assert describe_launch(16, "nccl", "MULTI_GPU", "bf16", 8).startswith("launch: world size 16 (2 machines x 8 processes)")


# 2. The lock ---------------------------------------------------------------------------------------------------


def test_lock_is_a_hidden_sibling_of_output_dir(tmp_path):
    assert lock_path(str(tmp_path / "runs" / "sft")) == str(tmp_path / "runs" / ".sft.rlhfkit-lock")
    assert lock_path(str(tmp_path / "runs" / "sft") + "/") == str(tmp_path / "runs" / ".sft.rlhfkit-lock")


def test_second_lock_on_one_output_dir_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    first = RunLock(str(out)).acquire()
    with open(first.path) as f:
        assert f.read().startswith(f"pid {os.getpid()} on host {socket.gethostname()}, started ")
    with pytest.raises(UserError) as err:
        RunLock(str(out)).acquire()  # flock locks are per open file: a second open in one process conflicts too
    message = str(err.value)
    assert message.startswith(f"output_dir '{out}' is in use by another run (pid {os.getpid()} on host "
                              f"{socket.gethostname()}, started ")
    assert "wait for it to finish or choose another output_dir" in message and "\n" not in message
    assert not out.exists()  # the refused run wrote nothing into output_dir
    first.release()
    assert os.listdir(tmp_path) == []  # the lock file goes with the run
    RunLock(str(out)).acquire().release()
    first.release()  # idempotent


def test_lock_creates_missing_parents_and_removes_them_again(tmp_path):
    lock = RunLock(str(tmp_path / "a" / "b" / "run")).acquire()
    assert os.path.isfile(tmp_path / "a" / "b" / ".run.rlhfkit-lock")
    lock.release()
    assert os.listdir(tmp_path) == []
    # A refused run removes the parents it created too: here the holder created them, so they stay.
    holder = RunLock(str(tmp_path / "a" / "run")).acquire()
    with pytest.raises(UserError, match="in use by another run"):
        RunLock(str(tmp_path / "a" / "run")).acquire()
    holder.release()
    assert os.listdir(tmp_path) == []


def test_unusable_output_dir_fails_before_the_lock_writes_anything(tmp_path):
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(UserError, match="is a file"):
        RunLock(str(tmp_path / "afile" / "run")).acquire()
    assert os.listdir(tmp_path) == ["afile"]


def test_a_killed_holders_lock_is_taken_over(tmp_path):
    """kill -9 runs no cleanup: the lock file stays, but the kernel released the lock with the process."""
    out = str(tmp_path / "run")
    code = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from rlhfkit.launch import RunLock; "
            f"lock = RunLock({out!r}).acquire(); print('locked', flush=True); sys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"pid {holder.pid} on host"):
            RunLock(out).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert os.path.isfile(lock_path(out))  # left behind by the killed holder
    lock = RunLock(out).acquire()
    with open(lock.path) as f:
        assert f.read().startswith(f"pid {os.getpid()} ")
    lock.release()
    assert os.listdir(tmp_path) == []


class _Writes:
    """A stderr that records each write() call: a line reaches a shared pipe whole only when written in one call."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text):
        self.calls.append(text)
        return len(text)

    def flush(self):
        pass


def test_the_error_line_is_written_in_one_call(monkeypatch, tmp_path):
    """Every process of a refused launch prints the same error into one pipe; written in two calls (text, then the
    newline), two processes' lines interleave into one (CI saw `...machines)rlhfkit: error: ...` on one line)."""
    from rlhfkit import cli

    spy = _Writes()
    monkeypatch.setattr(sys, "stderr", spy)
    assert cli.main(["sft", "--config", str(tmp_path / "missing.yaml")]) == 2
    lines = [c for c in spy.calls if "rlhfkit: error:" in c]
    assert len(lines) == 1 and lines[0].startswith("rlhfkit: error:") and lines[0].endswith("\n"), spy.calls
    assert lines[0].count("\n") == 1


def test_the_command_destroys_the_process_group_on_its_way_out_and_main_leaves_it_to_its_caller(tmp_path):
    """A process group left to the interpreter's exit is torn down in no set order with the Python objects its
    threads hold, which once aborted a finished 2-process run's rank ("terminate called without an active
    exception"): the `rlhfkit` command (`cli.entry`) destroys it before it returns, on an error too. `cli.main` called
    from Python leaves it to its caller, who may run several stages in the same group (the multiprocess tests' driver
    does; destroying it under accelerate's state failed every stage after the first). A one-process gloo group, in a
    process of its own (as accelerate makes it under torchrun)."""
    script = (
        "import sys, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path / 'store'}', rank=0, world_size=1)\n"
        "from rlhfkit.cli import entry, main\n"
        f"argv = ['sft', '--config', '{tmp_path / 'missing.yaml'}']\n"
        "first = main(argv)\n"
        "print(first, dist.is_initialized())\n"
        "sys.argv = ['rlhfkit', *argv]\n"
        "second = entry()\n"
        "print(second, dist.is_initialized())\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["2", "True", "2", "False"], r.stderr[-2000:]
