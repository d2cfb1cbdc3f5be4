"""rlhfkit: align language models with human preferences (SFT, reward models, online RL, preference optimisation)."""

import logging

__version__ = "0.1.0"

# Dependencies that speak when they are imported, with nothing for the user to do: bitsandbytes (the `qlora` extra;
# peft imports it whenever it is installed) asks the optional `kernels` package for a CPU kernel from the hub on CPUs
# with AVX512-BF16, and logs when it cannot have it; `kernels` logs, offline, that it skipped the publisher trust
# check. Their notices go to the `rlhfkit` logger at debug level (`rlhfkit --verbose` shows them), so that a one-line
# error stays one line; an error of theirs keeps its level.
QUIETED_LOGGERS = ("kernels", "bitsandbytes.backends.cpu.ops")


class _ToDebugLog(logging.Handler):
    """Hands a dependency's record to the `rlhfkit` logger, at debug level below ERROR, named by its logger."""

    def emit(self, record: logging.LogRecord) -> None:
        level = logging.DEBUG if record.levelno < logging.ERROR else record.levelno
        logging.getLogger("rlhfkit").log(level, "%s: %s", record.name, record.getMessage())


for _name in QUIETED_LOGGERS:
    _logger = logging.getLogger(_name)
    if not any(isinstance(h, _ToDebugLog) for h in _logger.handlers):
        _logger.addHandler(_ToDebugLog())
    _logger.propagate = False


def __getattr__(name: str):
    """`rlhfkit.train` and `rlhfkit.TrainResult` (rlhfkit.api), `rlhfkit.plan` and `rlhfkit.pipeline`, imported on first use so that `import rlhfkit` and
    `rlhfkit --help` stay instant (PEP 562)."""
    if name in ("train", "TrainResult"):
        from rlhfkit import api

        return getattr(api, name)
    if name == "plan":  # the package rlhfkit.plan, callable: rlhfkit.plan(stage, ...) returns a Plan
        import importlib

        return importlib.import_module("rlhfkit.plan")
    if name == "pipeline":  # a callable package: rlhfkit.pipeline("pipeline.yaml")
        import importlib

        return importlib.import_module("rlhfkit.pipeline")
    raise AttributeError(f"module 'rlhfkit' has no attribute {name!r}")
