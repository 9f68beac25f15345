"""A real Slurm cluster on this one machine, for tests (root only; Debian's slurmctld, slurmd, slurm-client and
munge, `tools/install-system-deps`).

    with SlurmCluster(3) as c:               # slurmctld, 3 slurmd and a private munged; all nodes IDLE
        job = c.sbatch("#!/bin/bash\\nsrun hostname\\n", "-N", "3")
        assert c.wait_job(job) == "COMPLETED"

Layout: a "hub" network namespace holds a bridge (the cluster's own L2 network, with the hub address on it) and
runs slurmctld; every compute node is a namespace of its own, joined to the bridge by a veth pair, and runs one
`slurmd -N NAME` with NodeAddr its own address. So nodes reach the controller and one another (srun's step
launches go node to node and node to controller), and nothing is bound in the machine's own namespace: no port
or address can collide with the machine's services (a system slurmd or munged included) or with another test
process's cluster. Namespace names carry the pid; subnets are 10.200.0.0/24 .. 10.249.255.0/24, keyed by pid.

Every daemon and client reads a slurm.conf of the cluster's own (in its temporary directory) through SLURM_CONF,
never /etc/slurm; munge runs a munged of its own (own key, socket, pid, log and seed files) that Slurm reaches
through `AuthInfo=socket=...` on the shared filesystem. Client commands run in the hub namespace (`hub_prefix()`
and `env`). `close()` (or leaving the `with` block, failed test or not) kills every process in the cluster's
namespaces (daemons, slurmstepd, job tasks, processes from `popen_in`), removes the namespaces (and with them
their links) and the temporary directory.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tests.eventually import eventually

_serial = itertools.count(1)

# Job states past which a job never changes again (scontrol's JobState names).
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                      "DEADLINE", "OUT_OF_MEMORY"})

_DAEMONS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "munged": "munge"}
_CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "munge")


def _which(cmd: str) -> str | None:
    """The command's path: on PATH, else in /usr/sbin or /sbin (daemons live there, off a user's PATH)."""
    return shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin")


def available() -> str:
    """'' when a SlurmCluster can run here; else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "a Slurm cluster in network namespaces needs root"
    if _which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if _which("nsenter") is None:
        return "`nsenter` (util-linux) is not installed"
    for cmd, package in _DAEMONS.items():
        if _which(cmd) is None:
            return f"`{cmd}` (Debian package {package}) is not installed (tools/install-system-deps)"
    for cmd in _CLIENTS:
        if _which(cmd) is None:
            package = "munge" if cmd == "munge" else "slurm-client"
            return f"`{cmd}` (Debian package {package}) is not installed (tools/install-system-deps)"
    return ""


def _ip(*args: str) -> None:
    p = subprocess.run([_which("ip") or "ip", *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


def parse_record(line: str) -> dict[str, str]:
    """One line of `scontrol show ... -o` (Key=Value Key=Value ...; a value may hold spaces, as a Reason does)
    as a dict."""
    out: dict[str, str] = {}
    for tok in re.split(r"\s+(?=[A-Za-z][A-Za-z0-9_:/.\-]*=)", line.strip()):
        key, sep, value = tok.partition("=")
        if sep:
            out[key] = value.strip()
    return out


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    """A Slurm cluster of `nodes` compute nodes named `{prefix}1 .. {prefix}N`, each `cpus` CPUs, in network
    namespaces of its own (module docstring). `conf_extra` lines are appended to slurm.conf (a later line wins)
    and `node_conf` to every NodeName line (e.g. "Gres=gpu:2" with a `GresTypes=gpu` in `conf_extra`).
    `slurmd_timeout` is Slurm's SlurmdTimeout: how long a silent slurmd stays up in slurmctld's eyes. The cluster
    starts on `__enter__` (or `start()`) and returns once every node is IDLE; `keep=True` (or SLURM_CLUSTER_KEEP=1)
    leaves the temporary directory (configs and logs) behind."""

    def __init__(self, nodes: int = 3, *, prefix: str = "n", cpus: int = 2, conf_extra: str = "",
                 node_conf: str = "", slurmd_timeout: int = 30, start_timeout: float = 180.0,
                 keep: bool | None = None) -> None:
        if not 1 <= nodes <= 200:
            raise ValueError("1..200 nodes")
        serial = next(_serial)
        pid = os.getpid()
        self.node_names: list[str] = [f"{prefix}{i}" for i in range(1, nodes + 1)]
        self.nodelist = f"{prefix}1" if nodes == 1 else f"{prefix}[1-{nodes}]"
        k = (pid * 16 + serial) % (50 * 256)
        net = f"10.{200 + k // 256}.{k % 256}"
        self.subnet = f"{net}.0/24"
        self.hub_ip = f"{net}.1"
        self._ips = {name: f"{net}.{10 + i}" for i, name in enumerate(self.node_names, 1)}
        self._tag = f"{pid}-{serial}"
        self.hub_ns = f"slh{self._tag}"
        self._ns = {name: f"sln{self._tag}-{name}" for name in self.node_names}
        self.cpus, self.conf_extra, self.node_conf = cpus, conf_extra, node_conf
        self.slurmd_timeout, self.start_timeout = slurmd_timeout, start_timeout
        self.keep = os.environ.get("SLURM_CLUSTER_KEEP") == "1" if keep is None else keep
        self.dir: Path = Path()
        self.conf_path: Path = Path()
        self.munge_socket: Path = Path()
        self.env: dict[str, str] = {}
        self._munged: subprocess.Popen | None = None
        self._slurmctld: subprocess.Popen | None = None
        self._slurmd: dict[str, subprocess.Popen] = {}
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []
        self._files: list = []
        self._jobs = itertools.count(1)
        self._started = self._closed = False

    # -- addresses and commands ---------------------------------------------------------------------------------

    def ip(self, node: str) -> str:
        """The node's address (its NodeAddr), reachable from the hub and every other node."""
        return self._ips[node]

    def netns(self, where: str) -> str:
        """The network namespace's name: `where` is a node name or "hub"."""
        return self.hub_ns if where == "hub" else self._ns[where]

    def prefix(self, where: str) -> list[str]:
        """argv prefix that runs a command in a node's namespace (or the hub's, where="hub"). nsenter, not `ip netns
        exec`: that one remounts /sys, and slurmd 22.05 will not start without the cgroup mounts under it."""
        return [_which("nsenter") or "nsenter", f"--net=/run/netns/{self.netns(where)}", "--"]

    def hub_prefix(self) -> list[str]:
        """argv prefix that runs a command in the hub namespace (slurmctld's; the one for client commands)."""
        return self.prefix("hub")

    def popen_in(self, where: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start a long-lived process in a namespace ("hub" or a node), with `env` unless `env=` is given, in a
        session of its own; `close()` kills it (SIGTERM, then SIGKILL)."""
        kw.setdefault("env", self.env)
        kw.setdefault("start_new_session", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen([*self.prefix(where), *argv], **kw)
        self._procs.append(p)
        return p

    def run_in(self, where: str, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0,
               **kw) -> subprocess.CompletedProcess:
        """Run a command to its end in a namespace ("hub" or a node) with `env`; text output captured."""
        kw.setdefault("env", self.env)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        kw.setdefault("cwd", self.dir)
        p = subprocess.run([*self.prefix(where), *argv], timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} (in {where}) exited {p.returncode}: "
                             f"{(p.stderr or '').strip() or (p.stdout or '').strip()}")
        return p

    # -- Slurm client commands (run in the hub) -----------------------------------------------------------------

    def scontrol(self, *args: str, check: bool = True) -> str:
        """`scontrol ARGS` in the hub; its stdout (SlurmError on a failure where check)."""
        return self.run_in("hub", [_which("scontrol") or "scontrol", *args], check=check).stdout

    def sinfo(self, *args: str) -> str:
        """`sinfo ARGS` in the hub; its stdout."""
        return self.run_in("hub", [_which("sinfo") or "sinfo", *args]).stdout

    def scancel(self, *args: str) -> str:
        """`scancel ARGS` in the hub; its stdout."""
        return self.run_in("hub", [_which("scancel") or "scancel", *args]).stdout

    def sbatch(self, script: str, *args: str, cwd: str | os.PathLike | None = None) -> int:
        """Submit `script` (the batch script's text) with `sbatch ARGS` from the hub; the job id. The job's
        working directory (and default output file, slurm-%j.out) is `cwd`, else the cluster's directory."""
        path = self.dir / "jobs" / f"job{next(self._jobs)}.sh"
        path.write_text(script)
        path.chmod(0o755)
        out = self.run_in("hub", [_which("sbatch") or "sbatch", "--parsable", *args, str(path)],
                          cwd=cwd or self.dir).stdout
        return int(out.strip().split(";")[0])

    def job_info(self, job_id: int | str) -> dict[str, str]:
        """`scontrol show job -o ID` as a dict (JobState, Reason, NodeList, ExitCode, StdOut, ...); {} once
        slurmctld forgot the job (MinJobAge after it ended)."""
        p = self.run_in("hub", [_which("scontrol") or "scontrol", "show", "job", "-o", str(job_id)], check=False)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("JobId=")), "")
        return parse_record(line) if p.returncode == 0 and line else {}

    def job_state(self, job_id: int | str) -> str:
        """The job's JobState (PENDING, RUNNING, COMPLETED, FAILED, ...); '' when slurmctld does not know it."""
        return self.job_info(job_id).get("JobState", "")

    def wait_job(self, job_id: int | str, states: Iterable[str] = TERMINAL, timeout: float = 120.0) -> str:
        """Wait until the job's state is one of `states` (by default any final one); that state. TimeoutError
        (with the job's record and the logs' tails) when it does not come within `timeout` seconds."""
        want = set(states)
        seen = {"state": ""}

        def reached() -> bool:
            seen["state"] = self.job_state(job_id)
            return seen["state"] in want

        self._wait(reached, timeout, lambda: f"job {job_id} never reached {sorted(want)}: {self.job_info(job_id)}")
        return seen["state"]

    def node_info(self, name: str) -> dict[str, str]:
        """`scontrol show node -o NAME` as a dict: State (e.g. IDLE, ALLOCATED, IDLE+DRAIN, DOWN*), Reason,
        NodeAddr, CPUTot, ..."""
        line = self.scontrol("show", "node", "-o", name).strip().splitlines()
        return parse_record(line[0]) if line else {}

    def node_state(self, name: str) -> str:
        """The node's State as scontrol writes it: base state ('*' appended when not responding) then '+'-joined
        flags, e.g. IDLE, MIXED, ALLOCATED, IDLE+DRAIN, DOWN*+DRAIN."""
        return self.node_info(name).get("State", "")

    def wait_node(self, name: str, want: str | Callable[[dict[str, str]], bool], timeout: float = 120.0
                  ) -> dict[str, str]:
        """Wait until the node's state is `want` (a State like "IDLE" or "IDLE+DRAIN": the same base state and
        flags, in any order) or until `want(node_info)` is true; the node's record."""
        if isinstance(want, str):
            wanted = sorted(want.split("+"))

            def ok(info: dict[str, str]) -> bool:
                return sorted(info.get("State", "").split("+")) == wanted
        else:
            ok = want
        last: dict[str, dict[str, str]] = {}

        def check() -> bool:
            last["info"] = self.node_info(name)
            return ok(last["info"])

        self._wait(check, timeout, lambda: f"node {name} never became {want}: {last.get('info')}")
        return last["info"]

    def wait_nodes(self, want: str = "IDLE", names: Iterable[str] | None = None, timeout: float = 120.0) -> None:
        """Wait until every node in `names` (all by default) has state `want` (as in wait_node)."""
        for name in names or self.node_names:
            self.wait_node(name, want, timeout)

    # -- node faults ----------------------------------------------------------------------------------------------

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL the node's slurmd (its running job steps are left alone): to slurmctld the node falls silent."""
        p = self._slurmd.pop(name)
        p.kill()
        p.wait(30)

    def start_slurmd(self, name: str) -> None:
        """Start the node's slurmd (again, after kill_slurmd); it registers with slurmctld by itself."""
        if name in self._slurmd and self._slurmd[name].poll() is None:
            raise SlurmError(f"{name}'s slurmd is running")
        slurmd = _which("slurmd") or "slurmd"
        log = self.dir / "log" / f"slurmd-{name}.out"
        self._slurmd[name] = self._daemon(name, [slurmd, "-D", "-N", name], log)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Make the namespaces, write the configs, start munged, slurmctld and every slurmd, and wait until every
        node is IDLE (SlurmError with the logs' tails past `start_timeout`)."""
        if self._started:
            raise SlurmError("started already")
        self._started = True
        atexit.register(self.close)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        reap_orphans()
        self.dir = Path(tempfile.mkdtemp(prefix=f"slurm{self._tag}-"))
        for sub in ("etc", "munge", "log", "run", "state", "spool", "jobs"):
            (self.dir / sub).mkdir()
        # munged wants every directory above its socket searchable by all (mkdtemp makes 0700).
        self.dir.chmod(0o711)
        (self.dir / "munge").chmod(0o711)
        self._network()
        self._start_munged()
        self._write_conf()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_"))}
        self.env["SLURM_CONF"] = str(self.conf_path)
        self.env["PATH"] = self.env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
        deadline = time.monotonic() + self.start_timeout
        ctld = _which("slurmctld") or "slurmctld"
        self._slurmctld = self._daemon("hub", [ctld, "-D", "-i"], self.dir / "log" / "slurmctld.out")
        self._wait(self._ctld_up, deadline - time.monotonic(), lambda: "slurmctld did not answer `scontrol ping`")
        for name in self.node_names:
            self.start_slurmd(name)
        for name in self.node_names:
            self.wait_node(name, "IDLE", max(1.0, deadline - time.monotonic()))

    def _network(self) -> None:
        for ns in (self.hub_ns, *self._ns.values()):
            if Path("/run/netns", ns).exists():  # left by a killed process whose pid this one now has
                subprocess.run([_which("ip") or "ip", "netns", "del", ns], capture_output=True, timeout=30)
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        hub = self.hub_ns
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{self.hub_ip}/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(self.node_names, 1):
            ns = self._ns[name]
            # Made straight in their namespaces: the names never exist in the machine's own.
            _ip("link", "add", f"v{i}", "netns", hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"v{i}", "master", "br0")
            _ip("-n", hub, "link", "set", f"v{i}", "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "route", "add", "default", "via", self.hub_ip)

    def _start_munged(self) -> None:
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.dir / "munge" / "munge.socket"
        m = self.dir / "munge"
        argv = [_which("munged") or "munged", "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={m / 'munged.pid'}", f"--log-file={self.dir / 'log' / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}", "--num-threads=4"]
        out = open(self.dir / "log" / "munged.out", "ab")  # noqa: SIM115 (closed in close())
        self._files.append(out)
        self._munged = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        munge = _which("munge") or "munge"

        def up() -> bool:
            if self._munged.poll() is not None:
                raise SlurmError(f"munged exited {self._munged.returncode}: {self._tails()}")
            return self.munge_socket.exists() and subprocess.run(
                [munge, "-n", f"--socket={self.munge_socket}"], capture_output=True, timeout=30).returncode == 0

        self._wait(up, 60.0, lambda: "munged did not come up")

    def _write_conf(self) -> None:
        d = self.dir
        self.conf_path = d / "etc" / "slurm.conf"
        (d / "etc" / "plugstack.conf").write_text("")
        # slurmd 22.05 loads a cgroup plugin whatever ProctrackType and TaskPlugin say (it only reads the hierarchy
        # here); without systemd a cgroup v2 machine needs IgnoreSystemd.
        (d / "etc" / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        for name in self.node_names:
            (d / "spool" / name).mkdir()
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.ip(n)} NodeHostname={n}" for n in self.node_names)
        self.conf_path.write_text(f"""\
# A test's own Slurm cluster (tests/slurm_cluster.py): every path is under {d}.
ClusterName=phx{self._tag.replace('-', 'x')}
# slurmctld checks that it runs on SlurmctldHost's host: the machine's hostname, at the hub's address.
SlurmctldHost={host}({self.hub_ip})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d / 'state'}
SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdSpoolDir={d / 'spool' / '%n'}
SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}
SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}
PlugStackConfig={d / 'etc' / 'plugstack.conf'}
SlurmctldDebug=info
SlurmdDebug=info
# No systemd, no cgroup hierarchy of our own: plain process tracking, no task confinement.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobContainerType=job_container/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# A job submitted to idle nodes starts at once, not after the batch_sched_delay's default 3 s.
SchedulerParameters=batch_sched_delay=0
# The node lines' CPUs count, not what slurmd finds on this machine (which every node shares).
SlurmdParameters=config_overrides
# A node back from DOWN (a slurmd restarted) returns to service on its own.
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
SlurmctldTimeout=30
MessageTimeout=10
KillWait=2
InactiveLimit=0
MinJobAge=600
Waittime=0
NodeName=DEFAULT CPUs={self.cpus} State=UNKNOWN {self.node_conf}
{nodes}
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
{self.conf_extra}
""")

    def _daemon(self, where: str, argv: list[str], log: Path) -> subprocess.Popen:
        out = open(log, "ab")  # noqa: SIM115 (closed in close())
        self._files.append(out)
        return subprocess.Popen([*self.prefix(where), *argv], env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)

    def _ctld_up(self) -> bool:
        if self._slurmctld is not None and self._slurmctld.poll() is not None:
            raise SlurmError(f"slurmctld exited {self._slurmctld.returncode}: {self._tails()}")
        p = self.run_in("hub", [_which("scontrol") or "scontrol", "ping"], check=False)
        return p.returncode == 0 and "UP" in p.stdout

    def _wait(self, cond: Callable[[], bool], timeout: float, what: Callable[[], str]) -> None:
        """Poll `cond` until true; past `timeout` seconds a TimeoutError saying `what()` with the logs' tails."""
        def exited() -> str | None:
            for name, p in self._slurmd.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name}'s slurmd exited {p.returncode}: {self._tails()}")
            return None
        try:
            eventually(cond, "Slurm", timeout, interval=0.1, abort=exited)
        except AssertionError:
            raise TimeoutError(f"{what()} within {timeout:.0f} s\n{self._tails()}") from None

    def _tails(self, lines: int = 15) -> str:
        out = []
        if not self.dir.is_dir():
            return ""
        for path in sorted((self.dir / "log").glob("*")):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                if text:
                    out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def close(self) -> None:
        """Kill every process of the cluster, remove its namespaces and (unless `keep`) its directory. Safe to call
        more than once, and after a failed start."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        # Processes started on purpose first (SIGTERM, a moment to exit), then whatever else lives in the namespaces
        # (slurmstepd, job tasks: they leave slurmd's session), then munged.
        tracked = [*self._procs, *self._slurmd.values(), *([self._slurmctld] if self._slurmctld else [])]
        for p in tracked:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for p in tracked:
            try:
                p.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
        for ns in self._namespaces:
            _kill_netns(ns)
        for p in tracked:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
        for ns in self._namespaces:
            subprocess.run([_which("ip") or "ip", "netns", "del", ns], capture_output=True, timeout=30)
        if self._munged is not None:
            _signal_group(self._munged, signal.SIGTERM)
            try:
                self._munged.wait(10)
            except subprocess.TimeoutExpired:
                _signal_group(self._munged, signal.SIGKILL)
                self._munged.wait(10)
        for f in self._files:
            f.close()
        if self.dir != Path() and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans() -> None:
    """Remove what clusters of test processes that died without close() (SIGKILLed, say) left: their namespaces
    (and every process in them) and their directories (and the munged serving it). A name carries its owner's pid;
    nothing whose owner still runs is touched. start() calls this."""
    with contextlib.suppress(OSError):
        for ns in os.listdir("/run/netns"):
            m = re.fullmatch(r"sl[hn](\d+)-\d+(-.*)?", ns)
            if m and not _alive(int(m.group(1))):
                _kill_netns(ns)
                subprocess.run([_which("ip") or "ip", "netns", "del", ns], capture_output=True, timeout=30)
    tmp = Path(tempfile.gettempdir())
    for d in tmp.glob("slurm*-*-*"):
        m = re.fullmatch(r"slurm(\d+)-\d+-.*", d.name)
        if not (m and d.is_dir() and (d / "munge").is_dir()) or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError, ValueError):
            pid = int((d / "munge" / "munged.pid").read_text().split()[0])
            if str(d).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(sig)


def _kill_netns(ns: str, timeout: float = 15.0) -> None:
    """SIGKILL every process in the namespace until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        p = subprocess.run([_which("ip") or "ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
        pids = [int(x) for x in p.stdout.split() if x.isdigit() and int(x) != os.getpid()]
        if p.returncode != 0 or not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
