"""The exception types for bad user input: `UserError` and its kinds.

The CLI catches `UserError`, prints its message on one line and exits with status 2 — no traceback. Raise it for
anything the user can fix (a file, a record, a config key, a model path); let programming errors propagate.
"""


class UserError(Exception):
    """Bad input from the user: the message names the file, record, line or key and what was expected."""


class ConfigError(UserError):
    """A config key is unknown, mistyped or incompatible with another."""


class DataError(UserError):
    """A data file or record is missing, malformed or of the wrong shape."""


def first_line(exc: BaseException, with_type: bool = False) -> str:
    """The first line of an exception's message, cut to 300 characters (prefixed with its type's name when
    `with_type`), or the type's name alone when the message is empty: a third-party error quoted in a one-line message."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return f"{type(exc).__name__}: {lines[0][:300]}" if with_type else lines[0][:300]


class TemplateError(UserError):
    """A chat template cannot render (or its response template cannot parse) what the run needs: tools, tool calls,
    tool results, a turn's end, or a conversation as an extension of its prefix (`templates.support`)."""
