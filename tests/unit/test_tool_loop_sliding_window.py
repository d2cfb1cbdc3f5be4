"""Sliding-window attention in the tool loop (`rollout.tool_loop.ToolLoop`).

The loop keeps one KV cache for a batch of episodes across their turns; a row's cache holds columns it did not fill
(left padding, the steps after its turn ended while others went on, the padding of shorter appended chunks), masked
out of attention. A dense model reads exactly its own tokens either way. A sliding window, though, is counted in
cache columns by transformers' masks (and its cache layers keep the last W columns), so the masked columns inside a
row's window take the place of real tokens, and its log-probs drift from the ones a full forward of the episode gives
(the trainer's): on a tiny Mistral with a 64-token window, by 1e-4 where the dense model agrees to 1e-7. The loop
therefore refuses a model with a sliding window, in one line, before it samples anything.
"""

import pytest
import torch
from transformers import Gemma2Config, LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config

from rlhfkit import templates
from rlhfkit.config import GenerationConfig
from rlhfkit.errors import UserError
from rlhfkit.model_sources import build_tiny_tokenizer
from rlhfkit.rollout.tool_loop import ToolLoop, sliding_window_of
from rlhfkit.tools import Toolbox
from rlhfkit.types import PromptBatch
from tests.scripted import Scripted
from tests.smoke.agent_tools import add
from tests.unit.test_tool_loop import BIAS, script


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tiny_tokenizer()
    templates.load("chatml_tools").apply_to(tokenizer)
    return tokenizer


def mistral(tok, window: int | None) -> MistralForCausalLM:
    config = MistralConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
                           sliding_window=window, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                           bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MistralForCausalLM(config).eval()


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


def test_a_sliding_window_policy_is_refused_in_one_line(tok):
    """Refused before any token is sampled: the error names the window and what to use instead."""
    model = mistral(tok, 64)
    with pytest.raises(UserError) as caught:
        play(tok, model)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("tools: the policy (mistral) uses sliding-window attention (64 tokens), which the tool "
                              "loop's KV cache")
    assert "sliding_window: null" in message


def test_the_same_architecture_without_a_window_matches_a_full_forward(tok):
    """Mistral with `sliding_window: null` (as Mistral 7B v0.2 and later ship) plays the loop: every sampled log-prob
    equals a full forward of the final episode's, as the tiny Llama's do (`test_tool_loop`)."""
    model = mistral(tok, None)
    ro = play(tok, model)
    with torch.no_grad():
        full = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, ro.prompt_ids.shape[1] - 1:-1]
    bias = BIAS * torch.nn.functional.one_hot(ro.response_ids, full.shape[-1])
    expected = torch.log_softmax(full.float() + bias, -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    mask = ro.action_mask.bool()
    assert ro.tools.calls.tolist() == [1, 0, 1] and mask.sum() > 100 and (ro.action_mask != ro.response_mask).any()
    torch.testing.assert_close(ro.sampler_logprobs[mask], expected[mask], rtol=1e-5, atol=1e-7)
