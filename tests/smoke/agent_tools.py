"""Tools, an environment and a reward for the agent smoke tests (`tools.functions: [agent_tools:add]` and friends):
importable by name from the tests' working directory, as a user's own module is from theirs."""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: x
        b: y
    """
    return a + b


def fail(x: int) -> int:
    """Fail.

    Args:
        x: x
    """
    raise ValueError("boom")


def inc(n: int) -> int:
    """Increment.

    Args:
        n: x
    """
    return n + 1


def recording(ran: list):
    """A tool `note(x)` that appends each x it is called with to `ran`: what ran, for tests that nothing did."""

    def note(x: int) -> int:
        """Note a number.

        Args:
            x: a number
        """
        ran.append(x)
        return x

    return note


class Tally:
    """An environment: reset with the row's `start`, a tool that counts, a reward that reads the count."""

    def __init__(self):
        self.count = 0

    def reset(self, start: int = 0, **row) -> str:
        self.count = start
        return f" (tally {start})"

    def bump(self, by: int) -> int:
        """Add to the tally.

        Args:
            by: x
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def completion_turns(completions, **kwargs) -> list[float]:
    """A reward under TRL's contract that reads the episodes: the number of messages in each completion."""
    return [float(len(c)) for c in completions]


def undocumented(a: int) -> int:
    return a
