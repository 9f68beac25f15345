"""gRPC servers on Unix sockets, for the processes on this node (trainlib in the ranks, NVRx)."""

from __future__ import annotations

import grp
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from phalanx.request_guard import RequestGuard
from phalanx.rpc import SERVER_OPTIONS

SOCKET_MODE = 0o660  # the agent's user and group only


async def serve(path: str | Path, add_servicer: Callable[[grpc.aio.Server], None], group: str = "") -> grpc.aio.Server:
    """Listen on the Unix socket `path`, replacing a stale socket a previous agent left (never another
    kind of file), open to the agent's user and `group` (default: the agent's group). Raises OSError
    with the reason if it cannot."""
    socket_path = Path(path)
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    if socket_path.is_socket():
        socket_path.unlink()
    elif socket_path.exists():
        raise OSError(f"{socket_path} exists and is not a socket; refusing to replace it")
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestGuard()])
    add_servicer(server)
    if server.add_insecure_port(f"unix://{socket_path}") == 0:
        raise OSError(f"cannot listen on unix socket {socket_path}")
    await server.start()
    try:
        os.chmod(socket_path, SOCKET_MODE)
        if group:
            os.chown(socket_path, -1, grp.getgrnam(group).gr_gid)
    except (OSError, KeyError) as e:
        await server.stop(None)
        reason = e.strerror if isinstance(e, OSError) else f"no group {group!r}"
        raise OSError(f"cannot give {socket_path} to group {group!r}: {reason}") from None
    return server
