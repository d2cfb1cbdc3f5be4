"""`rlhfkit demo --output-dir DIR` follows every stage's rule: an existing non-empty DIR is refused (one line, exit 2,
nothing written, before any model loads) unless `--overwrite` replaces it or `--from-stage` continues the demo in it.

The stages are stubbed here (the real path runs in tests/smoke/test_demo_quick.py): these tests take milliseconds."""

import os

import pytest

from rlhfkit.tasks import demo
from rlhfkit.cli import main


def _tree(root):
    """Every file under `root` with its bytes and mtime: "nothing written" means this is unchanged."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


@pytest.fixture
def no_models(monkeypatch):
    """Any model load or stage trainer fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded or a stage trained")

    monkeypatch.setattr(demo, "Policy", forbidden)
    monkeypatch.setattr(demo, "_train", forbidden)


@pytest.fixture
def stages(monkeypatch):
    """Stub every stage, recording (stage, the `overwrite` it would pass to its trainer)."""
    calls = []
    for name in demo.STAGES:
        def stage(self, name=name):
            calls.append((name, self.common["overwrite"]))
            return {"methods": {}} if name == "eval" else None
        monkeypatch.setattr(demo.Demo, f"stage_{name}", stage)
    monkeypatch.setattr(demo, "write_plot_and_report", lambda output_dir: [])
    return calls


@pytest.fixture
def previous_run(tmp_path):
    """DIR holding a user's earlier demo: its config.yaml and an SFT run."""
    out = tmp_path / "demo"
    (out / "sft").mkdir(parents=True)
    (out / "config.yaml").write_text("demo: {seed: 1}\n")
    (out / "sft" / "config.yaml").write_text("seed: 1\n")
    (out / "sft" / "model.safetensors").write_bytes(b"weights")
    return out


@pytest.mark.parametrize("extra", [[], ["--from-stage", "prompts"]])
def test_demo_refuses_a_non_empty_output_dir(previous_run, no_models, capsys, extra):
    before = _tree(previous_run)
    assert main(["demo", "--quick", "--output-dir", str(previous_run), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlhfkit: error: ") and str(previous_run) in err[0]
    assert "--overwrite" in err[0] and "--from-stage" in err[0]
    assert _tree(previous_run) == before


def test_demo_refuses_a_directory_holding_anything(tmp_path, no_models, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["demo", "--quick", "--output-dir", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err and os.listdir(out) == ["notes.txt"]


def test_demo_output_dir_under_a_file_is_one_line(tmp_path, no_models, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path / "file" / "demo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file" in err[0]


@pytest.mark.parametrize("make", [False, True])
def test_demo_runs_in_a_new_or_empty_dir_without_replacing_runs(tmp_path, stages, make):
    out = tmp_path / "demo"
    if make:
        out.mkdir()
    assert main(["demo", "--quick", "--output-dir", str(out)]) == 0
    assert stages == [(name, False) for name in demo.STAGES]  # nothing there to replace: the stages refuse to, too


def test_demo_overwrite_replaces_the_previous_demo(previous_run, stages):
    assert main(["demo", "--quick", "--output-dir", str(previous_run), "--overwrite"]) == 0
    assert stages == [(name, True) for name in demo.STAGES]
    assert "quick: true" in (previous_run / "config.yaml").read_text()


@pytest.mark.parametrize("stage", ["sft", "dpo", "eval"])
def test_demo_from_stage_continues_in_a_non_empty_dir(previous_run, stages, stage):
    assert main(["demo", "--quick", "--output-dir", str(previous_run), "--from-stage", stage]) == 0
    assert stages == [(name, True) for name in demo.STAGES[demo.STAGES.index(stage):]]  # the stages it reruns


@pytest.mark.parametrize("extra, with_online_dpo", [([], False), (["--full"], True)])
def test_online_dpo_runs_with_full_only(tmp_path, stages, extra, with_online_dpo):
    """The real demo runs online DPO with --full only (it would take it past its time budget on 2 CPU cores);
    --quick, plumbing, runs every stage."""
    assert main(["demo", "--output-dir", str(tmp_path / "demo"), *extra]) == 0
    want = [s for s in demo.STAGES if with_online_dpo or s != "online_dpo"]
    assert [name for name, _ in stages] == want and len(want) == len(demo.STAGES) - (not with_online_dpo)


def test_from_stage_online_dpo_without_full_is_one_line(previous_run, no_models, capsys):
    before = _tree(previous_run)
    assert main(["demo", "--output-dir", str(previous_run), "--from-stage", "online_dpo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rlhfkit: error: --from-stage online_dpo: that stage runs with --full only"]
    assert _tree(previous_run) == before
