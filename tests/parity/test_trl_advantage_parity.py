"""Parity with TRL 1.16's own GRPO advantage code: `scale_rewards` group | batch | none and
`multi_objective_aggregation` sum_then_normalize | normalize_then_sum, on fresh random tensors per case.

The advantage math sits inline in `GRPOTrainer._generate_and_score_completions`, so it cannot be called; nor is it
copied here. The test reads the installed method's source (`inspect.getsource`), cuts out the block from
`if self.multi_objective_aggregation == "sum_then_normalize":` to `advantages = torch.nan_to_num(...)` and runs that
block as it stands, on a namespace holding the attributes it reads. A TRL upgrade that changes the block is then
compared as it is, and one that moves its markers fails here loudly.

One process: TRL's rewards are gathered before this block, so its "batch" statistics span every process; ours do so
through `all_reduce` (tests/multiprocess cover N processes ≡ 1).
"""

from __future__ import annotations

import inspect
import textwrap
import types
import zlib

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

from rlhfkit.advantages import AdvantageInput, compute_advantages  # noqa: E402

START = 'if self.multi_objective_aggregation == "sum_then_normalize":'
END = "advantages = torch.nan_to_num(advantages, nan=0.0)"


def trl_advantage_block():
    """TRL's advantage block, compiled from the installed source (see the module docstring)."""
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    start, end = source.index(START), source.index(END)
    line_start = source.rindex("\n", 0, start) + 1
    return compile(textwrap.dedent(source[line_start:end + len(END)]), "trl-grpo-advantages", "exec")


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards, aggregation):
    trainer = types.SimpleNamespace(multi_objective_aggregation=aggregation, scale_rewards=scale_rewards,
                                    reward_weights=weights, reward_funcs=[None] * rewards_per_func.shape[1])
    scope = {"self": trainer, "rewards_per_func": rewards_per_func, "num_generations": num_generations,
             "device": rewards_per_func.device, "torch": torch, "nanstd": nanstd,
             "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1)}
    exec(trl_advantage_block(), scope)
    return scope["advantages"]


def random_case(seed, num_prompts, k, sources):
    g = torch.Generator().manual_seed(seed)
    per_func = torch.randint(0, 3, (num_prompts * k, sources), generator=g).float()
    per_func = per_func + torch.randn(num_prompts * k, sources, generator=g) * 0.3
    weights = torch.rand(sources, generator=g) + 0.5
    return per_func, weights, torch.arange(num_prompts).repeat_interleave(k)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize(("num_prompts", "k", "sources"), [(3, 2, 1), (4, 4, 2), (2, 8, 3)])
def test_scale_rewards_matches_trl(scale_rewards, num_prompts, k, sources):
    per_func, weights, group_ids = random_case(zlib.crc32(f"{scale_rewards}{k}{sources}".encode()), num_prompts, k, sources)
    scores = (per_func * weights).sum(-1)
    width = 5
    mask = torch.ones(len(scores), width, dtype=torch.bool)
    mask[::3, 3:] = False
    ours, _ = compute_advantages("grpo", AdvantageInput(rewards=torch.zeros(len(scores), width), scores=scores,
                                                        response_mask=mask, group_ids=group_ids,
                                                        scale_rewards=scale_rewards))
    theirs = trl_advantages(per_func, weights, k, scale_rewards, "sum_then_normalize")
    torch.testing.assert_close(ours, torch.where(mask, theirs.unsqueeze(1), 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("num_prompts", "k", "sources", "holes"), [(3, 4, 2, False), (4, 3, 3, True), (2, 2, 1, False)])
def test_normalize_then_sum_matches_trl(num_prompts, k, sources, holes):
    per_func, weights, group_ids = random_case(7 * k + sources, num_prompts, k, sources)
    if holes:  # a source that did not score some rows (None -> NaN), and one row nobody scored
        per_func[1, 0] = per_func[5, sources - 1] = float("nan")
        per_func[2, :] = float("nan")
    scores = torch.nan_to_num(per_func * weights).sum(-1)
    mask = torch.ones(len(scores), 3, dtype=torch.bool)
    ours, _ = compute_advantages("grpo", AdvantageInput(rewards=torch.zeros(len(scores), 3), scores=scores,
                                                        response_mask=mask, group_ids=group_ids,
                                                        source_scores=per_func, source_weights=weights))
    theirs = trl_advantages(per_func, weights, k, "group", "normalize_then_sum")
    torch.testing.assert_close(ours[:, 0], theirs, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# RLOOConfig's mapping (config.trl_rules.rloo_objective): TRL's RLOO loss, one clipped ratio per sequence averaged over
# sequences, has the gradient of rlhfkit's per-token clipped surrogate reduced with "seq-mean-token-sum" wherever the
# ratio is 1 (a rollout's one update, TRL's default num_iterations=1). Checked against RLOOTrainer._compute_loss.


def test_rloo_on_policy_gradient_matches_trls_rloo_loss():
    from collections import defaultdict

    from trl import RLOOTrainer

    from parity_helpers import IdentityAccelerator, leaf
    from rlhfkit.losses.aggregate import aggregate
    from rlhfkit.losses.policy import ppo_policy_loss

    g = torch.Generator().manual_seed(11)
    b, r = 6, 7
    mask = torch.arange(r).unsqueeze(0) < torch.randint(1, r + 1, (b, 1), generator=g)
    old = torch.where(mask, -torch.rand(b, r, generator=g) * 3, 0.0)
    logprobs, advantages = leaf(old.clone()), torch.randn(b, generator=g)  # on-policy: the ratio is 1
    trainer = object.__new__(RLOOTrainer)
    for name, value in dict(model=types.SimpleNamespace(training=True), accelerator=IdentityAccelerator(),
                            _metrics={"train": defaultdict(list)}, epsilon_low=0.2, epsilon_high=0.2,
                            aux_loss_enabled=False,
                            _get_per_token_logps_and_entropies=lambda *a, **k: (logprobs, torch.zeros_like(logprobs),
                                                                                None)).items():
        setattr(trainer, name, value)
    inputs = {"prompt_ids": torch.zeros(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.zeros(b, r, dtype=torch.long), "completion_mask": mask.long(),
              "old_logps": (old * mask).sum(1), "advantages": advantages}
    theirs, = torch.autograd.grad(RLOOTrainer._compute_loss(trainer, trainer.model, inputs), logprobs)
    per_token, _ = ppo_policy_loss(logprobs, old, advantages.unsqueeze(1).expand(b, r), clip_eps=0.2)
    ours, = torch.autograd.grad(aggregate(per_token, mask, "seq-mean-token-sum"), logprobs)
    # The losses' values differ (TRL's is -mean A at ratio 1, ours -mean A·|o|); their gradients are the same.
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    other, = torch.autograd.grad(aggregate(ppo_policy_loss(logprobs, old, advantages.unsqueeze(1).expand(b, r))[0],
                                           mask, "token-mean"), logprobs)
    assert not torch.allclose(other, theirs)  # rlhfkit's default reduction for rloo would not match
