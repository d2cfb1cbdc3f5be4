"""Online DPO's pure pieces (`losses.online_preference`, the functions the trainer calls): pair ranking with ties
dropped, the loss against hand-computed values, and the KL-regularised optimum on a bandit with an enumerable
response space."""

import math

import pytest
import torch

from rlhfkit.losses.online_preference import online_pair_loss, rank_pairs


def test_rank_pairs_orders_each_prompts_two_samples_and_drops_ties():
    # prompts: 0 (second better), 1 (first better), 2 (tie)
    pairs = rank_pairs(torch.tensor([0.1, 0.7, 2.0, -1.0, 0.5, 0.5]))
    assert pairs.chosen.tolist()[:2] == [1, 2] and pairs.rejected.tolist()[:2] == [0, 3]
    assert pairs.kept.tolist() == [True, True, False]
    assert float(pairs.tie_rate) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match=r"two samples per prompt"):
        rank_pairs(torch.zeros(3))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_online_pair_loss_against_hand_computed_values(loss_type):
    beta = 0.5
    scores = torch.tensor([1.0, 3.0, 2.0, 0.0, 4.0, 4.0])  # pair 0: row 1 ≻ row 0; pair 1: row 2 ≻ row 3; pair 2: tie
    logprobs = torch.tensor([-4.0, -6.0, -3.0, -5.0, -1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-5.0, -5.5, -3.5, -4.0, -1.5, -1.5])
    loss, metrics = online_pair_loss(logprobs, ref, rank_pairs(scores), loss_type=loss_type, beta=beta, num_pairs=2.0)
    # h = (log π(y_w) - log π_ref(y_w)) - (log π(y_l) - log π_ref(y_l)), by hand:
    h0 = (-6.0 + 5.5) - (-4.0 + 5.0)  # -1.5
    h1 = (-3.0 + 3.5) - (-5.0 + 4.0)  # 1.5
    per_pair = {"sigmoid": lambda h: math.log1p(math.exp(-beta * h)), "ipo": lambda h: (h - 1 / (2 * beta)) ** 2,
                "hinge": lambda h: max(0.0, 1 - beta * h)}[loss_type]
    assert float(loss.detach()) == pytest.approx((per_pair(h0) + per_pair(h1)) / 2.0, rel=1e-6)
    assert metrics["rewards/chosen"][:2].tolist() == pytest.approx([beta * -0.5, beta * 0.5])
    assert metrics["rewards/rejected"][:2].tolist() == pytest.approx([beta * 1.0, beta * -1.0])
    loss.backward()
    assert logprobs.grad[4:].abs().sum() == 0  # the tied pair takes no loss


def bandit(hard: bool, steps: int = 400, pairs: int = 128, beta: float = 0.5, seed: int = 0):
    """Online DPO on a one-token bandit: 5 responses, π_ref = softmax(ref_logits), reward r. Each step draws two
    responses per prompt from the policy, labels them with a judge, and takes an Adam step on `online_pair_loss` of
    `rank_pairs`. Returns (KL(π || π*), π) with π* ∝ π_ref · exp(r/β)."""
    g = torch.Generator().manual_seed(seed)
    ref_logits = torch.tensor([0.5, 0.0, -0.5, 1.0, -1.0])
    r = torch.tensor([0.0, 1.0, 0.5, -0.5, 1.5])
    ref_logp = torch.log_softmax(ref_logits, 0)
    optimum = torch.log_softmax(ref_logp + r / beta, 0)
    theta = torch.nn.Parameter(ref_logits.clone())  # the policy starts at the reference
    opt = torch.optim.Adam([theta], lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 if t < steps // 2 else 0.1)
    for _ in range(steps):
        with torch.no_grad():
            y = torch.multinomial(torch.softmax(theta, 0), 2 * pairs, replacement=True, generator=g)  # rows 2i, 2i+1
            # Bradley–Terry judge: r + Gumbel noise, so P(y1 ≻ y2) = σ(r1 - r2); hard: the argmax of r itself.
            gumbel = -torch.log(-torch.log(torch.rand(2 * pairs, generator=g)))
            scores = r[y] if hard else r[y] + gumbel
        ranked = rank_pairs(scores)
        logp = torch.log_softmax(theta, 0)[y]
        loss, _ = online_pair_loss(logp, ref_logp[y], ranked, loss_type="sigmoid", beta=beta,
                                   num_pairs=float(ranked.kept.sum().clamp(min=1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    logp = torch.log_softmax(theta.detach(), 0)
    return float((logp.exp() * (logp - optimum)).sum()), logp.exp()


def test_bradley_terry_labels_reach_the_kl_regularised_optimum():
    kl, _ = bandit(hard=False)
    assert kl < 2e-3


def test_hard_labels_have_another_fixed_point():
    """Labels from the argmax of r are certain for every unequal pair: the policy sharpens past π* toward the best
    response (the docs say so)."""
    kl, policy = bandit(hard=True)
    assert kl > 0.3
    assert float(policy[4]) > 0.9  # r's argmax
