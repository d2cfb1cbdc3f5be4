"""The experience maker from explicit parts (issue 26): a scripted rollout component (no model sampling), a scripted
policy and reference whose log-probs are round numbers, a reward function under TRL's contract; the `Experience`
checked against values computed by hand, with a rollout whose action mask differs from its real-token mask (a tool
result in the middle of a completion): those tokens take no KL, no loss, no advantage, no length and no entropy."""

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.algorithms import get_algorithm
from rlhfkit.config import OnlineConfig, load_config
from rlhfkit.kl_control import FixedKLController
from rlhfkit.rewards import Rewards, RunningMoments
from rlhfkit.trainers.experience import ExperienceMaker
from rlhfkit.trainers.policy_update import PolicyUpdate
from rlhfkit.types import PromptBatch, Rollout, Rows
from tests.scripted import OneProcess

LN2 = math.log(2.0)
V = 4  # vocabulary: 0, 1, 2, 3 (3 is EOS)
# The policy puts 1/2, 1/4, 1/8, 1/8 on tokens 0..3 at every position; the reference is uniform (1/4 each). Per-token
# k1 KL of a sampled token: log π − log π_ref = ln 2, 0, −ln 2, −ln 2.
POLICY = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
REFERENCE = torch.log(torch.full((V,), 0.25))
KL = [LN2, 0.0, -LN2, -LN2]


class TableLM(torch.nn.Module):
    """A causal LM whose next-token logits are `table[position]` (a (positions, V) table; one row repeated by default):
    its log-probs are known exactly. A trainable offset makes it a policy the update can differentiate."""

    def __init__(self, row: torch.Tensor, positions: int = 16):
        super().__init__()
        self.table = torch.nn.Parameter(row.expand(positions, V).clone())

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        positions = position_ids if position_ids is not None else torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return SimpleNamespace(logits=self.table[positions])  # (B, T, V)



class ScriptedReference:
    """π_ref: the uniform table, read as `models.Reference` reads its model."""

    def __init__(self):
        self.model = TableLM(REFERENCE)

    def rollout_logprobs(self, policy, rollout, temperature=1.0):
        from rlhfkit.models import rollout_logprobs

        with torch.no_grad():
            return rollout_logprobs(self.model, rollout, temperature)


# Two prompts of 2 tokens, two samples each; responses of up to 5 tokens. Row 0 called a tool: its tokens 2 and 3 (the
# tool's result, as the template renders it) are in the completion but are not the policy's.
RESPONSES = [[0, 1, 2, 2, 3], [1, 3], [0, 0, 3], [2, 1, 3]]
ACTION = [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
SCORES = [1.0, 3.0, 2.0, 2.0]


@dataclass
class ScriptedRollout:
    """A rollout component that returns the rollout above, whatever the policy: no sampling."""

    calls: int = 0

    def __call__(self, policy, prompts, examples, step):
        self.calls += 1
        width = 5
        ids = torch.tensor([r + [0] * (width - len(r)) for r in RESPONSES])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in RESPONSES])
        action = torch.tensor(ACTION) * mask
        return Rollout(prompt_ids=prompts.input_ids.repeat_interleave(2, 0), prompt_mask=prompts.attention_mask.repeat_interleave(2, 0),
                       response_ids=ids, response_mask=mask, group_ids=torch.tensor([0, 0, 1, 1]),
                       has_eos=torch.ones(4, dtype=torch.bool), sampler_logprobs=torch.zeros(4, width), action_mask=action,
                       texts=Rows(["a tool", "b", "c", "d"]), completions=Rows(["a tool", "b", "c", "d"]))


def fixed_scores(completions, **kwargs):
    return SCORES


def make(tmp_path, algorithm="rloo", beta=0.1, **algo):
    overrides = [f"output_dir={tmp_path}", f"algo.algorithm={algorithm}", "generation.num_samples=2",
                 "algo.rollout_batch_size=2", "optim.per_device_batch_size=2", "algo.old_logprob_source=recompute",
                 "algo.whiten_advantages=false", f"kl.coef={beta}", *[f"algo.{k}={v}" for k, v in algo.items()]]
    cfg = load_config(OnlineConfig, "configs/rloo_tiny.yaml", overrides)
    rollout, policy = ScriptedRollout(), TableLM(POLICY)
    rewards = Rewards(cfg.reward, None, "cpu", given=[fixed_scores])
    maker = ExperienceMaker(rollout, rewards, ScriptedReference(), None, FixedKLController(beta), RunningMoments(), cfg,
                            get_algorithm(algorithm), OneProcess(), old_source="recompute")
    prompts = PromptBatch(torch.tensor([[1, 2], [2, 1]]), torch.ones(2, 2, dtype=torch.long))
    examples = [{"prompt": "p0", "columns": {}}, {"prompt": "p1", "columns": {}}]
    return maker, policy, maker.make(policy, prompts, examples, 0, 1), cfg


def test_the_experience_of_a_scripted_rollout_against_hand_computed_values(tmp_path):
    maker, _, made, _ = make(tmp_path)
    exp = made.experience
    assert made.fault is None and maker.rollout.calls == 1
    action = torch.tensor(ACTION, dtype=torch.float) * exp.rollout.response_mask
    # π_old: log 1/2, 1/4, 1/8 on the action tokens, 0 elsewhere (tool tokens take no log-prob).
    expected_old = torch.tensor([[math.log(0.5) if t == 0 else math.log(0.25) if t == 1 else math.log(0.125)
                                  for t in r + [0] * (5 - len(r))] for r in RESPONSES]) * action
    torch.testing.assert_close(exp.old_logprobs, expected_old)
    # Sequence KL over the action tokens only. Row 0: tokens 0, 1, [2, 2: the tool's], 3 -> ln2 + 0 - ln2 = 0 (with
    # the tool's tokens it would be -2 ln2).
    expected_kl = torch.tensor([LN2 + 0.0 - LN2, 0.0 - LN2, LN2 + LN2 - LN2, -LN2 + 0.0 - LN2])
    torch.testing.assert_close(exp.kl, expected_kl)
    assert made.kl == pytest.approx(float(expected_kl.mean()))
    # RLOO with the KL in the reward, β = 0.1: R_i = score_i − β·KL_i; A_i = R_i − R_j of its sibling (k = 2).
    returns = torch.tensor(SCORES) - 0.1 * expected_kl
    per_row = torch.tensor([returns[0] - returns[1], returns[1] - returns[0], returns[2] - returns[3], returns[3] - returns[2]])
    torch.testing.assert_close(exp.advantages, per_row[:, None] * action)
    torch.testing.assert_close(exp.loss_mask, action)  # no loss on the tool's tokens
    assert made.stats["response/length_avg"] == pytest.approx(float(action.sum(1).mean()))  # the policy's tokens
    entropy = -(expected_old * action).sum(1).mean()
    assert made.stats["objective/entropy"] == pytest.approx(float(entropy), rel=1e-6)
    assert made.stats["objective/scores"] == pytest.approx(2.0)


def test_tokens_that_are_not_the_policys_take_no_loss_no_kl_no_entropy(tmp_path):
    """Change the policy's distribution only at the positions that predict response tokens 2 and 3: rows 0 and 1
    hold no action there (row 0: the tool's result; row 1: padding), so their loss and every figure (approx-KL,
    clip fraction, ratio, entropy) stay the same; row 2 takes an action at position 2, so the whole batch's loss moves
    (the check can fail)."""
    _, policy, made, cfg = make(tmp_path, entropy_coef=0.5)
    exp = made.experience
    other = TableLM(POLICY)
    with torch.no_grad():  # prompts of 2 tokens: response token t is predicted at sequence position 1 + t
        other.table[1 + 2] = torch.log(torch.tensor([0.1, 0.1, 0.1, 0.7]))
        other.table[1 + 3] = torch.log(torch.tensor([0.7, 0.1, 0.1, 0.1]))

    def loss_of(model, batch):
        update = PolicyUpdate(cfg, get_algorithm("rloo"), OneProcess(), model, None, False, None, None,
                              FixedKLController(0.1), old_source="recompute")
        return update.policy_loss(batch, "token-mean", float(batch.loss_mask.sum()), float(batch.loss_mask.shape[0]))

    assert float(loss_of(policy, exp)[0].detach()) != pytest.approx(float(loss_of(other, exp)[0].detach()), abs=1e-4)
    rows = exp.select(torch.tensor([0, 1]))
    a, b = loss_of(policy, rows), loss_of(other, rows)
    assert float(a[0].detach()) == pytest.approx(float(b[0].detach()), abs=1e-7)
    assert "policy/entropy_avg" in a[1]
    for key in a[1]:
        assert a[1][key] == pytest.approx(b[1][key], abs=1e-7), key  # (mean, what it averaged over)


def test_a_non_finite_score_is_a_fault_and_leaves_the_moments_untouched(tmp_path):
    global SCORES
    saved = SCORES
    SCORES = [1.0, float("nan"), 2.0, 2.0]
    try:
        maker, _, made, _ = make(tmp_path)
    finally:
        SCORES = saved
    assert made.fault is not None and made.experience is None
    assert maker.moments.state_dict() == RunningMoments().state_dict()


def test_a_micro_batch_holds_its_own_rows_text(tmp_path):
    """`Rows` are selected with their rows (a micro-batch's texts are its own)."""
    _, _, made, _ = make(tmp_path)
    part = made.experience.select(torch.tensor([2, 0]))
    assert list(part.rollout.texts) == ["c", "a tool"]
    assert list(replace(part.rollout).completions) == ["c", "a tool"]


def first_source(completions, **kwargs):
    return [1.0, 3.0, 2.0, 2.0]


def second_source(completions, **kwargs):
    return [0.0, 2.0, 4.0, 0.0]


def test_normalize_then_sum_reads_each_sources_own_scores(tmp_path):
    """GDPO (algo.multi_objective_aggregation=normalize_then_sum) through the experience maker, weights (1, 2). Each
    source's z in its group: source 1 ∓1/√2 then 0, 0 (a tie); source 2 ∓1/√2 then ±1/√2. Weighted sums ∓3/√2, ±√2;
    over the batch mean 0, Bessel std √(13/3)."""
    overrides = [f"output_dir={tmp_path}", "algo.algorithm=grpo", "generation.num_samples=2", "algo.rollout_batch_size=2",
                 "optim.per_device_batch_size=2", "algo.multi_objective_aggregation=normalize_then_sum"]
    cfg = load_config(OnlineConfig, "configs/grpo_tiny.yaml", overrides)
    rewards = Rewards(cfg.reward, None, "cpu", given=[first_source, second_source], given_weights=[1.0, 2.0])
    maker = ExperienceMaker(ScriptedRollout(), rewards, ScriptedReference(), None, FixedKLController(0.0),
                            RunningMoments(), cfg, get_algorithm("grpo"), OneProcess(), old_source="update")
    prompts = PromptBatch(torch.tensor([[1, 2], [2, 1]]), torch.ones(2, 2, dtype=torch.long))
    made = maker.make(TableLM(POLICY), prompts, [{"prompt": "p0", "columns": {}}, {"prompt": "p1", "columns": {}}], 0, 1)
    r2, std = math.sqrt(2), math.sqrt(13 / 3)
    expected = torch.tensor([-3 / r2, 3 / r2, r2, -r2]) / std
    torch.testing.assert_close(made.experience.advantages[:, 0], expected, rtol=1e-3, atol=1e-4)
    assert made.stats["objective/scores"] == pytest.approx((1 + 7 + 10 + 2) / 4)  # the weighted total is still logged


def test_scale_rewards_batch_through_the_experience_maker(tmp_path):
    """grpo with algo.scale_rewards=batch: scores 1, 3 | 2, 2, centred by their groups' means (2, 2): -1, 1, 0, 0;
    divided by the batch's Bessel std √(2/3) (plus 1e-4), not the groups' (√2 and 0)."""
    overrides = [f"output_dir={tmp_path}", "algo.algorithm=grpo", "generation.num_samples=2", "algo.rollout_batch_size=2",
                 "optim.per_device_batch_size=2", "algo.scale_rewards=batch"]
    cfg = load_config(OnlineConfig, "configs/grpo_tiny.yaml", overrides)
    maker = ExperienceMaker(ScriptedRollout(), Rewards(cfg.reward, None, "cpu", given=[fixed_scores]),
                            ScriptedReference(), None, FixedKLController(0.0), RunningMoments(), cfg,
                            get_algorithm("grpo"), OneProcess(), old_source="update")
    prompts = PromptBatch(torch.tensor([[1, 2], [2, 1]]), torch.ones(2, 2, dtype=torch.long))
    made = maker.make(TableLM(POLICY), prompts, [{"prompt": "p0", "columns": {}}, {"prompt": "p1", "columns": {}}], 0, 1)
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0]) / (math.sqrt(2 / 3) + 1e-4)
    torch.testing.assert_close(made.experience.advantages[:, 0], expected)
