"""Evaluation metrics: pure functions of sampled texts, scores and log-probs (no models, no I/O).

Lists or tensors in, python floats out (except `sequence_kl`, which keeps one value per sequence). Empty inputs are
errors, not NaNs, wherever a mean would be undefined. This module imports only torch (and `rlhfkit.ops`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from rlhfkit.kl import sequence_kl  # noqa: F401  (re-exported: evaluation's figures)
from rlhfkit.ops import masked_sum

Numbers = Sequence[float] | Sequence[bool] | torch.Tensor


def _vector(x: Numbers, name: str) -> torch.Tensor:
    v = torch.as_tensor(x).detach().to("cpu", torch.float64).flatten()
    if v.numel() == 0:
        raise ValueError(f"{name} is empty")
    return v


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n (Li et al. 2016, arXiv 1510.03055 §4.1): unique n-grams / total n-grams, pooled over all texts.

    Tokens are whitespace-separated words (`str.split()`); n-grams never cross from one text to the next, so a text
    shorter than n words adds none. Pooled over the whole set, so a policy that answers every prompt with the same
    sentence scores low even if that sentence repeats no word. No n-gram at all (every text shorter than n) gives
    0.0: nothing diverse was produced.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    grams = [tuple(words[i : i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def win_rate(scores_a: Numbers, scores_b: Numbers) -> float:
    """P(a beats b) over paired samples: mean of 1[a > b] + ½·1[a = b] (ties count half, so identical samples give
    exactly 0.5)."""
    a, b = _vector(scores_a, "scores_a"), _vector(scores_b, "scores_b")
    if a.shape != b.shape:
        raise ValueError(f"win_rate needs paired scores, got {a.numel()} and {b.numel()}")
    return float(((a > b).double() + 0.5 * (a == b).double()).mean())


def eos_rate(has_eos: Numbers) -> float:
    """Fraction of responses that ended with EOS (B,) bool."""
    return float(_vector(has_eos, "has_eos").mean())


def truncation_rate(has_eos: Numbers) -> float:
    """Fraction of responses cut at `max_new_tokens` (no EOS): 1 - eos_rate, the sampler having no other stop."""
    return 1.0 - eos_rate(has_eos)


def empty_rate(texts: Sequence[str]) -> float:
    """Fraction of responses that are empty or whitespace once decoded (e.g. EOS as the first token)."""
    if not texts:
        raise ValueError("texts is empty")
    return sum(not t.strip() for t in texts) / len(texts)


def mean_length(response_mask: torch.Tensor) -> float:
    """Mean response length in tokens, counting the EOS token when there is one: (B, R) mask -> float."""
    return float(_vector(response_mask.sum(-1), "response_mask").mean())


def reward_model_accuracy(chosen_scores: Numbers, rejected_scores: Numbers) -> float:
    """Fraction of preference pairs the reward model orders correctly (r_chosen > r_rejected; a tie counts as wrong,
    as the reward stage's `accuracy` does)."""
    c, r = _vector(chosen_scores, "chosen_scores"), _vector(rejected_scores, "rejected_scores")
    if c.shape != r.shape:
        raise ValueError(f"reward_model_accuracy needs paired scores, got {c.numel()} and {r.numel()}")
    return float((c > r).double().mean())


def within_group_accuracy(proxy: Numbers, gold: Numbers, group_size: int) -> tuple[float | None, int]:
    """How often a proxy (a reward model) orders two responses to the same prompt as the gold judge does.

    Scores come in consecutive groups of `group_size` (the samples of one prompt); every pair inside a group whose
    gold scores differ counts once, a proxy tie half. Returns (accuracy, number of pairs); accuracy is None when no
    pair has distinct gold scores.
    """
    p, g = _vector(proxy, "proxy"), _vector(gold, "gold")
    if p.shape != g.shape or p.numel() % group_size:
        raise ValueError(f"within_group_accuracy needs paired scores in groups of {group_size}, got {p.numel()} and {g.numel()}")
    p, g = p.view(-1, group_size), g.view(-1, group_size)
    i, j = torch.triu_indices(group_size, group_size, offset=1)
    dp, dg = p[:, i] - p[:, j], g[:, i] - g[:, j]  # (G, pairs)
    untied = dg != 0
    if not untied.any():
        return None, 0
    agree = ((dp * dg) > 0).double() + 0.5 * (dp == 0).double()
    return float(agree[untied].mean()), int(untied.sum())


def pearson(x: Numbers, y: Numbers) -> float:
    """Pearson correlation of two paired samples; 0.0 when either is constant (no linear relation can show)."""
    a, b = _vector(x, "x"), _vector(y, "y")
    if a.shape != b.shape:
        raise ValueError(f"pearson needs paired samples, got {a.numel()} and {b.numel()}")
    a, b = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom > 0 else 0.0


def mean_std(x: Numbers) -> dict[str, float]:
    """{"mean", "std"} of a sample (population std: 0 for a single value)."""
    v = _vector(x, "x")
    return {"mean": float(v.mean()), "std": float(v.std(unbiased=False))}


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || base) in nats for best-of-n sampling: log n - (n - 1) / n.

    The analytic formula used by Stiennon et al. 2020 (arXiv 2009.01325) and since, shown by Beirami et al. 2024
    (arXiv 2401.01879, Theorem 3.1) to be an upper bound on the true KL rather than its value. A yardstick for a
    policy's sequence KL: best-of-4 costs at most 0.636 nats, best-of-16 at most 1.835.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return math.log(n) - (n - 1) / n


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (Wilson 1927; Brown, Cai & DasGupta 2001, eq. 4) of a proportion `successes / n`,
    at the normal quantile `z` (1.96: 95%). Unlike p ± z·√(p(1-p)/n) it stays inside [0, 1] and is not empty at
    p = 0 or 1. A tie counted as half a success is allowed (`successes` need not be whole). n = 0 gives (0, 1)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
