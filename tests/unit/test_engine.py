"""The decode engine (`generation.Session`): a prompt several rows share is prefilled once and copied to each, a
finished row leaves the forward, waiting prompts join as rows finish (continuous refill). None of it may change what
a row reads: the logits of a forward of its own tokens, the tokens a batch that kept every row would draw."""

import pytest
import torch

from rlhfkit.config import GenerationConfig, OnlineConfig, load_config
from rlhfkit.errors import ConfigError
from rlhfkit.generation import Group, Session, Stream, generate, prompt_seed
from rlhfkit.types import PromptBatch
from tests.unit.test_tool_loop import tiny  # noqa: F401 - tiny is a fixture

class Recording(torch.nn.Module):
    """The tiny model, recording the shape of each forward's tokens."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.shapes = model, model.config, []

    @property
    def dtype(self):
        return self.model.dtype

    def forward(self, input_ids, cache=None, **kwargs):
        self.shapes.append(tuple(input_ids.shape))
        return self.model(input_ids=input_ids, cache=cache, **kwargs)

def batch_of(tok, texts):
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    return PromptBatch(torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids]),
                       torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids]))

def test_a_prompt_several_rows_share_is_prefilled_once_and_its_copies_go_their_own_ways(tiny):
    model, tok = tiny
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in ("abcd", "abx", "abcd", "abx", "abcd")]
    recording = Recording(model)
    session = Session(recording, GenerationConfig(), tok.eos_token_id, tok.pad_token_id, torch.device("cpu"))
    session.start([Group([i], p, Stream(), 1) for i, p in enumerate(prompts)])
    assert recording.shapes == [(2, 4)]  # "abcd" and "abx", left-padded
    assert session.mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]]
    assert session.next_position.tolist() == [4, 3, 4, 3, 4]
    for row, ids in enumerate(prompts):
        torch.testing.assert_close(session.logits[row], model(input_ids=torch.tensor([ids])).logits[0, -1])
    # the copies are rows of their own: each reads its prompt and its own next token
    tokens = [5, 6, 7, 8, 9]
    step = session.forward(torch.tensor(tokens)[:, None], torch.ones(5, 1, dtype=torch.bool))
    for row, (ids, token) in enumerate(zip(prompts, tokens)):
        torch.testing.assert_close(step[row], model(input_ids=torch.tensor([ids + [token]])).logits[0, -1])

def test_finished_rows_leave_the_forward(tiny):
    """With the commonest token as EOS rows end at different steps: each forward after the prefill feeds only the rows
    still sampling (one token each), and the tokens are those of transformers' `generate`, which keeps every row."""
    model, tok = tiny
    batch = batch_of(tok, ["hello there", "a b"])
    torch.manual_seed(0)
    free = generate(model, batch, GenerationConfig(max_new_tokens=30, num_samples=4), tok.eos_token_id, tok.pad_token_id)
    eos = int(free.response_ids.flatten().mode().values)
    recording = Recording(model)
    params = GenerationConfig(max_new_tokens=60, num_samples=4)
    torch.manual_seed(1)
    ours = generate(recording, batch, params, eos, tok.pad_token_id)
    torch.manual_seed(1)
    ref = generate(model, batch, GenerationConfig(max_new_tokens=60, num_samples=4, engine="hf"), eos, tok.pad_token_id)
    assert torch.equal(ours.response_ids, ref.response_ids)
    lengths = ours.response_mask.sum(1)
    assert len(set(lengths.tolist())) > 1
    assert recording.shapes[0] == (2, batch.input_ids.shape[1])  # each distinct prompt once
    live = [int((lengths > t).sum()) for t in range(1, int(lengths.max()))]  # rows still sampling at each step
    assert [s[0] for s in recording.shapes[1:]] == live and all(s[1] == 1 for s in recording.shapes[1:])

@pytest.mark.parametrize("rows", [3, 4, 7])
def test_continuous_refill_draws_each_seeded_prompt_as_alone(tiny, rows):
    """`generation.max_batch_rows`: five prompts of 3 samples through 3, 4 or 7 rows. A prompt drawn under its own
    seed gives the same tokens as with every row at once, and the rows never exceed the setting; log-probs match."""
    model, tok = tiny
    batch = batch_of(tok, ["hello there", "a b", "c", "the quick brown", "x y z w"])
    seeds = [prompt_seed(7, 0, ids[m.bool()]) for ids, m in zip(batch.input_ids, batch.attention_mask)]
    everything = generate(model, batch, GenerationConfig(max_new_tokens=20, num_samples=3), 2, tok.pad_token_id, seeds)
    recording = Recording(model)
    refilled = generate(recording, batch, GenerationConfig(max_new_tokens=20, num_samples=3, max_batch_rows=rows), 2,
                        tok.pad_token_id, seeds)
    assert torch.equal(refilled.response_ids, everything.response_ids)
    torch.testing.assert_close(refilled.sampler_logprobs, everything.sampler_logprobs, rtol=1e-5, atol=1e-5)
    assert max(s[0] for s in recording.shapes) <= rows
    assert len(set(everything.response_mask.sum(1).tolist())) > 1  # rows did end at different steps

def test_refilled_rows_match_a_full_forward(tiny):
    """Unseeded refill (rows joining a cache whose columns they did not fill): every sampled log-prob equals the one
    a forward of the row's prompt and response gives."""
    from rlhfkit.models import rollout_logprobs

    model, tok = tiny
    batch = batch_of(tok, ["hello there", "a b", "c", "the quick brown"])
    torch.manual_seed(0)
    ro = generate(model, batch, GenerationConfig(max_new_tokens=16, num_samples=2, max_batch_rows=3), 2,
                  tok.pad_token_id)
    full = rollout_logprobs(model, ro, 1.0)
    torch.testing.assert_close(ro.sampler_logprobs, full * ro.response_mask, rtol=1e-4, atol=1e-5)

@pytest.mark.parametrize("overrides, message", [
    (["generation.num_samples=4", "generation.max_batch_rows=3"],
     "config key 'generation.max_batch_rows' must hold one prompt's samples (generation.num_samples=4), got 3"),
    (["generation.max_batch_rows=8", "generation.engine=hf"],
     "config key 'generation.max_batch_rows' continuous refill is rlhfkit's dynamic-cache engine"),
])
def test_max_batch_rows_is_checked_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(OnlineConfig, None, ["model.name_or_path=tiny", "data.train=t.jsonl", "output_dir=out", "reward.function=m:f",
                                         *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_tool_loop_turn_feeds_only_the_rows_still_in_it(tiny):
    """A direct answer ends long before a tool call is written: from then on the turn's one-token forwards carry the
    calling row only (the finished one is parked out of the cache), and the next turn's chunk has the calling row
    alone (the other episode is over)."""
    from tests.unit.test_tool_loop import BIAS, script
    from rlhfkit.rollout.tool_loop import ToolLoop
    from rlhfkit.tools import Toolbox
    from tests.scripted import Scripted
    from tests.smoke.agent_tools import add

    model, tok = tiny
    recording = Recording(model)
    loop = ToolLoop(tok, GenerationConfig(max_new_tokens=200, top_k=1), 0, Toolbox([add]), 3, 2.0, 100)
    examples = [{"prompt": p, "columns": {}} for p in ("add 1 2", "hello")]
    ro = loop(Scripted(recording, tok, script, BIAS), batch_of(tok, ["a", "b"]), examples, 0)
    assert ro.tools.calls.tolist() == [1, 0]
    steps = [rows for rows, width in recording.shapes if width == 1]
    answer = int(ro.response_mask[1].sum())  # "no tool" and its EOS: the second row's whole episode
    assert steps[: answer - 1] == [2] * (answer - 1)  # both rows sample until the answer's EOS
    assert set(steps[answer - 1:]) == {1}  # then the call alone, in this turn and the next
    assert [rows for rows, width in recording.shapes if width > 1][1:] == [1]  # the results, fed to the caller only
