"""The end of a run through the real CLI: its model card, the push to a stand-in for the hub (no network), and the
precision and attention settings the models load with."""

import json
import os
import subprocess
import sys

from huggingface_hub import ModelCard
from transformers import TrainerCallback

from rlhfkit.objects import Objects
from rlhfkit.config import SFTConfig, load_config
from rlhfkit.trainers.sft import SFTTrainer

FAST = ["logging.progress_bar=false", "logging.logging_steps=1"]


def test_reward_model_run_gets_its_card_and_is_pushed_with_its_checkpoints_to_the_stand_in(tmp_path):
    out, log = tmp_path / "rm", tmp_path / "hub.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(PYTHONPATH=os.getcwd(), RLHFKIT_HUB_API="tests.smoke.hub_standin:StandInApi", HUB_STANDIN_LOG=str(log))
    cmd = [sys.executable, "-m", "rlhfkit.cli", "rm", "--config", "configs/rm_tiny.yaml", f"output_dir={out}", *FAST,
           "max_steps=4", "logging.eval_steps=2", "logging.save_steps=2", "logging.push_to_hub=true",
           "logging.hub_model_id=me/tiny-rm", "logging.hub_strategy=checkpoint"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    card = ModelCard.load(out / "README.md")
    meta = card.data.to_dict()
    assert meta["library_name"] == "rlhfkit" and meta["tags"][:2] == ["rlhfkit", "rm"]
    assert meta["pipeline_tag"] == "text-classification"
    last_eval = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in line][-1]
    assert f"| `eval/accuracy` | {last_eval['eval/accuracy']:.4g} |" in card.text and "## Reading the score" in card.text
    assert json.loads((out / "config.json").read_text())["rlhfkit_score"].startswith("rlhfkit score (pooling=")

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    uploads = [c for c in calls if c["call"] == "upload_folder"]
    assert {c["repo_id"] for c in calls} == {"me/tiny-rm"} and calls[0]["call"] == "create_repo"
    assert [(u["folder"], u["path_in_repo"]) for u in uploads] == [("checkpoint-2", "last-checkpoint"), ("rm", None)]
    final = uploads[-1]["files"]
    assert {"README.md", "config.json", "model.safetensors", "config.yaml", "metrics.jsonl"} <= set(final)
    assert not any(f.startswith("checkpoint-") for f in final)


class SeesModel(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kw):
        self.attn = model.config._attn_implementation


def test_auto_precision_on_cpu_and_the_attention_implementation_reach_the_model(tmp_path, caplog):
    cfg = load_config(SFTConfig, "configs/sft_tiny.yaml", [f"output_dir={tmp_path / 'run'}", "max_steps=1", *FAST,
                                                           "model.attn_implementation=eager"])
    assert cfg.mixed_precision == "auto"  # the default
    seen = SeesModel()
    trainer = SFTTrainer(cfg, Objects(callbacks=(seen,)))
    with caplog.at_level("INFO", logger="rlhfkit"):
        trainer.fit()
    assert trainer.run.mixed_precision == "no"  # no mixed precision on a CPU
    assert any("mixed precision no" in r.getMessage() for r in caplog.records)
    assert seen.attn == "eager"


def test_a_separate_reference_loads_in_the_runs_precision(tmp_path):
    # accelerate fixes the mixed precision once per process: this run gets a process of its own.
    script = f"""
import torch
from rlhfkit.config import DPOConfig, load_config
from rlhfkit.trainers.preference import PreferenceTrainer
cfg = load_config(DPOConfig, "configs/dpo_tiny.yaml", ["output_dir={tmp_path / 'run'}", "max_steps=1", *{FAST!r},
                                                      "mixed_precision=bf16", "algo.ref_model=tiny"])
trainer = PreferenceTrainer(cfg)
trainer.fit()
print("DTYPES", next(trainer.reference.model.parameters()).dtype, next(trainer.run.unwrap(trainer.model).parameters()).dtype)
"""
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.getcwd()},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the frozen reference in bf16, the trained policy in fp32
    assert "DTYPES torch.bfloat16 torch.float32" in done.stdout


def test_flash_attention_is_refused_before_any_model_loads_where_it_cannot_run(tmp_path, capsys):
    from rlhfkit.cli import main

    out = tmp_path / "run"
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}",
                 "model.attn_implementation=flash_attention_2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "config key 'model.attn_implementation': flash_attention_2 needs a CUDA GPU and the flash-attn package (pip "
        "install flash-attn --no-build-isolation); use sdpa here")
    assert not out.exists()


def _errors(capsys):
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.startswith("rlhfkit: error:")], err


def test_a_lora_run_saving_only_its_adapter_gets_an_rlhfkit_card(tmp_path):
    from rlhfkit.cli import main

    out = tmp_path / "sft"
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", *FAST, "max_steps=1",
                 "model.lora.enabled=true", "model.lora.merge_on_save=false"]) == 0
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    meta = ModelCard.load(out / "README.md").data.to_dict()
    assert meta["library_name"] == "rlhfkit" and {"rlhfkit", "sft", "peft", "lora"} <= set(meta["tags"])


def test_online_dpo_card_names_its_stage_and_method(tmp_path):
    from rlhfkit.cli import main

    out = tmp_path / "odpo"
    assert main(["online_dpo", "--config", "configs/online_dpo_tiny.yaml", f"output_dir={out}", *FAST, "max_steps=1"]) == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.to_dict()["tags"][:2] == ["rlhfkit", "online_dpo"]
    assert "(`rlhfkit online_dpo`): online DPO" in card.text


def _pushing_sft(tmp_path, monkeypatch, capsys, standin: str, extra: list[str]):
    """An sft run pushing to `me/tiny` through the stand-in `standin` (online, as far as the run can tell): its
    output directory, exit status and error lines."""
    from rlhfkit.cli import main

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("RLHFKIT_HUB_API", f"tests.smoke.hub_standin:{standin}")
    monkeypatch.setenv("HUB_STANDIN_LOG", str(tmp_path / "hub.jsonl"))
    out = tmp_path / "sft"
    code = main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", *FAST, *extra,
                 "logging.push_to_hub=true", "logging.hub_model_id=me/tiny"])
    errors, err = _errors(capsys)
    assert "Traceback" not in err, err
    return out, code, errors


def test_a_failed_upload_at_the_end_is_one_line_and_keeps_the_saved_model(tmp_path, monkeypatch, capsys):
    out, code, errors = _pushing_sft(tmp_path, monkeypatch, capsys, "UploadFails",
                                     ["max_steps=2", "logging.save_steps=1", "logging.hub_strategy=checkpoint"])
    assert code == 2 and len(errors) == 1, errors
    # The checkpoint's failed push was a warning: the run went on to its end.
    assert (out / "checkpoint-1" / "trainer_state.pt").is_file()
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 2
    assert errors[0] == (f"rlhfkit: error: logging.push_to_hub: the upload of {out} to 'me/tiny' failed (ConnectionError: "
                         f"connection reset by peer); the trained model is saved there: upload it with "
                         f"`hf upload me/tiny {out}`")
    assert (out / "model.safetensors").is_file() and (out / "README.md").is_file()


def test_a_repo_that_cannot_be_created_is_refused_before_training(tmp_path, monkeypatch, capsys):
    """As transformers' Trainer creates the repo at its start: a token without write access fails in seconds."""
    out, code, errors = _pushing_sft(tmp_path, monkeypatch, capsys, "NoWriteAccess", ["max_steps=1"])
    assert code == 2 and len(errors) == 1, errors
    assert errors[0] == ("rlhfkit: error: config key 'logging.hub_model_id': cannot create the repo 'me/tiny' "
                         "(PermissionError: 403 Forbidden: you cannot create me/tiny)")
    assert not (out / "metrics.jsonl").exists()


def test_a_resumed_lora_run_replaces_the_adapter_beside_its_merged_model(tmp_path):
    """The final directory's adapter/ is a directory: writing the final model again (a finished run resumed for more
    steps) replaces it rather than failing on a non-empty destination."""
    from safetensors.torch import load_file

    from rlhfkit.cli import main

    out = tmp_path / "sft"
    args = ["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", *FAST, "model.lora.enabled=true",
            "logging.save_steps=1", "data.eval=null"]
    assert main(args + ["max_steps=2"]) == 0
    first = load_file(out / "adapter" / "adapter_model.safetensors")
    assert main(args + ["max_steps=3", "resume=true"]) == 0
    again = load_file(out / "adapter" / "adapter_model.safetensors")
    assert first.keys() == again.keys() and any(not (first[k] == again[k]).all() for k in first)  # step 3's adapter
