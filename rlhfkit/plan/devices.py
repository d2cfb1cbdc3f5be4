"""The devices a plan can be made for: memory, bf16 FLOP/s and memory bandwidth from the vendors' data sheets, plus
`cpu` (this machine's RAM). What each achieves of them, where measured, is in rates.json (`rlhfkit.plan.timing`).

GB in plans means 2**30 bytes, the unit `torch.cuda.mem_get_info` and nvidia-smi report; a GPU's `memory_gb` is the
total torch reports for it (slightly under the sheet's figure: the driver keeps the rest).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlhfkit.errors import UserError

GB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float  # what one process can hold (the GPU's memory; the machine's RAM for cpu)
    flops: float  # dense bf16 FLOP/s of the sheet (cpu: fp32, nominal, see `cpu_device`)
    bandwidth: float  # memory bytes/s of the sheet
    sheet: str  # where the figures come from


# Dense (not sparse) bf16 tensor-core FLOP/s and HBM/GDDR bandwidth, SXM parts where there are several.
DEVICES = {
    "H100-80GB": Device("H100-80GB", 79.2, 989e12, 3.35e12, "NVIDIA H100 SXM data sheet"),
    "H200-141GB": Device("H200-141GB", 139.8, 989e12, 4.8e12, "NVIDIA H200 SXM data sheet"),
    "A100-40GB": Device("A100-40GB", 39.4, 312e12, 1.555e12, "NVIDIA A100 SXM data sheet"),
    "A100-80GB": Device("A100-80GB", 79.2, 312e12, 2.039e12, "NVIDIA A100 SXM data sheet"),
    "L4": Device("L4", 22.0, 121e12, 300e9, "NVIDIA L4 data sheet (242 TFLOP/s is with sparsity)"),
    "RTX-4090": Device("RTX-4090", 23.6, 165e12, 1.008e12, "NVIDIA Ada whitepaper (fp32 accumulate)"),
}
ALIASES = {"h100": "H100-80GB", "h200": "H200-141GB", "a100": "A100-80GB", "a100-40": "A100-40GB",
           "a100-80": "A100-80GB", "l4": "L4", "4090": "RTX-4090", "rtx4090": "RTX-4090"}

def cpu_device() -> Device:
    """This machine: its RAM, and a nominal fp32 rate of 32 FLOP per cycle per core at 2.5 GHz (AVX-512 FMA) and
    20 GB/s per core up to 100 GB/s: the fallback when rates.json holds no measurement for `cpu`."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GB
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Device("cpu", ram / GB, cores * 32 * 2.5e9, min(cores * 20e9, 100e9), f"this machine: {cores} cores, "
                  "nominal rates")


def device_named(name: str) -> Device:
    """The named device, or one line listing the known ones."""
    if name.lower() == "cpu":
        return cpu_device()
    key = ALIASES.get(name.lower(), next((k for k in DEVICES if k.lower() == name.lower()), None))
    if key is None:
        raise UserError(f"unknown device {name!r}: one of {', '.join(DEVICES)}, cpu (or give --memory GB)")
    return DEVICES[key]


def device_matching(name: str, total_gb: float) -> Device | None:
    """The table's device a GPU's reported name ("NVIDIA H100 80GB HBM3", "NVIDIA GeForce RTX 4090") is, the one of
    the closest memory where several match (A100 40/80 GB); None for a GPU the table does not hold."""
    tokens = set(name.upper().replace("-", " ").split())
    found = [d for key, d in DEVICES.items() if all(t in tokens for t in key.upper().split("-") if not t.endswith("GB"))]
    return min(found, key=lambda d: abs(d.memory_gb - total_gb)) if found else None


def memory_device(memory_gb: float) -> Device:
    """A device known by its memory alone (`--memory GB`): time is not planned on it."""
    if not memory_gb > 0:
        raise UserError(f"memory_gb: expected a positive number of GB, got {memory_gb}")
    return Device(f"{memory_gb:g} GB", float(memory_gb), 0.0, 0.0, "memory given")
