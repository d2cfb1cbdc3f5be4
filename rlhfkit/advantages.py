"""Advantage estimators: one input dataclass, one signature, a registry by name.

Every estimator is `fn(inp: AdvantageInput) -> (advantages, returns)`, both (B, R) fp32 and 0 on padding. Adding one
is one decorated function here and one test; the trainer looks it up by name through `rlhfkit.algorithms`.

Registered: "gae", "rloo", "grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline".

The group-relative estimators ("rloo", "grpo", "reinforce_pp_baseline") share one scaling choice, `scale_rewards`
(TRL's name and meaning): divide each sample's centred score by its group's standard deviation ("group"), by the
whole batch's ("batch", the Lite PPO of arXiv 2508.08221), or not at all ("none"); "dr_grpo" is "grpo"
with "none". "grpo" also takes several reward sources normalised one by one before their weighted sum (GDPO,
`normalize_then_sum_advantages`).

Where rewards come from: the trainer builds per-token `rewards` with `per_token_rewards` (score at the last response
token, -β·KL at every token when the algorithm puts KL in the reward) and keeps the sequence-level `scores` as well.
GAE, RLOO and REINFORCE++ read `rewards`; GRPO reads `scores` (its KL term lives in the loss).

Statistics are taken over the tensors given: pass the whole rollout batch (gathered across processes if the
statistics should be global), never a micro-batch.

This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhfkit.ops import masked_sum, masked_whiten


@dataclass(frozen=True)
class AdvantageInput:
    """Everything an estimator may read. Tensors are treated as constants (estimators run under no_grad).

    Data:
        rewards: (B, R) per-token rewards, 0 on padding: the score at the last valid token plus any per-token KL
            penalty (see `per_token_rewards`).
        scores: (B,) sequence-level scores (reward model / verifier output, before any KL).
        response_mask: (B, R) bool or 0/1, the response tokens that count (padding and tool outputs excluded).
        values: (B, R) critic values V(s_t) at each response position; "gae" only.
        group_ids: (B,) long, equal for samples of the same prompt; "rloo", "grpo", "dr_grpo",
            "reinforce_pp_baseline". Any ids, in any order.

    Options:
        gamma: discount γ ("gae", "reinforce_pp*").
        lam: GAE λ ("gae").
        whiten: whiten the advantages over the batch's valid tokens as a last step ("gae", "rloo", "grpo",
            "dr_grpo"). The REINFORCE++ estimators always whiten: the global normalisation is the method.
        eps: added to the standard deviation that divides the scores ("grpo", "rloo", "reinforce_pp_baseline" with
            `scale_rewards` group or batch); TRL uses 1e-4.
        scale_rewards: "group", "batch" or "none" (see the module's docstring); None = the estimator's own: "group"
            for "grpo", "none" for "rloo" and "reinforce_pp_baseline" (their papers divide by nothing). "dr_grpo"
            is always "none"; the other estimators take None only.
        source_scores: (B, S) each reward source's own score, NaN where it did not score the row; with
            `source_weights` (S,), GDPO's normalise-then-sum ("grpo" only; `scores` then only fills `returns`).
        all_reduce: under data parallelism, sums a tensor over all processes: whitening (and REINFORCE++'s global
            normalisation) then uses the statistics of the whole global batch, as one process holding it would.
            Group statistics need none: a prompt's samples are always on one process.
    """

    rewards: torch.Tensor  # (B, R)
    scores: torch.Tensor  # (B,)
    response_mask: torch.Tensor  # (B, R)
    values: torch.Tensor | None = None  # (B, R)
    group_ids: torch.Tensor | None = None  # (B,) long
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = False
    eps: float = 1e-4
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    scale_rewards: str | None = None
    source_scores: torch.Tensor | None = None  # (B, S)
    source_weights: torch.Tensor | None = None  # (S,)

    def __post_init__(self) -> None:
        if self.rewards.dim() != 2:
            raise ValueError(f"rewards must be (B, R), got shape {tuple(self.rewards.shape)}")
        batch, width = self.rewards.shape
        expected = {"response_mask": (batch, width), "scores": (batch,)}
        if self.values is not None:
            expected["values"] = (batch, width)
        if self.group_ids is not None:
            expected["group_ids"] = (batch,)
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"{name} must have shape {shape} to match rewards (B, R), got {actual}")
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam}")
        if self.scale_rewards not in (None, *SCALE_REWARDS):
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} or None, got {self.scale_rewards!r}")
        if (self.source_scores is None) != (self.source_weights is None):
            raise ValueError("source_scores and source_weights come together (GDPO's normalise-then-sum)")
        if self.source_scores is not None and (self.source_scores.shape[0] != batch or self.source_scores.dim() != 2
                                               or self.source_weights.shape != self.source_scores.shape[1:]):
            raise ValueError(f"source_scores must be (B={batch}, S) and source_weights (S,), got "
                             f"{tuple(self.source_scores.shape)} and {tuple(self.source_weights.shape)}")


SCALE_REWARDS = ("group", "batch", "none")


AdvantageFn = Callable[[AdvantageInput], tuple[torch.Tensor, torch.Tensor]]
ESTIMATORS: dict[str, AdvantageFn] = {}


def register_estimator(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: register `fn` under `name`. A duplicate name raises ValueError."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ESTIMATORS[name] = fn
        return fn

    return decorator


def get_estimator(name: str) -> AdvantageFn:
    """The estimator registered under `name`; KeyError naming the known ones otherwise."""
    if name not in ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def compute_advantages(name: str, inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator `name` on `inp` without autograd: (advantages (B, R), returns (B, R)), fp32, 0 on padding."""
    with torch.no_grad():
        return get_estimator(name)(inp)


# ---------------------------------------------------------------------------------------------------------------
# Shared pieces


def per_token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> torch.Tensor:
    """Per-token rewards of KL-regularised RLHF: -β·KL_t at every valid token, plus the score at the last one.

    Ziegler et al. 2019, arXiv 1909.08593, eq. 2 (R = r - β log(π/π_ref)), spread over tokens as in Stiennon et al.
    2020 (arXiv 2009.01325) and TRL: the score is received at the last valid response token (the EOS position).
    A response with no valid token receives nothing. Deliberate difference: TRL's PPO places the score one position
    after the last non-padding token (`sequence_lengths + 1`); here it lands on the last token of the mask given (pass
    TRL's one-longer mask to reproduce TRL).

    Args:
        scores: (B,) sequence-level scores.
        kl: (B, R) per-token KL estimate (usually `kl.token_kl(logprobs, ref_logprobs, mask)`).
        response_mask: (B, R) valid response tokens.
        kl_coef: β ≥ 0.

    Returns:
        (B, R) fp32 rewards, 0 on padding; their sum is score - β·Σ_t KL_t.
    """
    mask = response_mask.bool()
    rewards = torch.where(mask, -kl_coef * kl.float(), 0.0)  # (B, R)
    return rewards + _last_valid(mask) * scores.float().unsqueeze(-1)


def penalize_missing_eos(scores: torch.Tensor, has_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """(B,) scores with `penalty` (>= 0) subtracted from each response that has no EOS (cut at max_new_tokens).

    TRL's `missing_eos_penalty` convention: a positive number, subtracted. None or 0 leaves the scores as they are.
    """
    if not penalty:
        return scores.float()
    return scores.float() - penalty * (~has_eos.bool()).float()


def loss_mask(
    response_mask: torch.Tensor,
    has_eos: torch.Tensor,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mask_truncated: bool = False,
    drop_zero_variance_groups: bool = False,
) -> torch.Tensor:
    """(B, R) float: the tokens that take a loss — the response tokens, less the samples excluded from the loss.

    - `mask_truncated`: responses without EOS (DAPO's overlong filtering, Yu et al. 2025, arXiv 2503.14476, §3.4).
    - `drop_zero_variance_groups`: groups whose samples all scored the same (DAPO's dynamic sampling, §3.2, which
      also samples new groups to refill the batch; this mask only drops them).
    This mask is for the loss only: advantages are computed with the full `response_mask`, so excluding a sample
    from the loss never changes the baseline its siblings are compared with.
    """
    keep = torch.ones_like(has_eos, dtype=torch.bool)
    if mask_truncated:
        keep = keep & has_eos.bool()
    if drop_zero_variance_groups:
        keep = keep & ~zero_variance_groups(scores, group_ids)
    return response_mask.float() * keep.float().unsqueeze(1)


def _last_valid(mask: torch.Tensor) -> torch.Tensor:
    """(B, R) bool, True at each row's last valid position (nowhere for an empty row)."""
    width = mask.shape[-1]
    last = width - 1 - mask.long().flip(-1).argmax(-1)  # (B,) index of the last True
    positions = torch.arange(width, device=mask.device)
    return (positions == last.unsqueeze(-1)) & mask.any(-1, keepdim=True)


def group_stats(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, standard deviation and size of its group: three (B,) tensors.

    The standard deviation is the *sample* one (Bessel's correction, divide by k - 1), as `torch.std` and TRL's
    `nanstd` that GRPOTrainer uses. Raises ValueError if a group has fewer than 2 samples: one sample has no baseline
    (RLOO's leave-one-out mean is empty, GRPO's advantage is 0/0).

    Args:
        x: (B,) one value per sample.
        group_ids: (B,) long group id per sample (any values, any order).
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError(
            f"every group needs at least 2 samples (one sample has no baseline); group sizes: {counts.tolist()}"
        )
    x = x.float()
    sums = x.new_zeros(counts.numel()).index_add_(0, inverse, x)  # (G,)
    means = sums / counts
    squares = x.new_zeros(counts.numel()).index_add_(0, inverse, (x - means[inverse]) ** 2)  # (G,)
    stds = torch.sqrt(squares / (counts - 1))
    return means[inverse], stds[inverse], counts[inverse].to(x.dtype)


def zero_variance_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(B,) bool: True for samples whose whole group has the same score (exactly).

    Such a group gives every sample a zero group-relative advantage, so it carries no gradient; DAPO's dynamic
    sampling (Yu et al. 2025, arXiv 2503.14476, §3.2) drops these groups and samples more prompts. A group of one
    sample counts as zero-variance.
    """
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    scores = scores.float()
    highest = scores.new_full((num_groups,), -torch.inf).scatter_reduce(0, inverse, scores, "amax")
    lowest = scores.new_full((num_groups,), torch.inf).scatter_reduce(0, inverse, scores, "amin")
    return (highest == lowest)[inverse]


def _gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Â_t = Σ_l (γλ)^l δ_{t+l}, δ_t = r_t + γ V_{t+1} - V_t, by backward recursion over the valid tokens only.

    Invalid positions are skipped (the next valid token bootstraps across them), so right padding, left padding and
    masked-out spans inside a response all work; after the last valid token V = 0 (the episode ends). Returns (B, R),
    0 on invalid positions.
    """
    batch, width = rewards.shape
    last_gae = rewards.new_zeros(batch)  # (B,)
    next_value = rewards.new_zeros(batch)  # (B,)
    reversed_advantages = []
    for t in reversed(range(width)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        last_gae = torch.where(valid, gae, last_gae)
        next_value = torch.where(valid, values[:, t], next_value)
        reversed_advantages.append(torch.where(valid, gae, 0.0))
    return torch.stack(reversed_advantages[::-1], dim=1)  # (B, R)


def _whitened_return_to_go(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, all_reduce=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++'s (advantages, returns): the γ-discounted return-to-go, whitened over the batch's valid tokens."""
    returns = _gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)  # V = 0, λ = 1: return-to-go
    return masked_whiten(returns, mask, all_reduce=all_reduce), returns


def _require(value: torch.Tensor | None, field: str, estimator: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInput.{field}")
    return value


def _finish(advantages: torch.Tensor, mask: torch.Tensor, whiten: bool, all_reduce=None) -> torch.Tensor:
    """Optionally whiten over the valid tokens (of every process, with `all_reduce`); 0 on padding either way."""
    if whiten:
        return masked_whiten(advantages, mask, all_reduce=all_reduce)
    return torch.where(mask, advantages, 0.0)


def _broadcast(per_sequence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, R): the sequence value at every valid token, 0 on padding."""
    return torch.where(mask, per_sequence.unsqueeze(-1), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Estimators


@register_estimator("gae")
def gae(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation, Schulman et al. 2015, arXiv 1506.02438, eq. 16.

    Â_t = Σ_{l≥0} (γλ)^l δ_{t+l} with δ_t = r_t + γ V(s_{t+1}) - V(s_t), over the valid response tokens; returns
    = Â + V (the critic's target, taken before any whitening, as TRL). TRL's PPO then whitens the advantages: set
    `whiten=True` for its behaviour.
    """
    _scale_mode(inp, "gae", None)
    mask = inp.response_mask.bool()
    values = torch.where(mask, _require(inp.values, "values", "gae").float(), 0.0)
    advantages = _gae(inp.rewards.float(), values, mask, inp.gamma, inp.lam)
    returns = advantages + values
    return _finish(advantages, mask, inp.whiten, inp.all_reduce), returns


@register_estimator("rloo")
def rloo(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out, Ahmadian et al. 2024, arXiv 2402.14740 (after Kool et al. 2019).

    With k samples per prompt and R_i = Σ_t r_{i,t} the sequence return (score - β·Σ KL when KL is in the reward):
    A_i = R_i - 1/(k-1) Σ_{j≠i} R_j = k/(k-1) (R_i - mean_j R_j), the same at every token of sample i, divided by
    the group's or the batch's std of R with `scale_rewards` group or batch (default none, as the paper).
    returns = R_i at every valid token. Groups of one raise ValueError.
    """
    mask = inp.response_mask.bool()
    group_ids = _require(inp.group_ids, "group_ids", "rloo")
    sequence_returns = masked_sum(inp.rewards, mask, dim=-1)  # (B,)
    mean, _, size = group_stats(sequence_returns, group_ids)
    baseline = (mean * size - sequence_returns) / (size - 1)  # mean of the other k - 1 samples
    centred = _scaled(sequence_returns - baseline, sequence_returns, group_ids, inp, "none", "rloo")
    return _finish(_broadcast(centred, mask), mask, inp.whiten, inp.all_reduce), _broadcast(sequence_returns, mask)


def batch_std(x: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel) of (B,) `x` over the whole batch: every process's rows with
    `all_reduce` (a sum over processes), as TRL's `nanstd` over its gathered rewards. A scalar."""
    reduce = all_reduce or (lambda v: v)
    x = x.float()
    n, total = reduce(torch.stack([x.new_tensor(float(x.numel())), x.sum()]))
    if n < 2:
        raise ValueError(f"the batch standard deviation needs at least 2 samples, got {int(n)}")
    return torch.sqrt(reduce(((x - total / n) ** 2).sum()) / (n - 1))


def _scale_mode(inp: AdvantageInput, name: str, default: str | None) -> str | None:
    """`inp.scale_rewards`, or the estimator's `default` when None; ValueError for an estimator that scales nothing
    (default None) or one whose scaling is fixed ("dr_grpo")."""
    if inp.scale_rewards is not None and inp.scale_rewards != default and name in ("dr_grpo", "gae", "reinforce_pp"):
        raise ValueError(f"advantage estimator {name!r} takes no scale_rewards (got {inp.scale_rewards!r})")
    if inp.source_scores is not None and name != "grpo":
        raise ValueError(f"advantage estimator {name!r} takes no source_scores: normalise-then-sum is GRPO's (GDPO)")
    return inp.scale_rewards if inp.scale_rewards is not None else default


def _scaled(centred: torch.Tensor, raw: torch.Tensor, group_ids: torch.Tensor, inp: AdvantageInput, default: str,
            name: str) -> torch.Tensor:
    """(B,) centred scores divided as `scale_rewards` says: by the std of `raw` in the sample's group, or in the whole
    batch, plus eps (TRL 1.16's GRPOTrainer: `advantages / (std_rewards + 1e-4)`), or not at all."""
    mode = _scale_mode(inp, name, default)
    if mode == "none":
        return centred
    std = group_stats(raw, group_ids)[1] if mode == "group" else batch_std(raw, inp.all_reduce)
    return centred / (std + inp.eps)


def _group_relative(inp: AdvantageInput, default: str, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    mask = inp.response_mask.bool()
    scores = inp.scores.float()
    group_ids = _require(inp.group_ids, "group_ids", name)
    if inp.source_scores is not None:
        _scale_mode(inp, name, default)  # refuses the estimators that do not take sources
        if inp.scale_rewards is not None:
            raise ValueError("scale_rewards does not apply with source_scores: normalise-then-sum scales each source "
                             "by its group std and the sum by the batch std")
        per_sequence = normalize_then_sum_advantages(inp.source_scores, inp.source_weights, group_ids, inp.eps,
                                                     inp.all_reduce)
    else:
        mean, _, _ = group_stats(scores, group_ids)
        per_sequence = _scaled(scores - mean, scores, group_ids, inp, default, name)
    return _finish(_broadcast(per_sequence, mask), mask, inp.whiten, inp.all_reduce), _broadcast(scores, mask)


def normalize_then_sum_advantages(source_scores: torch.Tensor, weights: torch.Tensor, group_ids: torch.Tensor,
                                  eps: float = 1e-4, all_reduce=None) -> torch.Tensor:
    """GDPO's advantage over several reward sources: each source normalised within its group, then summed, then the
    sum normalised over the batch: "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
    Optimization", arXiv 2601.05242 (its decoupled normalisation); TRL's `multi_objective_aggregation=
    "normalize_then_sum"`.

    A_i = (Σ_k w_k ẑ_ik - mean_batch) / (std_batch + eps), ẑ_ik = (r_ik - mean_group(r_k)) / (std_group(r_k) + eps).
    Summing first lets a source with a large spread drown the others; normalising each first gives every source
    the same say. A source that did not score a row (NaN) is left out of its group's statistics and of the row's sum;
    a row no source scored gets advantage 0 and is left out of the batch statistics, as TRL does. Standard
    deviations are the sample ones (Bessel); the batch statistics span every process with `all_reduce`.

    Args:
        source_scores: (B, S) fp32, NaN where a source returned None.
        weights: (S,) each source's weight.
        group_ids: (B,) long, equal for samples of one prompt.

    Returns:
        (B,) per-sequence advantages.
    """
    x = source_scores.float()
    scored = ~torch.isnan(x)  # (B, S)
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = unique_ids.numel()
    zeros = x.new_zeros(num_groups, x.shape[1])
    counts = zeros.index_add(0, inverse, scored.float())  # (G, S)
    means = zeros.index_add(0, inverse, torch.where(scored, x, 0.0)) / counts  # NaN for a source no row of a group has
    deviations = torch.where(scored, x - means[inverse], 0.0)
    stds = torch.sqrt(zeros.index_add(0, inverse, deviations ** 2) / (counts - 1))  # NaN for fewer than 2 scored
    normalised = (x - means[inverse]) / (stds[inverse] + eps)  # (B, S), NaN where unscored or undefined
    weighted = normalised * weights.to(x.device).float()
    summed = torch.where(torch.isnan(weighted), 0.0, weighted).sum(-1)  # TRL's nansum
    any_scored = scored.any(-1)  # (B,)
    reduce = all_reduce or (lambda v: v)
    n, total = reduce(torch.stack([any_scored.sum().float(), summed[any_scored].sum()]))
    mean = total / n
    std = torch.sqrt(reduce(((summed[any_scored] - mean) ** 2).sum()) / (n - 1))
    return torch.where(any_scored, (summed - mean) / (std + eps), 0.0)


@register_estimator("grpo")
def grpo(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantage, Shao et al. 2024, arXiv 2402.03300, §4.1.2 (outcome supervision).

    A_i = (s_i - mean_group(s)) / (std_group(s) + eps) on the sequence scores, the same at every token of sample i.
    std is the sample standard deviation (Bessel, k - 1), as TRL's GRPOTrainer (`nanstd`); eps = 1e-4 as TRL.
    `scale_rewards` batch divides by the batch's std instead, none by nothing; with `source_scores`, GDPO's
    `normalize_then_sum_advantages`. returns = s_i at every valid token.
    """
    return _group_relative(inp, "group", "grpo")


@register_estimator("dr_grpo")
def dr_grpo(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO advantage, Liu et al. 2025, arXiv 2503.20783: GRPO without the division by the group std.

    A_i = s_i - mean_group(s): "grpo" with `scale_rewards="none"` (TRL's name). Dividing by the std up-weights
    prompts that are almost always solved or failed; the paper removes it along with the 1/|o_i| length
    normalisation (that part is the "seq-mean-token-sum-norm" aggregation). returns = s_i at every valid token.
    """
    return _group_relative(inp, "none", "dr_grpo")


@register_estimator("reinforce_pp")
def reinforce_pp(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++, Hu 2025, arXiv 2501.03262: discounted return-to-go, then global advantage normalisation.

    G_t = Σ_{s≥t} γ^{s-t} r_s over the valid tokens (per-token rewards carrying the k1 KL penalty and the score),
    then whitened over all valid tokens of the batch (mean 0, unbiased variance 1). returns = G_t (before whitening).
    """
    _scale_mode(inp, "reinforce_pp", None)
    mask = inp.response_mask.bool()
    return _whitened_return_to_go(inp.rewards.float(), mask, inp.gamma, inp.all_reduce)


@register_estimator("reinforce_pp_baseline")
def reinforce_pp_baseline(inp: AdvantageInput) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline, Hu 2025, arXiv 2501.03262: for k samples per prompt, the group-mean score
    is subtracted from each sample's score (at its last valid token) before the return-to-go and the global
    normalisation of "reinforce_pp" (and divided by the group's or batch's std with `scale_rewards` group or batch).
    returns = the return-to-go after the baseline.
    """
    mask = inp.response_mask.bool()
    group_ids = _require(inp.group_ids, "group_ids", "reinforce_pp_baseline")
    scores = inp.scores.float()
    mean, _, _ = group_stats(scores, group_ids)
    centred = _scaled(scores - mean, scores, group_ids, inp, "none", "reinforce_pp_baseline")
    rewards = inp.rewards.float() + _last_valid(mask) * (centred - scores).unsqueeze(-1)  # the score, centred (B, R)
    return _whitened_return_to_go(rewards, mask, inp.gamma, inp.all_reduce)
