"""An online step does what its math needs and no more (issue 36: each method's step against TRL's): the policy's mode
is switched once per phase, not around each part; a gradient norm that is only measured is not also multiplied into
every gradient; and the update's figures stay on the device until the update ends, read back once, to exactly the
numbers the per-micro-batch Python sums gave. The parts are the scripted ones of test_experience_maker.py."""

import contextlib
import math

import pytest
import torch

from rlhfkit.algorithms import get_algorithm
from rlhfkit.config import OnlineConfig, load_config
from rlhfkit.kl_control import FixedKLController
from rlhfkit.rewards import Rewards, RunningMoments
from rlhfkit.sharding import clip_grad_norm
from rlhfkit.trainers.experience import ExperienceMaker
from rlhfkit.trainers.optim import Optim
from rlhfkit.trainers.policy_update import PolicyUpdate
from rlhfkit.types import PromptBatch
from tests.scripted import OneProcess
from tests.unit.test_experience_maker import POLICY, ScriptedReference, ScriptedRollout, TableLM, fixed_scores


class Counted(TableLM):
    """The table policy, counting its real mode switches (a call that changes `training`)."""

    def __init__(self, row):
        super().__init__(row)
        self.switches = 0

    def train(self, mode: bool = True):
        self.switches += mode != self.training
        return super().train(mode)


class Watched(ScriptedRollout):
    """The scripted rollout, noting the mode the policy samples in."""

    def __init__(self):
        super().__init__()
        self.modes = []

    def __call__(self, policy, prompts, examples, step):
        self.modes.append(policy.training)
        return super().__call__(policy, prompts, examples, step)


class UpdateProcess(OneProcess):
    """One process, with the backward and the DDP switch the update calls."""

    def backward(self, loss, last):
        loss.backward()

    def no_sync(self, model, last):
        return contextlib.nullcontext()


def experience(tmp_path, rollout, policy, *overrides):
    """RLOO's experience of the scripted rollout (π_old recomputed), and its config."""
    cfg = load_config(OnlineConfig, "configs/rloo_tiny.yaml", [
        f"output_dir={tmp_path}", "generation.num_samples=2", "algo.rollout_batch_size=2", "optim.per_device_batch_size=2",
        "algo.old_logprob_source=recompute", "algo.whiten_advantages=false", "kl.coef=0.1", *overrides])
    maker = ExperienceMaker(rollout, Rewards(cfg.reward, None, "cpu", given=[fixed_scores]), ScriptedReference(), None,
                            FixedKLController(0.1), RunningMoments(), cfg, get_algorithm("rloo"), OneProcess(),
                            old_source="recompute")
    prompts = PromptBatch(torch.tensor([[1, 2], [2, 1]]), torch.ones(2, 2, dtype=torch.long))
    made = maker.make(policy, prompts, [{"prompt": "p0", "columns": {}}, {"prompt": "p1", "columns": {}}], 0, 1)
    assert made.fault is None
    return made.experience, cfg


def policy_update(cfg, policy):
    """RLOO's update of `policy` on one process, SGD at lr 0."""
    run = UpdateProcess()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    optim = Optim(optimizer, scheduler, clip=lambda max_norm: clip_grad_norm(run.accelerator, [policy], max_norm),
                  max_grad_norm=cfg.optim.max_grad_norm)
    return PolicyUpdate(cfg, get_algorithm("rloo"), run, policy, None, False, optim, None, FixedKLController(0.1),
                        old_source="recompute")


def test_the_experience_runs_in_eval_mode_and_the_update_in_train_mode_one_switch_each(tmp_path):
    """From train mode (the last update's): the rollout already sees eval mode, and the experience's no-grad forwards
    switch nothing more; the update switches back, once."""
    rollout, policy = Watched(), Counted(POLICY).train()
    exp, cfg = experience(tmp_path, rollout, policy)
    assert rollout.modes == [False] and not policy.training and policy.switches == 1
    policy_update(cfg, policy)(exp, 1)
    assert policy.training and policy.switches == 2


def test_a_norm_measured_only_is_the_clipping_norm_and_scales_nothing():
    """max_norm inf: the norm is the one `clip_grad_norm_` returns, to the bit, and every gradient is left as it was
    (no multiply by 1); a finite max_norm still clips."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)]
    (models[1](models[0](torch.randn(5, 4))) ** 2).sum().backward()
    grads = [p.grad.clone() for m in models for p in m.parameters()]
    norm = clip_grad_norm(OneProcess().accelerator, models, math.inf)
    assert float(norm) == float(torch.nn.utils.get_total_norm(grads))
    assert all(torch.equal(p.grad, g) for p, g in zip([p for m in models for p in m.parameters()], grads))
    clipped = clip_grad_norm(OneProcess().accelerator, models, 0.5 * float(norm))
    assert float(clipped) == float(norm)
    total = torch.nn.utils.get_total_norm([p.grad for m in models for p in m.parameters()])
    assert float(total) == pytest.approx(0.5 * float(norm), rel=1e-5)


def test_update_figures_read_back_once_equal_the_per_micro_batch_python_sums(tmp_path):
    """Four micro-batches of one row: the update's figures equal, exactly, each micro-batch's figures read back and
    summed as Python floats (weighted by its loss tokens, or by its rows for a sequence figure), then divided."""
    exp, cfg = experience(tmp_path, ScriptedRollout(), TableLM(POLICY), "optim.per_device_batch_size=1",
                          "algo.entropy_coef=0.5")
    update = policy_update(cfg, TableLM(POLICY))
    torch.manual_seed(3)
    order = torch.randperm(4)
    sums, weights, tokens = {}, {}, float(exp.loss_mask.sum())
    for row in order:
        _, metrics, *_ = update.policy_loss(exp.select(row[None]).trimmed(), "token-mean", tokens, 4.0)
        for name, (value, w) in metrics.items():
            sums[name] = sums.get(name, 0.0) + float(value) * float(w)
            weights[name] = weights.get(name, 0.0) + float(w)
    torch.manual_seed(3)
    result = update(exp, 1)
    assert result.fault is None and {"policy/entropy_avg", "policy/approxkl_avg", "loss/policy_avg"} <= set(sums)
    for name in sums:
        assert result.metrics[name] == sums[name] / max(weights[name], 1.0), name


def test_a_left_padded_rollout_moved_left_gives_the_masked_forwards_log_probs_and_values(tmp_path):
    """The rollout's forwards move each row left past its prompt's padding (`models.moved_left`), so the batch runs
    without a mask: the log-probs, entropies and critic values are those of the left-padded batch run with its mask
    (the rows' prompts padded by 0-3, their responses ended early by 0-2)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhfkit.critic import critic_values
    from rlhfkit.model_sources import build_tiny_model
    from rlhfkit.models import rollout_logprobs, token_logprobs
    from rlhfkit.rewards import token_scores
    from rlhfkit.types import Rollout

    build_tiny_model(str(tmp_path))
    policy = AutoModelForCausalLM.from_pretrained(tmp_path)
    critic = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1)
    torch.manual_seed(0)
    b, p, r = 8, 12, 6
    prompt_mask = torch.tensor([[0] * (i % 4) + [1] * (p - i % 4) for i in range(b)])
    response_mask = torch.tensor([[1] * (r - i % 3) + [0] * (i % 3) for i in range(b)])
    ro = Rollout(prompt_ids=torch.randint(3, 100, (b, p)) * prompt_mask, prompt_mask=prompt_mask,
                 response_ids=torch.randint(3, 100, (b, r)) * response_mask, response_mask=response_mask,
                 group_ids=torch.arange(b), has_eos=torch.ones(b, dtype=torch.bool), sampler_logprobs=torch.zeros(b, r),
                 action_mask=response_mask)
    labels = torch.cat([torch.full_like(ro.prompt_ids, -100), ro.response_ids.masked_fill(response_mask == 0, -100)], 1)
    masked, _, masked_entropy = token_logprobs(policy, ro.input_ids, ro.attention_mask, labels, 0.7, with_entropy=True)
    logprobs, entropy = rollout_logprobs(policy, ro, 0.7, with_entropy=True)
    torch.testing.assert_close(logprobs, masked[:, p - 1 :], rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, masked_entropy[:, p - 1 :], rtol=0, atol=1e-6)
    values = token_scores(critic, ro.input_ids, ro.attention_mask)[:, p - 1 : -1] * response_mask
    torch.testing.assert_close(critic_values(critic, critic, ro), values, rtol=0, atol=1e-6)


def test_set_training_reads_every_submodule_not_the_root_flag_alone():
    """A wrapper made in train mode around a model left in eval mode (a peft model around `from_pretrained`'s): the
    root says train, its layers do not, and asking for train mode switches them; asking again switches nothing."""
    from rlhfkit.models import set_training

    inner = Counted(POLICY).eval()
    inner.switches = 0
    outer = torch.nn.Sequential(inner)
    outer.training = True
    set_training(outer, True)
    assert inner.training and inner.switches == 1
    set_training(outer, True)
    assert inner.switches == 1
