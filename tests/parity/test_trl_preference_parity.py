"""Parity with TRL 1.16.0: our preference losses vs TRL's on the same seeded inputs, loss and gradients.

Inputs: B = 8, sequence log-probs ~ -U(1, 50), response lengths ~ U{1..30}. We compare TRL's batch-mean loss with the
mean of our per-example losses, and the gradients of both w.r.t. the policy log-probs, to 1e-5.

How TRL is called (no model, no trainer __init__):
  - DPO ("sigmoid", "hinge", "ipo"): `DPOTrainer._compute_loss` on an `object.__new__(DPOTrainer)` with the attributes
    it reads, a stub model whose fused-LM-head output carries our log-probs in one token position (zeros elsewhere, so
    TRL's sum over positions returns them), precomputed reference log-probs, and an identity accelerator.
  - cDPO (DPO with label smoothing): TRL 1.16's DPO "sigmoid" has no label smoothing, so the cDPO formula is taken from
    `CPOTrainer.cpo_loss` ("sigmoid"), fed the reference-normalised log-ratios so its logits are DPO's h.
  - SimPO: `CPOTrainer.cpo_loss` with loss_type="simpo", fed length-averaged log-probs (TRL averages in its forward).
  - ORPO: `ORPOTrainer.odds_ratio_loss`, fed length-averaged log-probs; TRL's total is `nll - mean(losses)`.
  - KTO: `KTOTrainer._compute_loss` with the same kind of stub model, precomputed reference and KL log-probs.

Deliberate differences, adapted here:
  - IPO: TRL divides the log-ratios in the loss by the completion length (clamped at 1) and logs `rewards/*` on the
    summed ones; ours does the same when given the response lengths, which is how the trainer calls it.
  - SimPO: TRL's `simpo_gamma` is the paper's γ (it subtracts simpo_gamma/β, then scales by β); we pass the same
    value. (The SimPO authors' code takes γ/β as `gamma_beta_ratio`; TRL does not.)
  - ORPO: TRL's single batch NLL (prompt + response, token mean) vs our per-example `chosen_nll`; we pass per-example
    NLLs whose mean is TRL's scalar. TRL's `beta` is our `beta`.
  - KTO: TRL orders its losses desirable-first, returns only their mean, and averages z0 over ranks; on one process
    z0 equals our micro-batch mean, so the batch means (and z0, mean rewards per class) are compared.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

pytest.importorskip("trl")

from trl import DPOTrainer, KTOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

from rlhfkit.losses.kto import kto_loss  # noqa: E402
from rlhfkit.losses.preference import orpo_loss, preference_loss, simpo_loss  # noqa: E402
from parity_helpers import TOL, assert_loss_and_grads_match, leaf

B = 8


def random_logps(seed: int, n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [-(torch.rand(B, generator=g, dtype=torch.float32) * 49 + 1) for _ in range(n)]


def random_lengths(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(1, 31, (B,), generator=g), torch.randint(1, 31, (B,), generator=g)


# ---------------------------------------------------------------------------------------------------------------
# Stubs: just enough of a model and an accelerator for TRL's `_compute_loss` methods.


class _IdentityAccelerator:
    device = torch.device("cpu")

    def gather(self, x):
        return x

    gather_for_metrics = gather


def _completion_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()  # (N, width)


class _StubCausalLM:
    """Returns, for input_ids of width W, per-token log-probs (N, W-1) holding `logps[i]` at position 0, zeros
    elsewhere — what TRL's fused LM head returns after masking non-completion tokens, summed to `logps`."""

    def __init__(self, logps_by_width: dict[int, torch.Tensor]):
        self.logps_by_width = logps_by_width
        self.training = True

    def __call__(self, input_ids, **kwargs):
        n, width = input_ids.shape
        logps = self.logps_by_width[width]
        log_probs = torch.cat([logps.unsqueeze(1), torch.zeros(n, width - 2)], dim=1)  # (N, W-1)
        zeros = torch.zeros(n, width - 1)
        return types.SimpleNamespace(
            log_probs=log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(), aux_loss=None
        )


def _bare_trainer(cls, model, **attrs):
    trainer = object.__new__(cls)
    trainer.model = model
    trainer.accelerator = _IdentityAccelerator()
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    trainer._tp_size = 1
    trainer.aux_loss_enabled = False
    for name, value in attrs.items():
        setattr(trainer, name, value)
    return trainer


def trl_dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, lengths_c, lengths_r, *, loss_type, beta):
    width = 32  # > max completion length, so the completion mask holds each length exactly
    model = _StubCausalLM({width: torch.cat([policy_chosen, policy_rejected])})
    trainer = _bare_trainer(
        DPOTrainer, model, beta=beta, loss_types=[loss_type], loss_weights=[1.0], label_smoothing=0.0,
        f_divergence_type="reverse_kl", ld_alpha=None, use_weighting=False, precompute_ref_logps=True,
    )
    completion_mask = _completion_mask(torch.cat([lengths_c, lengths_r]), width)
    inputs = {
        "input_ids": torch.zeros(2 * B, width, dtype=torch.long),
        "attention_mask": torch.ones(2 * B, width, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False), trainer._metrics["train"]


# ---------------------------------------------------------------------------------------------------------------
# DPO family


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl(loss_type, beta):
    policy_c, policy_r, ref_c, ref_r = random_logps(0)
    if loss_type == "hinge":
        # Put h around 1/β so both sides of the hinge are exercised.
        policy_c = ref_c + (policy_r - ref_r) + torch.linspace(-1, 3, B) / beta
    lengths_c, lengths_r = random_lengths(0)
    policy_c, policy_r = leaf(policy_c), leaf(policy_r)
    ours, _ = preference_loss(policy_c, policy_r, ref_c, ref_r, loss_type=loss_type, beta=beta)
    theirs, _ = trl_dpo_loss(policy_c, policy_r, ref_c, ref_r, lengths_c, lengths_r, loss_type=loss_type, beta=beta)
    assert_loss_and_grads_match(ours.mean(), theirs, [policy_c, policy_r])


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_matches_trl_loss_and_reward_metrics(beta):
    policy_c, policy_r, ref_c, ref_r = random_logps(1)
    lengths_c, lengths_r = random_lengths(1)
    lengths_c[0], policy_c[0], ref_c[0] = 0, 0.0, 0.0  # an empty chosen response: both clamp its length at 1
    policy_c, policy_r = leaf(policy_c), leaf(policy_r)
    ours, m = preference_loss(
        policy_c, policy_r, ref_c, ref_r, loss_type="ipo", beta=beta, chosen_lengths=lengths_c, rejected_lengths=lengths_r
    )
    theirs, trl_metrics = trl_dpo_loss(policy_c, policy_r, ref_c, ref_r, lengths_c, lengths_r, loss_type="ipo", beta=beta)
    assert_loss_and_grads_match(ours.mean(), theirs, [policy_c, policy_r])
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert m[name].mean().item() == pytest.approx(trl_metrics[name][-1], abs=1e-5), name
    # The case tells sums from averages: margins on length-averaged log-ratios would be far from TRL's.
    averaged = beta * ((policy_c.detach() - ref_c) / lengths_c.clamp(min=1) - (policy_r.detach() - ref_r) / lengths_r)
    assert abs(averaged.mean().item() - trl_metrics["rewards/margins"][-1]) > 0.1


def _cpo_self(loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0):
    return types.SimpleNamespace(
        alpha=0.0, loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma,
        accelerator=_IdentityAccelerator(),
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 0.3])
def test_cdpo_matches_trl_cpo_sigmoid_on_logratios(label_smoothing):
    policy_c, policy_r, ref_c, ref_r = random_logps(2)
    policy_c, policy_r = leaf(policy_c), leaf(policy_r)
    ours, _ = preference_loss(
        policy_c, policy_r, ref_c, ref_r, loss_type="sigmoid", beta=0.1, label_smoothing=label_smoothing
    )
    theirs, _, _ = CPOTrainer.cpo_loss(
        _cpo_self("sigmoid", 0.1, label_smoothing), policy_c - ref_c, policy_r - ref_r
    )
    assert_loss_and_grads_match(ours.mean(), theirs.mean(), [policy_c, policy_r])


def test_reference_free_matches_trl_cpo_sigmoid():
    policy_c, policy_r, _, _ = random_logps(3)
    policy_c, policy_r = leaf(policy_c), leaf(policy_r)
    ours, m = preference_loss(policy_c, policy_r, None, None, loss_type="sigmoid", beta=0.05, reference_free=True)
    theirs, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(_cpo_self("sigmoid", 0.05), policy_c, policy_r)
    assert_loss_and_grads_match(ours.mean(), theirs.mean(), [policy_c, policy_r])
    torch.testing.assert_close(m["rewards/chosen"], chosen_rewards, **TOL)
    torch.testing.assert_close(m["rewards/rejected"], rejected_rewards, **TOL)


# ---------------------------------------------------------------------------------------------------------------
# SimPO


@pytest.mark.parametrize(("beta", "gamma", "label_smoothing"), [(2.0, 0.5, 0.0), (2.5, 1.4, 0.0), (2.0, 1.0, 0.2)])
def test_simpo_matches_trl_cpo_simpo(beta, gamma, label_smoothing):
    policy_c, policy_r, _, _ = random_logps(4)
    lengths_c, lengths_r = random_lengths(4)
    policy_c, policy_r = leaf(policy_c), leaf(policy_r)
    ours, m = simpo_loss(
        policy_c, policy_r, lengths_c, lengths_r, beta=beta, gamma=gamma, label_smoothing=label_smoothing
    )
    theirs, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(
        _cpo_self("simpo", beta, label_smoothing, simpo_gamma=gamma), policy_c / lengths_c, policy_r / lengths_r
    )
    assert_loss_and_grads_match(ours.mean(), theirs.mean(), [policy_c, policy_r])
    torch.testing.assert_close(m["rewards/chosen"], chosen_rewards, **TOL)
    torch.testing.assert_close(m["rewards/rejected"], rejected_rewards, **TOL)


# ---------------------------------------------------------------------------------------------------------------
# ORPO


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_matches_trl_odds_ratio_loss(beta):
    policy_c, policy_r, _, _ = random_logps(5)
    lengths_c, lengths_r = random_lengths(5)
    g = torch.Generator().manual_seed(55)
    policy_c, policy_r = leaf(policy_c), leaf(policy_r)
    nll = leaf(torch.rand(B, generator=g) * 3)
    ours, m = orpo_loss(policy_c, policy_r, lengths_c, lengths_r, nll, beta=beta)
    trl_self = types.SimpleNamespace(beta=beta, accelerator=_IdentityAccelerator())
    losses, chosen_rewards, rejected_rewards, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
        trl_self, policy_c / lengths_c, policy_r / lengths_r
    )
    theirs = nll.mean() - losses.mean()  # as in ORPOTrainer.get_batch_loss_metrics
    assert_loss_and_grads_match(ours.mean(), theirs, [policy_c, policy_r, nll])
    torch.testing.assert_close(m["rewards/chosen"], chosen_rewards, **TOL)
    torch.testing.assert_close(m["rewards/rejected"], rejected_rewards, **TOL)
    torch.testing.assert_close(m["log_odds_ratio"].mean(), log_odds_ratio.detach(), **TOL)
    torch.testing.assert_close(m["log_odds_chosen"].mean(), log_odds_chosen.detach(), **TOL)


# ---------------------------------------------------------------------------------------------------------------
# KTO


def trl_kto_loss(policy, ref, desirable, policy_kl, ref_kl, *, beta, desirable_weight, undesirable_weight):
    width, kl_width = 32, 24  # distinct widths tell the stub which forward it is serving
    model = _StubCausalLM({width: policy, kl_width: policy_kl})
    trainer = _bare_trainer(
        KTOTrainer, model, beta=beta, loss_type="kto", desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight, calculate_KL=True, precompute_ref_logps=True,
    )
    inputs = {
        "input_ids": torch.zeros(B, width, dtype=torch.long),
        "attention_mask": torch.ones(B, width, dtype=torch.long),
        "completion_mask": _completion_mask(torch.full((B,), 5), width),
        "KL_input_ids": torch.zeros(B, kl_width, dtype=torch.long),
        "KL_attention_mask": torch.ones(B, kl_width, dtype=torch.long),
        "KL_completion_mask": _completion_mask(torch.full((B,), 5), kl_width),
        "label": desirable,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    loss = KTOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize(
    ("beta", "desirable_weight", "undesirable_weight", "kl_shift"),
    [(0.1, 1.0, 1.0, 3.0), (0.5, 1.33, 1.0, 1.0), (0.1, 1.0, 1.0, -3.0)],  # kl_shift < 0: z0 clamped to 0
)
def test_kto_matches_trl(beta, desirable_weight, undesirable_weight, kl_shift):
    policy, ref, policy_kl, ref_kl = random_logps(6)
    policy_kl = ref_kl + kl_shift + (policy_kl - policy_kl.mean()) * 0.1  # mean KL ≈ kl_shift
    desirable = torch.tensor([True, False, True, True, False, True, False, True])
    policy = leaf(policy)
    ours, m = kto_loss(
        policy, ref, desirable, policy_kl, ref_kl, beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
    )
    theirs, trl_metrics = trl_kto_loss(
        policy, ref, desirable, policy_kl, ref_kl, beta=beta,
        desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
    )
    assert_loss_and_grads_match(ours.mean(), theirs, [policy])
    assert m["kl"][0].item() == pytest.approx(trl_metrics["kl"][-1], abs=1e-5)
    chosen_mean = m["rewards/chosen"].sum() / m["desirable_mask"].sum()
    rejected_mean = m["rewards/rejected"].sum() / (1 - m["desirable_mask"]).sum()
    assert chosen_mean.item() == pytest.approx(trl_metrics["rewards/chosen"][-1], abs=1e-5)
    assert rejected_mean.item() == pytest.approx(trl_metrics["rewards/rejected"][-1], abs=1e-5)
