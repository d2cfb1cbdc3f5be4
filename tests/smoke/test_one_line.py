"""One line means one line: a refusal through the CLI, in a fresh process on an offline machine with every extra
installed (bitsandbytes and `kernels` print notices when they are imported), writes exactly rlhfkit's line to stderr
and exits with status 2. The dependencies' import-time notices go to the `rlhfkit` debug log, shown by --verbose."""

import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BASE = ["sft", "--config", "configs/sft_tiny.yaml", "max_steps=1", "data.eval=null"]

# case -> (arguments after `rlhfkit`, a part of the one expected line)
REFUSALS = {
    "bad config key": (BASE + ["optim.learning_rate=0.1"], "unknown config key 'optim.learning_rate'"),
    "missing data file": (BASE + ["data.train=no/such/file.jsonl"], "no/such/file.jsonl' not found"),
    "unknown stage option": (BASE + ["algo.nope=1"], "unknown config key 'algo.nope'"),
    "unknown command-line option": (["sft", "--config", "configs/sft_tiny.yaml", "--bogus"],
                                    "unrecognized arguments: --bogus"),
}


def rlhfkit_cli(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    """`python -m rlhfkit.cli ARGS` in a fresh process, offline (HF_HUB_OFFLINE=1: where `kernels` speaks up), with
    Python's default warning filters (a user's)."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "rlhfkit.cli", *args, f"output_dir={tmp_path / 'out'}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def kernels_speak_offline() -> bool:
    """Whether importing bitsandbytes here makes `kernels` log its offline notice (bitsandbytes asks `kernels` for
    its CPU kernel on CPUs with AVX512-BF16)."""
    try:
        import kernels  # noqa: F401
        from bitsandbytes.functional import has_avx512bf16
    except ImportError:
        return False
    return bool(has_avx512bf16())


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_refusal_prints_exactly_one_line_in_a_fresh_offline_process(case, tmp_path):
    args, expected = REFUSALS[case]
    done = rlhfkit_cli(args, tmp_path)
    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("rlhfkit: error: ") and expected in lines[0], lines[0]


def test_dependency_import_notices_go_to_the_rlhfkit_debug_log(caplog):
    """The notices `kernels` and bitsandbytes' CPU backend log when bitsandbytes is imported (the trust check skipped
    offline, a kernel that cannot be fetched) reach the `rlhfkit` logger at debug level, not stderr."""
    import rlhfkit  # noqa: F401  (installs the routing)

    with caplog.at_level(logging.DEBUG, logger="rlhfkit"):
        logging.getLogger("kernels._internals.hf_hub").warning("Skipping publisher trust check for 'x/y'")
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward")
    routed = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert routed == [("rlhfkit", logging.DEBUG, "kernels._internals.hf_hub: Skipping publisher trust check for 'x/y'"),
                      ("rlhfkit", logging.DEBUG, "bitsandbytes.backends.cpu.ops: Failed to load CPU gemm_4bit_forward")]


def test_verbose_shows_the_debug_log(tmp_path):
    """--verbose (before or after the stage) shows rlhfkit's debug log; the refusal is still the last line."""
    args = REFUSALS["bad config key"][0]
    for args in (["--verbose", *args], [args[0], "--verbose", *args[1:]]):
        done = rlhfkit_cli(args, tmp_path)
        lines = done.stderr.splitlines()
        assert done.returncode == 2, done.stderr
        assert lines[-1].startswith("rlhfkit: error: unknown config key 'optim.learning_rate'"), done.stderr
        assert all(line.startswith("rlhfkit: ") for line in lines), done.stderr
        if kernels_speak_offline():
            assert any("kernels" in line and "Skipping publisher trust check" in line for line in lines), done.stderr
