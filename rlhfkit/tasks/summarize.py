"""Reward functions for summarisation in TRL's style (`configs/grpo_smollm2.yaml`, on trl-lib/tldr): a format reward
and a length-aware quality reward, combined with `reward.weights`.

Both follow TRL's reward contract (`rlhfkit.reward_functions`): called with keywords, they take the completions as
strings or, on conversational data, as `[{"role": "assistant", "content": text}]`, and ignore what else they are
given. Neither needs a model, so they are cheap, and both are crude: they score the surface of a summary, not whether
it is right. Use them as a starting point, or next to a reward model (`reward.model`).
"""

from __future__ import annotations

import re

from rlhfkit.reward_functions import completion_text

_WORD = re.compile(r"[A-Za-z0-9']+")


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 for a completion shaped like a summary, else 0.0: one non-empty paragraph (no blank line) that ends a
    sentence (with ".", "!" or "?")."""
    out = []
    for completion in completions:
        text = completion_text(completion).strip()
        out.append(float(bool(text) and "\n\n" not in text and text[-1] in ".!?"))
    return out


def length_penalised_quality(prompts: list, completions: list, target_words: int = 30, **kwargs) -> list[float | None]:
    """How much of the summary is grounded in the post, less a penalty for running past `target_words` words.

    Quality is the fraction of the summary's distinct words (3 letters or more) that also occur in the prompt, in
    [0, 1]: a summary that invents nothing scores 1. The penalty is the number of words past `target_words`,
    divided by `target_words` (so a summary twice the target loses 1). An empty summary scores 0; None (the row is
    not scored) for a prompt with no words to check against.
    """
    out: list[float | None] = []
    for prompt, completion in zip(prompts, completions):
        source = set(_words(prompt if isinstance(prompt, str) else completion_text(prompt)))
        words = _words(completion_text(completion))
        if not source:
            out.append(None)
            continue
        content = {w for w in words if len(w) >= 3}
        quality = sum(w in source for w in content) / len(content) if content else 0.0
        out.append(quality - max(0, len(words) - target_words) / target_words)
    return out
