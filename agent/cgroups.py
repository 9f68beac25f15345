"""A cgroup of its own for every rank: its limits, and a way to kill all it started.

The agent makes `ROOT/PARENT/NODE/RANK-KEY` in each hierarchy it needs — the unified (v2) one where the memory
and pids controllers are enabled there, else the v1 `memory` and `pids` hierarchies — sets the rank's
limits in it, and the rank's wrapper moves itself in before it starts the rank, so the rank and every
process it starts (a data loader, a `setsid` daemon that left the process group) are in it. When the
rank is stopped or has ended, whatever is still in the cgroup is killed and the cgroup removed.

Without systemd as PID 1 nobody else manages these hierarchies, so the agent does. Where systemd is PID 1
the same cgroups are made beside systemd's slices (systemd leaves cgroups it did not make alone); a
transient systemd unit per rank is not made.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from phalanx import log
from phalanx.v1 import common_pb2

logger = log.get("cgroups")

V1_CONTROLLERS = ("memory", "pids")


class CgroupError(Exception):
    """A rank's limits cannot be enforced here; the message says why and what to do."""


@dataclass(frozen=True)
class RankCgroup:
    dirs: tuple[str, ...]  # one per hierarchy the rank is in

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in Path(d, "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def kill(self) -> int:
        """SIGKILL everything in the cgroup; the number of processes signalled."""
        for d in self.dirs:
            kill_file = Path(d, "cgroup.kill")  # v2 (Linux 5.14): the kernel kills all, forks racing it included
            if kill_file.exists():
                try:
                    kill_file.write_text("1")
                except OSError:
                    pass
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return len(pids)

    def adopt(self, pid: int) -> None:
        """Move a running process (a warm standby becoming the rank) in; what it starts from now on is in too.
        Raises OSError."""
        for d in self.dirs:
            Path(d, "cgroup.procs").write_text(str(pid))

    def remove(self) -> bool:
        """Remove the cgroup once empty (kill() first); False if something is still in it."""
        removed = True
        for d in self.dirs:
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError:
                removed = False
        return removed


class Cgroups:
    """Makes ranks' cgroups under `parent`/`node` of the hierarchies mounted at `root`; `parent` "" = none at all.
    (The node's name keeps apart several agents on one machine, as in a test or demo cluster.)"""

    def __init__(self, root: str = "/sys/fs/cgroup", parent: str = "phalanx", node: str = "node") -> None:
        self._root = Path(root)
        self._parent = f"{parent.strip('/')}/{node}" if parent.strip("/") else ""
        self.why_not = self._probe()  # "" when ranks get cgroups here
        if self._parent and self.why_not:
            logger.warning("ranks run without cgroups of their own", why=self.why_not)

    def _probe(self) -> str:
        if not self._parent:
            return "the agent's cgroup_parent is empty (cgroups are off)"
        if not os.access(self._root, os.W_OK) and not all(os.access(p, os.W_OK) for p in self._v1_roots()):
            return f"{self._root} is not writable by the agent (uid {os.geteuid()})"
        if self._unified() is None:
            missing = [c for c in V1_CONTROLLERS if not (self._root / c / "cgroup.procs").exists()]
            if missing:
                return f"no cgroup v2 with the memory and pids controllers, and no v1 {', '.join(missing)} " \
                       f"hierarchy under {self._root}"
        try:  # the node's own level made now, so that a hierarchy that looks usable and is not says so at start
            self._bases()
        except OSError as e:
            return f"cannot make the ranks' parent cgroup: {e}"
        return ""

    def _bases(self) -> list[Path]:
        """The node's level in each hierarchy (PARENT/NODE), made if missing; in v2 each level gives the memory
        and pids controllers to its children (a level with processes of its own cannot: the agent must then
        run in a leaf of its own, as under systemd with Delegate=yes). Raises OSError."""
        unified = self._unified()
        if unified is not None:
            d = unified
            for part in self._parent.split("/"):
                _enable(d, V1_CONTROLLERS)
                d = d / part
                d.mkdir(exist_ok=True)
            _enable(d, V1_CONTROLLERS)
            return [d]
        bases = [self._root / c / self._parent for c in V1_CONTROLLERS]
        for d in bases:
            d.mkdir(parents=True, exist_ok=True)
        return bases

    def sweep(self, keep: set[str]) -> int:
        """Remove the ranks' cgroups here that no record names (killing what is in them); how many."""
        if self.why_not:
            return 0
        removed = 0
        for base in self._bases():
            for d in base.iterdir():
                if d.is_dir() and str(d) not in keep:
                    cgroup = RankCgroup((str(d),))
                    cgroup.kill()
                    removed += cgroup.remove()
        if removed:
            logger.info("removed cgroups of ranks no record knows", count=removed)
        return removed

    def _v1_roots(self) -> list[Path]:
        return [self._root / c for c in V1_CONTROLLERS]

    def _unified(self) -> Path | None:
        """The v2 hierarchy, when it has the memory and pids controllers to give; else None (use v1)."""
        for base in (self._root, self._root / "unified"):
            controllers = base / "cgroup.controllers"
            try:
                offered = set(controllers.read_text().split())
            except OSError:
                continue
            if set(V1_CONTROLLERS) <= offered:
                return base
        return None

    @property
    def enabled(self) -> bool:
        return not self.why_not

    def make(self, key: str, limits: common_pb2.ResourceLimits) -> RankCgroup | None:
        """The rank's cgroup with its limits set; None where cgroups are off or impossible and no limit needs one.
        Raises CgroupError if the memory or tasks limit cannot be enforced."""
        wants = limits.memory_bytes or limits.tasks
        if self.why_not:
            if wants:
                raise CgroupError(f"this job limits memory or tasks, but ranks cannot get a cgroup here: "
                                  f"{self.why_not}")
            return None
        made: list[str] = []
        try:
            bases = self._bases()
            if len(bases) == 1:  # v2
                d = bases[0] / key
                d.mkdir(exist_ok=True)
                made.append(str(d))
                if limits.memory_bytes:
                    (d / "memory.max").write_text(str(limits.memory_bytes))
                    if (d / "memory.swap.max").exists():  # the limit is on memory, not memory the rank swapped out
                        (d / "memory.swap.max").write_text("0")
                if limits.tasks:
                    (d / "pids.max").write_text(str(limits.tasks))
                return RankCgroup((str(d),))
            for base in bases:
                d = base / key
                d.mkdir(exist_ok=True)
                made.append(str(d))
            dirs = made
            if limits.memory_bytes:
                Path(dirs[0], "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                memsw = Path(dirs[0], "memory.memsw.limit_in_bytes")  # swap too, where the kernel accounts it
                if memsw.exists():
                    memsw.write_text(str(limits.memory_bytes))
            if limits.tasks:
                Path(dirs[1], "pids.max").write_text(str(limits.tasks))
            return RankCgroup(tuple(dirs))
        except OSError as e:
            RankCgroup(tuple(made)).remove()
            if wants:
                raise CgroupError(f"cannot make the rank's cgroup to enforce its limits: {e}") from e
            logger.warning("rank runs without a cgroup of its own", rank=key, error=str(e))
            return None


def _enable(group: Path, controllers: tuple[str, ...]) -> None:
    """Give `controllers` to group's children (v2 subtree_control); those already given are left as they are."""
    control = group / "cgroup.subtree_control"
    missing = [c for c in controllers if c not in control.read_text().split()]
    if missing:
        control.write_text(" ".join(f"+{c}" for c in missing))

