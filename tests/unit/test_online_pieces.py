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


def test_experience_and_rollout_are_frozen_and_select_and_trim_make_copies():
    """Nothing changes an experience after `ExperienceMaker.make`: its fields cannot be reassigned; `select` and `trimmed`
    give new objects with the rows and the response columns asked for."""
    import dataclasses

    from rlhfkit.types import Experience, Rollout

    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    ro = Rollout(prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
                 response_ids=torch.arange(12).view(3, 4), response_mask=mask, group_ids=torch.tensor([0, 0, 1]),
                 has_eos=torch.tensor([True, True, False]), sampler_logprobs=-mask.float(), action_mask=mask)
    per_token = torch.arange(12, dtype=torch.float32).view(3, 4)
    exp = Experience(rollout=ro, old_logprobs=None, ref_logprobs=per_token, values=None, scores=torch.tensor([1.0, 2.0, 3.0]),
                     shaped_scores=torch.tensor([0.0, 0.5, 1.0]), kl=None, advantages=per_token, returns=per_token,
                     loss_mask=mask.float())
    for obj, name in ((exp, "advantages"), (exp, "old_logprobs"), (ro, "response_mask")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, None)
    rows = exp.select(torch.tensor([0, 1])).trimmed()
    assert rows.advantages.tolist() == [[0.0, 1.0], [4.0, 5.0]]  # rows 0-1, cut at their longest response (2)
    assert rows.rollout.response_ids.tolist() == [[0, 1], [4, 5]] and rows.scores.tolist() == [1.0, 2.0]
    assert exp.advantages.shape == (3, 4) and exp.rollout.response_ids.shape == (3, 4)  # the original is untouched
