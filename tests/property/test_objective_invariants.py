"""Invariants of every policy objective, on random tensors and through the real CLI on the tiny model:
  - at π = π_old (lr = 0) the ratio is 1, nothing is clipped, capped or masked, and the gradient is the plain policy
    gradient -A·∇log π (Clip-Cov's covariance-chosen tokens aside: chosen whatever the ratio, by design);
  - gradient accumulation ≡ one batch: micro-batches of 4 train exactly as one of 16, for every objective whose
    token selection is not a statistic of the micro-batch (Clip-Cov, KL-Cov and the top-entropy quantile are, as in
    TRL and verl: documented in docs/objectives.md);
  - each objective runs through `rlhfkit grpo` (the CLI smoke run), with the masks and the sampler correction on.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.cli import main
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.correction import off_policy_sequence_mask, rollout_correction
from rlhfkit.losses.objectives import ObjectiveParams
from rlhfkit.losses.policy import OBJECTIVES, policy_objective

NAMES = sorted(OBJECTIVES)
BATCH_STATISTIC = {"clip_cov", "kl_cov"}  # token selection by a statistic of the tokens a call is given


def rows_of(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("name", NAMES)
def test_at_the_old_policy_nothing_is_clipped_and_the_gradient_is_the_policy_gradient(name):
    g = torch.Generator().manual_seed(len(name))
    lp = (-torch.rand(6, 7, generator=g) * 3).requires_grad_(True)
    mask = torch.arange(7) < torch.randint(1, 8, (6, 1), generator=g)
    adv = torch.randn(6, 1, generator=g).expand(6, 7)  # one advantage per sequence: every objective reads it
    spec = OBJECTIVES[name]
    params = ObjectiveParams(level=spec.levels[0], clip_cov_ratio=0.2, clip_cov_lb=0.0)  # a window these products reach
    loss, m = spec.fn(lp, lp.detach(), adv, mask, params)
    ratio = m["ratio"] if m["ratio"].shape[-1] == 1 else m["ratio"][mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio))
    assert m["clipfrac"].sum() == 0 and m["approxkl"].sum() == 0
    (grad,) = torch.autograd.grad(aggregate(loss, mask, "token-mean"), lp)
    expected = torch.where(mask, -adv / mask.sum(), 0.0)
    if name == "clip_cov":  # its chosen tokens take no gradient, the others PPO's
        assert m["covfrac"].sum() > 0
        expected = expected * (1 - m["covfrac"])
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    # the masks and the correction leave everything in place when the sampler's log-probs are π_old's
    keep = off_policy_sequence_mask(adv, lp, lp.detach(), mask, 1e-3)
    weights, cm = rollout_correction(lp.detach(), lp.detach(), mask, "token_mask", 0.5, 2.0)
    assert keep.min() == 1 and weights[mask].min() == 1 and cm["corrected"].sum() == 0
    same, _ = policy_objective(lp, lp.detach(), adv, mask, objective=name, params=params, sequence_keep=keep,
                               is_weights=weights)
    if name not in BATCH_STATISTIC:  # (Clip-Cov draws its tokens again)
        torch.testing.assert_close(same, loss)


FAST = ["max_steps=1", "logging.progress_bar=false", "algo.rollout_batch_size=4", "algo.ppo_epochs=2",
        "algo.num_minibatches=1", "optim.adam_eps=1e-4"]


@pytest.mark.parametrize("name", NAMES)
def test_cli_runs_each_objective_and_at_lr_zero_moves_nothing(name, tmp_path):
    """The smoke run: `rlhfkit grpo` with the objective, the off-policy mask and the sampler correction; at lr = 0
    the second epoch still sees ratio 1, nothing clipped, masked or corrected, and no KL to the start."""
    out = tmp_path / "run"
    extra = ["algo.off_policy_mask_threshold=0.001", "algo.rollout_correction=token_mask",
             "algo.rollout_correction_min=0.5", "algo.rollout_correction_max=2"]
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "optim.lr=0",
                 f"algo.policy_loss={name}", *FAST, *extra]) == 0
    (row,) = rows_of(out)
    assert row["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert row["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-10)
    assert row["policy/clipfrac_avg"] == 0.0
    assert row["policy/off_policy_masked_frac"] == 0.0 and row["sampling/corrected_frac"] == 0.0
    assert row["sampling/mismatch_kl"] < 1e-8  # the decode loop's log-probs are the training forward's, to float noise
    assert row["objective/kl"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in BATCH_STATISTIC])
def test_accumulation_equals_one_batch(name, tmp_path):
    """Micro-batches of 4 against one of 16 (2 epochs, so the second is off-policy): the same metrics and weights."""
    args = ["grpo", "--config", "configs/grpo_tiny.yaml", f"algo.policy_loss={name}", "optim.lr=1e-2", *FAST,
            "algo.bias_corrected_kl=true"]
    assert main(args + [f"output_dir={tmp_path / 'one'}", "optim.per_device_batch_size=16"]) == 0
    assert main(args + [f"output_dir={tmp_path / 'micro'}", "optim.per_device_batch_size=4"]) == 0
    assert rows_of(tmp_path / "one")[0]["policy/approxkl_avg"] > 1e-8  # the second epoch was off-policy
    one, micro = rows_of(tmp_path / "one")[0], rows_of(tmp_path / "micro")[0]
    for key, value in one.items():  # wall times and the planned memory (which counts the micro-batch) aside
        if not key.startswith(("time/", "memory/")):
            assert micro[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    w1, w2 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "micro"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-6)
