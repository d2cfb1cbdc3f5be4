"""Run a list of rlhfkit CLI jobs in one process, one after another: under `torchrun` every process runs the same list
(one process group, started once, serves every job), and the tests import `run_job` to run the single-process
comparison in-process.

    torchrun --nproc_per_node 2 tests/multiprocess/driver.py JOBS.json RESULTS_DIR

A job is {"argv": [stage, "--config", FILE, key=value, ...]} plus optional
  "copy": [SRC, DST]    the main process copies directory SRC to DST first (a run to resume), the others wait;
  "nan": {"rank": R, "steps": [S, ...]}   the process of rank R (every process when R is null) puts a NaN into its
                        training forwards at the given steps (1-based, step 1 excluded), to test a fault seen by one
                        process only.
Each process writes RESULTS_DIR/rank{R}.json: the exit status of every job, in order.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys


def nan_loss(rank: int | None, steps: list[int]):
    """A NaN in every training forward of process `rank` (every process when None) at the 1-based `steps`, so its
    loss is NaN there (any offline stage or RFT): torch's global hooks (tests/hooks.py), no trainer method patched."""
    from tests.hooks import nan_in_steps

    return nan_in_steps(steps, when=lambda: rank is None or rank == int(os.environ.get("RANK", "0")))


def run_job(job: dict) -> int:
    """Run one job through `rlhfkit.cli.main`; return its exit status."""
    import torch.distributed as dist

    from rlhfkit.cli import main

    if "copy" in job:
        # No process state of our own: rlhfkit's must be the first (a copy job follows a job that started it).
        assert not os.environ.get("WORLD_SIZE") or dist.is_initialized(), "a copy job cannot come first"
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.copytree(*job["copy"])
        if dist.is_initialized():
            dist.barrier()
    nan = job.get("nan")
    with nan_loss(nan["rank"], nan["steps"]) if nan else contextlib.nullcontext():
        return main(job["argv"])


def run_jobs(jobs_file: str, results: str) -> None:
    """Run every job of JOBS_FILE in order; write this process's exit statuses to RESULTS/rank{R}.json."""
    with open(jobs_file, encoding="utf-8") as f:
        jobs = json.load(f)
    codes = []
    rank = os.environ.get("RANK", "0")
    for job in jobs:
        codes.append(run_job(job))
        with open(os.path.join(results, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump(codes, f)


if __name__ == "__main__":
    run_jobs(*sys.argv[1:3])
