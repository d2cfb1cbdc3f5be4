"""Every bad input named in the foundation issue: exit status 2, one line naming what is wrong, no traceback,
and an existing output_dir left exactly as it was — even with overwrite=true, since nothing is written before the
config, the data and the model have all loaded."""

import hashlib
import os
import subprocess
import sys

import pytest

from rlhfkit.cli import main

BASE = ["sft", "--config", "configs/sft_tiny.yaml", "max_steps=1", "data.eval=null"]


@pytest.fixture
def previous_run(tmp_path):
    """An output_dir holding an earlier run; returns (path, fingerprint function)."""
    out = tmp_path / "previous"
    out.mkdir()
    (out / "config.yaml").write_text("seed: 1\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "model.safetensors").write_bytes(b"weights")

    def fingerprint():
        return {p: hashlib.sha256((out / p).read_bytes()).hexdigest() for p in sorted(os.listdir(out))}

    return str(out), fingerprint


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run_cli(capsys, args):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("rlhfkit: error:")]
    return code, errors, err


GOOD = '{"prompt": "a", "completion": "b"}\n'

# case -> (data file to write or None, overrides (with {file} standing for that file), expected message part)
CASES = {
    "missing file": (None, ["data.train=no/such/file.jsonl"], "no/such/file.jsonl' not found"),
    "malformed json line": (GOOD * 2 + '{"prompt": "a",\n', ["data.train={file}"], "line 3: malformed JSON"),
    "missing field": (GOOD + '{"prompt": "a"}\n', ["data.train={file}"], "record 1: missing field 'completion'"),
    "mistyped field": ('{"prompt": "a", "completion": 5}\n', ["data.train={file}"], "record 0: field 'completion'"),
    "empty dataset": ("", ["data.train={file}"], ": no records"),
    "unknown config key": (None, ["optim.learning_rate=0.1"], "unknown config key 'optim.learning_rate'"),
    "wrong value type": (None, ["optim.per_device_batch_size=big"], "config key 'optim.per_device_batch_size': expected an integer"),
    "model path not found": (None, ["model.name_or_path=./no_such_model"], "model path './no_such_model' not found"),
    "prompt too long": (None, ["data.truncation=error", "data.max_prompt_length=8"], "record 0: prompt is"),
    "nan learning rate": (None, ["optim.lr=.nan"], "config key 'optim.lr': expected a finite number, got nan"),
    "nan max_grad_norm": (None, ["optim.max_grad_norm=.nan"], "config key 'optim.max_grad_norm': expected a finite number, got nan"),
    "infinite epochs": (None, ["max_steps=-1", "num_epochs=.inf"], "config key 'num_epochs': expected a finite number, got inf"),
    "negative seed": (None, ["seed=-1"], "config key 'seed' must be in [0, 2**32), got -1"),
    "lora targets match nothing": (None, ["model.lora.enabled=true", "model.lora.target_modules=[qkv]"],
                                   "config key 'model.lora.target_modules': ['qkv'] matches no module"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_exits_2_with_one_line_and_keeps_output_dir(case, tmp_path, capsys, previous_run):
    out, fingerprint = previous_run
    before = fingerprint()
    content, extra, expected = CASES[case]
    data = write(tmp_path, "data.jsonl", content) if content is not None else ""
    extra = [e.replace("{file}", data) for e in extra]
    code, errors, err = run_cli(capsys, BASE + [f"output_dir={out}", "overwrite=true"] + extra)
    assert code == 2
    assert len(errors) == 1, err
    assert expected in errors[0], errors[0]
    assert not any("Traceback" in line for line in err)
    assert fingerprint() == before


def test_existing_run_is_not_overwritten_without_overwrite(capsys, previous_run):
    out, fingerprint = previous_run
    before = fingerprint()
    code, errors, _ = run_cli(capsys, BASE + [f"output_dir={out}"])
    assert code == 2 and "holds another run" in errors[0] and "overwrite=true" in errors[0]
    assert fingerprint() == before


def test_non_run_directory_is_refused_even_with_overwrite(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, errors, _ = run_cli(capsys, BASE + [f"output_dir={tmp_path}", "overwrite=true"])
    assert code == 2 and "holds no rlhfkit run" in errors[0]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resume_without_checkpoint(tmp_path, capsys):
    code, errors, _ = run_cli(capsys, BASE + [f"output_dir={tmp_path / 'new'}", "resume=true"])
    assert code == 2 and "holds no complete checkpoint" in errors[0]


def test_console_script_prints_no_traceback(tmp_path):
    """The installed entry point, in a fresh process: status 2 and a single stderr line."""
    bad = write(tmp_path, "bad.jsonl", '{"prompt": 1}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "rlhfkit.cli", *BASE, f"data.train={bad}", f"output_dir={tmp_path / 'o'}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("rlhfkit: error:")]
    assert len(lines) == 1 and "bad.jsonl record 0" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


# config file text -> expected message part
CONFIG_FILES = {
    "not utf-8": ("model:\n  name_or_path: tiny\n# caf\xe9\n".encode("latin-1"), "line 3: not UTF-8 text"),
    "duplicate key": (b"optim:\n  lr: 0.001\n  warmup_steps: 1\n  lr: 0.1\n", "line 4: duplicate key 'optim.lr' (first given on line 2)"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_FILES))
def test_bad_config_file_exits_2_naming_the_file(case, tmp_path, capsys, previous_run):
    out, fingerprint = previous_run
    before = fingerprint()
    text, expected = CONFIG_FILES[case]
    config = tmp_path / "config.yaml"
    config.write_bytes(text)
    code, errors, err = run_cli(capsys, ["sft", "--config", str(config), "data.train=x.jsonl", f"output_dir={out}", "overwrite=true"])
    assert code == 2
    assert len(errors) == 1, err
    assert f"config file '{config}' {expected}" in errors[0], errors[0]
    assert fingerprint() == before


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to resolve (hence load) a model fails the test: the error must come before."""
    import rlhfkit.models

    def refuse(cfg):
        raise AssertionError(f"a model was loaded ({cfg.name_or_path}) before the output_dir check")

    monkeypatch.setattr(rlhfkit.models, "resolve_model_path", refuse)


@pytest.mark.parametrize("stage", ["sft", "eval"])
def test_output_dir_under_a_file_fails_before_any_model_loads(stage, tmp_path, capsys, no_model_loads):
    afile = tmp_path / "somefile"
    afile.write_text("mine")
    args = BASE if stage == "sft" else ["eval", "--config", "configs/eval_tiny.yaml"]
    code, errors, err = run_cli(capsys, args + [f"output_dir={afile}/run"])
    assert code == 2 and len(errors) == 1, err
    assert f"output_dir '{afile}/run'" in errors[0] and f"'{afile}' is a file" in errors[0], errors[0]
    assert afile.read_text() == "mine" and os.listdir(tmp_path) == ["somefile"]


@pytest.mark.parametrize("stage", ["sft", "eval"])
def test_unwritable_output_dir_fails_before_any_model_loads(stage, tmp_path, capsys, monkeypatch, no_model_loads):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    # Root may write anywhere, so the read-only directory is simulated where the check asks.
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.path.abspath(p) == str(locked) and mode & os.W_OK
                        else real_access(p, mode, **kw))
    args = BASE if stage == "sft" else ["eval", "--config", "configs/eval_tiny.yaml"]
    code, errors, err = run_cli(capsys, args + [f"output_dir={locked}/run/x"])
    assert code == 2 and len(errors) == 1, err
    assert f"output_dir '{locked}/run/x' is not writable" in errors[0] and f"'{locked}'" in errors[0], errors[0]
    assert os.listdir(locked) == []


@pytest.fixture(scope="module")
def causal_lm_dir(tmp_path_factory):
    """A causal LM (no score head) where a reward model is expected."""
    from rlhfkit.model_sources import build_tiny_model

    path = str(tmp_path_factory.mktemp("causal") / "lm")
    build_tiny_model(path)
    return path


PPO = ["ppo", "--config", "configs/ppo_tiny.yaml", "max_steps=1", "logging.progress_bar=false"]
NO_HEAD = "holds no trained score head ('score.weight' is not in its weights: a causal LM, not a reward model saved by `rlhfkit rm`)"


@pytest.mark.parametrize("stage", ["ppo", "rft", "eval"])
def test_causal_lm_as_reward_model_is_refused(stage, tmp_path, capsys, causal_lm_dir):
    args = {"ppo": PPO + ["reward.function=null"], "rft": ["rft", "--config", "configs/rft_tiny.yaml", "reward.function=null"],
            "eval": ["eval", "--config", "configs/eval_tiny.yaml"]}[stage]
    out = tmp_path / "out"
    code, errors, err = run_cli(capsys, args + [f"reward.model=[{causal_lm_dir}]", f"output_dir={out}"])
    assert code == 2 and len(errors) == 1, err
    assert f"config key 'reward.model': '{causal_lm_dir}' {NO_HEAD}" in errors[0], errors[0]
    assert not out.exists()


def test_causal_lm_as_critic_needs_the_explicit_switch(tmp_path, capsys, causal_lm_dir):
    out = tmp_path / "out"
    code, errors, err = run_cli(capsys, PPO + [f"algo.value_model={causal_lm_dir}", f"output_dir={out}"])
    assert code == 2 and len(errors) == 1, err
    assert f"config key 'algo.value_model': '{causal_lm_dir}' {NO_HEAD}" in errors[0], errors[0]
    assert "algo.allow_new_value_head=true" in errors[0]
    assert not out.exists()
    # Asked for explicitly, the critic starts from the causal LM with a new value head.
    assert main(PPO + [f"algo.value_model={causal_lm_dir}", "algo.allow_new_value_head=true", f"output_dir={out}"]) == 0
    assert os.path.isfile(out / "model.safetensors")


@pytest.mark.parametrize("stage,key", [("online_dpo", "algo.ref_model"), ("ppo", "algo.value_model"),
                                       ("dpo", "algo.ref_model"), ("ppo", "reward.model")])
def test_a_missing_model_directory_is_named_before_any_data_is_read(stage, key, tmp_path, capsys):
    """Every model path is checked before the data is read: the broken data file would be reported first otherwise."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{not json\n')
    config = {"online_dpo": "online_dpo_tiny", "ppo": "ppo_tiny", "dpo": "dpo_tiny"}[stage]
    code = main([stage, "--config", f"configs/{config}.yaml", f"output_dir={tmp_path / 'run'}", f"data.train={bad}",
                 f"{key}={tmp_path / 'no_such_model'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = [x for x in err.splitlines() if x.startswith("rlhfkit: error:")]
    assert len(line) == 1 and key in line[0] and "no_such_model" in line[0] and "bad.jsonl" not in line[0], err
