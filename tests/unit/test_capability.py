"""Capability retention (the alignment tax): per-token NLL of reference responses, against hand-computed values."""

import math
from types import SimpleNamespace

import pytest
import torch

from rlhfkit.evaluation.capability import alignment_tax, response_nll

V = 5


class FixedLogits(torch.nn.Module):
    """A 'causal LM' whose next-token distribution is the same at every position: softmax(`logits`)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.tensor(logits, dtype=torch.float32)

    def forward(self, input_ids, attention_mask=None, **kwargs):
        b, t = input_ids.shape
        return SimpleNamespace(logits=self.logits.expand(b, t, V).clone())


EXAMPLES = [  # prompt tokens labelled -100; responses of 2 and 3 tokens
    {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]},
    {"input_ids": [1, 0, 2, 2, 1], "labels": [-100, -100, 2, 2, 1]},
]


def test_uniform_model_scores_log_v_per_token():
    sums = response_nll(FixedLogits([0.0] * V), EXAMPLES, pad_token_id=0, batch_size=1, device="cpu")
    assert sums["tokens"].item() == 5  # 2 + 3 response tokens
    assert sums["nll"].item() == pytest.approx(5 * math.log(V), rel=1e-6)


def test_tax_is_the_difference_in_nats_per_token():
    # The "policy" puts probability e^2/(e^2+4) on token 2 and 1/(e^2+4) elsewhere: tokens 3, 4, 2, 2, 1.
    z = math.exp(2) + 4
    expected_policy = (2 * math.log(z) + 2 * (math.log(z) - 2) + math.log(z)) / 5
    policy = response_nll(FixedLogits([0.0, 0.0, 2.0, 0.0, 0.0]), EXAMPLES, 0, 2, "cpu")
    reference = response_nll(FixedLogits([0.0] * V), EXAMPLES, 0, 2, "cpu")
    tax = alignment_tax(policy, reference)
    assert tax.tokens == 5
    assert tax.policy_nll == pytest.approx(expected_policy, rel=1e-6)
    assert tax.reference_nll == pytest.approx(math.log(V), rel=1e-6)
    assert tax.delta == pytest.approx(expected_policy - math.log(V), rel=1e-6)
    assert tax.as_dict()["delta_nats"] == pytest.approx(tax.delta)


def test_shares_add_up_to_the_whole_set():
    """Two processes' shares, summed by `sum_over`, give the one-process figure (a token mean, not a mean of means)."""
    model, ref = FixedLogits([0.0, 1.0, 0.0, 3.0, 0.0]), FixedLogits([0.0] * V)
    whole = alignment_tax(response_nll(model, EXAMPLES, 0, 2, "cpu"), response_nll(ref, EXAMPLES, 0, 2, "cpu"))
    shares = [(response_nll(model, [e], 0, 2, "cpu"), response_nll(ref, [e], 0, 2, "cpu")) for e in EXAMPLES]
    # the other process's packed sums, in the packing order every process uses (ops.sums_by_name)
    other = alignment_tax(*shares[1], sum_over=lambda local: local.clone())
    packed_other = torch.tensor([shares[1][0]["nll"], shares[1][0]["tokens"], shares[1][1]["nll"], shares[1][1]["tokens"]],
                                dtype=torch.float64)
    split = alignment_tax(*shares[0], sum_over=lambda local: local + packed_other)
    assert other.tokens == 3
    assert split.policy_nll == pytest.approx(whole.policy_nll, rel=1e-9)
    assert split.reference_nll == pytest.approx(whole.reference_nll, rel=1e-9)
    assert split.tokens == whole.tokens
    # A mean of the two examples' own means would differ: the responses have 2 and 3 tokens.
    per_example = [(p["nll"] / p["tokens"]).item() for p, _ in shares]
    assert sum(per_example) / 2 != pytest.approx(whole.policy_nll, rel=1e-6)
