"""Request deserializers that never raise.

gRPC calls a method's deserializer on the raw request bytes before any handler code runs;
when it raises (invalid UTF-8 in a `string` field, a truncated message, a wrong wire type,
nesting too deep), grpc answers UNKNOWN and logs an "unexpected" exception — the client
learns nothing and a retrying client retries forever. A lenient deserializer returns an
`Undecodable` marker instead, which the server's handler turns into INVALID_ARGUMENT.

    handler = grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=lenient(pb.RegisterRequest)
    )
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that are not a valid encoding of `message_type`."""

    message_type: str
    size: int

    @property
    def reason(self) -> str:
        # upb says only "Error parsing message"; name the likely causes instead.
        return (
            f"request: {self.size} bytes that do not decode as {self.message_type} "
            "(invalid UTF-8 in a string field, a truncated message or a wrong wire type)"
        )


def lenient(message_class: type[M]) -> Callable[[bytes], M | Undecodable]:
    """A deserializer for `message_class` that returns `Undecodable` instead of raising."""
    name = message_class.DESCRIPTOR.full_name
    parse = message_class.FromString

    def deserialize(data: bytes) -> M | Undecodable:
        try:
            return parse(data)
        except (DecodeError, RuntimeError, ValueError):
            # RuntimeError/ValueError: the pure-Python and C++ protobuf backends' ways of
            # refusing what upb refuses with DecodeError (recursion depth, bad UTF-8).
            return Undecodable(name, len(data))

    return deserialize


__all__ = ["Undecodable", "lenient"]
