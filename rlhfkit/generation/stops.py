"""Stop strings (`generation.stop_strings`, transformers' and TRL's `stop_strings`): which rows' turns have just
ended at one.

A turn ends at the first token t at which a stop string occurs in `tokenizer.decode(turn[:t])` (special tokens
included, so a string may name one): a string may span tokens, and a token may run past the string's end (token
"stopped" completes "stop"); t is the turn's last token, kept as an EOS is, and nothing after it is sampled. Only the
turn's own text is read, never the prompt or an earlier turn: a string the prompt ends with half-written does not end
the response at its first token. (transformers' `StopStringCriteria` reads the prompt's tokens too.)
"""

from __future__ import annotations


class StopStrings:
    """The run's stop strings and the tokenizer that turns a turn's tokens into the text they are looked for in."""

    def __init__(self, strings, tokenizer):
        self.strings, self.tokenizer = tuple(strings), tokenizer

    def ended(self, turns: list[list[int]]) -> list[bool]:
        """For each turn (its tokens so far, the newest last), whether its text now holds a stop string. The engine
        asks after every token of a live row, so the first True is at the token that completes the string."""
        texts = self.tokenizer.batch_decode(turns, skip_special_tokens=False) if turns else []
        return [any(s in text for s in self.strings) for text in texts]


def stop_strings(params, tokenizer) -> StopStrings | None:
    """`generation.stop_strings` read with `tokenizer`, or None when there are none (no text is decoded then)."""
    return StopStrings(params.stop_strings, tokenizer) if params.stop_strings else None
