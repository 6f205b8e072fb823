"""How the agent service's methods are bound to the gRPC server.

The generated `add_AgentServiceServicer_to_server` uses each message's `FromString`, which
raises on bytes that do not decode, and grpc then answers UNKNOWN. Here every method gets
a lenient deserializer (`proto.decoding.lenient`) and a wrapper that

- answers INVALID_ARGUMENT for a request that does not decode (for HeartbeatStream: the
  first message that does not decode ends the stream with it), before the servicer runs;
- turns any exception the servicer did not expect into INTERNAL with a short, fixed
  message (the traceback goes to the log), never UNKNOWN with the exception's text —
  which may quote a whole request;
- clips every status details to `MAX_DETAILS_BYTES`;
- leaves grpc's own errors about the call (an abort, a send on a call whose peer has
  gone) to grpc: an agent whose link was cut makes the servicer's answer fail with
  `ExecuteBatchError`, which grpc drops quietly when the client has closed — wrapping it
  as INTERNAL aborted a dead call twice and logged two tracebacks.

The methods come from the service descriptor, so a method added to the .proto is bound
here without a change (a client-streaming one would fail loudly: none exists).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc import aio

from cpn.control.errors import clip_details
from proto.cpn.v1 import agent_pb2
from proto.decoding import Undecodable, lenient

log = logging.getLogger("cpn.control")
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
INTERNAL_DETAILS = "internal error in the control plane (logged there); not retryable as is"

if TYPE_CHECKING:
    Context = aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]


async def abort(context: Context, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the call with `code`; the details clipped to MAX_DETAILS_BYTES."""
    await context.abort(code, clip_details(details))
    raise AssertionError("unreachable: context.abort raises")


async def _unexpected(context: Context, method: str, exc: Exception) -> NoReturn:
    log.error("%s failed unexpectedly", method, exc_info=exc)
    await abort(context, grpc.StatusCode.INTERNAL, INTERNAL_DETAILS)


def _unary(method: str, behaviour: Any) -> Any:
    async def call(request: Any, context: Context) -> Any:
        if isinstance(request, Undecodable):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            return await behaviour(request, context)
        except (aio.AbortError, aio.InternalError):
            raise
        except Exception as exc:
            await _unexpected(context, method, exc)

    return call


def _server_stream(method: str, behaviour: Any) -> Any:
    async def call(request: Any, context: Context) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        try:
            async for item in behaviour(request, context):
                yield item
        except (aio.AbortError, aio.InternalError):
            raise
        except Exception as exc:
            await _unexpected(context, method, exc)

    return call


def _bidi_stream(method: str, behaviour: Any) -> Any:
    async def call(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        async def decoded() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Undecodable):
                    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                yield request

        try:
            async for item in behaviour(decoded(), context):
                yield item
        except (aio.AbortError, aio.InternalError):
            raise
        except Exception as exc:
            await _unexpected(context, method, exc)

    return call


def _message_class(descriptor: Any) -> Any:
    cls = getattr(agent_pb2, descriptor.name)
    assert cls.DESCRIPTOR.full_name == descriptor.full_name, descriptor.full_name
    return cls


def method_handlers(servicer: object) -> dict[str, Handler]:
    """One handler per method of cpn.v1.AgentService, bound to `servicer`."""
    handlers: dict[str, Handler] = {}
    method: MethodDescriptor
    for method in SERVICE.methods:
        behaviour = getattr(servicer, method.name)
        deserialize = lenient(_message_class(method.input_type))
        serialize: Callable[[Any], bytes] = _message_class(method.output_type).SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidi_stream(method.name, behaviour), deserialize, serialize
            )
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _server_stream(method.name, behaviour), deserialize, serialize
            )
        elif method.client_streaming:
            raise TypeError(f"{method.full_name}: client-streaming methods are not bound here")
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(method.name, behaviour), deserialize, serialize
            )
    return handlers


def add_agent_service(servicer: object, server: aio.Server) -> None:
    """Serve cpn.v1.AgentService from `servicer` (in place of the generated function)."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


__all__ = ["INTERNAL_DETAILS", "abort", "add_agent_service", "method_handlers"]
