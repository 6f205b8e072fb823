"""Errors the control server turns into gRPC statuses, and how their details are written.

Status details go back in an HTTP/2 trailer: a default gRPC client refuses a trailer much
larger than 8 KB (and reports RESOURCE_EXHAUSTED instead of the real status), and logs
and terminals should not receive a client's megabyte or its escape sequences. So a detail
names the field and the rule, quotes at most `QUOTE_CHARS` characters of the value (as a
Python literal, control characters escaped), and is clipped to `MAX_DETAILS_BYTES`.
"""

from __future__ import annotations

#: Longest status details the control server sends, in UTF-8 bytes.
MAX_DETAILS_BYTES = 1024
#: Characters of a rejected value quoted in a message.
QUOTE_CHARS = 32


def quote(value: str) -> str:
    """`value` for an error message: its start as a literal, and its length if cut."""
    if len(value) <= QUOTE_CHARS:
        return repr(value)
    return f"{value[:QUOTE_CHARS]!r}… ({len(value)} characters)"


def clip_details(details: str) -> str:
    """`details` cut to at most MAX_DETAILS_BYTES bytes of UTF-8, marked when cut."""
    data = details.encode("utf-8", "backslashreplace")
    if len(data) <= MAX_DETAILS_BYTES:
        return details
    marker = "… (cut)"
    room = MAX_DETAILS_BYTES - len(marker.encode())
    return data[:room].decode("utf-8", "ignore") + marker


class InvalidField(ValueError):
    """A request field is malformed: becomes INVALID_ARGUMENT, the field named."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
