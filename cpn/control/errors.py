"""Errors the control server turns into gRPC statuses."""

from __future__ import annotations


class InvalidField(ValueError):
    """A request field is malformed: becomes INVALID_ARGUMENT, the field named."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason
