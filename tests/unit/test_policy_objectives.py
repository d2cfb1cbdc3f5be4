"""The objectives TRL does not ship, and the pieces around every objective, against numbers computed by hand from
the papers' definitions: DPPO's Binary-TV and Binary-KL trust regions (arXiv 2602.04879), Clip-Cov and KL-Cov
(arXiv 2505.22617), GSPO-token (arXiv 2507.18071, eq. 13-15), the LUSPO reduction, the sampler-mismatch weights, the
off-policy sequence mask, the top-entropy tokens, the adaptive entropy controller; and the config's refusals."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.config import OnlineConfig, load_config
from rlhfkit.errors import ConfigError
from rlhfkit.kl_control import AdaptiveEntropyController
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.losses.correction import off_policy_sequence_mask, rollout_correction, top_entropy_mask
from rlhfkit.losses.objectives import ObjectiveParams
from rlhfkit.losses.policy import OBJECTIVES, get_objective

t = torch.tensor


def run(name, logprobs, old, advantages, mask=None, **params):
    """The objective's loss and metrics, and the gradient of its summed loss with respect to the log-probs."""
    lp = logprobs.clone().requires_grad_(True)
    mask = torch.ones_like(lp) if mask is None else mask
    loss, m = get_objective(name).fn(lp, old, advantages, mask, ObjectiveParams(**params))
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)
    return loss.detach(), m, grad


# DPPO ------------------------------------------------------------------------------------------------------------


def test_dppo_binary_tv_masks_only_tokens_pushed_past_the_tv_bound():
    """π_old(y) = 0.5 everywhere, δ = 0.15. A token leaves the trust region when |π - π_old| > δ in its advantage's
    direction: 0.5→0.7 with A > 0 (out), 0.5→0.6 (in), 0.5→0.3 with A < 0 (out), 0.5→0.4 (in), and the moves
    against the advantage stay in however far (0.5→0.2 with A > 0, 0.5→0.8 with A < 0). The rest learn by
    -sg(ρ)·A·log π: gradient -A·ρ, ρ = π/0.5."""
    p = t([[0.7, 0.6, 0.3, 0.4, 0.2, 0.8]])
    adv = t([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]])
    loss, m, grad = run("dppo_binary_tv", p.log(), torch.full_like(p, 0.5).log(), adv)
    torch.testing.assert_close(m["clipfrac"], t([[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(grad, t([[0.0, -1.2, 0.0, 0.8, -0.4, 1.6]]))
    assert loss[0, 1].item() == pytest.approx(-1.2 * math.log(0.6), abs=1e-6)  # 0.61299
    assert loss[0, 0].item() == 0.0
    # the threshold is a setting: at δ = 0.25 no token here leaves the region
    _, m, _ = run("dppo_binary_tv", p.log(), torch.full_like(p, 0.5).log(), adv, dppo_threshold=0.25)
    assert m["clipfrac"].sum() == 0


def test_dppo_binary_kl_masks_by_the_two_point_kl():
    """δ = 0.05. KL(Bern(0.5) || Bern(0.8)) = ½ ln(0.5/0.8) + ½ ln(0.5/0.2) = ½ ln 1.5625 = 0.2231 > δ: out for
    A > 0 (pushed up), in for A < 0 (moving against it); KL(0.5 || 0.55) = 0.00503 < δ: in; KL(0.5 || 0.2) = 0.2231:
    out for A < 0."""
    p = t([[0.8, 0.55, 0.2, 0.8]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    _, m, grad = run("dppo_binary_kl", p.log(), torch.full_like(p, 0.5).log(), adv)
    torch.testing.assert_close(m["clipfrac"], t([[1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(grad, t([[0.0, -1.1, 0.0, 1.6]]))
    # with the bound just above 0.2231, nothing leaves
    _, m, _ = run("dppo_binary_kl", p.log(), torch.full_like(p, 0.5).log(), adv, dppo_threshold=0.224)
    assert m["clipfrac"].sum() == 0


def test_dppo_caps_the_detached_ratio():
    """ρ = 0.9/0.01 = 90 is capped at 20 (the paper's truncation), or at `ratio_cap`; A < 0 moving up is in."""
    _, _, grad = run("dppo_binary_tv", t([[0.9]]).log(), t([[0.01]]).log(), t([[-1.0]]))
    assert grad.item() == pytest.approx(20.0)
    _, _, grad = run("dppo_binary_tv", t([[0.9]]).log(), t([[0.01]]).log(), t([[-1.0]]), ratio_cap=3.0)
    assert grad.item() == pytest.approx(3.0)


# Clip-Cov and KL-Cov ------------------------------------------------------------------------------------------------


def test_clip_cov_detaches_the_tokens_in_the_covariance_window():
    """A = [1, 1, -1, -1], log π = [-1, -3, -1, -3]: means 0 and -2, so the centred products are
    [1·1, 1·(-1), (-1)·1, (-1)·(-1)] = [1, -1, -1, 1]. The window (0.5, 5) holds tokens 0 and 3; with r = 0.5,
    max(1, ⌊0.5·4⌋) = 2 are drawn: both, their loss 0 and gradient 0; tokens 1 and 2 keep PPO's -A."""
    lp = t([[-1.0, -3.0, -1.0, -3.0]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, m, grad = run("clip_cov", lp, lp, adv, clip_cov_ratio=0.5, clip_cov_lb=0.5, clip_cov_ub=5.0)
    torch.testing.assert_close(m["covfrac"], t([[1.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(grad, t([[0.0, -1.0, 1.0, 0.0]]))
    torch.testing.assert_close(loss, t([[0.0, -1.0, 1.0, 0.0]]))
    # r = 0.25: one token of the two is drawn (at random), never one outside the window
    torch.manual_seed(0)
    _, m, _ = run("clip_cov", lp, lp, adv, clip_cov_ratio=0.25, clip_cov_lb=0.5, clip_cov_ub=5.0)
    assert m["covfrac"].sum() == 1 and m["covfrac"][0, 1] == m["covfrac"][0, 2] == 0
    # a window above every product selects nothing
    _, m, _ = run("clip_cov", lp, lp, adv, clip_cov_ratio=0.5, clip_cov_lb=1.5, clip_cov_ub=5.0)
    assert m["covfrac"].sum() == 0


def test_kl_cov_penalises_the_top_covariance_tokens():
    """A = [2, 1, -1, -2], log π = [-1, -2, -3, -2]: means 0 and -2, centred products [2, 0, 1, 0]. k = 0.25 →
    max(1, ⌊0.25·4⌋) = 1 token, token 0, whose π_old is e^-0.1 below π (ρ = e^0.1): its loss is
    -A·ρ + |log ρ| = -2·1.10517 + 0.1 = -2.11034 and its gradient -A·ρ + 1 = -1.21034; the others keep -A·ρ = -A."""
    lp = t([[-1.0, -2.0, -3.0, -2.0]])
    old = lp - t([[0.1, 0.0, 0.0, 0.0]])
    adv = t([[2.0, 1.0, -1.0, -2.0]])
    loss, m, grad = run("kl_cov", lp, old, adv, kl_cov_ratio=0.25)
    torch.testing.assert_close(m["covfrac"], t([[1.0, 0.0, 0.0, 0.0]]))
    assert loss[0, 0].item() == pytest.approx(-2 * math.exp(0.1) + 0.1, abs=1e-6)
    torch.testing.assert_close(grad, t([[-2 * math.exp(0.1) + 1.0, -1.0, 1.0, 2.0]]))
    _, m, _ = run("kl_cov", lp, old, adv, kl_cov_ratio=0.5)  # 2 tokens: 0 and 2 (products 2 and 1)
    torch.testing.assert_close(m["covfrac"], t([[1.0, 0.0, 1.0, 0.0]]))


# GSPO-token, LUSPO -----------------------------------------------------------------------------------------------


def test_gspo_token_equals_gspo_with_one_advantage_per_sequence():
    """GSPO paper eq. 15: with A_{i,t} = A_i, GSPO-token's objective and gradient are GSPO's."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 6, generator=g) * 2
    lp = old + torch.randn(4, 6, generator=g) * 0.3
    mask = torch.arange(6) < t([[6], [3], [5], [1]])
    adv = torch.randn(4, 1, generator=g).expand(4, 6)
    grads = []
    for name in ("gspo", "gspo_token"):
        x = lp.clone().requires_grad_(True)
        loss, m = get_objective(name).fn(x, old, adv, mask, ObjectiveParams(level="sequence", clip_eps=0.05))
        total = aggregate(loss, mask, "seq-mean-token-mean")
        grads.append((total, torch.autograd.grad(total, x)[0]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_luspo_reduction_weights_each_sequence_by_its_length():
    """seq-mean-token-sum: Σ_{i,t} ℓ / num_seqs: rows of 2 and 3 tokens with losses 1 and 2 → (2·1 + 3·2) / 2 = 4."""
    loss = t([[1.0, 1.0, 9.0], [2.0, 2.0, 2.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(4.0)
    assert get_objective("luspo").loss_agg == "seq-mean-token-sum"


# Masks and weights -------------------------------------------------------------------------------------------------


def test_rollout_correction_weights_by_hand():
    """log π_old - log π_sampler = [ln 2, 0, -ln 2] (and a masked token): token weights [2, 1, 0.5]; truncated to
    [·, 1.5] → [1.5, 1, 0.5] (one capped); masked outside [0.6, 1.5] → [0, 1, 0]; the sequence weight is their
    product, 1, which no bound touches."""
    old, sampler = t([[math.log(2), 0.0, -math.log(2), 5.0]]), torch.zeros(1, 4)
    mask = t([[1, 1, 1, 0]])
    w, m = rollout_correction(old, sampler, mask, "token_truncate", None, 1.5)
    torch.testing.assert_close(w[:, :3], t([[1.5, 1.0, 0.5]]))
    torch.testing.assert_close(m["corrected"][:, :3], t([[1.0, 0.0, 0.0]]))
    w, _ = rollout_correction(old, sampler, mask, "token_mask", 0.6, 1.5)
    torch.testing.assert_close(w[:, :3], t([[0.0, 1.0, 0.0]]))
    for mode in ("sequence_truncate", "sequence_mask"):
        w, m = rollout_correction(old, sampler, mask, mode, 0.6, 1.5)
        torch.testing.assert_close(w, t([[1.0]]))
        assert m["corrected"].sum() == 0
    # the mismatch KL per token: (w - 1) - ln w = (2 - 1 - ln 2, 0, 0.5 - 1 + ln 2)
    torch.testing.assert_close(m["mismatch_kl"][:, :3], t([[1 - math.log(2), 0.0, math.log(2) - 0.5]]))


def test_off_policy_sequence_mask_drops_only_negative_far_off_policy_sequences():
    """mean_t (log π_sampler - log π) = 0.5 for rows 0 and 1, 0.1 for row 2; δ = 0.3: row 0 (A < 0) is dropped,
    row 1 (A > 0) and row 2 (close) are kept."""
    lp = torch.zeros(3, 2)
    sampler = t([[0.5, 0.5], [0.5, 0.5], [0.1, 0.1]])
    adv = t([[-1.0], [1.0], [-1.0]]).expand(3, 2)
    keep = off_policy_sequence_mask(adv, lp, sampler, torch.ones(3, 2), 0.3)
    torch.testing.assert_close(keep, t([[0.0], [1.0], [1.0]]))


def test_top_entropy_mask_keeps_the_top_share():
    """Entropies 1..8 (two masked out): ρ = 0.5 keeps those at or above the 0.5 quantile of the six valid ones."""
    h = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0]])
    keep = top_entropy_mask(h, mask, 0.5)  # quantile of [1..6] at 0.5 = 3.5
    torch.testing.assert_close(keep, t([[False, False, False, True], [True, True, False, False]]))


def test_adaptive_entropy_controller_steps_and_gates():
    ctl = AdaptiveEntropyController(0.1, target=1.0, delta=0.05, low=0.0, high=0.12)
    assert ctl.value == 0.0  # no step measured: no bonus
    ctl.update(0.8)  # below target: up (capped at 0.12), bonus on
    assert (ctl.coef, ctl.value) == (pytest.approx(0.12), pytest.approx(0.12))
    ctl.update(1.5)  # above: down, bonus off
    assert (ctl.coef, ctl.value) == (pytest.approx(0.07), 0.0)
    restored = AdaptiveEntropyController(0.0, 1.0, 0.05, 0.0, 0.12)
    restored.load_state_dict(ctl.state_dict())
    assert (restored.coef, restored.last_entropy) == (ctl.coef, ctl.last_entropy)


# The registry and the config's refusals ------------------------------------------------------------------------------


def test_every_objective_is_registered_and_documented():
    from typing import get_args, get_type_hints

    from rlhfkit.config.stages import OnlineOptions

    names = get_args(get_type_hints(OnlineOptions)["policy_loss"])
    assert set(names) == set(OBJECTIVES)
    for spec in OBJECTIVES.values():
        assert "arXiv" in spec.fn.__doc__ or "arXiv" in (getattr(spec.fn, "__wrapped__", spec.fn).__doc__ or "")


@pytest.mark.parametrize(("overrides", "message"), [
    (["algo.policy_loss=gmpo", "algo.algorithm=ppo"], "'algo.policy_loss' gmpo at the token level reads one advantage per sequence"),
    (["algo.policy_loss=gspo", "algo.algorithm=reinforce_pp"], "'algo.policy_loss' gspo at the sequence level"),
    (["algo.policy_loss=gspo", "algo.importance_sampling_level=token"], "'algo.importance_sampling_level' must be one of sequence"),
    (["algo.policy_loss=cispo", "algo.delta=2"], "'algo.delta' applies to policy_loss gspo, gspo_token, luspo, ppo_clip, not cispo"),
    (["algo.policy_loss=sapo", "algo.clip_eps=0.3"], "'algo.clip_eps' applies to policy_loss"),
    (["algo.ratio_cap=4"], "'algo.ratio_cap' applies to policy_loss cispo, dppo_binary_kl, dppo_binary_tv, not ppo_clip"),
    (["algo.algorithm=dapo", "algo.bias_corrected_kl=true"], "'algo.bias_corrected_kl' corrects a KL term in the loss"),
    (["algo.policy_loss=gmpo", "algo.top_entropy_quantile=0.2"], "'algo.top_entropy_quantile' selects tokens"),
    (["algo.entropy_target=1"], "'algo.entropy_target' applies only with algo.adaptive_entropy=true"),
    (["algo.adaptive_entropy=true", "algo.entropy_coef=2"], "'algo.entropy_coef' is the adaptive coefficient's start"),
    (["algo.rollout_correction_max=2"], "'algo.rollout_correction_max' applies only with algo.rollout_correction"),
    (["algo.rollout_correction=token_mask", "algo.old_logprob_source=sampler"], "'algo.rollout_correction' weighs"),
    (["algo.rollout_correction=token_mask", "generation.engine=hf"], "needs generation.engine=rlhfkit"),
    (["algo.policy_loss=vespo", "algo.rollout_correction=sequence_mask"], "token_truncate or token_mask with vespo"),
    (["algo.rollout_correction=token_mask", "algo.rollout_correction_min=3"], "must be below rollout_correction_max"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(OnlineConfig, "configs/grpo_tiny.yaml", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_combines_with_grpo_and_the_token_level_ones_with_ppo(name):
    load_config(OnlineConfig, "configs/grpo_tiny.yaml", [f"algo.policy_loss={name}"])
    spec = OBJECTIVES[name]
    if spec.levels[0] not in spec.sequence_advantage_levels:  # per-token advantages are fine: PPO with its critic too
        load_config(OnlineConfig, "configs/ppo_tiny.yaml", [f"algo.policy_loss={name}"])
