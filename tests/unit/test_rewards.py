"""Reward scores read at the last real token, left/right padding, LoRA wrappers, ensembles."""

import pytest
import torch

from rlhfkit.config import LoraConfig, ModelConfig
from rlhfkit.model_sources import build_tiny_model
from rlhfkit.models import load_causal_lm, load_reward_model, load_tokenizer, save_model, unwrap_peft
from rlhfkit.rewards import RewardModelScorer, load_reward_scorer, reduce_ensemble, sequence_scores

# Three sequences of different lengths; the first two end with eos, which is also the pad token (id 2).
SEQS = [[5, 9, 13, 2], [7, 2], [4, 8, 15, 16, 23, 42]]
PAD = 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    build_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def rm(tiny_dir):
    """The tiny causal LM with a new random score head (a frozen scorer must ask for one explicitly)."""
    torch.manual_seed(0)
    return load_reward_model(ModelConfig(name_or_path=tiny_dir), trainable=False, allow_new_head=True)


def _pad(seqs, side):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), PAD)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(T - len(s), T)
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    return ids, mask


def _manual_scores(model, seqs):
    """Each sequence alone (no padding): backbone forward, score head, value at its last token."""
    base = unwrap_peft(model)
    out = []
    with torch.no_grad():
        for s in seqs:
            hidden = base.model(input_ids=torch.tensor([s])).last_hidden_state  # (1, T, H)
            out.append(base.score(hidden)[0, -1, 0])
    return torch.stack(out)


def test_tiny_tokenizer_pad_is_eos(tiny_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=tiny_dir))
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == PAD


@pytest.mark.parametrize("side", ["right", "left"])
def test_sequence_scores_read_the_last_real_token(rm, side):
    ids, mask = _pad(SEQS, side)
    scores = sequence_scores(rm, ids, mask)
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, _manual_scores(rm, SEQS), atol=1e-5, rtol=0)


def test_transformers_pooling_is_wrong_when_pad_is_eos(rm):
    # Why sequence_scores exists: HF pools at the last non-pad id, skipping the final eos of "[5, 9, 13, eos]".
    ids, mask = _pad(SEQS, "right")
    with torch.no_grad():
        hf = rm(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert not torch.allclose(hf[0], _manual_scores(rm, SEQS)[0], atol=1e-4)


def test_sequence_scores_through_a_lora_wrapper_and_gradients_reach_adapters_and_head(tiny_dir):
    torch.manual_seed(0)
    rm = load_reward_model(ModelConfig(name_or_path=tiny_dir, lora=LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # make the adapters and the trained head copy differ from the base
        for p in rm.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ids, mask = _pad(SEQS, "right")
    scores = sequence_scores(rm, ids, mask)
    torch.testing.assert_close(scores.detach(), _manual_scores(rm, SEQS), atol=1e-5, rtol=0)
    with rm.disable_adapter(), torch.no_grad():  # the adapters and the head copy really are in use
        assert not torch.allclose(sequence_scores(rm, ids, mask), scores.detach(), atol=1e-4)
    scores.sum().backward()
    trainable = {n: p for n, p in rm.named_parameters() if p.requires_grad}
    assert all(p.grad is not None for p in trainable.values())
    assert any("score.modules_to_save" in n for n in trainable)


def test_sequence_scores_needs_a_score_head(tiny_dir):
    lm = load_causal_lm(ModelConfig(name_or_path=tiny_dir), trainable=False)
    ids, mask = _pad(SEQS, "right")
    with pytest.raises(ValueError, match="no `score` head"):
        sequence_scores(lm, ids, mask)


def test_reward_model_scorer_is_gradient_free(rm):
    ids, mask = _pad(SEQS, "right")
    scores = RewardModelScorer(rm)(ids, mask)
    assert not scores.requires_grad
    torch.testing.assert_close(scores, _manual_scores(rm, SEQS), atol=1e-5, rtol=0)


def test_ensemble_mean_and_min():
    """K = 3 members' scores of 3 rows: their mean, or the most pessimistic (Coste et al. 2023)."""
    scores = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, 0.5], [2.0, -1.0, -1.0]])
    assert reduce_ensemble(scores, "mean").tolist() == [2.0, -1.0, 0.0]
    assert reduce_ensemble(scores, "min").tolist() == [1.0, -2.0, -1.0]


def test_load_reward_scorer_from_saved_dirs(tmp_path, rm, tiny_dir):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=tiny_dir))
    save_model(rm, tokenizer, str(tmp_path / "rm1"))
    torch.manual_seed(1)
    other = load_reward_model(ModelConfig(name_or_path=tiny_dir), tokenizer, trainable=False, allow_new_head=True)
    save_model(other, tokenizer, str(tmp_path / "rm2"))
    ids, mask = _pad(SEQS, "right")

    single = load_reward_scorer(str(tmp_path / "rm1"))
    assert isinstance(single, RewardModelScorer)
    torch.testing.assert_close(single(ids, mask), _manual_scores(rm, SEQS), atol=1e-5, rtol=0)
    second = load_reward_scorer(str(tmp_path / "rm2"))
    torch.testing.assert_close(second(ids, mask), _manual_scores(other, SEQS), atol=1e-5, rtol=0)


# Mean pooling over the response (RMOptions.pooling = "mean") -----------------------------------------------------


def _manual_mean_scores(model, seqs, prompt_lens):
    """Each sequence alone: the score head at every response position, averaged."""
    base = unwrap_peft(model)
    with torch.no_grad():
        out = [base.score(base.model(input_ids=torch.tensor([s])).last_hidden_state)[0, p:, 0].mean()
               for s, p in zip(seqs, prompt_lens)]
    return torch.stack(out)


@pytest.mark.parametrize("side", ["right", "left"])
def test_mean_pooling_averages_the_head_over_the_response(tiny_dir, side):
    torch.manual_seed(0)
    model = load_reward_model(ModelConfig(name_or_path=tiny_dir), trainable=False, allow_new_head=True)
    model.config.rlhfkit_pooling = "mean"
    prompt_lens = [2, 1, 4]  # response = the tokens after them
    ids, mask = _pad(SEQS, side)
    response = torch.zeros_like(mask)
    for i, (s, p) in enumerate(zip(SEQS, prompt_lens)):
        start = 0 if side == "right" else ids.shape[1] - len(s)
        response[i, start + p : start + len(s)] = 1
    scores = RewardModelScorer(model)(ids, mask, response)
    expected = _manual_mean_scores(model, SEQS, prompt_lens)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert not torch.allclose(scores, _manual_scores(model, SEQS), atol=1e-3)  # not the last-token score
    with pytest.raises(ValueError, match="pass response_mask"):
        sequence_scores(model, ids, mask)


def test_rm_stage_saves_its_pooling_and_scorers_follow_it(tmp_path):
    """`rlhfkit rm algo.pooling=mean`: the saved config says so, and a reloaded scorer reproduces the mean."""
    from rlhfkit.cli import main

    out = tmp_path / "rm"
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={out}", "max_steps=3", "algo.pooling=mean",
                 "logging.progress_bar=false"]) == 0
    scorer = load_reward_scorer(str(out))
    assert scorer.model.config.rlhfkit_pooling == "mean"
    ids, mask = _pad(SEQS, "right")
    response = mask.clone()
    response[:, :1] = 0
    torch.testing.assert_close(scorer(ids, mask, response), _manual_mean_scores(scorer.model, SEQS, [1, 1, 1]), atol=1e-5, rtol=0)
    default = tmp_path / "rm_last"
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={default}", "max_steps=1", "logging.progress_bar=false"]) == 0
    assert load_reward_scorer(str(default)).model.config.rlhfkit_pooling == "last"


def test_head_only_trains_the_score_head_alone(tmp_path):
    """`algo.head_only`: a linear probe. The saved body equals the initial model's; the head moved and learned."""
    from safetensors.torch import load_file

    from rlhfkit.cli import main
    from rlhfkit.models import resolve_model_path

    out = tmp_path / "probe"
    assert main(["rm", "--config", "configs/rm_tiny.yaml", f"output_dir={out}", "max_steps=20", "algo.head_only=true",
                 "model.lora.enabled=true", "optim.lr=1e-2", "logging.progress_bar=false"]) == 0
    saved = load_file(str(out / "model.safetensors"))
    init = load_file(str(resolve_model_path(ModelConfig(name_or_path="tiny"))) + "/model.safetensors")
    body = [k for k in saved if not k.startswith("score.")]
    assert body and all(torch.equal(saved[k], init[k]) for k in body)  # LoRA ignored, nothing merged in
    assert "score.weight" in saved
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
