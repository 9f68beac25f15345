"""How controller errors become gRPC statuses: each domain error has its own code."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from controller.errors import (
    AlreadyInSession,
    ControllerError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    StoreError,
    Unavailable,
    details,
)
from controller.validation import request_size
from phalanx import log
from phalanx.errors import BadRequest, PhalanxError

logger = log.get("rpc")

_CODES: list[tuple[type[PhalanxError], grpc.StatusCode]] = [
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),  # a streamed message that does not decode (request_guard)
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyInSession, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (StoreError, grpc.StatusCode.UNAVAILABLE),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]

R = TypeVar("R")



def status_for(error: PhalanxError) -> grpc.StatusCode:
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def unary(method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]):
    """Wrap a unary servicer method: size check, then domain errors to their status codes."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            request_size(request)
            return await method(self, request, context)
        except ControllerError as e:
            await context.abort(status_for(e), details(str(e)))
        except Exception as e:  # a bug: say so, keep serving
            logger.exception("rpc failed", method=method.__name__, peer=context.peer())
            await context.abort(grpc.StatusCode.INTERNAL, details(f"internal error in {method.__name__}: "
                                f"{type(e).__name__}: {e} (see the controller log)"))
        raise AssertionError("unreachable: abort raises")

    return wrapper
