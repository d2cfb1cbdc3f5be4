"""DAPO's dynamic sampling (arXiv 2503.14476 §3.2) through the experience maker, with a scripted rollout and scripted
refill candidates: a group whose two samples score the same ("flat" prompts) is dropped and its slot sampled again
from a fresh prompt until the step holds its 4 groups with signal or the rounds run out. The test counts the groups
trained on (rows with a loss), the prompts each round sampled, and the logged figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlhfkit.algorithms import get_algorithm
from rlhfkit.config import OnlineConfig, load_config
from rlhfkit.kl_control import FixedKLController
from rlhfkit.rewards import Rewards, RunningMoments
from rlhfkit.trainers.dynamic_sampling import refill_key, refill_order
from rlhfkit.trainers.experience import ExperienceMaker
from rlhfkit.types import PromptBatch, Rollout, Rows
from tests.scripted import OneProcess

K = 2



def example(name: str) -> dict:
    return {"prompt": name, "columns": {}}


def batch(names: list[str]) -> tuple[PromptBatch, list[dict]]:
    ids = torch.tensor([[len(n), i + 1] for i, n in enumerate(names)])
    return PromptBatch(ids, torch.ones_like(ids)), [example(n) for n in names]


class ScriptedRollout:
    """Two samples per prompt: "x" and "x" for a prompt named flat*, "x" and "xxx" otherwise (the reward is the
    completion's length, so a flat prompt's group has no signal). Records the prompts and key of every call."""

    def __init__(self):
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, policy, prompts, examples, step):
        names = [e["prompt"] for e in examples]
        self.calls.append((names, step))
        texts = [t for n in names for t in (("x", "x") if n.startswith("flat") else ("x", "xxx"))]
        lengths = [len(t) for t in texts]
        width = max(lengths)
        b = len(texts)
        response_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        return Rollout(prompt_ids=prompts.input_ids.repeat_interleave(K, 0),
                       prompt_mask=prompts.attention_mask.repeat_interleave(K, 0),
                       response_ids=response_mask.clone(), response_mask=response_mask,
                       group_ids=torch.arange(len(names)).repeat_interleave(K), has_eos=torch.ones(b, dtype=torch.bool),
                       sampler_logprobs=torch.zeros(b, width), action_mask=response_mask,
                       texts=Rows(texts), completions=Rows(texts))


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


ROUNDS = {1: ["sigA", "flatB", "flatC", "sigD"], 2: ["sigX", "sigY", "sigE", "sigZ"]}


def made(tmp_path, rounds: int, first=("flat0", "sig1", "flat2", "flat3")):
    cfg = load_config(OnlineConfig, "configs/grpo_tiny.yaml", [
        f"output_dir={tmp_path}", "algo.algorithm=dapo", "algo.dynamic_filtering=true",
        f"algo.max_sampling_rounds={rounds}", f"generation.num_samples={K}", "algo.rollout_batch_size=4",
        "optim.per_device_batch_size=8"])
    rollout = ScriptedRollout()
    rewards = Rewards(cfg.reward, SimpleNamespace(pad_token_id=0), "cpu", given=[length_reward])
    maker = ExperienceMaker(rollout, rewards, None, None, FixedKLController(0.0), RunningMoments(), cfg,
                            get_algorithm("dapo"), OneProcess(), old_source="update",
                            candidates=lambda step, round_: batch(ROUNDS[round_]))
    prompts, examples = batch(list(first))
    return maker.make(torch.nn.Linear(1, 1), prompts, examples, 3, 10), rollout


def trained_groups(made) -> list[str]:
    """The prompts of the groups that take a loss (any row of theirs with a loss token)."""
    exp = made.experience
    has_loss = exp.loss_mask.sum(1) > 0
    return [made.examples[i]["prompt"] for i in range(0, len(made.examples), K) if has_loss[i]]


def test_the_batch_is_filled_with_groups_that_have_signal(tmp_path):
    step, rollout = made(tmp_path, rounds=3)
    # Round 0: slots 0, 2, 3 flat. Round 1 samples those three: slot 0 <- sigA, slot 3 <- sigD, slot 2 gets flatC (no
    # signal). Round 2 samples slot 2 alone: sigE.
    assert [names for names, _ in rollout.calls] == [["flat0", "sig1", "flat2", "flat3"], ["sigA", "flatC", "sigD"],
                                                    ["sigE"]]
    assert [key for _, key in rollout.calls] == [3, refill_key(3, 1), refill_key(3, 2)]
    assert trained_groups(step) == ["sigA", "sig1", "sigE", "sigD"]  # 4 groups trained on, in slot order
    assert step.experience.rollout.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert step.experience.scores.tolist() == [1.0, 3.0] * 4
    assert step.stats["dynamic_sampling/rounds"] == 3
    assert step.stats["dynamic_sampling/dropped_groups"] == 4  # flat0, flat2, flat3, flatC
    assert step.stats["dynamic_sampling/filled_share"] == 1.0
    assert step.stats["objective/scores"] == 2.0  # the figures are the trained batch's


def test_a_step_still_short_after_its_rounds_trains_on_the_groups_it_has(tmp_path):
    step, rollout = made(tmp_path, rounds=2)
    assert len(rollout.calls) == 2
    assert trained_groups(step) == ["sigA", "sig1", "sigD"]  # slot 2 keeps its round-0 group, masked out of the loss
    assert [e["prompt"] for e in step.examples[::K]] == ["sigA", "sig1", "flat2", "sigD"]
    assert step.stats["dynamic_sampling/filled_share"] == 0.75 and step.stats["dynamic_sampling/rounds"] == 2


def test_one_round_only_masks(tmp_path):
    step, rollout = made(tmp_path, rounds=1)
    assert len(rollout.calls) == 1 and trained_groups(step) == ["sig1"]
    assert step.stats["dynamic_sampling/filled_share"] == 0.25 and step.stats["dynamic_sampling/dropped_groups"] == 3


def test_no_refill_when_every_group_has_signal(tmp_path):
    step, rollout = made(tmp_path, rounds=3, first=("s0", "s1", "s2", "s3"))
    assert len(rollout.calls) == 1 and step.stats["dynamic_sampling/rounds"] == 1
    assert trained_groups(step) == ["s0", "s1", "s2", "s3"]


def test_refill_order_is_a_function_of_seed_step_and_round():
    a = refill_order(0, 5, 1, n=10, slots=4)
    assert a == refill_order(0, 5, 1, n=10, slots=4) and len(set(a)) == 4
    assert a != refill_order(0, 5, 2, n=10, slots=4) and a != refill_order(0, 6, 1, n=10, slots=4)
    assert sorted(refill_order(0, 5, 1, n=3, slots=7)[:3]) == [0, 1, 2]  # fewer prompts than slots: repeated


def test_the_parts_are_joined_by_rollout_concat():
    a = ScriptedRollout()(None, *batch(["sig"]), 0)  # responses of width 3
    b = ScriptedRollout()(None, *batch(["flat", "flat"]), 0)  # width 1
    both = Rollout.concat([a, b], pad_token_id=9)
    assert both.response_ids.shape == (6, 3) and both.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.response_ids[2].tolist() == [1, 9, 9] and both.response_mask[2].tolist() == [1, 0, 0]
    assert list(both.texts) == ["x", "xxx", "x", "x", "x", "x"]


@pytest.mark.parametrize("rounds", [2])
def test_refills_are_refused_under_sharded_engines(tmp_path, rounds, monkeypatch):
    from rlhfkit.errors import UserError

    cfg = load_config(OnlineConfig, "configs/grpo_tiny.yaml", [
        f"output_dir={tmp_path}", "algo.algorithm=dapo", "algo.dynamic_filtering=true",
        f"algo.max_sampling_rounds={rounds}", f"generation.num_samples={K}"])
    run = OneProcess()
    run.accelerator = SimpleNamespace(distributed_type="FSDP")
    with pytest.raises(UserError, match="algo.max_sampling_rounds: refill rounds"):
        ExperienceMaker(None, None, None, None, None, None, cfg, get_algorithm("dapo"), run, True,
                        candidates=lambda step, round_: None)
