"""What the loops compute over every process, in one place: sums by name, and a process's share of a global count.

Sums travel by name, never by position in a packed tensor (`ops.sums_by_name`): every process passes the same
groups and names, so a figure added or removed on one side cannot shift another's value, and a loop's own
bookkeeping travels in a group of its own, apart from the metrics it logs. A loss normalised by a global count
(tokens, sequences, pairs) is divided on each process by its *share* of that count, Σ over processes / world size:
DDP (and FSDP, DeepSpeed) average the gradients over processes, and that average of the per-process losses is then
the sum over every process's items divided by the global count, as one process holding the whole batch would compute.
"""

from __future__ import annotations

import torch

from rlhfkit import ops


def sums_by_name(run, *groups: dict[str, torch.Tensor | float]) -> tuple[dict[str, float], ...]:
    """Each group {name: Σ over every process of its value} (scalars, fp64 but on MPS), one dict per group.
    Collective: every process calls it with the same groups and names."""
    device = run.accelerator.device
    if run.world == 1 and device.type != "mps":  # nothing to sum: each value in fp64, as the packed sum would hold it
        return tuple({name: float(value) for name, value in sorted(group.items())} for group in groups)
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    return ops.sums_by_name(*groups, sum_over=run.sum_over_processes, device=device, dtype=dtype)


def global_share(run, counts: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """{name: Σ over every process / world size}: what each process divides its summed loss by (module docstring).
    Collective."""
    (totals,) = sums_by_name(run, counts)
    return {name: total / run.world for name, total in totals.items()}
