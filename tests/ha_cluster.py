"""A highly available control plane on loopback for tests: N controller processes on one etcd, and agents
that know every controller. The test's own client follows the leader as the CLI does."""

from __future__ import annotations

import base64
import contextlib
import json
import signal
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from cli.local import free_port
from controller.store.etcd import prefix_end
from phalanx import framed
from phalanx.leader import leader_hint
from phalanx.v1 import control_pb2, control_pb2_grpc
from tests.cluster import Cluster
from tests.netns import Netns


class Following:
    """A ControlService stub over several controllers: each call goes to the leader, found by trying them."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.channels = {a: grpc.insecure_channel(a) for a in addresses}
        self.current = addresses[0]

    def __getattr__(self, method: str):
        def call(request, timeout: float = 5.0):
            deadline = time.monotonic() + max(timeout, 10.0)
            while True:
                for address in [self.current, *self.addresses]:
                    stub = control_pb2_grpc.ControlServiceStub(self.channels[address])
                    try:
                        reply = getattr(stub, method)(request, timeout=min(timeout, 2.0))
                        self.current = address
                        return reply
                    except grpc.RpcError as e:
                        # DEADLINE_EXCEEDED: a frozen controller (the tests only read through this, or write
                        # what may be written twice)
                        moving_on = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                        if e.code() not in moving_on or time.monotonic() > deadline:
                            raise
                        hint = leader_hint(e)
                        if hint in self.channels:
                            self.current = hint
                            break
                else:
                    time.sleep(0.05)
        return call

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


class HaCluster(Cluster):
    def __init__(self, root: Path, etcd_endpoint: str, controllers: int = 3, lease_ttl_s: int = 2,
                 netns: dict[str, Netns] | None = None, session_port: bool = False) -> None:
        """`netns`: members that run in a network namespace of their own (tests/netns.py), reaching etcd at the
        namespace's host address on etcd's port (etcd must listen there too). `session_port`: the agents' sessions
        go to the controllers' session port, the same port on each controller's host, so each controller has a
        loopback address of its own (127.0.0.1, .2, ...)."""
        super().__init__(root)
        self._channel.close()
        self.names = [f"c{i}" for i in range(controllers)]
        self.netns.update(netns or {})
        self.session_port = free_port("") if session_port else 0
        self.addresses = {name: f"{self._host(i, name)}:{free_port()}" for i, name in enumerate(self.names)}
        self.address = ",".join(self.addresses.values())  # what agents and the CLI are given
        self.etcd_endpoint = etcd_endpoint
        self.prefix = f"/test-ha/{uuid.uuid4().hex}/"
        self.lease_ttl_s = lease_ttl_s
        self.control = Following(list(self.addresses.values()))
        self._etcd_channel: grpc.Channel | None = None  # the test's own reads of the store (what a leader loads)
        self._channel = self.control  # closed by Cluster.close

    def _host(self, index: int, name: str) -> str:
        if name in self.netns:
            return self.netns[name].ns_ip
        return f"127.0.0.{index + 1}" if self.session_port else "127.0.0.1"

    def start_agent(self, name: str, gpus: int = 2, extra: str = "", metrics: bool = False) -> subprocess.Popen:
        if self.session_port:
            extra = f"session_port = {self.session_port}\n{extra}"
        return super().start_agent(name, gpus, extra, metrics)

    def start_controller(self, extra: str = "", metrics: bool = False, name: str = "") -> subprocess.Popen:
        """Start one member (`name`), or every member not running; returns the last started."""
        proc = None
        for member in [name] if name else self.names:
            if member in self.procs and self.procs[member].poll() is None:
                continue
            address = self.addresses[member]
            own = f'session_listen = "{framed.session_address(address, self.session_port)}"\n' \
                if self.session_port else ""
            if metrics:  # the same address when a member is started again
                own += f'metrics_listen = "{self.metrics.setdefault(member, f"127.0.0.1:{free_port()}")}"\n'
            ns = self.netns.get(member)
            etcd = self.etcd_endpoint if ns is None else f"{ns.host_ip}:{self.etcd_endpoint.rpartition(':')[2]}"
            proc = self._spawn(member, "controller.main",
                               f'listen = "{address}"\n{own}{extra}\n'
                               f'[store]\nbackend = "etcd"\netcd_endpoints = "{etcd}"\n'
                               f'etcd_prefix = "{self.prefix}"\netcd_tls = false\nname = "{member}"\n'
                               f'advertise = "{address}"\nlease_ttl_s = {self.lease_ttl_s}\n'
                               "[security]\ninsecure = true\n", tuple(ns.prefix()) if ns else ())
        self.wait_for(lambda: self.leader() is not None, "a leader elected")
        return proc

    def controllers(self) -> control_pb2.ListControllersResponse | None:
        for address in self.addresses.values():
            try:
                return control_pb2_grpc.ControlServiceStub(self.control.channels[address]).ListControllers(
                    control_pb2.ListControllersRequest(), timeout=2)
            except grpc.RpcError:
                continue
        return None

    def parked(self, name: str) -> int:
        """How many agents' sessions member `name` holds parked (a standby); -1 if it does not answer."""
        try:
            return control_pb2_grpc.ControlServiceStub(self.control.channels[self.addresses[name]]).ListControllers(
                control_pb2.ListControllersRequest(), timeout=2).parked_sessions
        except grpc.RpcError:
            return -1

    def leader(self) -> tuple[str, int] | None:
        """(name, epoch) of the leader that serves, asked of the leader itself."""
        reply = self.controllers()
        if reply is None or not reply.leader:
            return None
        try:
            stub = control_pb2_grpc.ControlServiceStub(self.control.channels[reply.leader_address])
            stub.GetStats(control_pb2.GetStatsRequest(), timeout=2)
        except (grpc.RpcError, KeyError):
            return None
        return reply.leader, reply.epoch

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """`controller`: the leader (the one a single-controller test means); anything else by name. The leader is
        the controller that answered the test's last call, when it still runs (no round trip: a kill aimed at a
        moment of a recovery must land then); else asked."""
        if name == "controller":
            names = {address: member for member, address in self.addresses.items()}
            name = names.get(self.control.current, "")
            if not name or self.procs[name].poll() is not None:
                leader = self.leader()
                assert leader is not None, "no leader to kill"
                name = leader[0]
        super().kill(name, sig)

    def _kv(self, key: bytes, range_end: bytes = b"") -> list:
        if self._etcd_channel is None:
            self._etcd_channel = grpc.insecure_channel(self.etcd_endpoint)
        return list(rpc.KVStub(self._etcd_channel).Range(rpc.RangeRequest(key=key, range_end=range_end),
                                                          timeout=10).kvs)

    def close(self) -> None:
        if self._etcd_channel is not None:
            self._etcd_channel.close()
        super().close()

    def stored_job(self, job_id: str) -> bytes | None:
        """A job's serialized record as etcd has it: what a new leader loads."""
        kvs = self._kv(f"{self.prefix}jobs/{job_id}".encode())
        return base64.b64decode(json.loads(kvs[0].value)["data"]) if kvs else None

    def stored_events(self, job_id: str) -> list[tuple[str, str]]:
        base = f"{self.prefix}events/".encode()
        out = []
        for kv in self._kv(base, prefix_end(base)):
            out += [(e["kind"], e["message"]) for e in json.loads(kv.value) if e["job"] == job_id]
        return out

    def log(self, name: str, lines: int = 20) -> str:
        if name == "controller":  # Cluster's messages name one controller: show every member's tail
            return "\n".join(f"--- {n}\n{super(HaCluster, self).log(n, lines)}" for n in self.names)
        return super().log(name, lines)


@contextlib.contextmanager
def with_own_etcd(root: Path):
    """An etcd member of the test's own (one it may stop and start: `etcdlocal.stop/start(members[0], members)`)
    and a control plane on it; skips where etcd is not installed. Yields (cluster, members)."""
    from phalanx import etcdlocal
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(str(e))
    members = etcdlocal.plan(root / "etcd", 1)
    etcdlocal.start(members[0], members)
    c = HaCluster(root, members[0].endpoint)
    try:
        etcdlocal.wait_healthy(members)
        yield c, members
    finally:
        c.close()
        etcdlocal.stop(members[0])
