"""A process busy with gRPC, as the agent is: a grpc.aio server and clients calling it without pause, on an event
loop in a thread of the test's own process. What the agent starts from such a process must start whole: Python
code run between fork and exec there (a `preexec_fn`) runs gRPC's fork handlers in the child, which then crashes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


@contextlib.contextmanager
def busy_grpc(clients: int = 4) -> Iterator[None]:
    loop = asyncio.new_event_loop()
    calls = threading.Event()  # set once the first call has come back: gRPC's threads are up
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)

        async def call() -> None:
            while not stop.is_set():
                with contextlib.suppress(grpc.RpcError):  # a call that timed out on a slow machine: the next one
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
                    calls.set()

        tasks = [asyncio.create_task(call()) for _ in range(clients)]
        await stop.wait()
        await asyncio.gather(*tasks, return_exceptions=True)
        await channel.close()
        await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert calls.wait(60), "the gRPC calls never got going"
        yield
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        if not thread.is_alive():
            loop.close()
