"""User-facing errors.

Anything a user can cause (a bad file, a job that does not fit) raises `CpnError` with a
one-line message that names the field or the shortfall. The CLI prints that line and exits
with status 2; it never shows a traceback for these.
"""


class CpnError(Exception):
    """An error caused by the user's input, reported as one line."""

    exit_code = 2


class InputError(CpnError, ValueError):
    """A file or argument is malformed: the message names the field and the reason."""


class InfeasibleError(CpnError):
    """A job cannot be placed: the message says what it needs and what is free."""
