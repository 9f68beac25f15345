"""`phalanx local up|status|down`: a whole cluster on loopback, for trying things out and for tests.

Everything lives in one directory (`$PHALANX_HOME/local`, default `~/.phalanx/local`): the
configuration of each process, its log, the controller's database, and `cluster.json`, which
records what was started so that `status` and `down` (and the CLI's controller lookup) can find it.

A daemon restarted by hand (after a crash, to try a setting) has a pid that `cluster.json` does not
know; `status` and `down` find it by what can be seen from outside: the process that now listens on
the controller's address, or one whose command line names the same configuration file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from phalanx import etcdlocal, framed
from phalanx.errors import PhalanxError
from phalanx.ports import free_port
from phalanx.rpc import DEFAULT_TIMEOUT_S
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc

START_TIMEOUT_S = 60.0  # Python daemons on a loaded 2-core machine can take a while to import
STOP_GRACE_S = 10.0
MEMBER_CONFIG = re.compile(r"controller(-\d+)?|node-\d+")  # the config files `up` writes, named by member


class LocalError(PhalanxError):
    pass


_children: dict[int, subprocess.Popen] = {}  # processes this CLI process started, by pid


@dataclass
class Proc:
    role: str  # "controller", "agent" or "etcd"
    name: str
    pid: int
    config: str  # its configuration file (etcd: its data directory, which its command line names)
    log: str
    address: str = ""
    metrics: str = ""  # where it serves Prometheus metrics (http://ADDRESS/metrics)
    command: list[str] = field(default_factory=list)  # how to start it again (`phalanx local start NAME`)

    def alive(self) -> bool:
        """Running, and still the process we started (pids get reused)."""
        child = _children.get(self.pid)
        if child is not None:  # started by this very process: ask it (its cmdline is not set until exec)
            return child.poll() is None
        try:
            p = psutil.Process(self.pid)
            return p.status() != psutil.STATUS_ZOMBIE and self.config in " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False

    def live_pid(self) -> int | None:
        """The process that plays this part now: the one we started if it runs; else, for the controller, the
        one listening on its address; else one started by hand with the same configuration file. None if none."""
        if self.alive():
            return self.pid
        if self.role == "controller" and self.address:
            pid = _listener(self.address)
            if pid is not None and _runs_module(pid, "controller"):
                return pid
        return _by_config(self.config)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _listener(address: str) -> int | None:
    """The pid of the process listening on TCP `address` (HOST:PORT), if it is one of this user's."""
    host, _, port = address.rpartition(":")
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for c in connections:
        if c.status == psutil.CONN_LISTEN and c.pid and c.laddr and c.laddr.port == int(port) and \
                c.laddr.ip in (host.strip("[]"), "0.0.0.0", "::"):
            return c.pid
    return None


def _runs_module(pid: int, role: str) -> bool:
    """Whether `pid` is a Phalanx daemon of that role (`python -m controller.main`, `phalanx-controller`)."""
    try:
        p = psutil.Process(pid)
        cmdline = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return _running(p) and any(arg in (f"{role}.main", f"phalanx-{role}") or arg.endswith(f"/phalanx-{role}")
                               for arg in cmdline)


def _by_config(config: str) -> int | None:
    """A running process whose command line has `--config FILE` with FILE our configuration file."""
    want = os.path.realpath(config)
    for p in psutil.process_iter(["cmdline", "cwd"]):
        cmdline = p.info["cmdline"] or []
        for i, arg in enumerate(cmdline):
            value = cmdline[i + 1] if arg == "--config" and i + 1 < len(cmdline) else \
                arg.removeprefix("--config=") if arg.startswith("--config=") else None
            if value is None:
                continue
            path = os.path.join(p.info["cwd"] or "", value) if not os.path.isabs(value) else value
            if os.path.realpath(path) == want and _running(p):
                return p.pid
    return None


def home() -> Path:
    return Path(os.environ.get("PHALANX_HOME") or Path.home() / ".phalanx") / "local"


def cluster_file() -> Path:
    return home() / "cluster.json"


def read_cluster() -> list[Proc] | None:
    try:
        data = json.loads(cluster_file().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise LocalError(f"{cluster_file()} is unreadable ({e}); remove it, or run `phalanx local down`") from None
    return [Proc(**p) for p in data["processes"]]


def controller_address() -> str | None:
    """The local cluster's controllers, comma-separated (clients follow the leader among them)."""
    procs = read_cluster()
    if not procs:
        return None
    return ",".join(p.address for p in procs if p.role == "controller") or None


def controller_config(address: str, root: Path, metrics: str = "", etcd: str = "", name: str = "",
                      session_port: int = 0) -> str:
    # Plaintext on loopback, for trying things out: a fleet runs mutual TLS (`phalanx certs`).
    session = f'session_listen = "{framed.session_address(address, session_port)}"\n' if session_port else ""
    text = (f'listen = "{address}"\nstate_db = "{root / "controller.db"}"\nmetrics_listen = "{metrics}"\n'
            f'{session}\n[security]\ninsecure = true\n')
    if etcd:
        text += (f'\n[store]\nbackend = "etcd"\netcd_endpoints = "{etcd}"\netcd_prefix = "/phalanx-local/"\n'
                 f'etcd_tls = false\netcd_max_txn_ops = {etcdlocal.MAX_TXN_OPS}\nname = "{name}"\n'
                 f'advertise = "{address}"\n')
    return text


def local_cgroup_parent(root: Path) -> str:
    """The ranks' cgroups of this local cluster: apart from a real agent's (`phalanx`) and from every other local
    cluster's on the machine. An agent removes, at its start, the ranks' cgroups under its parent that it has no
    record of (killing what runs in them): two local clusters under one parent would kill each other's ranks."""
    return f"phalanx-local/{zlib.crc32(str(root.resolve()).encode()):08x}"


def agent_config(name: str, address: str, root: Path, backend: str, gpus: int, labels: dict[str, str],
                 metrics: str = "", session_port: int = 0) -> str:
    node = root / "nodes" / name
    # One checkpoint directory for every agent, as a shared filesystem would be on a real fleet: a job submitted
    # without --checkpoint-dir uses <checkpoint_dir>/<job> on each of its nodes, and all must see the same one.
    lines = [f'node_name = "{name}"', f'controller = "{address}"', f'state_dir = "{node / "state"}"',
             f'checkpoint_dir = "{root / "checkpoints"}"', f'snapshot_dir = "{node / "snapshots"}"',
             f'nvrx_socket = "{node / "nvhcd.sock"}"', f'cgroup_parent = "{local_cgroup_parent(root)}"',
             f'metrics_listen = "{metrics}"', *([f"session_port = {session_port}"] if session_port else []),
             "", "[gpu]", f'backend = "{backend}"',
             f"sim_count = {gpus}", "", "[reconnect]", "max_backoff_s = 1.0", "", "[security]", "insecure = true"]
    if labels:
        lines += ["", "[labels]", *[f'{k} = "{v}"' for k, v in labels.items()]]
    return "\n".join(lines) + "\n"


def spawn(role: str, name: str, module: str, config_text: str, root: Path, address: str = "",
          metrics: str = "") -> Proc:
    config_path = root / f"{name}.toml"
    config_path.write_text(config_text)
    log_path = root / "logs" / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, "--config", str(config_path)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=root)
    _children[proc.pid] = proc
    return Proc(role, name, proc.pid, str(config_path), str(log_path), address, metrics)


def choose_backend(requested: str, nodes: int) -> str:
    """auto: real GPUs through NVML for a one-node cluster on a GPU host; simulated otherwise."""
    if requested != "auto":
        return requested
    if nodes == 1:
        try:
            import pynvml
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            pynvml.nvmlShutdown()
            if count:
                return "nvml"
        except Exception:
            pass
    return "sim"


def up(nodes: int, gpus_per_node: int, backend: str, out=sys.stdout, ha: int = 0,
       session_port: bool = False) -> list[Proc]:
    """Start a controller (with `ha` N: an N-member etcd cluster and N controllers electing a leader) and
    `nodes` agents. `session_port`: the agents' sessions go to the controllers' session port; an agent dials
    it on each controller's host, so each controller listens on a loopback address of its own (127.0.0.1,
    127.0.0.2, ...) with the same session port."""
    if ha < 0 or ha > 7:
        raise LocalError(f"--ha {ha}: give 0 (one controller on SQLite) or 1 to 7 members (3 is the usual)")
    if ha:
        try:
            etcdlocal.etcd_binary()
        except etcdlocal.EtcdMissing as e:
            raise LocalError(str(e)) from None
    existing = read_cluster()
    if existing and any(p.live_pid() is not None for p in existing):
        raise LocalError(f"a local cluster is already running (see `phalanx local status`, {cluster_file()}); "
                         "run `phalanx local down` first")
    root = home()
    for stale in ("controller.db", "controller.db-wal", "controller.db-shm", "nodes", "logs", "checkpoints", "etcd"):
        path = root / stale
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    for config in root.glob("*.toml"):  # the members' configs of a cluster before (more nodes, or --ha)
        if MEMBER_CONFIG.fullmatch(config.stem):
            config.unlink()
    (root / "logs").mkdir(parents=True, exist_ok=True)
    backend = choose_backend(backend, nodes)
    started: list[Proc] = []
    try:
        if ha:
            members = etcdlocal.plan(root / "etcd", ha, "etcd-")
            for member in members:
                member.log_path = root / "logs" / f"{member.name}.log"
                proc = etcdlocal.start(member, members)
                _children[proc.pid] = proc
                started.append(Proc("etcd", member.name, proc.pid, str(member.data_dir), str(member.log_path),
                                    member.endpoint, command=etcdlocal.command(member, members)))
            _write(started)
            etcdlocal.wait_healthy(members, START_TIMEOUT_S)
            print(f"etcd cluster of {ha} up: {', '.join(m.endpoint for m in members)}", file=out, flush=True)
            etcd = ",".join(m.endpoint for m in members)
            names = [f"controller-{i}" for i in range(ha)]
        else:
            etcd, names = "", ["controller"]
        sport = free_port("") if session_port else 0
        for i, name in enumerate(names):
            address = f"127.0.0.{i + 1 if sport else 1}:{free_port()}"
            metrics = f"127.0.0.1:{free_port()}"  # every process its own port: several clusters share a host
            started.append(spawn("controller", name, "controller.main",
                                 controller_config(address, root, metrics, etcd, name, sport), root, address,
                                 metrics))
        _write(started)
        controllers = [p for p in started if p.role == "controller"]
        address = _wait_serving(controllers)
        print(f"controller serving on {address}" + (f" (the leader of {ha})" if ha else f" (pid {controllers[0].pid})")
              + (f"; agents' sessions on session port {sport}" if sport else ""), file=out, flush=True)
        address = ",".join(p.address for p in controllers)
        for i in range(nodes):
            name = f"node-{i}"
            metrics = f"127.0.0.1:{free_port()}"
            text = agent_config(name, address, root, backend, gpus_per_node, {"rack": f"rack-{i // 4}"}, metrics,
                                sport)
            started.append(spawn("agent", name, "agent.main", text, root, metrics=metrics))
        _write(started)
        _wait_nodes(address, [p for p in started if p.role == "agent"], out)
    except BaseException:
        _stop(started)
        cluster_file().unlink(missing_ok=True)
        raise
    gpu_note = f"{gpus_per_node} simulated GPUs each" if backend == "sim" else f"GPU backend {backend}"
    print(f"local cluster up: {nodes} nodes ({gpu_note}); logs in {root / 'logs'}", file=out)
    return started


def _write(procs: list[Proc]) -> None:
    tmp = cluster_file().with_suffix(".tmp")
    tmp.write_text(json.dumps({"processes": [asdict(p) for p in procs]}, indent=2))
    os.replace(tmp, cluster_file())


def _tail(path: str, lines: int = 5) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_serving(controllers: list[Proc], timeout_s: float = START_TIMEOUT_S) -> str:
    """Until one of `controllers` serves (the leader, where there are several); returns its address."""
    deadline = time.monotonic() + timeout_s
    channels = {c.address: grpc.insecure_channel(c.address) for c in controllers}
    try:
        while time.monotonic() < deadline:
            for controller in controllers:
                if not controller.alive():
                    raise LocalError(f"{controller.name} exited during start-up; its log ({controller.log}) ends:\n"
                                     f"{_tail(controller.log)}")
                try:
                    reply = health_pb2_grpc.HealthStub(channels[controller.address]).Check(
                        health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return controller.address
                except grpc.RpcError:
                    pass  # not up yet, or a standby
            time.sleep(0.1)
    finally:
        for channel in channels.values():
            channel.close()
    raise LocalError(f"no controller served within {timeout_s:g}s; see {', '.join(c.log for c in controllers)}")


def _wait_nodes(address: str, agents: list[Proc], out) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    want = {p.name for p in agents}
    shown = -1
    address = address.split(",")[0] if "," not in address else _leader_of(address)
    with grpc.insecure_channel(address) as channel:
        stub = control_pb2_grpc.ControlServiceStub(channel)
        while time.monotonic() < deadline:
            for proc in agents:
                if not proc.alive():
                    raise LocalError(f"agent {proc.name} exited during start-up; its log ({proc.log}) ends:\n"
                                     f"{_tail(proc.log)}")
            reply = stub.ListNodes(control_pb2.ListNodesRequest(states=[common_pb2.NODE_STATE_UP]),
                                   timeout=DEFAULT_TIMEOUT_S)
            up_now = len(want & {n.name for n in reply.nodes})
            if up_now != shown:
                print(f"nodes UP: {up_now}/{len(want)}", file=out, flush=True)
                shown = up_now
            if up_now == len(want):
                return
            time.sleep(0.2)
    raise LocalError(f"not every node came UP within {START_TIMEOUT_S:g}s; see the logs in {home() / 'logs'}")


def _leader_of(addresses: str) -> str:
    """The address of the leader among comma-separated controllers, as any of them knows it."""
    for address in addresses.split(","):
        with grpc.insecure_channel(address) as channel:
            try:
                reply = control_pb2_grpc.ControlServiceStub(channel).ListControllers(
                    control_pb2.ListControllersRequest(), timeout=DEFAULT_TIMEOUT_S)
            except grpc.RpcError:
                continue
            if reply.leader_address:
                return reply.leader_address
    raise LocalError(f"no controller of {addresses} knows a leader; see the logs in {home() / 'logs'}")


def _find(name: str) -> tuple[list[Proc], Proc]:
    procs = read_cluster()
    if procs is None:
        raise LocalError("no local cluster; start one with `phalanx local up --nodes N`")
    for proc in procs:
        if proc.name == name:
            return procs, proc
    raise LocalError(f"no process named {name!r} in the local cluster; `phalanx local status` lists them: "
                     f"{', '.join(p.name for p in procs)}")


def stop_member(name: str, kill: bool = False) -> str:
    """Stop one process of the local cluster (SIGTERM, or SIGKILL with `kill`), to try a failover by hand."""
    _, proc = _find(name)
    pid = proc.live_pid()
    if pid is None:
        return f"{name} is not running"
    try:
        os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
    except ProcessLookupError:
        return f"{name} is not running"
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and proc.live_pid() is not None:
        time.sleep(0.05)
    if proc.live_pid() is not None:
        os.kill(pid, signal.SIGKILL)
    return f"{name} (pid {pid}) {'killed' if kill else 'stopped'}; `phalanx local start {name}` starts it again"


def start_member(name: str) -> str:
    """Start again one process of the local cluster that was stopped, with its configuration as before."""
    procs, proc = _find(name)
    if proc.live_pid() is not None:
        raise LocalError(f"{name} is already running (pid {proc.live_pid()})")
    if proc.role == "etcd":
        command = proc.command
    else:
        command = [sys.executable, "-m", f"{proc.role}.main", "--config", proc.config]
    with open(proc.log, "ab") as log:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=home())
    _children[child.pid] = child
    proc.pid = child.pid
    _write(procs)
    return f"{name} started (pid {child.pid}); its log: {proc.log}"


def status() -> list[dict[str, Any]]:
    procs = read_cluster()
    if procs is None:
        raise LocalError("no local cluster; start one with `phalanx local up --nodes N`")
    out = []
    for p in procs:
        pid = p.live_pid()
        out.append({**asdict(p), "pid": pid or p.pid, "running": pid is not None})  # restarted by hand: its new pid
    return out


def down(out=sys.stdout) -> int:
    procs = read_cluster()
    if procs is None:
        print("no local cluster is running", file=out)
        return 0
    stopped = _stop(procs)
    cluster_file().unlink(missing_ok=True)
    print(f"local cluster down: stopped {stopped} processes; logs kept in {home() / 'logs'}", file=out)
    return stopped


def _stop(procs: list[Proc]) -> int:
    """SIGTERM agents and controllers (whatever process plays each part now, see Proc.live_pid), SIGKILL whatever is
    left of them after the grace period; then the same for etcd: the controllers stand down cleanly on it (a
    leader revokes its lease), where an etcd gone first held each of them in its resignation until a timeout."""
    stopped = 0
    for phase in ([p for p in procs if p.role != "etcd"], [p for p in procs if p.role == "etcd"]):
        stopped += _stop_all(phase)
    return stopped


def _stop_all(procs: list[Proc]) -> int:
    running: list[tuple[Proc, int]] = []
    for proc in procs:
        pid = proc.live_pid()
        if pid is not None:
            running.append((proc, pid))
    for _, pid in running:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def alive(proc: Proc, pid: int) -> bool:
        if pid == proc.pid:
            return proc.alive()
        try:
            return _running(psutil.Process(pid))
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(alive(p, pid) for p, pid in running):
        time.sleep(0.05)
    for proc, pid in running:
        if alive(proc, pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return len(running)
