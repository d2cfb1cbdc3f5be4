"""QLoRA on the tiny model with bitsandbytes' own 4-bit layers (its CPU backend here): the policy (SFT, DPO,
PPO), the reference (the policy's base with adapters disabled) and the reward model (trained with LoRA, then frozen
in 4 bits to score PPO's samples), the merged export, and the refusals through the CLI."""

import json
import os
import sys
import types

import pytest
import torch

from rlhfkit.cli import main
from rlhfkit.config import LoraConfig, ModelConfig, QuantizationConfig, bitsandbytes_problem
from rlhfkit.models import load_causal_lm, load_tokenizer, save_model

PROBLEM = bitsandbytes_problem()
needs_bnb = pytest.mark.skipif(PROBLEM is not None, reason=f"bitsandbytes 4-bit cannot run here: {PROBLEM}")
FOUR_BIT = ["model.lora.enabled=true", "model.quantization.load_in_4bit=true", "logging.progress_bar=false"]


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def linear4bit():
    import bitsandbytes as bnb

    return bnb.nn.Linear4bit


@needs_bnb
def test_four_bit_policy_holds_linear4bit_layers_and_less_memory():
    lora = LoraConfig(enabled=True, dropout=0.0)
    cfg = ModelConfig(name_or_path="tiny", lora=lora, quantization=QuantizationConfig(load_in_4bit=True))
    tokenizer = load_tokenizer(cfg)
    policy = load_causal_lm(cfg, tokenizer)
    full = load_causal_lm(ModelConfig(name_or_path="tiny"), tokenizer, trainable=False)
    layers = [m for m in policy.modules() if isinstance(m, linear4bit())]
    linear = [m for m in full.model.modules() if isinstance(m, torch.nn.Linear)]  # the LM head is not quantized
    assert len(layers) == len(linear) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(m.weight.dtype == torch.uint8 for m in layers)  # two 4-bit weights per byte
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 14 and all("lora_" in n for n in trained)  # the adapters, nothing else
    # The linear weights take an eighth of their fp32 bytes (plus small per-block constants).
    assert sum(m.weight.numel() for m in layers) == sum(m.weight.numel() * 4 for m in linear) // 8
    frozen = load_causal_lm(cfg, tokenizer, trainable=False)  # the same weights without adapters (a reference)
    assert frozen.get_memory_footprint() < 0.3 * full.get_memory_footprint()  # embeddings and head stay in fp32


def qlora_policy():
    """(cfg, tokenizer, policy, input ids): the tiny model on a 4-bit base with seeded non-zero adapters (LoRA's B
    starts at zero, which would make the adapters invisible)."""
    torch.manual_seed(0)  # LoRA's A matrices start random
    cfg = ModelConfig(name_or_path="tiny", lora=LoraConfig(enabled=True, dropout=0.0),
                      quantization=QuantizationConfig(load_in_4bit=True))
    tokenizer = load_tokenizer(cfg)
    policy = load_causal_lm(cfg, tokenizer)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return cfg, tokenizer, policy, torch.randint(3, 60, (2, 12), generator=g)


@needs_bnb
def test_merged_export_is_the_trained_model_in_full_precision(tmp_path):
    """The adapters merged into the dequantized base: a plain fp32 model (no bitsandbytes to load it) computing what
    the 4-bit model with adapters computed; the 4-bit model itself is left as it was."""
    from transformers import AutoModelForCausalLM

    cfg, tokenizer, policy, ids = qlora_policy()
    policy.eval()
    with torch.no_grad():
        before = policy(ids).logits
    save_model(policy, tokenizer, str(tmp_path / "merged"))
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any(isinstance(m, linear4bit()) for m in merged.modules())
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, before, atol=1e-5)
        assert torch.equal(policy(ids).logits, before)
        assert (merged(ids).logits - load_causal_lm(cfg, tokenizer, trainable=False)(ids).logits).abs().max() > 0.01


@needs_bnb
def test_sampling_forward_leaves_training_gradients_alone():
    """An eval-mode forward without grad (as sampling and scoring run) changes neither the outputs nor the adapters'
    gradients of the next training step (bitsandbytes' CPU repacking would: `models._keep_cpu_layout`)."""
    def gradients(sample_first: bool):
        _, _, policy, ids = qlora_policy()
        if sample_first:
            policy.eval()
            with torch.no_grad():
                policy(ids)
        policy.train()
        policy(ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}

    fresh, after_sampling = gradients(False), gradients(True)
    assert fresh.keys() == after_sampling.keys()
    for name in fresh:
        assert torch.equal(fresh[name], after_sampling[name]), name


@needs_bnb
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_sft_on_a_four_bit_base_learns(checkpointing, tmp_path):
    out = tmp_path / "sft"
    assert main(["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={out}", "max_steps=30", "optim.lr=1e-2",
                 "logging.eval_steps=30", f"model.gradient_checkpointing={str(checkpointing).lower()}", *FOUR_BIT]) == 0
    train = [r["loss"] for r in rows(out) if "loss" in r]
    assert train[-1] < 0.9 * train[0], train
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # the merged full-precision model


@needs_bnb
def test_dpo_reference_is_the_four_bit_base_with_adapters_off(tmp_path):
    """At lr = 0 the adapters stay zero: policy and reference (the same 4-bit base) agree, so the loss is log 2."""
    out = tmp_path / "dpo"
    assert main(["dpo", "--config", "configs/dpo_tiny.yaml", f"output_dir={out}", "max_steps=2", "optim.lr=0",
                 "data.eval=null", "logging.logging_steps=1", *FOUR_BIT]) == 0
    for row in rows(out):
        assert row["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)


@needs_bnb
def test_ppo_with_four_bit_policy_and_four_bit_reward_model(tmp_path, monkeypatch):
    """A reward model trained with LoRA on a 4-bit base scores PPO's samples frozen in 4 bits; the policy, the
    reference and the critic share one 4-bit base. At lr = 0 with non-zero adapters, sampling (eval mode, no grad)
    and the update forwards see the same model (ratio 1) and the reference differs from the policy (KL off 0)."""
    import rlhfkit.rewards
    from transformers import TrainerCallback

    from rlhfkit.stages import run_stage

    rm = tmp_path / "rm"
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={rm}", "max_steps=2", "data.eval=null", *FOUR_BIT]) == 0

    loaded = []
    load_reward_model = rlhfkit.rewards.load_reward_model
    monkeypatch.setattr(rlhfkit.rewards, "load_reward_model",
                        lambda *a, **k: loaded.append(load_reward_model(*a, **k)) or loaded[-1])

    class NonzeroAdapters(TrainerCallback):  # LoRA B starts at zero: perturb it, so the policy differs from its base
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name and ".default." in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    out = tmp_path / "ppo"
    run_stage("ppo", "configs/ppo_tiny.yaml", [
        f"output_dir={out}", "max_steps=2", "optim.lr=0", "reward.function=null", f"reward.model=[{rm}]",
        "reward.quantization.load_in_4bit=true", "algo.rollout_batch_size=4", "optim.per_device_batch_size=4",
        "algo.num_minibatches=1", "algo.ppo_epochs=2", *FOUR_BIT], callbacks=[NonzeroAdapters()])
    assert len(loaded) == 1 and any(isinstance(m, linear4bit()) for m in loaded[0].modules())
    for row in rows(out):
        assert row["val/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert row["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-10)
        assert abs(row["objective/kl"]) > 0.01  # the reference is the base: adapters off
        assert row["objective/scores"] == row["objective/scores"]  # finite scores from the 4-bit reward model


def run_cli(capsys, args):
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if line.startswith("rlhfkit: error:")], err


@pytest.mark.parametrize("case", ["full fine-tuning", "bitsandbytes missing"])
def test_refusals_exit_2_with_one_line(case, tmp_path, capsys, monkeypatch):
    args = ["sft", "--config", "configs/sft_tiny.yaml", f"output_dir={tmp_path / 'out'}", "max_steps=1",
            "model.quantization.load_in_4bit=true"]
    if case == "full fine-tuning":
        # bitsandbytes as a machine where it runs sees it: the refusal is the config's rule, not this machine's
        bnb = types.ModuleType("bitsandbytes")
        bnb.__version__, bnb.supported_torch_devices = "0.50.2", {"cuda" if torch.cuda.is_available() else "cpu"}
        monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
        expected = "config key 'model.quantization.load_in_4bit' needs model.lora.enabled=true"
    else:
        monkeypatch.setitem(sys.modules, "bitsandbytes", None)
        args.append("model.lora.enabled=true")
        expected = "pip install 'rlhfkit[qlora]'"
    code, errors, err = run_cli(capsys, args)
    assert code == 2
    assert len(errors) == 1 and expected in errors[0], err
    assert not any("Traceback" in line for line in err)
    assert not (tmp_path / "out").exists()
