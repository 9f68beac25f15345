"""Launches, pins, watches, stops and re-adopts rank processes.

Every rank runs under `agent.rankwrap` in a session of its own (so nothing is orphaned into the
agent's group, and a stop reaches every process the rank started). Each rank has a record in
`<state_dir>/ranks/` — the wrapper's pid, process start time, exit-file path — written before the
launch is reported, so an agent that restarts re-adopts the ranks still running and learns how the
others ended. The pid's start time guards against a recycled pid. The rank's own pid (the wrapper's
child) is learnt from the file the wrapper writes beside its exit file, and kept in the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from agent import rank_table, rankwrap, safefs
from agent.cgroups import CgroupError, Cgroups, RankCgroup
from agent.warm import HOLD_S, Recipe, WarmPool, cold_command, recipe
from phalanx import log
from phalanx.clock import Clock, RealClock, Timer, wall_s
from phalanx.v1 import common_pb2, node_pb2

logger = log.get("supervisor")

KEEP_EXITED_S = 600.0  # exited ranks stay reported this long, so the controller hears of them
PARK_HOLD_S = 60.0  # the default of the agent's park_hold_s
# Run by path, isolated (-I: no working directory, script directory or PYTHONPATH on sys.path): a
# user's `agent.py` or `agent/` in the job's working directory cannot shadow the wrapper.
WRAPPER = str(Path(rankwrap.__file__).resolve())
# The agent's own systemd plumbing (notify socket, watchdog, socket activation): a rank that inherited
# it could ping the agent's watchdog or claim its sockets.
AGENT_ONLY_ENV = frozenset({"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                            "LISTEN_FDNAMES"})


# What a rank running as its own account keeps of the agent's environment: nothing of the agent's own (its
# sockets, watchdog, credentials), only what Phalanx gives every rank and a login's basics.
KEPT_ENV = frozenset({"PATH", "LANG", "LC_ALL", "TZ",
                      # where the agent has the rank's NCCL flight recorder dump (agent.collectors.nccl.rank_env)
                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"})


@dataclass(frozen=True)
class Account:
    """A local account ranks run as: looked up on this node by name (as the controller's access file allows)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    def spec(self) -> str:
        return f"{self.uid}:{self.gid}:{','.join(map(str, self.groups))}"

    def env(self, base_env: dict[str, str], job_env) -> dict[str, str]:
        env = {k: v for k, v in base_env.items() if k in KEPT_ENV or k.startswith("PHALANX_")}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env.update(HOME=self.home, USER=self.name, LOGNAME=self.name, SHELL=self.shell)
        env.update(job_env)
        return env

    def own(self, path: Path) -> None:
        """Make `path` (the job's directory under the agent's own checkpoint_dir, whose parent only root may
        change) this account's, mode 0700 (its checkpoints are nobody else's), created if missing; by descriptor
        beneath the parent, so a link there is not followed."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with safefs.closing_fd(safefs.open_dir(path.parent)) as parent, \
                safefs.closing_fd(safefs.walk(parent, [path.name], create=0o700)) as fd:
            os.fchown(fd, self.uid, self.gid)
            os.fchmod(fd, 0o700)

    def claim(self, path: Path) -> None:
        """Make `path` a directory of this account's, mode 0700, in a directory of the agent's (the snapshot
        directory's own/, the NCCL dumps' directory): whatever else is there, a link, a file or a directory of
        another account's, is removed first, so that the job's files go nowhere but here. Done by descriptor
        beneath the parent (agent/safefs.py): no link is followed."""
        with safefs.closing_fd(safefs.open_dir(path.parent)) as parent:
            try:
                st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and (not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, self.uid)):
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(path.name, dir_fd=parent)  # by descriptor: never follows the links in it
                else:
                    safefs.unlink_in(parent, path.name)
            with safefs.closing_fd(safefs.walk(parent, [path.name], create=0o700)) as fd:
                os.fchown(fd, self.uid, self.gid)
                os.fchmod(fd, 0o700)


@dataclass(frozen=True)
class AccountPolicy:
    """This node's own rules on whom ranks run as (agent [security] rank_accounts, root_ranks, agent_user_ranks):
    the controller names an account, the node decides whether it runs anything as it."""

    accounts: tuple[str, ...] = ("*",)
    root: bool = False
    agent_user: bool = True

    def refusal(self, run_as: str) -> str:
        """Why a job that runs as `run_as` ("" = the agent's user) is refused here, or ""."""
        if not run_as:
            return "" if self.agent_user else ("this node runs no ranks as the agent's own user (agent "
                                               "security.agent_user_ranks = false): the job must name an account")
        if run_as == "root" and not self.root:
            return "this node runs no ranks as root (agent security.root_ranks = false)"
        if "*" not in self.accounts and run_as not in self.accounts:
            return f"this node runs ranks only as {', '.join(self.accounts)} (agent security.rank_accounts), " \
                   f"not as {run_as!r}"
        return ""


def resolve_account(name: str) -> Account:
    """The account `name` on this node. Raises ValueError saying it is missing (or is root: the controller
    allows root only where its access file says so, and says so in the request)."""
    import pwd
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"account {name!r} does not exist on this node (the job runs as it): create it, or "
                         "map the identity to an account that does") from None
    if entry.pw_uid == 0 and name != "root":
        raise ValueError(f"account {name!r} has uid 0 on this node: root under another name is refused (the access "
                         "file allows root only by its name, with allow_root)")
    groups = tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)
    return Account(name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir, entry.pw_shell)


@dataclass
class RankRecord:
    job: str
    generation: int
    rank: int
    local_rank: int
    gpu: int
    pid: int
    started: float  # the process's create_time, to tell it from a later process with the same pid
    log: str
    exit_file: str
    exited_at: float = 0.0  # wall-clock seconds
    exit_code: int | None = None
    lost: bool = False
    rank_pid: int = 0  # the rank's own process (the wrapper's child); 0 until the wrapper has said
    fatal: str = ""  # what the rank's trainlib said made it stop for good
    warm: bool = False  # started from a standby (agent.warm), not a new process
    run_as: str = ""  # the account it runs as ("" = the agent's user)
    cgroup: list[str] = field(default_factory=list)  # its cgroup's directories (agent.cgroups); [] = none

    @property
    def key(self) -> str:
        return f"{self.job}.g{self.generation}.r{self.rank}"


def kill_recorded(path: Path, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group of the rank whose record is at `path`, if that rank still runs; whether it did.
    For what cleans up after a node (tests' and benchmarks' clusters): a record outlives its rank (kept
    KEEP_EXITED_S) and pids recycle within minutes on a busy machine, so a recorded pid alone could name another
    process, a session leader too; the record's process start time tells the rank from a later process."""
    try:
        data = json.loads(path.read_text())
        pid, started = int(data["pid"]), float(data["started"])
        if data.get("exit_code") is not None or abs(psutil.Process(pid).create_time() - started) >= 1.0:
            return False
        os.killpg(pid, sig)
        return True
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return False


@dataclass
class _Parked:
    """A rank (trainlib.run) whose generation ended and that waits, in its process, to rejoin the next."""
    record: RankRecord  # the ended generation's
    deliver: Callable[[dict[str, str] | None, str], bool]  # its answer: the next environment, or None and why
    timer: Timer


class Supervisor:
    def __init__(self, state_dir: Path, cpus_for_gpu: dict[int, list[int]] | None = None,
                 clock: Clock | None = None, warm: WarmPool | None = None, cgroups: Cgroups | None = None,
                 accounts: AccountPolicy | None = None, park_hold_s: float = PARK_HOLD_S) -> None:
        self._clock = clock or RealClock()
        self._park_hold_s = park_hold_s  # agent park_hold_s
        self._accounts = accounts or AccountPolicy(root=True)
        self._cgroups = cgroups
        self.warm = warm
        self._dir = state_dir / "ranks"
        self._logs = state_dir / "logs"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._cpus_for_gpu = cpus_for_gpu or {}
        self._ranks: dict[str, RankRecord] = {}
        self._children: dict[int, subprocess.Popen] = {}
        self._duty: dict[str, threading.Event] = {}  # slow-bursts=F duty cycles, by rank key
        self._throttle: dict[str, float] = {}  # slow=F factors, by rank key: the rank's trainlib applies them
        self._lock = threading.Lock()
        # job -> the newest generation this agent was told to stop: a launch of it (or an older one) that
        # arrives later — sent by a controller that died before the stop — is refused (fencing).
        self._stopped: dict[str, int] = {}
        self._unsaved: set[str] = set()  # records of ranks that ended whose end the disk has not taken yet
        self._parked: dict[tuple[str, int], _Parked] = {}  # (job, rank) -> a process waiting to rejoin as that rank

    # -- launching ---------------------------------------------------------------------------

    def launch(self, request: node_pb2.LaunchRanks, base_env: dict[str, str]) -> str:
        """Start this node's ranks of a job (rank_table.admit decides whether, and how). Raises ValueError/OSError
        with a reason on failure."""
        limits = request.limits
        running = tuple(r.rank for r in request.ranks if (existing := self._ranks.get(
            f"{request.job}.g{request.generation}.r{r.rank}")) is not None and self._alive(existing))
        cgroups = self._cgroups
        admission = rank_table.admit(rank_table.LaunchAsk(
            request.job, request.generation, has_command=bool(request.command),
            stopped=self._stopped.get(request.job, 0), running=running,
            account_refusal=self._accounts.refusal(request.run_as), as_account=bool(request.run_as),
            limits=bool(limits.memory_bytes or limits.tasks), open_files=bool(limits.open_files),
            no_cgroups="" if cgroups is not None and cgroups.enabled else
            cgroups.why_not if cgroups is not None else "cgroups are off",
            warm_pool=self.warm is not None and self.warm.enabled))
        if admission.refusal:
            raise ValueError(admission.refusal)
        account = resolve_account(request.run_as) if request.run_as else None
        env = self._env(base_env, request.env) if account is None else account.env(base_env, request.env)
        warm = admission.warm
        kind = recipe(request.job, request.command, env, self._workdir(request.workdir)) if warm else None
        started = []
        own = base_env.get("PHALANX_CHECKPOINT_DIR")  # the agent's checkpoint_dir/JOB, not one the job names
        if account is not None and own and env.get("PHALANX_CHECKPOINT_DIR") == own:
            account.own(Path(own))
        if account is not None:  # where its NCCL flight-recorder dumps and its in-memory snapshots go: the agent's
            if base_env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
                account.claim(Path(base_env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent)
            if base_env.get("PHALANX_SNAPSHOT_DIR"):
                account.claim(Path(base_env["PHALANX_SNAPSHOT_DIR"]) / request.job)
        for rank in request.ranks:
            started.append(self._start(request, rank, env, kind, account))
        if warm:
            self.warm.launching()
            self.warm.want(kind, len(request.ranks))  # ready for the next generation here
        started_warm = sum(1 for r in started if r.warm)
        return f"started ranks {', '.join(str(r.rank) for r in started)} of {request.job} (generation " \
               f"{request.generation}" + (f", {started_warm} warm" if started_warm else "") + ")"

    def prepare(self, request: node_pb2.PrepareRanks, base_env: dict[str, str]) -> str:
        """Keep standbys for a job this node may be asked to run (a spare of it)."""
        if self.warm is None or not self.warm.enabled:
            return "warm starts are off on this node"
        if request.run_as:  # a standby runs the job's code as the agent's user (root) before any rank is handed to it
            return (f"{request.job}'s ranks start cold: it runs as {request.run_as!r}, and standbys run as the agent's "
                    "user")
        kind = recipe(request.job, request.command, self._env(base_env, request.env), self._workdir(request.workdir))
        if kind is None:
            return f"{request.job}'s ranks start cold (not a python program, or PHALANX_WARM_START=0)"
        self.warm.want(kind, request.count, request.hold_s or HOLD_S)
        return f"holding {request.count} standbys of {request.job}"

    def tend_warm(self) -> None:
        if self.warm is not None:
            self.warm.tend({r.job for r in self._live()})

    @staticmethod
    def _env(base_env: dict[str, str], job_env) -> dict[str, str]:
        env = {k: v for k, v in base_env.items() if k not in AGENT_ONLY_ENV}
        env.update(job_env)
        return env

    def _workdir(self, workdir: str) -> str:
        return workdir or str(self._dir.parent)

    def _stamp(self) -> str:
        """The clock's wall time, local, for a rank log's header."""
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(wall_s(self._clock)))

    def _start(self, request: node_pb2.LaunchRanks, rank: node_pb2.RankLaunch, job_env: dict[str, str],
               kind: Recipe | None, account: Account | None = None) -> RankRecord:
        log_dir = self._logs / request.job
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"rank-{rank.rank}.log"
        exit_file = self._dir / f"{request.job}.g{request.generation}.r{rank.rank}.exit"
        exit_file.unlink(missing_ok=True)
        Path(rankwrap.pid_path(str(exit_file))).unlink(missing_ok=True)
        env = {**job_env, **rank.env}
        cpus = self._cpus_for_gpu.get(rank.gpu)
        workdir = self._workdir(request.workdir)
        rejoined = self._rejoin(request, rank, env, cpus, log_path)
        if rejoined is not None:
            return rejoined
        standby = self.warm.take(kind) if self.warm is not None else None
        proc = None
        # O_NOFOLLOW: the log directory is the agent's, but no link is ever followed to a file written as root
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
        if account is not None:
            os.fchown(fd, account.uid, account.gid)
        with open(fd, "ab") as out:
            out.write(f"--- phalanx: {request.job} generation {request.generation} rank {rank.rank} "
                      f"starting at {self._stamp()}{' (warm)' if standby else ''} ---\n".encode())
            out.flush()
            if standby is not None:
                try:
                    self.warm.assign(standby, {"env": env, "cwd": workdir, "log": str(log_path),
                                              "exit_file": str(exit_file), "cpus": cpus or []})
                    proc = standby.proc
                except OSError as e:
                    out.write(f"--- phalanx: {e}; starting cold ---\n".encode())
                    out.flush()
            try:
                cgroup = self._cgroups.make(exit_file.stem, request.limits) if self._cgroups else None
            except CgroupError as e:
                raise ValueError(str(e)) from None
            if proc is not None and cgroup is not None:  # a standby (no limits: those start cold) joins it now
                try:
                    cgroup.adopt(proc.pid)
                except OSError as e:
                    logger.warning("a warm rank runs without its cgroup", job=request.job, rank=rank.rank, error=str(e))
                    cgroup.remove()
                    cgroup = None
            if proc is None:
                options, wrapper_env = [], env
                for d in cgroup.dirs if cgroup is not None else ():
                    options += ["--cgroup", d]
                if request.limits.open_files:
                    options += ["--nofile", str(request.limits.open_files)]
                if cpus:  # the wrapper pins itself: no preexec_fn in this process, whose gRPC threads a fork crashes
                    options += ["--cpus", ",".join(map(str, cpus))]
                if account is not None:
                    env_file = exit_file.with_suffix(".env")
                    env_fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                    with open(env_fd, "w") as f:
                        json.dump(env, f)
                    options += ["--as", account.spec(), str(env_file), "--cwd", workdir]
                    wrapper_env = {"PATH": "/usr/bin:/bin"}  # the wrapper runs with the agent's rights
                # (as another account, the program as given: that account's interpreter would run a file of ours)
                command = list(request.command) if account is not None else cold_command(request.command)
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-I", WRAPPER, str(exit_file), *options, "--", *command],
                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=wrapper_env,
                        cwd=workdir if account is None else "/", start_new_session=True)
                except BaseException:
                    if cgroup is not None:
                        cgroup.remove()
                    raise
        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            created = 0.0
        record = RankRecord(request.job, request.generation, rank.rank, rank.local_rank, rank.gpu, proc.pid, created,
                            str(log_path), str(exit_file), warm=standby is not None and proc is standby.proc,
                            run_as=account.name if account is not None else "",
                            cgroup=list(cgroup.dirs) if cgroup is not None else [])
        with self._lock:
            self._ranks[record.key] = record
            self._children[proc.pid] = proc
        self._save(record)
        logger.info("rank started", job=request.job, generation=request.generation, rank=rank.rank, pid=proc.pid,
                    gpu=rank.gpu, cpus=len(cpus) if cpus else "all", warm=record.warm)
        return record

    def _rejoin(self, request: node_pb2.LaunchRanks, rank: node_pb2.RankLaunch, env: dict[str, str],
                cpus: list[int] | None, log_path: Path) -> RankRecord | None:
        """Hand the rank to the process that was it in an earlier generation and waits to rejoin (trainlib.run), if
        there is one; None if not."""
        parked = self._parked.pop((request.job, rank.rank), None)
        if parked is None:
            return None
        parked.timer.cancel()
        old = parked.record
        if not self._running(old) or not parked.deliver(env, ""):
            return None
        if cpus and old.rank_pid:
            _pin_threads(old.rank_pid, cpus)  # a process that ran a generation: torch's threads, trainlib's
        with open(log_path, "ab") as out:
            out.write(f"--- phalanx: {request.job} generation {request.generation} rank {rank.rank} rejoining in "
                      f"the same process (pid {old.rank_pid or old.pid}) at {self._stamp()} ---\n".encode())
        record = RankRecord(request.job, request.generation, rank.rank, rank.local_rank, rank.gpu, old.pid, old.started,
                            str(log_path), old.exit_file, rank_pid=old.rank_pid, warm=True, run_as=old.run_as,
                            cgroup=old.cgroup)
        old.exit_file = ""  # the wrapper writes it for the process's last generation: the new record's now
        self._save(old)
        with self._lock:
            self._ranks[record.key] = record
        self._save(record)
        logger.info("rank rejoined", job=request.job, generation=request.generation, rank=rank.rank, pid=old.pid)
        return record

    def park(self, request, deliver: Callable[[dict[str, str] | None, str], bool]) -> str:
        """A rank run by trainlib.run ended its generation (`request.exit_code`: 0 stopped, else failed) and waits to
        rejoin the next. Its generation's record ends now, as if the process had exited with that code; the next
        launch here with the same rank hands it the new environment (deliver), or, after park_hold_s, it is told to
        exit. Returns why it cannot wait here, or ""."""
        record = self._ranks.get(f"{request.job}.g{request.generation}.r{request.rank}")
        refused = rank_table.may_park(request.job, request.generation, request.rank,
                                      record is not None and self._alive(record), record.rank_pid if record else 0,
                                      request.pid)
        if refused:
            return refused
        key = (request.job, request.rank)
        if key in self._parked:
            self._release(key, "another process of this rank waits to rejoin")
        record.exit_code, record.exited_at = request.exit_code, wall_s(self._clock)
        self._end_slowness(record.key)
        self._save(record)
        hold = self._park_hold_s
        timer = self._clock.call_later(hold, lambda: self._release(
            key, f"no generation of {request.job} was launched here with rank {request.rank} within {hold:g}s "
                 "(park_hold_s)"))
        self._parked[key] = _Parked(record, deliver, timer)
        logger.info("rank waits to rejoin", job=request.job, generation=request.generation, rank=request.rank,
                    exit_code=request.exit_code, reason=request.reason)
        return ""

    def _release(self, key: tuple[str, int], why: str) -> None:
        parked = self._parked.pop(key, None)
        if parked is not None:
            parked.timer.cancel()
            parked.deliver(None, why)

    # -- watching ----------------------------------------------------------------------------

    def _alive(self, record: RankRecord) -> bool:
        return record.exit_code is None and not record.lost and self._running(record)

    def _running(self, record: RankRecord) -> bool:
        """Whether the record's process runs (a parked rank's does, though its generation's record has ended)."""
        child = self._children.get(record.pid)
        if child is not None:
            return child.poll() is None
        try:
            p = psutil.Process(record.pid)
            return abs(p.create_time() - record.started) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def poll(self) -> list[RankRecord]:
        """Notice ranks that ended since the last call; returns them. Each record's look is agent/rank_table.py's
        `decide`, then its actions. A look that fails (a record that cannot be written: a full state disk) is that
        rank's alone: the other ranks are looked at, and the first failure is raised at the end for the caller to
        say (the heartbeat goes up regardless); the failed rank is looked at again at the next call."""
        ended: list[RankRecord] = []
        failure: OSError | None = None
        now = wall_s(self._clock)
        with self._lock:
            records = list(self._ranks.values())
        for record in records:
            try:
                if self._look(record, now):
                    ended.append(record)
            except OSError as e:
                failure = failure or e
        with self._lock:
            live = {r.pid for r in self._ranks.values() if r.exit_code is None and not r.lost}
        for pid, child in list(self._children.items()):  # a parked rank told to exit: reap its wrapper
            if pid not in live and child.poll() is not None:
                self._children.pop(pid, None)
        if failure is not None:
            raise failure
        return ended

    def _look(self, record: RankRecord, now: float) -> bool:
        """One look at one record: rank_table.decide on what is seen, then its actions. True if the rank ended."""
        if record.key in self._unsaved:  # its end, not written at the look that saw it
            self._save(record)
            self._unsaved.discard(record.key)
        state = rank_table.state_of(record.exit_code, record.lost)
        alive, code = True, None
        if state is rank_table.RankState.RUNNING:
            alive = self._alive(record)
            if not alive:
                child = self._children.get(record.pid)
                code = self._read_exit(record)
                if code is None and child is not None and child.returncode is not None:
                    code = child.returncode  # the wrapper itself was killed (SIGKILL to the group): no exit file
        seen = rank_table.Seen(alive=alive, exit_code=code, age_s=now - record.exited_at,
                               has_cgroup=bool(record.cgroup), knows_rank_pid=bool(record.rank_pid))
        after, actions = rank_table.decide(state, seen, KEEP_EXITED_S)
        rank_table.check(state, after)
        A = rank_table.Action
        for action in actions:
            if action is A.LEARN_RANK_PID:
                self._learn_rank_pid(record)
            elif action is A.END:
                # known at once (the controller hears of the end with the next heartbeat, whatever the disk says);
                # a record that cannot be written is written at a later look (_unsaved)
                lost = after is rank_table.RankState.LOST
                record.exited_at, record.lost, record.exit_code = now, lost, None if lost else code
                self._children.pop(record.pid, None)
                self._end_slowness(record.key)
                self._unsaved.add(record.key)
                self._save(record)
                self._unsaved.discard(record.key)
                logger.info("rank ended", job=record.job, generation=record.generation, rank=record.rank,
                            exit_code=record.exit_code, lost=record.lost)
            elif action is A.CLEAR_CGROUP:  # what the rank left running (a daemon it started) ends with it
                self._clear_cgroup(record)
            elif action is A.DROP:
                self._drop(record)
        return after is not state

    def _clear_cgroup(self, record: RankRecord) -> None:
        """Kill what is left in the rank's cgroup and remove it, once the rank's own process is gone (a parked
        rank's process lives on into its next generation, with the same cgroup)."""
        if not record.cgroup or self._running(record):
            return
        cgroup = RankCgroup(tuple(record.cgroup))
        left = cgroup.kill()
        if left:
            logger.info("killed what the rank left running", job=record.job, rank=record.rank, processes=left)
        if cgroup.remove():
            record.cgroup = []
            self._save(record)

    def _learn_rank_pid(self, record: RankRecord) -> None:
        if record.rank_pid:
            return
        try:
            record.rank_pid = int(Path(rankwrap.pid_path(record.exit_file)).read_text().strip())
        except (OSError, ValueError):
            return  # not started yet (or a wrapper from before the pid file)
        self._save(record)

    def mark_fatal(self, job: str, generation: int, rank: int, reason: str) -> bool:
        """Remember that the rank's trainlib said it stops for good; False if no such rank runs here."""
        record = self._ranks.get(f"{job}.g{generation}.r{rank}")
        if record is None:
            return False
        if record.fatal != reason:
            record.fatal = reason
            self._save(record)
            logger.warning("rank stops for good", job=job, generation=generation, rank=rank, reason=reason)
        return True

    @staticmethod
    def _read_exit(record: RankRecord) -> int | None:
        try:
            return int(Path(record.exit_file).read_text().strip())
        except (OSError, ValueError):
            return None

    def statuses(self) -> list[node_pb2.RankStatus]:
        with self._lock:
            records = sorted(self._ranks.values(), key=lambda r: (r.job, r.generation, r.rank))
        out = []
        for r in records:
            if r.lost:
                state = common_pb2.RANK_STATE_LOST
            elif r.exit_code is not None:
                state = common_pb2.RANK_STATE_EXITED
            else:
                state = common_pb2.RANK_STATE_RUNNING
            out.append(node_pb2.RankStatus(job=r.job, generation=r.generation, rank=r.rank, state=state, pid=r.pid,
                                           exit_code=r.exit_code or 0, gpu=r.gpu, rank_pid=r.rank_pid,
                                           fatal=r.fatal))
        return out

    def current_generation(self, job: str) -> int | None:
        """The newest generation of `job` this node has launched (None if none)."""
        with self._lock:
            generations = [r.generation for r in self._ranks.values() if r.job == job]
        return max(generations, default=None)

    @property
    def running(self) -> int:
        with self._lock:
            return sum(1 for r in self._ranks.values() if r.exit_code is None and not r.lost)

    # -- stopping ----------------------------------------------------------------------------

    def stop(self, job: str, generation: int, grace_s: float) -> str:
        """SIGTERM the job's ranks (generation 0 = all) now; SIGKILL their groups after `grace_s` of the clock.
        Call on the event loop."""
        live = {r.key: r for r in self._live()}
        plan = rank_table.stop_plan(job, generation, self._stopped.get(job, 0),
                                    [(r.key, r.job, r.generation) for r in live.values()], list(self._parked))
        if plan.stopped:
            self._stopped[job] = plan.stopped
        for rank in plan.release:  # the job is over here: none of its ranks rejoins
            self._release((job, rank), f"{job} was stopped")
        targets = [live[key] for key in plan.targets]
        for record in targets:
            self._end_slowness(record.key)
            self._signal(record, signal.SIGCONT, group=True)  # a stopped (hung) rank cannot act on SIGTERM
            self._signal(record, signal.SIGTERM, group=False)  # the wrapper passes it to the rank once
        if targets:
            keys = [r.key for r in targets]
            self._clock.call_later(grace_s, lambda: self._kill_remaining(keys))
        return f"stopping {len(targets)} ranks of {job}" + (f" generation {generation}" if generation else "")

    def _kill_remaining(self, keys: list[str]) -> None:
        for key in keys:
            record = self._ranks.get(key)
            if record is not None and self._alive(record):
                logger.warning("rank did not stop within its grace period; SIGKILL", job=record.job, rank=record.rank)
                self._signal(record, signal.SIGKILL, group=True)
                if record.cgroup:  # and whatever left its process group (setsid)
                    RankCgroup(tuple(record.cgroup)).kill()

    def _signal(self, record: RankRecord, sig: int, group: bool) -> None:
        try:
            if group:
                os.killpg(record.pid, sig)  # the wrapper leads its own session: pgid == pid
            else:
                os.kill(record.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _live(self) -> list[RankRecord]:
        with self._lock:
            records = list(self._ranks.values())
        return [r for r in records if self._alive(r)]

    # -- faults on ranks (phalanx inject ... slow=F | slow-bursts=F | hang) --------------------

    def ranks_on_gpu(self, gpu: int) -> list[RankRecord]:
        return [r for r in self._live() if r.gpu == gpu]

    def hang(self, gpu: int) -> list[int]:
        """SIGSTOP the ranks on `gpu` until they are stopped for good."""
        ranks = self.ranks_on_gpu(gpu)
        for record in ranks:
            self._end_slowness(record.key)
            self._signal(record, signal.SIGSTOP, group=True)
        return [r.rank for r in ranks]

    def slow(self, gpu: int, factor: float) -> list[int]:
        """Throttle the ranks on `gpu` as a hot GPU would: every step's compute takes (1 + `factor`)x as long. The
        factor goes to the rank's trainlib in its report replies (slow_factor): only the rank knows where its
        steps begin and end."""
        ranks = self.ranks_on_gpu(gpu)
        for record in ranks:
            self._end_slowness(record.key)
            self._throttle[record.key] = factor
        return [r.rank for r in ranks]

    def slow_factor(self, job: str, generation: int, rank: int) -> float:
        """The slow=F throttle on this rank (0.0 for none)."""
        return self._throttle.get(f"{job}.g{generation}.r{rank}", 0.0)

    def slow_bursts(self, gpu: int, factor: float, period_s: float = 0.1) -> list[int]:
        """Duty-cycle the ranks on `gpu` with SIGSTOP/SIGCONT so that they run `factor` slower on average: with steps
        shorter than the cycle, some steps stop for a burst and others run at full speed."""
        ranks = self.ranks_on_gpu(gpu)
        stopped_share = factor / (1.0 + factor)  # F slower: work per second drops to 1 / (1 + F)
        for record in ranks:
            self._end_slowness(record.key)
            done = threading.Event()
            self._duty[record.key] = done

            def cycle(rec: RankRecord = record, done: threading.Event = done) -> None:
                while not done.is_set():
                    self._signal(rec, signal.SIGSTOP, group=True)
                    if done.wait(period_s * stopped_share):
                        break
                    self._signal(rec, signal.SIGCONT, group=True)
                    done.wait(period_s * (1 - stopped_share))
                self._signal(rec, signal.SIGCONT, group=True)

            threading.Thread(target=cycle, name=f"slow-{record.key}", daemon=True).start()
        return [r.rank for r in ranks]

    def _end_slowness(self, key: str) -> None:
        """End a slow=F or slow-bursts=F on the rank: it ended, is stopped, or has a new fault instead."""
        self._throttle.pop(key, None)
        done = self._duty.pop(key, None)
        if done is not None:
            done.set()

    # -- logs --------------------------------------------------------------------------------

    def cap_logs(self, max_bytes: int) -> list[str]:
        """Cut the log of every running rank that has grown past `max_bytes`: its last eighth goes to `.log.1`
        (replacing the one before) and the log starts again (the rank writes with O_APPEND, so it writes on at the
        new end), with a line saying so. A tenant's output cannot fill the node's state disk, which every job on it
        shares. Returns the logs cut. By descriptor, without following a link: the file is the job's account's."""
        cut = []
        for record in self._live():
            path = Path(record.log)
            try:
                fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            with open(fd, "r+b") as log:
                st = os.fstat(log.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size <= max_bytes:
                    continue
                keep = max_bytes // 8
                log.seek(st.st_size - keep)
                tail = log.read(keep)
                old = path.with_name(path.name + ".1")
                old.unlink(missing_ok=True)
                out = os.open(old, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
                os.fchown(out, st.st_uid, st.st_gid)
                with open(out, "wb") as f:
                    f.write(tail)
                os.ftruncate(log.fileno(), 0)
                log.write(f"--- phalanx: log cut at {st.st_size / 1e6:.0f} MB (agent rank_log_max_mb) at "
                          f"{self._stamp()}; its last {keep / 1e6:.0f} MB are in {old.name} ---\n".encode())
            cut.append(str(path))
            logger.warning("rank log cut", job=record.job, rank=record.rank, bytes=st.st_size, kept=str(old))
        return cut

    def prune_ended(self, root: Path, max_bytes: int) -> list[str]:
        """Delete the per-job directories under `root` (the rank logs', `logs_dir`; the NCCL dumps') of jobs
        that have no rank record here (ended, and their records dropped), oldest first, until those left take at
        most `max_bytes`: ended jobs' files cannot fill the state disk over weeks, whatever each one's size.
        Returns the jobs whose directories went. By descriptor beneath `root` (no link in a job's directory is
        followed), sizes counted with lstat."""
        with self._lock:
            kept = {record.job for record in self._ranks.values()}
        try:
            parent = safefs.open_dir(root)
        except FileNotFoundError:
            return []
        removed = []
        with safefs.closing_fd(parent):
            ended = []
            for name in os.listdir(parent):
                if name in kept:
                    continue
                try:
                    st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        ended.append((st.st_mtime, name, _tree_bytes(name, parent)))
                except OSError:  # gone meanwhile
                    continue
            total = sum(size for _, _, size in ended)
            for _, name, size in sorted(ended):
                if total <= max_bytes:
                    break
                shutil.rmtree(name, dir_fd=parent)  # by descriptor: never follows the links in it
                total -= size
                removed.append(name)
        if removed:
            logger.info("ended jobs' files deleted", root=str(root), jobs=len(removed), first=removed[0],
                        kept_bytes=total)
        return removed

    @property
    def logs_dir(self) -> Path:
        return self._logs

    def log_path(self, job: str, rank: int) -> Path | None:
        path = self._logs / job / f"rank-{rank}.log"
        return path if path.exists() else None

    # -- records -----------------------------------------------------------------------------

    def _save(self, record: RankRecord) -> None:
        path = self._dir / f"{record.key}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)

    def _drop(self, record: RankRecord) -> None:
        self._unsaved.discard(record.key)
        self._clear_cgroup(record)  # a parked rank's, once its process has gone
        with self._lock:
            self._ranks.pop(record.key, None)
        paths = [self._dir / f"{record.key}.json"]
        if record.exit_file:  # "" for a generation whose process rejoined the next (the next record has it)
            paths += [Path(record.exit_file), Path(rankwrap.pid_path(record.exit_file))]
        for path in paths:
            path.unlink(missing_ok=True)

    def adopt(self) -> list[RankRecord]:
        """Read the records a previous agent left; returns the ranks still running (re-adopted)."""
        adopted = []
        for path in sorted(self._dir.glob("*.json")):
            try:
                record = RankRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("unreadable rank record; ignored", path=str(path), error=str(e))
                continue
            with self._lock:
                self._ranks[record.key] = record
            if self._alive(record):
                adopted.append(record)
        for record in adopted:
            logger.info("rank re-adopted", job=record.job, generation=record.generation, rank=record.rank,
                        pid=record.pid)
        self.poll()  # the ones that ended while no agent watched: their exit files say how
        if self._cgroups is not None:  # and the cgroups of ranks no record knows (an agent killed mid-launch)
            with self._lock:
                known = {d for r in self._ranks.values() for d in r.cgroup}
            self._cgroups.sweep(known)
        return adopted


def _pin_threads(pid: int, cpus: list[int]) -> None:
    """Pin every thread of a running process (sched_setaffinity(pid) moves only its main thread)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            os.sched_setaffinity(int(tid), cpus)


def _tree_bytes(name: str, parent: int) -> int:
    """The bytes of the regular files beneath directory `name` of `parent`, walked by descriptor (links not
    followed)."""
    total = 0
    for _, _, files, fd in os.fwalk(name, dir_fd=parent, follow_symlinks=False):
        for file in files:
            with contextlib.suppress(OSError):
                st = os.stat(file, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total
