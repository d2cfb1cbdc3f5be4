"""`rlhfkit demo` and `rlhfkit demo --agent` are the pipeline files configs/pipelines/demo.yaml and agent.yaml, run by
one runner (`rlhfkit.tasks.demos`). Checked here without a model: each variant resolves and validates whole, the
stages' effective configs hold the demo's settings, and the demo's output folder follows the pipeline's rules
(a user's files refused before anything runs, one line, nothing written). The real runs: tests/smoke/."""

import os

import pytest

from rlhfkit.cli import main
from rlhfkit.pipeline.runner import Runner
from rlhfkit.pipeline.spec import read_spec
from rlhfkit.tasks.demos import pipeline_file


def _tree(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def _resolved(name, overrides):
    spec = read_spec(pipeline_file(name), ["output_dir=out", *overrides])
    return {r.spec.name: r for r in Runner(spec, plan=False).check_all()}


@pytest.mark.parametrize("overrides, stages", [
    (["vars.base_model=tiny"], ["prompts", "sft_data", "sft", "pairs", "rm", "ppo", "dpo", "eval"]),
    (["vars.base_model=tiny", "vars.full=true"], ["prompts", "sft_data", "sft", "pairs", "rm", "ppo", "online_dpo", "dpo", "eval"]),
    (["variant=quick"], ["prompts", "sft_data", "sft", "pairs", "rm", "ppo", "online_dpo", "dpo", "eval"]),
])
def test_the_demo_file_resolves_whole_in_every_variant(overrides, stages):
    assert list(_resolved("demo", overrides)) == stages


def test_the_demo_stages_hold_the_demos_settings():
    r = _resolved("demo", ["vars.base_model=tiny"])
    sft, rm, ppo, dpo = (r[n].cfg for n in ("sft", "rm", "ppo", "dpo"))
    assert (sft.model.lora.r, sft.model.lora.alpha, sft.optim.lr, sft.num_epochs, sft.data.max_length) == (16, 32, 2e-4, 2.0, 256)
    assert (rm.model.name_or_path, rm.model.num_layers, rm.algo.pooling, rm.algo.head_only, rm.optim.lr) == (
        os.path.join("out", "sft"), 10, "mean", True, 0.01)
    assert ppo.model.name_or_path == os.path.join("out", "sft") and ppo.reward.model == [os.path.join("out", "rm")]
    assert (ppo.algo.value_model, ppo.kl.controller, ppo.kl.target, ppo.optim.lr, ppo.optim.per_device_batch_size) == (
        "out/rm", "adaptive", 4.0, 3e-4, 8)
    assert dpo.model.name_or_path == os.path.join("out", "sft")  # from SFT, not from the PPO policy beside it
    quick = _resolved("demo", ["variant=quick"])
    assert (quick["sft"].cfg.model.name_or_path, quick["ppo"].cfg.max_steps, quick["ppo"].cfg.optim.per_device_batch_size) == (
        "tiny", 2, 4)


def test_the_agent_file_resolves_with_the_agents_settings():
    r = _resolved("agent", ["vars.base_model=tiny"])
    assert list(r) == ["prompts", "sft", "grpo", "eval"]
    sft, grpo = r["sft"].cfg, r["grpo"].cfg
    assert (sft.optim.scheduler, sft.optim.lr, sft.model.chat_template, sft.model.lora.target_modules) == (
        "linear", 1e-3, "chatml_tools", r".*\.layers\.(2[2-9])\.(self_attn|mlp)\.\w+_proj")
    assert grpo.model.name_or_path == os.path.join("out", "sft") and grpo.tools.functions == ["rlhfkit.tasks.agent:multiply"]
    assert (grpo.generation.num_samples, grpo.optim.per_device_batch_size, grpo.optim.scheduler) == (4, 8, "constant")


def test_a_users_files_in_a_stage_folder_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "rm").mkdir(parents=True)
    (out / "rm" / "notes.txt").write_text("keep me")
    before = _tree(out)
    assert main(["demo", "--quick", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stage 'rm'" in err[0] and "holds files the pipeline did not write" in err[0]
    assert _tree(out) == before and sorted(os.listdir(out)) == ["rm"]  # not even the prompts were written


def test_demo_output_dir_under_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path / "file" / "demo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file" in err[0]


def test_from_stage_online_dpo_without_full_is_one_line(tmp_path, capsys):
    """The real demo has online DPO with --full only; --quick (plumbing) runs every stage."""
    assert main(["demo", "--output-dir", str(tmp_path / "d"), "--from-stage", "online_dpo"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no stage named 'online_dpo'" in err[0] and "dpo, eval" in err[0]
    assert not (tmp_path / "d").exists()
