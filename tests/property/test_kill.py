"""kill -9 at random moments of an SFT, a DPO and a PPO run, then resume: the run ends as if never interrupted (issue 9).

Each stage runs once uninterrupted, then again as a real `python -m rlhfkit.cli` process that receives SIGKILL —
during a checkpoint save, during the pruning of an old checkpoint or the final save, and at a random moment after
setup — and is started again with resume=true (overwrite=true when no checkpoint survived the kill) until a last
start runs to completion. Then:

- the final metrics.jsonl (and PPO's samples.jsonl) equal the uninterrupted run's rows, step for step, with no
  duplicated or missing row (timing metrics aside);
- the final weights, and the checkpoints left beside them, equal the uninterrupted run's;
- the directory holds exactly what the uninterrupted run's holds: no `.tmp-*` leftover, no stale checkpoint, and no
  run moved aside by overwrite=true next to it;
- no start printed a traceback.

The kill moments come from a seeded generator, so every run of the test aims at the same moments; where the process
actually is at the random one still depends on the machine's speed, which is the point: the assertions hold
wherever it is. A named moment (a save, a pruning, the final save) is looked at again with the process stopped
before the kill, so a loaded machine cannot move the kill past it.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.checkpoint import CHECKPOINT_RE, latest_checkpoint

pytestmark = pytest.mark.slow

MAX_STEPS = 5
KEEP = 2  # logging.save_total_limit: every save from the third on prunes the oldest checkpoint
ARGS = [f"max_steps={MAX_STEPS}", "logging.save_steps=1", "logging.logging_steps=1", "logging.progress_bar=false",
        f"logging.save_total_limit={KEEP}"]
SAVING_RE = re.compile(r"^\.tmp-checkpoint-(\d+)-")  # checkpoint-N while it is being written
# Measurements that differ in every run: wall clock (so does every `time/*` metric) and the resident memory.
TIMING = ("elapsed_s", "memory/peak_rss_gb")
POLL_S = 0.001
TIMEOUT_S = 120


def _env():
    # One CPU thread and no GPU: the same ops on the same inputs give the same bits, so a resumed run must equal the
    # uninterrupted one exactly (weights, optimizer state and RNG states are restored bit for bit).
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")


class Start:
    """One `rlhfkit <stage>` process on `out`, killed with SIGKILL when `trigger` fires (None: runs to the end): seen
    firing, the process is stopped and looked at again, so that the kill lands in the moment the trigger names.

    Triggers: ("save", k) when a temporary `checkpoint-j` directory (j >= k) appears, i.e. while that checkpoint is
    being written; ("prune",) once a new checkpoint is in place and the oldest is due for deletion, or while it is
    being deleted; ("final",) while the final model is being written; ("after_setup", s) s seconds after this start
    has written its config.yaml (setup done, training begins).
    Every start notes when it wrote its config.yaml (`setup_done_at`) and its final model (`trained_at`, a fresh run).
    """

    def __init__(self, stage, out, extra, log_path, trigger=None):
        cmd = [sys.executable, "-m", "rlhfkit.cli", stage, "--config", f"configs/{stage}_tiny.yaml", f"output_dir={out}",
               *ARGS, *extra]
        self.out, self.trigger, self.log_path = str(out), trigger, log_path
        self.config_mtime = self._config_mtime()
        self.setup_done_at = self.trained_at = None
        self.killed, self.caught = False, []  # caught: the `.tmp-*` entries present just after the kill
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)

    def _config_mtime(self):
        try:
            return os.stat(os.path.join(self.out, "config.yaml")).st_mtime_ns
        except FileNotFoundError:
            return None

    def _fired(self) -> bool:
        try:
            names = os.listdir(self.out)
        except FileNotFoundError:
            return False
        now = time.monotonic()
        if self.setup_done_at is None and self._config_mtime() not in (None, self.config_mtime):
            self.setup_done_at = now
        if self.trained_at is None and self.setup_done_at is not None and "model.safetensors" in names:
            self.trained_at = now
        if self.trigger is None:
            return False
        kind = self.trigger[0]
        if kind == "after_setup":
            return self.setup_done_at is not None and now - self.setup_done_at >= self.trigger[1]
        if kind == "save":
            return any(int(m.group(1)) >= self.trigger[1] for m in map(SAVING_RE.match, names) if m)
        if kind == "prune":  # a new checkpoint in place, the oldest not yet (or half) deleted
            return any(n.startswith(".tmp-removed-") for n in names) or \
                sum(bool(CHECKPOINT_RE.match(n)) for n in names) > KEEP
        return any(n.startswith(".tmp-model-") for n in names)  # final

    def wait(self) -> int:
        deadline = time.monotonic() + TIMEOUT_S
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"{self.proc.args} did not finish in {TIMEOUT_S}s")
            if self._fired() and self._fired_when_frozen():
                os.kill(self.proc.pid, signal.SIGKILL)
                self.killed = self.proc.wait() == -signal.SIGKILL  # not if it had just exited by itself
                self.caught = sorted(n for n in os.listdir(self.out) if n.startswith(".tmp-"))
                break
            time.sleep(POLL_S)
        return self.proc.returncode

    def _fired_when_frozen(self) -> bool:
        """Stop the process (SIGSTOP) and look again: on a loaded machine the moment the trigger saw can pass before
        a signal lands (the checkpoint being written is renamed into place). Still there: the kill lands in it. Gone:
        the process goes on (SIGCONT) and the trigger waits for its next occurrence (a later save, say)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        while _state(self.proc.pid) not in "TtZX":  # stopped, or exited meanwhile ("" once reaped)
            time.sleep(POLL_S)
        if self._fired():
            return True
        os.kill(self.proc.pid, signal.SIGCONT)
        return False

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def _state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped, Z: exited), "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _rows(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in rows]


def _assert_rows_equal(got, want, what):
    assert [r.get("step") for r in got] == [r.get("step") for r in want], what
    for a, b in zip(_strip(got), _strip(want)):
        assert a == b, (what, a["step"], {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)})


def _weights(directory):
    """Every safetensors tensor under `directory`, checkpoints included, keyed by file and name."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            if f.endswith(".safetensors"):
                for k, v in load_file(os.path.join(root, f)).items():
                    out[f"{os.path.relpath(os.path.join(root, f), directory)}:{k}"] = v
    return out


def _assert_weights_equal(got_dir, want_dir):
    got, want = _weights(got_dir), _weights(want_dir)
    assert got.keys() == want.keys() and want, (got_dir, sorted(got.keys() ^ want.keys())[:5])
    for k in want:
        assert torch.equal(got[k], want[k]), (got_dir, k, float((got[k] - want[k]).abs().max()))


def _assert_state_equal(got_path, want_path):
    got, want = (torch.load(p, weights_only=True, map_location="cpu") for p in (got_path, want_path))
    assert got["step"] == want["step"] and got["scheduler"] == want["scheduler"]
    assert got.get("bad_steps") == want.get("bad_steps") and got.get("kl_controller") == want.get("kl_controller")
    for p, state in want["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optimizer"]["state"][p][k], v), (got_path, p, k)


def _triggers(stage):
    """The seeded kill moments of one stage: during a checkpoint save, during the pruning of an old checkpoint or the
    final save, and at a random moment of the training (a fraction of the time from its setup to its final model)."""
    rng = random.Random(f"rlhfkit-kill-{stage}")
    second = {"sft": ("final",), "dpo": ("prune",), "ppo": rng.choice([("final",), ("prune",)])}[stage]
    return [("save", rng.randint(1, MAX_STEPS - 1)), second, ("after_setup", rng.uniform(0.0, 1.0))]


@pytest.mark.parametrize("stage", ["sft", "dpo", "ppo"])
def test_kill_9_and_resume_equals_the_uninterrupted_run(stage, tmp_path):
    ref = tmp_path / "ref" / "run"
    start = Start(stage, ref, [], tmp_path / "ref.log")
    assert start.wait() == 0, start.log()
    train_s = start.trained_at - start.setup_done_at  # the training steps, checkpoints and final save

    out = tmp_path / "killed" / "run"
    starts = []
    for i, trigger in enumerate(_triggers(stage) + [None]):
        ckpt = latest_checkpoint(str(out)) if os.path.isdir(out) else None
        extra = ["resume=true"] if ckpt else ["overwrite=true"]
        if trigger and trigger[0] == "after_setup":  # a fraction of the steps left after ckpt
            left = MAX_STEPS - (int(CHECKPOINT_RE.match(os.path.basename(ckpt)).group(1)) if ckpt else 0)
            trigger = ("after_setup", trigger[1] * train_s * left / MAX_STEPS)
        start = Start(stage, out, extra, tmp_path / f"start{i}.log", trigger)
        code = start.wait()
        starts.append(start)
        log = start.log()
        assert "Traceback" not in log and (start.killed or code == 0), log
        print(f"{stage} start {i} {extra} trigger={trigger}: killed={start.killed}, then {start.caught}")  # shown on failure
    assert not starts[-1].killed

    # A kill deliberately during a checkpoint save: the save's temporary directory was still there after it.
    assert starts[0].killed and any(n.startswith(".tmp-checkpoint-") for n in starts[0].caught), starts[0].caught

    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows if not any(k.startswith("eval/") for k in r)] == list(range(1, MAX_STEPS + 1))
    for name in ("metrics.jsonl", "samples.jsonl"):
        _assert_rows_equal(_rows(out / name), _rows(ref / name), name)
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref))  # no .tmp-* leftover, the same checkpoints
    assert os.listdir(out.parent) == ["run"]  # no run moved aside by overwrite=true
    _assert_weights_equal(out, ref)  # the final model and every checkpoint's model (and critic)
    for ckpt in sorted(p for p in os.listdir(ref) if p.startswith("checkpoint-")):
        _assert_state_equal(out / ckpt / "trainer_state.pt", ref / ckpt / "trainer_state.pt")
