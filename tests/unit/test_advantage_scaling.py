"""`scale_rewards` (group | batch | none) for every group-relative estimator and GDPO's normalise-then-sum, on hand
values; and the batch statistics over two processes equal one process's (threads standing in for processes)."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from rlhfkit.advantages import AdvantageInput, compute_advantages, normalize_then_sum_advantages

SCORES = torch.tensor([0.0, 1.0, 2.0, 2.0, 5.0])
GROUPS = torch.tensor([0, 0, 1, 1, 1])
MASK = torch.ones(5, 2, dtype=torch.bool)


def per_sequence(name, scale, scores=SCORES, **extra):
    rewards = torch.zeros(len(scores), 2)
    rewards[:, -1] = scores  # the score at the last token: the sequence return of rloo and reinforce_pp
    adv, _ = compute_advantages(name, AdvantageInput(rewards=rewards, scores=scores, response_mask=MASK[:len(scores)],
                                                     group_ids=GROUPS[:len(scores)], eps=0.0, scale_rewards=scale,
                                                     **extra))
    return adv[:, 0]


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)


def test_grpo_group_batch_and_none_by_hand():
    # Centred by the group mean (½ and 3): -½ ½ -1 -1 2. Group stds √½ and √3; batch: mean 2, Σ(x-2)² = 14, /4 → √3.5.
    centred = [-0.5, 0.5, -1.0, -1.0, 2.0]
    close(per_sequence("grpo", "none"), centred)
    close(per_sequence("grpo", "group"), [c / s for c, s in zip(centred, [math.sqrt(.5)] * 2 + [math.sqrt(3)] * 3)])
    close(per_sequence("grpo", "batch"), [c / math.sqrt(3.5) for c in centred])
    close(per_sequence("grpo", None), per_sequence("grpo", "group").tolist())  # grpo's own: group
    close(per_sequence("dr_grpo", None), centred)  # Dr. GRPO: none


def test_rloo_scaled_by_hand():
    # Leave-one-out: group (0, 1) -> -1, 1; group (2, 2, 5) -> 2 - 3.5, 2 - 3.5, 5 - 2.
    loo = [-1.0, 1.0, -1.5, -1.5, 3.0]
    close(per_sequence("rloo", None), loo)  # rloo's own: none
    close(per_sequence("rloo", "group"), [c / s for c, s in zip(loo, [math.sqrt(.5)] * 2 + [math.sqrt(3)] * 3)])
    close(per_sequence("rloo", "batch"), [c / math.sqrt(3.5) for c in loo])


def test_reinforce_pp_baseline_scaled_before_its_global_normalisation():
    # The centred score goes in at the last token; the global whitening then removes any common factor, so group
    # scaling shows only where the groups' stds differ: compare the last tokens' whitened values.
    none, group = per_sequence("reinforce_pp_baseline", "none"), per_sequence("reinforce_pp_baseline", "group")
    assert not torch.allclose(none, group)
    batch = per_sequence("reinforce_pp_baseline", "batch")
    torch.testing.assert_close(batch, none, rtol=0, atol=1e-5)  # one common factor: whitened away


def test_scale_rewards_refused_where_there_is_no_group():
    values = torch.zeros(5, 2)
    for name, scale in (("gae", "group"), ("reinforce_pp", "batch"), ("dr_grpo", "group")):
        with pytest.raises(ValueError, match="takes no scale_rewards"):
            compute_advantages(name, AdvantageInput(rewards=values, scores=SCORES, response_mask=MASK, values=values,
                                                    group_ids=GROUPS, scale_rewards=scale))


def test_normalize_then_sum_by_hand_differs_from_sum_then_normalize():
    # Source 1 (0, 2 | 1, 3) and source 2 (1, 3 | 0, 4), weights (1, 2), groups of 2: every source's z is ∓1/√2, so
    # the weighted sums are ∓3/√2; over the batch mean 0, Bessel std √(4·4.5/3) = √6: A = ∓3/√12 = ∓√3/2.
    sources = torch.tensor([[0.0, 1.0], [2.0, 3.0], [1.0, 0.0], [3.0, 4.0]])
    weights, groups = torch.tensor([1.0, 2.0]), torch.tensor([0, 0, 1, 1])
    half = math.sqrt(3) / 2
    close(normalize_then_sum_advantages(sources, weights, groups, eps=0.0), [-half, half, -half, half])
    # Summed first (2, 8 | 1, 11), each group's std is 3√2 and 5√2: ∓1/√2 whatever the weights.
    adv, _ = compute_advantages("grpo", AdvantageInput(rewards=torch.zeros(4, 1), scores=sources @ weights,
                                                       response_mask=torch.ones(4, 1), group_ids=groups, eps=0.0))
    close(adv[:, 0], [-math.sqrt(.5), math.sqrt(.5)] * 2)


def run_as_two_processes(fn):
    """fn(rank, all_reduce) in two threads whose all_reduce sums a tensor over both, as a process group would."""
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def all_reduce(rank):
        def reduce(x):
            slots[rank] = x.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        return reduce

    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, fn(r, all_reduce(r)))) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return torch.cat(results)


def test_batch_statistics_over_two_processes_equal_one():
    g = torch.Generator().manual_seed(3)
    scores, sources = torch.randn(8, generator=g), torch.randn(8, 2, generator=g)
    sources[3, 1] = float("nan")
    groups, weights, mask = torch.arange(4).repeat_interleave(2), torch.tensor([1.0, 0.5]), torch.ones(8, 1)

    def advantages(rows, all_reduce=None, **extra):
        adv, _ = compute_advantages("grpo", AdvantageInput(rewards=torch.zeros(len(scores[rows]), 1), scores=scores[rows],
                                                           response_mask=mask[rows], group_ids=groups[rows],
                                                           all_reduce=all_reduce, **extra))
        return adv

    halves = [slice(0, 4), slice(4, 8)]  # a prompt's samples stay on one process
    for extra_of in (lambda rows: {"scale_rewards": "batch"},
                     lambda rows: {"source_weights": weights, "source_scores": sources[rows]}):
        one = advantages(slice(0, 8), **extra_of(slice(0, 8)))
        two = run_as_two_processes(lambda rank, reduce: advantages(halves[rank], reduce, **extra_of(halves[rank])))
        torch.testing.assert_close(two, one, rtol=0, atol=1e-6)


REQUIRED = ["model.name_or_path=tiny", "data.train=t.jsonl", "output_dir=o", "reward.function=m:f",
            "generation.num_samples=2"]


@pytest.mark.parametrize(("extra", "key", "message"), [
    (["algo.algorithm=ppo", "algo.scale_rewards=batch"], "algo.scale_rewards", "ppo has no group to scale by"),
    (["algo.algorithm=rloo", "algo.multi_objective_aggregation=normalize_then_sum"], "algo.multi_objective_aggregation",
     "GRPO's"),
    (["algo.algorithm=grpo", "algo.multi_objective_aggregation=normalize_then_sum", "algo.scale_rewards=none"],
     "algo.scale_rewards", "does not apply with normalize_then_sum"),
    (["algo.algorithm=grpo", "algo.multi_objective_aggregation=normalize_then_sum", "reward.normalize=batch"],
     "reward.normalize", "shapes the summed score"),
    (["algo.algorithm=ppo", "algo.dynamic_filtering=true"], "algo.dynamic_filtering", "ppo has no groups"),
    (["algo.algorithm=dapo", "algo.max_sampling_rounds=5"], "algo.max_sampling_rounds", "only with algo.dynamic_filtering"),
])
def test_advantage_options_refused_where_they_do_not_apply(extra, key, message):
    from rlhfkit.config import OnlineConfig, load_config
    from rlhfkit.errors import ConfigError

    with pytest.raises(ConfigError, match=f"config key '{key}' .*{message}"):
        load_config(OnlineConfig, None, REQUIRED + extra)


def test_the_algorithm_default_and_the_setting():
    from rlhfkit.algorithms import get_algorithm

    assert get_algorithm("dr_grpo").scale_rewards == "none" and get_algorithm("grpo").scale_rewards is None
