"""Precision that suits the device: `mixed_precision: auto`, frozen models' dtype, the attention implementation."""

import pytest
import torch

from rlhfkit.errors import UserError
from rlhfkit.precision import check_attn_implementation, frozen_model_dtype, resolve_mixed_precision, supports_bf16


@pytest.mark.parametrize("setting, device, bf16, expected", [
    ("auto", "cuda", True, "bf16"),  # Ampere and later
    ("auto", "cuda", False, "no"),  # V100, T4: no native bf16, and fp16 is not chosen behind the user's back
    ("auto", "cpu", True, "no"),
    ("auto", "cpu", False, "no"),
    ("auto", "xpu", True, "bf16"),
    ("fp16", "cuda", True, "fp16"),  # an explicit setting is kept
    ("bf16", "cpu", False, "bf16"),
    ("no", "cuda", True, "no"),
])
def test_resolve_mixed_precision(setting, device, bf16, expected):
    assert resolve_mixed_precision(setting, device, bf16) == expected


def test_cpu_has_no_native_bf16():
    assert supports_bf16(torch.device("cpu")) is False
    assert resolve_mixed_precision("auto", "cpu", supports_bf16(torch.device("cpu"))) == "no"


def test_frozen_models_load_in_the_runs_precision():
    assert frozen_model_dtype("bf16", "float32") == "bfloat16"
    assert frozen_model_dtype("fp16", "float32") == "float16"
    assert frozen_model_dtype("no", "float32") == "float32"
    assert frozen_model_dtype("no", "bfloat16") == "bfloat16"


def test_attn_implementation_is_checked_against_what_is_installed():
    for name in (None, "sdpa", "eager"):
        check_attn_implementation(name)
    with pytest.raises(UserError, match=r"^config key 'model.attn_implementation': must be sdpa, flash_attention_2 or "
                                        r"eager, got 'flash'$"):
        check_attn_implementation("flash")
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        check_attn_implementation("flash_attention_2")
    else:
        with pytest.raises(UserError) as exc:
            check_attn_implementation("flash_attention_2")
        assert str(exc.value) == ("config key 'model.attn_implementation': flash_attention_2 needs a CUDA GPU and the "
                                  "flash-attn package (pip install flash-attn --no-build-isolation); use sdpa here")
