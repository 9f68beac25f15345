"""systemd's notify protocol (Type=notify, WatchdogSec=) without a dependency: one datagram per message
to the socket named by $NOTIFY_SOCKET. Outside systemd every call is a no-op."""

from __future__ import annotations

import asyncio
import os
import socket


def notify(message: str) -> bool:
    """Send e.g. "READY=1", "WATCHDOG=1", "STOPPING=1", "STATUS=...". False when not under systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message.encode(), address)
        except OSError:
            return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1 (half of WatchdogSec), or None when systemd expects no pings."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


async def watchdog() -> None:
    """Ping systemd's watchdog from the event loop itself: a stuck loop stops the pings and gets restarted."""
    interval = watchdog_interval_s() or 1.0
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
