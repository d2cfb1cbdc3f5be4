"""The rules that join the advantage and reference options to the algorithm, the reward sources and the model:
`algo.scale_rewards` and `algo.multi_objective_aggregation` (the group-relative estimators, `rlhfkit.advantages`),
DAPO's dynamic sampling (`trainers.dynamic_sampling`) and TR-DPO's reference sync (`trainers.ref_sync`). Every setting
works or is refused here, in one line, before a model loads.
"""

from __future__ import annotations


def advantage_check(algo, method, reward):
    """The advantage options each estimator takes: scaling for the group-relative ones, normalise-then-sum for GRPO's,
    dynamic sampling for those that compare a group's samples."""
    group_relative = method.advantage in ("grpo", "rloo", "reinforce_pp_baseline")
    if algo.scale_rewards is not None and not group_relative:
        yield "algo.scale_rewards", (f"applies to the group-relative algorithms (grpo, dapo, dr_grpo, rloo, "
                                     f"reinforce_pp_baseline); {algo.algorithm} has no group to scale by")
    if algo.dynamic_filtering and not method.needs_groups:
        yield "algo.dynamic_filtering", f"drops groups whose samples all scored the same: {algo.algorithm} has no groups"
    if algo.max_sampling_rounds != 3 and not algo.dynamic_filtering:
        yield "algo.max_sampling_rounds", "applies only with algo.dynamic_filtering=true"
    if algo.multi_objective_aggregation == "normalize_then_sum":
        if method.advantage != "grpo":
            yield "algo.multi_objective_aggregation", (f"normalize_then_sum is GRPO's (grpo, dapo, dr_grpo), not "
                                                       f"{algo.algorithm}'s")
        elif algo.scale_rewards is not None:
            yield "algo.scale_rewards", ("does not apply with normalize_then_sum (each source is scaled by its group std "
                                         "and the sum by the batch std)")
        for key, value, default in (("reward.normalize", reward.normalize, "none"), ("reward.clip", reward.clip, None),
                                    ("reward.missing_eos_penalty", reward.missing_eos_penalty, None)):
            if value != default:
                yield key, ("shapes the summed score, which algo.multi_objective_aggregation=normalize_then_sum does not "
                            "use (it normalises each source's own)")


def ref_sync_check(algo, model, has_reference: bool):
    """TR-DPO's reference sync needs a reference model of its own and full fine-tuning: with LoRA the reference is the
    policy's frozen base (or a model whose weights do not match the adapted policy's), so mixing the policy into it is
    not defined (TRL refuses PEFT too). Its two numbers apply only with it."""
    if not algo.sync_ref_model:
        for key, default in (("ref_model_mixup_alpha", 0.6), ("ref_model_sync_steps", 512)):
            if getattr(algo, key) != default:
                yield f"algo.{key}", "applies only with algo.sync_ref_model=true"
        return
    if not has_reference:
        yield "algo.sync_ref_model", f"needs a reference model: {algo.algorithm} trains no KL term"
    elif model.lora.enabled:
        yield "algo.sync_ref_model", ("is not supported with LoRA: the reference is the policy's frozen base, which the "
                                      "adapters sit on, so mixing the policy into it would move the policy as well "
                                      "(TRL refuses it with PEFT too)")
