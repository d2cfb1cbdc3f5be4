"""The one exception type for bad user input.

The CLI catches `UserError`, prints its message on one line and exits with status 2 — no traceback. Raise it for
anything the user can fix (a file, a record, a config key, a model path); let programming errors propagate.
"""


class UserError(Exception):
    """Bad input from the user: the message names the file, record, line or key and what was expected."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or incompatible with another."""


class DataError(UserError):
    """A data file or record is missing, malformed or of the wrong shape."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """`ExceptionType: the first line of its message` (at most `limit` characters of it), for a one-line report."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:limit]}" if text else type(exc).__name__
