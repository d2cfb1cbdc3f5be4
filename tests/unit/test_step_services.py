"""The services of every optimizer step, on their fast paths for whole (unsharded) models: the same values as the
general paths they stand in for, bit for bit.

- Gradient clipping without a sharded engine (`sharding.clip_grad_norm`) equals accelerate's `clip_grad_norm_`.
- One process's sums by name (`trainers.processes.sums_by_name`) equal the packed fp64 sum over processes.
- The offline step runs the model in training mode after an evaluation or a callback's `eval()`, which it no longer
  resets at every step.
"""

import copy

import pytest
import torch

from rlhfkit import ops
from rlhfkit.sharding import clip_grad_norm
from rlhfkit.trainers.processes import sums_by_name
from tests.scripted import OneProcess


def _with_grads(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model(torch.randn(4, 5)).pow(2).sum().mul(30).backward()
    model[0].bias.grad = None  # a parameter without a gradient is left out of the norm
    return model


@pytest.mark.parametrize("max_norm", [0.5, float("inf")])
@pytest.mark.parametrize("n_models", [1, 2])
def test_clipping_whole_gradients_is_accelerates_bit_for_bit(max_norm, n_models):
    acc = OneProcess().accelerator
    ours = [_with_grads(seed) for seed in range(n_models)]
    theirs = copy.deepcopy(ours)  # weights only: the gradients are copied below
    for a, b in zip(ours, theirs):
        for p, q in zip(a.parameters(), b.parameters()):
            q.grad = None if p.grad is None else p.grad.clone()
    norm = clip_grad_norm(acc, ours + [None], max_norm)
    expected = acc.clip_grad_norm_([p for m in theirs for p in m.parameters()], max_norm)
    assert norm > 0.5 and torch.equal(norm, expected)
    for a, b in zip(ours, theirs):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            assert p.grad is None or torch.equal(p.grad, q.grad), name


def test_one_process_sums_by_name_are_the_packed_fp64_sums():
    groups = ({"loss": torch.tensor(0.1, dtype=torch.float32), "kl": torch.tensor([1 / 3], dtype=torch.float64),
               "bf16": torch.tensor(2.7, dtype=torch.bfloat16)},
              {"items": 3.0, "flag": True, "count": torch.tensor(7)})
    got = sums_by_name(OneProcess(), *groups)
    expected = ops.sums_by_name(*groups, sum_over=lambda x: x, dtype=torch.float64)
    assert got == expected
    assert [list(g) for g in got] == [["bf16", "kl", "loss"], ["count", "flag", "items"]]
    assert got[0]["loss"] == float(torch.tensor(0.1, dtype=torch.float32)) != 0.1  # fp32's value, not rounded again


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_offline_step_trains_in_training_mode_after_an_eval(tmp_path, lora):
    """Also with LoRA, whose peft wrapper is created in training mode around a model loaded in eval mode."""
    from rlhfkit.config import RMConfig, load_config
    from rlhfkit.trainers.reward import RewardTrainer

    cfg = load_config(RMConfig, "configs/rm_tiny.yaml", [f"output_dir={tmp_path}", "optim.per_device_batch_size=4",
                                                          "logging.progress_bar=false", f"model.lora.enabled={lora}"])
    trainer = RewardTrainer(cfg)
    trainer.setup()
    modes = []
    inner = trainer.run.unwrap(trainer.model)
    layer = inner.get_input_embeddings()  # a submodule: eval() reaches it, train() must too
    layer.register_forward_pre_hook(lambda module, args: modes.append(module.training) if torch.is_grad_enabled() else None)
    trainer.train_step(0)
    trainer.evaluate()
    trainer.train_step(1)
    inner.eval()  # what a callback may do on the model it is given
    trainer.train_step(2)
    assert modes == [True, True, True]
