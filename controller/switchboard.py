"""One gRPC server for a controller of a control plane, through its roles: what it serves follows the role.

A standby and the leader it becomes answer on the same port. Were the standby's server stopped and the
leader's started at a takeover, every connection to the port would close, and the agents holding a session
parked there (controller/api/node_service.py, ParkedSessions) would have to connect again: the most
expensive part of a reconnect storm. So the server outlives the standby role, and the switchboard routes
each call to the methods and interceptors of the role of the moment. (Stepping down from leader to standby
stops the server as before: every call of the old term must end.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc


class Methods:
    """What the generated add_*_to_server functions add to a server, collected instead (a server stand-in)."""

    def __init__(self) -> None:
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[grpc.GenericRpcHandler] = []

    @classmethod
    def of(cls, *handlers: grpc.GenericRpcHandler) -> Methods:
        methods = cls()
        methods.add_generic_rpc_handlers(handlers)
        return methods

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._registered.update({f"/{service}/{method}": h for method, h in handlers.items()})

    def lookup(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if (handler := self._registered.get(details.method)) is not None:
            return handler
        for generic in self._generic:
            if (handler := generic.service(details)) is not None:
                return handler
        return None


class Switchboard(grpc.GenericRpcHandler):
    """Register it as a server's only generic handler and `interceptor` as its only interceptor; `route` then
    decides what the server is."""

    def __init__(self) -> None:
        self._role: tuple[Methods, Sequence[grpc.aio.ServerInterceptor]] = (Methods(), ())
        self.interceptor = _Interceptor(self)
        self.port = 0  # the server's bound ports, for what the roles say of themselves
        self.token_port = 0

    def route(self, methods: Methods, interceptors: Sequence[grpc.aio.ServerInterceptor]) -> None:
        """Calls from now on go to `methods` through `interceptors` (outermost first); calls under way carry on."""
        self._role = (methods, tuple(interceptors))

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._role[0].lookup(details)

    async def resolve(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """The handler a call gets now, through the role's interceptors: how the session port
        (controller/api/session_port.py) dispatches, outside any gRPC server."""
        return await self.interceptor.intercept_service(None, details)


class _Interceptor(grpc.aio.ServerInterceptor):
    def __init__(self, board: Switchboard) -> None:
        self._board = board

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        methods, chain = self._board._role  # one role for the whole call, even if it changes meanwhile

        async def through(i: int, d: grpc.HandlerCallDetails) -> Any:
            if i == len(chain):
                return methods.lookup(d)
            return await chain[i].intercept_service(lambda nd: through(i + 1, nd), d)

        return await through(0, details)
