"""Gradient accumulation is exact: with the global counts passed in, the sum of the micro-batch losses equals the
one-batch loss, and so do the gradients, for every aggregation mode.

Each micro-batch is trimmed to its own longest response (as a collator pads it), so "seq-mean-token-sum-norm" must be
given the configured max_len rather than its local width.
"""

from __future__ import annotations

import pytest
import torch

from rlhfkit.losses.aggregate import AGG_MODES, aggregate

B, R, MICRO = 16, 12, 4
TOL = dict(rtol=0, atol=1e-6)


def random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, R + 1, (B,), generator=g)  # varied lengths, including empty responses
    lengths[0] = R
    mask = torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)  # (B, R)
    loss = (torch.randn(B, R, generator=g) * 3).requires_grad_(True)
    return loss, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_one_batch(mode, seed):
    loss, mask = random_batch(seed)
    counts = dict(num_tokens=mask.sum(), num_seqs=B, max_len=R)
    whole = aggregate(loss, mask, mode, **counts)
    (grad_whole,) = torch.autograd.grad(whole, loss)

    order = torch.randperm(B, generator=torch.Generator().manual_seed(seed + 100))  # shuffled, as a sampler would
    total = torch.zeros(())
    for idx in order.chunk(MICRO):
        width = max(int(mask[idx].sum(-1).max()), 1)  # trimmed to the micro-batch's longest response
        total = total + aggregate(loss[idx, :width], mask[idx, :width], mode, **counts)
    (grad_micro,) = torch.autograd.grad(total, loss)

    torch.testing.assert_close(total, whole, **TOL)
    torch.testing.assert_close(grad_micro, grad_whole, **TOL)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_positions_get_no_gradient(mode):
    loss, mask = random_batch(3)
    (grad,) = torch.autograd.grad(aggregate(loss, mask, mode), loss)
    assert (grad[~mask] == 0).all()
