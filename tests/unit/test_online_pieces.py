"""Reward post-processing, Python reward loading and the response mask of sampling."""

import pytest
import torch

from rlhfkit.errors import UserError
from rlhfkit.generation import response_mask_from_eos
from rlhfkit.reward_functions import RewardInputs, load_reward_function
from rlhfkit.rewards import RunningMoments, normalize_scores


def test_response_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 9, 9, 3], [9, 1, 1, 9, 1], [1, 1, 1, 1, 1]])
    mask, has_eos = response_mask_from_eos(ids, eos_token_id=9)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert has_eos.tolist() == [True, True, False]


def test_normalize_batch_minmax_clip():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    z = normalize_scores(x, "batch")
    assert z.mean().abs() < 1e-6 and z.std(unbiased=False).sub(1).abs() < 1e-5
    assert normalize_scores(x, "minmax").tolist() == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0], abs=1e-6)
    assert normalize_scores(torch.tensor([-10.0, 0.5, 10.0]), "none", clip=5.0).tolist() == [-5.0, 0.5, 5.0]


def test_running_moments_match_the_whole_history():
    r = RunningMoments()
    normalize_scores(torch.tensor([1.0, 2.0, 3.0]), "running", r)
    z = normalize_scores(torch.tensor([4.0, 5.0]), "running", r)
    # mean 3, population variance 2 over all five scores seen
    assert (r.mean, r.var, r.count) == (pytest.approx(3.0), pytest.approx(2.0), 5)
    assert z.tolist() == pytest.approx([1 / 2**0.5, 2 / 2**0.5], abs=1e-5)
    state = r.state_dict()
    r2 = RunningMoments()
    r2.load_state_dict(state)
    assert r2.state_dict() == state


def test_reward_function_loading_errors():
    assert load_reward_function("rlhfkit.tasks.toy:vowel_reward")(RewardInputs([""], ["aab"], [[]])) == [pytest.approx(2 / 3)]
    with pytest.raises(UserError, match="cannot import module 'no_such_module'"):
        load_reward_function("no_such_module:f")
    with pytest.raises(UserError, match="has no function 'nope'"):
        load_reward_function("rlhfkit.tasks.toy:nope")
