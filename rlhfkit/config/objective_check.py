"""The rules that join the policy objective's settings (`algo.policy_loss` and its hyperparameters, the masks, the
rollout correction, adaptive entropy) to each other and to the algorithm: every setting works or is refused here,
in one line, before a model loads. What each objective accepts is read from its registry entry
(`rlhfkit.losses.objectives.Objective`), never from a list kept here.
"""

from __future__ import annotations

import dataclasses

# The hyperparameters some objective reads: a non-default value is refused unless the chosen objective reads it.
OBJECTIVE_FIELDS = ("clip_eps", "clip_eps_high", "dual_clip", "delta", "ratio_cap", "sapo_temperature_pos",
                    "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
                    "dppo_threshold", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef")
ADAPTIVE_FIELDS = ("entropy_target", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta")


def effective_level(options) -> str:
    """The importance-sampling level a config runs at: `algo.importance_sampling_level`, or the objective's own."""
    from rlhfkit.losses.policy import get_objective

    return options.importance_sampling_level or get_objective(options.policy_loss).levels[0]


def objective_refusals(options):
    """(field, why) for each setting of `options` (an `OnlineOptions`) that cannot work as given."""
    from rlhfkit.algorithms import ALGORITHMS
    from rlhfkit.losses.objectives import SEQUENCE_ADVANTAGE_ESTIMATORS
    from rlhfkit.losses.policy import OBJECTIVES

    spec, defaults = OBJECTIVES[options.policy_loss], type(options)()
    level = effective_level(options)
    if level not in spec.levels:
        yield "importance_sampling_level", (f"must be one of {', '.join(spec.levels)} with policy_loss={spec.name}, "
                                            f"got {level!r}")
    for name in OBJECTIVE_FIELDS:
        if getattr(options, name) != getattr(defaults, name) and name not in spec.uses:
            readers = sorted(o.name for o in OBJECTIVES.values() if name in o.uses)
            yield name, f"applies to policy_loss {', '.join(readers)}, not {spec.name}: leave it at its default"
    algorithm = ALGORITHMS.get(options.algorithm)
    if algorithm is not None and level in spec.sequence_advantage_levels \
            and algorithm.advantage not in SEQUENCE_ADVANTAGE_ESTIMATORS:
        yield "policy_loss", (f"{spec.name} at the {level} level reads one advantage per sequence, and "
                              f"{algorithm.name}'s advantage ({algorithm.advantage}) differs from token to token: use a "
                              "group estimator (grpo, rloo, ...), or gspo_token / a token-level objective")
    if algorithm is not None and options.bias_corrected_kl and not algorithm.kl_in_loss:
        yield "bias_corrected_kl", f"corrects a KL term in the loss, and {algorithm.name} has none (it needs grpo's kl_in_loss)"
    if options.top_entropy_quantile < 1 and not spec.token_masks:
        yield "top_entropy_quantile", f"selects tokens of a per-token loss; {spec.name}'s is one number per sequence"
    yield from entropy_refusals(options, defaults)
    yield from correction_refusals(options, defaults, spec)


def entropy_refusals(options, defaults):
    if not options.adaptive_entropy:
        for name in ADAPTIVE_FIELDS:
            if getattr(options, name) != getattr(defaults, name):
                yield name, "applies only with algo.adaptive_entropy=true"
    elif not options.entropy_coef_min <= options.entropy_coef <= options.entropy_coef_max:
        yield "entropy_coef", (f"is the adaptive coefficient's start: must lie in [entropy_coef_min, entropy_coef_max] = "
                               f"[{options.entropy_coef_min}, {options.entropy_coef_max}], got {options.entropy_coef}")


def correction_refusals(options, defaults, spec):
    mode = options.rollout_correction
    if mode == "none":
        for name in ("rollout_correction_min", "rollout_correction_max"):
            if getattr(options, name) != getattr(defaults, name):
                yield name, "applies only with algo.rollout_correction (token_truncate, token_mask, sequence_*)"
        return
    if options.old_logprob_source == "sampler":
        yield "rollout_correction", ("weighs π_old (the training forward) against the sampler's log-probs, and with "
                                     "old_logprob_source=sampler they are the same: the ratio π/π_sampler already "
                                     "corrects the mismatch; use old_logprob_source auto or recompute")
    low, high = options.rollout_correction_min, options.rollout_correction_max
    if low is None and high is None:
        yield "rollout_correction_max", f"or rollout_correction_min is needed: {mode} needs a bound"
    elif low is not None and high is not None and not low < high:
        yield "rollout_correction_min", f"must be below rollout_correction_max ({high}), got {low}"
    if spec.takes_is_weights and mode.startswith("sequence"):
        yield "rollout_correction", f"must be token_truncate or token_mask with {spec.name} (it folds per-token weights into its own)"


def objective_params(options):
    """The `ObjectiveParams` of a validated `OnlineOptions`: its fields of the same names, at the effective level."""
    from rlhfkit.losses.objectives import ObjectiveParams

    names = {f.name for f in dataclasses.fields(ObjectiveParams)} - {"level"}
    return ObjectiveParams(level=effective_level(options), **{n: getattr(options, n) for n in names})
