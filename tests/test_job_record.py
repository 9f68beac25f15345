"""A job's record as stored (controller/jobs/record.py): a large job's rank table packed, and read back as it was
(phalanx/ranks.py: in memory too, a table of PACKED_FROM ranks or more is packed)."""

import asyncio
import re
import uuid

import pytest

from controller.jobs import record
from controller.recovery import lifecycle
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py); the etcd test is of the etcd tier by its fixture


def job_of(nodes: int, per: int, replicas: int = 0, generation: int = 3) -> pb.Job:
    """A running job's record as the lifecycle writes it: every rank RUNNING, with pids its nodes reported."""
    job = pb.Job(id="job-7", state=pb.JOB_STATE_RUNNING, generation=generation,
                 spec=pb.JobSpec(command=["train"], nodes=nodes, ranks_per_node=per, replicas=replicas))
    lifecycle.with_nodes(job, [f"node-{i:05d}" for i in range(nodes)], ["spare-0"])
    n = ranktable.count(job)
    ranktable.set_span(job, 0, n, pb.RANK_STATE_RUNNING)
    for rank in range(n):
        ranktable.set_pids(job, rank, 4000 + rank, 3000 + rank)
    return job


def without_pids(job: pb.Job) -> pb.Job:
    """What a packed record keeps of `job`: everything but its ranks' pids (the nodes' next heartbeats say them)."""
    out = pb.Job()
    out.CopyFrom(job)
    for rank in out.ranks:
        rank.pid = rank.wrapper_pid = 0
    out.packed_ranks.ClearField("pids")
    out.packed_ranks.ClearField("wrapper_pids")
    if not out.packed_ranks.states:
        out.ClearField("packed_ranks")
    return out


def same(a: pb.Job, b: pb.Job) -> bool:
    """The same job with the same rank table, whichever form each holds it in (rows, or packed)."""
    def rest(job: pb.Job) -> pb.Job:
        out = pb.Job()
        out.CopyFrom(job)
        out.ClearField("ranks")
        out.ClearField("packed_ranks")
        return out

    def table(job: pb.Job) -> list[tuple]:
        return [(r.rank, r.node, r.local_rank, r.gpu, r.state, r.exit_code, r.generation, r.pid, r.wrapper_pid)
                for r in ranktable.rows(job)]
    return rest(a) == rest(b) and table(a) == table(b)


def test_a_large_jobs_rank_table_is_stored_packed_and_read_back_whole():
    job = job_of(16, 4)
    job.ranks[5].state, job.ranks[5].exit_code = pb.RANK_STATE_EXITED, 3
    job.ranks[9].state = pb.RANK_STATE_LOST
    data = record.pack(job, packed_from=64)
    stored = pb.Job.FromString(data)
    assert not stored.ranks and len(stored.packed_ranks.states) == 64 and len(stored.packed_ranks.exit_codes) == 64
    assert not stored.packed_ranks.generations  # every rank's is the job's
    loaded = record.unpack(data)
    assert ranktable.is_packed(loaded) and same(loaded, without_pids(job))  # packed, in memory too
    # all exit codes 0: no column for them
    job.ranks[5].exit_code = 0
    assert not pb.Job.FromString(record.pack(job, packed_from=64)).packed_ranks.exit_codes
    assert same(record.unpack(record.pack(job, packed_from=64)), without_pids(job))


def test_a_replica_group_rebuilt_since_keeps_its_generation_and_its_ranks_theirs():
    """A rebuilt group's ranks run a newer generation than the others': implied from the groups' own generations
    while they agree, written out per rank where one does not."""
    job = job_of(8, 2, replicas=4)
    job.generation = job.groups[2].generation = 4
    for i in lifecycle.group_span(job, 2):
        for local in range(2):
            job.ranks[i * 2 + local].generation = 4
    data = record.pack(job, packed_from=16)
    assert not pb.Job.FromString(data).packed_ranks.generations
    assert same(record.unpack(data), without_pids(job))
    job.ranks[0].generation = 2  # (not as its group says)
    data = record.pack(job, packed_from=16)
    assert len(pb.Job.FromString(data).packed_ranks.generations) == 16
    assert same(record.unpack(data), without_pids(job))


def test_a_small_job_or_a_table_out_of_its_layout_is_stored_in_full():
    job = job_of(4, 2)
    assert record.pack(job) == job.SerializeToString()  # under PACKED_FROM: as an earlier release stores it
    assert record.unpack(record.pack(job)) == job
    job.ranks[3].node = "node-00003"  # (rank 3 is node-00001's by the layout)
    assert record.pack(job, packed_from=1) == job.SerializeToString()
    odd = job_of(4, 2)
    odd.ranks[0].gpu = 1
    assert record.pack(odd, packed_from=1) == odd.SerializeToString()


def test_a_record_saved_again_by_an_earlier_release_is_read_by_its_table_not_by_the_columns_it_kept():
    """An earlier release reads a packed record without its ranks and keeps the columns it does not know when it
    saves the record again: the table it wrote then (a later generation's) is the one read, not the stale columns."""
    job = job_of(16, 4)
    stored = pb.Job.FromString(record.pack(job, packed_from=64))
    newer = job_of(16, 4, generation=9)
    newer.packed_ranks.CopyFrom(stored.packed_ranks)
    assert record.unpack(newer.SerializeToString()) == job_of(16, 4, generation=9)


def test_a_packed_table_that_does_not_fit_its_job_is_refused_with_the_job_named():
    job = job_of(16, 4)
    stored = pb.Job.FromString(record.pack(job, packed_from=64))
    stored.packed_ranks.states = stored.packed_ranks.states[:-1]
    why = "job-7: its stored rank table (63 ranks, 16 nodes x 4) does not fit its job"
    with pytest.raises(record.BadRecord, match=re.escape(why)):
        record.unpack(stored.SerializeToString())
    stored = pb.Job.FromString(record.pack(job, packed_from=64))
    stored.packed_ranks.generations.extend([3] * 5)
    with pytest.raises(record.BadRecord):
        record.unpack(stored.SerializeToString())
    stored = pb.Job.FromString(record.pack(job, packed_from=64))  # a state byte that is no RankState
    stored.packed_ranks.states = stored.packed_ranks.states[:9] + b"\xc8" + stored.packed_ranks.states[10:]
    with pytest.raises(record.BadRecord, match="holds a rank state that is none: 200"):
        record.unpack(stored.SerializeToString())


def test_a_job_of_16384_nodes_x_8_ranks_is_committed_to_etcd_and_a_new_controller_loads_it(etcd_server):
    """The record of a job of 131,072 ranks in full (3.5 MB) is more than etcd takes in one request; packed, the job
    manager commits it, and one started on the same store (a restart, a takeover) loads the job whole."""
    from controller.config import JobsConfig, LivenessConfig, RecoveryConfig
    from controller.errors import StoreError
    from controller.jobs.manager import JobManager
    from controller.jobs.topology import flat
    from controller.nodes.registry import Registry
    from controller.obs.events import EventHub
    from controller.recovery.entry import JobEntry
    from controller.store.base import JobRecord
    from controller.store.etcd import Etcd, EtcdStore
    from phalanx.clock import RealClock

    job = job_of(16_384, 8)
    assert ranktable.is_packed(job)  # (in memory, as the lifecycle makes it)
    ranktable.set_states(job, {77: (pb.RANK_STATE_EXITED, 1)})

    def manager(store):
        clock, hub = RealClock(), EventHub()
        return JobManager(store, Registry(store, clock, LivenessConfig(), hub), clock, hub, JobsConfig(),
                          lambda: flat([]), RecoveryConfig())

    async def go():
        store = EtcdStore(Etcd([etcd_server.endpoint]), f"/test/{uuid.uuid4().hex}/")
        full = pb.Job()  # the same table in rows (as an earlier release held it), 3.5 MB or more
        full.CopyFrom(job)
        full.ClearField("packed_ranks")
        full.ranks.extend(ranktable.rows(job))
        with pytest.raises(StoreError, match="RESOURCE_EXHAUSTED"):
            await store.commit(jobs=[JobRecord("job-8", "RUNNING", full.SerializeToString())])  # in full: refused
        jobs = manager(store)
        entry = jobs.entries[job.id] = JobEntry(pb.Job(id=job.id), 0)
        await jobs.save(entry, lifecycle.Commit(job, "job.running", f"{job.id} running"))
        assert entry.revision > 0
        again = manager(store)
        await again.load()
        assert again.entries[job.id].job == without_pids(job)
        await jobs.save(entry, lifecycle.Commit(full, "job.running", f"{job.id} running"))
        again = manager(store)
        await again.load()
        assert again.entries[job.id].job == without_pids(job)
        cancelled = pb.Job()  # every rank killed by SIGTERM: a column of 131,072 exit codes of -15
        cancelled.CopyFrom(job)
        cancelled.state = pb.JOB_STATE_CANCELLED
        ranktable.set_states(cancelled, dict.fromkeys(range(ranktable.count(job)), (pb.RANK_STATE_EXITED, -15)))
        await jobs.save(entry, lifecycle.Commit(cancelled, "job.cancelled", f"{job.id} cancelled"))
        damaged = pb.Job.FromString(record.pack(job_of(4, 2), packed_from=1))
        damaged.id, damaged.packed_ranks.states = "job-9", b"\x02"  # (one rank's state for 8 ranks)
        await store.commit(jobs=[JobRecord("job-9", "RUNNING", damaged.SerializeToString())])
        again = manager(store)
        await again.load()  # the damaged record is not loaded; the others are, and job-9 is never an id again
        assert again.entries[job.id].job == without_pids(cancelled) and "job-9" not in again.entries
        assert again._next_id == 10
        await store.close()
    asyncio.run(go())
