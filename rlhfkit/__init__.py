"""rlhfkit: align language models with human preferences (SFT, reward models, online RL, preference optimisation)."""

import logging

__version__ = "0.1.0"

# bitsandbytes (the `qlora` extra; peft imports it whenever it is installed) logs at import, on CPUs with AVX512-BF16,
# that the optional `kernels` package (a kernel fetched from the hub) is missing, then uses its own CPU kernel: a line
# on every run, with nothing for the user to do.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def __getattr__(name: str):
    """`rlhfkit.train` and `rlhfkit.TrainResult` (rlhfkit.api) and `rlhfkit.plan` (rlhfkit.plan), imported on first use so that `import rlhfkit` and
    `rlhfkit --help` stay instant (PEP 562)."""
    if name in ("train", "TrainResult"):
        from rlhfkit import api

        return getattr(api, name)
    if name == "plan":  # the package rlhfkit.plan, callable: rlhfkit.plan(stage, ...) returns a Plan
        import importlib

        return importlib.import_module("rlhfkit.plan")
    raise AttributeError(f"module 'rlhfkit' has no attribute {name!r}")
