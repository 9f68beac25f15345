"""An in-process controller (registry, jobs and the node service's session reader, on a MemoryStore,
under a FakeClock) and fake agents that answer its commands: recovery and fencing without processes.

`World.restart()` is a controller kill -9: every task of the old controller dies mid-await, sessions
end, and a new controller loads the same store. A `FakeAgent` keeps its ranks across that, like a real
agent whose ranks live in sessions of their own. It remembers every launch, and every launch of a
generation made while an older generation of the same job still ran on it (`overlaps`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from controller.api.node_service import NodeService
from controller.config import JobsConfig, LivenessConfig, RecoveryConfig
from controller.jobs.manager import JobManager
from controller.jobs.topology import flat
from controller.nodes.registry import Registry
from controller.nodes.session import Session
from controller.obs.events import EventHub
from controller.store.memory import MemoryStore
from phalanx.clock import FakeClock
from phalanx.v1 import common_pb2, node_pb2
from tests.eventually import eventually_async

pb = common_pb2
BEAT_S = 0.01  # virtual seconds between a fake agent's heartbeats, and between two looks of `World.until`
WAIT_S = 60.0  # real seconds: generous, a shared machine may be slow; no test asserts on time


class FakeContext:
    """The part of grpc.aio.ServicerContext that NodeService._read uses: read() from a queue."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()

    async def read(self):
        return await self.inbox.get()


class World:
    def __init__(self, jobs: JobsConfig | None = None, recovery: RecoveryConfig | None = None) -> None:
        self.clock = FakeClock()
        self.store = MemoryStore()
        self.jobs_cfg = jobs or JobsConfig(schedule_interval_s=0.02, stop_grace_s=0.0)
        self.recovery_cfg = recovery or RecoveryConfig(restart_backoff_s=0.001, max_restarts=10)
        self.agents: dict[str, FakeAgent] = {}
        self._tasks: list[asyncio.Task] = []
        self.registry: Registry
        self.jobs: JobManager
        self.service: NodeService

    async def start(self) -> None:
        """A controller process starting on the store: load, serve, resume recoveries."""
        self.hub = EventHub()
        self.registry = Registry(self.store, self.clock, LivenessConfig(), self.hub)
        self.jobs = JobManager(self.store, self.registry, self.clock, self.hub, self.jobs_cfg,
                               lambda: flat(e.record.name for e in self.registry.entries()), self.recovery_cfg)
        self.service = NodeService(self.registry, self.jobs)
        await self.registry.load()
        await self.jobs.load()
        self.jobs.executor.rest_after = lambda took: 0.0  # virtual time: no rest measured in the host's real CPU
        self._tasks = [asyncio.create_task(self.jobs.run(), name="scheduler"),
                       asyncio.create_task(self._liveness(), name="liveness"),
                       asyncio.create_task(self.clock.autojump(), name="autojump")]

    async def _liveness(self) -> None:
        """The liveness loop, a tick every BEAT_S of virtual time. The clock jumps to its next timer whenever every
        task is blocked (FakeClock.autojump), so a busy machine slows the world down but never makes anyone miss
        a beat; tests may jump further with `clock.advance`."""
        while True:
            await self.registry.tick()
            await self.clock.sleep(BEAT_S)

    async def kill(self) -> None:
        """kill -9: every task of the controller (scheduler, recoveries, launches, session readers, and whatever
        they started) dies where it is; the agents' sessions end with it."""
        for agent in self.agents.values():
            agent.controller_died()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def stop(self) -> None:
        await self.kill()
        for agent in self.agents.values():
            await agent.shut()

    def add(self, name: str, gpus: int = 2) -> FakeAgent:
        self.agents[name] = FakeAgent(self, name, gpus)
        return self.agents[name]

    def job(self, job_id: str = "job-1") -> pb.Job:
        return self.jobs.get(job_id)

    async def stored_state(self, job_id: str = "job-1") -> str:
        return next(r.state for r in await self.store.load_jobs() if r.id == job_id)

    async def kinds(self, job_id: str = "job-1") -> list[str]:
        return [e.kind for e in await self.store.list_events(job=job_id, limit=100_000)]

    async def launched_generations(self, job_id: str = "job-1") -> list[int]:
        """The generation of every placement and restart in the event log, in order."""
        return [int(e.message.split(" generation ")[1].split()[0])
                for e in await self.store.list_events(job=job_id, limit=100_000)
                if e.kind in ("job.placed", "job.restarting")]

    async def submit(self, nodes: int = 2, spares: int = 1) -> str:
        job = await self.jobs.submit(pb.JobSpec(command=["train"], nodes=nodes, ranks_per_node=1, spares=spares),
                                     "tester")
        return job.id

    async def until(self, predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
        """Look every BEAT_S of virtual time (the world cannot run past a state between two looks by more than a
        beat) until `predicate` holds; fail after `timeout` real seconds."""
        await eventually_async(predicate, what, timeout, describe=lambda: f"job: {self._describe()}",
                               pause=lambda: self.clock.sleep(BEAT_S))

    def _describe(self) -> str:
        try:
            return str({j.id: (pb.JobState.Name(j.state), j.generation, j.reason) for j in self.jobs.list(set())})
        except Exception as e:  # a description is for a failure message only
            return repr(e)


class FakeAgent:
    def __init__(self, world: World, name: str, gpus: int) -> None:
        self.world = world
        self.name = name
        self.gpus = gpus
        self.ranks: dict[tuple[str, int, int], node_pb2.RankStatus] = {}
        self.launches: list[tuple[str, int]] = []
        self.overlaps: list[str] = []
        self.fail_launch: set[int] = set()  # generations whose launch this agent refuses
        self.hold: set[str] = set()  # commands it receives and leaves unanswered (and undone)
        self.held: list[node_pb2.Command] = []
        self.received: list[str] = []  # the kind of every command that reached it
        self.commands: list[node_pb2.Command] = []
        self.progress: list[node_pb2.RankProgress] = []  # trainlib's reports, sent with the next heartbeat
        self.mute: set[str] = set()  # commands it carries out without the answer reaching the controller
        self.frozen = False  # SIGSTOP: no heartbeats, no commands read
        self.remap_pending: set[int] = set()  # GPUs with a pending row remap (FAILING)
        self.gpus_lost: set[int] = set()  # GPUs fallen off the bus (FAILED)
        self.ack_checkpoints = False  # its ranks commit every checkpoint asked of them, at the step asked
        self.snapshot_address = ""  # where it would serve snapshots (set before connect: a node that keeps them)
        self.snapshots: list[node_pb2.SnapshotHeld] = []  # the in-memory snapshots it says it holds
        self.session: Session | None = None
        self._tasks: list[asyncio.Task] = []
        self._pids = itertools.count(1000)

    def inventory(self) -> pb.NodeInventory:
        return pb.NodeInventory(hostname=self.name, gpu_backend=pb.GPU_BACKEND_KIND_SIM, address="127.0.0.1",
                                gpus=[pb.GpuInfo(index=i) for i in range(self.gpus)],
                                snapshot_address=self.snapshot_address)

    async def connect(self) -> None:
        """Register, open a session and start heartbeats, as the agent's link does."""
        registry = self.world.registry
        entry = await registry.register(self.name, self.inventory(), f"ipv4:127.0.0.1:{self.name}")
        session = Session(f"ipv4:127.0.0.1:{self.name}")
        registry.attach(self.name, entry.record.incarnation, session)
        context = FakeContext()
        self.session = session
        reader = asyncio.create_task(self.world.service._read(context, entry, session))
        self._tasks = [reader, asyncio.create_task(self._pump(session, context)),
                       asyncio.create_task(self._beat(context, session))]

    def controller_died(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        self.session = None

    async def shut(self) -> None:
        self.controller_died()

    def running(self, job: str = "job-1") -> list[node_pb2.RankStatus]:
        return [s for s in self.ranks.values() if s.job == job and s.state == pb.RANK_STATE_RUNNING]

    def crash(self, job: str, rank: int, code: int = 1) -> None:
        for status in self.running(job):
            if status.rank == rank:
                status.state, status.exit_code = pb.RANK_STATE_EXITED, code

    def heartbeat(self) -> node_pb2.Heartbeat:
        ranks = sorted(self.ranks.values(), key=lambda s: (s.job, s.generation, s.rank))
        gpus = [pb.GpuTelemetry(index=i, remap_pending=i in self.remap_pending, lost=i in self.gpus_lost)
                for i in range(self.gpus)]
        progress, self.progress = self.progress, []
        return node_pb2.Heartbeat(ranks=ranks, running_ranks=sum(s.state == pb.RANK_STATE_RUNNING for s in ranks),
                                  gpus=gpus, health_digest=1 + sum(1 << i for i in self.remap_pending)
                                  + sum(1 << (8 + i) for i in self.gpus_lost),
                                  progress=progress, snapshots=self.snapshots)

    async def _beat(self, context: FakeContext, session: Session) -> None:
        while not session.closed.is_set():
            if not self.frozen:
                context.inbox.put_nowait(node_pb2.AgentMessage(heartbeat=self.heartbeat()))
            await self.world.clock.sleep(BEAT_S)

    async def _pump(self, session: Session, context: FakeContext) -> None:
        while True:
            while self.frozen:
                await self.world.clock.sleep(BEAT_S)
            message = await session.outbox.get()
            if message is None:
                return
            if message.WhichOneof("body") != "command":
                continue
            command = message.command
            self.received.append(command.WhichOneof("body"))
            self.commands.append(command)
            if command.WhichOneof("body") in self.hold:
                self.held.append(command)
                continue
            result = self.carry_out(command)
            result.id = command.id
            if command.WhichOneof("body") in self.mute:
                continue
            context.inbox.put_nowait(node_pb2.AgentMessage(result=result))
            if command.WhichOneof("body") == "checkpoint" and self.ack_checkpoints:
                ask = command.checkpoint
                for status in self.running(ask.job):
                    if status.generation == ask.generation:
                        context.inbox.put_nowait(node_pb2.AgentMessage(checkpoint_ack=node_pb2.CheckpointAck(
                            job=ask.job, generation=ask.generation, rank=status.rank, request_id=ask.request_id,
                            step=ask.at_step)))

    def carry_out(self, command: node_pb2.Command) -> node_pb2.CommandResult:
        body = command.WhichOneof("body")
        if body == "reserve_port":
            return node_pb2.CommandResult(ok=True, port=29500)
        if body == "launch":
            launch = command.launch
            if launch.generation in self.fail_launch:
                return node_pb2.CommandResult(ok=False, error=f"launch of generation {launch.generation} refused")
            older = [s for s in self.running(launch.job) if s.generation < launch.generation]
            if older:
                self.overlaps.append(f"{launch.job} generation {launch.generation} launched on {self.name} while "
                                     f"generation {older[0].generation} still ran there")
            self.launches.append((launch.job, launch.generation))
            for rank in launch.ranks:
                self.ranks[(launch.job, launch.generation, rank.rank)] = node_pb2.RankStatus(
                    job=launch.job, generation=launch.generation, rank=rank.rank, state=pb.RANK_STATE_RUNNING,
                    pid=next(self._pids), gpu=rank.gpu)
            return node_pb2.CommandResult(ok=True)
        if body == "stop":
            stop = command.stop
            for status in self.running(stop.job):
                if stop.generation in (0, status.generation):
                    status.state, status.exit_code = pb.RANK_STATE_EXITED, -15
            return node_pb2.CommandResult(ok=True)
        return node_pb2.CommandResult(ok=True)
