"""The demo task: short reviews of invented items, judged by VADER sentiment (`rlhfkit demo`).

Prompts ask for a one- or two-sentence review of a film, book or product whose name is generated (seeded) from
syllable and word lists, so the model has never seen it and must write from the prompt alone. The gold judge is
VADER's compound score of the response (Hutto & Gilbert 2014, "VADER: A Parsimonious Rule-based Model for Sentiment
Analysis of Social Media Text"), in [-1, 1]: the task rewards warm, positive reviews.

Simulated annotators compare two responses with Bradley-Terry noise on the gold scores:
    P(a preferred over b) = σ((g_a - g_b) / τ),  τ = ANNOTATOR_TAU = 0.2.
With compound scores in [-1, 1], τ = 0.2 makes a gap of 0.2 (e.g. "nice" vs neutral) a 73% / 27% call, a gap of 0.5
a 92% call, and equal scores a coin flip: noisy enough that the reward model must average over labels, clean enough
that 100-200 pairs teach it the gold order.
"""

from __future__ import annotations

import math
import random
import re

ANNOTATOR_TAU = 0.2  # Bradley-Terry temperature of the simulated annotators (gold-score units)

SYLLABLES = ["ka", "lo", "mi", "ren", "to", "sa", "vi", "nu", "pe", "dor", "ri", "ma", "bel", "an", "zu", "qui", "tha", "os"]
NOUNS = ["river", "garden", "winter", "harbor", "lantern", "orchard", "mirror", "signal", "meadow", "engine", "comet", "island"]
ADJECTIVES = ["silent", "golden", "last", "hidden", "northern", "broken", "little", "endless", "quiet", "secret", "wild", "distant"]
PRODUCTS = ["coffee maker", "backpack", "desk lamp", "pair of headphones", "water bottle", "blender", "keyboard",
            "umbrella", "office chair", "phone case", "toaster", "pair of running shoes"]
TEMPLATES = [
    "Write a one- or two-sentence review of the {kind} {name}.",
    "In one or two sentences, review the {kind} {name}.",
    "Give a short review (one or two sentences) of the {kind} {name}.",
]

_analyzer = None


def _brand(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _item(rng: random.Random) -> tuple[str, str]:
    """(kind, name) of one invented film, book or product."""
    kind = rng.choice(["film", "book", "product"])
    if kind == "product":
        return rng.choice(PRODUCTS), f"\"{_brand(rng)}\""
    title = f"The {rng.choice(ADJECTIVES).capitalize()} {rng.choice(NOUNS).capitalize()}"
    if rng.random() < 0.5:
        title = f"{_brand(rng)}'s {rng.choice(NOUNS).capitalize()}"
    return ("novel" if kind == "book" and rng.random() < 0.5 else kind), f"\"{title}\""


def make_prompts(num_items: int = 400, eval_fraction: float = 0.2, seed: int = 0) -> tuple[list[str], list[str]]:
    """(train prompts, held-out eval prompts): `num_items` distinct invented items, the last `eval_fraction` held out."""
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    while len(prompts) < num_items:
        kind, name = _item(rng)
        if name in seen:
            continue
        seen.add(name)
        prompts.append(rng.choice(TEMPLATES).format(kind=kind, name=name))
    n_eval = max(1, round(eval_fraction * num_items))
    return prompts[:-n_eval], prompts[-n_eval:]


def gold_score(text: str) -> float:
    """VADER compound sentiment of `text`, in [-1, 1] (0 for an empty text)."""
    global _analyzer
    if _analyzer is None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        _analyzer = SentimentIntensityAnalyzer()
    return float(_analyzer.polarity_scores(text)["compound"]) if text.strip() else 0.0


def gold_judge(prompts: list, completions: list) -> list[float]:
    """The gold judge as a reward function under TRL's contract (`reward.function` / `reward.gold_function:
    rlhfkit.tasks.reviews:gold_judge`): completions are texts, or `[{"role": "assistant", "content": ...}]` lists on
    conversational prompts, as the demo's are."""
    from rlhfkit.reward_functions import completion_text

    return [gold_score(completion_text(c)) for c in completions]


def annotate(gold_a: float, gold_b: float, rng: random.Random, tau: float = ANNOTATOR_TAU) -> bool:
    """A simulated annotator's label: True when a is preferred, drawn with P = σ((g_a - g_b) / τ)."""
    return rng.random() < 1.0 / (1.0 + math.exp(-(gold_a - gold_b) / tau))


_SENTENCE_END = re.compile(r"[.!?]+[\"')]*(?=\s|$)")  # end punctuation, closing quotes/brackets, then space or end


def trim_review(text: str, ended: bool) -> str | None:
    """The review cut to at most two sentences, or None when it is not a usable 1-2 sentence answer.

    A response that ended with EOS is kept if it has one or two sentences; a longer or cut-off one is kept up to
    the end of its second sentence. Lists, headings and multi-line answers are rejected (not the taught format).
    """
    text = text.strip()
    if not text or "\n" in text or text.startswith(("#", "-", "*")):
        return None
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    if not ends:
        return None
    if ended and len(ends) <= 2 and ends[-1] == len(text):
        return text
    cut = text[: ends[min(1, len(ends) - 1)]].strip()
    return cut if len(cut.split()) >= 4 else None
