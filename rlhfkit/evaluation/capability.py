"""Capability retention, the "alignment tax": how much worse the policy predicts held-out reference texts than the
reference model does.

The seeds' remedy 4 (evaluate general ability after each round, roll back when it degrades) needs a figure: the mean
per-token negative log-likelihood of reference responses (SFT-format records: prompt + response, or chat turns) under
the policy and under the reference, and their difference in nats per token. A positive difference is capability the
policy lost; `rlhfkit eval` writes it as the `alignment_tax` block of eval.json and the online evaluation logs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlhfkit.data import collate_sft
from rlhfkit.losses.sft import token_nll
from rlhfkit.models import Reference, scored_logits
from rlhfkit.ops import sums_by_name


@dataclass(frozen=True)
class AlignmentTax:
    """Mean per-token NLL (nats) of the reference responses under the policy and under the reference model."""

    policy_nll: float
    reference_nll: float
    tokens: int  # response tokens scored (every process's share)

    @property
    def delta(self) -> float:
        """policy_nll - reference_nll: nats per token the policy lost (negative: it predicts them better)."""
        return self.policy_nll - self.reference_nll

    def as_dict(self) -> dict[str, float]:
        return {"policy_nll": self.policy_nll, "reference_nll": self.reference_nll, "delta_nats": self.delta,
                "tokens": self.tokens}


@torch.no_grad()
def response_nll(model, examples: Sequence[dict], pad_token_id: int, batch_size: int, device) -> dict[str, torch.Tensor]:
    """{"nll": Σ NLL, "tokens": token count} of the labelled (response) tokens of tokenised SFT `examples` under
    `model` (fp64 sums of fp32 NLLs).

    Sums, not a mean, so that shares from several processes add up to the whole set's figure."""
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(examples), batch_size):
        batch = collate_sft(list(examples[start : start + batch_size]), pad_token_id).to(device)
        logits, first = scored_logits(model, batch.input_ids, batch.attention_mask, batch.labels)  # (B, T-first, V)
        token_nlls, parts = token_nll(logits, batch.labels[:, first:])  # (B, T-first-1)
        nll, tokens = nll + token_nlls.double().sum(), tokens + parts["mask"].double().sum()
    return {"nll": nll, "tokens": tokens}


def alignment_tax(policy_sums: dict[str, torch.Tensor], reference_sums: dict[str, torch.Tensor],
                  sum_over: Callable[[torch.Tensor], torch.Tensor] | None = None) -> AlignmentTax:
    """The `AlignmentTax` of two `response_nll` results (this process's share; `sum_over` sums them over processes
    when given, by name: `ops.sums_by_name`)."""
    device = policy_sums["nll"].device
    policy, reference = sums_by_name(policy_sums, reference_sums, sum_over=sum_over, device=device)
    tokens = int(policy["tokens"])
    if tokens == 0:
        raise ValueError("no response tokens to score in the capability set")
    return AlignmentTax(policy_nll=policy["nll"] / tokens, reference_nll=reference["nll"] / tokens, tokens=tokens)


def frozen_reference(reference, policy):
    """The reference as a model to call, in a context: a `models.Reference` (a second model, or `policy`'s base with
    its LoRA adapters disabled) or a plain model."""
    return reference.frozen(policy) if isinstance(reference, Reference) else contextlib.nullcontext(reference)


def measure_alignment_tax(policy, reference, examples: Sequence[dict], pad_token_id: int, batch_size: int,
                          state=None) -> AlignmentTax:
    """The `AlignmentTax` of tokenised SFT `examples` under `policy` and `reference` (a model or a `models.Reference`).
    With `state` (accelerate's, several processes) each process scores every world-th example and the sums are
    added over processes: the figure of one process scoring them all."""
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    mine, device = examples[rank::world], next(policy.parameters()).device
    policy_sums = response_nll(policy, mine, pad_token_id, batch_size, device)
    with frozen_reference(reference, policy) as ref:
        reference_sums = response_nll(ref, mine, pad_token_id, batch_size, device)
    sum_over = None
    if world > 1:
        from accelerate.utils import reduce

        sum_over = lambda t: reduce(t, reduction="sum")  # noqa: E731
    return alignment_tax(policy_sums, reference_sums, sum_over=sum_over)
