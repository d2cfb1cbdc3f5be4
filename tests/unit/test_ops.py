"""Hand-computed values for rlhfkit.ops: masked statistics, log-probs and entropy from logits, KL estimators.

Round numbers: probabilities (1/4, 1/2, 1/4) from logits log(1, 2, 1); a log-ratio of ln 2 between policy and reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.kl import kl_penalty
from rlhfkit.ops import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

LN2 = math.log(2.0)
TOL = dict(rtol=0, atol=1e-6)


def t(*rows) -> torch.Tensor:
    """t([1, 2]) is 1-D; t([1, 2], [3, 4]) is 2-D."""
    return torch.tensor(rows[0] if len(rows) == 1 else rows, dtype=torch.float32)


def assert_close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), **TOL)


# ---------------------------------------------------------------------------------------------------------------
# Masked statistics


def test_masked_sum_and_mean_hand_computed():
    x = t([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert_close(masked_sum(x, mask), 7.0)
    assert_close(masked_sum(x, mask, dim=-1), [3.0, 4.0])
    assert_close(masked_mean(x, mask), 7.0 / 3)
    assert_close(masked_mean(x, mask, dim=-1), [1.5, 4.0])
    assert_close(masked_mean(x, mask, dim=0), [2.5, 2.0, 0.0])  # an empty column gives 0, not NaN


def test_masked_positions_never_leak_even_inf_or_nan():
    x = t([1.0, float("inf")], [float("nan"), 3.0]).requires_grad_(True)
    mask = torch.tensor([[True, False], [False, True]])
    total = masked_sum(x, mask)
    assert_close(total, 4.0)
    total.backward()
    assert_close(x.grad, [[1.0, 0.0], [0.0, 1.0]])


def test_masked_var_unbiased_and_biased():
    x = t([1.0, 2.0, 3.0, 4.0, 100.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    assert_close(masked_var(x, mask), 5.0 / 3)  # Σ(x - 2.5)² = 5, / (n - 1)
    assert_close(masked_var(x, mask, unbiased=False), 1.25)


def test_masked_var_needs_enough_valid_positions():
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(t([1.0, 2.0]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="at least 1"):
        masked_var(t([1.0, 2.0]), torch.tensor([0, 0]), unbiased=False)


def test_masked_whiten_mean_zero_variance_one_padding_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g) * 3 + 5
    mask = torch.arange(7).unsqueeze(0) < torch.tensor([[7], [3], [5], [1]])
    w = masked_whiten(x, mask)
    assert_close(masked_mean(w, mask), 0.0)
    assert_close(masked_var(w, mask), 1.0)
    assert_close(w[~mask], torch.zeros(int((~mask).sum())))
    rescaled = masked_whiten(x, mask, shift_mean=False)
    assert_close(masked_mean(rescaled, mask), masked_mean(x, mask))
    assert_close(masked_var(rescaled, mask), 1.0)


def test_masked_whiten_hand_computed():
    # mean 2, unbiased variance 1 -> (x - 2) / 1.
    w = masked_whiten(t([1.0, 2.0, 3.0, 9.0]), torch.tensor([1, 1, 1, 0]))
    assert_close(w, [-1.0, 0.0, 1.0, 0.0])


# ---------------------------------------------------------------------------------------------------------------
# Log-probs and entropy


def test_logprobs_hand_computed():
    logits = torch.log(t([1.0, 2.0, 1.0], [1.0, 1.0, 2.0])).unsqueeze(0)  # (1, 2, 3): p = (¼, ½, ¼), (¼, ¼, ½)
    labels = torch.tensor([[1, 0]])
    assert_close(logprobs_from_logits(logits, labels), [[math.log(0.5), math.log(0.25)]])


def test_logprobs_temperature_divides_logits():
    # Logits (0, 2 ln 2) at τ = 2 are (0, ln 2): p = (1/3, 2/3).
    logits = t([0.0, 2 * LN2]).view(1, 1, 2)
    lp = logprobs_from_logits(logits, torch.tensor([[1]]), temperature=2.0)
    assert_close(lp, [[math.log(2 / 3)]])
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, torch.tensor([[1]]), temperature=0.0)


def test_logprobs_match_manual_softmax_and_are_fp32():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    labels = torch.randint(0, 11, (3, 5), generator=g)
    manual = torch.log(torch.softmax(logits / 0.7, dim=-1)).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    # Log-probs reach about -20 here: compare relatively (fp32 rounding of the manual log of a softmax).
    torch.testing.assert_close(logprobs_from_logits(logits, labels, temperature=0.7), manual, rtol=1e-6, atol=1e-6)
    out = logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    reference = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert_close(out, reference)


def test_logprobs_gradient_matches_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 6, generator=g, requires_grad=True)
    labels = torch.randint(0, 6, (2, 4), generator=g)
    (grad_ours,) = torch.autograd.grad(logprobs_from_logits(logits, labels).sum(), logits)
    ref = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).sum()
    (grad_ref,) = torch.autograd.grad(ref, logits)
    assert_close(grad_ours, grad_ref)


def test_entropy_hand_computed():
    # Uniform over 4: ln 4. (¼, ½, ¼): ½ ln 4 + ½ ln 2 = 1.5 ln 2.
    uniform = torch.zeros(1, 1, 4)
    assert_close(entropy_from_logits(uniform), [[math.log(4.0)]])
    skewed = torch.log(t([1.0, 2.0, 1.0])).view(1, 1, 3)
    assert_close(entropy_from_logits(skewed), [[1.5 * LN2]])
    # τ = 2 on logits (0, 2 ln 2): p = (1/3, 2/3).
    tempered = entropy_from_logits(t([0.0, 2 * LN2]).view(1, 1, 2), temperature=2.0)
    assert_close(tempered, [[-(1 / 3) * math.log(1 / 3) - (2 / 3) * math.log(2 / 3)]])


def test_entropy_of_near_one_hot_is_finite():
    logits = t([0.0, -1e4, -1e4]).view(1, 1, 3)
    assert_close(entropy_from_logits(logits), [[0.0]])


# ---------------------------------------------------------------------------------------------------------------
# KL estimators


def test_kl_estimators_hand_computed():
    # log π = ln ½, log π_ref = ln ¼: log π - log π_ref = ln 2, r = π_ref / π = ½.
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])
    assert_close(kl_penalty(logp, ref, "k1"), [LN2])
    assert_close(kl_penalty(logp, ref, "k2"), [0.5 * LN2**2])
    assert_close(kl_penalty(logp, ref, "k3"), [0.5 - 1 + LN2])  # (r - 1) - log r
    assert_close(kl_penalty(logp, ref, "abs"), [LN2])
    # Swapped: log-ratio -ln 2, r = 2.
    assert_close(kl_penalty(ref, logp, "k1"), [-LN2])
    assert_close(kl_penalty(ref, logp, "k3"), [2 - 1 - LN2])
    assert_close(kl_penalty(ref, logp, "abs"), [LN2])


def test_kl_estimators_zero_when_equal_and_k3_nonnegative():
    g = torch.Generator().manual_seed(3)
    logp, ref = -torch.rand(4, 9, generator=g) * 5, -torch.rand(4, 9, generator=g) * 5
    for kind in ("k1", "k2", "k3", "abs"):
        assert_close(kl_penalty(logp, logp, kind), torch.zeros(4, 9))
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_k3_is_clamped_finite_with_finite_gradient():
    logp = t([-1000.0, 0.0]).requires_grad_(True)
    ref = t([0.0, -1000.0])
    k3 = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_unknown_kind_raises():
    with pytest.raises(ValueError, match="kind"):
        kl_penalty(t([0.0]), t([0.0]), "k4")


def test_masked_whiten_with_all_reduce_uses_the_global_batch():
    """Two shards of one batch, each whitened with an all_reduce that adds the other shard's sums, give exactly the
    whitening of the whole batch (not each shard's own statistics)."""
    from rlhfkit.ops import masked_whiten

    torch.manual_seed(0)
    x = torch.randn(6, 5) * 3 + 1
    mask = torch.rand(6, 5) > 0.3
    whole = masked_whiten(x, mask)
    shards = [(x[:3], mask[:3]), (x[3:], mask[3:])]

    def summing_with(other_x, other_mask):
        state = {}

        def all_reduce(t):
            m = other_mask.bool()
            if "mean" not in state:  # first call: (count, sum)
                out = t + torch.stack([m.sum().float(), other_x.float()[m].sum()])
                state["mean"] = out[1] / out[0]
                return out
            return t + ((other_x.float()[m] - state["mean"]) ** 2).sum()  # second: squared deviations

        return all_reduce

    for i, (xi, mi) in enumerate(shards):
        other = shards[1 - i]
        got = masked_whiten(xi, mi, all_reduce=summing_with(*other))
        torch.testing.assert_close(got, whole[:3] if i == 0 else whole[3:], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(masked_whiten(x[:3], mask[:3]), whole[:3])  # each shard's own statistics differ


def test_sums_by_name_keeps_each_group_apart_and_goes_by_name():
    """Groups come back apart under their own names; the sum over processes (here a scripted one adding a second
    process's packed values) is matched to names by the packing order decided inside, not by the caller."""
    from rlhfkit.ops import sums_by_name

    figures, own = sums_by_name({"b": 2.0, "a": torch.tensor(1.0)}, {"weight": 4})
    assert figures == {"a": 1.0, "b": 2.0} and own == {"weight": 4.0}
    # the other process packs the same groups and names the same way: (a, b | weight)
    figures, own = sums_by_name({"b": 2.0, "a": 1.0}, {"weight": 4}, sum_over=lambda t: t + torch.tensor([10.0, 20.0, 40.0], dtype=t.dtype))
    assert figures == {"a": 11.0, "b": 22.0} and own == {"weight": 44.0}
    assert sums_by_name({}, {}) == ({}, {})


def test_log_probs_and_entropy_go_by_chunks_of_rows_bounded_in_memory():
    """A small vocabulary's batch is one chunk (a handful of ops, not a handful per row); a real vocabulary's rows go
    one at a time (a chunk never holds more than CHUNK_ELEMENTS fp32 values beyond one row); and the values are the
    row-by-row ones, bit for bit."""
    from rlhfkit.ops import CHUNK_ELEMENTS, row_chunks

    assert row_chunks(torch.zeros(8, 17, 103)) == [slice(0, 8)]
    assert row_chunks(torch.zeros(3, 300, 49152, dtype=torch.bfloat16)) == [slice(0, 1), slice(1, 2), slice(2, 3)]
    rows = CHUNK_ELEMENTS // (64 * 1024)
    assert row_chunks(torch.zeros(rows + 1, 64, 1024))[0] == slice(0, rows)
    torch.manual_seed(0)
    logits, labels = torch.randn(5, 7, 11), torch.randint(0, 11, (5, 7))
    for part in (logits, logits[:1]):
        one_by_one = torch.cat([logprobs_from_logits(r[None], l[None], 0.7) for r, l in zip(part, labels)])
        assert torch.equal(logprobs_from_logits(part, labels[: len(part)], 0.7), one_by_one)
        assert torch.equal(entropy_from_logits(part, 0.7), torch.cat([entropy_from_logits(r[None], 0.7) for r in part]))
