"""A calculator tool, an exact-answer task judge and format rules for the `rlhfkit eval` agent tests
(`tools.functions: [tests.smoke.agent_eval_tools:calculator]` and friends), importable by name as a user's module is."""


def calculator(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the episode's last assistant message is exactly the record's answer, else 0.0 (TRL's contract: each
    completion is the episode's messages)."""
    last = [[m for m in c if m["role"] == "assistant"][-1]["content"].strip() for c in completions]
    return [float(text == str(a)) for text, a in zip(last, answer)]


def always(completions, **kwargs) -> list[float]:
    """Every episode completes its task (a judge whose share is known: 1.0)."""
    return [1.0] * len(completions)


def accept(message) -> bool:
    """A format rule that accepts every turn the loop found well formed."""
    return True


def reject(message) -> bool:
    """A format rule that accepts no turn."""
    return False
