"""Continuous refill in the tool loop (`generation.max_batch_rows` with tools): with more episodes than rows, a
prompt's episodes join the session as soon as finished episodes leave room (at the end of a round of turns), instead
of the batch waiting for its longest episode. What it may not change: each row reads its own conversation (the
sampled log-probs equal a full forward), and a prompt drawn under its own seed (`generation.seed_per_prompt`) plays
the same episodes as with every row at once (and as alone: 2 processes ≡ 1). Under the run's one random stream the
tokens depend on which rows share each step's draw, with or without refill: only the seeded streams promise them."""

import torch

from tests.unit.test_engine import Recording
from tests.unit.test_tool_loop import BIAS, END, call, run, tiny  # noqa: F401 - tiny is a fixture
from tests.smoke.agent_tools import add, inc

LONG = "raw " + call("inc", n=1)[: -len(END)]  # calls inc, then inc on each result: max_calls bounds it


def prefills(recording) -> list[int]:
    """The rows of each prefill (a forward of whole rendered prompts, ~800 tokens with the tools' schemas; the chunks
    appended after turns are tens of tokens)."""
    return [rows for rows, width in recording.shapes if width > 300]


def test_a_finished_episode_s_row_takes_the_next_waiting_episode(tiny):
    """Episodes of 4, 1, 1 and 2 turns through 2 rows (max_calls 3). Round 1: the long one and "hello"; "hello" ends,
    "hi" joins. Round 2: "hi" ends, "add 1 2" joins. Rounds 3 and 4: the long one and "add". So three prefills, of 2,
    1 and 1 rows (played in chunks of 2 it would be 2 and 2, the second after the long episode's fourth turn), never
    more than 2 rows in a forward, the episodes those of every row at once, their log-probs a full forward's."""
    model, tok = tiny
    prompts = [LONG, "hello", "hi", "add 1 2"]
    recording = Recording(model)
    ro, _ = run((recording, tok), prompts, tools=(add, inc), max_new_tokens=600, max_batch_rows=2)
    assert prefills(recording) == [2, 1, 1]
    assert max(rows for rows, _ in recording.shapes) == 2
    assert ro.tools.turns.tolist() == [4, 1, 1, 2] and ro.tools.calls.tolist() == [3, 0, 0, 1]
    every, _ = run(tiny, prompts, tools=(add, inc), max_new_tokens=600)
    assert torch.equal(ro.response_ids, every.response_ids) and torch.equal(ro.action_mask, every.action_mask)
    full = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, ro.prompt_ids.shape[1] - 1:-1]
    bias = BIAS * torch.nn.functional.one_hot(ro.response_ids, full.shape[-1])
    expected = torch.log_softmax(full.float() + bias, -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    mask = ro.action_mask.bool()
    torch.testing.assert_close(ro.sampler_logprobs[mask], expected[mask], rtol=1e-5, atol=1e-7)


def test_seeded_episodes_are_the_same_with_refill_and_alone(tiny):
    """Sampled (top_k=0: the script only tilts the odds), 2 samples of 4 prompts, each prompt under its own seed:
    through 4 rows (two prompts at a time, a third joining when two episodes end) the episodes equal those of every
    row at once, and each prompt's equal its own alone."""
    prompts = [LONG, "hello", "add 30 4", "raw abc"]
    kw = dict(tools=(add, inc), num_samples=2, top_k=0, seed_per_prompt=True, step=2, bias=10.0, max_new_tokens=600)
    model, tok = tiny
    recording = Recording(model)
    refilled, _ = run((recording, tok), prompts, max_batch_rows=4, **kw)
    every, _ = run(tiny, prompts, **kw)
    assert len(prefills(recording)) > 2 and max(rows for rows, _ in recording.shapes) <= 4
    assert int(every.tools.calls.sum()) >= 3 and len(set(every.response_mask.sum(1).tolist())) >= 3
    assert torch.equal(refilled.response_ids, every.response_ids)
    assert torch.equal(refilled.action_mask, every.action_mask)
    torch.testing.assert_close(refilled.sampler_logprobs, every.sampler_logprobs, rtol=1e-5, atol=1e-6)
    for p in (0, 2):
        alone, _ = run(tiny, [prompts[p]], **kw)
        width = alone.response_ids.shape[1]
        assert torch.equal(refilled.response_ids[2 * p: 2 * p + 2, :width], alone.response_ids)
