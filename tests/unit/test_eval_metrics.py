"""Evaluation metrics on hand-computed values."""

import math

import pytest
import torch

from rlhfkit.evaluation.metrics import (
    best_of_n_kl, distinct_n, empty_rate, eos_rate, mean_length, mean_std, pearson, reward_model_accuracy,
    sequence_kl, truncation_rate, win_rate, within_group_accuracy,
)


def test_distinct_n_pools_over_texts_without_crossing_them():
    texts = ["a b a b", "a b"]
    assert distinct_n(texts, 1) == pytest.approx(2 / 6)  # a, b out of a b a b a b
    assert distinct_n(texts, 2) == pytest.approx(2 / 4)  # (a b), (b a) out of ab ba ab | ab: no "b a" across texts
    assert distinct_n(["the cat sat", "a dog ran"], 2) == 1.0
    assert distinct_n(["x", ""], 2) == 0.0  # no bigram at all
    with pytest.raises(ValueError):
        distinct_n(texts, 0)


def test_win_rate_counts_ties_half():
    assert win_rate([1, 2, 3, 4], [0, 2, 5, 1]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert win_rate(torch.tensor([0.3, 0.7]), torch.tensor([0.3, 0.7])) == 0.5
    with pytest.raises(ValueError):
        win_rate([1, 2], [1])
    with pytest.raises(ValueError):
        win_rate([], [])


def test_sequence_kl_sums_k1_over_the_response_only():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, 0.0]])
    ref_logprobs = torch.tensor([[-2.0, -2.0, -1.0], [-1.0, -1.0, -float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = sequence_kl(logprobs, ref_logprobs, mask)
    assert kl.shape == (2,)
    torch.testing.assert_close(kl, torch.tensor([1.0 + 0.0 - 2.0, 0.5 + 0.0]))  # the masked -inf never enters


def test_rates_and_lengths():
    has_eos = [True, False, True, True]
    assert eos_rate(has_eos) == 0.75 and truncation_rate(has_eos) == 0.25
    assert eos_rate(torch.tensor(has_eos)) == 0.75
    assert mean_length(torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])) == 2.0
    assert empty_rate(["", "  \n", "a", "b"]) == 0.5
    assert mean_std([1.0, 3.0]) == {"mean": 2.0, "std": 1.0}


def test_reward_model_accuracy_counts_ties_wrong():
    assert reward_model_accuracy([1, 2, 3, 0], [0, 2, 1, 1]) == 0.5


def test_within_group_accuracy_by_hand():
    # Group 1 (3 samples): gold 0.1 < 0.5 < 0.9; the proxy orders (0,1) right, (0,2) right, (1,2) wrong -> 2 of 3.
    # Group 2: gold 0.2 = 0.2 (tie: not counted), 0.2 < 0.7 twice; proxy ties on (0,2) (half), right on (1,2).
    proxy = [1.0, 3.0, 2.0, 5.0, 4.0, 5.0]
    gold = [0.1, 0.5, 0.9, 0.2, 0.2, 0.7]
    acc, pairs = within_group_accuracy(proxy, gold, 3)
    assert pairs == 5
    assert acc == pytest.approx((1 + 1 + 0 + 0.5 + 1) / 5)
    assert within_group_accuracy([1.0, 2.0], [0.3, 0.3], 2) == (None, 0)
    assert within_group_accuracy([2.0, 1.0], [0.0, 1.0], 2) == (0.0, 1)
    with pytest.raises(ValueError, match="groups of 3"):
        within_group_accuracy([1.0, 2.0], [1.0, 2.0], 3)


def test_pearson():
    assert pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 5)  # Σdxdy = 4, Σdx² = Σdy² = 5
    assert pearson([1, 2, 3], [6, 4, 2]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3], [5, 5, 5]) == 0.0  # a constant has no linear relation to show


def test_best_of_n_kl():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)
    assert best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75)
    assert best_of_n_kl(16) == pytest.approx(1.8350887, abs=1e-6)
    with pytest.raises(ValueError):
        best_of_n_kl(0)


def test_metrics_and_alarms_import_without_transformers():
    import subprocess
    import sys

    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('transformers', 'peft', 'accelerate'):\n"
            "            raise ImportError(name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import rlhfkit.evaluation.metrics, rlhfkit.evaluation.alarms\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wilson_interval_against_hand_computed_values():
    from rlhfkit.evaluation.metrics import wilson_interval

    # 8 of 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.716770, half 1.96·√(0.016 + 0.009604) / 1.38416 = 0.226580
    lo, hi = wilson_interval(8, 10, z=1.96)
    assert lo == pytest.approx(0.490162, abs=1e-5) and hi == pytest.approx(0.943318, abs=1e-5)
    lo, hi = wilson_interval(0, 20, z=1.96)  # never empty at p = 0
    assert lo == 0.0 and hi == pytest.approx(3.8416 / 23.8416, abs=1e-6)
    assert wilson_interval(0, 0) == (0.0, 1.0)
