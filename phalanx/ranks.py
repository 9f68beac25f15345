"""A job's rank table, in one of two forms: rows (`Job.ranks`, one RankInfo a rank) or packed (`Job.packed_ranks`).

A generation's table follows from the job's nodes: rank r runs on node r // ranks_per_node as local rank and GPU
r % ranks_per_node, in its replica group's generation or the job's. Only each rank's state is its own (and an exit
code, a pid where one is known). A table of PACKED_FROM ranks or more is held packed, in memory as in the store: the
states one byte a rank, exit codes and pids in columns made when the first one that is not 0 comes. A recovery of a
job of 16,384 nodes then costs what changed, not a message per rank: a new generation's table is one bytes object, a
launch sets every state at once, and the ranks not RUNNING are found by a search in C. A smaller job's table is rows,
as it always was (what an earlier release reads, and what most jobs are).

Read a table through `rows(job)` (the rows, or a `Rows` view that makes each row as it is read); change it through
the functions here, never through a row of a packed table (it is a copy). The store leaves pids out
(controller/jobs/record.py): a running rank's node says them again at its next heartbeat.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import attrgetter

from phalanx.v1 import common_pb2 as pb

PACKED_FROM = 1024  # ranks: from here on a generation's table is packed


def is_packed(job: pb.Job) -> bool:
    return job.HasField("packed_ranks")


def count(job: pb.Job) -> int:
    """How many ranks the table has (a packed table's: its layout's, nodes x ranks_per_node, without reading its
    states: a bytes field is copied out at each read)."""
    return len(job.nodes) * job.spec.ranks_per_node if job.HasField("packed_ranks") else len(job.ranks)


def rows(job: pb.Job) -> Sequence[pb.RankInfo]:
    """The table's rows, in rank order: `job.ranks`, or a packed table's `Rows`."""
    return Rows(job) if job.HasField("packed_ranks") else job.ranks


def numbers(job: pb.Job) -> Iterable[int]:
    """Each rank's number, in table order (a packed table's: 0 .. count - 1)."""
    return range(count(job)) if job.HasField("packed_ranks") else [r.rank for r in job.ranks]


def any_in(job: pb.Job, state: int) -> bool:
    """Whether any rank of the table is in `state`."""
    if job.HasField("packed_ranks"):
        return 0 <= state < 256 and bytes((state,)) in job.packed_ranks.states
    return any(r.state == state for r in job.ranks)


def node_runs(job: pb.Job, rank: int, node: str) -> bool:
    """Whether `node` runs rank `rank` by the table (a generation's layout: rank r at r; a packed table's, node r //
    ranks_per_node of the job's nodes, looked up without a row)."""
    if job.HasField("packed_ranks"):
        per = job.spec.ranks_per_node
        return 0 <= rank < len(job.nodes) * per and job.nodes[rank // per] == node
    ranks = job.ranks
    return 0 <= rank < len(ranks) and ranks[rank].rank == rank and ranks[rank].node == node


def states(ranks: Sequence[pb.RankInfo]) -> bytes | None:
    """Each rank's state, one byte each, where `ranks` hold them so (a packed table's Rows, or spans of it): None
    otherwise (rows: read one by one)."""
    return getattr(ranks, "states", None)


def positions(job: pb.Job, state: int) -> list[int]:
    """The numbers of the ranks in `state`, in order (a packed table's: found in C, no row made)."""
    if not job.HasField("packed_ranks"):
        return [r.rank for r in job.ranks if r.state == state]
    if not 0 <= state < 256:
        return []
    return [m.start() for m in re.finditer(re.escape(bytes((state,))), job.packed_ranks.states)]


def where(ranks: Sequence[pb.RankInfo], state: int, equal: bool = True) -> list[pb.RankInfo]:
    """The rows of `ranks` whose state is `state` (or, not `equal`, is not), in order: found by a search in C over
    their states (one byte each), a row made for each found. Nearly always none are not RUNNING, in a job of 16,384
    ranks judged at every step."""
    return list(iter_where(ranks, state, equal))


def iter_where(ranks: Sequence[pb.RankInfo], state: int, equal: bool = True) -> Iterator[pb.RankInfo]:
    """`where`, each row made as it is reached (a caller that wants the first one makes one)."""
    table = states(ranks)
    if table is None:
        try:
            table = bytes(map(_STATE, ranks))
        except ValueError:  # a state past a byte (no RankState is): looked at one by one
            return (r for r in ranks if (r.state == state) == equal)
    if not 0 <= state < 256:
        return iter(()) if equal else iter(ranks)
    mark = bytes((state,))
    if not equal and table.count(mark) == len(table):
        return iter(())
    found = re.compile(re.escape(mark) if equal else b"[^" + re.escape(mark) + b"]", re.DOTALL)
    return (ranks[m.start()] for m in found.finditer(table))


_STATE = attrgetter("state")


def group_generation(job: pb.Job, rank: int) -> int:
    """The generation a rank of a generation's layout runs: its replica group's (the group of its node's position),
    else the job's."""
    if not job.groups or job.spec.replicas < 1 or job.spec.ranks_per_node < 1:
        return job.generation
    k = len(job.nodes) // job.spec.replicas
    g = rank // job.spec.ranks_per_node // k if k else len(job.groups)
    return job.groups[g].generation if g < len(job.groups) else job.generation


def implied_generations(job: pb.Job, n: int) -> tuple[int, ...]:
    """Each of `n` ranks' generation as its replica group's, else the job's (`group_generation`, for every rank)."""
    if not job.groups or job.spec.replicas < 1 or job.spec.ranks_per_node < 1:
        return (job.generation,) * n
    per, k, gens = job.spec.ranks_per_node, len(job.nodes) // job.spec.replicas, [job.generation] * n
    for g, group in enumerate(job.groups):
        start, stop = min(g * k * per, n), min((g + 1) * k * per, n)
        gens[start:stop] = repeat(group.generation, stop - start)
    return tuple(gens)


class Rows(Sequence):
    """A packed table read as rows: each RankInfo made as it is read (a copy: changes go through this module). The
    few rows a step reads cost a few microseconds each; a pass over every row costs what the rows would have. The
    states are read out once, at the first row (a bytes field is copied at each read: 128 KB at 131,072 ranks): a view
    is for reading the table as it is, not across a change to it."""

    __slots__ = ("_job", "_states")

    def __init__(self, job: pb.Job) -> None:
        self._job = job
        self._states: bytes | None = None

    @property
    def states(self) -> bytes:
        if self._states is None:
            self._states = self._job.packed_ranks.states
        return self._states

    def __len__(self) -> int:
        return count(self._job)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1:  # (a node's ranks, a heartbeat's: the columns read once for them)
                return list(self._make(start, stop))
            return [next(self._make(k, k + 1)) for k in range(start, stop, step)]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"rank {i} of {n}")
        return next(self._make(i, i + 1))

    def __iter__(self) -> Iterator[pb.RankInfo]:
        return self._make(0, len(self))

    @property
    def exit_codes(self) -> Sequence[int] | None:
        """Each rank's exit code, in rank order; None: every one 0."""
        return list(self._job.packed_ranks.exit_codes) or None

    def generation(self, i: int) -> int:
        """Rank i's generation, without making its row."""
        packed = self._job.packed_ranks
        return packed.generations[i] if packed.generations else group_generation(self._job, i)

    def _make(self, start: int, stop: int) -> Iterator[pb.RankInfo]:
        """The rows [start, stop), each made as it is reached; a node and its group's generation looked up once for
        its ranks (fields set one by one: half the time of keyword arguments)."""
        job = self._job
        packed, per, states = job.packed_ranks, job.spec.ranks_per_node, self.states
        codes, generations, pids, wrappers = packed.exit_codes, packed.generations, packed.pids, packed.wrapper_pids
        at, node, generation = -1, "", 0
        for i in range(start, stop):
            if i // per != at:
                at = i // per
                node, generation = job.nodes[at], 0 if generations else group_generation(job, i)
            row = pb.RankInfo()
            row.rank, row.node, row.generation = i, node, generations[i] if generations else generation
            if state := states[i]:
                row.state = state
            if local := i % per:
                row.local_rank = row.gpu = local
            if codes:
                row.exit_code = codes[i]
            if pids:
                row.pid, row.wrapper_pid = pids[i], wrappers[i]
            yield row


def build(job: pb.Job, state: int = pb.RANK_STATE_UNSPECIFIED, packed_from: int | None = None) -> None:
    """The table anew for the job's nodes and generation, each rank in `state`: packed from `packed_from` ranks
    (PACKED_FROM)."""
    per, generation = job.spec.ranks_per_node, job.generation
    del job.ranks[:]
    job.ClearField("packed_ranks")
    n = len(job.nodes) * per if per >= 1 else 0
    if n >= (PACKED_FROM if packed_from is None else packed_from):
        job.packed_ranks.states = bytes((state,)) * n
        return
    add = job.ranks.add
    for i, node in enumerate(job.nodes):
        for local in range(per):  # (fields set one by one, those not 0 only: half the time of keyword arguments)
            row = add()
            row.rank, row.node, row.generation = i * per + local, node, generation
            if local:
                row.local_rank = row.gpu = local
            if state:
                row.state = state


def _state_byte(state: int) -> int:
    if not 0 <= state < 256:
        raise ValueError(f"rank state {state} is not a RankState")
    return state


def set_states(job: pb.Job, moves: Mapping[int, tuple[int, int]]) -> None:
    """Rank (its index in the table) -> (state, exit code), all at once."""
    if not job.HasField("packed_ranks"):
        for i, (state, code) in moves.items():
            job.ranks[i].state, job.ranks[i].exit_code = state, code
        return
    packed = job.packed_ranks
    table = bytearray(packed.states)
    for i, (state, _) in moves.items():
        table[i] = _state_byte(state)
    packed.states = bytes(table)
    if not packed.exit_codes and not any(code for _, code in moves.values()):
        return
    if not packed.exit_codes:
        packed.exit_codes.extend(repeat(0, len(table)))
    for i, (_, code) in moves.items():
        packed.exit_codes[i] = code


def set_span(job: pb.Job, start: int, stop: int, state: int) -> None:
    """Every rank in [start, stop) to `state` (a launch: RUNNING), its exit code kept."""
    if not job.HasField("packed_ranks"):
        for row in job.ranks[start:stop]:
            row.state = state
        return
    packed = job.packed_ranks
    table = packed.states
    stop = min(stop, len(table))
    packed.states = table[:start] + bytes((_state_byte(state),)) * max(0, stop - start) + table[stop:]


def renew(job: pb.Job, start: int, stop: int, generation: int) -> None:
    """The ranks in [start, stop) anew as `generation` on their nodes (job.nodes as it is now): not started, no exit
    code, no pid. A replica group launched again; the job's other ranks keep theirs."""
    if not job.HasField("packed_ranks"):
        per = job.spec.ranks_per_node
        for i in range(start, stop):
            row = job.ranks[i]
            row.node, row.generation, row.state, row.exit_code, row.pid, row.wrapper_pid = (
                job.nodes[i // per], generation, pb.RANK_STATE_UNSPECIFIED, 0, 0, 0)
        return
    set_span(job, start, stop, pb.RANK_STATE_UNSPECIFIED)
    packed, n = job.packed_ranks, stop - start
    for column, value in ((packed.exit_codes, 0), (packed.pids, 0), (packed.wrapper_pids, 0),
                          (packed.generations, generation)):
        if column:
            column[start:stop] = [value] * n


def set_pids(job: pb.Job, i: int, pid: int, wrapper_pid: int) -> None:
    """Rank `i`'s pids as its node reports them (not stored: shown, never decided on)."""
    if not job.HasField("packed_ranks"):
        job.ranks[i].pid, job.ranks[i].wrapper_pid = pid, wrapper_pid
        return
    packed = job.packed_ranks
    if not packed.pids:
        if not pid and not wrapper_pid:
            return
        n = len(packed.states)
        packed.pids.extend(repeat(0, n))
        packed.wrapper_pids.extend(repeat(0, n))
    packed.pids[i], packed.wrapper_pids[i] = pid, wrapper_pid
