"""Hypothesis strategies for protobuf messages that are legal on the wire but hostile.

`near(base)` starts from a valid message and replaces some of its fields, recursively,
with values from the edges of each protobuf type — integers at 0, ±1, the 32- and 64-bit
limits and around the current time in milliseconds; doubles including NaN, ±inf and
subnormals; strings empty, huge, with NUL, control, format or non-ASCII characters; enum
values that are unset, unknown or negative; repeated fields emptied or filled with
near-valid copies. Starting near a valid message matters: a wholly random message fails
at its first field and tests nothing behind it.

`undecodable(base)` gives bytes that do not decode as `base`'s type, or might not: a
truncated encoding, a string field holding invalid UTF-8, a flipped byte, random bytes.

Written here rather than taken from a library: hypothesis-protobuf and its kin generate
from scratch (no near-valid mode) and are unmaintained for protobuf 5+.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, TypeVar

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

M = TypeVar("M", bound=Message)
F = FieldDescriptor

NOW_MS = int(time.time() * 1000)
_TIMES_MS = [
    NOW_MS,
    NOW_MS + 3_600_000,
    NOW_MS - 3 * 86_400_000,
    253_402_300_800_000,
]  # …year 10000
_INT_EDGES: dict[int, tuple[list[int], int, int]] = {
    F.TYPE_INT32: ([0, 1, -1, 2**31 - 1, -(2**31)], -(2**31), 2**31 - 1),
    F.TYPE_UINT32: ([0, 1, 7, 254, 255, 2**31 - 1, 2**31, 2**32 - 1], 0, 2**32 - 1),
    F.TYPE_INT64: (
        [0, -1, 2**31, 2**53, 2**62, 2**63 - 1, -(2**63), *_TIMES_MS],
        -(2**63),
        2**63 - 1,
    ),
    F.TYPE_UINT64: ([0, 1, 2**31, 2**53, 2**63 - 1, 2**63, 2**64 - 1], 0, 2**64 - 1),
}
_STRINGS = st.one_of(
    st.sampled_from(
        [
            "", "a", "b", "c", "zz", "n0", "n1", "job-1", "mlx5_0", "A100",
            "\0", "a\0", "n0\n", " a", "a b", "\x1b[2J", "\u202e", "é" * 40, "x" * 65,
            "x" * 129, "x" * 5000, "x" * 300_000, "127.0.0.1:9", "[::1]:80", "host:0",
            "host:99999", "[fe80::1%eth0]:1", "h:\u0661", "a:b:c", "-a.b:1",
        ]
    ),
    st.text(max_size=70),
)  # fmt: skip
_DOUBLES = st.one_of(
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.0000001, -1.0, 1e5, 1e6, 1e308, 5e-324]),
    st.floats(allow_nan=True, allow_infinity=True),
)
_ENUMS = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 99, -1, 2**31 - 1, -(2**31)])


def scalars(field: Any) -> st.SearchStrategy[Any]:
    if field.type in _INT_EDGES:
        edges, lo, hi = _INT_EDGES[field.type]
        return st.one_of(st.sampled_from(edges), st.integers(lo, hi))
    if field.type == F.TYPE_DOUBLE:
        return _DOUBLES
    if field.type == F.TYPE_STRING:
        return _STRINGS
    if field.type == F.TYPE_BOOL:
        return st.booleans()
    if field.type == F.TYPE_ENUM:
        return _ENUMS
    raise NotImplementedError(f"{field.full_name}: no strategy for field type {field.type}")


def near(base: M, depth: int = 0) -> st.SearchStrategy[M]:
    """`base` with some fields (recursively) replaced by values from the edges."""

    @st.composite
    def build(draw: st.DrawFn) -> M:
        msg = type(base)()
        msg.CopyFrom(base)
        for field in base.DESCRIPTOR.fields:
            if draw(st.integers(0, 3)) != 0:  # most fields stay as in the valid base
                continue
            _mutate(draw, msg, field, depth)
        return msg

    return build()


def _mutate(draw: st.DrawFn, msg: Message, field: Any, depth: int) -> None:
    name = field.name
    if field.is_repeated:
        container: Any = getattr(msg, name)
        if field.type == F.TYPE_MESSAGE:
            bases = list(container) or [GetMessageClass(field.message_type)()]
            count = draw(st.integers(0, 3 if depth < 2 else 1))
            items = [draw(near(draw(st.sampled_from(bases)), depth + 1)) for _ in range(count)]
        else:
            items = draw(st.lists(scalars(field), max_size=3))
        del container[:]
        container.extend(items)
        return
    if field.type == F.TYPE_MESSAGE:
        if draw(st.booleans()) or depth >= 3:
            msg.ClearField(name)
        else:
            getattr(msg, name).CopyFrom(draw(near(getattr(msg, name), depth + 1)))
        return
    if field.has_presence and draw(st.booleans()):
        msg.ClearField(name)
        return
    value = draw(scalars(field))
    # A value protobuf cannot represent at all (a lone surrogate): keep the old one.
    with contextlib.suppress(ValueError, TypeError, UnicodeEncodeError):
        setattr(msg, name, value)


def _with_invalid_utf8(base: Message) -> st.SearchStrategy[bytes]:
    strings = [f for f in base.DESCRIPTOR.fields if f.type == F.TYPE_STRING and not f.is_repeated]
    if not strings:
        return st.just(b"\xff")

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        field = draw(st.sampled_from(strings))
        bad = draw(st.sampled_from([b"\xff", b"\xc0\x80", b"a\xed\xa0\x80", b"\xf4\x90\x80\x80"]))
        key = (field.number << 3) | 2  # length-delimited; numbers here are < 16: one byte
        extra = bytes([key, len(bad)]) + bad
        encoded = base.SerializeToString()
        return draw(st.sampled_from([extra + encoded, encoded + extra]))

    return build()


def undecodable(base: Message) -> st.SearchStrategy[bytes]:
    """Bytes that (mostly) do not decode as `base`'s message type."""
    encoded = base.SerializeToString()

    @st.composite
    def truncated(draw: st.DrawFn) -> bytes:
        return encoded[: draw(st.integers(0, max(len(encoded) - 1, 0)))]

    @st.composite
    def flipped(draw: st.DrawFn) -> bytes:
        if not encoded:
            return b"\x80"
        i = draw(st.integers(0, len(encoded) - 1))
        return encoded[:i] + bytes([encoded[i] ^ draw(st.integers(1, 255))]) + encoded[i + 1 :]

    return st.one_of(_with_invalid_utf8(base), truncated(), flipped(), st.binary(max_size=64))


__all__ = ["NOW_MS", "near", "scalars", "undecodable"]
