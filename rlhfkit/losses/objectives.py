"""The registry of policy objectives: one pure function per objective, chosen by `algo.policy_loss`.

An objective maps (log π, log π_old, A, mask) to a per-token loss (B, R), UNREDUCED, and detached metrics; the
reduction is `losses.aggregate`'s. The trainer calls `get_objective(name).fn` and never branches on the name: adding
an objective is one function and one `register_objective` line (docs/objectives.md lists them all). The families
register themselves when imported: `losses.policy_clip` (PPO clip, GSPO, GSPO-token, LUSPO, GMPO, SAPO),
`losses.policy_weighted` (CISPO, DPPO, VESPO), `losses.policy_cov` (Clip-Cov, KL-Cov); `losses.policy` imports them
all, so read the registry through it.

Shared conventions of every objective function `fn(logprobs, old_logprobs, advantages, mask, params)`:
  - logprobs (B, R) log π_θ of the sampled tokens (requires grad); old_logprobs (B, R) log π_old (rollout time);
    advantages (B, R), per token (a sequence-level objective reads one value per sequence: the masked mean of its
    row, exact for the group estimators whose advantage is the same at every token); mask (B, R) the tokens that count.
  - The loss is (B, R) fp32. A sequence-level objective returns its per-sequence loss broadcast over the row, so
    that the reduction sees the same numbers TRL's (B, 1) tensors give under `(loss * mask)`.
  - Metrics are detached; each is (B, R) (read by its masked mean over tokens) or (B, 1) (one value per sequence,
    read by its mean over sequences, as TRL logs sequence-level figures). Every objective returns "ratio" (the
    importance weight it uses, token or sequence), "clipfrac" (the share of the loss it clipped, capped, gated off or
    masked: 0 wherever π = π_old, see each objective) and "approxkl" (½ (log π - log π_old)², per token).
  - log ρ is clamped to [-20, 20] before exp (`ops.LOG_RATIO_CLAMP`): inside that range, every sane rollout, the
    numbers are TRL's.

This module imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlhfkit.ops import LOG_RATIO_CLAMP

LEVELS = ("token", "sequence")
# The advantage estimators whose advantage is one number per sequence (broadcast over its tokens): the only ones a
# sequence-level ratio can be paired with. GAE and REINFORCE++'s return-to-go differ from token to token.
SEQUENCE_ADVANTAGE_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo"})


@dataclass(frozen=True)
class ObjectiveParams:
    """The hyperparameters an objective may read (`algo.*` of the same names; see `rlhfkit.config.stages`)."""

    level: str = "token"  # the importance ratio: "token" ρ_t, or "sequence" s_i = exp(mean_t log ρ_t)
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # None = clip_eps
    dual_clip: float | None = None
    delta: float | None = None
    ratio_cap: float | None = None  # None = the objective's own default
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    dppo_threshold: float | None = None  # None = the variant's default
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


ObjectiveFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, ObjectiveParams],
                       tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Objective:
    """One registered objective.

    Fields:
        name: the `algo.policy_loss` value.
        fn: the pure function (see the module docstring).
        levels: the importance-sampling levels it accepts, its own default first.
        uses: the `algo.*` hyperparameters it reads; a non-default value of another objective's is refused.
        loss_agg: the reduction it is defined with (the paper's, TRL's), used unless `algo.loss_agg` says otherwise;
            None = the algorithm's default.
        sequence_advantage_levels: the levels at which it reads one advantage per sequence (refused there with GAE and
            REINFORCE++, whose advantage differs from token to token).
        token_masks: a token mask (top-entropy) selects tokens of its loss; False where the loss is one number per
            sequence that a token mask would only rescale (GMPO).
        takes_is_weights: it folds the rollout correction's weights into its own (keyword `is_weights`) instead of
            having its loss multiplied by them.
    """

    name: str
    fn: ObjectiveFn
    levels: tuple[str, ...] = ("token",)
    uses: frozenset[str] = frozenset()
    loss_agg: str | None = None
    sequence_advantage_levels: tuple[str, ...] = ("sequence",)
    token_masks: bool = True
    takes_is_weights: bool = False


OBJECTIVES: dict[str, Objective] = {}


def register_objective(objective: Objective) -> Objective:
    """Add `objective` under its name; a duplicate name raises ValueError."""
    if objective.name in OBJECTIVES:
        raise ValueError(f"policy objective {objective.name!r} is already registered")
    if not objective.levels or set(objective.levels) - set(LEVELS):
        raise ValueError(f"{objective.name}: levels must be a non-empty subset of {LEVELS}")
    OBJECTIVES[objective.name] = objective
    return objective


def get_objective(name: str) -> Objective:
    """The objective registered under `name`; KeyError naming the known ones otherwise."""
    if name not in OBJECTIVES:
        raise KeyError(f"unknown policy objective {name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


# Shared pieces --------------------------------------------------------------------------------------------------------


def log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, R) log ρ = log π - log π_old in fp32, clamped to ±LOG_RATIO_CLAMP (exp stays finite)."""
    return (logprobs.float() - old_logprobs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) -> (B, 1): the mean over each row's masked tokens (an empty row gives 0, its count clamped to 1)."""
    m = mask.float()
    return ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def importance_log_weight(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log importance weight at `level`: log ρ_t (B, R), or GSPO's log s_i = mean_t log ρ_t (B, 1)
    (Zheng et al. 2025, arXiv 2507.18071, eq. 7)."""
    if level == "token":
        return log_rho
    if level == "sequence":
        return sequence_mean(log_rho, mask)
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def sequence_advantage(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, R) -> (B, 1): one advantage per sequence, the masked mean of its row (exact when it is constant)."""
    return sequence_mean(advantages.float(), mask)


def base_metrics(log_rho: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor) -> dict[str, torch.Tensor]:
    """The three metrics every objective returns, detached."""
    return {"ratio": ratio.detach(), "clipfrac": clipped.detach().float(), "approxkl": 0.5 * log_rho.detach() ** 2}
