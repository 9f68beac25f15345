"""NCCL flight-recorder dumps: where ranks write them, what they say, and which rank holds a job up.

torch's flight recorder keeps each rank's last N collectives; on a watchdog timeout, or when
someone writes to `<prefix><rank>.pipe`, it writes them to `<prefix><rank>`. The agent picks the
prefix for the ranks it launches so it knows where to look, summarises each dump into one
`NcclRankState` per rank, and `culprit()` compares the ranks: the one whose last started collective
is lowest is the one the others wait for.

A dump is a pickle written by another process, so it is untrusted input: it is read with an
unpickler that cannot reach any code, and it is size-capped.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx import log
from phalanx.errors import PhalanxError
from phalanx.v1 import common_pb2

logger = log.get("nccl")

DUMP_FILE_PREFIX = "nccl_trace_rank_"
MAX_DUMP_BYTES = 64 * 1024 * 1024
# torch writes a dump in place (no temp file and rename), so a file this young may still be growing.
SETTLE_NS = 1_000_000_000
DEFAULT_PG = "0"  # torch names the default process group "0" (desc "default_pg")

_DUMP_NAME = re.compile(rf"^{DUMP_FILE_PREFIX}(\d+)$")  # excludes `<prefix><rank>.pipe` and temp files
_STATES = frozenset({"scheduled", "started", "completed"})
_INT_LIMIT = 2**63


class DumpParseError(PhalanxError):
    """A file is not a flight-recorder dump we can read. The message is one line."""


def dump_prefix(state_dir: Path, job: str) -> Path:
    """The file prefix the job's ranks dump to; torch appends the rank number."""
    if not job or job in (".", "..") or "/" in job or "\0" in job:
        raise ValueError(f"job name {job!r} must be a single path component")
    return state_dir / "nccl" / job / DUMP_FILE_PREFIX


def rank_env(state_dir: Path, job: str) -> dict[str, str]:
    """Environment for a rank so its dumps (and its dump-trigger pipe) land where the watcher looks.

    Both temp-file names are set because torch renamed TORCH_NCCL_DEBUG_INFO_TEMP_FILE to
    TORCH_FR_DUMP_TEMP_FILE and reads either depending on version and backend.
    """
    prefix = dump_prefix(state_dir, job)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(prefix),
        "TORCH_FR_DUMP_TEMP_FILE": str(prefix),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(prefix),
    }


@dataclass(frozen=True)
class PgSummary:
    """Where one rank stands in one process group, as its dump says."""

    name: str
    desc: str
    entries: int
    last_enqueued_seq: int  # highest collective the rank's code reached
    last_started_seq: int  # highest it started (the enqueued one when the backend does not track starts)
    last_completed_seq: int
    last_op: str  # profiling name of the group's newest entry
    last_state: str  # scheduled, started or completed
    last_created_ns: int  # wall-clock creation time of the newest entry


@dataclass(frozen=True)
class DumpSummary:
    version: str
    groups: dict[str, PgSummary]  # by process-group name

    def default_group(self) -> PgSummary | None:
        """The group to report: the default PG if it has entries, else the busiest one."""
        for g in self.groups.values():
            if g.desc == "default_pg" or g.name == DEFAULT_PG:
                return g
        return max(self.groups.values(), key=lambda g: g.entries, default=None)


class _PlainUnpickler(pickle.Unpickler):
    """Loads only plain data (dict, list, tuple, str, bytes, numbers, bool, None).

    `find_class` is pickle's only way to reach code (GLOBAL, STACK_GLOBAL, INST and extension codes
    all go through it, and REDUCE/NEWOBJ/BUILD need what it returns); torch's C++ pickler never
    emits any of these, so refusing all of them costs nothing for a real dump.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a dump holds only plain data")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _load(data: bytes) -> Any:
    """Decode a pickle dump, or the JSON variant torch serves (`_dump_fr_trace_json`, the debug server)."""
    if data.lstrip()[:1] == b"{":
        return json.loads(data)
    return _PlainUnpickler(io.BytesIO(data)).load()


def _get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    value = obj.get(key, default)
    if value is ...:
        raise DumpParseError(f"{where} has no {key!r}")
    if value is not default and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise DumpParseError(f"{where}: {key!r} is {type(value).__name__}")
    if kind is int and not 0 <= value < _INT_LIMIT:  # the report's fields are 64-bit
        raise DumpParseError(f"{where}: {key!r} is out of range ({value})")
    return value


def _status(dump: dict[str, Any]) -> dict[int, dict[str, int]]:
    """pg_status by pg_id: counters that survive the ring buffer wrapping (-1: never)."""
    raw = _get(dump, "pg_status", dict, "dump", {})
    out: dict[int, dict[str, int]] = {}
    for pg_id, counters in raw.items():
        if isinstance(counters, dict) and str(pg_id).isdigit():
            out[int(pg_id)] = {k: v for k, v in counters.items() if isinstance(v, int) and -1 <= v < _INT_LIMIT}
    return out


def parse_dump(data: bytes) -> DumpSummary:
    """Summarise a dump per process group; any unreadable input raises DumpParseError, nothing else."""
    if len(data) > MAX_DUMP_BYTES:
        raise DumpParseError(f"{len(data)} bytes is over the {MAX_DUMP_BYTES}-byte limit for a dump")
    try:
        dump = _load(data)
    except Exception as e:  # a garbage file may raise almost anything while unpickling
        raise DumpParseError(f"not a flight-recorder dump ({_one_line(e)})") from None
    if not isinstance(dump, dict):
        raise DumpParseError(f"not a flight-recorder dump (top level is {type(dump).__name__}, not dict)")
    version = str(_get(dump, "version", (str, int, float), "dump"))
    entries = _get(dump, "entries", list, "dump", [])
    status = _status(dump)

    grouped: dict[str, list[dict[str, Any]]] = {}
    descs: dict[str, str] = {}
    pg_ids: dict[str, int] = {}
    for i, e in enumerate(entries):
        where = f"entry {i}"
        if not isinstance(e, dict):
            raise DumpParseError(f"{where} is {type(e).__name__}, not dict")
        pg = _get(e, "process_group", (tuple, list), where)
        if len(pg) != 2 or not all(isinstance(p, str) for p in pg):
            raise DumpParseError(f"{where}: 'process_group' is not a (name, desc) pair")
        for key in ("collective_seq_id", "time_created_ns"):
            _get(e, key, int, where)
        _get(e, "profiling_name", str, where)
        if _get(e, "state", str, where) not in _STATES:
            raise DumpParseError(f"{where}: unknown state {e['state']!r}")
        grouped.setdefault(pg[0], []).append(e)
        descs[pg[0]] = pg[1]
        if isinstance(e.get("pg_id"), int):
            pg_ids[pg[0]] = e["pg_id"]

    groups = {
        name: _summarise(name, descs[name], es, status.get(pg_ids.get(name, -1), {})) for name, es in grouped.items()
    }
    return DumpSummary(version=version, groups=groups)


def _int_or(value: Any, default: int) -> int:
    return value if isinstance(value, int) else default


def _done(e: dict[str, Any]) -> bool:
    # gloo never moves an entry past "scheduled"; it retires the entry when the work finishes.
    return e["state"] == "completed" or e.get("retired") is True


def _summarise(name: str, desc: str, entries: list[dict[str, Any]], status: dict[str, int]) -> PgSummary:
    colls = [e for e in entries if not e.get("is_p2p")]  # p2p ops have their own sequence

    def seqs(pred: Callable[[dict[str, Any]], bool]) -> list[int]:
        return [e["collective_seq_id"] for e in colls if pred(e)]

    enqueued = max([*seqs(lambda e: True), status.get("last_enqueued_collective", 0), 0])
    completed = max([*seqs(_done), status.get("last_completed_collective", 0), 0])
    # Starts are seen only with CUDA timing events (TORCH_NCCL_ENABLE_TIMING); without them a rank
    # that reached a collective is the best evidence that it entered it.
    tracks_start = status.get("last_started_collective", -1) >= 0 or any(
        e["state"] == "started" or e.get("time_discovered_started_ns") for e in entries
    )
    if tracks_start:
        started = max([*seqs(lambda e: e["state"] != "scheduled"), status.get("last_started_collective", 0), completed])
    else:
        started = enqueued
    newest = max(entries, key=lambda e: (_int_or(e.get("record_id"), -1), e["time_created_ns"]))
    return PgSummary(
        name=name,
        desc=desc,
        entries=len(entries),
        last_enqueued_seq=enqueued,
        last_started_seq=started,
        last_completed_seq=completed,
        last_op=newest["profiling_name"],
        last_state="completed" if _done(newest) else newest["state"],
        last_created_ns=newest["time_created_ns"],
    )


def read_dump(path: Path) -> DumpSummary:
    """Read and summarise one dump file, refusing oversized ones before reading them. The file is in a directory
    the job's ranks write: it is opened without following a link and without blocking on a FIFO (either may have
    replaced the regular file the scan saw), and what was opened must be a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise DumpParseError("not a regular file")
            size = st.st_size
            if size > MAX_DUMP_BYTES:
                raise DumpParseError(f"{size} bytes is over the {MAX_DUMP_BYTES}-byte limit for a dump")
            data = f.read(MAX_DUMP_BYTES + 1)
    except OSError as e:
        raise DumpParseError(f"cannot read ({_one_line(e)})") from None
    return parse_dump(data)


def to_state(summary: DumpSummary, *, job: str, rank: int, path: Path, dump_time_ns: int) -> common_pb2.NcclRankState:
    """The report for one rank; the age is measured at dump time, which is what the dump describes."""
    g = summary.default_group()
    state = common_pb2.NcclRankState(job=job, rank=rank, dump_path=str(path), dump_time_unix_ns=dump_time_ns)
    state.process_group = g.name if g else DEFAULT_PG
    if g is not None:
        state.last_started_seq = g.last_started_seq
        state.last_completed_seq = g.last_completed_seq
        state.last_op = g.last_op
        state.last_state = g.last_state
        state.last_age_s = max(0.0, (dump_time_ns - g.last_created_ns) / 1e9)
    return state


class FlightRecorderWatcher:
    """Finds `<state_dir>/nccl/<job>/nccl_trace_rank_<rank>` dumps and keeps one state per rank.

    A file is parsed again only when its (mtime, size) changes, so a scan of an idle directory costs
    a few stat calls. A bad file is logged once per version; the rank keeps its last good state.
    """

    def __init__(self, state_dir: Path, *, settle_ns: int = SETTLE_NS) -> None:
        self._root = state_dir / "nccl"
        self._settle_ns = settle_ns
        self._seen: dict[Path, tuple[int, int]] = {}  # path -> (mtime_ns, size) last parsed
        self._states: dict[Path, common_pb2.NcclRankState] = {}  # last good state per file
        self.parses = 0  # files parsed so far; lets a caller see that unchanged files are skipped

    def _files(self) -> dict[Path, tuple[str, int, os.stat_result]]:
        found: dict[Path, tuple[str, int, os.stat_result]] = {}
        try:
            jobs = [d for d in os.scandir(self._root) if d.is_dir(follow_symlinks=False)]
        except OSError:
            return found
        for job in jobs:
            try:
                names = [(f, _DUMP_NAME.match(f.name)) for f in os.scandir(job.path)]
                for f, m in names:
                    if m is None:
                        continue
                    st = f.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):  # never open a FIFO: it would block the scan
                        found[Path(f.path)] = (job.name, int(m.group(1)), st)
            except OSError:  # a job directory or file removed under us: next scan sees the result
                continue
        return found

    def scan(self, now_ns: int) -> list[common_pb2.NcclRankState]:
        """States of every rank with a readable dump, sorted by (job, rank)."""
        files = self._files()
        for gone in set(self._seen) - set(files):
            self._seen.pop(gone, None)
            self._states.pop(gone, None)
        for path, (job, rank, st) in files.items():
            key = (st.st_mtime_ns, st.st_size)
            if self._seen.get(path) == key or now_ns - st.st_mtime_ns < self._settle_ns:
                continue
            self._seen[path] = key
            self.parses += 1
            try:
                summary = read_dump(path)
            except DumpParseError as e:
                logger.warning("nccl_dump_unreadable", job=job, rank=rank, path=str(path), error=str(e))
                continue
            state = to_state(summary, job=job, rank=rank, path=path, dump_time_ns=st.st_mtime_ns)
            self._states[path] = state
            logger.info(
                "nccl_dump_read",
                job=job,
                rank=rank,
                process_group=state.process_group,
                last_started_seq=state.last_started_seq,
                last_completed_seq=state.last_completed_seq,
                last_op=state.last_op,
                last_state=state.last_state,
            )
        return sorted((_copy(s) for s in self._states.values()), key=lambda s: (s.job, s.rank))


def _copy(state: common_pb2.NcclRankState) -> common_pb2.NcclRankState:
    """Callers get copies, so editing a returned message cannot change what the watcher remembers."""
    out = common_pb2.NcclRankState()
    out.CopyFrom(state)
    return out


def culprit(states: Sequence[common_pb2.NcclRankState]) -> tuple[int, str] | None:
    """The rank the others wait for, with a sentence saying why; None when the ranks agree.

    Within each (job, process group), the rank whose last started collective is lowest has not
    entered the collective the furthest ranks are blocked in (torch's own reading of these dumps).
    Ties go to the lowest rank number, and the sentence names the others as far behind.
    """
    groups: dict[tuple[str, str], list[common_pb2.NcclRankState]] = {}
    for s in states:
        groups.setdefault((s.job, s.process_group), []).append(s)
    for (job, pg), members in sorted(groups.items()):
        ahead = max(s.last_started_seq for s in members)
        behind = min(s.last_started_seq for s in members)
        if ahead == behind:
            continue
        laggards = sorted(s.rank for s in members if s.last_started_seq == behind)
        leaders = sorted((s for s in members if s.last_started_seq == ahead), key=lambda s: s.rank)
        reason = (
            f"rank {laggards[0]} is behind in process group {pg!r} of job {job!r}: its last started collective "
            f"is #{behind}, while rank(s) {', '.join(str(s.rank) for s in leaders)} started #{ahead} "
            f"({leaders[0].last_op or 'unknown op'}) and wait for it"
        )
        if len(laggards) > 1:
            reason += f" (rank(s) {', '.join(map(str, laggards[1:]))} are as far behind)"
        return laggards[0], reason
    return None
