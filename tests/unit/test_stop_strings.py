"""Stop strings (`generation.stop_strings`): a row ends at the first token whose turn text holds one, that token kept
and nothing after it sampled, in every sampler, with refill, the same rows on 2 processes as on 1; the config and
TRL's `generation_kwargs` map to it or are refused in one line.

On the tiny model (one character, one token): scripted turns give hand-counted lengths; seeded free runs give the
tokens a stopped run must reproduce up to its stop."""

import random

import pytest
import torch

from rlhfkit.config import GenerationConfig, OnlineConfig, load_config
from rlhfkit.errors import ConfigError, UserError
from rlhfkit.generation import StopStrings, generate, prompt_seed, stop_strings
from rlhfkit.models import rollout_logprobs
from rlhfkit.rollout.single_turn import SingleTurn
from tests.scripted import Scripted
from tests.unit.test_engine import Recording, batch_of
from tests.unit.test_tool_loop import BIAS, END, call, ids, run, tool_turn, tiny  # noqa: F401 - tiny is a fixture

TURNS = {"say a": "hello world. bye" + END, "say b": "no stop here" + END, "say c": "stop at the end.",
         "say d": "a" * 30, "say e": "a" * 19 + ".", "say f": "hello" + END}


def single_turn(tiny, prompts, stops, max_new_tokens=20, model=None):
    model_, tok = tiny
    params = GenerationConfig(max_new_tokens=max_new_tokens, top_k=1, stop_strings=list(stops))
    examples = [{"prompt": p, "columns": {}} for p in prompts]
    policy = Scripted(model or model_, tok, lambda text: TURNS[text], BIAS)
    return SingleTurn(tok, params, 0)(policy, batch_of(tok, prompts), examples, 0)


def test_a_row_ends_at_the_token_that_completes_a_stop_string(tiny):
    """Counted by hand, with stop strings "o w" and ".": "hello w" (7 tokens: "o w" spans three, the first "."
    comes later), "no stop here" + EOS (13: neither string occurs), "stop at the end." (16: "." is its last token),
    "a" * 20 (cut by the budget of 20: not ended), "a" * 19 + "." (20: the stop string at the budget's last token
    ends it), "hello" + EOS (6: "o" then EOS, not " w")."""
    model, tok = tiny
    recording = Recording(model)
    ro = single_turn(tiny, list(TURNS), ["o w", "."], model=recording)
    lengths = ro.response_mask.sum(1).tolist()
    assert lengths == [7, 13, 16, 20, 20, 6]
    assert list(ro.texts) == ["hello w", "no stop here", "stop at the end.", "a" * 20, "a" * 19 + ".", "hello"]
    assert ro.has_eos.tolist() == [True, True, True, False, True, True]
    assert (ro.response_ids[ro.response_mask == 0] == tok.pad_token_id).all()
    assert (ro.sampler_logprobs[ro.response_mask == 0] == 0).all()
    # No token after a row's stop is sampled: the one-token forwards carry the rows still live at each step.
    steps = [rows for rows, width in recording.shapes if width == 1]
    assert steps == [sum(n > t for n in lengths) for t in range(1, max(lengths))]
    # The tokens kept, and their log-probs, are those of the same rows sampled without stop strings.
    free = single_turn(tiny, list(TURNS), [])
    for i, n in enumerate(lengths):
        assert torch.equal(ro.response_ids[i, :n], free.response_ids[i, :n])
        torch.testing.assert_close(ro.sampler_logprobs[i, :n], free.sampler_logprobs[i, :n])


def test_a_stop_string_may_name_a_special_token_and_the_prompt_is_not_read(tiny):
    """"<|im_end|>" is EOS's text: a row ends at its EOS either way. Prompt "say f" and stop string "fh" do not stop the
    turn "hello" at its first token: only the turn's own text is read."""
    _, tok = tiny
    ro = single_turn(tiny, ["say b"], [END, "e h"])
    assert ro.response_mask.sum().item() == 13 and ro.has_eos.tolist() == [True]
    ro = single_turn(tiny, ["say f"], ["fh"])  # the prompt's "f" and the first token "h" would make "fh"
    assert list(ro.texts) == ["hello"] and ro.response_mask.sum().item() == 6


def stops_from(free, tok, rows):
    """Two-character stop strings taken from the middle of some rows of a free run."""
    found = []
    for i in rows:
        text = tok.decode(free.response_ids[i][free.response_mask[i].bool()].tolist())
        found.append(text[6:8])
    return found


def expected_ends(free, tok, stops) -> tuple[list[int], list[bool]]:
    """Each row's length by the definition (the first t at which a stop string occurs in decode(tokens[:t]), else the
    free run's own end), and whether it ended by itself (a stop string, or the free row's EOS)."""
    lengths, ended = [], []
    for ids_, mask, eos in zip(free.response_ids, free.response_mask, free.has_eos.tolist()):
        row = ids_[mask.bool()].tolist()
        hits = [t for t in range(1, len(row) + 1) if any(s in tok.decode(row[:t]) for s in stops)]
        lengths.append(hits[0] if hits else len(row))
        ended.append(bool(hits) or eos)
    return lengths, ended


@pytest.mark.parametrize("rows", [None, 4])
def test_stopped_rows_draw_as_free_ones_with_refill_and_match_a_full_forward(tiny, rows):
    """Seeded prompts (5 x 3 samples), sampled freely, then with stop strings taken from their own text, every row at
    once or 4 rows at a time (continuous refill): each row is the free row up to the first token whose text holds a
    stop string (the others' tokens unchanged), its log-probs those a full forward gives, and each prompt's rows are
    what it draws alone (2 processes ≡ 1)."""
    model, tok = tiny
    batch = batch_of(tok, ["hello there", "a b", "c", "the quick brown", "x y z w"])
    seeds = [prompt_seed(3, 0, i[m.bool()]) for i, m in zip(batch.input_ids, batch.attention_mask)]
    params = GenerationConfig(max_new_tokens=24, num_samples=3)
    free = generate(model, batch, params, 2, tok.pad_token_id, seeds)
    stops = stops_from(free, tok, [0, 4, 9])
    params = GenerationConfig(max_new_tokens=24, num_samples=3, stop_strings=stops, max_batch_rows=rows)
    ro = generate(model, batch, params, 2, tok.pad_token_id, seeds, stop_strings(params, tok))
    lengths, ended = expected_ends(free, tok, stops)
    assert ro.response_mask.sum(1).tolist() == lengths
    assert sum(n < int(m.sum()) for n, m in zip(lengths, free.response_mask)) >= 3  # rows did stop early
    for i, n in enumerate(lengths):
        assert torch.equal(ro.response_ids[i, :n], free.response_ids[i, :n])
    assert ro.has_eos.tolist() == ended
    full = rollout_logprobs(model, ro, 1.0)
    torch.testing.assert_close(ro.sampler_logprobs, full * ro.response_mask, rtol=1e-4, atol=1e-5)
    for p in range(5):  # each prompt alone under its seed: what one process of several draws
        alone = generate(model, batch_of(tok, [["hello there", "a b", "c", "the quick brown", "x y z w"][p]]), params,
                         2, tok.pad_token_id, seeds[p: p + 1], stop_strings(params, tok))
        width = alone.response_ids.shape[1]
        assert torch.equal(alone.response_ids, ro.response_ids[3 * p: 3 * p + 3, :width])


def test_the_tool_loop_ends_a_turn_at_a_stop_string_and_closes_it_before_the_results(tiny):
    """"</tool_call>" ends the calling turn before its EOS: the call still runs, the template's end-of-turn (EOS) is
    appended unsampled (action 0) before the result; "got" ends the last turn, and the episode, as ended."""
    model, tok = tiny
    ro, _ = run(tiny, ["add 1 2", "hello"], stop_strings=["</tool_call>", "got"])
    turn1 = call("add", a=1, b=2)[: -len(END)]
    expected = ids(tok, turn1 + END + tool_turn("add", "3") + "got")
    assert ro.response_ids[0][ro.response_mask[0].bool()].tolist() == expected
    n1, n_tool = len(ids(tok, turn1)), len(ids(tok, END + tool_turn("add", "3")))
    assert ro.action_mask[0][: len(expected)].tolist() == [1] * n1 + [0] * n_tool + [1] * 3
    assert ro.tools.calls.tolist() == [1, 0] and ro.has_eos.tolist() == [True, True]
    assert ro.response_ids[1][ro.response_mask[1].bool()].tolist() == ids(tok, "no tool" + END)
    full = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask).logits[:, ro.prompt_ids.shape[1] - 1:-1]
    bias = BIAS * torch.nn.functional.one_hot(ro.response_ids, full.shape[-1])
    expected_lp = torch.log_softmax(full.float() + bias, -1).gather(-1, ro.response_ids[..., None]).squeeze(-1)
    mask = ro.action_mask.bool()
    torch.testing.assert_close(ro.sampler_logprobs[mask], expected_lp[mask], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overrides, message", [
    (["generation.stop_strings=[x]", "generation.engine=hf"],
     "config key 'generation.stop_strings' stop strings end rows in rlhfkit's decode loop"),
    (["generation.stop_strings=['']"], "config key 'generation.stop_strings' an empty string would end every row"),
])
def test_stop_strings_are_checked_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(OnlineConfig, None, ["model.name_or_path=tiny", "data.train=t.jsonl", "output_dir=out",
                                         "reward.function=m:f", *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_trl_generation_kwargs_stop_strings_map_and_the_rest_is_refused():
    trl = pytest.importorskip("trl")
    from rlhfkit.config.trl_args import trl_config_keys

    cpu = {"use_cpu": True, "bf16": False, "output_dir": "out"}
    keys = trl_config_keys("grpo", trl.GRPOConfig(**cpu, generation_kwargs={"stop_strings": ["\n\n", "###"]}))
    assert keys["generation"]["stop_strings"] == ["\n\n", "###"]
    keys = trl_config_keys("rloo", trl.RLOOConfig(**cpu, generation_kwargs={"stop": "</answer>"}))  # vLLM's name
    assert keys["generation"]["stop_strings"] == ["</answer>"]
    assert "stop_strings" not in trl_config_keys("grpo", trl.GRPOConfig(**cpu))["generation"]
    with pytest.raises(UserError) as err:
        trl_config_keys("grpo", trl.GRPOConfig(**cpu, generation_kwargs={"stop_strings": ["x"], "num_beams": 2}))
    assert str(err.value).startswith("args.generation_kwargs=['num_beams']: rlhfkit samples with its own decode loop")
    assert "\n" not in str(err.value)


def test_generate_needs_the_tokenizer_exactly_when_there_are_stop_strings(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="stop=stop_strings"):
        generate(model, batch_of(tok, ["a"]), GenerationConfig(stop_strings=["x"]), 2, 2)


class Counting:
    """A tokenizer that counts the tokens each `batch_decode` call decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def batch_decode(self, ids, **kwargs):
        self.decoded.append(sum(map(len, ids)))
        return self.tokenizer.batch_decode(ids, **kwargs)


def test_a_long_turn_is_checked_on_a_bounded_tail(tiny):
    """Two rows of up to 300 tokens under a stop string that never occurs: each step decodes a tail of a bounded length
    (one character per token: the string's 10 characters, a margin of 6, 4 tokens at the window's start and 3
    before the newest), not the whole turn, so a turn costs O(n) decoding, not O(n²)."""
    model, tok = tiny
    batch = batch_of(tok, ["hello there", "a b"])
    params = GenerationConfig(max_new_tokens=300, stop_strings=["never-said"])
    counting = Counting(tok)
    ro = generate(model, batch, params, 2, tok.pad_token_id, [1, 2], stop_strings(params, counting))
    assert ro.response_mask.sum(1).max() == 300  # a row runs to the budget
    per_row = 15 + (4 + 15 + 3 + 1)  # a middle of 15 tokens, then the window
    assert max(counting.decoded) <= 2 * per_row and sum(counting.decoded) <= 300 * 2 * per_row


def byte_level():
    """A byte-level BPE tokenizer (GPT-2's, Llama 3's, SmolLM2's kind) trained on text with multi-byte characters,
    so that its tokens hold whole characters, parts of them, and several."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[END], show_progress=False)
    tokenizer.train_from_iterator(["héllo wörld, a naïve café: 5 € and 😀, 日本語のテキスト. Stop it!"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def sentencepiece():
    """Llama 2's kind: "▁" for a space, <0xNN> byte tokens for what the vocabulary lacks, the leading space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁the", "▁stop", "s", "t", "o", "p", "é", ".", "▁a", "ab"]
    tokenizer = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def wordpiece():
    """BERT's kind: "##" joins a piece to the one before, others are joined with a space, and the clean-up removes
    the space before punctuation and in "n't", "'s"."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["[UNK]", "do", "not", "n", "'", "t", "s", ".", ",", "?", "##s", "##ing", "##'", "a", "stop", "##op"]
    tokenizer = Tokenizer(models.WordPiece({p: i for i, p in enumerate(pieces)}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


ALPHABET = "ab .,'-" + "éü€😀日本語のテ" + "stopn"


def streams(tok, rng, n):
    """n token streams: half random ids (stray bytes of characters, special tokens), half encoded random text of
    multi-byte characters, which byte tokens and merged pieces split apart."""
    rows = []
    for i in range(n):
        if i % 2:
            rows.append([rng.randrange(len(tok)) for _ in range(rng.randrange(30, 200))])
        else:
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(20, 120)))
            rows.append(tok.encode(text, add_special_tokens=False) or [0])
    return rows


@pytest.mark.parametrize("make", [byte_level, sentencepiece, wordpiece, None])
def test_the_tail_check_ends_rows_where_the_whole_turn_does(make, tiny):
    """Token streams and stop strings of 1 to 12 characters cut from the end of their text at a random token (some
    ending in "�": a character's bytes cut apart): asked after every token, as the engine asks, the check ends each
    row at the first token whose whole turn's text holds a stop string."""
    tok = make() if make else tiny[1]
    rng = random.Random(0)
    for trial in range(24):
        rows = streams(tok, rng, 4)
        strings = []
        for row in rng.sample(rows, 3):
            text = tok.decode(row[: rng.randrange(len(row) // 2, len(row) + 1)], skip_special_tokens=False)
            strings.append(text[-rng.randrange(1, 13):] or "x")
        check = StopStrings(strings, tok)
        expected = [next((t for t in range(1, len(r) + 1) if any(s in tok.decode(r[:t], skip_special_tokens=False)
                                                                   for s in strings)), None) for r in rows]
        ends, live = [None] * len(rows), list(range(len(rows)))
        for t in range(1, max(map(len, rows)) + 1):
            live = [i for i in live if t <= len(rows[i])]
            for i, hit in zip(live, check.ended([rows[i][:t] for i in live])):
                if hit:
                    ends[i] = t
            live = [i for i in live if ends[i] is None]
        assert ends == expected, (trial, strings)
