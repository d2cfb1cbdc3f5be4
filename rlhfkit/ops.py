"""Tensor operations shared by losses, advantage estimators and trainers: masked statistics, log-probs of labels,
and entropy (the KL estimators are in `rlhfkit.kl`).

Everything here is a pure function computed in fp32. Masks are (B, R) or (B, T), bool or 0/1; a masked-out position
never contributes, even when it holds inf or NaN (we select with `torch.where`, never multiply by the mask).

This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# exp(20) ≈ 4.9e8 is finite in fp32 (exp overflows above ~88). A per-token log-ratio beyond ±20 means the two
# policies disagree by a factor of half a billion on one token: a broken rollout or a padding position. Clamping keeps
# exp() finite so such a position cannot turn a loss or its gradient (0 · inf = NaN) into NaN.
LOG_RATIO_CLAMP = 20.0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over positions where `mask` is set, over `dim` (all dimensions when None), in fp32."""
    selected = torch.where(mask.bool(), x.float(), 0.0)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is set, over `dim` (all dimensions when None), in fp32.

    A slice with no valid position has mean 0 rather than NaN (its count is clamped to 1), so an empty response in a
    batch cannot poison a logged metric.
    """
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def segment_sum(x: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Per-segment sums of a flat tensor, in fp32: (N,), (N,) long in [0, S) -> (S,); an empty segment sums to 0.

    The padding-free layout's counterpart of `x.sum(-1)` over padded rows (`types.PaddingFreeBatch.seq_ids`)."""
    return torch.zeros(num_segments, dtype=torch.float32, device=x.device).index_add(0, segment_ids, x.float())


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions where `mask` is set (a scalar), in fp32.

    unbiased=True applies Bessel's correction n / (n - 1), as TRL's `masked_var`. Raises ValueError when there are too
    few valid positions (fewer than 2 unbiased, none biased): the variance is undefined there, not zero.
    """
    n = mask.bool().sum()
    if n < (2 if unbiased else 1):
        raise ValueError(f"masked_var needs at least {2 if unbiased else 1} valid positions, got {int(n)}")
    mean = masked_mean(x, mask)
    var = masked_mean((x.float() - mean) ** 2, mask)
    return var * n / (n - 1) if unbiased else var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the valid positions, with the unbiased variance (as TRL's `masked_whiten`).

    shift_mean=False adds the mean back (rescale only), as used to whiten rewards without moving their mean.
    Masked-out positions are set to 0, so nothing downstream reads a whitened padding value.

    all_reduce: under data parallelism, a function returning the sum of a tensor over all processes. The mean and
    variance are then those of every process's valid positions — what one process holding the whole batch would
    compute — not this shard's alone.
    """
    if all_reduce is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        m, xf = mask.bool(), x.float()
        (total,) = summed({"count": m.sum().float(), "sum": xf[m].sum()}, sum_over=all_reduce, device=x.device,
                          dtype=torch.float32)  # the global count and sum
        n, total = total["count"], total["sum"]
        if n < 2:
            raise ValueError(f"masked_var needs at least 2 valid positions, got {int(n)}")
        mean = total / n
        var = all_reduce(((xf[m] - mean) ** 2).sum()) / (n - 1)
    whitened = (x.float() - mean) * torch.rsqrt(var + 1e-8)  # 1e-8: a constant batch gives 0, not a division by 0
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


CHUNK_ELEMENTS = 1 << 22  # fp32 values (16 MiB) a log-prob or entropy chunk holds at most, one row at least


def row_chunks(logits: torch.Tensor) -> list[slice]:
    """(B, T, V) -> slices of rows, each holding at most CHUNK_ELEMENTS values (and at least one row): one chunk for
    a tiny vocabulary's whole batch, one row at a time for a real one (T · V is millions)."""
    per_row = max(1, logits[0].numel()) if logits.shape[0] else 1
    rows = max(1, CHUNK_ELEMENTS // per_row)
    return [slice(i, min(i + rows, logits.shape[0])) for i in range(0, logits.shape[0], rows)]


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[label] per position, in fp32.

    `temperature` must be the sampling temperature: the policy that generated the tokens is softmax(logits / τ), so the
    old, new and reference log-probs all use the same τ (otherwise the PPO ratio and the KL compare different
    distributions).

    Memory: we compute label_logit - logsumexp(logits) a few sequences at a time (`row_chunks`: one (T, V) row for a
    real vocabulary, the whole batch where it is small) rather than `log_softmax` then `gather` over the whole batch.
    Both are exact in fp32; a chunk holds at most `CHUNK_ELEMENTS` fp32 values instead of a (B, T, V) copy (the
    vocabulary dimension dominates). With autograd on, the fp32 chunks are still saved for backward; the saving is in
    peak memory of the forward. Each chunk is a handful of ops forward and backward, so a small model's step does
    not pay them per row.

    Args:
        logits: (B, T, V), any float dtype; upcast to fp32 row by row.
        labels: (B, T) long, valid vocabulary ids (mask padding positions afterwards, not with -100).
        temperature: τ > 0.

    Returns:
        (B, T) fp32 log-probabilities.
    """
    _check_temperature(temperature)
    rows = []
    for part in row_chunks(logits):
        z = logits[part].float() / temperature  # (b, T, V)
        picked = z.gather(-1, labels[part].unsqueeze(-1)).squeeze(-1)  # (b, T, V) -> (b, T)
        rows.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(rows)  # (B, T)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits / temperature) per position, in fp32, one sequence at a time.

    H = logsumexp(z) - Σ_v softmax(z)_v · z_v, which needs no log of a probability that underflowed to 0.

    Args:
        logits: (B, T, V).
        temperature: τ > 0, the sampling temperature (same reason as `logprobs_from_logits`).

    Returns:
        (B, T) fp32 entropies.
    """
    _check_temperature(temperature)
    rows = []
    for part in row_chunks(logits):
        z = logits[part].float() / temperature  # (b, T, V)
        lse = torch.logsumexp(z, dim=-1)  # (b, T)
        probs = torch.exp(z - lse.unsqueeze(-1))  # (b, T, V)
        rows.append(lse - (probs * z).sum(-1))
    return torch.cat(rows)  # (B, T)


def summed(*groups: dict[str, torch.Tensor | float], sum_over: Callable[[torch.Tensor], torch.Tensor] | None = None,
           device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> tuple[dict[str, torch.Tensor], ...]:
    """Each group {name: scalar} with every value summed by `sum_over` (an all-reduce over processes; None: one
    process), in one call: a tuple of dicts of 0-d `dtype` tensors, one per group, under the same names.

    Values travel by name, never by position: every caller passes the same groups and names, and the packing order
    (group, then sorted name) is decided here, so a figure added on one side cannot shift another's value. A loop
    keeps its own bookkeeping (weights, counts, flags) in a group of its own, apart from the figures it logs."""
    keys = [(g, name) for g, group in enumerate(groups) for name in sorted(group)]
    out: tuple[dict[str, torch.Tensor], ...] = tuple({} for _ in groups)
    if not keys:
        return out
    local = torch.stack([torch.as_tensor(groups[g][name], dtype=dtype, device=device).detach().reshape(()).to(device)
                         for g, name in keys])
    totals = sum_over(local) if sum_over is not None else local
    for i, (g, name) in enumerate(keys):
        out[g][name] = totals[i]
    return out


def sums_by_name(*groups: dict[str, torch.Tensor | float], sum_over: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> tuple[dict[str, float], ...]:
    """`summed`, as Python floats: the figures a loop logs and the counts it divides them by."""
    return tuple({name: float(v) for name, v in group.items()}
                 for group in summed(*groups, sum_over=sum_over, device=device, dtype=dtype))
