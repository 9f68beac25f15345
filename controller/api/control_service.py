"""ControlService: what the CLI calls. Thin: validate, call the registry or the store, pack."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
import psutil

from controller import access, validation
from controller.api.auth import current_peer
from controller.api.rendezvous_service import TORCHRUN_PREFIX
from controller.api.rpc import unary
from controller.credentials import Credentials
from controller.errors import FailedPrecondition, InvalidArgument
from controller.jobs.manager import JobManager
from controller.nodes.registry import Registry
from controller.obs.events import EventHub, WatcherOverflow
from controller.store.base import EventRecord, Store
from phalanx import faults
from phalanx.rpc import DEFAULT_CHECKPOINT_DEADLINE_S, MAX_CHECKPOINT_DEADLINE_S
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc, node_pb2

_REPLAY_PAGE = 1000
LAG_REFRESH_S = 1.0  # GetStats recomputes the heartbeat lag percentiles at most this often (a view for people)


async def newest_events(store: Store, after_seq: int, limit: int, node: str = "", job: str = "",
                        by: str = "") -> list[EventRecord]:
    """The newest `limit` events with seq > after_seq (and the node, job and person asked for), oldest first:
    read backwards from the last seq in windows that double while the filters match little. Seqs are dense (the
    log is pruned from its old end only), so the first events after `lo` that match include every match up to
    `hi`."""
    found: list[EventRecord] = []
    hi, window = await store.last_event_seq(), limit
    while hi > after_seq and len(found) < limit:
        lo = max(after_seq, hi - window)
        page = [e for e in await store.list_events(after_seq=lo, limit=hi - lo, node=node, job=job)
                if e.seq <= hi and (not by or e.fields.get("by") == by)]
        found = page + found
        hi, window = lo, min(window * 2, 64 * limit)
    return found[-limit:]


LIST_PAGE_BYTES = 8 << 20  # a ListJobs page: half the transport's message limit (phalanx.rpc.MAX_TRANSPORT_BYTES)


def _page(jobs: list[common_pb2.Job], after_id: str) -> control_pb2.ListJobsResponse:
    """The jobs after `after_id` (in the order given: by number, then torchrun runs by id), as many as fit in
    LIST_PAGE_BYTES; next_after_id names the last one when more follow."""
    if after_id:
        ids = [j.id for j in jobs]
        start = ids.index(after_id) + 1 if after_id in ids else _after(ids, after_id)
        jobs = jobs[start:]
    page, size = control_pb2.ListJobsResponse(), 0
    for i, job in enumerate(jobs):
        shown = _shown(job)
        size += shown.ByteSize() + 8
        if size > LIST_PAGE_BYTES and page.jobs:
            page.next_after_id = jobs[i - 1].id
            break
        page.jobs.append(shown)
    return page


def _after(ids: list[str], after_id: str) -> int:
    """Where the jobs after `after_id` start when it is gone (deleted since the page before): after every job
    that sorts before it (job-N by N, then torchrun runs by id)."""
    def key(job_id: str) -> tuple[int, int, str]:
        number = job_id.removeprefix("job-")
        return (0, int(number), "") if number.isdigit() else (1, 0, job_id)
    mark = key(after_id)
    return sum(1 for job_id in ids if key(job_id) <= mark)


def _shown(job: common_pb2.Job) -> common_pb2.Job:
    """The job as the caller may see it: its environment's values (tokens, passwords) only to its owner and admins;
    a viewer or another user sees the names, each value "<hidden>". The token of its lighthouse's control port (what
    takes the lighthouse up, or stops it) is the controllers' alone: nobody is shown it."""
    who = access.caller()
    hide_env = not (who is None or who.role == access.ADMIN or who.name == job.user or not job.spec.env)
    if not hide_env and not job.lighthouse_token:
        return job
    shown = common_pb2.Job()
    shown.CopyFrom(job)
    shown.ClearField("lighthouse_token")
    if hide_env:
        for name in shown.spec.env:
            shown.spec.env[name] = HIDDEN
    return shown


HIDDEN = "<hidden>"


class ControlService(control_pb2_grpc.ControlServiceServicer):
    def __init__(self, registry: Registry, store: Store, hub: EventHub, jobs: JobManager,
                 controllers: Callable[[], Awaitable[control_pb2.ListControllersResponse]] | None = None,
                 credentials: Credentials | None = None, policy: access.Policy | None = None,
                 torchrun_jobs: Callable[[], list[common_pb2.Job]] = list) -> None:
        self._registry = registry
        self._torchrun_jobs = torchrun_jobs  # torchrun runs (the rendezvous), listed beside Phalanx's own jobs
        self._policy = policy
        self._credentials = credentials
        self._controllers = controllers
        self._jobs = jobs
        self._store = store
        self._hub = hub
        self._clock = jobs.clock
        self._started = self._clock.monotonic()
        self._lag, self._lag_at = [0.0, 0.0, 0.0], float("-inf")  # GetStats' lag percentiles and when computed
        self._process = psutil.Process()

    @unary
    async def ListNodes(self, request: control_pb2.ListNodesRequest, context):
        states = validation.node_states(request.states)
        entries = self._registry.entries()
        return control_pb2.ListNodesResponse(
            nodes=[e.to_proto() for e in entries if not states or e.record.state in states])

    @unary
    async def GetNode(self, request: control_pb2.GetNodeRequest, context):
        return self._registry.get(validation.node_name(request.name, "name")).to_proto()

    @unary
    async def DrainNode(self, request: control_pb2.DrainNodeRequest, context):
        name = validation.node_name(request.name, "name")
        with access.acting(_caller()):
            entry = await self._registry.drain(name, validation.reason(request.reason))
        return entry.to_proto()

    @unary
    async def UndrainNode(self, request: control_pb2.UndrainNodeRequest, context):
        with access.acting(_caller()):
            entry = await self._registry.undrain(validation.node_name(request.name, "name"))
        return entry.to_proto()

    @unary
    async def ListEvents(self, request: control_pb2.ListEventsRequest, context):
        if request.node:
            validation.node_name(request.node, "node")
        if request.job:
            validation.job_id(request.job, "job")
        limit = validation.page_limit(request.limit)
        if request.newest:
            events = await newest_events(self._store, request.after_seq, limit, request.node, request.job, request.by)
            return control_pb2.ListEventsResponse(events=[e.to_proto() for e in events])
        if not request.by:
            events = await self._store.list_events(after_seq=request.after_seq, limit=limit, node=request.node,
                                                   job=request.job)
            return control_pb2.ListEventsResponse(events=[e.to_proto() for e in events])
        found, last = [], request.after_seq  # a person's events: pages of the log, filtered
        while len(found) < limit and (page := await self._store.list_events(
                after_seq=last, limit=_REPLAY_PAGE, node=request.node, job=request.job)):
            found += [e for e in page if e.fields.get("by") == request.by][:limit - len(found)]
            last = page[-1].seq
        return control_pb2.ListEventsResponse(events=[e.to_proto() for e in found])

    async def WatchEvents(self, request: control_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext):
        try:
            validation.request_size(request)
            if request.node:
                validation.node_name(request.node, "node")
            if request.job:
                validation.job_id(request.job, "job")
        except InvalidArgument as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        watcher = self._hub.subscribe()  # before the replay, so nothing falls between the two
        try:
            last = request.after_seq
            while page := await self._store.list_events(after_seq=last, limit=_REPLAY_PAGE,
                                                        node=request.node, job=request.job):
                for event in page:
                    if not request.by or event.fields.get("by") == request.by:
                        yield event.to_proto()
                last = page[-1].seq
            while True:
                try:
                    event = await watcher.next()
                except WatcherOverflow:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"fell behind the event stream; resume with after_seq={last}")
                if event.seq <= last or (request.node and event.node != request.node) or (
                        request.job and event.job != request.job) or (
                        request.by and event.fields.get("by") != request.by):
                    continue
                last = event.seq
                yield event.to_proto()
        finally:
            watcher.close()

    @unary
    async def GetHealth(self, request: control_pb2.GetHealthRequest, context):
        entries = [self._registry.get(validation.node_name(request.node, "node"))] if request.node else \
            self._registry.entries()
        return control_pb2.GetHealthResponse(nodes=[e.health_proto() for e in entries])

    @unary
    async def GetTopology(self, request: control_pb2.GetTopologyRequest, context):
        entry = self._registry.get(validation.node_name(request.node, "node"))
        return entry.inventory().topology

    @unary
    async def InjectFault(self, request: control_pb2.InjectFaultRequest, context):
        entry = self._registry.get(validation.node_name(request.node, "node"))
        try:
            fault = faults.parse(request.fault)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        inventory = entry.inventory()
        if inventory.gpu_backend != common_pb2.GPU_BACKEND_KIND_SIM:
            kind = common_pb2.GpuBackendKind.Name(inventory.gpu_backend).removeprefix("GPU_BACKEND_KIND_")
            raise FailedPrecondition(f"node {request.node} has GPU backend {kind}; faults can only be injected into "
                                     "simulated GPUs")
        if request.gpu_index >= len(inventory.gpus):
            raise InvalidArgument(f"node {request.node} has {len(inventory.gpus)} GPUs; there is no GPU "
                                  f"{request.gpu_index}")
        if entry.session is None:
            raise FailedPrecondition(f"node {request.node} is not connected ({entry.record.state})")
        result = await entry.session.request(node_pb2.Command(inject=node_pb2.InjectFault(
            gpu_index=request.gpu_index, fault=str(fault))))
        message = result.message or f"node {request.node}: injected {fault} into GPU {request.gpu_index}"
        with access.acting(_caller()):
            event = EventRecord("node.inject", message, self._clock.wall_ns(), node=request.node,
                                fields={"gpu": str(request.gpu_index), "fault": str(fault), **access.by("node.inject")})
        self._hub.publish((await self._store.commit(events=[event])).events)
        return control_pb2.InjectFaultResponse(message=message)

    @unary
    async def SubmitJob(self, request: control_pb2.SubmitJobRequest, context):
        # The job's user is who authenticated (a certificate's or token's name), never what the request claims;
        # on an insecure trial cluster there is nobody to ask, and the claim stands.
        peer = current_peer()
        user = peer.name if peer is not None else request.user
        spec = common_pb2.JobSpec()
        spec.CopyFrom(request.spec)
        who = access.caller()
        if who is not None:
            spec.run_as = self._policy.account(who, spec.run_as)
        elif spec.run_as:
            raise FailedPrecondition("--as (run_as) needs an access file on the controller (security.access_file): "
                                     "without one, ranks run as the agent's user")
        with access.acting(_caller()):
            return await self._jobs.submit(spec, user)

    @unary
    async def ListJobs(self, request: control_pb2.ListJobsRequest, context):
        states = set(request.states)
        unknown = [s for s in states if s not in common_pb2.JobState.values() or s == 0]
        if unknown:
            raise InvalidArgument(f"states: {unknown[0]} is not a job state")
        torchrun = sorted((j for j in self._torchrun_jobs() if not states or j.state in states), key=lambda j: j.id)
        return _page([*self._jobs.list(states), *torchrun], request.after_id)

    @unary
    async def GetJob(self, request: control_pb2.GetJobRequest, context):
        torchrun = self._torchrun_job(request.id)
        return _shown(torchrun if torchrun is not None else self._jobs.get(validation.job_id(request.id)))

    def _torchrun_job(self, job_id: str) -> common_pb2.Job | None:
        """The torchrun run `job_id` names (torchrun-RUN_ID), or None if it names none."""
        if not job_id.startswith(TORCHRUN_PREFIX):
            return None
        return next((j for j in self._torchrun_jobs() if j.id == job_id), None)

    @unary
    async def CancelJob(self, request: control_pb2.CancelJobRequest, context):
        if self._torchrun_job(request.id) is not None:
            raise FailedPrecondition(f"{request.id} is a torchrun run: its workers are torchrun's, not Phalanx's; "
                                     "stop its torchrun agents (scancel, or kill them) to end it")
        job = self._jobs.get(validation.job_id(request.id))
        access.require_owner(job.user, job.id)
        with access.acting(_caller()):
            return _shown(await self._jobs.cancel(job.id))

    @unary
    async def ReadLogs(self, request: control_pb2.ReadLogsRequest, context):
        job = self._jobs.get(validation.job_id(request.job, "job"))
        access.require_owner(job.user, job.id)
        result, node = await self._jobs.read_logs(validation.job_id(request.job, "job"), request.rank, request.offset,
                                                  validation.log_chunk(request.max_bytes))
        offset = min(request.offset, result.size)
        return control_pb2.LogChunk(data=result.data, next_offset=offset + len(result.data), size=result.size,
                                    node=node)

    @unary
    async def CheckpointJob(self, request: control_pb2.CheckpointJobRequest, context):
        deadline = request.deadline_s or DEFAULT_CHECKPOINT_DEADLINE_S
        if not 0 < deadline <= MAX_CHECKPOINT_DEADLINE_S:
            raise InvalidArgument(f"deadline_s ({deadline}) must be between 0 and {MAX_CHECKPOINT_DEADLINE_S:g}")
        job = self._jobs.get(validation.job_id(request.id))
        access.require_owner(job.user, job.id)
        with access.acting(_caller()):
            step, seconds = await self._jobs.checkpoint(job.id, deadline)
        return control_pb2.CheckpointJobReply(step=step, seconds=seconds)

    @unary
    async def ListControllers(self, request: control_pb2.ListControllersRequest, context):
        if self._controllers is None:
            return control_pb2.ListControllersResponse(store="sqlite")
        return await self._controllers()

    @unary
    async def GetStats(self, request: control_pb2.GetStatsRequest, context):
        registry = self._registry
        now = self._clock.monotonic()
        if now - self._lag_at >= LAG_REFRESH_S:  # sorting the window's 65,536 samples takes ~25 ms of the loop
            self._lag, self._lag_at = registry.lag.percentiles(0.50, 0.99, 1.0), now
        p50, p99, pmax = self._lag
        cpu = self._process.cpu_times()
        return control_pb2.ControllerStats(
            nodes=len(registry.entries()),
            sessions=registry.sessions,
            heartbeats_total=registry.heartbeats_total,
            heartbeat_lag_p50_ms=p50,
            heartbeat_lag_p99_ms=p99,
            heartbeat_lag_max_ms=pmax,
            heartbeat_lag_samples=registry.lag.count,
            process_cpu_seconds=cpu.user + cpu.system,
            process_rss_bytes=self._process.memory_info().rss,
            uptime_s=self._clock.monotonic() - self._started,
        )

    # -- certificates ---------------------------------------------------------------------------------

    def _credentials_or_fail(self) -> Credentials:
        if self._credentials is None:
            raise FailedPrecondition("this controller keeps no credentials")
        return self._credentials

    @unary
    async def CreateEnrolToken(self, request: control_pb2.CreateEnrolTokenRequest, context):
        token, expires_ns, ca_hash = await self._credentials_or_fail().create_token(
            request.ttl_s, request.uses, request.description, _caller())
        return control_pb2.CreateEnrolTokenResponse(token=token, expires_unix_ns=expires_ns, ca_hash=ca_hash)

    @unary
    async def RevokeCertificate(self, request: control_pb2.RevokeCertificateRequest, context):
        message = await self._credentials_or_fail().revoke(request.name, request.role, request.serial,
                                                           request.reason, _caller())
        cut = 0
        if request.name and request.role in ("", "node") and self._registry.kick(
                request.name, grpc.StatusCode.UNAUTHENTICATED, f"the certificate of node {request.name!r} was revoked"):
            cut = 1
        if request.role in ("", "node"):  # every agent's snapshot port refuses it from now on, too
            told = node_pb2.Command(revocations=self._credentials_or_fail().node_revocations())
            for entry in self._registry.entries():
                if entry.session is not None:
                    self._jobs.executor.send(entry.record.name, told, f"revocations-{entry.record.name}")
        return control_pb2.RevokeCertificateResponse(message=message, sessions_cut=cut)


def _caller() -> str:
    peer = current_peer()
    return peer.name if peer is not None else "anonymous (insecure controller)"
