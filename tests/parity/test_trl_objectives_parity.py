"""Parity of the policy objectives with TRL 1.16's own code, on fresh random tensors per case: loss, gradient with
respect to the log-probs, and every figure TRL logs.

Where TRL's code is called (installed trl==1.16.0):
  - `GRPOTrainer._compute_loss` (trl/trainer/grpo_trainer.py, lines 3020-3290) on an `object.__new__(GRPOTrainer)`
    carrying the attributes it reads, `_get_per_token_logps_and_entropies` stubbed to return our leaf log-probs and
    the given entropies, an identity accelerator (one process). Every `loss_type` TRL accepts (grpo, dapo, bnpo,
    dr_grpo, cispo, sapo, luspo, vespo) at both `importance_sampling_level`s (vespo: token only, the level rlhfkit
    accepts; TRL's sequence level changes only its bias-corrected KL weight), each plain and with `delta`,
    `top_entropy_quantile`, `off_policy_mask_threshold` and the bias-corrected KL together; and with the sampler
    correction's `importance_sampling_ratio`, and with adaptive entropy (the controller's coefficient step by step).
  - `GRPOTrainer.get_high_entropy_mask`, `get_off_policy_mask`, `get_gamma_weights`: inside `_compute_loss`.
  - trl/experimental/gmpo `GMPOTrainer._compute_loss` for GMPO, the same way.

Faithful transcription (inline in `_generate_and_score_completions`, so it cannot be called): the sampler-correction
weights, grpo_trainer.py (1.16.0) lines 2659-2706, as `trl_is_ratio` below, the loop's locals made arguments.

Deliberate differences, not compared: TRL's entropy bonus is a token mean whatever the loss type, rlhfkit's follows
the loss's reduction (identical for the token-mean types, compared there); TRL's "bnpo" normalises each micro-batch
by its own token count, rlhfkit by the minibatch's (identical on one micro-batch, as here).
"""

from __future__ import annotations

import math
import types
import zlib
from collections import defaultdict

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOTrainer  # noqa: E402

from rlhfkit.kl_control import AdaptiveEntropyController  # noqa: E402
from rlhfkit.losses.aggregate import aggregate  # noqa: E402
from rlhfkit.losses.correction import off_policy_sequence_mask, rollout_correction, top_entropy_mask  # noqa: E402
from rlhfkit.losses.objectives import ObjectiveParams  # noqa: E402
from rlhfkit.losses.policy import policy_objective  # noqa: E402
from rlhfkit.ops import masked_mean  # noqa: E402
from parity_helpers import TOL, IdentityAccelerator, assert_loss_and_grads_match, leaf  # noqa: E402

B, R = 8, 10
MAX_LEN = R + 6  # TRL's max_completion_length, wider than the batch
EXTRA_ITEMS = 37  # num_items_in_batch spans more tokens than this micro-batch (the accumulated batch)

# TRL loss_type -> (rlhfkit policy_loss, reduction, normaliser keyword)
LOSS_TYPES = {
    "grpo": ("ppo_clip", "seq-mean-token-mean"), "dapo": ("ppo_clip", "token-mean"),
    "bnpo": ("ppo_clip", "token-mean"), "dr_grpo": ("ppo_clip", "seq-mean-token-sum-norm"),
    "cispo": ("cispo", "token-mean"), "sapo": ("sapo", "seq-mean-token-mean"),
    "luspo": ("luspo", "seq-mean-token-sum"), "vespo": ("vespo", "token-mean"),
}
GLOBAL_COUNT = {"dapo", "cispo", "vespo"}  # normalised by num_items_in_batch


def fresh_batch(case: str) -> dict:
    """Random tensors of their own for each case (seeded by the case's name, so a failure reproduces)."""
    g = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    lengths = torch.randint(2, R + 1, (B,), generator=g)
    mask = torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, R, generator=g) * 3
    # Per-token noise plus a per-sequence shift, so that token and sequence ratios reach the clip region: the first
    # sequence moved up with a positive advantage, the second down with a negative one (both clipped at either level,
    # and the second far off-policy), the rest at random.
    shift = torch.randn(B, 1, generator=g) * 0.25
    shift[:2, 0] = torch.tensor([0.6, -0.6])
    advantages = torch.randn(B, generator=g)
    advantages[:2] = torch.tensor([1.0, -1.0]) * advantages[:2].abs()
    new = old + torch.randn(B, R, generator=g) * 0.3 + shift
    return dict(logprobs=leaf(new), old=old, ref=old + torch.randn(B, R, generator=g) * 0.2,
                sampling=old + torch.randn(B, R, generator=g) * 0.15, advantages=advantages,
                entropies=torch.rand(B, R, generator=g) * 3, mask=mask)


def trl_args(**overrides) -> types.SimpleNamespace:
    args = dict(delta=None, use_bias_correction_kl=False, steps_per_generation=1, sapo_temperature_pos=1.0,
                sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                entropy_target=0.2, entropy_coef_delta=0.005, entropy_coef_min=0.0, entropy_coef_max=1.0)
    return types.SimpleNamespace(**{**args, **overrides})


def trl_trainer(batch: dict, cls=GRPOTrainer, **attrs):
    trainer = object.__new__(cls)
    defaults = dict(
        model=types.SimpleNamespace(training=True), accelerator=IdentityAccelerator(),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (batch["logprobs"], batch["entropies"], None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", loss_type="grpo",
        beta=0.0, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, _entropy_bonus_enabled=False,
        use_adaptive_entropy=False, entropy_coef=0.0, _last_world_entropy=float("inf"), _entropy_window_stats=None,
        aux_loss_enabled=False, args=trl_args())
    for name, value in {**defaults, **attrs}.items():
        setattr(trainer, name, value)
    return trainer


def trl_inputs(batch: dict, is_ratio: torch.Tensor | None = None) -> dict:
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, R, dtype=torch.long), "completion_mask": batch["mask"].long(),
              "advantages": batch["advantages"], "old_per_token_logps": batch["old"],
              "ref_per_token_logps": batch["ref"], "sampling_per_token_logps": batch["sampling"],
              "num_items_in_batch": torch.tensor(float(batch["mask"].sum() + EXTRA_ITEMS))}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return inputs


def ours(batch: dict, loss_type: str, level: str, *, beta=0.0, bias=False, delta=None, quantile=1.0, threshold=None,
         is_weights=None, entropy_coef=0.0):
    """rlhfkit's loss and metrics for TRL's `loss_type`, through `policy_objective` and `aggregate`."""
    objective, agg = LOSS_TYPES[loss_type]
    mask, adv = batch["mask"], batch["advantages"].unsqueeze(1).expand(B, R)
    params = ObjectiveParams(level=level, clip_eps=0.2, clip_eps_high=0.28, delta=delta,
                             ratio_cap=0.28 if objective == "cispo" else None)  # TRL's cispo caps ρ at epsilon_high
    terms = {}
    if quantile < 1:
        terms["token_keep"] = top_entropy_mask(batch["entropies"], mask, quantile)
    if threshold is not None:
        terms["sequence_keep"] = off_policy_sequence_mask(adv, batch["logprobs"], batch["sampling"], mask, threshold)
    per_token, m = policy_objective(
        batch["logprobs"], batch["old"], adv, mask, objective=objective, params=params,
        ref_logprobs=batch["ref"] if beta else None, kl_coef=beta, bias_corrected_kl=bias,
        entropy=batch["entropies"] if entropy_coef else None, entropy_coef=entropy_coef, is_weights=is_weights, **terms)
    loss = aggregate(per_token, mask, agg, num_tokens=float(mask.sum() + EXTRA_ITEMS) if loss_type in GLOBAL_COUNT
                     else None, num_seqs=B, max_len=MAX_LEN)
    return loss, m


def figure(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x.mean()) if x.shape[-1] == 1 else float(masked_mean(x, mask))


def assert_figures_match(m: dict, trl_metrics: dict, loss_type: str, mask: torch.Tensor) -> None:
    if loss_type in ("grpo", "dapo", "bnpo", "dr_grpo", "luspo"):
        pairs = {"clip_ratio/region_mean": "clipfrac", "clip_ratio/low_mean": "clip_low", "clip_ratio/high_mean": "clip_high"}
    else:
        pairs = {"cispo": {"cispo_clip_ratio": "clipfrac"}, "vespo": {"vespo/phi_seq_mean": "phi"}}.get(loss_type, {})
    if "kl" in trl_metrics:
        pairs["kl"] = "kl"
    for trl_name, key in pairs.items():
        assert figure(m[key], mask) == pytest.approx(trl_metrics[trl_name][0], abs=1e-6), trl_name


CASES = [(t, level, extras) for t in LOSS_TYPES for level in ("token", "sequence") for extras in (False, True)
         if not (t == "vespo" and level == "sequence")]


@pytest.mark.parametrize(("loss_type", "level", "extras"), CASES,
                         ids=[f"{t}-{lv}-{'extras' if e else 'plain'}" for t, lv, e in CASES])
def test_loss_type_matches_trl(loss_type, level, extras):
    """Every TRL loss type at both levels; "extras": delta, top-entropy tokens, the off-policy mask and the
    bias-corrected KL, all at once."""
    batch = fresh_batch(f"{loss_type}-{level}-{extras}")
    beta = 0.04
    knobs = dict(delta=1.5 if extras else None, quantile=0.6 if extras else 1.0, threshold=0.02 if extras else None,
                 bias=extras)
    clip_type = LOSS_TYPES[loss_type][0] in ("ppo_clip", "luspo")
    trainer = trl_trainer(batch, loss_type=loss_type, importance_sampling_level=level, beta=beta,
                          top_entropy_quantile=knobs["quantile"], off_policy_mask_threshold=knobs["threshold"],
                          args=trl_args(delta=knobs["delta"] if clip_type else None, use_bias_correction_kl=extras))
    theirs = GRPOTrainer._compute_loss(trainer, trainer.model, trl_inputs(batch))
    mine, m = ours(batch, loss_type, level, beta=beta, bias=knobs["bias"],
                   delta=knobs["delta"] if clip_type else None, quantile=knobs["quantile"], threshold=knobs["threshold"])
    assert_loss_and_grads_match(mine, theirs, [batch["logprobs"]])
    assert_figures_match(m, trainer._metrics["train"], loss_type, batch["mask"])
    if clip_type:  # the fresh tensors exercised both branches of the clip
        assert 0 < figure(m["clipfrac"], batch["mask"]) < 1
    if extras:  # and the masks kept some tokens and sequences, and dropped some
        keep = off_policy_sequence_mask(batch["advantages"].unsqueeze(1).expand(B, R), batch["logprobs"],
                                        batch["sampling"], batch["mask"], 0.02)
        assert 0 < float(keep.mean()) < 1


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """Transcription: grpo_trainer.py (1.16.0) lines 2659-2706, the vLLM importance-sampling ratio."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    if sequence_level_is:
        per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
        logps_diff = per_sequence_logps_diff
    else:
        logps_diff = per_token_logps_diff
    vllm_importance_sampling_ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        vllm_importance_sampling_ratio = torch.clamp(vllm_importance_sampling_ratio, min=clip_min, max=clip_max)
    elif mode in ["sequence_mask", "token_mask"]:
        min_val = clip_min if clip_min is not None else -math.inf
        max_val = clip_max if clip_max is not None else math.inf
        invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (vllm_importance_sampling_ratio > max_val)
        vllm_importance_sampling_ratio = vllm_importance_sampling_ratio.masked_fill(invalid_mis_mask, value=0.0)
    return vllm_importance_sampling_ratio


CORRECTIONS = [("token_truncate", "dapo"), ("token_mask", "grpo"), ("sequence_truncate", "cispo"),
               ("sequence_mask", "sapo"), ("token_mask", "vespo"), ("token_truncate", "vespo")]


@pytest.mark.parametrize(("mode", "loss_type"), CORRECTIONS, ids=[f"{m}-{t}" for m, t in CORRECTIONS])
def test_sampler_correction_matches_trl(mode, loss_type):
    """The weights equal TRL's ratio (bounds that cap or mask some tokens or sequences), and the loss weighted by
    them equals TRL's `_compute_loss` given that ratio (VESPO folds it into its Gamma weight)."""
    batch = fresh_batch(f"correction-{mode}-{loss_type}")
    clip_min, clip_max = (0.9, 1.1) if mode.startswith("token") else (0.7, 1.4)
    weights, cm = rollout_correction(batch["old"], batch["sampling"], batch["mask"], mode, clip_min, clip_max)
    expected = trl_is_ratio(batch["old"], batch["sampling"], batch["mask"].float(), mode, clip_min, clip_max)
    torch.testing.assert_close(weights, expected, **TOL)
    assert 0 < figure(cm["corrected"], batch["mask"]) < 1
    trainer = trl_trainer(batch, loss_type=loss_type, use_vllm=True, vllm_importance_sampling_correction=True)
    theirs = GRPOTrainer._compute_loss(trainer, trainer.model, trl_inputs(batch, expected))
    mine, _ = ours(batch, loss_type, "token", is_weights=weights)
    assert_loss_and_grads_match(mine, theirs, [batch["logprobs"]])


def test_adaptive_entropy_matches_trl():
    """Skywork-OR1's controller, step by step with TRL's (bnpo, one micro-batch per step: the bonus is then the same
    token mean on both sides): the loss with the bonus, the coefficient and the gating after each step."""
    ctl = AdaptiveEntropyController(0.05, target=1.2, delta=0.02, low=0.01, high=0.09)
    args = trl_args(entropy_target=1.2, entropy_coef_delta=0.02, entropy_coef_min=0.01, entropy_coef_max=0.09)
    trainer, bonus_steps = None, 0
    for step, scale in enumerate((1.0, 0.5, 0.5, 0.5, 2.0, 2.0)):  # entropies above, then below, then above target
        batch = fresh_batch(f"adaptive-{step}")
        batch["entropies"] = leaf(batch["entropies"] * scale)
        if trainer is None:
            trainer = trl_trainer(batch, loss_type="bnpo", use_adaptive_entropy=True, entropy_coef=0.05,
                                  _entropy_bonus_enabled=True, args=args)
        trainer._get_per_token_logps_and_entropies = lambda *a, b=batch, **k: (b["logprobs"], b["entropies"], None)
        mine, _ = ours(batch, "bnpo", "token", entropy_coef=ctl.value)
        theirs = GRPOTrainer._compute_loss(trainer, trainer.model, trl_inputs(batch))
        used = [batch["logprobs"]] + ([batch["entropies"]] if ctl.value else [])  # no bonus: entropies unused
        bonus_steps += ctl.value > 0
        assert_loss_and_grads_match(mine, theirs, used)
        ctl.update(float(masked_mean(batch["entropies"].detach(), batch["mask"])))
        assert ctl.coef == pytest.approx(trainer.entropy_coef, abs=1e-9)
        assert ctl.last_entropy == pytest.approx(trainer._last_world_entropy, abs=1e-6)
    assert 0 < bonus_steps < 6 and ctl.value == 0  # the bonus came on below the target, and off above it


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gmpo_matches_trl_experimental(beta):
    from trl.experimental.gmpo import GMPOTrainer

    batch = fresh_batch(f"gmpo-{beta}")
    trainer = trl_trainer(batch, cls=GMPOTrainer, beta=beta, epsilon_low=0.1, epsilon_high=0.15)
    theirs = GMPOTrainer._compute_loss(trainer, trainer.model, trl_inputs(batch))
    mask, adv = batch["mask"], batch["advantages"].unsqueeze(1).expand(B, R)
    per_token, m = policy_objective(batch["logprobs"], batch["old"], adv, mask, objective="gmpo",
                                    params=ObjectiveParams(clip_eps=0.1, clip_eps_high=0.15),
                                    ref_logprobs=batch["ref"] if beta else None, kl_coef=beta)
    mine = aggregate(per_token, mask, "seq-mean-token-mean")
    assert_loss_and_grads_match(mine, theirs, [batch["logprobs"]])
    got = trainer._metrics["train"]
    for trl_name, key in {"clip_ratio/region_mean": "clipfrac", "clip_ratio/low_mean": "clip_low",
                          "clip_ratio/high_mean": "clip_high"}.items():
        assert figure(m[key], mask) == pytest.approx(got[trl_name][0], abs=1e-6), trl_name
    assert 0 < figure(m["clipfrac"], mask) < 1
