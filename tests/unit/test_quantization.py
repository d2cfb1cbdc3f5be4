"""QLoRA's config plumbing (model.quantization, reward.quantization), without running bitsandbytes: the
BitsAndBytesConfig built from the config, the rules that refuse a 4-bit base where it cannot work, and the one-line
refusals when bitsandbytes is missing or cannot run on this machine."""

import sys
import types

import pytest
import torch

from rlhfkit.config import EvalConfig, QuantizationConfig, RMConfig, SFTConfig, load_config
from rlhfkit.errors import ConfigError
from rlhfkit.models import bnb_config

SFT = ["data.train=x.jsonl", "output_dir=out", "model.name_or_path=tiny"]
FOUR_BIT = ["model.quantization.load_in_4bit=true"]


@pytest.fixture
def bitsandbytes_runs(monkeypatch):
    """The environment checks pass, whatever this machine has: the rules of the config alone are tested. The check reads
    bitsandbytes' public `__version__` and `supported_torch_devices`; a stand-in module supplies a version that runs
    on this machine's device, in one process."""
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake_bitsandbytes())
    for engine in ("FSDP", "DEEPSPEED"):
        monkeypatch.delenv(f"ACCELERATE_USE_{engine}", raising=False)


def fake_bitsandbytes(version="0.50.2"):
    module = types.ModuleType("bitsandbytes")
    module.__version__ = version
    module.supported_torch_devices = {"cuda" if torch.cuda.is_available() else "cpu"}
    return module


def test_bnb_config_carries_every_field():
    q = bnb_config(QuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype="bfloat16",
                                      bnb_4bit_use_double_quant=False))
    assert (q.load_in_4bit, q.load_in_8bit) == (True, False)
    assert q.bnb_4bit_quant_type == "fp4"
    assert q.bnb_4bit_compute_dtype is torch.bfloat16
    assert q.bnb_4bit_use_double_quant is False


def test_bnb_config_defaults_are_the_qlora_papers():
    q = bnb_config(QuantizationConfig(load_in_4bit=True))
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_compute_dtype, q.bnb_4bit_use_double_quant) == ("nf4", torch.float32, True)
    assert bnb_config(QuantizationConfig()) is None  # not quantized: no quantization_config at all


def test_four_bit_training_needs_lora(bitsandbytes_runs):
    with pytest.raises(ConfigError, match=r"'model.quantization.load_in_4bit' needs model.lora.enabled=true"):
        load_config(SFTConfig, overrides=SFT + FOUR_BIT)
    cfg = load_config(SFTConfig, overrides=SFT + FOUR_BIT + ["model.lora.enabled=true", "model.quantization.bnb_4bit_quant_type=fp4"])
    assert cfg.model.quantization == QuantizationConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4")


def test_reward_head_only_probe_refuses_a_four_bit_base(bitsandbytes_runs):
    with pytest.raises(ConfigError, match=r"'algo.head_only' and model.quantization.load_in_4bit are exclusive"):
        load_config(RMConfig, overrides=SFT + FOUR_BIT + ["model.lora.enabled=true", "algo.head_only=true"])


def test_eval_takes_four_bit_models_without_lora(bitsandbytes_runs):
    """Inference only: the evaluated policy, its reference and the reward-model judges may all be 4-bit."""
    cfg = load_config(EvalConfig, overrides=["model.name_or_path=tiny", "data.eval=x.jsonl", "output_dir=out", *FOUR_BIT,
                                             "reward.quantization.load_in_4bit=true"])
    assert cfg.model.quantization.load_in_4bit and cfg.reward.quantization.load_in_4bit


def test_unknown_quant_type_names_the_key():
    with pytest.raises(ConfigError, match=r"'model.quantization.bnb_4bit_quant_type': expected one of 'nf4', 'fp4'"):
        load_config(SFTConfig, overrides=SFT + ["model.quantization.bnb_4bit_quant_type=int4"])


def test_missing_bitsandbytes_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    with pytest.raises(ConfigError) as info:
        load_config(SFTConfig, overrides=SFT + FOUR_BIT + ["model.lora.enabled=true"])
    assert str(info.value) == ("config key 'model.quantization.load_in_4bit' needs bitsandbytes, which is not installed: "
                               "pip install 'rlhfkit[qlora]'")
    with pytest.raises(ConfigError, match=r"'reward.quantization.load_in_4bit' needs bitsandbytes"):
        load_config(EvalConfig, overrides=["model.name_or_path=tiny", "data.eval=x.jsonl", "output_dir=out",
                                           "reward.quantization.load_in_4bit=true"])


def test_no_check_of_bitsandbytes_without_four_bit(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert not load_config(SFTConfig, overrides=SFT).model.quantization.load_in_4bit


def test_unsupported_device_and_sharded_launch_are_refused(monkeypatch):
    bnb = pytest.importorskip("bitsandbytes")
    args = SFT + FOUR_BIT + ["model.lora.enabled=true"]
    here = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(bnb, "supported_torch_devices", {"hpu"})
    with pytest.raises(ConfigError, match=rf"'model.quantization.load_in_4bit' is not supported on this machine: "
                                          rf"bitsandbytes .* runs 4-bit layers on hpu, not {here}"):
        load_config(SFTConfig, overrides=args)
    monkeypatch.setattr(bnb, "supported_torch_devices", {here})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"works with one process or DDP, not FSDP or DeepSpeed"):
        load_config(SFTConfig, overrides=args)
    monkeypatch.setattr(bnb, "__version__", "0.45.5")
    with pytest.raises(ConfigError, match=r"needs bitsandbytes >= 0.46.1, found 0.45.5"):
        load_config(SFTConfig, overrides=args)
