"""The preference and KTO trainers on the tiny model: the one concatenated forward, padding invariance, reference
log-probs (precomputed, on the fly, LoRA base), the step-0 identities, reference-free methods, bad configs."""

import dataclasses
import math

import pytest
import torch

import rlhfkit.trainers.preference as preference
from rlhfkit.cli import main
from rlhfkit.config import DPOConfig, KTOConfig, ORPOConfig, load_config
from rlhfkit.data import collate_unpaired
from rlhfkit.models import load_causal_lm, sequence_logprobs, token_logprobs
from rlhfkit.trainers.kto import KTOTrainer
from rlhfkit.trainers.preference import PreferenceTrainer, concat_pairs

CONFIGS = {"dpo": (DPOConfig, "configs/dpo_tiny.yaml"), "orpo": (ORPOConfig, "configs/orpo_tiny.yaml")}


def make_trainer(tmp_path, overrides=(), stage="dpo"):
    cfg_cls, path = CONFIGS.get(stage, (KTOConfig, "configs/kto_tiny.yaml"))
    base = [f"output_dir={tmp_path}", "logging.progress_bar=false", "optim.max_grad_norm=null"]
    cfg = load_config(cfg_cls, path, base + list(overrides))
    trainer = (KTOTrainer if stage == "kto" else PreferenceTrainer)(cfg)
    trainer.setup()
    return trainer


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("dpo") / "run")


def first_batch(trainer, n=8):
    return trainer.collate(trainer.train_set[:n])


def test_concatenated_forward_equals_separate_forwards(dpo):
    batch = first_batch(dpo)
    together, counts = sequence_logprobs(dpo.model, *concat_pairs(batch))
    chosen, n_chosen = sequence_logprobs(dpo.model, batch.chosen_input_ids, batch.chosen_attention_mask, batch.chosen_labels)
    rejected, n_rejected = sequence_logprobs(dpo.model, batch.rejected_input_ids, batch.rejected_attention_mask, batch.rejected_labels)
    torch.testing.assert_close(together, torch.cat([chosen, rejected]), rtol=0, atol=1e-5)
    torch.testing.assert_close(counts, torch.cat([n_chosen, n_rejected]))


def test_left_and_right_padding_give_the_same_logprobs(dpo):
    input_ids, attention_mask, labels = concat_pairs(first_batch(dpo))
    right, right_mask = token_logprobs(dpo.model, input_ids, attention_mask, labels)
    # Move each row's padding to the left: roll by the number of padding tokens.
    pads = (attention_mask == 0).sum(-1)
    roll = lambda x: torch.stack([row.roll(int(p)) for row, p in zip(x, pads)])  # noqa: E731
    assert pads.max() > 0 and (roll(attention_mask)[:, 0] == 0).any()
    left, left_mask = token_logprobs(dpo.model, roll(input_ids), roll(attention_mask), roll(labels))
    torch.testing.assert_close(left[left_mask.bool()], right[right_mask.bool()], rtol=0, atol=1e-5)
    torch.testing.assert_close(left.sum(-1), right.sum(-1), rtol=0, atol=1e-5)


def tiny_dir():
    from rlhfkit.config import ModelConfig
    from rlhfkit.models import resolve_model_path

    return resolve_model_path(ModelConfig(name_or_path="tiny"))


STEP0 = {  # overrides -> the loss at h = 0, and whether a second model is loaded
    "dpo": ([], math.log(2), True),
    "dpo lora": (["model.lora.enabled=true"], math.log(2), False),
    "dpo ref_model": (["algo.ref_model={tiny}"], math.log(2), True),
    "cdpo": (["algo.label_smoothing=0.1"], math.log(2), True),
    "ipo": (["algo.loss_type=ipo", "algo.beta=0.5"], 1.0, True),  # (0 - 1/(2β))²
    "hinge": (["algo.loss_type=hinge"], 1.0, True),  # relu(1 - 0)
}


@pytest.mark.parametrize("case", sorted(STEP0))
def test_step0_policy_equals_reference_so_rewards_are_0(tmp_path, case):
    extra, expected, copy = STEP0[case]
    trainer = make_trainer(tmp_path, [e.replace("{tiny}", tiny_dir()) for e in extra])
    batch = first_batch(trainer, 16)
    trainer.model.train()
    loss, metrics = trainer.compute_loss(trainer.model, batch, num_items=16)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert metrics[name].item() == 0.0, name
    assert (trainer.reference.model is not None) == copy  # LoRA: the base with adapters disabled, no second copy


def test_ipo_empty_response_gives_a_finite_hand_checked_loss(tmp_path):
    """A pair whose chosen response is empty (here built directly; the data layer drops such records) reaches
    compute_loss: its average log-ratio counts the empty response as one token, so the loss stays finite."""
    trainer = make_trainer(tmp_path, ["algo.loss_type=ipo", "algo.beta=0.5"])  # 1/(2β) = 1
    examples = [dict(e) for e in trainer.train_set[:2]]
    examples[0]["chosen_ids"] = examples[0]["chosen_action_mask"] = []
    batch = trainer.collate(examples)
    trainer.model.train()
    with torch.no_grad():
        logprobs, lengths = sequence_logprobs(trainer.model, *concat_pairs(batch))
    (c0, c1), (r0, r1) = logprobs.chunk(2)[0].tolist(), logprobs.chunk(2)[1].tolist()
    (n_c0, n_c1), (n_r0, n_r1) = lengths.chunk(2)[0].tolist(), lengths.chunk(2)[1].tolist()
    assert c0 == 0.0 and n_c0 == 0 and n_c1 > 0 and n_r0 > 0
    # Reference log-probs given in the batch so that the averaged log-ratios are round numbers:
    # pair 0: chosen 0 (empty), rejected -1 per token -> h = 1 -> loss (1 - 1)² = 0;
    # pair 1: chosen +3 per token, rejected 0 -> h = 3 -> loss (3 - 1)² = 4. Mean over the 2 pairs: 2.
    batch = dataclasses.replace(
        batch, ref_chosen_logprobs=torch.tensor([0.0, c1 - 3 * n_c1]), ref_rejected_logprobs=torch.tensor([r0 + n_r0, r1])
    )
    loss, metrics = trainer.compute_loss(trainer.model, batch, num_items=2)
    assert loss.item() == pytest.approx(2.0, abs=1e-4)
    # The rewards are β times the summed log-ratios (TRL's definition), not the averaged ones.
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5 * (0 + 3 * n_c1) / 2, abs=1e-4)
    assert metrics["rewards/rejected"].item() == pytest.approx(0.5 * (-n_r0 + 0) / 2, abs=1e-4)
    assert metrics["rewards/accuracies"].item() == 1.0
    assert metrics["logps/chosen"].item() == pytest.approx((c0 + c1) / 2, abs=1e-4)


def test_precomputed_reference_equals_on_the_fly(tmp_path, dpo):
    pre = make_trainer(tmp_path / "pre", ["algo.precompute_ref_logprobs=true"])
    assert pre.reference.model is None  # the copy is freed once its log-probs are stored
    assert {"ref_chosen_logprobs", "ref_rejected_logprobs"} <= set(pre.train_set[0]) and "ref_chosen_logprobs" in pre.eval_set[0]
    # The stored values equal the reference forward of the on-the-fly trainer.
    batch = first_batch(dpo)
    on_the_fly = dpo.reference.sequence_logprobs(dpo.model, *concat_pairs(batch))
    stored = first_batch(pre).to("cpu")  # .to keeps the extra fields
    torch.testing.assert_close(torch.cat([stored.ref_chosen_logprobs, stored.ref_rejected_logprobs]), on_the_fly, rtol=0, atol=1e-5)
    # ... so the first optimizer step has the same loss (and a fresh on-the-fly trainer, the same step).
    fresh = make_trainer(tmp_path / "fly")
    assert pre.train_step(0)["loss"] == pytest.approx(fresh.train_step(0)["loss"], abs=1e-6)


def test_lora_reference_is_the_base_model_with_adapters_disabled(tmp_path):
    trainer = make_trainer(tmp_path, ["model.lora.enabled=true", "optim.lr=0.05"])
    for step in range(2):  # move the adapters away from their zero init
        trainer.train_step(step)
    batch = first_batch(trainer)
    trainer.model.eval()
    reference = trainer.reference.sequence_logprobs(trainer.model, *concat_pairs(batch))
    base = load_causal_lm(trainer.cfg.model, trainer.tokenizer, trainable=False)
    with torch.no_grad():
        expected, _ = sequence_logprobs(base, *concat_pairs(batch))
        policy, _ = sequence_logprobs(trainer.model, *concat_pairs(batch))
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-5)
    assert (policy - expected).abs().max() > 1e-2  # the adapters are on again outside the reference


@pytest.mark.parametrize("stage, extra", [("dpo", ["algo.loss_type=simpo"]), ("orpo", [])])
def test_reference_free_methods_load_no_reference(tmp_path, monkeypatch, stage, extra):
    loads = []
    original = preference.load_causal_lm
    monkeypatch.setattr(preference, "load_causal_lm", lambda *a, **k: loads.append(k) or original(*a, **k))
    trainer = make_trainer(tmp_path, extra, stage=stage)
    assert trainer.reference is None and len(loads) == 1
    assert math.isfinite(trainer.train_step(0)["loss"])


def test_grad_accumulation_equals_one_large_batch(tmp_path):
    def step0(name, overrides):
        trainer = make_trainer(tmp_path / name, ["data.eval=null", *overrides])
        grads = {}
        trainer.optim.optimizer.step = lambda: grads.update(
            {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        )
        return trainer.train_step(0), grads

    (m_big, big), (m_small, small) = (
        step0("big", ["optim.per_device_batch_size=16"]),
        step0("small", ["optim.per_device_batch_size=4", "optim.grad_accum_steps=4"]),
    )
    assert big.keys() == small.keys() and big
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-5, atol=1e-6, msg=name)
    assert m_small["logps/chosen"] == pytest.approx(m_big["logps/chosen"], rel=1e-6)


def test_kto_class_means_are_exact_across_micro_batches(tmp_path):
    big = make_trainer(tmp_path / "big", ["data.eval=null", "optim.per_device_batch_size=16", "optim.warmup_steps=0"], stage="kto")
    small = make_trainer(tmp_path / "small", ["data.eval=null", "optim.per_device_batch_size=4", "optim.grad_accum_steps=4", "optim.warmup_steps=0"], stage="kto")
    (batch,) = big.micro_batches(0)  # the 16 rows of step 0, the same rows as small's 4 micro-batches
    m_big, m_small = big.train_step(0), small.train_step(0)
    # By hand: the step-0 policy is the frozen reference, so its log-probs give the class means.
    logprobs = big.reference.sequence_logprobs(big.model, batch.input_ids, batch.attention_mask, batch.labels)
    desirable = batch.desirable
    assert 0 < desirable.sum() < 16
    assert m_big["logps/chosen"] == pytest.approx(logprobs[desirable].mean().item(), rel=1e-5)
    assert m_big["logps/rejected"] == pytest.approx(logprobs[~desirable].mean().item(), rel=1e-5)
    for name in ("logps/chosen", "logps/rejected", "kl", "loss", "rewards/accuracies"):
        assert m_small[name] == pytest.approx(m_big[name], rel=1e-5, abs=1e-7), name
    assert "desirable_fraction" not in m_big and "rewards/margins" in m_big
    # Step 1 (the policy has moved, z0 > 0): z0 is one estimate over the step's 16 rows either way.
    m_big, m_small = big.train_step(1), small.train_step(1)
    assert m_big["kl"] > 0
    for name in ("logps/chosen", "logps/rejected", "kl", "loss", "rewards/accuracies"):
        assert m_small[name] == pytest.approx(m_big[name], rel=1e-5, abs=1e-7), name


def test_kto_lone_eval_example_pairs_with_the_next_eval_example(tmp_path):
    trainer = make_trainer(tmp_path, ["data.eval=null", "max_steps=1", "optim.per_device_batch_size=2"], stage="kto")
    trainer.eval_set = trainer.train_set[:3]  # batches of 2 and 1
    (first, counted_first), (lone, counted_lone) = trainer.eval_batches()
    assert counted_first and counted_lone  # one process: no filler batches
    assert first.input_ids.shape[0] == 2 and lone.input_ids.shape[0] == 1
    assert first.z0 == lone.z0  # one reference point over the whole eval set
    # Example 2 is paired with example 0's completion (the next one, cyclically).
    paired = collate_unpaired(trainer.eval_set[2:3], trainer.tokenizer.pad_token_id, trainer.eval_set[:1])
    assert torch.equal(lone.kl_input_ids, paired.kl_input_ids)
    metrics = trainer.evaluate()
    assert metrics and all(math.isfinite(v) for v in metrics.values())


BAD = {
    "kto batch size 1": (["kto", "--config", "configs/kto_tiny.yaml", "optim.per_device_batch_size=1"],
                         "config key 'optim.per_device_batch_size' must be >= 2 for KTO"),
    "kto beta 0": (["kto", "--config", "configs/kto_tiny.yaml", "algo.beta=0"], "config key 'algo.beta' must be > 0"),
    "kto beta negative": (["kto", "--config", "configs/kto_tiny.yaml", "algo.beta=-1"], "config key 'algo.beta' must be > 0"),
    "dpo beta 0": (["dpo", "--config", "configs/dpo_tiny.yaml", "algo.beta=0"], "config key 'algo.beta' must be > 0"),
    "simpo with precompute": (["dpo", "--config", "configs/simpo_tiny.yaml", "algo.precompute_ref_logprobs=true"],
                              "config key 'algo.precompute_ref_logprobs' must be false with loss_type=simpo"),
    "ipo with label smoothing": (["dpo", "--config", "configs/ipo_tiny.yaml", "algo.label_smoothing=0.1"],
                                 "config key 'algo.label_smoothing' applies only to"),
    "orpo negative lambda": (["orpo", "--config", "configs/orpo_tiny.yaml", "algo.beta=-0.1"], "config key 'algo.beta' must be >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_exits_2_with_one_line(case, tmp_path, capsys):
    args, expected = BAD[case]
    assert main(args + [f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("rlhfkit: error:")]
    assert len(errors) == 1 and expected in errors[0], err
    assert not (tmp_path / "out").exists()  # failed before anything was written or loaded
