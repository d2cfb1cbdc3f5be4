"""Sliding-window attention in every sampler (`generation.Session`).

A session's KV cache holds columns a row did not fill (left padding, the steps after its turn ended while others went
on, the padding of shorter appended chunks, the columns from before a refilled row joined), masked out of attention.
transformers counts a sliding window in cache columns (its masks, and its sliding cache layers that keep the last W
columns), so those masked columns would take the place of real tokens inside the window: on a tiny Mistral with a
64-token window, a 1e-4 drift from the full forward, where a dense model agrees to 1e-7. The engine counts the window
in each row's own positions instead (`session.window_masks`, every column kept): the sampled log-probs equal a full
forward of the episode, for Mistral (every layer slides) and Gemma 2 / Gemma 3 (sliding and full layers mixed).
"""

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, MistralForCausalLM, Qwen2Config)

from rlhfkit import templates
from rlhfkit.config import GenerationConfig
from rlhfkit.errors import UserError
from rlhfkit.generation import generate, sliding_window_of
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.models import rollout_logprobs
from rlhfkit.rollout.tool_loop import ToolLoop
from rlhfkit.tools import Toolbox
from rlhfkit.types import PromptBatch
from tests.scripted import Scripted
from tests.smoke.agent_tools import add
from tests.unit.test_tool_loop import BIAS, script

WINDOW = 64  # the tool loop's episodes are ~150 tokens: gaps inside the window, which a column-counted one drifts on


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(tokenizer)
    return tokenizer


def tiny_model(tok, kind: str, window: int | None = WINDOW, attention: str = "sdpa"):
    shape = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                 eos_token_id=tok.eos_token_id, bos_token_id=None)
    if kind == "mistral":
        config, cls = MistralConfig(sliding_window=window, **shape), MistralForCausalLM
    elif kind == "gemma2":
        config, cls = Gemma2Config(sliding_window=window, head_dim=16, **shape), Gemma2ForCausalLM
    else:
        config, cls = Gemma3TextConfig(sliding_window=window, head_dim=16, layer_types=["sliding_attention",
                                       "full_attention"], **shape), Gemma3ForCausalLM
    config._attn_implementation = attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).eval()


def play(tok, model):
    """Three episodes of different lengths (a call, a direct answer, a call with a longer result), scripted."""
    params = GenerationConfig(max_new_tokens=200, top_k=1)
    loop = ToolLoop(tok, params, 0, Toolbox([add]), 3, 2.0, 100)
    examples = [{"prompt": p, "columns": {}} for p in ("add 1 2", "hello", "add 400 500")]
    batch = PromptBatch(torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long))
    return loop(Scripted(model, tok, script, BIAS), batch, examples, 0)


def test_sliding_window_of_reads_the_layers_that_use_one():
    assert sliding_window_of(MistralConfig(sliding_window=16)) == 16
    assert sliding_window_of(MistralConfig(sliding_window=None)) is None
    assert sliding_window_of(LlamaConfig()) is None
    assert sliding_window_of(Qwen2Config()) is None  # use_sliding_window=False: every layer is full attention
    assert sliding_window_of(Qwen2Config(sliding_window=32, use_sliding_window=True, max_window_layers=1,
                                         num_hidden_layers=2)) == 32  # layer 1 slides
    assert sliding_window_of(Gemma2Config(num_hidden_layers=2, sliding_window=512)) == 512  # alternating layers


@pytest.mark.parametrize("kind, attention", [("mistral", "sdpa"), ("mistral", "eager"), ("gemma2", "eager"),
                                             ("gemma3", "sdpa")])
def test_the_tool_loop_matches_a_full_forward_with_a_sliding_window(tok, kind, attention):
    """Episodes much longer than the window, whose cache rows hold gap columns: every sampled log-prob equals a full
    forward of the final episode (whose left padding sits before every real token, so transformers' column-counted
    window is exact there). With transformers' own masks and sliding cache layers, Mistral and Gemma drift by 1e-4."""
    model = tiny_model(tok, kind, attention=attention)
    ro = play(tok, model)
    with torch.no_grad():
        full = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, ro.prompt_ids.shape[1] - 1:-1]
    bias = BIAS * torch.nn.functional.one_hot(ro.response_ids, full.shape[-1])
    expected = torch.log_softmax(full.float() + bias, -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    mask = ro.action_mask.bool()
    assert ro.tools.calls.tolist() == [1, 0, 1] and mask.sum() > 100 and (ro.action_mask != ro.response_mask).any()
    assert int(ro.response_mask.sum(1).max()) > 2 * WINDOW
    torch.testing.assert_close(ro.sampler_logprobs[mask], expected[mask], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
@pytest.mark.parametrize("max_batch_rows", [None, 3])
def test_one_turn_and_refill_match_a_full_forward_with_a_sliding_window(tok, kind, max_batch_rows):
    """`generate` (rows leaving at different steps; with refill, rows joining a cache wider than themselves): the
    sampled log-probs are those of a full forward, with responses several windows long."""
    model = tiny_model(tok, kind, window=16)
    texts = ["hello there", "a b", "c d e f g", "x"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    batch = PromptBatch(torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids]),
                        torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]))
    torch.manual_seed(0)
    free = generate(model, batch, GenerationConfig(max_new_tokens=80, num_samples=2), tok.eos_token_id, tok.pad_token_id)
    eos = int(free.response_ids[:, 20:].flatten().mode().values)  # a common token: rows end at different steps
    torch.manual_seed(1)
    ro = generate(model, batch, GenerationConfig(max_new_tokens=80, num_samples=2, max_batch_rows=max_batch_rows), eos,
                  tok.pad_token_id)
    lengths = ro.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 1 and int(lengths.max()) > 2 * 16
    full = rollout_logprobs(model, ro, 1.0)
    torch.testing.assert_close(ro.sampler_logprobs, full * ro.response_mask, rtol=1e-5, atol=1e-5)


def test_flash_attention_with_a_window_is_refused_in_one_line(tok):
    """flash attention takes the window from the layer, counted in columns, not the engine's masks: refused before
    any forward (the model's config as it would be loaded with it; the kernel itself is not needed to refuse)."""
    model = tiny_model(tok, "mistral")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError) as caught:
        generate(model, PromptBatch(torch.tensor([[5, 6]]), torch.ones(1, 2, dtype=torch.long)),
                 GenerationConfig(max_new_tokens=2), tok.eos_token_id, tok.pad_token_id)
    assert "\n" not in str(caught.value) and "flash_attention_2" in str(caught.value)
