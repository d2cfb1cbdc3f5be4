"""What the multiprocess tests share: a free port for a process group, a run's logged rows and final weights, and the
comparisons that "N processes == 1 on the same global batch" is asserted with (tests/multiprocess/*).

Imported as `driver` is: each test file puts its own folder on sys.path."""

from __future__ import annotations

import json
import math
import os
import socket

import torch
from safetensors.torch import load_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def rows(run_dir) -> list[dict]:
    """A run's metrics.jsonl."""
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def weights(directory) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `directory` (a run's model or a checkpoint's)."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    assert out, f"no weights in {directory}"
    return out


def assert_same_weights(a, b, atol=1e-5):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    assert worst <= atol, f"max |Δweight| = {worst:.3g} between {a} and {b}"


def assert_same_rows(a: list[dict], b: list[dict], rel=1e-5, abs_=1e-6):
    """The same logged rows (steps, keys, values), `elapsed_s` and the memory figures aside (measured per process, and
    planned per process, so they differ with the number of processes).

    An accuracy counts comparisons (chosen above rejected): where the two are equal but for float noise (the step-1
    policy is its reference, so every implicit reward is 0 ± 1e-7 when the reference log-probs were precomputed in
    batches padded otherwise) it is noise, and it is compared only where the logged margin is above that noise.
    """
    strip = [[{k: v for k, v in r.items() if k != "elapsed_s" and not k.startswith("memory/")} for r in rs]
             for rs in (a, b)]
    assert [sorted(r) for r in strip[0]] == [sorted(r) for r in strip[1]]
    for ra, rb in zip(*strip):
        for k in ra:
            va, vb = ra[k], rb[k]
            margin = ra.get(k.replace("accuracies", "margins").replace("accuracy", "margin"))
            if "accura" in k and margin is not None and abs(margin) < 1e-5:
                continue
            if va is None or vb is None:
                assert va is vb, (ra["step"], k, va, vb)
            else:
                assert math.isclose(va, vb, rel_tol=rel, abs_tol=abs_), (ra["step"], k, va, vb)
