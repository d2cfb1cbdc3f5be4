"""Stop strings (`generation.stop_strings`, transformers' and TRL's `stop_strings`): which rows' turns have just
ended at one.

A turn ends at the first token t at which a stop string occurs in `tokenizer.decode(turn[:t])` (special tokens
included, so a string may name one): a string may span tokens, and a token may run past the string's end (token
"stopped" completes "stop"); t is the turn's last token, kept as an EOS is, and nothing after it is sampled. Only the
turn's own text is read, never the prompt or an earlier turn: a string the prompt ends with half-written does not end
the response at its first token. (transformers' `StopStringCriteria` reads the prompt's tokens too.)

The check decodes a tail of the turn, not the whole of it, so that a turn of n tokens costs O(n) decoding, not
O(n²). Why a tail is enough: the engine asks after every token, stopping the row at the first hit, so the text
before the newest token holds no stop string, and a new one must end in what the newest token changed. That token
changes the text of at most `BACK` tokens before it (it completes a character whose first bytes they hold, or a
clean-up removes a space before it), so a string of k characters lies within those tokens plus the k - 1
characters before them. The window takes enough tokens before them to cover k - 1 characters, plus `GUARD` tokens
at its start whose text may read differently alone than in the whole turn (stray bytes of a character begun
earlier decode as "�", a SentencePiece leading space is stripped, a WordPiece "##" stays). Those first tokens can
only make a window see a string that is not there (one holding "�" or "##"), never miss one; so a hit in a window is
confirmed on the whole turn (a true hit ends the row: once per row). Assumed of the decoder (byte-level BPE,
SentencePiece with byte fallback, WordPiece): a window's start alters only its first `GUARD` tokens' text.
tests/unit/test_stop_strings.py holds random token streams of a tokenizer of each kind (multi-byte characters split
across tokens) to the whole-turn rule.
"""

from __future__ import annotations

# Tokens before the newest whose text it may change: the up to 3 leading bytes of a UTF-8 character it completes
# (one or more bytes per token), or the space a clean-up removes before a "n't" (" ", "n", "'").
BACK = 3
# Tokens at a window's start that may read differently than in the whole turn: up to 3 stray continuation bytes of a
# character begun before the window, one more for a stripped leading space or a "##" prefix.
GUARD = 4
# Characters a window's middle, decoded alone, may show beyond its own text: up to 3 "�" for a character's bytes cut
# at each of its two ends.
SLACK = 6


class StopStrings:
    """The run's stop strings and the tokenizer that turns a turn's tokens into the text they are looked for in."""

    def __init__(self, strings, tokenizer):
        self.strings, self.tokenizer = tuple(strings), tokenizer
        self.need = max(map(len, self.strings), default=1) - 1 + SLACK  # characters a window's middle must cover

    def ended(self, turns: list[list[int]]) -> list[bool]:
        """For each turn (its tokens so far, the newest last), whether its text now holds a stop string. The engine
        asks after every token of a live row, so the first True is at the token that completes the string; asked so,
        the answer is that of the whole turn's text (module docstring)."""
        starts = self.window_starts(turns)
        hits = [self.holds(text) for text in self.decode([turn[j:] for turn, j in zip(turns, starts)])]
        confirm = [i for i, (hit, j) in enumerate(zip(hits, starts)) if hit and j > 0]
        for i, text in zip(confirm, self.decode([turns[i] for i in confirm])):
            hits[i] = self.holds(text)
        return hits

    def window_starts(self, turns: list[list[int]]) -> list[int]:
        """Where each turn's window starts: `GUARD` tokens, then a middle whose text covers `need` characters, then
        the `BACK` tokens and the newest one; 0 (the whole turn) when the turn is shorter. The middle starts at
        `need` tokens (one character each, the common case) and doubles until its text is long enough."""
        starts: list[int | None] = [None] * len(turns)
        size, pending = self.need, list(range(len(turns)))
        while pending:
            middles = {}
            for i in pending:
                end = len(turns[i]) - 1 - BACK
                if end - size - GUARD <= 0:
                    starts[i] = 0
                else:
                    middles[i] = (end - size, end)
            texts = self.decode([turns[i][a:b] for i, (a, b) in middles.items()])
            for (i, (a, _)), text in zip(middles.items(), texts):
                if len(text) >= self.need:
                    starts[i] = a - GUARD
            pending, size = [i for i in pending if starts[i] is None], size * 2
        return starts

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=False) if ids else []

    def holds(self, text: str) -> bool:
        return any(s in text for s in self.strings)


def stop_strings(params, tokenizer) -> StopStrings | None:
    """`generation.stop_strings` read with `tokenizer`, or None when there are none (no text is decoded then)."""
    return StopStrings(params.stop_strings, tokenizer) if params.stop_strings else None
