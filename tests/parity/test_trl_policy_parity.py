"""Parity with TRL on the same seeded tensors: PPO clipped surrogate, value loss, GAE, GRPO's loss types and the
GRPO/RLOO advantages — losses, gradients and metrics to 1e-5.

Where the TRL code is called (installed trl==1.16.0):
  - `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py, lines 3020-3290), on an `object.__new__(GRPOTrainer)`
    carrying the attributes it reads, with `_get_per_token_logps_and_entropies` stubbed to return our log-probs
    (a leaf tensor, so gradients are compared) and an identity accelerator. Loss types "grpo", "bnpo", "dr_grpo",
    "dapo", with and without the k3 KL term, symmetric and asymmetric (Clip-Higher) clipping.
  - `trl.trainer.utils.nanstd`, inside the advantage transcriptions below.

Faithful transcriptions (the math is inline in a training loop, so it cannot be called; we copy the lines verbatim,
renaming only the loop's local variables into function arguments):
  - GRPO advantages: trl/trainer/grpo_trainer.py (1.16.0) lines 2761-2788, `_generate_and_score_completions`, the
    "sum_then_normalize" branch with one reward function.
  - RLOO advantages: trl/trainer/rloo_trainer.py (1.16.0) lines 1663-1699, KL in the reward and the leave-one-out
    baseline.
  - PPO: TRL 1.16.0 ships no PPO trainer. We transcribe huggingface/trl `trl/experimental/ppo/ppo_trainer.py` at commit
    0062ee10a9bc59dbb7ba244f3bbaf2e81f25196f (the last TRL PPO trainer): the module helpers `masked_mean`,
    `masked_var`, `masked_whiten` (about lines 77-110) and, inside `PPOTrainer.train`, the blocks "# 4. compute rewards"
    through "# 6. compute advantages and returns" (reward placement, GAE loop, whitening) and the micro-batch loss
    (`vpredclipped` ... `approxkl`). Line numbers of the train loop were not recorded; the block comments locate them.

Deliberate differences, adapted here:
  - Reward placement: TRL's PPO puts the score at `sequence_lengths + 1`, one past the last non-padding token, and
    keeps values and rewards valid up to there (`padding_mask_p1`). We place the score at the last valid token of the
    mask we are given; passing TRL's p1 mask reproduces TRL's rewards exactly (tested).
  - GAE: TRL runs the recursion over the full width on zero-filled padding; ours skips invalid positions. Identical
    on TRL's zero-filled inputs (tested); ours also handles holes and left padding.
  - approx-KL: TRL logs `0.5 * (logprobs_diff**2).mean()` over all positions including padding (where it is 0); ours
    is per token, and the trainer takes its masked mean over valid tokens. Same numerator (tested), different
    denominator.
  - RLOO: TRL 1.16's RLOO clips a *sequence-level* ratio exp(Σ log π - Σ log π_old); ours clips per token, like PPO.
    Only the advantages are compared. TRL's `normalize_advantages` whitens per sequence with eps 1e-4; our `whiten`
    whitens over valid tokens (REINFORCE++'s global normalisation), so it is not compared either.
  - log-ratio clamp: ours clamps log ρ to [-20, 20]; the random inputs here stay far inside.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from rlhfkit.advantages import AdvantageInput, compute_advantages, per_token_rewards  # noqa: E402
from rlhfkit.losses.aggregate import aggregate  # noqa: E402
from rlhfkit.losses.policy import ppo_policy_loss, value_loss  # noqa: E402
from rlhfkit.kl import kl_penalty  # noqa: E402
from rlhfkit.ops import masked_mean, masked_sum, masked_whiten  # noqa: E402
from parity_helpers import TOL, IdentityAccelerator, assert_loss_and_grads_match, leaf

B, R = 8, 10
INVALID_LOGPROB = 1.0  # TRL PPO's fill value for padding log-probs


# ---------------------------------------------------------------------------------------------------------------
# Transcription: TRL experimental PPO (commit 0062ee10), module helpers, about lines 77-110.


def trl_masked_mean(values, mask, axis=None):
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    else:
        return (values * mask).sum() / mask.sum()


def trl_masked_var(values, mask, unbiased=True):
    mean = trl_masked_mean(values, mask)
    centered_values = values - mean
    variance = trl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("mask_sum is zero")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def trl_masked_whiten(values, mask, shift_mean=True):
    mean, var = trl_masked_mean(values, mask), trl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


# Transcription: `PPOTrainer.train`, "# 4. compute rewards" to "# 6. compute advantages and returns".


def trl_ppo_rewards_and_gae(logprobs, ref_logprobs, values, scores, sequence_lengths, kl_coef, gamma, lam):
    responses_width = logprobs.shape[1]
    response_idxs = torch.arange(responses_width).repeat(logprobs.shape[0], 1)
    padding_mask = response_idxs > sequence_lengths.unsqueeze(1)
    logprobs = torch.masked_fill(logprobs, padding_mask, INVALID_LOGPROB)
    ref_logprobs = torch.masked_fill(ref_logprobs, padding_mask, INVALID_LOGPROB)
    sequence_lengths_p1 = sequence_lengths + 1
    padding_mask_p1 = response_idxs > (sequence_lengths_p1.unsqueeze(1))
    values = torch.masked_fill(values, padding_mask_p1, 0)

    # 4. compute rewards (kl_estimator="k1")
    logr = ref_logprobs - logprobs
    kl = -logr
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    actual_start = torch.arange(rewards.size(0), device=rewards.device)
    actual_end = torch.where(sequence_lengths_p1 < rewards.size(1), sequence_lengths_p1, sequence_lengths)
    rewards[actual_start, actual_end] += scores

    # 6. compute advantages and returns
    lastgaelam = 0
    advantages_reversed = []
    gen_length = responses_width
    for t in reversed(range(gen_length)):
        nextvalues = values[:, t + 1] if t < gen_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    raw_advantages = torch.stack(advantages_reversed[::-1], axis=1)
    returns = raw_advantages + values
    advantages = trl_masked_whiten(raw_advantages, ~padding_mask)
    advantages = torch.masked_fill(advantages, padding_mask, 0)
    return dict(
        logprobs=logprobs, ref_logprobs=ref_logprobs, values=values, rewards=rewards, raw_advantages=raw_advantages,
        advantages=advantages, returns=returns, padding_mask=padding_mask, padding_mask_p1=padding_mask_p1,
    )


# Transcription: the micro-batch loss of `PPOTrainer.train` (`vpredclipped` ... `approxkl`).


def trl_ppo_micro_batch_loss(new_logprobs, mb_logprobs, mb_advantage, vpred, mb_values, mb_return, padding_mask,
                             padding_mask_p1, cliprange, cliprange_value):
    new_logprobs = torch.masked_fill(new_logprobs, padding_mask, INVALID_LOGPROB)
    vpred = torch.masked_fill(vpred, padding_mask_p1, 0)
    vpredclipped = torch.clamp(vpred, mb_values - cliprange_value, mb_values + cliprange_value)
    vf_losses1 = torch.square(vpred - mb_return)
    vf_losses2 = torch.square(vpredclipped - mb_return)
    vf_loss_max = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * trl_masked_mean(vf_loss_max, ~padding_mask_p1)
    vf_clipfrac = trl_masked_mean((vf_losses2 > vf_losses1).float(), ~padding_mask_p1)
    logprobs_diff = new_logprobs - mb_logprobs
    ratio = torch.exp(logprobs_diff)
    pg_losses = -mb_advantage * ratio
    pg_losses2 = -mb_advantage * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss_max = torch.max(pg_losses, pg_losses2)
    pg_loss = trl_masked_mean(pg_loss_max, ~padding_mask)
    pg_clipfrac = trl_masked_mean((pg_losses2 > pg_losses).float(), ~padding_mask)
    approxkl = 0.5 * (logprobs_diff**2).mean()
    return pg_loss, vf_loss, pg_clipfrac, vf_clipfrac, approxkl


def ppo_rollout(seed: int):
    g = torch.Generator().manual_seed(seed)
    sequence_lengths = torch.randint(0, R, (B,), generator=g)  # index of the last real token
    sequence_lengths[:2] = torch.tensor([R - 1, R - 2])  # a full row, and one whose p1 position is the last column
    return dict(
        logprobs=-torch.rand(B, R, generator=g) * 3,
        ref_logprobs=-torch.rand(B, R, generator=g) * 3,
        values=torch.randn(B, R, generator=g),
        scores=torch.randn(B, generator=g) * 2,
        sequence_lengths=sequence_lengths,
    )


# ---------------------------------------------------------------------------------------------------------------
# PPO: rewards, GAE, policy loss, value loss


@pytest.mark.parametrize(("seed", "gamma", "lam"), [(0, 1.0, 0.95), (1, 0.99, 0.9), (2, 1.0, 1.0)])
def test_ppo_rewards_and_gae_match_trl(seed, gamma, lam):
    roll = ppo_rollout(seed)
    theirs = trl_ppo_rewards_and_gae(**roll, kl_coef=0.05, gamma=gamma, lam=lam)
    valid_p1 = ~theirs["padding_mask_p1"]  # TRL's reward/value region: through one past the last real token

    kl = kl_penalty(theirs["logprobs"], theirs["ref_logprobs"], "k1")
    rewards = per_token_rewards(roll["scores"], kl, valid_p1, kl_coef=0.05)
    torch.testing.assert_close(rewards, torch.where(valid_p1, theirs["rewards"], 0.0), **TOL)

    data = AdvantageInput(
        rewards=rewards, scores=roll["scores"], response_mask=valid_p1, values=theirs["values"], gamma=gamma, lam=lam
    )
    advantages, returns = compute_advantages("gae", data)
    torch.testing.assert_close(advantages, torch.where(valid_p1, theirs["raw_advantages"], 0.0), **TOL)
    torch.testing.assert_close(returns, torch.where(valid_p1, theirs["returns"], 0.0), **TOL)
    # TRL whitens over the real tokens only (padding_mask, not p1).
    torch.testing.assert_close(masked_whiten(advantages, ~theirs["padding_mask"]), theirs["advantages"], **TOL)


def test_gae_with_whiten_matches_trl_without_padding():
    roll = ppo_rollout(3)
    roll["sequence_lengths"] = torch.full((B,), R - 1)
    theirs = trl_ppo_rewards_and_gae(**roll, kl_coef=0.1, gamma=1.0, lam=0.95)
    full = torch.ones(B, R, dtype=torch.bool)
    data = AdvantageInput(
        rewards=theirs["rewards"], scores=roll["scores"], response_mask=full, values=theirs["values"], whiten=True
    )
    advantages, returns = compute_advantages("gae", data)
    torch.testing.assert_close(advantages, theirs["advantages"], **TOL)
    torch.testing.assert_close(returns, theirs["returns"], **TOL)


@pytest.mark.parametrize(("seed", "cliprange", "cliprange_value"), [(0, 0.2, 0.2), (1, 0.1, 0.05)])
def test_ppo_policy_and_value_loss_match_trl(seed, cliprange, cliprange_value):
    roll = ppo_rollout(seed)
    theirs = trl_ppo_rewards_and_gae(**roll, kl_coef=0.05, gamma=1.0, lam=0.95)
    g = torch.Generator().manual_seed(seed + 50)
    # New log-probs and values near the old ones, so that some tokens clip and some do not.
    new_logprobs = leaf(roll["logprobs"] + torch.randn(B, R, generator=g) * 0.3)
    vpred = leaf(theirs["values"] + torch.randn(B, R, generator=g) * 0.3)
    valid, valid_p1 = ~theirs["padding_mask"], ~theirs["padding_mask_p1"]

    pg_loss, vf_loss, pg_clipfrac, vf_clipfrac, approxkl = trl_ppo_micro_batch_loss(
        new_logprobs, theirs["logprobs"], theirs["advantages"], vpred, theirs["values"], theirs["returns"],
        theirs["padding_mask"], theirs["padding_mask_p1"], cliprange, cliprange_value,
    )
    ours_pg, pg_metrics = ppo_policy_loss(
        new_logprobs, theirs["logprobs"], theirs["advantages"], clip_eps=cliprange
    )
    ours_vf, vf_metrics = value_loss(vpred, theirs["values"], theirs["returns"], clip_range_value=cliprange_value)

    assert_loss_and_grads_match(aggregate(ours_pg, valid, "token-mean"), pg_loss, [new_logprobs])
    assert_loss_and_grads_match(aggregate(ours_vf, valid_p1, "token-mean"), vf_loss, [vpred])
    assert 0 < pg_clipfrac < 1 and 0 < vf_clipfrac < 1  # both branches exercised
    torch.testing.assert_close(masked_mean(pg_metrics["clipfrac"], valid), pg_clipfrac, **TOL)
    torch.testing.assert_close(masked_mean(vf_metrics["clipfrac"], valid_p1), vf_clipfrac, **TOL)
    # Same numerator; TRL divides by every position (B·R), we by the valid tokens.
    torch.testing.assert_close(masked_sum(pg_metrics["approxkl"], valid) / (B * R), approxkl, **TOL)


def test_masked_whiten_matches_trl():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(B, R, generator=g) * 4 + 1
    mask = torch.rand(B, R, generator=g) > 0.3
    for shift_mean in (True, False):
        theirs = trl_masked_whiten(x, mask, shift_mean=shift_mean)
        torch.testing.assert_close(masked_whiten(x, mask, shift_mean=shift_mean), torch.where(mask, theirs, 0.0), **TOL)


# ---------------------------------------------------------------------------------------------------------------
# GRPO: TRL's own `_compute_loss`


def trl_grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, *, loss_type, beta, epsilon, epsilon_high,
                  max_completion_length, num_items_in_batch):
    trainer = object.__new__(GRPOTrainer)
    attrs = dict(
        model=types.SimpleNamespace(training=True),
        accelerator=IdentityAccelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        loss_type=loss_type, beta=beta, epsilon_low=epsilon, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, _entropy_bonus_enabled=False, aux_loss_enabled=False,
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
    )
    for name, value in attrs.items():
        setattr(trainer, name, value)
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, R, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,  # (B,)
        "old_per_token_logps": old_logprobs,
        "ref_per_token_logps": ref_logprobs,
        "num_items_in_batch": torch.tensor(float(num_items_in_batch)),
    }
    loss = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    return loss, trainer._metrics["train"]


def grpo_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, R + 1, (B,), generator=g)
    mask = torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, R, generator=g) * 3
    return dict(
        logprobs=leaf(old + torch.randn(B, R, generator=g) * 0.3),
        old_logprobs=old,
        ref_logprobs=old + torch.randn(B, R, generator=g) * 0.2,
        advantages=torch.randn(B, generator=g),
        mask=mask,
    )


# TRL loss_type -> (our aggregation mode, how the global counts are passed).
TRL_LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",  # local token count = our default
    "dapo": "token-mean",  # global token count of the accumulated batch = our num_tokens
    "dr_grpo": "seq-mean-token-sum-norm",  # max_completion_length = our max_len
}


@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_TYPES))
@pytest.mark.parametrize(("beta", "epsilon_high"), [(0.0, 0.2), (0.04, 0.28)])
def test_grpo_loss_types_match_trl(loss_type, beta, epsilon_high):
    batch = grpo_batch(seed=len(loss_type) + int(beta * 100))
    mask = batch["mask"]
    max_completion_length = R + 6  # TRL's constant, larger than this batch's width
    num_items_in_batch = int(mask.sum()) + 37  # DAPO: tokens of the whole accumulated batch, not this micro-batch
    theirs, trl_metrics = trl_grpo_loss(
        batch["logprobs"], batch["old_logprobs"], batch["ref_logprobs"], batch["advantages"], mask,
        loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
    )

    per_token_adv = batch["advantages"].unsqueeze(1).expand(B, R)
    loss, metrics = ppo_policy_loss(
        batch["logprobs"], batch["old_logprobs"], per_token_adv, clip_eps=0.2, clip_eps_high=epsilon_high
    )
    if beta:
        loss = loss + beta * kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k3")
    counts = {
        "grpo": {},
        "bnpo": {},
        "dapo": {"num_tokens": num_items_in_batch},
        "dr_grpo": {"max_len": max_completion_length},
    }[loss_type]
    ours = aggregate(loss, mask, TRL_LOSS_TYPES[loss_type], **counts)

    assert_loss_and_grads_match(ours, theirs, [batch["logprobs"]])
    clip_region = masked_mean(metrics["clipfrac"], mask)
    assert 0 < clip_region < 1
    assert clip_region.item() == pytest.approx(trl_metrics["clip_ratio/region_mean"][0], abs=1e-6)
    if beta:
        kl = masked_mean(kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k3"), mask)
        assert kl.item() == pytest.approx(trl_metrics["kl"][0], abs=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Group advantages


def trl_grpo_advantages(rewards, num_generations, scale_rewards):
    """grpo_trainer.py (1.16.0) lines 2761-2788, one reward function of weight 1 (so `rewards` is its output)."""
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


def trl_rloo_advantages(rewards, old_per_token_logps, ref_per_token_logps, completion_mask, beta, num_generations):
    """rloo_trainer.py (1.16.0) lines 1663-1699, normalize_advantages=False, one process (gather = identity)."""
    if beta != 0.0:
        per_token_kl = old_per_token_logps - ref_per_token_logps
        kl = (per_token_kl * completion_mask).sum(-1)
        rewards = rewards - beta * kl
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    baselines = baselines.view(-1)
    advantages = rewards - baselines
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("num_generations", [2, 4])
def test_grpo_and_dr_grpo_advantages_match_trl(num_generations):
    g = torch.Generator().manual_seed(num_generations)
    scores = torch.randint(0, 3, (B,), generator=g).float() + torch.randn(B, generator=g) * 0.1
    mask = torch.arange(R).unsqueeze(0) < torch.randint(1, R + 1, (B, 1), generator=g)
    group_ids = torch.arange(B // num_generations).repeat_interleave(num_generations)
    for name, scale_rewards in [("grpo", "group"), ("dr_grpo", "none")]:
        data = AdvantageInput(rewards=torch.zeros(B, R), scores=scores, response_mask=mask, group_ids=group_ids)
        advantages, _ = compute_advantages(name, data)
        theirs = trl_grpo_advantages(scores, num_generations, scale_rewards)
        torch.testing.assert_close(advantages, torch.where(mask, theirs.unsqueeze(1), 0.0), **TOL)


@pytest.mark.parametrize(("num_generations", "beta"), [(2, 0.05), (4, 0.0), (4, 0.1)])
def test_rloo_advantages_match_trl(num_generations, beta):
    g = torch.Generator().manual_seed(num_generations + int(beta * 100))
    scores = torch.randn(B, generator=g)
    mask = torch.arange(R).unsqueeze(0) < torch.randint(1, R + 1, (B, 1), generator=g)
    old, ref = -torch.rand(B, R, generator=g) * 3, -torch.rand(B, R, generator=g) * 3
    group_ids = torch.arange(B // num_generations).repeat_interleave(num_generations)

    rewards = per_token_rewards(scores, kl_penalty(old, ref, "k1"), mask, kl_coef=beta)
    data = AdvantageInput(rewards=rewards, scores=scores, response_mask=mask, group_ids=group_ids)
    advantages, _ = compute_advantages("rloo", data)
    theirs = trl_rloo_advantages(scores, old, ref, mask.long(), beta, num_generations)
    torch.testing.assert_close(advantages, torch.where(mask, theirs.unsqueeze(1), 0.0), **TOL)
