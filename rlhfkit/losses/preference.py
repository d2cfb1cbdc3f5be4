"""Pairwise preference-optimisation losses: DPO (+ cDPO), IPO, hinge (SLiC), SimPO, ORPO.

Every function takes sequence log-probabilities already summed over response tokens, shape (B,), and returns
`(loss, metrics)`: `loss` is per pair, shape (B,), unreduced (the trainer reduces it with global counts so gradient
accumulation is exact); `metrics` holds detached (B,) tensors. All math runs in fp32.

This module imports only torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFERENCE_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def _check_label_smoothing(label_smoothing: float) -> None:
    # ε = 0.5 makes the loss independent of which response is chosen, so nothing is learned.
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")


def _smoothed_logistic_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """-(1-ε) log σ(z) - ε log σ(-z): the logistic loss on a label flipped with probability ε (cDPO)."""
    loss = -F.logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def _pair_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The metrics shared by every pairwise loss, named as TRL logs them; each detached, shape (B,)."""
    chosen_rewards = chosen_rewards.detach()
    rejected_rewards = rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/margins": chosen_rewards - rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
        "logps/chosen": chosen_logprobs.detach(),
        "logps/rejected": rejected_logprobs.detach(),
    }


def preference_loss(
    policy_chosen_logprobs: torch.Tensor,
    policy_rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor | None,
    ref_rejected_logprobs: torch.Tensor | None,
    *,
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reference-anchored pairwise losses on h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l)).

    loss_type:
      - "sigmoid": DPO, Rafailov et al. 2023, arXiv 2305.18290, eq. 7: -log σ(βh). With label_smoothing ε > 0 it is
        conservative DPO (cDPO, Mitchell 2023, "A note on DPO with noisy preferences"):
        -(1-ε) log σ(βh) - ε log σ(-βh).
      - "ipo": IPO, Azar et al. 2023, arXiv 2310.12036, eq. 17: (h - 1/(2β))², β playing the paper's τ.
      - "hinge": the rank-calibration loss of SLiC-HF (Zhao et al. 2023, arXiv 2305.10425, §2) on the DPO log-ratio,
        relu(1 - βh) = β · max(0, 1/β - h), i.e. margin δ = 1/β; the form TRL and the DPO authors' code use.

    IPO's length normalisation, deliberately TRL 1.16's (`DPOTrainer`): given `chosen_lengths` and `rejected_lengths`,
    IPO's h is taken on per-token log-ratios, h = (log π(y_w) - log π_ref(y_w)) / |y_w| - (... y_l) / |y_l|, each
    length clamped at 1 (as TRL does). The paper does not state this normalisation; the IPO authors confirmed it to
    TRL as the form behind their results. Only the loss uses the averages: the metrics stay on the summed log-ratios,
    as TRL logs them. Without lengths, eq. 17 is applied to the summed log-ratios as given.

    Other deliberate differences from TRL 1.16 `DPOTrainer`:
      - cDPO: TRL 1.16's DPO "sigmoid" ignores `label_smoothing` (its smoothed variant is "robust", which also divides
        by 1 - 2ε); here "sigmoid" with ε > 0 is cDPO, the formula of TRL's CPO/SimPO trainer and of earlier TRL DPO.
      - label_smoothing with "ipo" or "hinge" raises instead of being silently ignored.

    Args:
        policy_chosen_logprobs, policy_rejected_logprobs: (B,) log π(y|x) summed over response tokens.
        ref_chosen_logprobs, ref_rejected_logprobs: (B,) the same under the reference model; None only with
            `reference_free=True`, which sets log π_ref ≡ 0 (so h = log π(y_w) - log π(y_l)).
        loss_type: one of "sigmoid", "ipo", "hinge".
        beta: β > 0, the KL-regularisation strength (IPO's τ).
        label_smoothing: ε in [0, 0.5), the assumed probability that a preference label is flipped ("sigmoid" only).
        reference_free: use no reference model (requires both ref log-probs to be None).
        chosen_lengths, rejected_lengths: (B,) response token counts |y| (int or float), "ipo" only, both or neither:
            IPO's h on per-token log-ratios (see above).

    Returns:
        loss: (B,) per pair, unreduced, fp32.
        metrics: detached (B,) tensors "rewards/chosen" = β(log π(y_w) - log π_ref(y_w)), "rewards/rejected",
            "rewards/margins" (chosen - rejected), "rewards/accuracies" (1.0 where chosen > rejected),
            "logps/chosen", "logps/rejected" (the policy's summed log-probs).
    """
    _check_beta(beta)
    _check_label_smoothing(label_smoothing)
    if loss_type not in PREFERENCE_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {PREFERENCE_LOSS_TYPES}, got {loss_type!r}")
    if label_smoothing and loss_type != "sigmoid":
        raise ValueError(f"label_smoothing applies only to loss_type='sigmoid', got loss_type={loss_type!r}")
    refs_given = (ref_chosen_logprobs is not None, ref_rejected_logprobs is not None)
    if reference_free and any(refs_given):
        raise ValueError("reference_free=True takes no reference log-probs; pass ref_*_logprobs=None")
    if not reference_free and not all(refs_given):
        raise ValueError("ref_chosen_logprobs and ref_rejected_logprobs are required unless reference_free=True")
    lengths_given = (chosen_lengths is not None, rejected_lengths is not None)
    if any(lengths_given) and not all(lengths_given):
        raise ValueError("chosen_lengths and rejected_lengths go together: pass both or neither")
    if any(lengths_given) and loss_type != "ipo":
        raise ValueError(f"response lengths apply only to loss_type='ipo', got loss_type={loss_type!r}")

    policy_chosen = policy_chosen_logprobs.float()
    policy_rejected = policy_rejected_logprobs.float()
    if reference_free:
        chosen_logratios, rejected_logratios = policy_chosen, policy_rejected
    else:
        chosen_logratios = policy_chosen - ref_chosen_logprobs.float()  # type: ignore[union-attr]  # (B,)
        rejected_logratios = policy_rejected - ref_rejected_logprobs.float()  # type: ignore[union-attr]  # (B,)
    h = chosen_logratios - rejected_logratios  # (B,)

    if loss_type == "sigmoid":
        loss = _smoothed_logistic_loss(beta * h, label_smoothing)
    elif loss_type == "ipo":
        if chosen_lengths is not None:
            # An empty response has summed log-ratio 0; counting it as one token keeps its average 0 instead of
            # 0/0 = NaN (TRL clamps the same way).
            chosen_avg = chosen_logratios / chosen_lengths.float().clamp(min=1)  # (B,)
            rejected_avg = rejected_logratios / rejected_lengths.float().clamp(min=1)  # type: ignore[union-attr]  # (B,)
            h = chosen_avg - rejected_avg
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        loss = torch.relu(1 - beta * h)

    metrics = _pair_metrics(beta * chosen_logratios, beta * rejected_logratios, policy_chosen, policy_rejected)
    return loss, metrics


def simpo_loss(
    policy_chosen_logprobs: torch.Tensor,
    policy_rejected_logprobs: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO, Meng et al. 2024, arXiv 2405.14734, eq. 6: reference-free, length-normalised, with a target margin γ.

    loss = -log σ(β/|y_w| · log π(y_w|x) - β/|y_l| · log π(y_l|x) - γ)

    With label_smoothing ε > 0 the logistic loss is smoothed as in cDPO: -(1-ε) log σ(z) - ε log σ(-z).

    `gamma` is the paper's γ, the margin in reward units. The SimPO authors' code configures it as
    `gamma_beta_ratio` = γ/β; TRL 1.16's `simpo_gamma` is γ itself (its code subtracts simpo_gamma/β before scaling
    by β), so TRL's `simpo_gamma` equals this `gamma`.

    Args:
        policy_chosen_logprobs, policy_rejected_logprobs: (B,) log π(y|x) summed over response tokens.
        chosen_lengths, rejected_lengths: (B,) response token counts |y| (int or float).
        beta: β > 0, the reward scale.
        gamma: γ, the target reward margin.
        label_smoothing: ε in [0, 0.5).

    Returns:
        loss: (B,) per pair, unreduced, fp32.
        metrics: detached (B,) "rewards/chosen" = β · log π(y_w|x)/|y_w|, "rewards/rejected", "rewards/margins",
            "rewards/accuracies", and "logps/chosen", "logps/rejected" = the summed log-probs as given (TRL's
            CPOTrainer logs the length-averaged ones under these names for SimPO).
    """
    _check_beta(beta)
    _check_label_smoothing(label_smoothing)
    # An empty response has summed log-prob 0; dividing by 1 keeps its average 0 instead of 0/0 = NaN.
    chosen_avg = policy_chosen_logprobs.float() / chosen_lengths.float().clamp(min=1)  # (B,)
    rejected_avg = policy_rejected_logprobs.float() / rejected_lengths.float().clamp(min=1)  # (B,)
    chosen_rewards = beta * chosen_avg
    rejected_rewards = beta * rejected_avg
    loss = _smoothed_logistic_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    metrics = _pair_metrics(
        chosen_rewards, rejected_rewards, policy_chosen_logprobs.float(), policy_rejected_logprobs.float()
    )
    return loss, metrics


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate everywhere (Mächler 2012, "Accurately computing log(1 - exp(-|a|))").

    Branches at x = -ln 2: log(-expm1(x)) near 0, log1p(-exp(x)) below. Each branch only sees inputs from its own
    side, so the branch torch.where discards cannot produce an inf whose 0-weighted gradient would become NaN.
    """
    threshold = -0.6931471805599453  # -ln 2
    near_zero = x > threshold
    x_near = torch.where(near_zero, x, torch.full_like(x, threshold))
    x_far = torch.where(near_zero, torch.full_like(x, threshold), x)
    return torch.where(near_zero, torch.log(-torch.expm1(x_near)), torch.log1p(-torch.exp(x_far)))


def orpo_loss(
    policy_chosen_logprobs: torch.Tensor,
    policy_rejected_logprobs: torch.Tensor,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO, Hong et al. 2024, arXiv 2403.07691, eqs. 4-7: SFT plus an odds-ratio penalty, no reference model.

    loss = L_SFT + λ · L_OR,  L_OR = -log σ(log odds(y_w|x) - log odds(y_l|x)),  odds(y|x) = p / (1 - p)

    where log p is the length-averaged log-prob log π(y|x)/|y| (as in the paper's eq. 4 and its code) and
    log(1 - p) is computed stably as log1mexp(log p).

    Differences from TRL 1.16's experimental `ORPOTrainer` (its `beta` is this λ):
      - `chosen_nll` is whatever per-example NLL the trainer supplies (mean over the chosen response tokens); TRL takes
        one token-mean NLL over the whole chosen batch *including prompt tokens*. Per-example values let the trainer
        reduce with global counts.
      - The average log-probs are clamped at -1e-6 (see below); TRL does not clamp.

    Args:
        policy_chosen_logprobs, policy_rejected_logprobs: (B,) log π(y|x) summed over response tokens.
        chosen_lengths, rejected_lengths: (B,) response token counts.
        chosen_nll: (B,) per-example NLL of the chosen response (the L_SFT term); gradients flow through it.
        beta: β >= 0, the weight of the odds-ratio term (the paper's λ, TRL's ORPO `beta`).

    Returns:
        loss: (B,) per pair, unreduced, fp32.
        metrics: detached (B,) "rewards/chosen" = λ · log π(y_w|x)/|y_w| (TRL logs β · average log-prob, the same
            number since its β is λ), "rewards/rejected", "rewards/margins", "rewards/accuracies",
            "log_odds_ratio" = log σ(log odds(y_w) - log odds(y_l)) = -L_OR and "log_odds_chosen" = log odds(y_w) -
            log odds(y_l) (TRL's names for these two quantities), "nll_loss" = chosen_nll, "logps/chosen",
            "logps/rejected" = the summed log-probs as given (TRL logs the averaged ones).
    """
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    # A log-prob is <= 0, but one computed in low precision can round to 0 or above, where log(1 - p) is -inf or NaN;
    # -1e-6 (p = 1 - 1e-6 per token on average) is beyond any average token probability worth distinguishing.
    chosen_avg = (policy_chosen_logprobs.float() / chosen_lengths.float().clamp(min=1)).clamp(max=-1e-6)  # (B,)
    rejected_avg = (policy_rejected_logprobs.float() / rejected_lengths.float().clamp(min=1)).clamp(max=-1e-6)  # (B,)
    log_odds = (chosen_avg - _log1mexp(chosen_avg)) - (rejected_avg - _log1mexp(rejected_avg))  # (B,)
    log_sigmoid_odds = F.logsigmoid(log_odds)
    nll = chosen_nll.float()
    loss = nll - beta * log_sigmoid_odds

    metrics = _pair_metrics(
        beta * chosen_avg, beta * rejected_avg, policy_chosen_logprobs.float(), policy_rejected_logprobs.float()
    )
    metrics["log_odds_ratio"] = log_sigmoid_odds.detach()
    metrics["log_odds_chosen"] = log_odds.detach()
    metrics["nll_loss"] = nll.detach()
    return loss, metrics
