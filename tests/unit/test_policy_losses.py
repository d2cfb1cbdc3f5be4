"""Hand-computed values for the PPO clipped surrogate (symmetric, asymmetric, dual clip), the clipped value loss,
and the aggregation modes.

Ratios are round: ρ ∈ {½, 1, 1.25, 1.5, 2, 5} against old log-probs of 0, advantages ±1.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.policy import ppo_policy_loss, value_loss

TOL = dict(rtol=0, atol=1e-6)


def t(*rows) -> torch.Tensor:
    """t([1, 2]) is 1-D; t([1, 2], [3, 4]) is 2-D."""
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), **TOL)


def log_ratios(*ratios: float) -> torch.Tensor:
    return torch.log(t([list(ratios)])).requires_grad_(True)  # (1, N): log π with log π_old = 0


# ---------------------------------------------------------------------------------------------------------------
# ppo_policy_loss


def test_ratio_one_gives_minus_advantage_and_zero_metrics():
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=g) * 4
    advantages = torch.randn(3, 5, generator=g)
    loss, m = ppo_policy_loss(logprobs.clone().requires_grad_(True), logprobs, advantages)
    assert_close(loss, -advantages)
    assert_close(m["clipfrac"], torch.zeros(3, 5))
    assert_close(m["approxkl"], torch.zeros(3, 5))
    assert_close(m["ratio"], torch.ones(3, 5))
    assert_close(m["dual_clipfrac"], torch.zeros(3, 5))


def test_clipping_on_both_sides():
    # ε = 0.2. ρ = 1.5, A = +1: clipped to 1.2 -> -1.2. ρ = ½, A = -1: clipped to 0.8 -> 0.8.
    # ρ = 1.5, A = -1: unclipped 1.5 is the larger -> 1.5. ρ = ½, A = +1: unclipped -½ is the larger -> -½.
    logprobs = log_ratios(1.5, 0.5, 1.5, 0.5)
    advantages = t([[1.0, -1.0, -1.0, 1.0]])
    loss, m = ppo_policy_loss(logprobs, torch.zeros(1, 4), advantages)
    assert_close(loss, [[-1.2, 0.8, 1.5, -0.5]])
    assert_close(m["clipfrac"], [[1.0, 1.0, 0.0, 0.0]])
    assert_close(m["ratio"], [[1.5, 0.5, 1.5, 0.5]])
    assert_close(m["approxkl"], [[0.5 * math.log(1.5) ** 2, 0.5 * math.log(0.5) ** 2] * 2])
    # Clipped tokens get no gradient; unclipped ones d(-Aρ)/d log π = -Aρ.
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert_close(grad, [[0.0, 0.0, 1.5, -0.5]])


def test_asymmetric_clip_higher():
    # ε_low = 0.2, ε_high = 0.28: ρ = 1.25 with A = +1 is inside [0.8, 1.28]; ρ = 1.5 clips at 1.28.
    loss, m = ppo_policy_loss(
        log_ratios(1.25, 1.5, 0.5), torch.zeros(1, 3), t([[1.0, 1.0, -1.0]]), clip_eps=0.2, clip_eps_high=0.28
    )
    assert_close(loss, [[-1.25, -1.28, 0.8]])
    assert_close(m["clipfrac"], [[0.0, 1.0, 1.0]])


def test_dual_clip_caps_negative_advantages():
    # c = 3. ρ = 5, A = -1: PPO gives 5, capped at 3. ρ = 2, A = -1: 2 < 3, unchanged. ρ = 5, A = +1: clipped to
    # -1.2, the dual clip does not apply to positive advantages. ρ = 5, A = -2: PPO 10, capped at 6.
    logprobs = log_ratios(5.0, 2.0, 5.0, 5.0)
    advantages = t([[-1.0, -1.0, 1.0, -2.0]])
    loss, m = ppo_policy_loss(logprobs, torch.zeros(1, 4), advantages, dual_clip=3.0)
    assert_close(loss, [[3.0, 2.0, -1.2, 6.0]])
    assert_close(m["dual_clipfrac"], [[1.0, 0.0, 0.0, 1.0]])
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert_close(grad, [[0.0, 2.0, 0.0, 0.0]])
    plain, _ = ppo_policy_loss(logprobs, torch.zeros(1, 4), advantages)
    assert_close(plain, [[5.0, 2.0, -1.2, 10.0]])


def test_policy_loss_argument_checks():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_eps"):
        ppo_policy_loss(x, x, x, clip_eps=1.0)
    with pytest.raises(ValueError, match="clip_eps_high"):
        ppo_policy_loss(x, x, x, clip_eps_high=0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(x, x, x, dual_clip=1.0)


def test_extreme_log_ratio_on_padding_keeps_gradients_finite():
    # A padding position holding log π = -1000 (e.g. a pad token) must not make NaN gradients through the mask.
    logprobs = t([[-1.0, -1000.0]]).requires_grad_(True)
    loss, _ = ppo_policy_loss(logprobs, t([[-1.0, 0.0]]), t([[1.0, -1.0]]))
    total = aggregate(loss, torch.tensor([[True, False]]), "token-mean")
    assert_close(total, -1.0)
    (grad,) = torch.autograd.grad(total, logprobs)
    assert_close(grad, [[-1.0, 0.0]])


# ---------------------------------------------------------------------------------------------------------------
# value_loss


def test_value_loss_clipped_and_unclipped():
    # c = 0.2, V_old = 0. V = 1, R = 2: clipped V = 0.2 -> ½·max(1, 3.24) = 1.62, clipfrac 1.
    # V = 0.1, R = 1: inside the range -> ½·0.81. V = -1, R = -0.5: clipped -0.2 -> ½·max(0.25, 0.09) = 0.125.
    values = t([[1.0, 0.1, -1.0]]).requires_grad_(True)
    loss, m = value_loss(values, torch.zeros(1, 3), t([[2.0, 1.0, -0.5]]), clip_range_value=0.2)
    assert_close(loss, [[1.62, 0.405, 0.125]])
    assert_close(m["clipfrac"], [[1.0, 0.0, 0.0]])
    (grad,) = torch.autograd.grad(loss.sum(), values)
    assert_close(grad, [[0.0, -0.9, -0.5]])  # the clipped branch has no gradient w.r.t. V outside the range


def test_value_loss_without_clipping():
    loss, m = value_loss(t([[1.0, 3.0]]), t([[0.0, 0.0]]), t([[2.0, 0.0]]), clip_range_value=None)
    assert_close(loss, [[0.5, 4.5]])
    assert_close(m["clipfrac"], [[0.0, 0.0]])
    with pytest.raises(ValueError, match="clip_range_value"):
        value_loss(t([[1.0]]), t([[0.0]]), t([[0.0]]), clip_range_value=0.0)


# ---------------------------------------------------------------------------------------------------------------
# aggregate


def test_aggregate_modes_hand_computed():
    # Row 0: tokens (1, 2, 3); row 1: token (6); padding holds 100.
    loss = t([1.0, 2.0, 3.0], [6.0, 100.0, 100.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert_close(aggregate(loss, mask, "token-mean"), 12.0 / 4)
    assert_close(aggregate(loss, mask, "seq-mean-token-mean"), (2.0 + 6.0) / 2)
    assert_close(aggregate(loss, mask, "seq-mean-token-sum-norm"), 12.0 / (2 * 3))
    assert_close(aggregate(loss, mask, "seq-mean-token-sum-norm", max_len=4), 12.0 / (2 * 4))
    assert_close(aggregate(loss, mask, "token-mean", num_tokens=8), 12.0 / 8)
    assert_close(aggregate(loss, mask, "seq-mean-token-mean", num_seqs=4), 8.0 / 4)
    with pytest.raises(ValueError, match="mode"):
        aggregate(loss, mask, "sum")


def test_aggregate_empty_row_counts_as_a_sequence():
    loss = t([2.0, 4.0], [7.0, 7.0])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert_close(aggregate(loss, mask, "seq-mean-token-mean"), 3.0 / 2)
