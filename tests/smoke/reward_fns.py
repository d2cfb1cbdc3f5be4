"""Reward functions for the CLI tests, loaded as `tests.smoke.reward_fns:NAME` (the tests run from the repository
root, which is importable while a reward function loads)."""

CALLS: list[dict] = []  # one entry per call of `record`


def record(prompts, completions, **kwargs):
    """Records what it was given; scores 0."""
    CALLS.append({"prompts": list(prompts), "n": len(completions), "kwargs": {k: list(v) for k, v in kwargs.items()}})
    return [0.0] * len(completions)


def zeros(prompts, completions):
    return [0.0] * len(completions)


def returns_none(prompts, completions):
    return None


def one_too_few(prompts, completions):
    return [0.0] * (len(completions) - 1)


def raises(prompts, completions):
    raise KeyError("answer")
