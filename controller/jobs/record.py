"""A job's record as the store keeps it: the Job message, with a large job's rank table packed.

A generation's rank table follows from the job's nodes (phalanx/ranks.py): rank r runs on node r // ranks_per_node as
local rank and GPU r % ranks_per_node, in its replica group's generation or the job's. Written out in full, a job of
16,384 nodes x 8 ranks is some 3.5-4.6 MB, more than etcd takes in one request (--max-request-bytes, 1.5 MiB by
default): such a job could not be committed at all. A table of PACKED_FROM ranks or more is held packed in memory
(`PackedRanks`: each rank's state; its exit code when any rank's is not 0; its generation when any rank's is not its
group's), and stored so, about 0.33 MB at that size. Its ranks' pids are left out of the store: a running rank's node
says them again at its next heartbeat, an ended rank's stay unknown (they are shown, never decided on). A table in
rows (a smaller job's; a large one's that an earlier release saved) is stored packed where it is a generation's
layout, else as it is; a smaller job's is stored in rows, which a controller of an earlier release reads as before.
`unpack` keeps the form it finds.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter

from phalanx import ranks as ranktable
from phalanx.ranks import PACKED_FROM, implied_generations
from phalanx.v1 import common_pb2 as pb

__all__ = ["PACKED_FROM", "BadRecord", "pack", "unpack"]

_RANK_STATES = frozenset(pb.RankState.values())


class BadRecord(ValueError):
    """A stored record whose packed rank table does not fit its job (its columns' lengths), or holds a state that is
    no RankState."""


def _column(job: pb.Job, name: str) -> tuple:
    """One field of every rank, in rank order (a pass in C: a Python step per rank would cost several times more)."""
    return tuple(map(attrgetter(name), job.ranks))


def pack(job: pb.Job, packed_from: int = PACKED_FROM) -> bytes:
    """The record's bytes: the job with its rank table packed (held so, or from `packed_from` ranks when it is a
    generation's layout), its pids left out; else as it is."""
    if ranktable.is_packed(job):
        if not job.packed_ranks.pids:
            return job.SerializeToString()
        out = pb.Job()
        out.CopyFrom(job)
        out.packed_ranks.ClearField("pids")
        out.packed_ranks.ClearField("wrapper_pids")
        return out.SerializeToString()
    n, per = len(job.ranks), job.spec.ranks_per_node
    if n < packed_from or per < 1 or n != len(job.nodes) * per:
        return job.SerializeToString()
    locals_ = tuple(range(per)) * len(job.nodes)
    if _column(job, "rank") != tuple(range(n)) or _column(job, "local_rank") != locals_ or \
            _column(job, "gpu") != locals_ or \
            _column(job, "node") != tuple(chain.from_iterable(zip(*[job.nodes] * per, strict=True))):
        return job.SerializeToString()
    out = pb.Job()
    out.CopyFrom(job)
    out.ClearField("ranks")
    packed = out.packed_ranks
    packed.states = bytes(_column(job, "state"))
    codes = _column(job, "exit_code")
    if any(codes):
        packed.exit_codes.extend(codes)
    generations = _column(job, "generation")
    if generations != implied_generations(job, n):
        packed.generations.extend(generations)
    return out.SerializeToString()


def unpack(data: bytes) -> pb.Job:
    """The job a stored record holds, its rank table as stored (packed, or rows). Raises BadRecord for a packed table
    that does not fit its job or holds a state that is none (a record damaged in the store, not one this code
    wrote: the heartbeat path would trip on such a state)."""
    job = pb.Job.FromString(data)
    if not job.HasField("packed_ranks"):
        return job
    if job.ranks:  # saved again by an earlier release, which kept the columns it did not know: its table is newer
        job.ClearField("packed_ranks")
        return job
    packed = job.packed_ranks
    per, n = job.spec.ranks_per_node, len(packed.states)
    if per < 1 or n != len(job.nodes) * per or len(packed.exit_codes) not in (0, n) or \
            len(packed.generations) not in (0, n):
        raise BadRecord(f"{job.id}: its stored rank table ({n} ranks, {len(job.nodes)} nodes x {per}) does not fit "
                        "its job")
    unknown = set(packed.states) - _RANK_STATES  # (a set of the bytes, in C)
    if unknown:
        raise BadRecord(f"{job.id}: its stored rank table holds a rank state that is none: {min(unknown)}")
    packed.ClearField("pids")  # (never stored: the nodes say them)
    packed.ClearField("wrapper_pids")
    return job
