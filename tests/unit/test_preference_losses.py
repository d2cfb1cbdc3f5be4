"""Hand-computed values and invariants for the preference losses (DPO/cDPO/IPO/hinge, SimPO, ORPO, KTO).

Inputs are chosen so the answer has a closed form: βh = 0 gives log 2, βh = ln 3 gives σ = 3/4, an average
log-prob of ln(1/2) gives odds 1.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.losses.kto import kto_loss
from rlhfkit.losses.preference import orpo_loss, preference_loss, simpo_loss

LN2, LN3 = math.log(2.0), math.log(3.0)
TOL = dict(rtol=0, atol=1e-6)


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), **TOL)


# ---------------------------------------------------------------------------------------------------------------
# preference_loss: DPO, cDPO, IPO, hinge


def test_dpo_hand_computed():
    # Row 0: h = 0 -> log 2. Row 1: h = ln 9, β = 1/2 -> βh = ln 3, σ = 3/4 -> -ln(3/4).
    loss, m = preference_loss(
        t(-10.0, -10.0 + 2 * LN3), t(-20.0, -20.0), t(-10.0, -10.0), t(-20.0, -20.0), loss_type="sigmoid", beta=0.5
    )
    assert_close(loss, [LN2, -math.log(0.75)])
    assert_close(m["rewards/chosen"], [0.0, LN3])
    assert_close(m["rewards/rejected"], [0.0, 0.0])
    assert_close(m["rewards/margins"], [0.0, LN3])
    assert_close(m["rewards/accuracies"], [0.0, 1.0])
    assert_close(m["logps/chosen"], [-10.0, -10.0 + 2 * LN3])
    assert_close(m["logps/rejected"], [-20.0, -20.0])


def test_cdpo_label_smoothing():
    # βh = ln 3, ε = 0.1: -(0.9) ln σ(ln 3) - 0.1 ln σ(-ln 3) = 0.9 ln(4/3) + 0.1 ln 4.
    loss, _ = preference_loss(t(2 * LN3), t(0.0), t(0.0), t(0.0), loss_type="sigmoid", beta=0.5, label_smoothing=0.1)
    assert_close(loss, [0.9 * math.log(4 / 3) + 0.1 * math.log(4.0)])


def test_ipo_hand_computed():
    # β = 1/4 -> 1/(2β) = 2; h = 5 -> 9, h = 0 -> 4, h = 2 -> 0.
    chosen = t(-5.0, -7.0, -3.0)
    ref_chosen = t(-8.0, -7.0, -4.0)  # chosen log-ratios 3, 0, 1
    rejected = t(-9.0, -9.0, -9.0)
    ref_rejected = t(-7.0, -9.0, -8.0)  # rejected log-ratios -2, 0, -1
    loss, m = preference_loss(chosen, rejected, ref_chosen, ref_rejected, loss_type="ipo", beta=0.25)
    assert_close(loss, [9.0, 4.0, 0.0])
    assert_close(m["rewards/margins"], [1.25, 0.0, 0.5])


def test_ipo_with_lengths_averages_the_loss_and_sums_the_rewards():
    # β = 1/4 -> 1/(2β) = 2. The loss's h averages each log-ratio over its response (TRL's IPO); the rewards do not.
    # Row 0: log-ratios 6 over 3 tokens, 0 over 5 -> h = 2 -> loss 0; rewards 1.5 and 0.
    # Row 1: an empty chosen response (log-prob 0, length 0, counted as 1 -> average 0); rejected -4 over 4 -> -1;
    #        h = 1 -> loss 1; rewards 0 and -1.
    # Row 2: 4 over 8 -> 0.5, 2 over 1 -> 2; h = -1.5 -> loss 12.25; rewards 1 and 0.5: on sums the chosen wins,
    #        on averages it would lose.
    chosen, ref_chosen, len_chosen = t(-12.0, 0.0, -6.0), t(-18.0, 0.0, -10.0), torch.tensor([3, 0, 8])
    rejected, ref_rejected, len_rejected = t(-10.0, -8.0, -3.0), t(-10.0, -4.0, -5.0), torch.tensor([5, 4, 1])
    loss, m = preference_loss(
        chosen, rejected, ref_chosen, ref_rejected, loss_type="ipo", beta=0.25,
        chosen_lengths=len_chosen, rejected_lengths=len_rejected,
    )
    assert_close(loss, [0.0, 1.0, 12.25])
    assert_close(m["rewards/chosen"], [1.5, 0.0, 1.0])
    assert_close(m["rewards/rejected"], [0.0, -1.0, 0.5])
    assert_close(m["rewards/margins"], [1.5, 1.0, 0.5])
    assert_close(m["rewards/accuracies"], [1.0, 1.0, 1.0])
    assert_close(m["logps/chosen"], [-12.0, 0.0, -6.0])
    assert_close(m["logps/rejected"], [-10.0, -8.0, -3.0])


def test_ipo_empty_responses_have_a_finite_loss_and_gradient():
    # Both responses empty: log-probs 0 over 0 tokens -> averages 0 -> h = 0 -> (0 - 1/(2β))² = 1 at β = 1/2.
    chosen, rejected = t(0.0).requires_grad_(), t(0.0).requires_grad_()
    zero = torch.tensor([0])
    loss, _ = preference_loss(chosen, rejected, t(0.0), t(0.0), loss_type="ipo", beta=0.5,
                              chosen_lengths=zero, rejected_lengths=zero)
    assert_close(loss, [1.0])
    loss.sum().backward()
    assert_close(chosen.grad, [-2.0])  # d/dc (c/1 - 1)² at c = 0
    assert_close(rejected.grad, [2.0])


def test_lengths_apply_only_to_ipo_and_come_in_pairs():
    n = torch.tensor([3])
    with pytest.raises(ValueError, match="only to loss_type='ipo'"):
        preference_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), loss_type="sigmoid", beta=0.1, chosen_lengths=n,
                        rejected_lengths=n)
    with pytest.raises(ValueError, match="both or neither"):
        preference_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), loss_type="ipo", beta=0.1, chosen_lengths=n)


def test_hinge_hand_computed():
    # β = 1/2: h = 1 -> relu(1/2) = 1/2; h = 4 -> 0; h = -2 -> 2.
    zeros = t(0.0, 0.0, 0.0)
    loss, _ = preference_loss(t(1.0, 4.0, -2.0), zeros, zeros, zeros, loss_type="hinge", beta=0.5)
    assert_close(loss, [0.5, 0.0, 2.0])


def test_reference_free_uses_policy_logprobs_only():
    loss, m = preference_loss(t(-1.0), t(-1.0), None, None, loss_type="sigmoid", beta=0.1, reference_free=True)
    assert_close(loss, [LN2])
    assert_close(m["rewards/chosen"], [-0.1])


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_swapping_chosen_and_rejected_flips_the_margin(loss_type):
    g = torch.Generator().manual_seed(0)
    a, b, c, d = (-torch.rand(6, generator=g) * 40 - 1 for _ in range(4))
    _, m = preference_loss(a, b, c, d, loss_type=loss_type, beta=0.1)
    _, swapped = preference_loss(b, a, d, c, loss_type=loss_type, beta=0.1)
    assert_close(swapped["rewards/margins"], -m["rewards/margins"])
    assert_close(swapped["rewards/chosen"], m["rewards/rejected"])


def test_policy_equal_to_reference_gives_log2_everywhere():
    g = torch.Generator().manual_seed(1)
    chosen, rejected = -torch.rand(8, generator=g) * 50, -torch.rand(8, generator=g) * 50
    loss, m = preference_loss(chosen, rejected, chosen.clone(), rejected.clone(), loss_type="sigmoid", beta=0.3)
    assert_close(loss, torch.full((8,), LN2))
    assert_close(m["rewards/margins"], torch.zeros(8))


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_preference_loss_rejects_nonpositive_beta(beta):
    with pytest.raises(ValueError, match="beta must be > 0"):
        preference_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), loss_type="sigmoid", beta=beta)


@pytest.mark.parametrize("eps", [-0.1, 0.5, 0.7])
def test_preference_loss_rejects_label_smoothing_outside_range(eps):
    with pytest.raises(ValueError, match="label_smoothing"):
        preference_loss(t(-1.0), t(-2.0), t(-1.0), t(-2.0), loss_type="sigmoid", beta=0.1, label_smoothing=eps)


def test_preference_loss_argument_errors():
    args = (t(-1.0), t(-2.0))
    with pytest.raises(ValueError, match="loss_type"):
        preference_loss(*args, t(-1.0), t(-2.0), loss_type="dpo", beta=0.1)
    with pytest.raises(ValueError, match="only to loss_type='sigmoid'"):
        preference_loss(*args, t(-1.0), t(-2.0), loss_type="ipo", beta=0.1, label_smoothing=0.1)
    with pytest.raises(ValueError, match="required unless reference_free"):
        preference_loss(*args, None, None, loss_type="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="required unless reference_free"):
        preference_loss(*args, t(-1.0), None, loss_type="sigmoid", beta=0.1)
    with pytest.raises(ValueError, match="takes no reference"):
        preference_loss(*args, t(-1.0), t(-2.0), loss_type="sigmoid", beta=0.1, reference_free=True)


# ---------------------------------------------------------------------------------------------------------------
# SimPO


def test_simpo_hand_computed():
    # avg log-probs -10/5 = -2 and -30/10 = -3, β = 2 -> rewards -4, -6, margin 2. γ = 2 -> z = 0 -> log 2.
    chosen, rejected, len_c, len_r = t(-10.0), t(-30.0), torch.tensor([5]), torch.tensor([10])
    loss, m = simpo_loss(chosen, rejected, len_c, len_r, beta=2.0, gamma=2.0)
    assert_close(loss, [LN2])
    assert_close(m["rewards/chosen"], [-4.0])
    assert_close(m["rewards/rejected"], [-6.0])
    assert_close(m["rewards/margins"], [2.0])
    assert_close(m["rewards/accuracies"], [1.0])
    assert_close(m["logps/chosen"], [-10.0])
    # z = 2 - (2 - ln 3) = ln 3, ε = 1/4: 0.75 ln(4/3) + 0.25 ln 4.
    loss, _ = simpo_loss(chosen, rejected, len_c, len_r, beta=2.0, gamma=2.0 - LN3, label_smoothing=0.25)
    assert_close(loss, [0.75 * math.log(4 / 3) + 0.25 * math.log(4.0)])


def test_simpo_swap_and_beta():
    g = torch.Generator().manual_seed(2)
    a, b = -torch.rand(5, generator=g) * 40, -torch.rand(5, generator=g) * 40
    la, lb = torch.randint(1, 30, (5,), generator=g), torch.randint(1, 30, (5,), generator=g)
    _, m = simpo_loss(a, b, la, lb, beta=2.0, gamma=0.5)
    _, swapped = simpo_loss(b, a, lb, la, beta=2.0, gamma=0.5)
    assert_close(swapped["rewards/margins"], -m["rewards/margins"])
    with pytest.raises(ValueError, match="beta must be > 0"):
        simpo_loss(a, b, la, lb, beta=0.0, gamma=0.5)


# ---------------------------------------------------------------------------------------------------------------
# ORPO


def test_orpo_hand_computed():
    # Row 0: chosen avg ln(1/2) -> odds 1; rejected avg ln(1/5) -> odds 1/4; log odds ratio ln 4,
    #        L_OR = -ln σ(ln 4) = ln(5/4). Row 1: equal odds -> L_OR = log 2.
    chosen = t(3 * math.log(0.5), 2 * math.log(0.2))
    rejected = t(2 * math.log(0.2), 4 * math.log(0.2))
    len_c, len_r = torch.tensor([3, 2]), torch.tensor([2, 4])
    nll = t(0.7, 1.5)
    loss, m = orpo_loss(chosen, rejected, len_c, len_r, nll, beta=0.5)
    assert_close(loss, [0.7 + 0.5 * math.log(1.25), 1.5 + 0.5 * LN2])
    assert_close(m["log_odds_chosen"], [math.log(4.0), 0.0])
    assert_close(m["log_odds_ratio"], [math.log(0.8), -LN2])
    assert_close(m["rewards/chosen"], [0.5 * math.log(0.5), 0.5 * math.log(0.2)])
    assert_close(m["rewards/rejected"], [0.5 * math.log(0.2), 0.5 * math.log(0.2)])
    assert_close(m["rewards/accuracies"], [1.0, 0.0])
    assert_close(m["nll_loss"], [0.7, 1.5])
    assert_close(m["logps/chosen"], chosen)


def test_orpo_is_finite_at_extreme_logprobs_and_swap_flips():
    chosen = torch.tensor([0.0, -1e-9, -200.0, -0.01], requires_grad=True)
    rejected = torch.tensor([-200.0, -3.0, 0.0, -0.02], requires_grad=True)
    lengths = torch.tensor([1, 1, 2, 1])
    loss, m = orpo_loss(chosen, rejected, lengths, lengths, torch.zeros(4), beta=1.0)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(chosen.grad).all() and torch.isfinite(rejected.grad).all()
    _, swapped = orpo_loss(rejected, chosen, lengths, lengths, torch.zeros(4), beta=1.0)
    assert_close(swapped["log_odds_chosen"], -m["log_odds_chosen"])
    with pytest.raises(ValueError, match="beta must be >= 0"):
        orpo_loss(chosen, rejected, lengths, lengths, torch.zeros(4), beta=-1.0)


def test_orpo_gradient_flows_through_nll():
    nll = torch.tensor([0.3, 0.4], requires_grad=True)
    loss, _ = orpo_loss(t(-1.0, -2.0), t(-3.0, -4.0), torch.tensor([1, 1]), torch.tensor([1, 1]), nll, beta=0.1)
    loss.sum().backward()
    assert_close(nll.grad, [1.0, 1.0])


# ---------------------------------------------------------------------------------------------------------------
# KTO


def test_kto_negative_kl_is_clamped_and_weights_apply():
    # Mean KL = (-1 + -3)/2 < 0 -> z0 = 0. β = 1, r = ln 3 on both rows.
    # Desirable: λ_D (1 - σ(ln 3)) = 2 · 1/4. Undesirable: λ_U (1 - σ(-ln 3)) = 0.5 · 3/4.
    loss, m = kto_loss(
        t(-10.0 + LN3, -20.0 + LN3), t(-10.0, -20.0), torch.tensor([True, False]), t(-6.0, -8.0), t(-5.0, -5.0),
        beta=1.0, desirable_weight=2.0, undesirable_weight=0.5,
    )
    assert_close(loss, [0.5, 0.375])
    assert_close(m["kl"], [0.0, 0.0])
    assert_close(m["desirable_mask"], [1.0, 0.0])
    assert_close(m["rewards/chosen"], [LN3, 0.0])
    assert_close(m["rewards/rejected"], [0.0, LN3])
    assert_close(m["logps/chosen"], [-10.0 + LN3, 0.0])
    assert_close(m["logps/rejected"], [0.0, -20.0 + LN3])


def test_kto_positive_reference_point():
    # KL pairs give log-ratios 0 and 2 ln 3 -> z0 = ln 3. β = 1.
    # Desirable r = ln 3: 1 - σ(0) = 1/2. Undesirable r = 0: 1 - σ(ln 3) = 1/4.
    loss, m = kto_loss(
        t(-4.0 + LN3, -4.0), t(-4.0, -4.0), torch.tensor([True, False]), t(-1.0, -1.0 + 2 * LN3), t(-1.0, -1.0),
        beta=1.0,
    )
    assert_close(loss, [0.5, 0.25])
    assert_close(m["kl"], [LN3, LN3])


def test_kto_reference_point_is_detached():
    policy = torch.tensor([-3.0, -5.0, -4.0], requires_grad=True)
    policy_kl = torch.tensor([-2.0, -6.0, -1.0], requires_grad=True)
    desirable = torch.tensor([True, False, True])
    loss, _ = kto_loss(policy, t(-4.0, -4.0, -4.0), desirable, policy_kl, t(-3.0, -3.0, -3.0), beta=0.5)
    loss.sum().backward()
    assert policy_kl.grad is None or torch.count_nonzero(policy_kl.grad) == 0
    assert policy.grad is not None and torch.count_nonzero(policy.grad) == 3


def test_kto_z0_override():
    args = (t(-4.0 + LN3, -4.0), t(-4.0, -4.0), torch.tensor([True, False]))
    loss, m = kto_loss(*args, None, None, beta=1.0, z0=torch.tensor(LN3))
    assert_close(loss, [0.5, 0.25])
    loss, m = kto_loss(*args, None, None, beta=1.0, z0=torch.tensor(-2.0))  # clamped to 0
    assert_close(m["kl"], [0.0, 0.0])
    with pytest.raises(ValueError, match="not both"):
        kto_loss(*args, t(-1.0, -1.0), t(-1.0, -1.0), beta=1.0, z0=torch.tensor(0.0))
    with pytest.raises(ValueError, match="required unless z0"):
        kto_loss(*args, None, None, beta=1.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        kto_loss(*args, None, None, beta=0.0, z0=torch.tensor(0.0))


# ---------------------------------------------------------------------------------------------------------------
# Shared contract: (B,) fp32 loss, detached (B,) metrics


def _all_losses(requires_grad: bool):
    g = torch.Generator().manual_seed(3)
    B = 4

    def logprobs():
        return (-torch.rand(B, generator=g) * 49 - 1).half().requires_grad_(requires_grad)

    lengths = torch.randint(1, 20, (B,), generator=g)
    desirable = torch.tensor([True, False, True, False])
    yield preference_loss(logprobs(), logprobs(), logprobs(), logprobs(), loss_type="sigmoid", beta=0.1, label_smoothing=0.1)
    yield preference_loss(logprobs(), logprobs(), logprobs(), logprobs(), loss_type="ipo", beta=0.1)
    yield preference_loss(logprobs(), logprobs(), logprobs(), logprobs(), loss_type="hinge", beta=0.1)
    yield simpo_loss(logprobs(), logprobs(), lengths, lengths, beta=2.0, gamma=1.0)
    yield orpo_loss(logprobs(), logprobs(), lengths, lengths, -logprobs() / 50, beta=0.1)
    yield kto_loss(logprobs(), logprobs(), desirable, logprobs(), logprobs(), beta=0.1)


def test_shapes_dtypes_and_detached_metrics():
    for loss, metrics in _all_losses(requires_grad=True):
        assert loss.shape == (4,) and loss.dtype == torch.float32 and loss.requires_grad
        for name, value in metrics.items():
            assert value.shape == (4,), name
            assert not value.requires_grad and value.grad_fn is None, name
            assert value.dtype == torch.float32, name
