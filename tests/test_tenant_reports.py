"""What a node or a job's spec can make the controller do, in process (tests/jobs_world.py): a node speaks only
for the ranks it runs, and no standby runs the code of a job that runs as an account (issue 39). The real-process
attacks on the same rules are in tests/test_attacks.py."""

from __future__ import annotations

import asyncio

import pytest

from phalanx import ranks as ranktable
from phalanx.v1 import common_pb2 as pb
from phalanx.v1 import node_pb2
from tests.jobs_world import World
from tests.test_recovery_faults import asked, cluster, run, state

# the tier (tests/conftest.py); each test with rank tables in rows and packed (conftest.rank_tables)
pytestmark = [pytest.mark.inproc, pytest.mark.usefixtures("rank_tables")]


def test_a_node_cannot_speak_for_a_rank_it_does_not_run():
    """Issue 39: with node-b's own certificate and no rank of the job on it, forged checkpoint acks made `phalanx
    checkpoint` say every rank committed step 4242, and forged progress and rank states were taken in. Reports
    about a rank are believed only from the node that runs it, in the generation they name."""

    async def go():
        world = World()
        job_id = await cluster(world)
        job = world.job(job_id)
        a, b = (world.agents[n] for n in job.nodes)
        spare = world.agents[job.spares[0]]
        forged = spare.session is not None and world.registry.get(spare.name)
        # the spare says rank 0 (node a's) exited and made progress: neither is believed
        heartbeat = node_pb2.Heartbeat(
            ranks=[node_pb2.RankStatus(job=job_id, generation=1, rank=0, state=pb.RANK_STATE_EXITED, exit_code=1)],
            progress=[node_pb2.RankProgress(job=job_id, generation=1, rank=0, last_step=4242, steps=10,
                                            mean_step_s=0.01)])
        world.jobs.observe(forged, heartbeat)
        assert state(world, job_id) == "RUNNING" and not world.jobs.entries[job_id].tracks
        assert [r.state for r in ranktable.rows(world.job(job_id))] == [pb.RANK_STATE_RUNNING] * 2
        # a user's checkpoint: the spare's acks for both ranks are not counted; the ranks' own are
        asking = asyncio.create_task(world.jobs.checkpoint(job_id, 30))
        await world.until(lambda: asked(a) and asked(b), "the request at the job's nodes")
        request_id = asked(a)[-1].request_id
        for rank in (0, 1):
            world.jobs.checkpoint_ack(spare.name, node_pb2.CheckpointAck(job=job_id, generation=1, rank=rank,
                                                                         request_id=request_id, step=4242))
        assert not world.jobs.entries[job_id].checkpoint.acks and not asking.done()
        world.jobs.checkpoint_ack(a.name, node_pb2.CheckpointAck(job=job_id, generation=1, rank=1,
                                                                 request_id=request_id, step=4242))  # b's rank
        for agent, rank in ((a, 0), (b, 1)):
            world.jobs.checkpoint_ack(agent.name, node_pb2.CheckpointAck(job=job_id, generation=1, rank=rank,
                                                                         request_id=request_id, step=7))
        step, _ = await asking
        assert step == 7
        await world.stop()

    run(go())



def test_no_spare_is_asked_to_keep_standbys_of_a_job_that_runs_as_an_account():
    """A standby runs the job's program as the agent's user (root): a `user` whose job ran as its account got root
    on the spare through a torch.py beside its script. Of two jobs with a spare each, only the one that runs as the
    agent's user is prepared."""

    async def go():
        world = World()
        await world.start()
        for name in ("node-a", "node-b", "node-c", "node-d"):
            await world.add(name).connect()
        tenant = await world.jobs.submit(pb.JobSpec(command=["python", "train.py"], nodes=1, ranks_per_node=1,
                                                    spares=1, run_as="phx-alice"), "alice")
        trial = await world.jobs.submit(pb.JobSpec(command=["python", "train.py"], nodes=1, ranks_per_node=1,
                                                   spares=1), "tester")
        await world.until(lambda: all(world.job(j.id).state == pb.JOB_STATE_RUNNING for j in (tenant, trial)),
                          "both jobs running")
        prepared = lambda: [c.prepare for a in world.agents.values() for c in a.commands  # noqa: E731
                            if c.WhichOneof("body") == "prepare"]
        await world.until(lambda: any(p.job == trial.id for p in prepared()), "the trial job's spare prepared")
        assert {p.job for p in prepared()} == {trial.id}
        assert all(p.run_as == "" for p in prepared())
        await world.stop()

    run(go())


@pytest.mark.parametrize("run_as", ["", "root", "phx-bob"])
def test_a_job_record_is_launched_only_as_an_account_its_user_may_use(run_as):
    """run_as was checked only at submit: a record written to the store by anything else (a stolen certificate
    with write access to etcd, an older controller) with an empty run_as was launched as root by the next leader.
    The access file is asked again at every launch."""
    from controller.access import Identity, Policy

    async def go():
        world = World()
        await world.start()
        world.jobs.access_policy = Policy({"alice": Identity("alice", "user", ("phx-alice",))}, "access.toml")
        for name in ("node-a", "node-b"):
            await world.add(name).connect()
        job = await world.jobs.submit(pb.JobSpec(command=["train"], nodes=1, ranks_per_node=1, run_as=run_as),
                                      "alice")
        await world.until(lambda: "not launched" in world.job(job.id).reason, "the launch refused")
        assert not [a for a in world.agents.values() if "launch" in a.received]
        ok = await world.jobs.submit(pb.JobSpec(command=["train"], nodes=1, ranks_per_node=1, run_as="phx-alice"),
                                     "alice")
        await world.until(lambda: world.job(ok.id).state == pb.JOB_STATE_RUNNING, "alice's own account launched")
        await world.stop()

    run(go())


def test_the_controller_tells_agents_every_revoked_node_certificate():
    """What each agent's snapshot port refuses (issue 39): the node certificates revoked, by serial and by name, and
    no client's."""
    from controller.credentials import Credentials
    from controller.store.memory import MemoryStore
    from phalanx.clock import FakeClock

    async def go():
        credentials = Credentials(MemoryStore(), FakeClock(), "", "", 365, lambda events: None)
        await credentials.load()
        await credentials.revoke("gpu7", "node", "", "stolen", "ops")
        await credentials.revoke("", "node", "ab12", "lost", "ops")
        await credentials.revoke("alice", "client", "", "left", "ops")
        told = credentials.node_revocations()
        assert list(told.serials) == ["ab12"] and dict(told.names) == {"gpu7": credentials.clock.wall_ns()}

    run(go())


def test_one_user_cannot_fill_the_store_with_jobs():
    """Issue 39: job records had no quota: one `user` could submit until etcd's space ran out (NOSPACE stops the
    control plane for everyone). Past jobs.max_active_per_user unended jobs, a submission is refused, saying so;
    another user's goes on, and so does the first's once one of its jobs ends."""
    from controller.config import JobsConfig
    from controller.errors import FailedPrecondition

    async def go():
        world = World(jobs=JobsConfig(schedule_interval_s=0.02, stop_grace_s=0.0, max_active_per_user=3))
        await world.start()
        spec = lambda: pb.JobSpec(command=["train"], nodes=4, ranks_per_node=1)  # noqa: E731 (never placed: 0 nodes)
        jobs = [await world.jobs.submit(spec(), "alice") for _ in range(3)]
        with pytest.raises(FailedPrecondition, match="alice has 3 jobs that have not ended"):
            await world.jobs.submit(spec(), "alice")
        await world.jobs.submit(spec(), "bob")
        await world.jobs.cancel(jobs[0].id)
        await world.jobs.submit(spec(), "alice")
        await world.stop()

    run(go())


def test_ended_jobs_records_are_deleted_past_the_retention_and_ids_are_never_reused():
    """Issue 39: ended job records were never deleted: a `user` submitting and cancelling in a loop filled the
    store (and ListJobs broke past 16 MiB). Past jobs.ended_kept records, or older than jobs.ended_kept_s, the
    oldest ended ones are deleted with a `job.forgotten` event each; a running job never is, nor the newest job
    (the next controller counts ids on from the records it loads), and a deleted job's id says it is gone."""
    from controller.config import JobsConfig
    from controller.errors import NotFound
    from controller.jobs.manager import FORGET_EVERY_S

    async def go():
        world = World(jobs=JobsConfig(schedule_interval_s=0.02, stop_grace_s=0.0, ended_kept=2,
                                      ended_kept_s=3600.0))
        await world.start()
        spec = lambda: pb.JobSpec(command=["train"], nodes=4, ranks_per_node=1)  # noqa: E731 (never placed: 0 nodes)
        jobs = [(await world.jobs.submit(spec(), "alice")).id for _ in range(6)]
        for job_id in jobs[:5]:  # job-6 stays pending
            await world.jobs.cancel(job_id)
            world.clock.advance(1.0)
        world.clock.advance(FORGET_EVERY_S)
        await world.until(lambda: len(world.jobs.entries) == 3, "the 3 oldest ended records deleted")
        assert sorted(world.jobs.entries) == ["job-4", "job-5", "job-6"]
        with pytest.raises(NotFound, match="job-1 is no longer kept"):
            world.jobs.get("job-1")
        assert "job.forgotten" in await world.kinds("job-1")
        assert "job.submitted" in await world.kinds("job-1")  # its events stay
        await world.restart()
        assert sorted(world.jobs.entries) == ["job-4", "job-5", "job-6"]
        await world.jobs.cancel("job-6")
        world.clock.advance(3600.0 + FORGET_EVERY_S)  # all three past the age: all but the newest go
        await world.until(lambda: sorted(world.jobs.entries) == ["job-6"], "every ended record but the newest gone")
        await world.restart()
        assert (await world.jobs.submit(spec(), "alice")).id == "job-7"
        await world.stop()

    run(go())


def test_list_jobs_answers_in_pages_that_the_cli_follows(monkeypatch):
    """Issue 39: ListJobs answered every job in one message, and past the transport's 16 MiB `phalanx jobs` broke
    for everyone. It answers about 8 MiB a page, in id order, naming where the next page starts; the CLI follows
    the pages; a page's last job deleted meanwhile (ended_kept) does not lose the rest."""
    from cli.main import every_job
    from controller.api import control_service
    from phalanx.v1 import control_pb2

    monkeypatch.setattr(control_service, "LIST_PAGE_BYTES", 10_000)
    jobs = [pb.Job(id=f"job-{n}", spec=pb.JobSpec(command=["x" * 1000])) for n in range(1, 41)]
    jobs += [pb.Job(id="torchrun-a"), pb.Job(id="torchrun-b")]
    pages = []

    class Stub:
        def ListJobs(self, request, timeout):
            page = control_service._page(jobs, request.after_id)
            pages.append(len(page.jobs))
            return page

    assert [j.id for j in every_job(lambda rpc: rpc(Stub()))] == [j.id for j in jobs]
    assert len(pages) > 3 and all(n <= 10 for n in pages), pages
    first = control_service._page(jobs, "")
    gone = first.next_after_id  # deleted before the next page is asked for
    rest = [j for j in jobs if j.id != gone]
    assert control_service._page(rest, gone).jobs[0].id == jobs[len(first.jobs)].id
    assert control_service._page(rest, "torchrun-a").jobs[0].id == "torchrun-b"
    assert control_pb2.ListJobsResponse() == control_service._page([], "")


def test_no_node_enrols_at_one_controller_under_another_controllers_name(tmp_path):
    """Issue 39 (controller impersonation): enrolment refused only the enrolling controller's own names; with HA a
    node could enrol at ctl01 as "ctl02", a server certificate for the name its clients dial to reach ctl02. Every
    controller's name and advertised host (etcd's members) is refused now; other names still enrol."""
    from controller.credentials import Credentials
    from controller.errors import InvalidArgument
    from controller.store.memory import MemoryStore
    from phalanx import pki
    from phalanx.clock import FakeClock

    pki.init_ca(tmp_path, cluster="test")

    async def go():
        credentials = Credentials(MemoryStore(), FakeClock(), str(tmp_path / "ca.crt"), str(tmp_path / "ca.key"), 365,
                                  lambda events: None)
        await credentials.load()

        async def peers() -> set[str]:
            return {"ctl02", "ctl02.example.com", "ctl03"}

        credentials.peers = peers
        for name in ("ctl02", "CTL02.example.com"):
            token, _, _ = await credentials.create_token(3600, 1, "test", "ops")
            _, csr = pki.new_key_and_csr(name)
            with pytest.raises(InvalidArgument, match="is a controller's name"):
                await credentials.enrol(token, csr, "ipv4:10.0.0.7:1")
        token, _, _ = await credentials.create_token(3600, 1, "test", "ops")
        _, csr = pki.new_key_and_csr("gpu7")
        cert, _, _ = await credentials.enrol(token, csr, "ipv4:10.0.0.7:1")
        assert b"BEGIN CERTIFICATE" in cert

    run(go())


def test_revoking_a_certificate_revokes_what_was_renewed_from_it(tmp_path):
    """Issue 39: a node renewed its certificate, and revoking the stolen one by serial left the renewed one valid.
    Each renewal keeps the serials it descends from; revoking any of them revokes it, at the controller and at
    every agent's snapshot port."""
    from controller.credentials import Credentials, certificate_facts
    from controller.store.memory import MemoryStore
    from phalanx import pki
    from phalanx.clock import FakeClock

    pki.init_ca(tmp_path, cluster="test")

    async def go():
        credentials = Credentials(MemoryStore(), FakeClock(), str(tmp_path / "ca.crt"), str(tmp_path / "ca.key"), 365,
                                  lambda events: None)
        await credentials.load()
        token, _, _ = await credentials.create_token(3600, 1, "test", "ops")
        _, csr = pki.new_key_and_csr("gpu7")
        first, _, _ = await credentials.enrol(token, csr, "ipv4:10.0.0.7:1")
        _, csr = pki.new_key_and_csr("gpu7")
        second, _ = await credentials.renew("gpu7", csr, "ipv4:10.0.0.7:1", first)
        _, csr = pki.new_key_and_csr("gpu7")
        third, _ = await credentials.renew("gpu7", csr, "ipv4:10.0.0.7:1", second)
        assert credentials.revocation("node", "gpu7", third) is None
        await credentials.revoke("", "node", certificate_facts(first)[0], "stolen", "ops")
        assert credentials.revocation("node", "gpu7", third) is not None
        assert certificate_facts(third)[0] in credentials.node_revocations().serials

    run(go())
