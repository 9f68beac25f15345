"""Free TCP ports, for a new MASTER_PORT (agent) or a local cluster's controller (CLI, tests)."""

from __future__ import annotations

import random
import socket

LOWEST = 10_000
TRIES = 50


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections (and for binds to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now on `host` ("" = every interface).

    Chosen at random below the kernel's ephemeral range when there is room: a port handed out by a bind to
    port 0 comes from that range, and between this call and the caller's own bind, any process's outgoing
    connection may be given the same port (`address already in use`, seen with etcd in a busy test run)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(TRIES if low - LOWEST > 1_000 else 0):
        port = rng.randrange(LOWEST, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
