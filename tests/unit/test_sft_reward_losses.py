import math

import torch

from rlhfkit.losses.reward import bradley_terry_loss
from rlhfkit.losses.sft import sft_loss, token_nll


def test_bradley_terry_plain():
    # r_c - r_r = 0 -> -log σ(0) = log 2; r_c - r_r = ln 3 -> σ = 3/4 -> -ln(3/4).
    chosen = torch.tensor([1.0, math.log(3.0), 0.0])
    rejected = torch.tensor([1.0, 0.0, math.log(3.0)])
    loss, m = bradley_terry_loss(chosen, rejected)
    expected = torch.tensor([math.log(2.0), -math.log(0.75), -math.log(0.25)])
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)
    assert m["accuracy"].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(m["margin"], chosen - rejected)
    torch.testing.assert_close(m["chosen_score"], chosen)


def test_bradley_terry_margin():
    # diff = 2, margin = 2 -> -log σ(0) = log 2; diff = 1 + ln 3, margin 1 -> -ln(3/4).
    chosen = torch.tensor([3.0, 1.0 + math.log(3.0)])
    rejected = torch.tensor([1.0, 0.0])
    loss, _ = bradley_terry_loss(chosen, rejected, margin=torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(loss, torch.tensor([math.log(2.0), -math.log(0.75)]), atol=1e-6, rtol=0)


def test_bradley_terry_centering():
    # diff 0 -> log 2, plus 0.1 * (1 + 1)^2 = 0.4.
    loss, _ = bradley_terry_loss(torch.tensor([1.0]), torch.tensor([1.0]), center_coef=0.1)
    torch.testing.assert_close(loss, torch.tensor([math.log(2.0) + 0.4]), atol=1e-6, rtol=0)


def test_bradley_terry_gradient_and_stability():
    chosen = torch.tensor([0.0, 200.0], requires_grad=True)
    rejected = torch.tensor([0.0, -200.0])
    loss, m = bradley_terry_loss(chosen, rejected)
    loss.sum().backward()
    # d/dx -log σ(x) = -(1 - σ(x)): -1/2 at 0; ~0 (and finite) far in the tail.
    torch.testing.assert_close(chosen.grad, torch.tensor([-0.5, 0.0]), atol=1e-6, rtol=0)
    assert torch.isfinite(loss).all() and not m["margin"].requires_grad


def test_token_nll_hand_value_and_mask():
    # Uniform logits over V=4 -> NLL = ln 4 at each labelled position; the prompt (-100) costs nothing.
    logits = torch.zeros(1, 4, 4)
    labels = torch.tensor([[-100, -100, 2, 3]])
    nll, parts = token_nll(logits, labels)
    assert nll.shape == (1, 3)
    torch.testing.assert_close(nll, torch.tensor([[0.0, math.log(4.0), math.log(4.0)]]), atol=1e-6, rtol=0)
    assert parts["mask"].tolist() == [[0.0, 1.0, 1.0]]


def test_token_nll_shift():
    # Position t predicts token t+1: a logit of +inf-ish on the right next token gives ~0 loss.
    logits = torch.full((1, 3, 5), -30.0)
    logits[0, 0, 4] = 30.0  # predicts labels[1] = 4
    logits[0, 1, 1] = 30.0  # predicts labels[2] = 1
    nll, parts = token_nll(logits, torch.tensor([[0, 4, 1]]))
    assert nll.max() < 1e-6 and parts["correct"].tolist() == [[1.0, 1.0]]


def test_sft_loss_divides_by_the_global_token_count():
    # Uniform logits over V=4: ln 4 per labelled token. Two micro-batches of 1 and 2 labelled tokens, each divided by
    # the step's 3 tokens, add up to the one-batch loss ln 4; each logs its own per-token mean.
    logits = torch.zeros(1, 4, 4)
    first, first_metrics = sft_loss(logits, torch.tensor([[-100, -100, -100, 3]]), num_tokens=3)
    second, second_metrics = sft_loss(logits, torch.tensor([[-100, -100, 2, 3]]), num_tokens=3)
    torch.testing.assert_close(first, torch.tensor(math.log(4.0) / 3), atol=1e-6, rtol=0)
    torch.testing.assert_close(first + second, torch.tensor(math.log(4.0)), atol=1e-6, rtol=0)
    torch.testing.assert_close(second_metrics["loss"], torch.tensor(math.log(4.0)), atol=1e-6, rtol=0)
    assert first_metrics["mean_token_accuracy"] == 0.0  # argmax of uniform logits is token 0, the label is 3
    nothing, metrics = sft_loss(logits, torch.full((1, 4), -100), num_tokens=3)
    assert nothing == 0.0 and metrics["loss"] == 0.0  # no labelled token: 0, not NaN
