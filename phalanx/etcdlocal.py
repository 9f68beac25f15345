"""Runs etcd members on loopback: the tests' etcd and `phalanx local up --ha N`'s.

Each member gets its own data directory and two free ports (clients, peers). With `pki` (a directory
made by `phalanx certs`), clients must present a certificate signed by the cluster CA (mutual TLS);
the peers talk plaintext on loopback.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx.ports import free_port

# Enough operations per transaction for a commit of a few thousand records in one piece (etcd's default is 128).
MAX_TXN_OPS = 10_000


class EtcdMissing(RuntimeError):
    pass


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise EtcdMissing("etcd is not installed (Debian: apt-get install etcd-server, or tools/install-system-deps)")
    return path


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"


def plan(root: Path, count: int, name_prefix: str = "etcd") -> list[Member]:
    return [Member(f"{name_prefix}{i}", free_port(), free_port(), root / f"{name_prefix}{i}.data",
                   root / f"{name_prefix}{i}.log") for i in range(count)]


def command(member: Member, members: list[Member], pki: Path | None = None, token: str = "phalanx-local",
            also_listen: tuple[str, ...] = ()) -> list[str]:
    """`also_listen`: more addresses (besides 127.0.0.1) to serve clients on, at the same port."""
    scheme = "https" if pki else "http"
    client_url = f"{scheme}://{member.endpoint}"
    listen = ",".join([client_url, *(f"{scheme}://{host}:{member.client_port}" for host in also_listen)])
    cmd = [etcd_binary(), "--name", member.name, "--data-dir", str(member.data_dir),
           "--listen-client-urls", listen, "--advertise-client-urls", client_url,
           "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
           "--initial-cluster", ",".join(f"{m.name}={m.peer_url}" for m in members),
           "--initial-cluster-token", token, "--initial-cluster-state", "new",
           "--max-txn-ops", str(MAX_TXN_OPS), "--heartbeat-interval", "100", "--election-timeout", "1000",
           "--log-level", "warn", "--logger", "zap"]
    if pki:
        cmd += ["--client-cert-auth", "--trusted-ca-file", str(pki / "ca.crt"),
                "--cert-file", str(pki / "etcd.crt"), "--key-file", str(pki / "etcd.key")]
    return cmd


def start(member: Member, members: list[Member], pki: Path | None = None,
          also_listen: tuple[str, ...] = ()) -> subprocess.Popen:
    member.data_dir.mkdir(parents=True, exist_ok=True)
    with open(member.log_path, "ab") as log:
        member.proc = subprocess.Popen(command(member, members, pki, also_listen=also_listen), stdout=log,
                                       stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
    return member.proc


def wait_healthy(members: list[Member], timeout_s: float = 60.0, pki: Path | None = None) -> None:
    """Until every running member answers /health over its client URL (etcdctl endpoint health)."""
    deadline = time.monotonic() + timeout_s
    etcdctl = shutil.which("etcdctl")
    pending = [m for m in members if m.proc is not None]
    while pending:
        m = pending[0]
        if m.proc.poll() is not None:
            raise RuntimeError(f"etcd member {m.name} exited with {m.proc.returncode}: "
                               f"{m.log_path.read_text(errors='replace')[-2000:]}")
        if _healthy(m, etcdctl, pki):
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"etcd member {m.name} not healthy after {timeout_s:.0f} s; log {m.log_path}")
        time.sleep(0.1)


def _healthy(m: Member, etcdctl: str | None, pki: Path | None) -> bool:
    if etcdctl is None:  # no client tool: a listening client port will do
        import socket
        try:
            socket.create_connection(("127.0.0.1", m.client_port), timeout=0.5).close()
            return True
        except OSError:
            return False
    scheme = "https" if pki else "http"
    cmd = [etcdctl, "--endpoints", f"{scheme}://{m.endpoint}", "--command-timeout", "2s", "endpoint", "health"]
    if pki:
        cmd += ["--cacert", str(pki / "ca.crt"), "--cert", str(pki / "etcd.crt"), "--key", str(pki / "etcd.key")]
    r = subprocess.run(cmd, capture_output=True, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}, timeout=10)
    return r.returncode == 0


def stop(member: Member, kill: bool = False) -> None:
    if member.proc is None or member.proc.poll() is not None:
        return
    member.proc.kill() if kill else member.proc.terminate()
    try:
        member.proc.wait(10)
    except subprocess.TimeoutExpired:
        member.proc.kill()
        member.proc.wait()
