"""What a run actually held, to set beside its plan: on a GPU `torch.cuda.max_memory_allocated`; on a CPU the peak
of live tensor storage, tracked op by op (`LiveTensors`), and the peak resident memory of the process.

`LiveTensors` is a TorchDispatchMode: every tensor an op returns has its storage counted once (by address) until the
storage is freed (a weak reference's callback), and tensors made outside any op (weights read from a file) are
counted by `add`. It sees every allocation a CPU run makes through torch, forward and backward alike, at the cost of a
Python call per op (`plan.measure`).
"""

from __future__ import annotations

import resource
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rlhfkit.plan.devices import GB


class LiveTensors(TorchDispatchMode):
    """The live bytes of CPU tensor storage while the mode is on, and their peak."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.current = 0
        self.peak = 0

    def add(self, *tensors: torch.Tensor) -> None:
        """Count tensors (and their storage once) that no op under this mode made: weights loaded before, buffers."""
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.is_meta:
                continue
            try:
                storage = t.untyped_storage()
                # A fake tensor (torch.compile, export) reports a CPU device over a meta storage: it holds no memory,
                # and its data pointer raises.
                if storage.device.type != "cpu":
                    continue
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, some subclasses)
                continue
            if size == 0 or key in self.live:
                continue
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key, size)

    def add_module(self, module: torch.nn.Module) -> None:
        self.add(*module.parameters(), *module.buffers())

    def _freed(self, key: int, size: int) -> None:
        if self.live.get(key) == size:
            del self.live[key]
            self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(*(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        return out

    def reset_peak(self) -> None:
        self.peak = self.current


def peak_rss_gb() -> float:
    """The process's peak resident memory (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GB if sys.platform == "darwin" else peak * 1024 / GB


@dataclass(frozen=True)
class Measured:
    peak_gb: float | None  # GPU: max_memory_allocated; CPU: peak live tensor storage (None when not tracked)
    rss_gb: float | None  # CPU: peak resident memory of the process
    how: str  # what peak_gb measures

    def metrics(self, planned_gb: float) -> dict[str, float]:
        out = {"memory/planned_peak_gb": planned_gb}
        if self.peak_gb is not None:
            out["memory/peak_gb"] = self.peak_gb
        if self.rss_gb is not None:
            out["memory/peak_rss_gb"] = self.rss_gb
        return out
