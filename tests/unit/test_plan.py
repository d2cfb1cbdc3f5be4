"""`rlhfkit plan`: sizes hand-computed from a Llama-style config.json (no weights present), the CLI's one-line
refusals, suggestions that are the planner's own re-plans, and the Python API."""

import json
import os
import subprocess
import sys
import time

import pytest

import rlhfkit
from rlhfkit.errors import UserError
from rlhfkit.plan import GB, plan_for
from rlhfkit.plan.layout import with_changes
from rlhfkit.stages import build_stage_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32, "num_hidden_layers": 32,
            "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Llama-2-7B's parameter count: embeddings and head 2·V·H, per layer 4·H² (attention) + 3·H·I (MLP) + 2·H (norms),
# the final norm H.
PARAMS_7B = 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096


def write_model(tmp_path, config: dict, name: str = "llama7b") -> str:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "rlhfkit.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_7b_ppo_from_config_json_alone_in_seconds(tmp_path):
    model = write_model(tmp_path, LLAMA_7B)
    assert not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(model))
    t0 = time.time()
    out = cli("ppo", f"model.name_or_path={model}", f"reward.model=[{model}]", "model.dtype=bfloat16",
              "--device", "H100-80GB", "--json")
    elapsed = time.time() - t0
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert elapsed < 30  # a subprocess on a loaded 2-core machine; the planning itself takes well under a second
    update = plan["phases"]["update"]["parts_gb"]
    assert update["weights/policy"] == pytest.approx(PARAMS_7B * 2 / GB)
    assert update["weights/reference"] == pytest.approx(PARAMS_7B * 2 / GB)
    # A reward model and the critic initialised from it: sequence classifiers, one output instead of the LM head.
    score_params = PARAMS_7B - 32000 * 4096 + 4096
    assert update["weights/reward"] == pytest.approx(score_params * 2 / GB)
    assert update["weights/critic"] == pytest.approx(score_params * 2 / GB)
    assert update["optimizer"] == pytest.approx(2 * (PARAMS_7B + score_params) * 2 / GB)  # AdamW's two moments, bf16
    assert plan["fits"] is False and plan["peak_gb"] > 80
    assert plan["suggestions"] and plan["suggestions"][0]["saves_gb"] >= plan["suggestions"][-1]["saves_gb"]


def test_kv_cache_and_logits_sizes(tmp_path):
    """The generation phase's KV cache: 2 (K and V) · layers · rows · kv_heads · head_dim · (prompt + response) ·
    bytes; the update's logits: rows · (response + 1) · V · (two fp32 copies + two in the compute dtype)."""
    model = write_model(tmp_path, LLAMA_7B)
    cfg = build_stage_config("grpo", {"model": {"name_or_path": model, "dtype": "bfloat16"}, "data": {
        "train": "x", "max_prompt_length": 100}, "output_dir": "x", "reward": {"function": "m:f"},
        "generation": {"max_new_tokens": 28, "num_samples": 4}, "algo": {"rollout_batch_size": 2},
        "optim": {"per_device_batch_size": 2}})
    plan = plan_for("grpo", cfg, device="H100")
    gen = next(ph for ph in plan.phases if ph.name == "generation").parts
    assert gen["kv cache"] == 2 * 32 * 8 * 32 * 128 * 128 * 2
    from rlhfkit.plan.layout import Forward
    from rlhfkit.plan.memory import Precision, logits_bytes
    from rlhfkit.plan.shape import load_shape

    # The update's logits at the backward's start: the fp32 copy, its gradient rows and the bf16 logits' gradient.
    shape = load_shape(model, "model")
    assert logits_bytes(shape, Forward(2, 128, 29, True), Precision(2, 2, 2, True)) == 2 * 29 * 32000 * (8 + 2 * 2)


def test_suggestions_are_replans(tmp_path):
    model = write_model(tmp_path, LLAMA_7B)
    cfg = build_stage_config("dpo", {"model": {"name_or_path": model}, "data": {"train": "x", "max_length": 512, "max_prompt_length": 256},
                                     "output_dir": "x"})
    plan = plan_for("dpo", cfg, device="A100-40GB")
    assert plan.fits is False
    for s in plan.suggestions:
        if s.processes is None:
            again = plan_for("dpo", with_changes(cfg, s.changes), device="A100-40GB", suggest=False)
            assert s.peak_gb == pytest.approx(again.peak_gb)
            assert s.saves_gb == pytest.approx(plan.peak_gb - again.peak_gb)
    assert [s.saves_gb for s in plan.suggestions] == sorted((s.saves_gb for s in plan.suggestions), reverse=True)


def test_python_api_tiny_without_device():
    plan = rlhfkit.plan("sft", overrides={"model.name_or_path": "tiny", "data.max_length": 64, "data.max_prompt_length": 32})
    assert plan.fits is None and plan.device is None and plan.seconds_per_step is None
    assert plan.peak_gb > 0 and [ph.name for ph in plan.phases] == ["update"]
    json.dumps(plan.to_dict())
    with_memory = rlhfkit.plan("sft", overrides={"model.name_or_path": "tiny"}, memory_gb=0.001)
    assert with_memory.fits is False


def test_refusals_one_line(tmp_path):
    gpt2 = write_model(tmp_path, {"model_type": "gpt2", "n_embd": 768}, "gpt2")
    out = cli("sft", f"model.name_or_path={gpt2}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "'gpt2'" in out.stderr and "llama, mistral, qwen2, qwen3" in out.stderr
    model = write_model(tmp_path, LLAMA_7B)
    out = cli("sft", f"model.name_or_path={model}", "--device", "TPU-v9")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "H100-80GB" in out.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    out = cli("sft", f"model.name_or_path={broken}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "config.json" in out.stderr


def test_unknown_stage_refused():
    with pytest.raises(UserError, match="unknown stage 'eval'"):
        rlhfkit.plan("eval", overrides={"model.name_or_path": "tiny"})


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "orpo", "kto", "ppo", "rloo", "grpo", "reinforce_pp",
                                   "online_dpo", "rft"])
def test_every_stage_plans_its_shipped_tiny_config(stage):
    plan = rlhfkit.plan(stage, config=os.path.join(ROOT, "configs", f"{stage}_tiny.yaml"), device="L4")
    names = [ph.name for ph in plan.phases]
    assert names == (["generation", "update"] if stage in ("ppo", "rloo", "grpo", "reinforce_pp", "online_dpo", "rft")
                     else ["update"])
    assert plan.fits is True and plan.peak_gb > 0 and plan.seconds_per_step > 0
    assert plan.peak_gb == pytest.approx(max(ph.total for ph in plan.phases) / GB)


def test_a_gpu_is_found_in_the_table_by_its_reported_name():
    from rlhfkit.plan.devices import device_matching

    assert device_matching("NVIDIA H100 80GB HBM3", 79.1).name == "H100-80GB"
    assert device_matching("NVIDIA A100-SXM4-40GB", 39.4).name == "A100-40GB"
    assert device_matching("NVIDIA A100-SXM4-80GB", 79.2).name == "A100-80GB"
    assert device_matching("NVIDIA GeForce RTX 4090", 23.6).name == "RTX-4090"
    assert device_matching("NVIDIA L4", 22.0).name == "L4"
    assert device_matching("NVIDIA L40S", 44.4) is None and device_matching("NVIDIA H200", 139.8).name == "H200-141GB"
