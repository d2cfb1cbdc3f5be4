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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, cut to 300 characters, or its type's name when the message is empty:
    a third-party error quoted inside a one-line message."""
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else type(exc).__name__
