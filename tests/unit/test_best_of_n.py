"""Best-of-n pieces by hand: the analytic KL of best-of-n sampling and the per-group selection."""

import math

import pytest
import torch

from rlhfkit.evaluation.metrics import best_of_n_kl
from rlhfkit.trainers.best_of_n import select_best


def test_best_of_n_kl_hand_values():
    assert best_of_n_kl(1) == 0.0  # best of one sample is the policy itself
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5, abs=1e-12)  # 0.19315
    assert best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75, abs=1e-12)  # 0.63629
    assert best_of_n_kl(4) == pytest.approx(0.6362943611, abs=1e-9)


def test_best_of_n_kl_grows_like_log_n_and_rejects_n_below_one():
    values = [best_of_n_kl(n) for n in range(1, 65)]
    assert all(b > a for a, b in zip(values, values[1:]))
    assert best_of_n_kl(64) < math.log(64)
    with pytest.raises(ValueError):
        best_of_n_kl(0)


def _best_of_n_pmf(base: torch.Tensor, n: int) -> torch.Tensor:
    """The exact distribution of best-of-n over outcomes with distinct rewards, listed worst to best: the best of n
    draws is outcome i when all n fall in outcomes <= i but not all in outcomes < i, so p_i = F_i^n - F_{i-1}^n."""
    cdf = base.double().cumsum(0)
    return cdf**n - torch.cat([cdf.new_zeros(1), cdf[:-1]]) ** n


def test_best_of_n_kl_is_the_exact_kl_in_the_limit_and_bounds_it_below():
    # The exact distribution, first checked against best-of-n sampling itself (200k draws of n, keep the best).
    gen = torch.Generator().manual_seed(0)
    base = torch.tensor([0.4, 0.1, 0.3, 0.2])
    draws = torch.multinomial(base.expand(200_000, -1), 4, replacement=True, generator=gen)
    measured = torch.bincount(draws.max(1).values, minlength=4).double() / 200_000
    torch.testing.assert_close(measured, _best_of_n_pmf(base, 4), atol=4e-3, rtol=0)

    kl = lambda p, q: float((p * (p / q.double()).log()).sum())  # noqa: E731
    for n in (2, 4, 16):
        # Many equally likely outcomes approach a continuous reward: the exact KL tends to log n - (n-1)/n ...
        uniform = torch.full((100_000,), 1e-5)
        assert kl(_best_of_n_pmf(uniform, n), uniform) == pytest.approx(best_of_n_kl(n), abs=1e-3)
        # ... and with few outcomes it is below (Beirami et al. 2024, Theorem 3.1): the formula is an upper bound.
        for base in (torch.full((2,), 0.5), torch.tensor([0.4, 0.1, 0.3, 0.2]), torch.tensor([0.05, 0.05, 0.9])):
            assert 0.0 < kl(_best_of_n_pmf(base, n), base) < best_of_n_kl(n)


def test_select_best_per_group():
    scores = torch.tensor([0.1, 0.7, 0.3, -1.0, -2.0, -0.5, 5.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    assert select_best(scores, group_ids).tolist() == [1, 5, 6]


def test_select_best_ties_go_to_the_lowest_index():
    scores = torch.tensor([2.0, 3.0, 3.0, 1.0, 1.0, 1.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    assert select_best(scores, group_ids).tolist() == [1, 3]


def test_select_best_groups_need_not_be_adjacent_and_nan_never_wins():
    scores = torch.tensor([float("nan"), 0.0, -3.0, float("nan"), float("nan"), -1.0])
    group_ids = torch.tensor([0, 1, 0, 1, 2, 2])
    assert select_best(scores, group_ids).tolist() == [2, 1, 5]
    # A group of NaNs only: its lowest index, which the trainer then drops as non-finite.
    assert select_best(torch.tensor([float("nan"), float("nan")]), torch.tensor([0, 0])).tolist() == [0]


def test_select_best_with_one_sample_per_group_is_the_identity():
    assert select_best(torch.tensor([0.3, -0.2, 0.9]), torch.tensor([0, 1, 2])).tolist() == [0, 1, 2]


def test_best_of_n_is_made_of_parts_and_keeps_each_prompts_best(tmp_path):
    """`BestOfN` takes the parts every sampling loop uses (a scripted rollout component, the reward sources, a
    one-process run), never the trainer: two prompts, two samples each, scores 1, 3 | 2, 2 by hand; each prompt's best
    (a tie to the lower index) is kept with its prompt tokens unlabelled."""
    from rlhfkit.config import RFTConfig, load_config
    from rlhfkit.model_sources import build_tiny_tokenizer
    from rlhfkit.rewards import Rewards
    from rlhfkit.trainers.best_of_n import BestOfN
    from rlhfkit.trainers.sampling import Sampling
    from tests.scripted import OneProcess
    from tests.unit.test_experience_maker import POLICY, ScriptedRollout, TableLM, fixed_scores

    class Run(OneProcess):
        def permutation(self, n, epoch):
            return torch.arange(n)

        def sharded(self, model):
            return False

    cfg = load_config(RFTConfig, "configs/rft_tiny.yaml", [f"output_dir={tmp_path}", "generation.num_samples=2",
                                                            "algo.sampling_batch_size=2"])
    rewards = Rewards(cfg.reward, build_tiny_tokenizer(), "cpu", given=[fixed_scores])
    rollout = ScriptedRollout()
    prompts = [{"prompt": p, "prompt_ids": ids, "columns": {}} for p, ids in (("p0", [1, 2]), ("p1", [2, 1]))]
    best_of_n = BestOfN(Sampling(rollout, rewards, None, Run(), 2, 1.0), cfg, prompts, per_iteration=2, total_steps=4)
    kept, stats, samples = best_of_n(TableLM(POLICY), 0, 0)
    assert rollout.calls == 1
    assert kept == [{"input_ids": [1, 2, 1, 3], "labels": [-100, -100, 1, 3]},
                    {"input_ids": [2, 1, 0, 0, 3], "labels": [-100, -100, 0, 0, 3]}]
    assert stats["rft/mean_score_all"] == 2.0 and stats["rft/mean_score_best"] == 2.5
    assert stats["rft/kept"] == 2 and stats["rft/kept_length_avg"] == 2.5
    assert [s["completion"] for s in samples] == ["b", "c"]  # the text the rollout component decoded
