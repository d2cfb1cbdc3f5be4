"""Reward functions for the CLI tests, loaded as `tests.smoke.reward_fns:NAME` (the tests run from the repository
root, which is importable while a reward function loads)."""

import asyncio

CALLS: list[dict] = []  # one entry per call of `record`
STEPS: list[int] = []  # trainer_state.global_step at each call of `by_step`


def record(prompts, completions, **kwargs):
    """Records what it was given (of trainer_state, its global_step); scores 0."""
    state = kwargs.pop("trainer_state", None)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("log_metric", "log_extra")}  # TRL's logging hooks
    CALLS.append({"prompts": list(prompts), "n": len(completions), "kwargs": {k: list(v) for k, v in kwargs.items()},
                  "global_step": getattr(state, "global_step", None)})
    return [0.0] * len(completions)


def zeros(prompts, completions):
    return [0.0] * len(completions)


def returns_none(prompts, completions):
    return None


def one_too_few(prompts, completions):
    return [0.0] * (len(completions) - 1)


def raises(prompts, completions):
    raise KeyError("answer")


# TRL-shaped functions (issue 19): each is called with keywords only --------------------------------------------


def completions_only(completions, **kwargs):
    return [float(len(c)) for c in completions]


def with_answer(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def keyword_only(*, prompts, completions):
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]


def none_for_some(completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def always_none(completions, **kwargs):
    return [None] * len(completions)


async def awaited(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c) > 3) for c in completions]


def by_step(completions, trainer_state, **kwargs):
    STEPS.append(trainer_state.global_step)
    return [0.0] * len(completions)


def vowels_or_none(completions, **kwargs):
    """The number of vowels; None (does not apply) for a completion without any."""
    counts = [sum(ch in "aeiou" for ch in c) for c in completions]
    return [float(n) if n else None for n in counts]


def logs_things(completions, log_metric, log_extra, **kwargs):
    """TRL 1.16's logging hooks: a scalar metric per call and a column for the completions table."""
    has_a = ["a" in c for c in completions]
    log_metric("share_with_a", sum(has_a) / len(has_a))
    log_extra("has_a", has_a)
    return [float(x) for x in has_a]


def half_flat(prompts, completions, **kwargs):
    """1.0 for every completion of a prompt of even length (a group without signal: DAPO's dynamic sampling drops it),
    the completion's vowel share otherwise."""
    return [1.0 if len(str(p)) % 2 == 0 else sum(ch in "aeiou" for ch in c) / max(len(c), 1)
            for p, c in zip(prompts, completions)]


def holds_a_vowel(completions, **kwargs):
    """A synthetic red-team judge: a response is "harmful" when it holds a vowel (a tiny model writes one in some of
    its responses, so the harmful rates and the paired changes are not all zero)."""
    return [any(v in c for v in "aeiou") for c in completions]
