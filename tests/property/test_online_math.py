"""The online loop computes what it claims (issue 9, items 1-8): each test fails for the bug it names.

- the entropy bonus is the gradient of the full distribution's entropy, not of the sampled token's log-prob;
- Dr. GRPO's normaliser is the configured max_new_tokens, whatever width a rollout is padded to;
- excluding truncated samples from the loss does not change their siblings' baselines;
- the rollout's no-grad forwards (and, by default, the update forward) run without dropout: lr = 0 ⇒ ratio 1;
- an algorithm without a reference logs no KL it did not measure;
- reward.missing_eos_penalty is a positive number subtracted (TRL's convention);
- a NaN reward does not poison the running reward statistics; blown-up weights are bad steps, not a traceback.
"""

import dataclasses
import json
import math

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from transformers import TrainerCallback

from rlhfkit.cli import main
from rlhfkit.config import OnlineConfig, load_config
from rlhfkit.errors import UserError
from rlhfkit.losses.aggregate import aggregate
from rlhfkit.critic import critic_values
from rlhfkit.models import rollout_logprobs
from rlhfkit.objects import Objects
from rlhfkit.ops import entropy_from_logits, logprobs_from_logits
from rlhfkit.stages import run_stage
from rlhfkit.trainers import online_setup
from rlhfkit.trainers.online import OnlineTrainer, sampler_is_exact
from rlhfkit.trainers.policy_update import PolicyUpdate
from tests.hooks import causal_lm_forwards

FAST = ["logging.progress_bar=false", "algo.rollout_batch_size=4", "optim.per_device_batch_size=4", "algo.num_minibatches=1"]


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def build(tmp_path, config, *overrides, rollout=None):
    """An online trainer, set up; `rollout`: `Objects.rollout` (wraps the rollout component)."""
    cfg = load_config(OnlineConfig, f"configs/{config}", [f"output_dir={tmp_path / 'run'}", *FAST, *overrides])
    trainer = OnlineTrainer(cfg, Objects(rollout=rollout))
    trainer.setup()
    return trainer


def assert_same_run(a, b, rtol=1e-5, atol=1e-6):
    """Two run directories with the same metrics (wall times and measured memory aside) and the same final weights."""
    from safetensors.torch import load_file

    rows_a, rows_b = rows_of(a / "metrics.jsonl"), rows_of(b / "metrics.jsonl")
    assert len(rows_a) == len(rows_b)
    for r1, r2 in zip(rows_a, rows_b):
        for key, value in r2.items():
            if not key.startswith(("time/", "memory/")):
                assert r1[key] == pytest.approx(value, rel=rtol, abs=atol), key
    w1, w2 = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=rtol, atol=atol)


def update_with(t, shares_base=None, **algo):
    """The trainer's update component built again with `algo` changes (a config given at construction)."""
    cfg = dataclasses.replace(t.cfg, algo=dataclasses.replace(t.cfg.algo, **algo))
    return PolicyUpdate(cfg, t.algo, t.run, t.model, t.value, t.shares_base if shares_base is None else shares_base,
                        t.optim, None, t.kl_ctl, t.update.old_source)


def grads(trainer):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for p in trainer.model.parameters() if p.requires_grad]


class NonzeroAdapters(TrainerCallback):
    """LoRA B starts at zero, so the adapters change nothing until trained: make them non-zero when training begins
    (seeded; `on_train_begin` gets the model), so that with lr = 0 the policy still differs from its base and dropout
    on the adapter input changes the output."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)


# 1. Entropy bonus ------------------------------------------------------------------------------------------------


def test_entropy_bonus_gradient_is_the_exact_entropy_gradient():
    """On a 5-token vocabulary, with zero advantages the objective is -c·H aggregated: its gradient with respect to
    the logits equals -c·∇H, H = -Σ p log p computed here from the probabilities themselves."""
    from rlhfkit.losses.policy import policy_objective

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    new_lp = logprobs_from_logits(logits, tokens)
    per_token, _ = policy_objective(new_lp, new_lp.detach(), torch.zeros(2, 3),
                                    entropy=entropy_from_logits(logits), entropy_coef=0.3)
    (got,) = torch.autograd.grad(aggregate(per_token, mask, "token-mean"), logits)

    leaf = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(leaf, -1)
    exact_h = -(p * torch.log(p)).sum(-1)  # (2, 3)
    (expected,) = torch.autograd.grad(-0.3 * (exact_h * mask).sum() / mask.sum(), leaf)
    assert expected.abs().max() > 1e-2  # the entropy has a gradient to follow
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_trainer_entropy_bonus_follows_the_models_entropy(tmp_path):
    """Through the trainer: the gradient the bonus adds (coef 0.5 minus coef 0) is -0.5·∇ of the aggregated entropy
    of the model's own next-token distributions at the response positions."""
    t = build(tmp_path, "grpo_tiny.yaml", "algo.entropy_coef=0.5", "max_steps=1")
    exp = t.experience(0).experience
    n = exp.loss_mask.shape[0]
    num_tokens, num_seqs = float(exp.loss_mask.sum()), float(n)
    t.model.train()

    def loss_grads(coef):
        t.model.zero_grad(set_to_none=True)
        loss, *_ = update_with(t, entropy_coef=coef).policy_loss(exp, "token-mean", num_tokens, num_seqs)
        loss.backward()
        return grads(t)

    with_bonus, without = loss_grads(0.5), loss_grads(0.0)
    ro = exp.rollout
    t.model.zero_grad(set_to_none=True)
    position_ids = (ro.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = t.model(input_ids=ro.input_ids, attention_mask=ro.attention_mask, position_ids=position_ids).logits
    width = ro.response_ids.shape[1]
    h = entropy_from_logits(logits[:, -width - 1 : -1], t.cfg.generation.temperature)  # (B, R)
    (-0.5 * aggregate(h, exp.loss_mask, "token-mean", num_tokens=num_tokens)).backward()
    expected = grads(t)
    assert max(float(e.abs().max()) for e in expected) > 1e-4
    for a, b, e in zip(with_bonus, without, expected):
        torch.testing.assert_close(a - b, e, rtol=1e-3, atol=1e-6)


# 2. Dr. GRPO's constant normaliser --------------------------------------------------------------------------------


def _pad_response(exp, extra):
    """The same rollout with `extra` more padding columns after every response."""
    pad = lambda x, value=0: torch.nn.functional.pad(x, (0, extra), value=value)  # noqa: E731
    ro = exp.rollout
    padded = dataclasses.replace(ro, response_ids=pad(ro.response_ids, 0), response_mask=pad(ro.response_mask),
                                 sampler_logprobs=pad(ro.sampler_logprobs), action_mask=pad(ro.action_mask))
    widths = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns", "loss_mask")
    return dataclasses.replace(exp, rollout=padded, **{k: pad(getattr(exp, k)) for k in widths if getattr(exp, k) is not None})


def _loss_and_grads(t, exp):
    """The aggregated policy loss of `exp` as one micro-batch at its own width (the update's normalisation: the
    rollout's tokens and rows), and its gradient."""
    t.model.train()
    t.model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    loss, *_ = t.update.policy_loss(exp, "seq-mean-token-sum-norm", float(exp.loss_mask.sum()),
                                         float(exp.loss_mask.shape[0]))
    loss.backward()
    return float(loss.detach()), grads(t)


def test_dr_grpo_loss_does_not_depend_on_the_padded_width(tmp_path):
    t = build(tmp_path, "grpo_tiny.yaml", "algo.algorithm=dr_grpo", "optim.lr=0", "max_steps=1",
              "optim.per_device_batch_size=16")
    exp = t.experience(0).experience
    assert exp.loss_mask.shape[1] <= t.cfg.generation.max_new_tokens
    assert t.algo.default_loss_agg == "seq-mean-token-sum-norm"
    loss_a, grad_a = _loss_and_grads(t, exp)
    loss_b, grad_b = _loss_and_grads(t, _pad_response(exp, 7))  # the same rows, 7 columns wider
    assert loss_a != 0.0
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for a, b in zip(grad_a, grad_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


# 3. Truncated samples and their siblings' baselines ---------------------------------------------------------------


class ForcedEOS:
    """A rollout component whose rows' `has_eos` are forced (the run's own sampling otherwise)."""

    def __init__(self, inner, has_eos):
        self.inner, self.has_eos = inner, has_eos

    def __call__(self, policy, prompts, examples, step):
        return dataclasses.replace(self.inner(policy, prompts, examples, step), has_eos=torch.tensor(self.has_eos))


def _fixed_scores(monkeypatch, tmp_path, scores, has_eos):
    """(the `reward.function` override that scores rows `scores` under the public contract, the `Objects.rollout`
    that forces their `has_eos`)."""
    module = "fixed_scores_" + "_".join(str(int(x)) for x in scores)  # one module per list: imports are cached
    (tmp_path / f"{module}.py").write_text(f"def reward(prompts, completions):\n    return {list(scores)!r}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"reward.function={module}:reward", lambda inner: ForcedEOS(inner, has_eos)


@pytest.mark.parametrize("algorithm", ["rloo", "grpo"])
def test_truncated_sample_excluded_from_loss_keeps_its_siblings_baseline(algorithm, tmp_path, monkeypatch):
    """Scores [1, 1, 1, 5], the 5 truncated, mask_truncated=true: the siblings' advantages are those of all four
    scores (RLOO: 1 - (1 + 1 + 5)/3 = -4/3), and the truncated sample takes no loss."""
    config = "rloo_tiny.yaml" if algorithm == "rloo" else "grpo_tiny.yaml"
    fixed, forced = _fixed_scores(monkeypatch, tmp_path, [1.0, 1.0, 1.0, 5.0], [True, True, True, False])
    t = build(tmp_path, config, f"algo.algorithm={algorithm}", "algo.mask_truncated=true", "kl.coef=0", "algo.rollout_batch_size=1",
              "generation.num_samples=4", "optim.lr=0", "max_steps=1", "algo.whiten_advantages=false", fixed, rollout=forced)
    exp = t.experience(0).experience
    mask = exp.rollout.response_mask.float()
    assert exp.loss_mask[3].sum() == 0 and torch.equal(exp.loss_mask[:3], mask[:3])
    per_sequence = (exp.advantages[:3] * mask[:3]).sum(1) / mask[:3].sum(1)
    if algorithm == "rloo":
        torch.testing.assert_close(per_sequence, torch.full((3,), -4.0 / 3.0))
    else:
        scores = torch.tensor([1.0, 1.0, 1.0, 5.0])
        expected = (scores[:3] - scores.mean()) / (scores.std() + 1e-4)
        torch.testing.assert_close(per_sequence, expected)


# 4. Dropout in the rollout forwards -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_lora_dropout_lr_zero_gives_ratio_one_at_every_step(stage, tmp_path, monkeypatch):
    out = tmp_path / "run"
    run_stage(stage, f"configs/{stage}_tiny.yaml", [f"output_dir={out}", "model.lora.enabled=true", "model.lora.r=4",
                                                    "model.lora.dropout=0.1", "optim.lr=0", "algo.ppo_epochs=2",
                                                    "max_steps=3", *FAST], callbacks=[NonzeroAdapters()])
    rows = rows_of(out / "metrics.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["val/ratio"] == pytest.approx(1.0, abs=1e-6), row["step"]
        assert row["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-10), row["step"]
        assert row["policy/clipfrac_avg"] == 0.0, row["step"]
    # The switch: with dropout kept in the update forward, the same run's ratio moves off 1.
    out = tmp_path / "dropout"
    run_stage(stage, f"configs/{stage}_tiny.yaml", [f"output_dir={out}", "model.lora.enabled=true", "model.lora.r=4",
                                                    "model.lora.dropout=0.1", "optim.lr=0", "max_steps=1",
                                                    "algo.disable_dropout=false", "algo.ppo_epochs=2", *FAST],
              callbacks=[NonzeroAdapters()])
    assert abs(rows_of(out / "metrics.jsonl")[0]["policy/approxkl_avg"]) > 1e-6


def test_lora_ppo_uses_disabled_adapters_as_reference(tmp_path, monkeypatch):
    """Non-zero adapters at lr = 0: the policy differs from its base, so the KL to the reference (adapters disabled)
    is positive; were the adapters left on, the reference would be the policy and the KL 0."""
    out = tmp_path / "run"
    run_stage("ppo", "configs/ppo_tiny.yaml", [f"output_dir={out}", "model.lora.enabled=true", "model.lora.r=4",
                                               "optim.lr=0", "max_steps=1", *FAST], callbacks=[NonzeroAdapters()])
    assert rows_of(out / "metrics.jsonl")[-1]["objective/kl"] > 0.05


# 7. DAPO's options take effect --------------------------------------------------------------------------------


def test_dapo_options_take_effect(tmp_path, monkeypatch):
    """Dynamic filtering drops the group whose four scores are equal (one round: the scripted scores cannot score a
    refill, which tests/unit/test_dynamic_sampling.py covers); mask_truncated drops the truncated sample;
    clip-higher (ε_high = 0.28) leaves a ratio of 1.25 unclipped where the symmetric 0.2 clips it."""
    fixed, forced = _fixed_scores(monkeypatch, tmp_path, [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0],
                                  [True] * 5 + [False] + [True] * 2)
    t = build(tmp_path, "grpo_tiny.yaml", "algo.algorithm=dapo", "algo.dynamic_filtering=true",
              "algo.max_sampling_rounds=1", "algo.mask_truncated=true",
              "algo.clip_eps_high=0.28", "algo.rollout_batch_size=2", "optim.lr=0", "max_steps=1",
              "optim.per_device_batch_size=8", fixed, rollout=forced)
    exp = t.experience(0).experience
    kept = exp.loss_mask.sum(1) > 0
    assert kept.tolist() == [False] * 4 + [True, False, True, True]
    assert t.cfg.algo.loss_agg is None and t.algo.default_loss_agg == "token-mean"
    assert exp.old_logprobs is None  # one pass over the experience: π_old is the update forward's own log-probs
    with torch.no_grad():
        old = rollout_logprobs(t.model, exp.rollout, t.cfg.generation.temperature)
    shifted = dataclasses.replace(exp, old_logprobs=old - math.log(1.25))  # ratio π/π_old = 1.25 everywhere
    positive = float((exp.loss_mask * (exp.advantages > 0)).sum() / exp.loss_mask.sum())
    assert 0 < positive < 1
    t.model.train()
    _, high, *_ = t.update.policy_loss(shifted, "token-mean", 1.0, 8.0)
    _, symmetric, *_ = update_with(t, clip_eps_high=None).policy_loss(shifted, "token-mean", 1.0, 8.0)
    assert high["val/ratio"][0] == pytest.approx(1.25, rel=1e-5)
    assert high["policy/clipfrac_avg"][0] == 0.0
    assert symmetric["policy/clipfrac_avg"][0] == pytest.approx(positive, abs=1e-6)


# 5. No reference, no KL ------------------------------------------------------------------------------------------


def test_algorithms_without_a_reference_log_no_kl(tmp_path):
    out = tmp_path / "drgrpo"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "algo.algorithm=dr_grpo", "max_steps=2",
                 "logging.sample_log_steps=1", *FAST]) == 0
    for row in rows_of(out / "metrics.jsonl"):
        assert not {"objective/kl", "objective/kl_coef", "objective/rlhf_reward"} & row.keys(), row
        assert math.isfinite(row["objective/scores"])
    assert all(s["kl"] is None for s in rows_of(out / "samples.jsonl"))
    # With a reference (GRPO), the KL is measured and logged.
    out = tmp_path / "grpo"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "max_steps=1", *FAST]) == 0
    row = rows_of(out / "metrics.jsonl")[0]
    assert row["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # step 1: the policy is the reference
    assert row["objective/rlhf_reward"] == pytest.approx(row["objective/scores"], abs=1e-5)


# 6. missing_eos_penalty ------------------------------------------------------------------------------------------


def test_missing_eos_penalty_is_subtracted(tmp_path, monkeypatch):
    """TRL's convention: penalty 2 turns the truncated sample's 5 into 3; RLOO's first advantage is 1 - 5/3."""
    fixed, forced = _fixed_scores(monkeypatch, tmp_path, [1.0, 1.0, 1.0, 5.0], [True, True, True, False])
    t = build(tmp_path, "rloo_tiny.yaml", "algo.algorithm=rloo", "reward.missing_eos_penalty=2.0", "kl.coef=0", "algo.rollout_batch_size=1",
              "generation.num_samples=4", "max_steps=1", "algo.whiten_advantages=false", fixed, rollout=forced)
    exp = t.experience(0).experience
    mask = exp.rollout.response_mask.float()
    first = float((exp.advantages[0] * mask[0]).sum() / mask[0].sum())
    assert first == pytest.approx(1.0 - 5.0 / 3.0, abs=1e-5)


def test_negative_missing_eos_penalty_is_refused():
    with pytest.raises(UserError, match=r"reward.missing_eos_penalty.*subtracted"):
        load_config(OnlineConfig, "configs/rloo_tiny.yaml", ["reward.missing_eos_penalty=-1.0"])


# 8. Non-finite values online -------------------------------------------------------------------------------------


def _second_step_reward(tmp_path, monkeypatch, module: str, rows_per_step: int, change: str) -> None:
    """`module:reward`: each completion's length, with `change` applied to the second step's rows."""
    (tmp_path / f"{module}.py").write_text(
        "seen = 0\n"
        "def reward(prompts, completions):\n"
        "    global seen\n"
        "    out = [float(len(c)) for c in completions]\n"
        f"    if {rows_per_step} <= seen < {2 * rows_per_step}:\n"
        f"        {change}\n"
        "    seen += len(completions)\n"
        "    return out\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_one_nan_reward_does_not_poison_running_normalisation(tmp_path, monkeypatch):
    """Step 2's rewards hold a NaN: that step is skipped, and steps 3 and 4 train (running moments untouched)."""
    _second_step_reward(tmp_path, monkeypatch, "one_nan", 16, "out[0] = float('nan')")
    out = tmp_path / "run"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "reward.function=one_nan:reward",
                 "reward.normalize=running", "max_steps=4", "max_bad_steps=2", *FAST]) == 0
    rows = rows_of(out / "metrics.jsonl")
    assert [r["faults/skipped_total"] for r in rows] == [0, 1, 1, 1]


def test_a_skipped_step_leaves_no_trace_in_the_running_moments(tmp_path, monkeypatch):
    """Step 2's rewards are finite but overflow the running moments (3e38 · 4 rows: its mean is inf), so its shaped
    scores and advantages are not: the step is skipped, and the moments stay as step 1 left them, so steps 3 and 4
    train. Updating the moments before the advantages were checked poisoned every later step."""
    _second_step_reward(tmp_path, monkeypatch, "huge", 4, "out = [3e38] * len(completions)")
    out = tmp_path / "run"
    assert main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "reward.function=huge:reward",
                 "reward.normalize=running", "max_steps=4", "max_bad_steps=2", "generation.num_samples=2",
                 "algo.rollout_batch_size=2", "optim.per_device_batch_size=4", "logging.progress_bar=false",
                 "algo.num_minibatches=1"]) == 0
    rows = rows_of(out / "metrics.jsonl")
    assert [r["faults/skipped_total"] for r in rows] == [0, 1, 1, 1]


def test_target_kl_early_stop_advances_the_schedule_like_a_skip(tmp_path):
    """The learning rate is a function of the step number (trainers/optim.py): a step that stops early on
    algo.target_kl advances the schedule past the updates it did not make, as a skipped step does, so every step
    starts at the learning rate of a run that never stops early."""
    args = ["ppo", "--config", "configs/ppo_tiny.yaml", "max_steps=3", "optim.scheduler=linear", "algo.ppo_epochs=2",
            "algo.num_minibatches=2", "algo.rollout_batch_size=4", "optim.per_device_batch_size=2",
            "logging.progress_bar=false"]
    assert main(args + [f"output_dir={tmp_path / 'plain'}"]) == 0
    assert main(args + [f"output_dir={tmp_path / 'stops'}", "algo.target_kl=1e-12"]) == 0
    plain, stops = rows_of(tmp_path / "plain" / "metrics.jsonl"), rows_of(tmp_path / "stops" / "metrics.jsonl")
    assert [r["policy/early_stopped"] for r in stops] == [1.0, 1.0, 1.0]
    assert [r["policy/early_stopped"] for r in plain] == [0.0, 0.0, 0.0]
    assert [r["lr"] for r in stops] == pytest.approx([r["lr"] for r in plain], rel=1e-12)
    assert plain[1]["lr"] < plain[0]["lr"]  # the schedule moves


def test_blown_up_weights_are_bad_steps_not_a_traceback(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={out}", "optim.lr=1e30", "max_steps=8",
                 "max_bad_steps=2", "logging.save_steps=1", *FAST])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("rlhfkit: error:")]
    assert len(errors) == 1 and "max_bad_steps=2" in errors[0], errors
    # Step 1's update blew the weights up (finite, but every log-prob is inf/NaN): that state is never checkpointed.
    assert not list(out.glob("checkpoint-*")) and "holds no checkpoint" in errors[0]


def test_resumed_run_alarms_see_the_rows_before_the_checkpoint(tmp_path, monkeypatch):
    """The reward-hacking alarms read the run's history: after a resume it starts with the rows logged before."""
    seen = []
    real = online_setup.check_alarms
    monkeypatch.setattr(online_setup, "check_alarms", lambda history, **kw: seen.append([r["step"] for r in history]) or real(history, **kw))
    args = ["grpo", "--config", "configs/grpo_tiny.yaml", f"output_dir={tmp_path / 'run'}", "logging.save_steps=2",
            "logging.table_steps=1", *FAST]
    assert main(args + ["max_steps=3"]) == 0  # leaves checkpoint-2
    seen.clear()
    assert main(args + ["max_steps=4", "resume=true"]) == 0
    assert seen[-1] == [1, 2, 3, 4]


def test_one_pass_skips_the_old_logprob_forward_and_changes_nothing(tmp_path):
    """GRPO with one pass over each rollout: π_old is the update forward's own log-probs, so one policy forward per
    micro-batch fewer — and the same metrics and weights as with the separate no-grad pass."""
    args = ["grpo", "--config", "configs/grpo_tiny.yaml", "max_steps=2", "optim.lr=1e-2", "optim.adam_eps=1e-4", *FAST]
    with causal_lm_forwards() as lean:
        assert main(args + [f"output_dir={tmp_path / 'lean'}"]) == 0
    with causal_lm_forwards() as two:  # the no-grad forward for π_old asked for
        assert main(args + [f"output_dir={tmp_path / 'two'}", "algo.old_logprob_source=recompute"]) == 0
    # The skipped pass: 2 steps × 16 rows (the reference's and the update's forwards are in both counts).
    assert sum(rows for rows, _ in two) - sum(rows for rows, _ in lean) == 2 * 16
    assert_same_run(tmp_path / "lean", tmp_path / "two")


class VariedLengths:
    """A rollout component whose row i is cut after 3 + i % 7 tokens (a random tiny model seldom ends early)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, policy, prompts, examples, step):
        ro = self.inner(policy, prompts, examples, step)
        n, width = ro.response_ids.shape
        lengths = torch.tensor([min(3 + i % 7, width) for i in range(n)])
        mask = (torch.arange(width) < lengths[:, None]).long()
        return dataclasses.replace(ro, response_mask=mask, action_mask=mask, response_ids=ro.response_ids.masked_fill(mask == 0, 0),
                                   sampler_logprobs=ro.sampler_logprobs * mask, has_eos=torch.ones(n, dtype=torch.bool))


def test_micro_batches_run_at_their_own_width_and_change_nothing(tmp_path):
    """Each micro-batch is cut to its longest response: every forward of a run is at a width with a real token in
    its last column; and a forward at the cut width gives exactly the full width's log-probs and values on the real
    tokens (so the cut changes no loss, no KL, no advantage)."""
    overrides = ["max_steps=2", "optim.per_device_batch_size=2", "logging.progress_bar=false", "algo.rollout_batch_size=8",
                 "algo.num_minibatches=1", f"output_dir={tmp_path / 'cut'}"]
    with causal_lm_forwards() as forwards:
        OnlineTrainer(load_config(OnlineConfig, "configs/ppo_tiny.yaml", overrides), Objects(rollout=VariedLengths)).fit()
    assert forwards and all(last for _, last in forwards)  # no forward pays for columns of padding only
    t = build(tmp_path / "parts", "ppo_tiny.yaml", "algo.rollout_batch_size=8", "max_steps=1", rollout=VariedLengths)
    ro = t.experience(0).experience.rollout
    policy, critic = t.run.unwrap(t.model), t.run.unwrap(t.value)
    with torch.no_grad():
        for rows in (slice(0, 2), slice(2, 4), slice(4, 8)):
            part = ro.select(rows)
            cut, width = part.trimmed(), part.trimmed().response_ids.shape[1]
            assert width < ro.response_ids.shape[1]
            for read in (lambda r: rollout_logprobs(policy, r), lambda r: critic_values(critic, critic, r)):
                torch.testing.assert_close(read(cut), read(part)[:, :width] * cut.action_mask, rtol=1e-5, atol=1e-6)


def test_separate_critic_is_backpropagated_with_the_policy_in_one_backward(tmp_path, monkeypatch):
    """PPO with its own critic model: one backward of policy + value loss per micro-batch (two with a shared-base
    critic's update, which backpropagates them apart), and the same metrics and weights either way."""
    from accelerate import Accelerator

    calls = []
    backward = Accelerator.backward  # accelerate's public backward, which every loop calls through `Run.backward`
    monkeypatch.setattr(Accelerator, "backward", lambda self, loss, **k: calls.append(1) or backward(self, loss, **k))
    args = ("max_steps=1", "optim.lr=1e-2", "optim.adam_eps=1e-4", "optim.per_device_batch_size=4", "algo.rollout_batch_size=8",
            "algo.ppo_epochs=1")
    one, two = build(tmp_path / "one", "ppo_tiny.yaml", *args), build(tmp_path / "two", "ppo_tiny.yaml", *args)
    assert one.value is not None and not one.shares_base
    exp = one.experience(0).experience
    first = one.update(exp, 1)
    assert len(calls) == 2  # 2 micro-batches
    calls.clear()
    apart = update_with(two, shares_base=True)(exp, 1)
    assert len(calls) == 2 * 2
    assert first.metrics == pytest.approx(apart.metrics, rel=1e-5, abs=1e-7)
    for a, b in zip([*one.model.parameters(), *one.value.parameters()], [*two.model.parameters(), *two.value.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_ppo_old_logprobs_from_the_sampler_by_default_skip_a_forward_and_match_the_recompute(tmp_path, monkeypatch):
    """PPO, 2 epochs × 2 minibatches, KL in the reward, fp32 on rlhfkit's decode loop: `algo.old_logprob_source: auto`
    takes the decode loop's recorded log-probs for π_old, so one policy forward per micro-batch fewer than
    `recompute`; they equal a training forward's to float noise, so the run matches the recomputing one (same metrics
    and weights), and the sampler gap is measured at the first update forward, where it is float noise too."""
    args = ["ppo", "--config", "configs/ppo_tiny.yaml", "max_steps=2", "optim.lr=1e-2", "optim.adam_eps=1e-4",
            "logging.logging_steps=1", *FAST, "algo.num_minibatches=2", "optim.per_device_batch_size=2", "algo.ppo_epochs=2"]
    with causal_lm_forwards() as recompute:
        assert main(args + [f"output_dir={tmp_path / 'recompute'}", "algo.old_logprob_source=recompute"]) == 0
    with causal_lm_forwards() as auto:
        assert main(args + [f"output_dir={tmp_path / 'auto'}"]) == 0
    with causal_lm_forwards() as sampler:
        assert main(args + [f"output_dir={tmp_path / 'sampler'}", "algo.old_logprob_source=sampler"]) == 0
    assert sum(r for r, _ in recompute) - sum(r for r, _ in auto) == 2 * 4  # the skipped pass: 2 steps × 4 rows
    assert auto == sampler  # the same forwards, at the same widths
    rows = rows_of(tmp_path / "auto" / "metrics.jsonl")
    assert all(0 < r["policy/sampler_logprob_gap"] < 1e-5 for r in rows)
    assert all(r["policy/approxkl_avg"] > 1e-6 for r in rows)  # the weights did move between minibatches
    untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith(("time/", "memory/"))} for r in rs]  # noqa: E731
    assert untimed(rows) == untimed(rows_of(tmp_path / "sampler" / "metrics.jsonl"))  # auto is sampler here
    gapless = tmp_path / "auto_gapless.jsonl"  # the gap is the one metric measured differently
    gapless.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "policy/sampler_logprob_gap"}) + "\n" for r in rows))
    (tmp_path / "auto" / "metrics.jsonl").replace(tmp_path / "auto" / "metrics_with_gap.jsonl")
    gapless.replace(tmp_path / "auto" / "metrics.jsonl")
    # The sampler's log-probs differ from a training forward's by ~1e-7 (the KV cache's sums): after two steps of
    # Adam at lr 1e-2 the weights differ by ~1e-6 (thread count dependent), far below the 1e-2 an update moves them.
    assert_same_run(tmp_path / "recompute", tmp_path / "auto", rtol=1e-4, atol=1e-5)


def test_auto_old_logprobs_give_the_recomputed_update_to_fp32_tolerance(tmp_path):
    """One PPO step (2 epochs × 2 minibatches) from the same rollout: π_old as `auto` takes it (the sampler's) and as
    a no-grad forward recomputes it agree to fp32 noise, and so do the updates they drive (metrics and weights)."""
    args = ("max_steps=1", "optim.lr=1e-2", "optim.adam_eps=1e-4", "algo.num_minibatches=2", "optim.per_device_batch_size=2",
            "algo.ppo_epochs=2")
    auto = build(tmp_path / "auto", "ppo_tiny.yaml", *args)
    again = build(tmp_path / "again", "ppo_tiny.yaml", *args, "algo.old_logprob_source=recompute")
    assert (auto.update.old_source, again.update.old_source) == ("sampler", "recompute")
    torch.manual_seed(0)
    a = auto.experience(0).experience
    torch.manual_seed(0)  # the same draws
    b = again.experience(0).experience
    assert torch.equal(a.rollout.response_ids, b.rollout.response_ids)  # the same seeded rollout
    assert torch.equal(a.old_logprobs, a.rollout.sampler_logprobs)
    on = a.rollout.action_mask.bool()
    assert 0 < float((a.old_logprobs - b.old_logprobs)[on].abs().max()) < 1e-5  # the KV cache's sums: noise, not 0
    torch.manual_seed(0)
    first = auto.update(a, 1)
    torch.manual_seed(0)  # the same minibatch shuffles
    second = again.update(b, 1)
    assert 0 < first.metrics["policy/sampler_logprob_gap"] < 1e-5
    assert "policy/sampler_logprob_gap" not in second.metrics  # the recompute's gap is the experience's figure
    for key, value in second.metrics.items():
        assert first.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for p, q in zip([*auto.model.parameters(), *auto.value.parameters()], [*again.model.parameters(), *again.value.parameters()]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("overrides", "rollout", "source"), [
    ((), None, "sampler"),  # fp32, rlhfkit's single-turn decode loop: the sampler's are π_old
    (("algo.ppo_epochs=1", "algo.num_minibatches=1", "algo.algorithm=grpo", "generation.num_samples=2"), None, "update"),
    (("generation.engine=hf",), None, "recompute"),  # transformers' generate: its processors see other logits
    ((), VariedLengths, "recompute"),  # a rollout component the config did not make
    (("algo.rollout_correction=token_truncate",), None, "recompute"),  # weighs π_old against the sampler's
    (("algo.old_logprob_source=recompute",), None, "recompute"),
])
def test_auto_takes_the_sampler_old_logprobs_only_where_they_equal_a_recompute(tmp_path, overrides, rollout, source):
    t = build(tmp_path, "ppo_tiny.yaml", "max_steps=1", "algo.num_minibatches=2", "optim.per_device_batch_size=2",
              *overrides, rollout=rollout)
    assert (t.maker.old_source, t.update.old_source) == (source, source)
    if source == "sampler":  # in bf16 (autocast, or weights) the two differ by more than noise: recomputed
        policy = t.run.unwrap(t.model)
        assert not sampler_is_exact(t.cfg, "bf16", policy, Objects())
        assert not sampler_is_exact(t.cfg, "no", policy.to(torch.bfloat16), Objects())


def test_sampler_old_logprobs_need_rlhfkits_decode_loop():
    with pytest.raises(UserError, match="algo.old_logprob_source.*generation.engine=rlhfkit"):
        load_config(OnlineConfig, "configs/ppo_tiny.yaml", ["algo.old_logprob_source=sampler", "generation.engine=hf"])


def test_old_logprobs_key_is_refused_with_its_new_name(tmp_path, capsys):
    """The switch once named like a tensor: the old key gives one line naming the new one, exit status 2."""
    with pytest.raises(UserError, match=r"^config key 'algo.old_logprobs' was renamed: use 'algo.old_logprob_source'$"):
        load_config(OnlineConfig, "configs/ppo_tiny.yaml", ["algo.old_logprobs=sampler"])
    assert main(["ppo", "--config", "configs/ppo_tiny.yaml", f"output_dir={tmp_path}", "algo.old_logprobs=recompute"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert errors == ["rlhfkit: error: config key 'algo.old_logprobs' was renamed: use 'algo.old_logprob_source'"]


def test_accelerate_unwrap_is_not_called_per_micro_batch(tmp_path, monkeypatch):
    """accelerate's `unwrap_model` probes the installed packages on every call (12 ms with deepspeed installed):
    the online loop unwraps its models once, so the count does not grow with the steps."""
    from accelerate import Accelerator

    calls = []
    real = Accelerator.unwrap_model
    monkeypatch.setattr(Accelerator, "unwrap_model", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    counts = {}
    for steps in (1, 3):
        calls.clear()
        assert main(["ppo", "--config", "configs/ppo_tiny.yaml", f"max_steps={steps}", "algo.ppo_epochs=2",
                     f"output_dir={tmp_path / str(steps)}", *FAST, "optim.per_device_batch_size=2"]) == 0
        counts[steps] = len(calls)
    assert counts[3] == counts[1], counts


def test_kl_is_monitored_without_a_kl_term(tmp_path):
    """Dr. GRPO trains no KL term, and with LoRA the KL to the initial policy is free (adapters disabled): it is
    measured and logged, so the drift the alarms watch is visible; it enters neither reward nor loss (the same
    updates as with the monitor off). Where the algorithm has a KL term, the setting is refused."""
    args = ["grpo", "--config", "configs/grpo_tiny.yaml", "algo.algorithm=dr_grpo", "max_steps=2", "model.lora.enabled=true",
            "model.lora.r=4", "optim.lr=1e-2", *FAST]
    assert main(args + [f"output_dir={tmp_path / 'on'}"]) == 0
    assert main(args + [f"output_dir={tmp_path / 'off'}", "kl.monitor=false"]) == 0
    on, off = rows_of(tmp_path / "on" / "metrics.jsonl"), rows_of(tmp_path / "off" / "metrics.jsonl")
    assert on[0]["objective/kl"] == pytest.approx(0.0, abs=1e-6) and abs(on[1]["objective/kl"]) > 1e-4  # the policy moved
    assert not {"objective/kl"} & off[0].keys()
    for a, b in zip(on, off):
        assert a["loss/policy_avg"] == pytest.approx(b["loss/policy_avg"], rel=1e-5)
    with pytest.raises(UserError, match="kl.monitor.*measures the KL"):
        load_config(OnlineConfig, "configs/grpo_tiny.yaml", ["kl.monitor=true"])
