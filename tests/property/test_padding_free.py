"""Padding-free batches (`data.padding_free`) equal padded ones: the same loss, gradient, rewards and log-probs for
SFT, the reward model and the preference methods, on the tiny model with examples of very different lengths. And
padding-free is not classic packing (`data.packing`): no token sees its row neighbours."""

import dataclasses

import pytest
import torch

from rlhfkit.config import DPOConfig, ORPOConfig, RMConfig, SFTConfig, load_config
from rlhfkit.data import collate_sft, collate_sft_padding_free, pack_sft
from rlhfkit.attention import PADDING_FREE_ATTENTION, use_padding_free_attention
from rlhfkit.models import load_causal_lm, scored_logits, sequence_logprobs
from rlhfkit.rewards import POOLING_ATTR, sequence_scores, sequence_scores_padding_free
from rlhfkit.trainers.preference import PreferenceTrainer, concat_pairs, pair_logprobs
from rlhfkit.trainers.reward import RewardTrainer
from rlhfkit.trainers.sft import SFTTrainer
from rlhfkit.types import PaddingFreeBatch, PaddingFreePairs, PreferenceBatch, SFTBatch

ATOL = 1e-5
STAGES = {
    "sft": (SFTConfig, SFTTrainer, "configs/sft_tiny.yaml"),
    "rm": (RMConfig, RewardTrainer, "configs/rm_tiny.yaml"),
    "dpo": (DPOConfig, PreferenceTrainer, "configs/dpo_tiny.yaml"),
    "orpo": (ORPOConfig, PreferenceTrainer, "configs/orpo_tiny.yaml"),
}


def make_trainer(tmp_path, stage, overrides=()):
    cfg_cls, trainer_cls, path = STAGES[stage]
    cfg = load_config(cfg_cls, path, [f"output_dir={tmp_path}", "logging.progress_bar=false", *overrides])
    trainer = trainer_cls(cfg)
    trainer.setup()
    trainer.model.eval()
    return trainer


def collate(trainer, examples, padding_free: bool):
    """`trainer.collate` with data.padding_free set as asked (the trainer reads its config at each call)."""
    cfg = trainer.cfg
    trainer.cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, padding_free=padding_free))
    try:
        return trainer.collate(examples)
    finally:
        trainer.cfg = cfg


def loss_and_grads(trainer, batch):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    n = float(trainer.count(batch))
    loss, metrics = trainer.compute_loss(model, batch, n)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads, n


def assert_same_step(trainer, examples):
    """compute_loss on the padded and the padding-free batch of `examples`: same count, loss, metrics, gradient."""
    padded = loss_and_grads(trainer, collate(trainer, examples, False))
    flat = loss_and_grads(trainer, collate(trainer, examples, True))
    assert flat[3] == padded[3]
    torch.testing.assert_close(flat[0], padded[0], rtol=0, atol=ATOL)
    assert flat[1].keys() == padded[1].keys()
    for k in padded[1]:
        torch.testing.assert_close(flat[1][k], padded[1][k], rtol=0, atol=ATOL, msg=k)
    assert flat[2].keys() == padded[2].keys() and padded[2]
    for k in padded[2]:
        torch.testing.assert_close(flat[2][k], padded[2][k], rtol=1e-4, atol=ATOL, msg=k)


def varied_sft(trainer, n=6):
    """Real examples, plus the first one cut to a few tokens and two made several times longer: lengths 5..~180."""
    examples = [dict(e) for e in trainer.train_set[:n]]
    short = {k: v[:5] for k, v in examples[0].items()}
    short["labels"] = [-100, -100] + short["input_ids"][2:]
    long = [{k: examples[i][k] * 4 for k in ("input_ids", "labels")} for i in (1, 2)]
    batch = examples + [short] + long
    assert max(map(len, (e["input_ids"] for e in batch))) > 5 * min(map(len, (e["input_ids"] for e in batch)))
    return batch


def varied_pairs(trainer, n=6):
    """Real pairs plus two with a long chosen or rejected response and one with a short prompt."""
    examples = [dict(e) for e in trainer.train_set[:n]]
    a, b, c = (dict(e) for e in examples[:3])
    a["chosen_ids"], a["chosen_action_mask"] = a["chosen_ids"] * 5, a["chosen_action_mask"] * 5
    b["rejected_ids"], b["rejected_action_mask"] = b["rejected_ids"] * 4, b["rejected_action_mask"] * 4
    c["prompt_ids"] = c["prompt_ids"][-3:]
    return examples + [a, b, c]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("sft") / "run", "sft", ["data.padding_free=true"])


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("rm") / "run", "rm", ["data.padding_free=true"])


@pytest.fixture(scope="module")
def dpo(tmp_path_factory):
    return make_trainer(tmp_path_factory.mktemp("dpo") / "run", "dpo", ["data.padding_free=true"])


# 1. The batches ----------------------------------------------------------------------------------------------------


def test_sft_batch_is_one_row_with_positions_restarting_and_no_padding(sft):
    examples = varied_sft(sft)
    batch = collate(sft, examples, True)
    assert isinstance(batch, PaddingFreeBatch) and isinstance(collate(sft, examples, False), SFTBatch)
    lengths = [len(e["input_ids"]) for e in examples]
    assert batch.input_ids.shape == batch.position_ids.shape == batch.labels.shape == (1, sum(lengths))
    assert batch.seq_lens.tolist() == lengths
    assert batch.position_ids[0].tolist() == [t for n in lengths for t in range(n)]
    assert batch.input_ids[0].tolist() == [t for e in examples for t in e["input_ids"]]
    assert batch.seq_ids.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    # No token predicts a sequence's first token: its left neighbour belongs to another sequence.
    assert (batch.next_token_labels[batch.position_ids == 0] == -100).all()


def test_preference_batch_holds_chosen_then_rejected_sequences(dpo):
    examples = varied_pairs(dpo)
    batch = collate(dpo, examples, True)
    assert isinstance(batch, PaddingFreePairs) and isinstance(collate(dpo, examples, False), PreferenceBatch)
    chosen = [e["prompt_ids"] + e["chosen_ids"] for e in examples]
    rejected = [e["prompt_ids"] + e["rejected_ids"] for e in examples]
    assert batch.sequences.seq_lens.tolist() == [len(s) for s in chosen + rejected]
    assert batch.sequences.input_ids[0].tolist() == [t for s in chosen + rejected for t in s]
    assert dpo.count(batch) == len(examples)


# 2. SFT -------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("completion_only", [True, False])
def test_sft_loss_and_gradient_equal_padded(sft, completion_only):
    cfg = sft.cfg
    sft.cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, completion_only=completion_only))
    try:
        assert_same_step(sft, varied_sft(sft))
    finally:
        sft.cfg = cfg


# 3. Reward model ----------------------------------------------------------------------------------------------------


def test_rm_loss_and_gradient_equal_padded(rm):
    assert_same_step(rm, varied_pairs(rm))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_rm_rewards_per_example_equal_padded(rm, pooling):
    examples = varied_pairs(rm)
    config = rm.model.config
    before = getattr(config, POOLING_ATTR)
    setattr(config, POOLING_ATTR, pooling)
    try:
        with torch.no_grad():
            padded = collate(rm, examples, False)
            input_ids, attention_mask, labels = concat_pairs(padded)
            expected = sequence_scores(rm.model, input_ids, attention_mask, labels != -100)
            flat = sequence_scores_padding_free(rm.model, collate(rm, examples, True).sequences)
    finally:
        setattr(config, POOLING_ATTR, before)
    assert flat.shape == (2 * len(examples),)
    torch.testing.assert_close(flat, expected, rtol=0, atol=ATOL)


# 4. DPO family ------------------------------------------------------------------------------------------------------


def test_chosen_and_rejected_logprobs_equal_padded(dpo):
    examples = varied_pairs(dpo)
    with torch.no_grad():
        expected, expected_n = sequence_logprobs(dpo.model, *concat_pairs(collate(dpo, examples, False)))
        flat, flat_n = pair_logprobs(dpo.model, collate(dpo, examples, True))
    torch.testing.assert_close(flat_n, expected_n, rtol=0, atol=0)
    # rtol: a long response's sum (~250 nats) is held by fp32 to ~1.5e-5 (one unit in the last place).
    torch.testing.assert_close(flat, expected, rtol=1e-6, atol=ATOL)


def test_dpo_loss_and_gradient_equal_padded(dpo):
    assert_same_step(dpo, varied_pairs(dpo))


@pytest.mark.parametrize("stage, overrides", [
    ("dpo", ["algo.loss_type=sigmoid", "algo.label_smoothing=0.1"]),  # cDPO
    ("dpo", ["algo.loss_type=ipo"]),
    ("dpo", ["algo.loss_type=simpo"]),
    ("dpo", ["algo.precompute_ref_logprobs=true"]),
    ("dpo", ["model.lora.enabled=true"]),  # the reference is the policy's base with its adapters disabled
    ("dpo", ["model.gradient_checkpointing=true"]),  # the backward recomputes the per-sequence attention
    ("orpo", []),
    ("rm", ["model.lora.enabled=true", "algo.pooling=mean"]),
], ids=["cdpo", "ipo", "simpo", "precomputed_refs", "dpo_lora", "dpo_checkpointing", "orpo", "rm_lora_mean"])
def test_preference_variants_equal_padded(tmp_path, stage, overrides):
    trainer = make_trainer(tmp_path / "run", stage, ["data.padding_free=true", *overrides])
    if "model.gradient_checkpointing=true" in overrides:
        trainer.model.train()  # transformers checkpoints in training mode only (the tiny model has no dropout)
        assert trainer.model.model.gradient_checkpointing
    examples = varied_pairs(trainer)
    for i, e in enumerate(examples):
        if "ref_chosen_logprobs" in e:  # policy = reference: move the rewards off 0, where accuracy flips on rounding
            e["ref_chosen_logprobs"] += (-1) ** i
    assert_same_step(trainer, examples)


def test_precomputed_reference_logprobs_equal_padded(tmp_path, dpo):
    trainer = make_trainer(tmp_path / "run", "dpo", ["data.padding_free=true", "algo.precompute_ref_logprobs=true"])
    examples = trainer.train_set[:8]
    with torch.no_grad():  # the reference is the policy's starting weights, which `dpo` still holds
        expected, _ = sequence_logprobs(dpo.model, *concat_pairs(collate(dpo, examples, False)))
    got = torch.tensor([e[k] for k in ("ref_chosen_logprobs", "ref_rejected_logprobs") for e in examples])
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


# 5. Not classic packing ----------------------------------------------------------------------------------------------


def test_trainers_run_attention_per_sequence(sft, rm, dpo):
    for trainer in (sft, rm, dpo):
        assert trainer.model.config._attn_implementation == PADDING_FREE_ATTENTION
    assert dpo.reference.model.config._attn_implementation == PADDING_FREE_ATTENTION


def test_per_sequence_attention_only_where_exact(sft):
    """Sliding-window or eager attention keeps transformers' own path (one masked (N, N) product per row)."""
    model = load_causal_lm(sft.cfg.model, sft.tokenizer)
    model.config.sliding_window = 16
    assert use_padding_free_attention(model) == "sdpa"
    model.config.sliding_window = None
    model.set_attn_implementation("eager")
    assert use_padding_free_attention(model) == "eager"
    model.set_attn_implementation("sdpa")
    assert use_padding_free_attention(model) == PADDING_FREE_ATTENTION == model.config._attn_implementation


@pytest.mark.parametrize("attention", [PADDING_FREE_ATTENTION, "sdpa", "eager"],
                         ids=["per_sequence", "sdpa_block_mask", "eager_block_mask"])
def test_a_tokens_logits_do_not_depend_on_its_row_neighbours(sft, attention):
    """Under padding_free a sequence's logits are those of the sequence alone, whatever shares its row — with the
    trainers' per-sequence attention and with transformers' block-diagonal mask (sdpa, eager); under `data.packing`
    (`pack_sft`: attention crosses example boundaries) they change with the example before it."""
    model, pad = sft.model, sft.tokenizer.pad_token_id
    model.set_attn_implementation(attention)
    try:
        check_neighbours(model, sft, pad)
    finally:
        model.set_attn_implementation(PADDING_FREE_ATTENTION)


def check_neighbours(model, sft, pad):
    a, b, c = ({"input_ids": e["input_ids"], "labels": e["input_ids"]} for e in sft.train_set[:3])
    assert a["input_ids"] != c["input_ids"]

    def logits(batch):  # every position's logits
        with torch.no_grad():
            if isinstance(batch, PaddingFreeBatch):
                return scored_logits(model, batch.input_ids, None, batch.labels, batch.position_ids)[0][0]
            return scored_logits(model, batch.input_ids, batch.attention_mask, batch.labels)[0][0]

    n = len(b["input_ids"])
    alone = logits(collate_sft([b], pad))
    for before in (a, c):
        flat = logits(collate_sft_padding_free([before, b]))[-n:]
        torch.testing.assert_close(flat, alone, rtol=0, atol=ATOL)
        row = pack_sft([before, b], max_length=10**6)
        assert len(row) == 1
        packed = logits(collate_sft(row, pad))[-n:]
        assert not torch.allclose(packed, alone, atol=1e-3)
