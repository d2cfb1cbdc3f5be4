"""Precision and attention that suit the device: `mixed_precision: auto`, the dtype of frozen models, and a check of
`model.attn_implementation` against what is installed."""

from __future__ import annotations

import torch

from rlhfkit.errors import UserError


def resolve_mixed_precision(setting: str, device_type: str, bf16_supported: bool) -> str:
    """The mixed precision a run uses: `setting` itself unless it is "auto", which is "bf16" on an accelerator that
    computes in bf16 natively (`supports_bf16`) and "no" elsewhere: on a CPU, and on a GPU without bf16, where fp16
    would bring a loss scaler and its skipped steps that the user did not ask for."""
    if setting != "auto":
        return setting
    return "bf16" if device_type != "cpu" and bf16_supported else "no"


def supports_bf16(device: torch.device) -> bool:
    """Whether `device` computes in bf16 natively (CUDA from Ampere on, XPU); emulated bf16 does not count."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "xpu":
        return torch.xpu.is_bf16_supported()
    return False


def frozen_model_dtype(mixed_precision: str, model_dtype: str) -> str:
    """The dtype a frozen model (reward model, reference) loads in: the run's mixed precision when there is one (its
    forwards run under that autocast anyway, so the weights need not stay fp32), else `model_dtype`."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision, model_dtype)


def check_attn_implementation(name: str | None) -> None:
    """Refuse, in one line, an attention implementation that cannot run here (`model.attn_implementation`): sdpa and
    eager come with torch and transformers; flash_attention_2 needs the flash-attn package and a CUDA GPU."""
    if name in (None, "sdpa", "eager"):
        return
    if name != "flash_attention_2":
        raise UserError(f"config key 'model.attn_implementation': must be sdpa, flash_attention_2 or eager, got {name!r}")
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        raise UserError("config key 'model.attn_implementation': flash_attention_2 needs a CUDA GPU and the flash-attn "
                        "package (pip install flash-attn --no-build-isolation); use sdpa here")
