"""An online RL algorithm is a registered combination: an advantage estimator, the clipped policy loss, whether it
needs a critic and a reference model, where the KL penalty goes, and how the loss is reduced by default.

The trainer reads an `Algorithm` and never branches on its name: adding one is one `register_algorithm` line (plus
an estimator in `rlhfkit.advantages` if it needs a new one). Clip ranges, β and the like are config, not algorithm.

KL placement:
  - kl_in_reward: -β·k1 at every token of the per-token reward (`advantages.per_token_rewards`), the RLHF recipe of
    Ziegler et al. 2019 (arXiv 1909.08593); PPO, RLOO, REINFORCE++.
  - kl_in_loss: +β·k3 added to the per-token policy loss (`kl.kl_penalty(..., "k3")`), GRPO's recipe (Shao et al.
    2024, arXiv 2402.03300, eq. 3-4).
  - neither: no KL term and no reference model (DAPO, Dr. GRPO).

This module imports only torch (through the core modules).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.advantages import ESTIMATORS
from rlhfkit.losses.aggregate import AGG_MODES


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """One online RL method, as the trainer needs to know it (constructed by keyword).

    Fields:
        name: registry key, the `algo.algorithm` of a config.
        family: the CLI command that runs it (`rlhfkit ppo|rloo|grpo|reinforce_pp`); variants share their family's.
        advantage: name of the advantage estimator in `rlhfkit.advantages.ESTIMATORS`.
        needs_value: trains a critic (value head) next to the policy.
        needs_reference: keeps a frozen reference policy for the KL term.
        needs_groups: compares the samples of one prompt (needs `generation.num_samples` >= 2).
        kl_in_reward: k1 KL penalty in the per-token rewards.
        kl_in_loss: k3 KL term in the per-token loss.
        default_loss_agg: `aggregate` mode used unless the config overrides it.
        whiten_by_default: whiten the advantages over the rollout unless `algo.whiten_advantages` says otherwise
            (TRL's PPO does; the group-relative estimators are already normalised).
        scale_rewards: the group-relative estimator's scaling unless `algo.scale_rewards` says otherwise ("group",
            "batch", "none"; None = the estimator's own, `advantages.AdvantageInput.scale_rewards`).
    """

    name: str
    family: str
    advantage: str
    needs_value: bool = False
    needs_reference: bool = False
    needs_groups: bool = False
    kl_in_reward: bool = False
    kl_in_loss: bool = False
    default_loss_agg: str = "token-mean"
    whiten_by_default: bool = False
    scale_rewards: str | None = None

    def __post_init__(self) -> None:
        if self.advantage not in ESTIMATORS:
            known = sorted(ESTIMATORS)
            raise ValueError(f"{self.name}: unknown advantage estimator {self.advantage!r}; known: {known}")
        if self.default_loss_agg not in AGG_MODES:
            raise ValueError(f"{self.name}: default_loss_agg must be one of {AGG_MODES}, got {self.default_loss_agg!r}")
        if self.kl_in_reward and self.kl_in_loss:
            raise ValueError(f"{self.name}: KL goes in the reward or in the loss, not both (it would count twice)")
        if (self.kl_in_reward or self.kl_in_loss) != self.needs_reference:
            raise ValueError(f"{self.name}: a reference model is needed exactly when there is a KL term")


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add `algorithm` to the registry under its name; a duplicate name raises ValueError."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def family_members(family: str) -> tuple[str, ...]:
    """The algorithms a CLI command runs, its namesake first (the default); () for a command that is no family."""
    return tuple(sorted((a.name for a in ALGORITHMS.values() if a.family == family), key=lambda n: (n != family, n)))


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered under `name`; KeyError naming the known ones otherwise."""
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


# PPO for RLHF (Schulman et al. 2017, arXiv 1707.06347; Ziegler et al. 2019): GAE with a critic, k1 KL in the reward,
# token-mean over the batch as TRL's PPO trainer.
register_algorithm(Algorithm(name="ppo", family="ppo", advantage="gae", needs_value=True, needs_reference=True,
                             kl_in_reward=True, whiten_by_default=True))
# RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline, the sequence KL in the reward.
register_algorithm(Algorithm(name="rloo", family="rloo", advantage="rloo", needs_reference=True, needs_groups=True,
                             kl_in_reward=True))
# GRPO (Shao et al. 2024, arXiv 2402.03300, eq. 3): group-normalised advantage, k3 KL in the loss, 1/|o_i| per sequence.
register_algorithm(Algorithm(name="grpo", family="grpo", advantage="grpo", needs_reference=True, needs_groups=True,
                             kl_in_loss=True, default_loss_agg="seq-mean-token-mean"))
# Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): no std scaling (GRPO's estimator with scale_rewards "none"), no length
# normalisation, no KL term.
register_algorithm(Algorithm(name="dr_grpo", family="grpo", advantage="grpo", needs_groups=True, scale_rewards="none",
                             default_loss_agg="seq-mean-token-sum-norm"))
# DAPO (Yu et al. 2025, arXiv 2503.14476): GRPO's advantage, no KL (§2.3), token-level loss (§3.3). Clip-Higher is the
# config's clip_eps_high (0.28 in the paper). Dynamic sampling (§3.2) when the config sets `algo.dynamic_filtering`:
# groups whose samples all scored the same are dropped and more prompts sampled until the step holds
# `algo.rollout_batch_size` groups with signal, for at most `algo.max_sampling_rounds` rounds
# (`trainers.dynamic_sampling`); a step still short trains on what it found, the rest masked out of the loss.
register_algorithm(Algorithm(name="dapo", family="grpo", advantage="grpo", needs_groups=True))
# REINFORCE++ (Hu 2025, arXiv 2501.03262): return-to-go of k1-penalised rewards, globally whitened.
register_algorithm(Algorithm(name="reinforce_pp", family="reinforce_pp", advantage="reinforce_pp", needs_reference=True,
                             kl_in_reward=True))
# REINFORCE++ with a group-mean baseline on the score (same paper), KL placed as in "reinforce_pp".
register_algorithm(Algorithm(name="reinforce_pp_baseline", family="reinforce_pp", advantage="reinforce_pp_baseline",
                             needs_reference=True, needs_groups=True, kl_in_reward=True))
