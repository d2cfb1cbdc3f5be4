"""The demo task: prompts, the VADER gold judge, the Bradley-Terry annotators and the SFT filter."""

import math
import random

import pytest

from rlhfkit.tasks import reviews


def test_prompts_are_seeded_distinct_and_held_out():
    train, held_out = reviews.make_prompts(400, eval_fraction=0.2, seed=0)
    assert (len(train), len(held_out)) == (320, 80)
    assert len(set(train + held_out)) == 400  # one prompt per distinct invented item
    assert reviews.make_prompts(400, seed=0) == (train, held_out)
    assert reviews.make_prompts(400, seed=1) != (train, held_out)
    assert all("one or two sentences" in p or "one- or two-sentence" in p for p in train)


def test_gold_judge_is_vader_compound():
    great, awful = reviews.gold_judge(["p", "p"], ["A wonderful, moving film. I loved it!", "An awful, boring mess."])
    assert 0.5 < great <= 1.0 and -1.0 <= awful < -0.5
    assert reviews.gold_score("") == 0.0 and reviews.gold_score("The lamp is blue.") == 0.0


@pytest.mark.parametrize("gap", [0.0, 0.2, -0.4])
def test_annotators_prefer_with_bradley_terry_probability(gap):
    rng = random.Random(0)
    n = 20000
    rate = sum(reviews.annotate(0.5 + gap, 0.5, rng) for _ in range(n)) / n
    expected = 1 / (1 + math.exp(-gap / reviews.ANNOTATOR_TAU))  # σ(0)=0.5, σ(1)=0.731, σ(-2)=0.119
    assert rate == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize("text, ended, expected", [
    ("Good one. Fine!", True, "Good one. Fine!"),  # ended with EOS after two sentences: kept whole
    ("A good one indeed. Fine! Third one here.", True, "A good one indeed. Fine!"),  # three sentences: cut after the second
    ('I liked "The Wild Mirror." It was great. And then', False, 'I liked "The Wild Mirror." It was great.'),
    ("A lovely lamp for any desk. It glows", False, "A lovely lamp for any desk."),  # cut off: up to the last full sentence
    ("no sentence end at all", True, None),
    ("- a list item.", True, None),
    ("Line one.\nLine two.", True, None),
    ("Ok.", True, "Ok."),
    ("Ok. Then more", False, None),  # what is left after the cut is too short to be a review
    ("", True, None),
])
def test_trim_review(text, ended, expected):
    assert reviews.trim_review(text, ended) == expected


def test_gold_judge_takes_conversational_completions():
    """On chat prompts (the demo's) reward functions get `[{"role": "assistant", "content": ...}]` completions
    (TRL's contract): the gold judge scores their text as it scores the string (it raised on the list)."""
    from rlhfkit.tasks.reviews import gold_judge

    texts = ["What a wonderful, lovely film.", "It was awful and boring."]
    chat = [[{"role": "assistant", "content": t}] for t in texts]
    assert gold_judge([], chat) == gold_judge([], texts)
    assert gold_judge([], texts)[0] > 0 > gold_judge([], texts)[1]
