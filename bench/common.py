"""Shared helpers: processes that are always cleaned up, configs, free ports, waiting, machine facts."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from phalanx.ports import free_port  # noqa: F401 - the benchmarks take it from here
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
TASKSET = shutil.which("taskset")
# The environment for the processes we start (bench/run.py sets it to the one it started with).
CHILD_ENV = dict(os.environ)


KEEP = False  # --keep: leave temp directories (configs, logs, databases) behind for inspection


@contextlib.contextmanager
def temp_root(prefix: str):
    """A temp directory for one benchmark's configs, logs and state; removed afterwards unless KEEP."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        if KEEP:
            log(f"kept {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def log(message: str) -> None:
    """A progress line (stderr is left to the processes; progress goes to stdout, flushed)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def controller_toml(address: str, root: Path, session_listen: str = "") -> str:
    return (f'listen = "{address}"\nstate_db = "{root / "c.db"}"\n' + _session_line(session_listen)
            + 'security.insecure = true  # loopback\n')


def _session_line(session_listen: str) -> str:
    """The controller's session port (agents' sessions in frames), a top-level key: before any table."""
    return f'session_listen = "{session_listen}"\n' if session_listen else ""


def etcd_store_toml(endpoint: str, name: str, advertise: str = "") -> str:
    """A [store] table: this controller campaigns on the etcd member at `endpoint` (plaintext, on loopback)."""
    from phalanx import etcdlocal
    return (f'[store]\nbackend = "etcd"\netcd_endpoints = "{endpoint}"\netcd_tls = false\n'
            f'etcd_max_txn_ops = {etcdlocal.MAX_TXN_OPS}\nname = "{name}"\n'
            + (f'advertise = "{advertise}"\n' if advertise else ""))


def secure_controller_toml(address: str, root: Path, pki: Path, session_listen: str = "") -> str:
    """A controller on mutual TLS with the certificates in `pki` (bench/capacity.py's TLS comparison)."""
    return (f'listen = "{address}"\nstate_db = "{root / "c.db"}"\n' + _session_line(session_listen)
            + f'[security]\nca_file = "{pki / "ca.crt"}"\n'
            f'cert_file = "{pki / "controller.crt"}"\nkey_file = "{pki / "controller.key"}"\n')


def agent_toml(name: str, address: str, root: Path, gpus: int = 8, snapshots: Path | None = None) -> str:
    """An agent's config under `root`, its snapshots in `snapshots` / name when given (a tmpfs, as in production)."""
    node = root / name
    return (f'node_name = "{name}"\ncontroller = "{address}"\nstate_dir = "{node / "state"}"\n'
            'security.insecure = true\n'
            f'checkpoint_dir = "{node / "checkpoints"}"\n'
            f'snapshot_dir = "{snapshots / name if snapshots else node / "snapshots"}"\n'
            f'\n[gpu]\nbackend = "sim"\nsim_count = {gpus}\n')


def spawn_daemon(procs: dict, root: Path, name: str, module: str, config: str) -> None:
    """Start `python -m module --config root/name.toml` (the config written from `config`) in a session of its own,
    its output in root/name.log, as procs[name]."""
    (root / f"{name}.toml").write_text(config)
    with open(root / f"{name}.log", "ab") as out:
        procs[name] = subprocess.Popen([sys.executable, "-m", module, "--config", str(root / f"{name}.toml")],
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def cli(address: str, *args: str, timeout: float = 120) -> str:
    """`phalanx ARGS` against the insecure loopback controller at `address`: its stdout."""
    env = {**os.environ, "PHALANX_CONTROLLER": address, "PHALANX_INSECURE": "1"}  # loopback
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env).stdout


def pin_argv(argv: list[str], cpu: int | None) -> tuple[list[str], object]:
    """The argv and preexec_fn that start a child pinned to `cpu` (None: anywhere).

    `taskset -c CPU` when there is one (the exec'd process and every thread it makes stay on that
    CPU), else sched_setaffinity in the child before exec (same effect). Either way the child also
    gets SIGKILL should this process die without cleaning up (PR_SET_PDEATHSIG).
    """
    if cpu is not None and TASKSET:
        return [TASKSET, "-c", str(cpu), *argv], _child_setup(None)
    return argv, _child_setup(cpu)


try:  # resolved here, not in the child between fork and exec
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _PRCTL = None
_PR_SET_PDEATHSIG = 1


def _child_setup(cpu: int | None):
    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
    return setup


def pin_this_process(cpus: set[int]) -> None:
    """Pin every thread of this process (sched_setaffinity(0) alone moves only the calling thread)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


class Procs:
    """Every process a benchmark starts, each in its own session; close() kills each process group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pids: dict[int, str] = {}  # pid (== pgid, start_new_session) -> name
        self.popens: dict[int, subprocess.Popen] = {}
        (root / "logs").mkdir(parents=True, exist_ok=True)

    def log_path(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def spawn(self, name: str, module: str, config_text: str | None = None, args: tuple[str, ...] = (),
              cpu: int | None = None) -> subprocess.Popen:
        argv = [sys.executable, "-m", module]
        if config_text is not None:
            config = self.root / f"{name}.toml"
            config.write_text(config_text)
            argv += ["--config", str(config)]
        argv += list(args)
        argv, preexec = pin_argv(argv, cpu)
        with open(self.log_path(name), "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=REPO, preexec_fn=preexec, env=CHILD_ENV)
        self.pids[proc.pid] = name
        self.popens[proc.pid] = proc
        return proc

    async def spawn_piped(self, name: str, module: str, args: tuple[str, ...] = (),
                          cpu: int | None = None) -> asyncio.subprocess.Process:
        """A child with stdin/stdout pipes (the load generator); stderr goes to its log."""
        argv, preexec = pin_argv([sys.executable, "-m", module, *args], cpu)
        with open(self.log_path(name), "ab") as err:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                cwd=REPO, preexec_fn=preexec, env=CHILD_ENV, limit=1 << 20)
        self.pids[proc.pid] = name
        return proc

    def tail(self, name: str, lines: int = 8) -> str:
        try:
            text = self.log_path(name).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join("    " + line[:300] for line in text)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Signal one process (and its group); reap it if we hold its Popen."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        popen = self.popens.get(pid)
        if popen is not None and sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)

    def forget(self, pid: int) -> None:
        self.pids.pop(pid, None)
        self.popens.pop(pid, None)

    def close(self, grace_s: float = 3.0) -> None:
        """SIGTERM every group, then SIGKILL what is left after `grace_s`. Safe to call twice."""
        pids = list(self.pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_group_alive(pid) for pid in pids):
            for popen in self.popens.values():
                popen.poll()
            time.sleep(0.05)
        for pid in pids:
            if _group_alive(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for popen in self.popens.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout=5)
        self.pids.clear()
        self.popens.clear()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still counts for killpg; treat a reaped-or-zombie leader with no others as gone.
    try:
        with open(f"/proc/{pgid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


async def wait_serving(address: str, procs: Procs, pid: int, name: str, timeout_s: float = 60.0,
                       credentials: grpc.ChannelCredentials | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    channel = (grpc.aio.insecure_channel(address) if credentials is None
               else grpc.aio.secure_channel(address, credentials))
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not process_running(pid):
                raise RuntimeError(f"{name} exited during start-up; its log ends:\n{procs.tail(name)}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{name} did not serve within {timeout_s:g}s; its log ends:\n{procs.tail(name)}")


def process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


async def wait_node_up(stub: control_pb2_grpc.ControlServiceStub, name: str, since_ns: int, pid: int,
                       procs: Procs, proc_name: str, timeout_s: float = 60.0) -> control_pb2.Node:
    """Until `name` is UP, connected, and the controller has a heartbeat from it sent after `since_ns`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process_running(pid):
            raise RuntimeError(f"{proc_name} exited; its log ends:\n{procs.tail(proc_name)}")
        try:
            node = await stub.GetNode(control_pb2.GetNodeRequest(name=name), timeout=5.0)
            if (node.state == common_pb2.NODE_STATE_UP and node.connected
                    and node.last_heartbeat_unix_ns > since_ns):
                return node
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
        await asyncio.sleep(0.05)
    raise RuntimeError(f"node {name} did not come UP within {timeout_s:g}s; {proc_name} log ends:\n"
                       f"{procs.tail(proc_name)}")


async def last_event_seq(stub: control_pb2_grpc.ControlServiceStub, after: int = 0) -> int:
    while True:
        page = await stub.ListEvents(control_pb2.ListEventsRequest(after_seq=after, limit=10_000), timeout=10.0)
        if not page.events:
            return after
        after = page.events[-1].seq


def machine() -> dict[str, object]:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.lower().startswith("model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    if not model:
        with contextlib.suppress(OSError):
            model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("model name")), "")
    import grpc as _grpc
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "cpu_model": model or "unknown",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "grpcio": _grpc.__version__,
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
    }
