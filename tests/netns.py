"""Network namespaces for partition tests: a process put in one reaches the rest over a veth pair, and `cut()`
drops every packet both ways (the `blackhole` queueing discipline on both ends of the veth pair): a silent
partition, as a pulled cable is, not a refused connection. Made and removed by the test (root only)."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

_serial = itertools.count(1)


def available() -> str:
    """'' when namespaces can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return ""


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Netns:
    def __init__(self) -> None:
        n = (os.getpid() % 200) * 10 + next(_serial) % 10  # distinct per test process and per namespace
        self.name = f"phx{os.getpid()}-{n}"
        self.host_dev, self.ns_dev = f"phh{n}", f"phn{n}"
        a, b = divmod(n, 64)
        self.host_ip, self.ns_ip = f"10.{77 + a % 100}.{b * 4 // 256}.{b * 4 % 256 + 1}", \
            f"10.{77 + a % 100}.{b * 4 // 256}.{b * 4 % 256 + 2}"
        _run("ip", "netns", "add", self.name)
        try:
            _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev)
            _run("ip", "link", "set", self.ns_dev, "netns", self.name)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_dev)
            _run("ip", "link", "set", self.host_dev, "up")
            self.exec_("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_dev)
            self.exec_("ip", "link", "set", self.ns_dev, "up")
            self.exec_("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        self.is_cut = False

    def route_out(self) -> None:
        """A default route through the host end: the namespace reaches every address of the host (another
        namespace's host end included), as a machine on a network reaches the controller."""
        self.exec_("ip", "route", "add", "default", "via", self.host_ip)

    def prefix(self) -> list[str]:
        """Run a command inside: prepend this."""
        return ["ip", "netns", "exec", self.name]

    def exec_(self, *args: str) -> None:
        _run(*self.prefix(), *args)

    def cut(self) -> None:
        _run("tc", "qdisc", "add", "dev", self.host_dev, "root", "blackhole")
        self.exec_("tc", "qdisc", "add", "dev", self.ns_dev, "root", "blackhole")
        self.is_cut = True

    def heal(self) -> None:
        _run("tc", "qdisc", "del", "dev", self.host_dev, "root")
        self.exec_("tc", "qdisc", "del", "dev", self.ns_dev, "root")
        self.is_cut = False

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
