"""Every Phalanx server's first check: a request that does not decode, or is larger than MAX_REQUEST_BYTES,
is refused with INVALID_ARGUMENT and a message that says which, before any handler sees it.

gRPC's own answer to an undecodable request is UNKNOWN ("Unexpected DecodeError"), which reads like a
server bug, and its size limit (MAX_TRANSPORT_BYTES, RESOURCE_EXHAUSTED) is a backstop far above what any
request needs. Unary requests are checked here and never reach the handler. A streamed request's
messages are read by the handler, so a bad one raises BadRequest where the handler reads it; a handler
that does not catch it still ends the call with INVALID_ARGUMENT.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from phalanx.errors import BadRequest
from phalanx.rpc import MAX_REQUEST_BYTES

Deserializer = Callable[[bytes], Any] | None


def _type_name(deserializer: Deserializer, method: str) -> tuple[str, str]:
    """(short, full) name of the request type a deserializer makes; the method path where unknown."""
    descriptor = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    if descriptor is None:
        return method, method
    return descriptor.name, descriptor.full_name


def checked(deserializer: Deserializer, method: str) -> Callable[[bytes], Any]:
    """`deserializer`, refusing (BadRequest) a message over MAX_REQUEST_BYTES or one that does not decode."""
    short, full = _type_name(deserializer, method)

    def decode(raw: bytes) -> Any:
        if len(raw) > MAX_REQUEST_BYTES:
            raise BadRequest(f"{short} is {len(raw)} bytes; the limit is {MAX_REQUEST_BYTES}")
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, TypeError) as e:  # upb raises DecodeError; keep any other parser honest
            why = str(e).rpartition("': ")[2] or type(e).__name__  # upb: "Error parsing message with type 'T': why"
            raise BadRequest(f"cannot decode the request as {full}: {why}; are client and server built from "
                             "the same .proto files?") from None

    return decode


def _unary_request(behavior: Callable, decode: Callable[[bytes], Any]) -> Callable:
    """A handler taking the raw request: decode it (or refuse it), then call `behavior` with the message."""
    if inspect.isasyncgenfunction(behavior):
        async def stream_out(raw: bytes, context: grpc.aio.ServicerContext):
            try:
                request = decode(raw)
            except BadRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            async for response in behavior(request, context):
                yield response
        return stream_out

    async def unary_out(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = decode(raw)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result
    return unary_out


def _stream_request(behavior: Callable) -> Callable:
    """A streamed-request handler whose uncaught BadRequest ends the call with INVALID_ARGUMENT."""
    if inspect.isasyncgenfunction(behavior):
        async def stream_out(requests: Any, context: grpc.aio.ServicerContext):
            try:
                async for response in behavior(requests, context):
                    yield response
            except BadRequest as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return stream_out

    async def unary_out(requests: Any, context: grpc.aio.ServicerContext):
        try:
            result = behavior(requests, context)
            return await result if inspect.isawaitable(result) else result
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    return unary_out


_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def handler_parts(handler: grpc.RpcMethodHandler) -> tuple[str, Callable, Callable]:
    """(kind, behaviour, factory) of a method handler: kind is "unary_unary" ... "stream_stream", factory the
    grpc.*_rpc_method_handler that builds a handler of that kind. For interceptors that wrap behaviours."""
    for kind, factory in _FACTORIES.items():
        if (behaviour := getattr(handler, kind)) is not None:
            return kind, behaviour, factory
    raise ValueError(f"a method handler with no behaviour: {handler!r}")


class RequestGuard(grpc.aio.ServerInterceptor):
    """Put first in every server's interceptors (after authentication, which must not decode anything)."""

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # UNIMPLEMENTED: gRPC says so itself
        decode = checked(handler.request_deserializer, handler_call_details.method)
        serialize = handler.response_serializer
        kind, behaviour, factory = handler_parts(handler)
        if kind.startswith("unary_"):  # the request arrives raw and is decoded (or refused) in the wrapper
            return factory(_unary_request(behaviour, decode), response_serializer=serialize)
        return factory(_stream_request(behaviour), request_deserializer=decode, response_serializer=serialize)
