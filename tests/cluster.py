"""A real cluster on loopback for tests: a controller process and agent processes, started directly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.supervisor import kill_recorded
from cli import render
from cli.local import free_port
from cli.render import state_name
from phalanx.pki import issue
from phalanx.tls import channel_credentials
from phalanx.v1 import control_pb2, control_pb2_grpc
from tests.eventually import TIMEOUT_S, eventually


def alive(pid: int) -> bool:
    """Whether `pid` runs (not exited, not a zombie). A process that exits between two looks is not alive: no
    check-then-inspect race (psutil.Process raises NoSuchProcess for a pid gone since pid_exists said yes)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False

class Cluster:
    """Plaintext by default (`insecure = true` in every config); with `pki`, a directory holding a cluster CA,
    mutual TLS: the controller, each agent and the test's own client get certificates issued from it."""

    def __init__(self, root: Path, pki: Path | None = None) -> None:
        self.root = root
        self.address = f"127.0.0.1:{free_port()}"
        # each test cluster's ranks' cgroups apart from every other's (and from a real agent's `phalanx`)
        self.cgroup_parent = f"phalanx-test/{os.getpid()}-{zlib.crc32(str(root).encode()):08x}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.metrics: dict[str, str] = {}  # process name -> its metrics address, for those started with metrics
        self.pki = pki
        if pki is None:
            self._channel = grpc.insecure_channel(self.address)
        else:
            for name, role, sans in (("controller", "controller", ("127.0.0.1", "localhost")),
                                     ("operator", "client", ())):
                if not (pki / f"{name}.crt").exists():
                    issue(pki, name, role, sans)
            creds = channel_credentials((pki / "ca.crt").read_bytes(), (pki / "operator.crt").read_bytes(),
                                        (pki / "operator.key").read_bytes())
            self._channel = grpc.secure_channel(self.address, creds)
        self.control = control_pb2_grpc.ControlServiceStub(self._channel)
        self.health = health_pb2_grpc.HealthStub(self._channel)
        self.netns: dict = {}  # process name -> tests/netns.Netns it runs in

    def listen_on(self, host: str) -> None:
        """Serve the controller on `host` instead of 127.0.0.1 (agents in network namespaces reach it there)."""
        assert self.pki is None, "plaintext only"
        self._channel.close()
        self.address = f"{host}:{self.address.rpartition(':')[2]}"
        self._channel = grpc.insecure_channel(self.address)
        self.control = control_pb2_grpc.ControlServiceStub(self._channel)
        self.health = health_pb2_grpc.HealthStub(self._channel)

    def _spawn(self, name: str, module: str, config: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
        """`prefix`: what the command runs under (default: `ip netns exec NS` for a process given a namespace)."""
        if not prefix and name in self.netns:
            prefix = tuple(self.netns[name].prefix())
        path = self.root / f"{name}.toml"
        path.write_text(config)
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen([*prefix, sys.executable, "-m", module, "--config", str(path)], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def _metrics_listen(self, name: str, metrics: bool) -> str:
        if not metrics:
            return ""
        self.metrics[name] = f"127.0.0.1:{free_port()}"
        return f'metrics_listen = "{self.metrics[name]}"\n'

    def start_controller(self, extra: str = "", metrics: bool = False) -> subprocess.Popen:
        proc = self._spawn("controller", "controller.main",
                           f'listen = "{self.address}"\nstate_db = "{self.root / "controller.db"}"\n'
                           f'{self._metrics_listen("controller", metrics)}{extra}\n'
                           + self._security(extra, "controller"))
        self.wait_for(self._serving, "controller serving")
        return proc

    def _serving(self) -> bool:
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def start_agent(self, name: str, gpus: int = 2, extra: str = "", metrics: bool = False) -> subprocess.Popen:
        """`extra`: top-level keys, then any sections of its own (not [gpu] or [reconnect]).

        Warm standbys are off unless `extra` sets `warm_start`: each imports torch ahead for every rank a node may
        run, and on a test machine every "node" shares the same cores (and the suite runs in parallel), so they
        would cost every test that is not about them seconds of CPU. Tests about warm starts set it."""
        node = self.root / name
        if "warm_start" not in extra:
            extra = f"warm_start = false\n{extra}"
        return self._spawn(name, "agent.main", self._metrics_listen(name, metrics) + (
            f'node_name = "{name}"\ncontroller = "{self.address}"\nstate_dir = "{node / "state"}"\n'
            f'checkpoint_dir = "{node / "ckpt"}"\nsnapshot_dir = "{node / "snapshots"}"\n'
            f'nvrx_socket = "{node / "nvhcd.sock"}"\n'
            + ("" if "cgroup_parent" in extra else f'cgroup_parent = "{self.cgroup_parent}"\n') + f'{extra}\n'
            f'[gpu]\nbackend = "sim"\nsim_count = {gpus}\n'
            "[reconnect]\nmax_backoff_s = 1.0\n" + self._security(extra, name)))

    def _security(self, extra: str, name: str) -> str:
        """The [security] section for a daemon's config, unless the test wrote its own."""
        if "[security]" in extra:
            return ""
        if self.pki is None:
            return "[security]\ninsecure = true\n"
        if not (self.pki / f"{name}.crt").exists():
            issue(self.pki, name, "node")
        return (f'[security]\nca_file = "{self.pki / "ca.crt"}"\ncert_file = "{self.pki / f"{name}.crt"}"\n'
                f'key_file = "{self.pki / f"{name}.key"}"\n')

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        os.kill(proc.pid, sig)
        proc.wait(timeout=TIMEOUT_S)

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Run `phalanx ARGS...` against this cluster's controller, as a user would."""
        env = {**os.environ, "PHALANX_CONTROLLER": self.address}
        if self.pki is None:
            env["PHALANX_INSECURE"] = "1"
        else:
            env.update(PHALANX_CA=str(self.pki / "ca.crt"), PHALANX_CERT=str(self.pki / "operator.crt"),
                       PHALANX_KEY=str(self.pki / "operator.key"))
        return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)

    # What `phalanx job --json`, `events --json` and `logs` print, read over this client's own channel: a wait loop
    # polls these, and a CLI process per poll (0.25 s of CPU to start) costs more than what it waits for.
    def job(self, job_id: str) -> dict:
        return render.job_dict(self.control.GetJob(control_pb2.GetJobRequest(id=job_id), timeout=10))

    def events(self, job: str = "", node: str = "", limit: int = 1000) -> list[dict]:
        """The newest `limit` events (of `job`, of `node`), oldest first, as `phalanx events --json`."""
        reply = self.control.ListEvents(control_pb2.ListEventsRequest(job=job, node=node, limit=limit, newest=True),
                                        timeout=10)
        return [render.event_dict(e) for e in reply.events]

    def logs(self, job_id: str, rank: int = 0) -> str:
        """Rank `rank`'s log so far, as `phalanx logs JOB --rank RANK`."""
        data, offset = bytearray(), 0
        while True:
            chunk = self.control.ReadLogs(control_pb2.ReadLogsRequest(job=job_id, rank=rank, offset=offset),
                                          timeout=10)
            data += chunk.data
            offset = chunk.next_offset
            if offset >= chunk.size:
                return data.decode(errors="replace")

    def states(self) -> dict[str, str]:
        try:
            reply = self.control.ListNodes(control_pb2.ListNodesRequest(), timeout=5)
        except grpc.RpcError:
            return {}
        return {n.name: state_name(n.state) for n in reply.nodes}

    def node(self, name: str) -> control_pb2.Node:
        return self.control.GetNode(control_pb2.GetNodeRequest(name=name), timeout=5)

    def wait_states(self, expected: dict[str, str]) -> None:
        self.wait_for(lambda: all(self.states().get(k) == v for k, v in expected.items()),
                      f"nodes {expected}")

    def wait_connected(self, names) -> None:
        """UP and in session: a node is UP from its registration, and its session (which commands such as an
        injected fault need) opens just after."""
        self.wait_states(dict.fromkeys(names, "UP"))
        self.wait_for(lambda: all(self.node(n).connected for n in names), f"the sessions of {', '.join(names)}")

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
        eventually(predicate, what, timeout, describe=lambda: f"nodes: {self.states()}\ncontroller log:\n"
                   f"{self.log('controller')}{self.daemon_logs()}{self.rank_logs('*')}", abort=self._controller_exited)

    def _controller_exited(self) -> str | None:
        proc = self.procs.get("controller")
        if proc is None or proc.poll() is None:
            return None
        return f"controller exited ({proc.returncode}):\n{self.log('controller')}"

    def log(self, name: str, lines: int = 20) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def daemon_logs(self, lines: int = 10) -> str:
        """The last lines of every agent's log, for a failure's message."""
        return "".join(f"\n{name} log (last lines):\n{self.log(name, lines)}" for name in self.procs
                       if name != "controller")

    def rank_logs(self, job_id: str, lines: int = 8) -> str:
        """The last lines of each rank log of `job_id` ('*': of every job) on every node, for a failure's
        message."""
        logs = sorted(self.root.glob(f"*/state/logs/{job_id}/rank-*.log"))
        return "".join(f"\n{p.relative_to(self.root)} (last lines):\n" +
                       "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) for p in logs)

    def close(self) -> None:
        """Kill everything: the daemons, and any rank still running (ranks live in sessions of their own)."""
        self._channel.close()
        for record in self.root.glob("*/state/ranks/*.json"):
            kill_recorded(record)
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=TIMEOUT_S)
        remove_cgroups(self.cgroup_parent)


def remove_cgroups(parent: str, root: Path = Path("/sys/fs/cgroup")) -> None:
    """Kill what is left in a test cluster's rank cgroups and remove them, deepest first."""
    for top in (root / "memory" / parent, root / "pids" / parent, root / "unified" / parent, root / parent):
        if not top.is_dir():
            continue
        dirs = sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True)
        for d in [*dirs, top]:
            for pid in (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else ():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(100):  # a killed process leaves its cgroup as it is reaped, a moment later
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        with contextlib.suppress(OSError):
            top.parent.rmdir()  # phalanx-test, once no other test process's clusters are in it
