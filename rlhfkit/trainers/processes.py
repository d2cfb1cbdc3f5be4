"""What the loops compute over every process, in one place: sums by name, and a process's share of a global count.

Sums travel by name, never by position in a packed tensor: every process passes the same names (sorted here), so a
figure added or removed on one side cannot shift another's value. A loss normalised by a global count (tokens,
sequences, pairs) is divided on each process by its *share* of that count, Σ over processes / world size: DDP (and
FSDP, DeepSpeed) average the gradients over processes, and that average of the per-process losses is then the sum
over every process's items divided by the global count, as one process holding the whole batch would compute.
"""

from __future__ import annotations

import torch


def sums_by_name(run, values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """{name: Σ over every process of its value} (scalars, fp64 but on MPS). Collective: every process calls it with the same
    names."""
    names = sorted(values)
    if not names:
        return {}
    device = run.accelerator.device
    dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
    local = torch.stack([torch.as_tensor(values[n], dtype=dtype, device=device).detach().reshape(()) for n in names])
    return dict(zip(names, run.sum_over_processes(local).tolist()))


def global_share(run, counts: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """{name: Σ over every process / world size}: what each process divides its summed loss by (module docstring).
    Collective."""
    return {name: total / run.world for name, total in sums_by_name(run, counts).items()}
