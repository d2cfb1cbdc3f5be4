"""Launches through the real CLI in fresh processes: a launch that would leave each process training alone is refused
in one line (exit 2) before any model loads; a second run on a locked output_dir is refused naming the holder; and a
simulated 2-machine run (two torchrun agents, `--nnodes 2`, c10d rendezvous on localhost, gloo) equals one process on
the same global batch, with metrics.jsonl written once."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.launch import RunLock, lock_path

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, rows, weights  # noqa: E402
TIMEOUT_S = 180  # per process: a hang fails the test instead of blocking the suite
SFT = ["sft", "--config", "configs/sft_tiny.yaml", "data.eval=null", "logging.logging_steps=1", "logging.progress_bar=false"]


def env(**extra):
    """No GPU, one thread per process; the parent test's launcher variables removed."""
    e = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")}
    return {**e, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **extra}


def errors(stderr: str) -> list[str]:
    """The `rlhfkit: error:` lines the processes wrote. accelerate launch (1.16) repeats the tail of its child's stderr
    in a RuntimeError it raises after it (then its traceback): only what comes before is the child's."""
    written = re.split(r"^(?:Traceback \(most recent call last\):|RuntimeError: )", stderr, maxsplit=1, flags=re.M)[0]
    return [line for line in written.splitlines() if line.startswith("rlhfkit: error:")]


# 1. Refusals ---------------------------------------------------------------------------------------------------


def test_accelerate_launch_cpu_with_two_processes_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` itself (its plain launcher starts one process)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "rlhfkit.cli", *SFT, f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0  # accelerate launch turns the child's status 2 into its own error
    lines = errors(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "`accelerate launch` was asked for several processes but started only this one" in lines[0]
    assert "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N -m rlhfkit.cli" in lines[0]
    assert os.listdir(tmp_path) == []  # nothing written, not even the lock


def test_accelerate_launch_multi_gpu_without_gpus_is_refused(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` with no GPU visible: torchrun starts two processes (WORLD_SIZE=2)
    and torch joins them, but accelerate, finding no GPU, makes each a world of one: two runs on one output_dir."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           "-m", "rlhfkit.cli", *SFT, f"output_dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    lines = errors(proc.stderr)
    assert len(lines) == 2 and len(set(lines)) == 1, proc.stderr  # one line from each process
    assert lines[0].startswith("rlhfkit: error: the launch asked for 2 processes (WORLD_SIZE=2, set by torchrun")
    assert os.listdir(tmp_path) == []


def test_second_run_on_a_locked_output_dir_is_refused(tmp_path, capsys):
    """This test process holds the lock a running run holds (flock locks belong to an open file, so a second open in
    the same process conflicts as another process would); the CLI run names the holder and writes nothing."""
    out = tmp_path / "run"
    holder = RunLock(str(out)).acquire()
    try:
        code = main([*SFT, f"output_dir={out}"])
    finally:
        holder.release()
    lines = errors(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1, lines
    assert f"output_dir '{out}' is in use by another run (pid {os.getpid()} on host {socket.gethostname()}" in lines[0]
    assert not out.exists() and os.listdir(tmp_path) == []


# 2. Two machines, simulated on one -----------------------------------------------------------------------------


def test_simulated_two_machine_run_equals_one_process(tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1 --node_rank {0,1}` with a static rendezvous on 127.0.0.1: one torchrun
    agent per "machine", as on two hosts. 2 x per_device_batch_size 8 must give the weights of 1 x 16."""
    steps = ["max_steps=3"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([*SFT, *steps, f"output_dir={one}", "optim.per_device_batch_size=16"]) == 0
    port = free_port()
    agents, logs = [], []
    for node in (0, 1):
        logs.append(open(tmp_path / f"node{node}.log", "w+"))
        # Static rendezvous on machine 0's address (127.0.0.1, not "localhost": no IPv6/IPv4 ambiguity).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
               str(node), "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "rlhfkit.cli", *SFT, *steps,
               f"output_dir={two}", "optim.per_device_batch_size=8"]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env(ACCELERATE_USE_CPU="1"), stdout=logs[-1],
                                       stderr=subprocess.STDOUT))
    try:
        codes = [agent.wait(timeout=TIMEOUT_S) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = ["timed out"]
    finally:
        for agent in agents:
            agent.kill()
    text = []
    for log in logs:
        log.seek(0)
        text.append(log.read())
        log.close()
    assert codes == [0, 0], "\n".join(f"--- machine {i}:\n{t[-4000:]}" for i, t in enumerate(text))
    # The start line, from the main process only (machine 0).
    assert "rlhfkit: launch: world size 2 (2 machines x 1 process), backend gloo, distributed type MULTI_CPU" in text[0]
    assert "rlhfkit: launch:" not in text[1]
    # metrics.jsonl written once: one row per step; the global gradient norm as in one process.
    logged, reference = rows(two), rows(one)
    assert [r["step"] for r in logged] == [1, 2, 3]
    for a, b in zip(logged, reference):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    ours, theirs = weights(two), weights(one)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6, msg=name)
    assert not os.path.exists(lock_path(str(two)))  # the main process released the lock at the end
