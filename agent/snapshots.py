"""In-memory snapshots of the ranks' training state, held by the node's agent and replicated to a peer.

trainlib in a rank copies its state into host memory, writes it to a file under this node's snapshot
directory (tmpfs: host memory that outlives the rank process) and tells the agent (SnapshotTaken). The
agent keeps it within the node's budget and streams a replica to the agent of another node of the job
(the peer the controller named at launch), so that losing one node loses no snapshot. When a rank is
restored, its node's agent hands it the file — from its own directory, or fetched from the node that
holds it — after checking the CRC-32 recorded when it was taken.

Layout under `root`, a tree only root (the agent's user) can change, checked component by component when the
agent starts (agent/safefs.py)::

    own/<job>/g<generation>/r<rank>/s<step>.pt        written by the rank (renamed into place when complete);
                                                      own/<job> is made by the agent, owned by the job's account
    own/<job>/restore-r<rank>.pt                      a replica handed to a rank that runs as an account
    replica/<job>/g<generation>/r<rank>/s<step>.pt    written by this agent from a peer's stream (0700)
    meta/<own|replica>/<job>/g<gen>/r<rank>/s<step>.pt.json   size and CRC-32: the file counts as held only with it

The ranks may write under own/<job>, so the agent never follows a path there: it walks down from own/ with
O_NOFOLLOW and reads, checks and removes what it opened (a regular file owned by the job directory's owner), by
descriptor. What it writes of its own (metadata, replicas) is in directories no rank can write.

Per (job, rank) and kind, only the newest generation is kept (a restore uses the generation that just
ended), and of it the steps taken in the last RETAIN_S seconds, at least the newest KEEP_STEPS, and the
step the controller pinned. Keeping by time, the same on every node, is what makes the nodes' holdings
overlap: the controller sees each node's as of its last heartbeat, up to a second apart, which with
short steps is dozens of steps; it pins a step it sees on two nodes for every rank, and that step must
still be there when the pin arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import tempfile
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent import bulk, safefs
from phalanx import log, pki, tls
from phalanx.clock import Clock, RealClock, wait_for
from phalanx.names import NAME
from phalanx.request_guard import RequestGuard
from phalanx.rpc import CLIENT_OPTIONS, SERVER_OPTIONS, peer_host
from phalanx.v1 import node_pb2, snapshot_pb2, snapshot_pb2_grpc

logger = log.get("snapshots")

KEEP_STEPS = 4
RETAIN_S = 3.0  # snapshots younger than this are kept: over two heartbeat intervals of the controller's view
MAX_CHANNELS = 64  # channels to peers kept open at once (the oldest closed for a new one)
BULK_OPEN_S = 10.0  # asking a peer for a bulk ticket
NO_BULK_S = 60.0  # a peer whose bulk port was not reached (or that could not pull) is streamed to for this long
CHUNK = 512 << 10  # a stream message's data: well under MAX_REQUEST_BYTES with its header
REPLICA_WAIT_S = 10.0  # an eviction's in-memory checkpoint waits this long for its replica (then the ranks save
# durably, within what is left of the controller's checkpoint deadline: 30 s by default)
OUTCOMES_KEPT = 8  # per rank, the last replicas sent and how each went (a rank's writes may land out of order)
OWN, REPLICA = "own", "replica"
GRANTS = "grants.json"  # under meta/: job -> the nodes that may put and get its snapshots here
VIA_BULK, VIA_STREAM = "bulk port", "gRPC stream"  # how a snapshot was fetched from a peer (the latter a fallback)
_STEP = re.compile(r"^s(\d+)\.pt$")


class SnapshotError(Exception):
    """A snapshot that cannot be kept or handed out; the message says why."""


@dataclass(frozen=True)
class Key:
    job: str
    generation: int
    rank: int
    step: int

    def relative(self) -> Path:
        return Path(self.job) / f"g{self.generation}" / f"r{self.rank}" / f"s{self.step}.pt"

    def pb(self) -> snapshot_pb2.SnapshotKey:
        return snapshot_pb2.SnapshotKey(job=self.job, generation=self.generation, rank=self.rank, step=self.step)

    @classmethod
    def of(cls, message) -> Key:
        """The key a request names. Raises SnapshotError for a job id that could not be ours (it names a path)."""
        if not NAME.fullmatch(message.job):
            raise SnapshotError(f"job {message.job[:80]!r} is not a job id (1-63 letters, digits, '.', '_', '-')")
        return cls(message.job, message.generation, message.rank, message.step)


@dataclass(frozen=True)
class Held:
    key: Key
    kind: str  # OWN or REPLICA
    path: Path
    size: int
    crc32: int
    at: float = 0.0  # when this node took it in (monotonic)


def file_crc32(fd: int) -> int:
    """The CRC-32 of what the open descriptor `fd` holds, read from its start; `fd` is closed."""
    crc = 0
    with open(fd, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


class SnapshotStore:
    """The snapshots this node holds, bounded by `budget_bytes` (own and replicas together)."""

    def __init__(self, root: Path, budget_bytes: int, keep: int = KEEP_STEPS, clock: Clock | None = None,
                 retain_s: float = RETAIN_S) -> None:
        root = Path(os.path.abspath(root))
        self.root, self.budget, self.keep, self.retain_s = root, budget_bytes, keep, retain_s
        self._clock = clock or RealClock()
        self.own_dir = root / OWN
        self._held: dict[tuple[str, Key], Held] = {}
        self._pins: dict[str, tuple[int, int]] = {}  # job -> (generation, step) kept beyond the newest steps
        self._lives: dict[str, int] = {}  # job -> times launched or forgotten here (see accept_replica_by)
        self._grants: dict[str, frozenset[str]] = {}  # job -> the nodes that may put and get its snapshots here
        self._revoked: tuple[frozenset[str], dict[str, int]] = (frozenset(), {})  # serials; node name -> when
        # raises safefs.UnsafePath: a tree another account could change is not used at all
        safefs.secure_dir(root)
        for kind, mode in ((OWN, 0o755), (REPLICA, 0o700), ("meta", 0o700)):
            with contextlib.suppress(FileExistsError):
                os.mkdir(root / kind, mode)
            try:
                fd = safefs.open_dir(root / kind)  # a link there is refused, not followed
            except OSError as e:
                raise safefs.UnsafePath(f"{root / kind} is a link or not a directory ({e.strerror}): the agent does "
                                        "not use it (remove it)") from None
            with safefs.closing_fd(fd):
                if os.fstat(fd).st_uid not in safefs.trusted_uids():
                    raise safefs.UnsafePath(f"{root / kind} is owned by uid {os.fstat(fd).st_uid}, not by root or "
                                            "the agent's user")
                os.fchmod(fd, mode)  # an older agent's own/ was 1777 (its ranks made their own directories)
        self._rescan()
        self._load_grants()

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def used(self) -> int:
        return sum(h.size for h in self._held.values())

    def held(self) -> list[Held]:
        return sorted(self._held.values(), key=lambda h: (h.key.job, h.key.rank, h.key.generation, h.key.step, h.kind))

    def report(self) -> list[node_pb2.SnapshotHeld]:
        return [node_pb2.SnapshotHeld(job=h.key.job, generation=h.key.generation, rank=h.key.rank, step=h.key.step,
                                      size=h.size, replica=h.kind == REPLICA) for h in self.held()]

    def find(self, key: Key) -> Held | None:
        return self._held.get((OWN, key)) or self._held.get((REPLICA, key))

    def path(self, kind: str, key: Key) -> Path:
        return self.root / kind / key.relative()

    # -- who may put and get a job's snapshots here (the controller says: GrantSnapshots) -----------------------

    def grant(self, job: str, nodes: Iterable[str]) -> None:
        """The nodes that may put and get `job`'s snapshots here from now on (replacing what was granted), kept in the
        agent's own tree so that a restarted agent still knows."""
        if not NAME.fullmatch(job):
            raise SnapshotError(f"job {job[:80]!r} is not a job id")
        granted = frozenset(n for n in nodes if NAME.fullmatch(n))
        if self._grants.get(job) == granted:
            return
        self._grants[job] = granted
        self._save_grants()

    def granted(self, job: str, node: str) -> bool:
        return node in self._grants.get(job, ())

    def grantees(self, job: str) -> list[str]:
        return sorted(self._grants.get(job, ()))

    def revoke(self, serials: Iterable[str], names: dict[str, int]) -> None:
        """The node certificates the controller has revoked (the whole list): refused by this node's services."""
        self._revoked = (frozenset(serials), dict(names))
        self._save_grants()

    def revoked(self, node: str, cert: bytes) -> bool:
        """Whether node `node`'s certificate `cert` (PEM or DER) was revoked, as the controller last said."""
        try:
            return pki.revoked_by(*self._revoked, node, cert)
        except ValueError:  # not a certificate: nothing TLS let through, but refuse it rather than guess
            return True

    def _save_grants(self) -> None:
        path = self.root / "meta" / GRANTS
        tmp = path.with_name(f".{GRANTS}.tmp")
        tmp.write_text(json.dumps({"jobs": {job: sorted(nodes) for job, nodes in self._grants.items()},
                                   "revoked": {"serials": sorted(self._revoked[0]), "names": self._revoked[1]}}))
        os.replace(tmp, path)

    def _load_grants(self) -> None:
        try:
            data = json.loads((self.root / "meta" / GRANTS).read_text())
            self._grants = {job: frozenset(nodes) for job, nodes in data["jobs"].items()
                            if NAME.fullmatch(job) and isinstance(nodes, list)}
            revoked = data["revoked"]
            self._revoked = (frozenset(map(str, revoked["serials"])),
                             {str(n): int(t) for n, t in revoked["names"].items()})
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            self._grants, self._revoked = {}, (frozenset(), {})

    def _meta(self, kind: str, key: Key) -> Path:
        return self.root / "meta" / kind / key.relative().with_name(f"s{key.step}.pt.json")

    def _own_file(self, key: Key) -> tuple[int, int]:
        """(a descriptor of rank `key.rank`'s directory of the step, one of the step's file) under own/, walked with
        O_NOFOLLOW; the file must be a regular file owned by own/<job>'s owner (the job's account). Raises OSError
        (safefs.UnsafePath for a link, a FIFO or a file of another account's)."""
        with safefs.closing_fd(safefs.open_dir(self.own_dir)) as own, \
                safefs.closing_fd(safefs.walk(own, [key.job])) as job:
            owner = os.fstat(job).st_uid
            directory = safefs.walk(job, [f"g{key.generation}", f"r{key.rank}"])
        try:
            return directory, safefs.open_regular(directory, f"s{key.step}.pt", owner)
        except BaseException:
            os.close(directory)
            raise

    def open(self, held: Held) -> int:
        """A read descriptor of the held snapshot's file (an own one opened without following any path a rank can
        write). Raises OSError."""
        if held.kind == REPLICA:
            return os.open(held.path, safefs.FILE_FLAGS & ~os.O_NONBLOCK)
        directory, fd = self._own_file(held.key)
        os.close(directory)
        return fd

    def hand_over(self, held: Held) -> Path:
        """The path a rank of the job reads `held` from: the file itself, unless it is a replica (0600, the agent's)
        and the job runs as an account; then a copy the agent writes into the job's own directory, by descriptor
        (O_EXCL, never through a name the ranks made), owned by that account. Raises OSError."""
        if held.kind == OWN:
            return held.path
        with safefs.closing_fd(safefs.open_dir(self.own_dir)) as own:
            try:
                job = safefs.walk(own, [held.key.job])
            except FileNotFoundError:
                return held.path  # no directory made for an account: the ranks run as the agent's user
            with safefs.closing_fd(job):
                st = os.fstat(job)
                if st.st_uid == os.geteuid():
                    return held.path
                name = f"restore-r{held.key.rank}.pt"
                safefs.unlink_in(job, name)
                out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                              dir_fd=job)
                with open(out, "wb") as dst, open(self.open(held), "rb") as src:
                    os.fchown(out, st.st_uid, st.st_gid)
                    shutil.copyfileobj(src, dst, CHUNK)
        return self.own_dir / held.key.job / name

    def accept_own(self, key: Key, path: str, size: int, crc32: int) -> Held:
        """A rank's new snapshot, written where its key says. Raises SnapshotError (the file at the key's path is
        removed, unless the rank named another)."""
        expected = self.path(OWN, key)
        if Path(path) != expected:  # refused, and nothing removed: what is at `expected` was not written with it
            raise SnapshotError(f"snapshot of rank {key.rank} of {key.job} step {key.step} is at {path}, not "
                                f"{expected}")
        try:
            directory, fd = self._own_file(key)
        except OSError as e:  # a link, a FIFO, another account's file: nothing is removed, the rank's to clean
            self._held.pop((OWN, key), None)
            raise SnapshotError(f"snapshot {expected} is refused: {e.strerror or e}") from e
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise SnapshotError(f"snapshot {expected} holds {actual} bytes, not the {size} its rank wrote")
            self._fit(key, size, OWN)
        except (SnapshotError, OSError) as e:
            self._held.pop((OWN, key), None)  # a step written again and refused: what was held of it is gone too
            safefs.unlink_in(directory, expected.name)
            raise SnapshotError(str(e)) from e
        finally:
            os.close(fd)
            os.close(directory)
        return self._keep(Held(key, OWN, expected, size, crc32, self._clock.monotonic()))

    async def accept_replica(self, key: Key, size: int, crc32: int, chunks: AsyncIterator[bytes]) -> Held:
        """Write a peer's snapshot from its chunks, check its size and CRC-32, keep it. Raises SnapshotError."""
        async def fill(tmp: Path) -> tuple[int, int]:
            crc, written = 0, 0
            with open(tmp, "wb") as f:
                async for data in chunks:
                    written += len(data)
                    if written > size:
                        raise SnapshotError(f"replica of rank {key.rank} step {key.step} is longer than its {size} "
                                            "bytes")
                    crc = zlib.crc32(data, crc)
                    f.write(data)
            return written, crc

        return await self.accept_replica_by(key, size, crc32, fill)

    async def accept_replica_by(self, key: Key, size: int, crc32: int,
                                fill: Callable[[Path], Awaitable[tuple[int, int]]]) -> Held:
        """Keep a peer's snapshot that `fill` writes into the path it is given, returning the bytes written and
        their CRC-32, once both match. Raises SnapshotError, or what `fill` raises (nothing is kept then)."""
        self._fit(key, size, REPLICA)
        path = self.path(REPLICA, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own: two receives of one key (a restore asked again while the first, given up on, still
        # runs on its thread) never write into one file
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        lives = self._lives.get(key.job, 0)
        try:
            written, crc = await fill(tmp)
            if written != size or crc != crc32:
                raise SnapshotError(f"replica of rank {key.rank} of {key.job} step {key.step} arrived torn or "
                                    f"corrupt ({written} of {size} bytes, CRC-32 {crc:08x}, expected {crc32:08x})")
            # what happened while it arrived: a generation launched here or the job forgotten (what was on its way
            # may be of another life of the job id), a newer generation pinned or held
            if self._lives.get(key.job, 0) != lives:
                raise SnapshotError(f"replica of rank {key.rank} of {key.job} step {key.step} arrived after the job "
                                    "was launched again or ended here: not kept")
            self._check_current(key, REPLICA)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return self._keep(Held(key, REPLICA, path, size, crc32, self._clock.monotonic()))

    async def verified(self, key: Key) -> Held:
        """The held snapshot for `key` after checking its CRC-32 against the one recorded (read in a worker thread:
        a gigabyte would hold the agent's event loop, and its heartbeats, for a second). Raises SnapshotError."""
        held = self.find(key)
        if held is None:
            raise SnapshotError(f"no snapshot of rank {key.rank} of {key.job} step {key.step} (generation "
                                f"{key.generation}) here")
        try:
            fd = self.open(held)
        except OSError as e:
            self._drop(held)
            raise SnapshotError(f"snapshot {held.path} cannot be read: {e.strerror or e}; dropped") from e
        if await asyncio.to_thread(file_crc32, fd) != held.crc32:
            self._drop(held)
            raise SnapshotError(f"snapshot {held.path} does not match its CRC-32 (corrupt); dropped")
        return held

    def pin(self, job: str, generation: int, step: int) -> None:
        """Keep `step` of `generation` (the controller's newest step held twice over), releasing the previous pin."""
        self._pins[job] = (generation, step)
        for held in [h for h in self._held.values() if h.key.job == job and h.key.generation < generation]:
            self._drop(held)  # a whole step of a newer generation is held twice over: these are never restored
        newest: dict[tuple[str, int], Key] = {}  # (kind, rank) -> its newest snapshot
        for kind, key in self._held:
            best = newest.get((kind, key.rank))
            if key.job == job and (best is None or (key.generation, key.step) > (best.generation, best.step)):
                newest[(kind, key.rank)] = key
        for (kind, _rank), key in newest.items():
            for old in self._superseded(kind, key):
                self._drop(old)

    def launched(self, job: str, generation: int) -> None:
        """A generation of `job` starts here: anything held of it or a later generation comes from another life
        of the same job id (a controller whose store was reset) and must never be restored."""
        self._lives[job] = self._lives.get(job, 0) + 1
        for held in [h for h in self._held.values() if h.key.job == job and h.key.generation >= generation]:
            self._drop(held)
        if self._pins.get(job, (0, 0))[0] >= generation:
            del self._pins[job]

    def forget(self, keep_jobs: Iterable[str]) -> list[str]:
        """Drop every snapshot of jobs not in `keep_jobs` (ended, or gone from this node); the jobs dropped."""
        keep = set(keep_jobs)
        gone = sorted({h.key.job for h in self._held.values()} - keep)
        for held in [h for h in self._held.values() if h.key.job in gone]:
            self._drop(held)
        for kind in (OWN, REPLICA):
            for job in gone:  # rmtree works by descriptor and never follows a link the ranks made
                shutil.rmtree(self.root / kind / job, ignore_errors=True)
                shutil.rmtree(self.root / "meta" / kind / job, ignore_errors=True)
        for job in gone:
            self._pins.pop(job, None)
            self._lives[job] = self._lives.get(job, 0) + 1
        if any(job in self._grants for job in gone):
            for job in gone:
                self._grants.pop(job, None)
            self._save_grants()
        return gone

    # -- internals -----------------------------------------------------------------------------

    def _fit(self, key: Key, size: int, kind: str) -> None:
        """Make room for `size` bytes by dropping what the new snapshot supersedes; SnapshotError if it cannot fit
        (or a newer generation's snapshot of the rank is held already: this one is stale)."""
        self._check_current(key, kind)
        if size > self.budget:
            raise SnapshotError(f"a snapshot of rank {key.rank} of {key.job} takes {size / 1e6:.1f} MB, more than this "
                                f"node's whole snapshot budget of {self.budget / 1e6:.1f} MB (agent "
                                "snapshot_budget_mb): the job's state does not fit in memory here")
        free = self.budget - self.used
        if free >= size:
            return
        reclaimable = self._reclaimable(key, kind)
        if free + sum(h.size for h in reclaimable) < size:
            raise SnapshotError(f"a snapshot of rank {key.rank} of {key.job} ({size / 1e6:.1f} MB) does not fit in "
                                f"this node's snapshot budget: {self.used / 1e6:.1f} of {self.budget / 1e6:.1f} MB "
                                "are taken (agent snapshot_budget_mb)")
        for held in reclaimable:
            if free >= size:
                break
            self._drop(held)
            free += held.size

    def _check_current(self, key: Key, kind: str) -> None:
        """SnapshotError if `key` is stale: a newer generation's snapshot of the rank is held, or pinned."""
        if any(hk.job == key.job and hk.rank == key.rank and hk.generation > key.generation and k == kind
               for k, hk in self._held) or self._pins.get(key.job, (0, 0))[0] > key.generation:
            raise SnapshotError(f"snapshot of rank {key.rank} of {key.job} is of generation {key.generation}, and a "
                                "newer generation's is held: stale")

    def _reclaimable(self, key: Key, kind: str) -> list[Held]:
        """What may go to make room for `key`, of key's job only (another job's steps may be the ones a restore of
        it is about to load), in this order: the oldest taken in first, what only the retention keeps of key's
        generation (another rank's steps beyond its newest `keep`, not pinned) and any rank's copies of an older
        generation than it has here, key included (a spare's fetched snapshot, once the rank it restored
        snapshots here itself); then the rank's own older steps of `kind`, oldest first and its pinned step last
        (fewer steps kept, but the newest). A rank with nothing newer here keeps its older generation's steps:
        the restore of key's generation may still need them. Refusing `key` instead would turn the rank's
        snapshots off for the generation."""
        pinned = self._pins.get(key.job)
        newest_generation = {key.rank: key.generation}  # rank -> its newest generation here, either kind
        groups: dict[tuple[str, int], list[Held]] = {}  # (kind, rank) -> its snapshots
        for (k, hk), held in self._held.items():
            if hk.job == key.job and hk != key:
                newest_generation[hk.rank] = max(newest_generation.get(hk.rank, 0), hk.generation)
                groups.setdefault((k, hk.rank), []).append(held)
        spare: list[Held] = []
        for (k, rank), group in groups.items():
            group.sort(key=lambda h: (h.key.generation, h.key.step))
            if group[-1].key.generation < newest_generation[rank]:
                spare += group
            elif (k, rank) != (kind, key.rank):
                spare += [h for h in group if h.key.generation == key.generation][:-self.keep]
        spare = sorted((h for h in spare if (h.key.generation, h.key.step) != pinned), key=lambda h: h.at)
        first = {(h.kind, h.key) for h in spare}
        older = [h for h in self._mine(kind, key) if (h.key.generation, h.key.step) < (key.generation, key.step)
                 and (h.kind, h.key) not in first]
        return spare + sorted(older, key=lambda h: (h.key.generation, h.key.step) == pinned)

    def _superseded(self, kind: str, key: Key) -> list[Held]:
        """Of (job, rank)'s other snapshots of `kind`, those to drop once `key` is kept, oldest first: every older
        generation's, and of its own those neither among the newest `keep` steps (with `key`), nor younger than
        `retain_s`, nor pinned."""
        pinned = self._pins.get(key.job)
        mine = self._mine(kind, key)
        same = [h for h in mine if h.key.generation == key.generation]
        newest = same[len(same) - (self.keep - 1):] if self.keep > 1 else []
        old = self._clock.monotonic() - self.retain_s
        return [h for h in mine if h.key.generation < key.generation] + [
            h for h in same if h not in newest and h.at < old and (h.key.generation, h.key.step) != pinned]

    def _mine(self, kind: str, key: Key) -> list[Held]:
        """The other snapshots of `kind` of key's job and rank, oldest first."""
        return sorted((h for (k, hk), h in self._held.items()
                       if k == kind and hk.job == key.job and hk.rank == key.rank and hk != key),
                      key=lambda h: (h.key.generation, h.key.step))

    def _keep(self, held: Held) -> Held:
        meta = self._meta(held.kind, held.key)  # in the agent's own tree: no rank can put a link in its way
        meta.parent.mkdir(parents=True, exist_ok=True)
        tmp = meta.with_name(f".{meta.name}.tmp")
        tmp.write_text(json.dumps({"size": held.size, "crc32": held.crc32}))
        os.replace(tmp, meta)
        self._held[(held.kind, held.key)] = held
        for old in self._superseded(held.kind, held.key):
            self._drop(old)
        return held

    def _drop(self, held: Held) -> None:
        self._held.pop((held.kind, held.key), None)
        with contextlib.suppress(FileNotFoundError):
            self._meta(held.kind, held.key).unlink()
        if held.kind == REPLICA:
            with contextlib.suppress(FileNotFoundError):
                held.path.unlink()
            return
        with contextlib.suppress(OSError), safefs.closing_fd(safefs.open_dir(self.own_dir)) as own, \
                safefs.closing_fd(safefs.walk(own, [held.key.job, f"g{held.key.generation}", f"r{held.key.rank}"])) \
                as directory:
            safefs.unlink_in(directory, held.path.name)  # a link the rank put there goes, not what it points to

    def _rescan(self) -> None:
        """An agent that restarts finds the snapshots it held (tmpfs outlives it), from its own metadata; torn
        files and metadata without the other are removed."""
        for kind in (OWN, REPLICA):
            base = self.root / "meta" / kind
            for top, _dirs, files in os.walk(base):  # the agent's own tree; os.walk follows no link
                for name in files:
                    meta_path = Path(top) / name
                    m = re.fullmatch(r"s(\d+)\.pt\.json", name)
                    try:
                        job, gen, rank = meta_path.relative_to(base).parts[:3]
                        key = Key(job, int(gen[1:]), int(rank[1:]), int(m.group(1)))
                        meta = json.loads(meta_path.read_text())
                        held = Held(key, kind, self.path(kind, key), int(meta["size"]), int(meta["crc32"]),
                                    self._clock.monotonic())
                        with open(self.open(held)) as f:
                            if os.fstat(f.fileno()).st_size == held.size:
                                self._held[(kind, key)] = held
                                continue
                    except (OSError, ValueError, KeyError, TypeError, AttributeError):
                        pass
                    with contextlib.suppress(OSError):
                        meta_path.unlink()
        for kind in (OWN, REPLICA):
            # what is not held is a write that never finished or was never handed in: removed, by descriptor (fwalk
            # opens each directory beneath the last and follows no link; a link is removed, not what it points to)
            base = self.root / kind
            for top, _dirs, files, top_fd in os.fwalk(base, follow_symlinks=False):
                parts = Path(top).relative_to(base).parts
                if len(parts) != 3:
                    continue
                for name in files:
                    m = _STEP.match(name)
                    try:
                        held = m is not None and (kind, Key(parts[0], int(parts[1][1:]), int(parts[2][1:]),
                                                            int(m.group(1)))) in self._held
                    except ValueError:
                        held = False
                    if not held:
                        with contextlib.suppress(OSError):
                            safefs.unlink_in(top_fd, name)


# -- between agents ------------------------------------------------------------------------------

async def _chunks_of(fd: int, key: Key, size: int, crc32: int) -> AsyncIterator[snapshot_pb2.SnapshotChunk]:
    """The chunks of the snapshot open at `fd` (closed at the end)."""
    first = True
    with open(fd, "rb") as f:
        while True:
            data = f.read(CHUNK)
            if first:
                yield snapshot_pb2.SnapshotChunk(key=key.pb(), size=size, crc32=crc32, data=data)
                first = False
            elif data:
                yield snapshot_pb2.SnapshotChunk(data=data)
            if len(data) < CHUNK:
                return


async def _drain(request_stream: AsyncIterator | None) -> None:
    if request_stream is not None:
        async for _ in request_stream:
            pass


class SnapshotService(snapshot_pb2_grpc.SnapshotServiceServicer):
    """Peers put replicas here and get snapshots back."""

    def __init__(self, store: SnapshotStore, emit: Callable[..., None], nodes_only: bool = False,
                 bulk_server: bulk.BulkServer | None = None, puller: Replicator | None = None) -> None:
        self._store, self._emit = store, emit
        self._nodes_only = nodes_only  # served with mutual TLS: only the cluster's nodes may put or get
        self._bulk = bulk_server  # None: Open is refused and restores stream over Get
        self._puller = puller  # reads a Pull's snapshot from the caller's bulk port; None: Pull says "stream it"

    async def _refuse_non_nodes(self, context, request_stream: AsyncIterator | None = None) -> str:
        """The calling node's name; PERMISSION_DENIED unless the peer presented a node certificate ("" without
        TLS: a trial cluster, no names to check). A refused client stream is read to its end first: grpc.aio
        reports INTERNAL instead of our status to a client whose write races the status (grpc/grpc#36066), and
        only a misconfigured peer is ever refused, so the read costs nothing that matters."""
        if not self._nodes_only:
            return ""
        peer = tls.peer_identity(context)
        if peer is None or peer[0] != "node":
            who = f"{peer[0]} {peer[1]!r}" if peer else "a peer without a phalanx certificate"
            await _drain(request_stream)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"snapshot replicas are for the cluster's nodes only, not {who}")
        pem = context.auth_context().get("x509_pem_cert")
        if not pem or self._store.revoked(peer[1], pem[0]):
            await _drain(request_stream)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"the certificate of node {peer[1]!r} was revoked (the controller said so)")
        return peer[1]

    async def _require_grant(self, context, node: str, job: str, request_stream: AsyncIterator | None = None) -> None:
        """PERMISSION_DENIED unless the controller granted `node` the job's snapshots here (GrantSnapshots): any
        other node certificate, a stolen one included, reads and writes no job's snapshots but those of jobs it
        runs or restores."""
        if not self._nodes_only or self._store.granted(job, node):
            return
        await _drain(request_stream)
        granted = ", ".join(self._store.grantees(job)) or "no node (no grant from the controller yet)"
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            f"node {node!r} may not put or get snapshots of {job} here: the controller granted "
                            f"them to {granted}")

    async def Put(self, request_iterator, context) -> snapshot_pb2.PutReply:
        stream = request_iterator.__aiter__()
        node = await self._refuse_non_nodes(context, stream)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return snapshot_pb2.PutReply(ok=False, error="empty stream: no snapshot")
        try:
            key = Key.of(first.key)
        except SnapshotError as e:
            return snapshot_pb2.PutReply(ok=False, error=f"the first chunk names no snapshot: {e}")
        await self._require_grant(context, node, key.job, stream)

        async def data() -> AsyncIterator[bytes]:
            yield first.data
            async for chunk in stream:
                yield chunk.data

        try:
            await self._store.accept_replica(key, first.size, first.crc32, data())
        except (SnapshotError, OSError) as e:
            logger.warning("replica refused", job=key.job, rank=key.rank, step=key.step, error=str(e))
            return snapshot_pb2.PutReply(ok=False, error=str(e))
        return snapshot_pb2.PutReply(ok=True)

    async def _held(self, request: snapshot_pb2.SnapshotKey, context) -> Held:
        try:
            held = self._store.find(Key.of(request))
            if held is None:
                raise SnapshotError(f"no snapshot of rank {request.rank} of {request.job} step {request.step} "
                                    f"(generation {request.generation}) here")
        except SnapshotError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return held

    async def Get(self, request: snapshot_pb2.SnapshotKey, context):
        """Stream a held snapshot with its recorded CRC-32; the receiver checks it (a corrupt file is refused there,
        so reading it twice here would only halve the throughput)."""
        await self._require_grant(context, await self._refuse_non_nodes(context), request.job)
        held = await self._held(request, context)
        try:
            fd = self._store.open(held)
        except OSError as e:  # reclaimed since it was found
            await context.abort(grpc.StatusCode.NOT_FOUND, f"snapshot {held.path} is gone: {e.strerror or e}")
        async for chunk in _chunks_of(fd, held.key, held.size, held.crc32):
            yield chunk

    async def Open(self, request: snapshot_pb2.SnapshotKey, context) -> snapshot_pb2.BulkTicket:
        """A ticket to read a held snapshot from the bulk port (agent/bulk.py), for the calling node only."""
        node = await self._refuse_non_nodes(context)
        await self._require_grant(context, node, request.job)
        if self._bulk is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node has no snapshot bulk port; use Get")
        held = await self._held(request, context)
        try:
            token = self._bulk.ticket(self._store.open(held), held.size, node)
        except OSError as e:  # reclaimed since it was found
            await context.abort(grpc.StatusCode.NOT_FOUND, f"snapshot {held.path} is gone: {e.strerror or e}")
        except bulk.BulkError as e:  # too many outstanding: this one streams
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{e}; use Get")
        return snapshot_pb2.BulkTicket(size=held.size, crc32=held.crc32, port=self._bulk.port, token=token)


    async def Pull(self, request: snapshot_pb2.PullRequest, context) -> snapshot_pb2.PutReply:
        """Keep a replica read from the caller's bulk port: at the address the call came from (only the port is
        the caller's word), from the node its certificate names (with TLS)."""
        node = await self._refuse_non_nodes(context)
        if self._puller is None:
            return snapshot_pb2.PutReply(ok=False, stream=True, error="this node does not read replicas from bulk "
                                                                      "ports")
        try:
            key = Key.of(request.key)
            if not 0 < request.port < 65536:
                raise SnapshotError(f"port {request.port} is not a port")
        except SnapshotError as e:
            return snapshot_pb2.PutReply(ok=False, error=f"no snapshot to pull: {e}")
        await self._require_grant(context, node, key.job)
        host = peer_host(context.peer())
        who = tls.peer_identity(context) if self._nodes_only else None
        address = f"[{host}]:{request.port}" if ":" in host else f"{host}:{request.port}"
        source = f"{who[1]}@{address}" if who else address
        try:
            held = await self._puller.fetch_bulk(source, key)
        except (bulk.BulkError, SnapshotError, OSError) as e:
            # the caller's address unreachable from here (another interface), its port filtered, a refusal: the
            # stream is the caller's fallback either way, and it gives a refusal (the budget) its final word
            return snapshot_pb2.PutReply(ok=False, stream=True, error=str(e))
        if held is None:
            return snapshot_pb2.PutReply(ok=False, stream=True, error=f"{source} serves no bulk port")
        return snapshot_pb2.PutReply(ok=True)


class Replicator:
    """Streams each new own snapshot to the job's peer node, newest first: while a transfer runs, a newer
    snapshot of the same rank replaces any waiting one (a replica a step behind is worth more than a queue)."""

    def __init__(self, store: SnapshotStore, emit: Callable[..., None],
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self._store, self._emit = store, emit
        self._clock = store.clock
        self.credentials = credentials  # mutual TLS to peers with this node's certificate; None: plaintext
        self.tls_files: bulk.TlsFiles | None = None  # the same, for peers' bulk ports
        self.own_port = 0  # this node's SnapshotService port, when it serves a bulk port: peers Pull replicas from it
        self._stream_said = False
        self._no_bulk: dict[str, float] = {}  # source -> until when its bulk port is not tried (it was not reached)
        self._no_pull: dict[str, float] = {}  # peer -> until when it is not asked to Pull (it could not)
        self._receiving = 0  # bulk receives under way
        self.fetched: Counter[str] = Counter()  # how fetches came: VIA_BULK, VIA_STREAM
        self._closing: set[asyncio.Task] = set()
        self.peers: dict[str, str] = {}  # job -> [NODE@]HOST:PORT of its peer's SnapshotService
        self._waiting: dict[tuple[str, int], Held] = {}
        self._busy: set[str] = set()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._failing: set[str] = set()  # jobs whose last transfer failed (said once until one succeeds)
        self.sent = 0
        # (job, rank) -> the last keys sent to the peer, each with "" if the peer kept it, else why not
        self._outcome: dict[tuple[str, int], dict[Key, str]] = {}
        self._watchers: dict[Key, list[asyncio.Future[str]]] = {}  # keys whose replica someone awaits

    def offer(self, held: Held) -> None:
        peer = self.peers.get(held.key.job)
        if not peer:
            return
        replaced = self._waiting.get((held.key.job, held.key.rank))
        if replaced is not None and replaced.key != held.key:
            if (replaced.key.generation, replaced.key.step) > (held.key.generation, held.key.step):
                return  # a newer one waits already (a rank's writes may land out of order)
            self._settle(replaced.key, f"superseded by step {held.key.step} before it was sent")
        self._waiting[(held.key.job, held.key.rank)] = held
        if held.key.job not in self._busy:
            self._busy.add(held.key.job)
            asyncio.get_running_loop().create_task(self._send_all(held.key.job))

    async def _send_all(self, job: str) -> None:
        try:
            while True:
                ready = [k for k in self._waiting if k[0] == job]
                if not ready:
                    return
                held = self._waiting.pop(ready[0])
                if self._store.find(held.key) is None:
                    self._settle(held.key, "dropped from this node before it was sent")
                    continue  # superseded meanwhile
                await self._send(self.peers.get(job, ""), held)
        finally:
            self._busy.discard(job)

    def _stub(self, peer: str) -> snapshot_pb2_grpc.SnapshotServiceStub:
        """A stub on the one channel kept per peer, `NODE@HOST:PORT` (with TLS, the peer's certificate must name
        NODE) or `HOST:PORT`."""
        channel = self._channels.get(peer)
        if channel is None:
            node, _, address = peer.rpartition("@")
            # keepalive as on every channel of ours: a peer whose host died mid-transfer is given up in seconds,
            # not at the call's deadline of a minute or two
            if self.credentials is None:
                channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(address, self.credentials,
                                                  options=[*CLIENT_OPTIONS, *tls.target_name_options(node)])
            if len(self._channels) >= MAX_CHANNELS:  # peers come and go over a node's life; Pull names any port
                oldest = self._channels.pop(next(iter(self._channels)))
                # calls on it may finish (a Get has 120 s)
                closing = asyncio.get_running_loop().create_task(oldest.close(grace=150))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            self._channels[peer] = channel
        return snapshot_pb2_grpc.SnapshotServiceStub(channel)

    def no_peer(self, job: str) -> str:
        """"" when `job` has a peer node to keep its ranks' replicas, else why not."""
        return "" if self.peers.get(job) else f"{job} has no peer node on which to keep a replica"

    async def replicated(self, key: Key, timeout: float = REPLICA_WAIT_S) -> str:
        """"" once the job's peer node keeps the replica of `key` (sent already or still to be), else why not: no
        peer, the transfer failed, or not within `timeout` seconds."""
        sent = self._outcome.get((key.job, key.rank), {})
        if key in sent:
            return sent[key]
        if why := self.no_peer(key.job):
            return why
        if self._store.find(key) is None:
            return f"snapshot of rank {key.rank} step {key.step} is not held on this node"
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._watchers.setdefault(key, []).append(waiter)
        try:
            return await wait_for(self._clock, asyncio.shield(waiter), timeout)
        except TimeoutError:
            return f"its replica was not kept by {self.peers.get(key.job)} within {timeout:g}s"
        finally:
            watchers = self._watchers.get(key, [])
            if waiter in watchers:
                watchers.remove(waiter)
            if not watchers:
                self._watchers.pop(key, None)

    def _settle(self, key: Key, error: str) -> None:
        for waiter in self._watchers.pop(key, []):
            if not waiter.done():
                waiter.set_result(error)

    async def _send(self, peer: str, held: Held) -> None:
        error = await self._transfer(peer, held) if peer else "no peer node"
        sent = self._outcome.setdefault((held.key.job, held.key.rank), {})
        sent[held.key] = error
        while len(sent) > OUTCOMES_KEPT:
            del sent[next(iter(sent))]
        self._settle(held.key, error)

    async def _transfer(self, peer: str, held: Held) -> str:
        try:
            reply = await self._pull(peer, held)
            if reply is None:
                reply = await self._stub(peer).Put(_chunks_of(self._store.open(held), held.key, held.size, held.crc32),
                                                   timeout=60)
            error = "" if reply.ok else reply.error
        except Exception as e:  # gRPC's errors, a file dropped meanwhile: the next snapshot tries again
            if isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.PERMISSION_DENIED:
                error = f"{peer} refused it: PERMISSION_DENIED: {e.details()}"
            else:
                error = f"{peer} unreachable: {e.code().name if isinstance(e, grpc.RpcError) else e}"
        if error:
            if held.key.job not in self._failing:
                self._failing.add(held.key.job)
                self._emit("snapshot_replica_failed", f"replica of {held.key.job} rank {held.key.rank} step "
                           f"{held.key.step} not kept by {peer}: {error}", job=held.key.job)
            return error
        self._failing.discard(held.key.job)
        self.sent += 1
        return ""

    def forget(self, jobs: Iterable[str]) -> None:
        """Jobs whose snapshots this node gave back: nothing of theirs is sent or awaited any more."""
        gone = set(jobs)
        for job in gone:
            self.peers.pop(job, None)
        self._failing -= gone
        for job_rank in [k for k in self._outcome if k[0] in gone]:
            del self._outcome[job_rank]
        for job_rank in [k for k in self._waiting if k[0] in gone]:  # a send under way ends after its transfer
            self._settle(self._waiting.pop(job_rank).key, "its job's snapshots were dropped from this node")

    async def _pull(self, peer: str, held: Held) -> snapshot_pb2.PutReply | None:
        """Have the peer read `held` from this node's bulk port; None: Put it instead (this node serves no bulk
        port, the peer's agent predates Pull, or it could not reach the port)."""
        if not self.own_port or self._no_pull.get(peer, 0.0) > self._clock.monotonic():
            return None
        try:
            reply = await self._stub(peer).Pull(snapshot_pb2.PullRequest(key=held.key.pb(), port=self.own_port),
                                                timeout=60)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return None
        if reply.stream:
            self._no_pull[peer] = self._clock.monotonic() + NO_BULK_S
            if not self._stream_said:
                self._stream_said = True
                logger.warning("a snapshot peer did not read this node's bulk port; the replica goes by stream "
                               "(said once)",
                               peer=peer, reason=reply.error)
            return None
        return reply

    async def fetch(self, source: str, key: Key) -> Held:
        """Get `key` from the SnapshotService at `source` into this node's replicas: from its bulk port, else (a
        peer without one, a port the network does not let through) as a gRPC stream. Raises SnapshotError (a
        transfer that fails midway too: the caller asks the next node that holds it)."""
        started, via = self._clock.monotonic(), VIA_BULK
        try:
            held = await self.fetch_bulk(source, key)
        except bulk.BulkError as e:
            if e.started:  # the peer failed mid-transfer: likely gone, and the next holder is the better bet
                raise SnapshotError(f"fetching rank {key.rank} of {key.job} step {key.step} from {source} failed: "
                                    f"{e}") from e
            logger.warning("snapshot bulk port not reached; streaming the snapshot instead", source=source,
                           job=key.job, rank=key.rank, step=key.step, error=str(e))
            held = None
        if held is None:
            started, via = self._clock.monotonic(), VIA_STREAM
            held = await self.fetch_stream(source, key)
        took = max(self._clock.monotonic() - started, 1e-6)
        self.fetched[via] += 1
        logger.info("snapshot fetched", source=source, job=key.job, rank=key.rank, step=key.step, via=via,
                    mb=round(held.size / 1e6, 1), seconds=round(took, 3), gbps=round(held.size / took / 1e9, 2))
        return held

    async def fetch_bulk(self, source: str, key: Key) -> Held | None:
        """`key` read from the bulk port of `source`; None when it has none, when its port could not be reached in
        the last NO_BULK_S, or when this node receives MAX_CONNECTIONS already. Raises BulkError when the transfer
        fails, SnapshotError when the peer does not have the snapshot or sends a corrupt one."""
        if self._no_bulk.get(source, 0.0) > self._clock.monotonic() or self._receiving >= bulk.MAX_CONNECTIONS:
            return None
        node, _, address = source.rpartition("@")
        try:
            ticket = await self._stub(source).Open(key.pb(), timeout=BULK_OPEN_S)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION):
                return None
            raise SnapshotError(f"fetching rank {key.rank} of {key.job} step {key.step} from {source} failed: "
                                f"{e.code().name}: {e.details()}") from e
        receiver = bulk.Receiver(address.rpartition(":")[0], ticket.port, ticket.token, ticket.size, self.tls_files,
                                 node)

        async def fill(tmp: Path) -> tuple[int, int]:  # on a thread of its own: the event loop beats on
            try:
                return await asyncio.get_running_loop().run_in_executor(bulk.RECEIVERS, receiver.into, tmp)
            except asyncio.CancelledError:  # given up on (the rank's call, a Pull's deadline): stop reading now
                receiver.cancel()
                raise

        self._receiving += 1
        try:
            return await self._store.accept_replica_by(key, ticket.size, ticket.crc32, fill)
        except bulk.BulkError as e:
            if not e.started:  # its port refused or filtered: the stream, for a while, without asking again
                self._no_bulk[source] = self._clock.monotonic() + NO_BULK_S
            raise
        finally:
            self._receiving -= 1

    async def fetch_stream(self, source: str, key: Key) -> Held:
        """`key` streamed from `source` over gRPC. Raises SnapshotError."""
        stream = self._stub(source).Get(key.pb(), timeout=120)
        try:
            first = await stream.read()
            if first is grpc.aio.EOF:
                raise SnapshotError(f"{source} sent nothing for rank {key.rank} step {key.step}")

            async def data() -> AsyncIterator[bytes]:
                yield first.data
                while (chunk := await stream.read()) is not grpc.aio.EOF:
                    yield chunk.data

            return await self._store.accept_replica(key, first.size, first.crc32, data())
        except grpc.RpcError as e:
            raise SnapshotError(f"fetching rank {key.rank} of {key.job} step {key.step} from {source} failed: "
                                f"{e.code().name}: {e.details()}") from e

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


async def serve(listen: str, service: SnapshotService,
                credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, str]:
    """Serve peers at `listen` (host:port, port 0 = any free one; with `credentials`, mutual TLS); the server and
    the address it took."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RequestGuard()])
    snapshot_pb2_grpc.add_SnapshotServiceServicer_to_server(service, server)
    host = listen.rsplit(":", 1)[0]
    port = server.add_insecure_port(listen) if credentials is None else server.add_secure_port(listen, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {listen} for snapshot peers")
    await server.start()
    return server, f"{host}:{port}"


class Snapshots:
    """The agent's side of snapshots: what the ranks hand in (kept, replicated) and what a restore asks for."""

    def __init__(self, store: SnapshotStore, replicator: Replicator, emit: Callable[..., None]) -> None:
        self.store, self.replicator, self._emit = store, replicator, emit
        self.bulk: bulk.BulkServer | None = None  # the bulk port peers read this node's snapshots from
        # (job, generation)s told once that their snapshots do not fit: each generation's ranks turn their snapshots
        # off at the refusal, so a later generation refused again is news again
        self._refused: set[tuple[str, int]] = set()

    def launched(self, job: str, generation: int, peer: str) -> None:
        self.store.launched(job, generation)
        self.replicator.peers[job] = peer

    def taken(self, key: Key, path: str, size: int, crc32: int) -> str:
        """A rank's new snapshot: kept and offered to the peer; else why not (an event says so once per job)."""
        try:
            held = self.store.accept_own(key, path, size, crc32)
        except SnapshotError as e:
            if (key.job, key.generation) not in self._refused:
                self._refused.add((key.job, key.generation))
                self._emit("snapshot_refused", f"{key.job}: {e}; the job goes on with its disk checkpoints only",
                           job=key.job)
            return str(e)
        self.replicator.offer(held)
        return ""

    async def fetch(self, key: Key, source: str) -> Held:
        """The verified snapshot for `key` on this node, else fetched from `source`: `NODE@HOST:PORT`, or several,
        comma-separated, tried in turn (a copy that fails its CRC-32 or a peer that dies mid-transfer, and the next
        one is asked). Raises SnapshotError with every reason (an event says so)."""
        errors = []
        for where in ["", *filter(None, source.split(","))]:
            try:
                return await (self.store.verified(key) if not where else self.replicator.fetch(where, key))
            except Exception as e:  # SnapshotError, OSError, a source gRPC cannot even parse: all say why
                errors.append(str(e))
        why = "; ".join(errors)
        self._emit("snapshot_unavailable", f"{key.job}: snapshot of rank {key.rank} step {key.step} (generation "
                   f"{key.generation}) cannot be restored here: {why}", job=key.job)
        raise SnapshotError(why)
