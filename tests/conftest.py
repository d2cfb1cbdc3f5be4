"""Shared test setup: every test runs offline, with the model cache in a per-session temporary directory."""

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `-n 2` (pyproject's addopts): one worker per core, each computing on one thread, so that the workers' in-process
    # runs and the processes the tests start do not fight over the cores.
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Build tiny models into a fresh cache once per session, unless RLHFKIT_CACHE is set by the caller."""
    if "RLHFKIT_CACHE" not in os.environ:
        os.environ["RLHFKIT_CACHE"] = str(tmp_path_factory.mktemp("rlhfkit-cache"))
    yield


@pytest.fixture(autouse=True)
def _chdir_root(monkeypatch):
    """Configs name data files relative to the repository root."""
    monkeypatch.chdir(ROOT)


def pytest_collection_modifyitems(config, items):
    """The xdist groups (`--dist loadgroup`, pyproject's addopts): a test file's tests share a worker, as with
    `loadfile` (its module fixtures run once), and the tests that start several processes (tests/multiprocess/) all
    share one worker, so that two process groups never run at once: two torchrun groups started side by side by the
    two workers made a rank abort ("terminate called without an active exception") in clean-clone CI runs."""
    multiprocess = os.path.join(ROOT, "tests", "multiprocess") + os.sep
    for item in items:
        path = str(item.path)
        group = "multiprocess" if path.startswith(multiprocess) else os.path.relpath(path, ROOT)
        item.add_marker(pytest.mark.xdist_group(group))
