"""The wrappers that bind the agent service to grpc leave grpc's own errors about a call
to grpc. A site whose link is cut mid-answer makes the servicer's `context.abort` fail to
send (`ExecuteBatchError`: the peer has gone); wrapped as an unexpected error it was logged
with two tracebacks and aborted a second time ("Abort already called!"), seen in CI.

The failing send is a race with the network that no real client here produces on demand,
so the call's context is the smallest stand-in that fails as grpc's does."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from cpn.control.handlers import method_handlers
from proto.cpn.v1 import agent_pb2 as pb
from proto.cpn.v1 import agent_pb2_grpc

#: grpc's Cython core, where the error of a failed send is defined (no stubs for it).
cygrpc: Any = importlib.import_module("grpc._cython.cygrpc")


class _GoneCall:
    """A call whose peer has gone: every status it sends fails, as grpc's does then."""

    def __init__(self) -> None:
        self.aborts = 0

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborts += 1
        raise cygrpc.ExecuteBatchError('Failed "execute_batch"')


class _Refusing(agent_pb2_grpc.AgentServiceServicer):
    """Refuses every heartbeat (an unknown lease), as the real servicer does."""

    async def Heartbeat(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.NOT_FOUND, "lease_id: unknown lease")

    async def HeartbeatStream(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        async for _ in requests:
            await context.abort(grpc.StatusCode.NOT_FOUND, "lease_id: unknown lease")
        yield pb.HeartbeatResponse()


async def _one(request: Any) -> AsyncIterator[Any]:
    yield request


def test_a_refusal_the_peer_never_gets_is_left_to_grpc(caplog: pytest.LogCaptureFixture) -> None:
    handlers: dict[str, Any] = dict(method_handlers(_Refusing()))  # type: ignore[abstract]
    beat = pb.HeartbeatRequest(site="a")

    async def stream(context: _GoneCall) -> None:
        async for _ in handlers["HeartbeatStream"].stream_stream(_one(beat), context):
            pass

    for call in (
        lambda context: handlers["Heartbeat"].unary_unary(beat, context),
        stream,
    ):
        context = _GoneCall()
        with (
            caplog.at_level(logging.INFO, logger="cpn.control"),
            pytest.raises(cygrpc.ExecuteBatchError),
        ):
            asyncio.run(call(context))
        assert context.aborts == 1, "aborted once, not again as an internal error"
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
