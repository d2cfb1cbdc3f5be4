"""The tool loop's KV cache (`rollout.tool_loop.Session`): a prompt several rows share is prefilled once and copied to
each; the cache's layers grow in place. Both must leave what each row reads unchanged: the logits of a forward of the
row's own tokens, the keys and values a `DynamicLayer` would hold."""

import torch
from transformers.cache_utils import DynamicLayer

from rlhfkit.config import GenerationConfig
from rlhfkit.rollout.tool_loop import GrowingLayer, Session
from tests.unit.test_tool_loop import tiny  # noqa: F401 - tiny is a fixture


class Recording(torch.nn.Module):
    """The tiny model, recording the shape of each forward's tokens."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.shapes = model, model.config, []

    def forward(self, input_ids, cache=None, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return self.model(input_ids=input_ids, cache=cache, **kwargs)


def test_a_prompt_several_rows_share_is_prefilled_once_and_its_copies_go_their_own_ways(tiny):
    model, tok = tiny
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in ("abcd", "abx", "abcd", "abx", "abcd")]
    recording = Recording(model)
    session = Session(recording, GenerationConfig(), tok.eos_token_id, tok.pad_token_id, torch.device("cpu"))
    logits = session.start(prompts)
    assert recording.shapes == [(2, 4)]  # "abcd" and "abx", left-padded
    assert all(type(layer) is GrowingLayer for layer in session.cache.layers)
    assert session.mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]]
    assert session.next_position.tolist() == [4, 3, 4, 3, 4]
    for row, ids in enumerate(prompts):
        torch.testing.assert_close(logits[row], model(input_ids=torch.tensor([ids])).logits[0, -1])
    # the copies are rows of their own: each reads its prompt and its own next token
    tokens = [5, 6, 7, 8, 9]
    step = session.forward(torch.tensor(tokens)[:, None], torch.ones(5, 1, dtype=torch.bool))
    for row, (ids, token) in enumerate(zip(prompts, tokens)):
        torch.testing.assert_close(step[row], model(input_ids=torch.tensor([ids + [token]])).logits[0, -1])


def test_a_growing_layer_holds_what_a_dynamic_layer_holds_and_writes_a_token_in_place():
    torch.manual_seed(0)
    growing, dynamic = GrowingLayer(), DynamicLayer()
    states = lambda batch, length: (torch.randn(batch, 3, length, 4), torch.randn(batch, 3, length, 4))  # noqa: E731
    steps = [("update", 1, 5), ("select", [0, 0, 0]), ("update", 3, 2), ("update", 3, 1), ("update", 3, 1),
             ("select", [2, 0]), ("update", 2, 9), ("update", 2, 1)]
    for op, *args in steps:
        if op == "update":
            kv = states(*args)
            out = [layer.update(*kv) for layer in (growing, dynamic)]
            assert all(torch.equal(a, b) for a, b in zip(*out))
        else:
            for layer in (growing, dynamic):
                layer.batch_select_indices(torch.tensor(args[0]))
        assert torch.equal(growing.keys, dynamic.keys) and torch.equal(growing.values, dynamic.values)
    assert growing.get_seq_length() == dynamic.get_seq_length() == 19
    before = growing.keys.data_ptr()  # 19 columns in a buffer of 36 (doubled from 18)
    growing.update(*states(2, 1))
    assert growing.keys.data_ptr() == before and growing.get_seq_length() == 20
