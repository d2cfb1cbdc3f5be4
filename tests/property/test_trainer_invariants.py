"""Invariants of the offline loop: gradient accumulation equals one large batch; a resumed run equals an
uninterrupted one."""

import os

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from rlhfkit.cli import main
from rlhfkit.config import RMConfig, SFTConfig, load_config
from rlhfkit.trainers.reward import RewardTrainer
from rlhfkit.trainers.sft import SFTTrainer
from tests.hooks import interrupt_after_step

STAGES = {
    "sft": (SFTConfig, SFTTrainer, "configs/sft_tiny.yaml"),
    "rm": (RMConfig, RewardTrainer, "configs/rm_tiny.yaml"),
}


def first_step_gradients(stage, tmp_path, overrides):
    """Gradients of optimizer step 0, captured just before the optimizer applies them."""
    cfg_cls, trainer_cls, path = STAGES[stage]
    cfg = load_config(cfg_cls, path, [f"output_dir={tmp_path}", "data.eval=null", "optim.max_grad_norm=null", *overrides])
    trainer = trainer_cls(cfg)
    trainer.setup()
    grads = {}

    def capture(optimizer, args, kwargs):
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.detach().clone()

    handle = register_optimizer_step_pre_hook(capture)  # torch's public hook, before the update is applied
    try:
        trainer.train_step(0)
    finally:
        handle.remove()
    return grads


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_grad_accumulation_equals_one_large_batch(stage, tmp_path):
    big = first_step_gradients(stage, tmp_path / "big", ["optim.per_device_batch_size=16", "optim.grad_accum_steps=1"])
    small = first_step_gradients(stage, tmp_path / "small", ["optim.per_device_batch_size=4", "optim.grad_accum_steps=4"])
    assert big.keys() == small.keys() and len(big) > 0
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-5, atol=1e-6, msg=name)


def weights(run_dir):
    files = [f for f in os.listdir(run_dir) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(run_dir, f)))
    return out


@pytest.mark.parametrize("stage, extra", [("sft", []), ("rm", ["model.lora.enabled=true", "model.lora.r=4"])])
def test_resume_equals_uninterrupted(stage, extra, tmp_path):
    _, _, path = STAGES[stage]
    args = [stage, "--config", path, "max_steps=6", "logging.save_steps=3", "logging.logging_steps=1", "data.eval=null", *extra]
    full = tmp_path / "full"
    assert main(args + [f"output_dir={full}"]) == 0

    interrupted = tmp_path / "interrupted"
    with interrupt_after_step(4):  # the run dies in step 5, after checkpoint-3 was written
        assert main(args + [f"output_dir={interrupted}"]) == 130
    assert os.path.isdir(interrupted / "checkpoint-3")
    assert main(args + [f"output_dir={interrupted}", "resume=true"]) == 0

    a, b = weights(full), weights(interrupted)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    # The metrics log continues without duplicates from the interrupted attempt.
    steps = [line for line in (interrupted / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 6
