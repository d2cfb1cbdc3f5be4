"""Hand-computed values and invariants for the advantage estimators and their shared pieces.

GAE is checked against a brute-force double loop Â_t = Σ_l (γλ)^l δ_{t+l} over the valid tokens; group estimators
on small groups with round scores (0/1 rewards, groups of 2 or 3).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.advantages import (
    ESTIMATORS,
    AdvantageInput,
    compute_advantages,
    get_estimator,
    group_stats,
    per_token_rewards,
    register_estimator,
    zero_variance_groups,
)
from rlhfkit.ops import masked_mean, masked_var

TOL = dict(rtol=0, atol=1e-6)


def t(*rows) -> torch.Tensor:
    """t([1, 2]) is 1-D; t([1, 2], [3, 4]) is 2-D."""
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), **TOL)


def lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, R) right-padded


def inp(rewards, mask, *, scores=None, values=None, group_ids=None, **options) -> AdvantageInput:
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    scores = torch.zeros(rewards.shape[0]) if scores is None else torch.as_tensor(scores, dtype=torch.float32)
    return AdvantageInput(
        rewards=rewards, scores=scores, response_mask=mask, values=values, group_ids=group_ids, **options
    )


# ---------------------------------------------------------------------------------------------------------------
# GAE


def brute_force_gae(rewards, values, mask, gamma, lam):
    """Â_t = Σ_{l≥0} (γλ)^l δ_{t+l} over each row's valid tokens, V = 0 after the last one; double loop."""
    advantages = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        r = [rewards[b, i].item() for i in idx]
        v = [values[b, i].item() for i in idx] + [0.0]
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(idx))]
        for k, i in enumerate(idx):
            advantages[b, i] = sum((gamma * lam) ** l * deltas[k + l] for l in range(len(idx) - k))
    return advantages


def test_gae_hand_computed():
    # γ = λ = ½. δ = (1 + ½·1 - ½, 0 + ½·1.5 - 1, 2 + 0 - 1.5) = (1, -¼, ½);
    # Â_2 = ½, Â_1 = -¼ + ¼·½ = -⅛, Â_0 = 1 + ¼·(-⅛) = 0.96875.
    rewards, values = t([[1.0, 0.0, 2.0]]), t([[0.5, 1.0, 1.5]])
    adv, ret = compute_advantages(
        "gae", inp(rewards, torch.ones(1, 3, dtype=torch.bool), values=values, gamma=0.5, lam=0.5)
    )
    assert_close(adv, [[0.96875, -0.125, 0.5]])
    assert_close(ret, [[1.46875, 0.875, 2.0]])  # Â + V


def test_gae_matches_brute_force_with_padding_and_holes():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    mask = torch.rand(5, 9, generator=g) > 0.3  # holes anywhere, like masked-out tool outputs
    mask[:, 0] = True
    for gamma, lam in [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)]:
        adv, ret = compute_advantages("gae", inp(rewards, mask, values=values, gamma=gamma, lam=lam))
        expected = brute_force_gae(rewards, values, mask, gamma, lam)
        assert_close(adv, expected)
        assert_close(ret, torch.where(mask, expected + values, 0.0))


def test_gae_lambda_gamma_one_zero_values_is_reward_to_go():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(3, 6, generator=g)
    mask = lengths_mask([6, 4, 1], 6)
    rewards = torch.where(mask, rewards, 0.0)
    adv, ret = compute_advantages("gae", inp(rewards, mask, values=torch.zeros(3, 6), gamma=1.0, lam=1.0))
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    assert_close(adv, torch.where(mask, reward_to_go, 0.0))
    assert_close(ret, torch.where(mask, reward_to_go, 0.0))


def test_gae_padding_values_do_not_matter_and_left_equals_right_padding():
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = lengths_mask([7, 5, 3, 2], 7)
    adv, _ = compute_advantages("gae", inp(rewards, mask, values=values, gamma=0.9, lam=0.9))
    junk = torch.randn(4, 7, generator=g) * 100
    adv_junk, _ = compute_advantages(
        "gae",
        inp(torch.where(mask, rewards, junk), mask, values=torch.where(mask, values, junk), gamma=0.9, lam=0.9),
    )
    assert_close(adv_junk, adv)
    assert_close(adv[~mask], torch.zeros(int((~mask).sum())))
    # Left padding: roll each row so its valid tokens end at the right edge.
    shifts = (7 - mask.sum(-1)).tolist()
    roll = lambda x: torch.stack([row.roll(s) for row, s in zip(x, shifts)])  # noqa: E731
    adv_left, _ = compute_advantages("gae", inp(roll(rewards), roll(mask), values=roll(values), gamma=0.9, lam=0.9))
    assert_close(adv_left, roll(adv))


def test_gae_whiten_and_missing_values():
    g = torch.Generator().manual_seed(3)
    mask = lengths_mask([5, 3, 4], 5)
    adv, _ = compute_advantages(
        "gae", inp(torch.randn(3, 5, generator=g), mask, values=torch.randn(3, 5, generator=g), whiten=True)
    )
    assert_close(masked_mean(adv, mask), 0.0)
    assert_close(masked_var(adv, mask), 1.0)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", inp(torch.zeros(3, 5), mask))


# ---------------------------------------------------------------------------------------------------------------
# Group estimators


def test_rloo_hand_computed_with_interleaved_groups():
    # Group 7: returns (1, 2, 3) -> 1 - 2.5, 2 - 2, 3 - 1.5. Group 4: (0, 4) -> -4, 4.
    mask = lengths_mask([2, 1, 3, 2, 3], 3)
    sequence_returns = [1.0, 0.0, 2.0, 4.0, 3.0]
    rewards = per_token_rewards(t(sequence_returns), torch.zeros(5, 3), mask, kl_coef=0.0)
    adv, ret = compute_advantages("rloo", inp(rewards, mask, group_ids=torch.tensor([7, 4, 7, 4, 7])))
    per_seq = torch.tensor([-1.5, -4.0, 0.0, 4.0, 1.5])
    assert_close(adv, torch.where(mask, per_seq.unsqueeze(-1), 0.0))
    assert_close(ret, torch.where(mask, t(sequence_returns).unsqueeze(-1), 0.0))


def test_rloo_identity_k_over_k_minus_one():
    g = torch.Generator().manual_seed(4)
    k, num_prompts, width = 4, 3, 6
    mask = torch.rand(k * num_prompts, width, generator=g) > 0.2
    rewards = torch.where(mask, torch.randn(k * num_prompts, width, generator=g), 0.0)
    group_ids = torch.arange(num_prompts).repeat_interleave(k)
    adv, _ = compute_advantages("rloo", inp(rewards, mask, group_ids=group_ids))
    sequence_returns = rewards.sum(-1).view(num_prompts, k)
    expected = (k / (k - 1) * (sequence_returns - sequence_returns.mean(-1, keepdim=True))).flatten()
    assert_close(adv, torch.where(mask, expected.unsqueeze(-1), 0.0))


def test_groups_of_one_raise():
    mask = torch.ones(3, 2, dtype=torch.bool)
    for name in ("rloo", "grpo", "dr_grpo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="at least 2 samples"):
            compute_advantages(name, inp(torch.zeros(3, 2), mask, group_ids=torch.tensor([0, 0, 1])))
        with pytest.raises(ValueError, match="group_ids"):
            compute_advantages(name, inp(torch.zeros(3, 2), mask))


def test_grpo_hand_computed_and_dr_grpo_unscaled():
    # Group (0, 1): mean ½, sample std √½ -> ±½/√½ = ±√½. Group (2, 2, 5): mean 3, sample std √(1+1+4)/2 = √3.
    scores = t([0.0, 1.0, 2.0, 2.0, 5.0])
    group_ids = torch.tensor([0, 0, 1, 1, 1])
    mask = lengths_mask([2, 1, 2, 2, 1], 2)
    adv, ret = compute_advantages("grpo", inp(torch.zeros(5, 2), mask, scores=scores, group_ids=group_ids, eps=0.0))
    s = math.sqrt(0.5)
    per_seq = t([-0.5 / s, 0.5 / s, -1 / math.sqrt(3), -1 / math.sqrt(3), 2 / math.sqrt(3)])
    assert_close(adv, torch.where(mask, per_seq.unsqueeze(-1), 0.0))
    assert_close(ret, torch.where(mask, scores.unsqueeze(-1), 0.0))
    dr_adv, _ = compute_advantages("dr_grpo", inp(torch.zeros(5, 2), mask, scores=scores, group_ids=group_ids))
    assert_close(dr_adv, torch.where(mask, t([-0.5, 0.5, -1.0, -1.0, 2.0]).unsqueeze(-1), 0.0))


def test_grpo_groups_have_mean_zero_and_sample_std_one():
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(12, generator=g)
    group_ids = torch.arange(3).repeat(4)  # interleaved groups of 4
    adv, _ = compute_advantages(
        "grpo", inp(torch.zeros(12, 1), torch.ones(12, 1, dtype=torch.bool), scores=scores, group_ids=group_ids, eps=0)
    )
    for gid in range(3):
        a = adv[group_ids == gid, 0]
        assert_close(a.mean(), 0.0)
        assert_close(a.std(), 1.0)  # torch.std is unbiased, as GRPO's normalisation


def test_group_stats_and_zero_variance_groups():
    scores = t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 0])
    mean, std, size = group_stats(scores, group_ids)
    assert_close(mean, [1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 1.0])
    assert_close(std, [0.0, 0.0, math.sqrt(0.5), math.sqrt(0.5), 0.0, 0.0, 0.0])
    assert_close(size, [3.0, 3.0, 2.0, 2.0, 2.0, 2.0, 3.0])
    assert zero_variance_groups(scores, group_ids).tolist() == [True, True, False, False, True, True, True]
    # 0.1 + 0.2 ≠ 0.3 in float: the test is exact equality of scores, not a near-zero std.
    assert zero_variance_groups(t([0.3, 0.3, 0.1]), torch.tensor([5, 5, 6])).tolist() == [True, True, True]


# ---------------------------------------------------------------------------------------------------------------
# REINFORCE++


def test_reinforce_pp_hand_computed():
    # γ = 1: returns-to-go (1, 1) and (3, 3); mean 2, unbiased variance 4/3 -> ±√3/2.
    rewards = t([0.0, 1.0], [0.0, 3.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv, ret = compute_advantages("reinforce_pp", inp(rewards, mask))
    h = math.sqrt(3) / 2
    assert_close(adv, [[-h, -h], [h, h]])
    assert_close(ret, [[1.0, 1.0], [3.0, 3.0]])
    # γ = ½ discounts: (½, 1) and (1.5, 3).
    _, ret_discounted = compute_advantages("reinforce_pp", inp(rewards, mask, gamma=0.5))
    assert_close(ret_discounted, [[0.5, 1.0], [1.5, 3.0]])


def test_reinforce_pp_whitened_over_valid_tokens():
    g = torch.Generator().manual_seed(6)
    mask = lengths_mask([6, 2, 4, 5], 6)
    rewards = torch.where(mask, torch.randn(4, 6, generator=g), 0.0)
    adv, _ = compute_advantages("reinforce_pp", inp(rewards, mask, gamma=0.95))
    assert_close(masked_mean(adv, mask), 0.0)
    assert_close(masked_var(adv, mask), 1.0)
    assert_close(adv[~mask], torch.zeros(int((~mask).sum())))


def test_reinforce_pp_baseline_subtracts_group_mean_score():
    # Scores 1 and 3 in one group (mean 2), placed at the last token: returns-to-go (-1, -1), (1, 1) -> ±√3/2.
    mask = torch.ones(2, 2, dtype=torch.bool)
    scores = t([1.0, 3.0])
    rewards = per_token_rewards(scores, torch.zeros(2, 2), mask, kl_coef=0.0)
    adv, ret = compute_advantages(
        "reinforce_pp_baseline", inp(rewards, mask, scores=scores, group_ids=torch.tensor([0, 0]))
    )
    h = math.sqrt(3) / 2
    assert_close(ret, [[-1.0, -1.0], [1.0, 1.0]])
    assert_close(adv, [[-h, -h], [h, h]])


# ---------------------------------------------------------------------------------------------------------------
# per_token_rewards


def test_per_token_rewards_places_score_at_last_valid_token():
    # Right-padded, left-padded, a hole, and an empty response.
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    kl = t([0.5, 1.0, 1.5, 9.0], [9.0, 9.0, 1.0, 2.0], [1.0, 9.0, 3.0, 9.0], [9.0, 9.0, 9.0, 9.0])
    scores = t([10.0, 20.0, 30.0, 40.0])
    rewards = per_token_rewards(scores, kl, mask, kl_coef=0.5)
    expected = t(
        [-0.25, -0.5, 10.0 - 0.75, 0.0], [0.0, 0.0, -0.5, 20.0 - 1.0], [-0.5, 0.0, 30.0 - 1.5, 0.0], [0.0] * 4
    )
    assert_close(rewards, expected)


def test_per_token_rewards_sum_is_score_minus_beta_kl():
    g = torch.Generator().manual_seed(7)
    mask = lengths_mask([5, 1, 3], 5)
    kl, scores = torch.randn(3, 5, generator=g), torch.randn(3, generator=g)
    rewards = per_token_rewards(scores, kl, mask, kl_coef=0.1)
    assert_close(rewards.sum(-1), scores - 0.1 * torch.where(mask, kl, 0.0).sum(-1))
    last = mask.sum(-1) - 1
    assert_close(rewards[torch.arange(3), last], scores - 0.1 * kl[torch.arange(3), last])


# ---------------------------------------------------------------------------------------------------------------
# Registry and input


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_has_the_same_signature_and_zero_padding(name):
    g = torch.Generator().manual_seed(8)
    mask = lengths_mask([4, 2, 3, 1], 4)
    data = AdvantageInput(
        rewards=torch.where(mask, torch.randn(4, 4, generator=g), 0.0),
        scores=torch.randn(4, generator=g),
        response_mask=mask,
        values=torch.randn(4, 4, generator=g, requires_grad=True),
        group_ids=torch.tensor([0, 1, 0, 1]),
    )
    adv, ret = compute_advantages(name, data)
    assert adv.shape == ret.shape == (4, 4)
    assert adv.dtype == ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_registry_duplicate_and_unknown_names():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("gae")(lambda inp: (inp.rewards, inp.rewards))
    with pytest.raises(KeyError, match="gae"):
        get_estimator("nope")


def test_advantage_input_checks_shapes():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="values"):
        AdvantageInput(rewards=torch.zeros(2, 3), scores=torch.zeros(2), response_mask=mask, values=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="scores"):
        AdvantageInput(rewards=torch.zeros(2, 3), scores=torch.zeros(3), response_mask=mask)
    with pytest.raises(ValueError, match="gamma"):
        AdvantageInput(rewards=torch.zeros(2, 3), scores=torch.zeros(2), response_mask=mask, gamma=1.5)
