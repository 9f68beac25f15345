"""A job's record as the store keeps it: the Job message, with a large job's rank table packed.

A generation's rank table (lifecycle.rank_table) follows from the job's nodes: rank r runs on node r //
ranks_per_node as local rank and GPU r % ranks_per_node, in its replica group's generation or the job's. Written out
in full, a job of 16,384 nodes x 8 ranks is some 3.5-4.6 MB, more than etcd takes in one request
(--max-request-bytes, 1.5 MiB by default): such a job could not be committed at all. A record of PACKED_FROM ranks or
more is stored with only what the rows do not imply, in columns (`PackedRanks`: each rank's state; its exit code when
any rank's is not 0; its generation when any rank's is not its group's), about 0.33 MB at that size. Its ranks' pids
are left out: a running rank's node says them again at its next heartbeat, an ended rank's stay unknown (they are
shown, never decided on). A table that is not a generation's layout (no record this code writes) is stored in full,
as is a smaller job's, which a controller of an earlier release reads as before. In memory the table is always in
full: `unpack` rebuilds it as the record is loaded.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import attrgetter

from controller.recovery import lifecycle
from phalanx.v1 import common_pb2 as pb

PACKED_FROM = 1024  # ranks: from here on a record is stored packed


class BadRecord(ValueError):
    """A stored record whose packed rank table does not fit its job (its columns' lengths)."""


def _implied_generations(job: pb.Job, n: int) -> tuple[int, ...]:
    """Each rank's generation as its replica group's (lifecycle.group_span), else the job's."""
    if not job.groups:
        return (job.generation,) * n
    per, gens = job.spec.ranks_per_node, [job.generation] * n
    for g, group in enumerate(job.groups):
        span = lifecycle.group_span(job, g)
        gens[span.start * per:span.stop * per] = repeat(group.generation, len(span) * per)
    return tuple(gens)


def _column(job: pb.Job, name: str) -> tuple:
    """One field of every rank, in rank order (a pass in C: a Python step per rank would cost several times more)."""
    return tuple(map(attrgetter(name), job.ranks))


def pack(job: pb.Job, packed_from: int = PACKED_FROM) -> bytes:
    """The record's bytes: the job with its rank table packed (from `packed_from` ranks, when it is a generation's
    layout), else as it is."""
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
    if generations != _implied_generations(job, n):
        packed.generations.extend(generations)
    return out.SerializeToString()


def unpack(data: bytes) -> pb.Job:
    """The job a stored record holds, its rank table in full (pids 0 until the nodes report). Raises BadRecord for a
    packed table that does not fit its job (a record damaged in the store, not one this code wrote)."""
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
    states, codes = packed.states, tuple(packed.exit_codes)
    generations = tuple(packed.generations) or _implied_generations(job, n)
    job.ClearField("packed_ranks")
    base = states[0] if states else pb.RANK_STATE_UNSPECIFIED
    lifecycle.rank_table(job, base)  # (every rank RUNNING, most often: a pass over the few that are not)
    ranks = job.ranks
    for i in (i for i, state in enumerate(states) if state != base):
        ranks[i].state = states[i]
    for i in (i for i, code in enumerate(codes) if code):
        ranks[i].exit_code = codes[i]
    for i in (i for i, generation in enumerate(generations) if generation != job.generation):
        ranks[i].generation = generations[i]
    return job
