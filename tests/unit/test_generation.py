"""generate(): the sampler's log-probs of the sampled tokens, read one step at a time (no (B, R, V) logits kept)."""

import pytest
import torch

from rlhfkit.config import GenerationConfig, ModelConfig
from rlhfkit.generation import generate
from rlhfkit.models import load_causal_lm, load_tokenizer
from rlhfkit.types import PromptBatch


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(name_or_path="tiny")
    tok = load_tokenizer(cfg)
    return load_causal_lm(cfg, tok).eval(), tok


def prompts(tok):
    ids = [tok("hello there", add_special_tokens=False)["input_ids"], tok("a b", add_special_tokens=False)["input_ids"]]
    width = max(map(len, ids))
    pad = tok.pad_token_id
    return PromptBatch(torch.tensor([[pad] * (width - len(x)) + x for x in ids]),
                       torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]))


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampler_logprobs_equal_the_full_logits_computation(tiny, top_k):
    """Same seed, same tokens: the recorded log-probs equal log_softmax(raw logits / τ) of the sampled tokens computed
    from transformers' `output_logits` (top-k truncation is not part of the density)."""
    model, tok = tiny
    params = GenerationConfig(max_new_tokens=12, temperature=0.7, num_samples=3, top_k=top_k)
    batch = prompts(tok)
    torch.manual_seed(0)
    ro = generate(model, batch, params, tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(0)
    out = model.generate(input_ids=batch.input_ids.repeat_interleave(3, 0),
                         attention_mask=batch.attention_mask.repeat_interleave(3, 0), do_sample=True, temperature=0.7,
                         top_k=top_k or None, max_new_tokens=12, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, return_dict_in_generate=True, output_logits=True)
    sampled = out.sequences[:, batch.input_ids.shape[1]:]
    assert torch.equal(ro.response_ids, sampled.masked_fill(ro.response_mask == 0, tok.pad_token_id))
    full = torch.log_softmax(torch.stack(out.logits, 1).float() / 0.7, -1).gather(-1, sampled.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(ro.sampler_logprobs, full * ro.response_mask, rtol=1e-5, atol=1e-6)
    assert (ro.sampler_logprobs * ro.response_mask).abs().sum() > 0


def test_generate_keeps_no_full_logits(tiny, monkeypatch):
    model, tok = tiny
    seen = {}
    real = model.generate

    def spy(**kwargs):
        seen.update(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    generate(model, prompts(tok), GenerationConfig(max_new_tokens=4), tok.eos_token_id, tok.pad_token_id)
    assert not seen.get("output_logits") and not seen.get("output_scores")
