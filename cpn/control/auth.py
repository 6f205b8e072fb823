"""Bearer-token authentication for the agent service, as a gRPC server interceptor.

Every call to `cpn.v1.AgentService` must carry `authorization: Bearer <token>`; a missing
or unknown token gets UNAUTHENTICATED before the servicer runs. A valid token identifies
one site: the interceptor hands that site to the servicer (through `authenticated_site`),
which answers PERMISSION_DENIED when the request names another site. Health checks and
reflection stay open, as load balancers and grpcurl expect.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio

from cpn.control.tokens import SiteTokens

AGENT_SERVICE_PREFIX = "/cpn.v1.AgentService/"

#: The site the current call's token belongs to; set only inside AgentService calls.
authenticated_site: contextvars.ContextVar[str] = contextvars.ContextVar("cpn_authenticated_site")

if TYPE_CHECKING:  # the stubs' generics do not exist at run time
    Handler = grpc.RpcMethodHandler[Any, Any]
    Context = aio.ServicerContext[Any, Any]


def bearer_token(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class BearerTokenInterceptor(aio.ServerInterceptor):
    def __init__(self, tokens: SiteTokens) -> None:
        self._tokens = tokens
        # Wrapped handlers per (method, site), built once rather than on every call; kept
        # with the handler they wrap so that a different handler is never served stale.
        self._wrapped: dict[tuple[str, str], tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(AGENT_SERVICE_PREFIX):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        site = self._tokens.site_for(token) if token is not None else None
        if site is None:
            reason = (
                "missing bearer token (metadata 'authorization: Bearer <token>')"
                if token is None
                else "invalid token"
            )
            return _deny(handler, reason)
        key = (handler_call_details.method, site)
        cached = self._wrapped.get(key)
        if cached is None or cached[0] is not handler:
            cached = self._wrapped[key] = (handler, _with_site(handler, site))
        return cached[1]


def _with_site(handler: Handler, site: str) -> Handler:
    # The generated servicer's methods are coroutines (unary) and async generators
    # (streams) under grpc.aio, whatever the sync-flavoured stubs say.
    if handler.unary_unary is not None:
        inner: Any = handler.unary_unary

        async def unary(request: Any, context: Context) -> Any:
            token = authenticated_site.set(site)
            try:
                return await inner(request, context)
            finally:
                authenticated_site.reset(token)

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_stream is not None:
        inner_stream: Any = handler.unary_stream

        async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
            authenticated_site.set(site)  # this generator runs in its own task context
            async for item in inner_stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_stream is not None:
        inner_bidi: Any = handler.stream_stream

        async def bidi(requests: Any, context: Context) -> AsyncIterator[Any]:
            authenticated_site.set(site)
            async for item in inner_bidi(requests, context):
                yield item

        return grpc.stream_stream_rpc_method_handler(
            bidi, handler.request_deserializer, handler.response_serializer
        )
    raise TypeError("AgentService has no client-streaming methods")


def _deny(handler: Handler, reason: str) -> Handler:
    async def unary(_request: Any, context: Context) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def stream(_request: Any, context: Context) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # unreachable: abort raises; makes this an async generator

    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(
            stream, handler.request_deserializer, handler.response_serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        unary, handler.request_deserializer, handler.response_serializer
    )
