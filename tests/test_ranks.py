"""A job's rank table in its two forms (phalanx/ranks.py): rows and packed read the same, and change the same."""

import random

import pytest

from controller.jobs import record
from controller.recovery import lifecycle
from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def table(job: pb.Job) -> list[tuple]:
    return table_of(ranktable.rows(job))


def table_of(rows) -> list[tuple]:
    return [(r.rank, r.node, r.local_rank, r.gpu, r.state, r.exit_code, r.generation, r.pid, r.wrapper_pid)
            for r in rows]


def pair(nodes: int, per: int, replicas: int = 0) -> tuple[pb.Job, pb.Job]:
    """The same job twice: its table in rows, and packed."""
    jobs = []
    for packed_from in (1 << 30, 1):
        job = pb.Job(id="job-3", generation=5, spec=pb.JobSpec(command=["x"], nodes=nodes, ranks_per_node=per,
                                                               replicas=replicas))
        job.nodes.extend(f"n{i}" for i in range(nodes))
        if replicas > 1:
            job.groups.extend(pb.ReplicaGroup(index=g, generation=5) for g in range(replicas))
        ranktable.build(job, pb.RANK_STATE_UNSPECIFIED, packed_from=packed_from)
        jobs.append(job)
    rows, packed = jobs
    assert not ranktable.is_packed(rows) and ranktable.is_packed(packed)
    return rows, packed


def test_both_forms_read_the_same_through_every_change_a_job_makes():
    """A randomized run of what the lifecycle and the job manager do to a table (a launch, exits with codes, lost
    ranks, pids from heartbeats, a replica group launched again on a spare, a group joining): after each, both forms
    read the same rows, and every question asked of a table has the same answer."""
    rng = random.Random(7)
    for _ in range(20):
        nodes, per, replicas = rng.choice([(6, 2, 3), (8, 1, 2), (4, 4, 0), (9, 2, 3)])
        rows, packed = pair(nodes, per, replicas)
        n = nodes * per
        for _ in range(60):
            op = rng.randrange(5)
            if op == 0:
                lo = rng.randrange(n)
                hi = rng.randrange(lo, n + 1)
                for job in (rows, packed):
                    ranktable.set_span(job, lo, hi, pb.RANK_STATE_RUNNING)
            elif op == 1:
                moves = {rng.randrange(n): (rng.choice([pb.RANK_STATE_EXITED, pb.RANK_STATE_LOST]),
                                            rng.choice([0, 0, 1, -15, 137])) for _ in range(rng.randrange(1, 4))}
                for job in (rows, packed):
                    ranktable.set_states(job, moves)
            elif op == 2:
                i, pid = rng.randrange(n), rng.randrange(0, 5000)
                for job in (rows, packed):
                    ranktable.set_pids(job, i, pid, pid + 1 if pid else 0)
            elif op == 3 and replicas > 1:
                g, generation = rng.randrange(replicas), rows.generation + 1
                k = nodes // replicas
                for job in (rows, packed):
                    job.generation = generation
                    job.nodes[g * k] = f"spare{generation}"
                    ranktable.renew(job, g * k * per, (g + 1) * k * per, generation)
                    job.groups[g].generation = generation
            elif op == 4:
                for job in (rows, packed):
                    ranktable.set_states(job, {})
            assert table(rows) == table(packed)  # (a packed table's rows made in one go, by its iterator)
            view = ranktable.rows(packed)
            assert table_of(view[i] for i in range(n)) == table(rows)  # (and one by one)
            assert [view.generation(i) for i in range(n)] == [r.generation for r in ranktable.rows(rows)]
            i, a = rng.randrange(nodes), rng.randrange(n)
            for start, stop in ((i * per, (i + 1) * per), (a, rng.randrange(a, n + 1)), (a, a + per)):
                assert [t for t in table_of(view[start:stop])] == table(rows)[start:stop]  # a node's, or any
            for state in (pb.RANK_STATE_UNSPECIFIED, pb.RANK_STATE_RUNNING, pb.RANK_STATE_EXITED,
                          pb.RANK_STATE_LOST):
                assert ranktable.any_in(rows, state) == ranktable.any_in(packed, state)
                for equal in (True, False):
                    looked = [r.rank for r in ranktable.rows(rows) if (r.state == state) == equal]  # row by row
                    assert [r.rank for r in ranktable.where(ranktable.rows(rows), state, equal)] == looked
                    assert [r.rank for r in ranktable.where(ranktable.rows(packed), state, equal)] == looked
            assert list(ranktable.numbers(rows)) == list(ranktable.numbers(packed)) == list(range(n))
            rank, node = rng.randrange(-1, n + 1), f"n{rng.randrange(nodes)}"
            assert ranktable.node_runs(rows, rank, node) == ranktable.node_runs(packed, rank, node)
            assert lifecycle.all_exited_zero(rows) == lifecycle.all_exited_zero(packed)
            assert lifecycle.group_rebuilt(rows) == lifecycle.group_rebuilt(packed)
            for r in (-1, 0, n - 1, n, rng.randrange(n)):
                assert lifecycle.rank_generation(rows, r) == lifecycle.rank_generation(packed, r) == \
                    lifecycle.generation_of(rows)(r) == lifecycle.generation_of(packed)(r)
            positions = lifecycle.node_positions(rows)
            assert [r.rank for r in lifecycle.ranks_on(rows, node, positions)] == \
                [r.rank for r in lifecycle.ranks_on(packed, node, positions)]
        # stored and loaded, each keeps its form and its rows (all but the pids, which the store leaves out)
        for job in (rows, packed):
            loaded = record.unpack(record.pack(job, packed_from=1))
            assert ranktable.is_packed(loaded) and [t[:7] for t in table(loaded)] == [t[:7] for t in table(job)]
            assert all(t[7:] == (0, 0) for t in table(loaded))


def test_a_packed_tables_rows_are_read_by_index_slice_and_from_the_end_and_a_rank_past_it_is_an_index_error():
    _, packed = pair(3, 2)
    ranktable.set_states(packed, {4: (pb.RANK_STATE_EXITED, 9)})
    view = ranktable.rows(packed)
    assert len(view) == 6 and view[-1].rank == 5 and view[4].exit_code == 9 and view[4].node == "n2"
    assert [r.rank for r in view[1:5:2]] == [1, 3] and view[2:2] == []
    with pytest.raises(IndexError):
        view[6]
    with pytest.raises(IndexError):
        view[-7]
    view[0].state = pb.RANK_STATE_LOST  # a copy: the table is changed through phalanx.ranks only
    assert ranktable.rows(packed)[0].state == pb.RANK_STATE_UNSPECIFIED


def test_a_new_generations_table_is_packed_from_packed_from_ranks_and_in_rows_below():
    job = pb.Job(id="job-1", generation=2, spec=pb.JobSpec(command=["x"], nodes=4, ranks_per_node=8))
    lifecycle.with_nodes(job, [f"n{i}" for i in range(4)], [])
    assert not ranktable.is_packed(job) and ranktable.count(job) == 32
    big = pb.Job(id="job-2", generation=2, spec=pb.JobSpec(command=["x"], nodes=128, ranks_per_node=8))
    lifecycle.with_nodes(big, [f"n{i}" for i in range(128)], [])
    assert ranktable.is_packed(big) and ranktable.count(big) == 1024 and not big.ranks
    assert len(big.SerializeToString()) < 3_000  # (its rows would be some 30 KB)
    lifecycle.with_nodes(big, [f"n{i}" for i in range(4)], [])  # a smaller generation: in rows again
    assert not ranktable.is_packed(big) and ranktable.count(big) == 32
