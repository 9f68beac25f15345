"""Every RPC of every Phalanx service, fuzzed against real daemons (DESIGN: "What bad input and faults get").

Requests come from strategies derived from the .proto descriptors (tests/proto_strategies.py), so a new
field, message, method or service is fuzzed without a line here, and `test_every_method_is_fuzzed` fails
until a new service is given an address. They go to a real controller with three agents and a few jobs
(so calls reach both "not found" and the paths behind it) and to one agent's Unix sockets (trainlib's
LocalService, NVRx's health check). Where a request type has SEEDS (valid requests), most of its cases
are a seed with a field or three mutated, so they get past validation to what lies behind it; the rest
are random messages. One case in three is bytes that do not decode.

Every answer must be OK or a status a person can act on, with a message: never UNKNOWN or INTERNAL
(a handler that raised), never DEADLINE_EXCEEDED unless the call waits by design. Afterwards every
daemon is alive and quiet in its log, the CLI lists nodes and jobs, a fresh job runs, and the controller
restarts from its store with the same jobs.

`make test` runs QUICK_CASES cases (about 25 s on two cores); the full FULL_CASES run (about 70 s) is
marked slow and runs on a cluster of its own: `.venv/bin/python -m pytest -m slow tests/test_fuzz_rpc.py`,
or `PHALANX_SLOW=1 make test` for everything. PHALANX_FUZZ_CASES=N overrides either count, and with
PHALANX_FUZZ_TRACE=N (and -s) the summary lists each method's N most common answers.
Examples are derandomized: a failure reproduces on every run, and hypothesis prints the falsifying draws.
"""

from __future__ import annotations

import collections
import functools
import importlib
import math
import os
import pkgutil
import signal
import sqlite3
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import phalanx.nvhcd
import phalanx.v1
from controller.server import SERVICES as CONTROLLER_SERVICES
from phalanx.rpc import MAX_REQUEST_BYTES, MAX_TRANSPORT_BYTES
from phalanx.v1 import common_pb2, control_pb2, local_pb2, node_pb2, rendezvous_pb2
from tests import proto_strategies as ps
from tests.cluster import Cluster

# the tier (tests/conftest.py); the module runs on one xdist worker (tests/conftest.py SAME_WORKER): its last test
# checks what every fuzz test before it sent
pytestmark = pytest.mark.procs

QUICK_CASES = 2_000
FULL_CASES = 10_000
AGENTS = ["n1", "n2", "n3"]
VICTIM = "n3"  # faults are injected here; the long-running job is kept off it
FUZZ_NODES = [f"fz-{i}" for i in range(4)]  # registered and sessioned by the fuzzer only
CALL_TIMEOUT_S = 5.0   # a call that does not wait must answer well within this
WAIT_TIMEOUT_S = 0.1   # a call that waits by design is cut short here (DEADLINE_EXCEEDED is then fine)

# Where each service is served: a new service fails test_every_method_is_fuzzed until it is listed.
WHERE = {
    "phalanx.v1.ControlService": "controller",
    "phalanx.v1.NodeService": "controller",
    "phalanx.v1.RendezvousService": "controller",
    "grpc.health.v1.Health": "controller",
    "phalanx.v1.EnrolService": "controller",
    "phalanx.v1.LocalService": "local",
    "phalanx.v1.SnapshotService": "snapshot",
    "nvhcd.HealthCheckService": "nvrx",
}
# Calls that wait by design: for a commit, a round to form, the next event, health change or checkpoint request.
WAITS = {"phalanx.v1.ControlService/WatchEvents", "phalanx.v1.ControlService/CheckpointJob",
         "phalanx.v1.RendezvousService/AwaitRound", "grpc.health.v1.Health/Watch", "phalanx.v1.LocalService/Watch"}
# Cases per method, relative: the session and the calls with the most behind them get more.
WEIGHT = {"phalanx.v1.NodeService/Session": 4, "phalanx.v1.NodeService/Register": 2,
          "phalanx.v1.ControlService/SubmitJob": 2, "phalanx.v1.ControlService/InjectFault": 4,
          "phalanx.v1.RendezvousService/Join": 2, "phalanx.v1.LocalService/Report": 2}

# Answers of the standard health service (grpcio-health-checking), not ours to change.
LIBRARY = {
    ("grpc.health.v1.Health/Check", grpc.StatusCode.NOT_FOUND),   # unknown service: bare, as the protocol says
    ("grpc.health.v1.Health/List", grpc.StatusCode.UNIMPLEMENTED),  # not implemented by grpcio-health-checking
}

OK = grpc.StatusCode.OK
ALLOWED = {OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}


def all_services() -> dict[str, object]:
    """Every service any generated module declares, and the standard health service the controller serves."""
    out = {}
    for package in (phalanx.v1, phalanx.nvhcd):
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.endswith("_pb2"):
                file = importlib.import_module(f"{package.__name__}.{module.name}").DESCRIPTOR
                out.update({s.full_name: s for s in file.services_by_name.values()})
    out["grpc.health.v1.Health"] = health_pb2.DESCRIPTOR.services_by_name["Health"]
    return out


@dataclass(frozen=True)
class Method:
    service: str
    descriptor: object

    @property
    def path(self) -> str:
        return f"{self.service}/{self.descriptor.name}"

    @property
    def waits(self) -> bool:
        return self.path in WAITS


METHODS = [Method(name, m) for name, s in sorted(all_services().items()) if name in WHERE for m in s.methods]
BY_PATH = {m.path: m for m in METHODS}
_total_weight = sum(WEIGHT.get(m.path, 1) for m in METHODS)


def budget(method: Method, total: int) -> int:
    return max(20, math.ceil(total * WEIGHT.get(method.path, 1) / _total_weight))


# -- what the fuzzer knows of the cluster: values that get past "not found" ---------------------------------------

def known_or_random(*known: object) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(known), st.sampled_from(known), ps.text())


def small_or_random(bits: int = 64) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 4), st.integers(0, 4), st.integers(0, 2**bits - 1))


JOBS = ["job-1", "job-2", "job-3"]  # running (never on VICTIM), succeeded, pending (see `fuzzed`)
FAULT_NAMES = ["xid", "ecc-dbe", "ecc-sbe-rate", "remap-pending", "remap-failure", "thermal", "gpu-lost",
               "pcie-replay", "nvlink-errors", "clear", "slow", "slow-bursts", "hang"]
FAULT_VALUES = ["", "0", "1", "48", "79", "999", "1000", "-1", "0.3", "1.5", "nan", "inf", "-inf", "1e308", "1e20",
                "18446744073709551616", "1234567", "0x10", "1_000", " 7 ", "=1"]
faults = st.one_of(  # the language of phalanx/faults.py: NAME or NAME=VALUE, with values of every kind
    st.tuples(st.sampled_from(FAULT_NAMES), st.one_of(st.floats().map(repr), st.integers().map(str),
                                                      st.sampled_from(FAULT_VALUES), ps.text())).map("=".join),
    st.sampled_from(FAULT_NAMES), ps.text())
nodes = known_or_random(*AGENTS, *FUZZ_NODES, "ghost")
job_ids = known_or_random(*JOBS, "job-0", "job-4", "job-7", "job-99999999999999999999", "job-x")
runs = known_or_random("run-a", "run-b", "none")
participants = known_or_random("p0", "p1", "p2")
# placement mostly says no: a fuzzed job that runs, runs a harmless program that ends at once
commands = st.one_of(
    st.tuples(st.sampled_from(["true", "false", "/nonexistent/fuzz", "", "tr\x00ue"]),
              st.lists(ps.text(), max_size=3)).map(lambda t: [t[0], *t[1]]),
    st.just([]))
labels = st.dictionaries(known_or_random("switch", "spine", "superspine", "block", "rack"),
                         known_or_random("s1", "s2", "sp1", "b1", ""), max_size=4)

# By full name, or by bare name where every field of that name has the same type.
HINTS: dict[str, st.SearchStrategy] = {
    # nodes
    "phalanx.v1.GetNodeRequest.name": nodes, "phalanx.v1.DrainNodeRequest.name": nodes,
    "phalanx.v1.UndrainNodeRequest.name": nodes, "node": nodes,
    "phalanx.v1.RegisterRequest.node_name": st.one_of(st.sampled_from(FUZZ_NODES), nodes),
    "phalanx.v1.InjectFaultRequest.node": known_or_random(VICTIM, *FUZZ_NODES, "ghost"),
    "fault": faults, "gpu_index": small_or_random(32), "labels": labels,
    # jobs
    "phalanx.v1.GetJobRequest.id": job_ids, "phalanx.v1.CheckpointJobRequest.id": job_ids, "job": job_ids,
    "phalanx.v1.CancelJobRequest.id": known_or_random("job-2", "job-3", "job-4", "job-5", "job-6", "job-0"),
    "phalanx.v1.JobSpec.command": commands,
    "phalanx.v1.JobSpec.nodes": st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1), st.just(100_001)),
    "generation": small_or_random(), "rank": small_or_random(32), "round": small_or_random(),
    "request_id": small_or_random(),
    "phalanx.v1.JobSpec.name": known_or_random("fuzz", "a.b-c_9"), "ranks_per_node": small_or_random(32),
    "spares": small_or_random(32), "segment": small_or_random(32),
    "priority": st.one_of(st.integers(-1000, 1000), st.integers(-(2**31), 2**31 - 1)),
    "phalanx.v1.JobSpec.env": st.dictionaries(known_or_random("A", "FUZZ_1", "_x"), ps.text(), max_size=3),
    "reason": known_or_random("maintenance", "fuzz"),
    "gpu_backend": st.one_of(st.integers(1, 3), st.integers(-(2**31), 2**31 - 1)),
    # rendezvous
    "run_id": runs, "participant_id": participants,
    "min_nodes": small_or_random(32), "max_nodes": small_or_random(32),
    "last_call_s": st.one_of(st.sampled_from([0.0, 0.01, 1.0]), st.floats()),
    "join_timeout_s": st.one_of(st.sampled_from([0.05, 1.0, 600.0]), st.floats()),
    "wait_s": st.one_of(st.sampled_from([0.0, 0.05]), st.floats()),
    "phalanx.v1.StoreAddress.host": known_or_random("127.0.0.1", "node-a"),
    "phalanx.v1.StoreAddress.port": st.one_of(st.integers(1, 65535), st.integers(0, 2**32 - 1)),
}


# Valid requests to mutate, by type: a call with most fields valid gets past validation to what lies behind
# it. A type without seeds is fuzzed from its descriptor alone.
_RUN = {"run_id": "run-a", "participant_id": "p0"}
_JOB = {"job": "job-1", "generation": 1, "rank": 0}
SEEDS: dict[str, list] = {
    "phalanx.v1.SubmitJobRequest": [control_pb2.SubmitJobRequest(user="fuzz", spec=common_pb2.JobSpec(
        name="fuzz", command=["true"], nodes=1, ranks_per_node=1, env={"FUZZ": "1"}))],
    "phalanx.v1.DrainNodeRequest": [control_pb2.DrainNodeRequest(name=VICTIM, reason="fuzz")],
    "phalanx.v1.InjectFaultRequest": [control_pb2.InjectFaultRequest(node=VICTIM, gpu_index=i % 2, fault=fault)
                                      for i, fault in enumerate(["thermal", "xid=79", "ecc-sbe-rate=5", "pcie-replay=3",
                                                                 "nvlink-errors=2", "slow=0.3", "hang", "clear"])],
    "phalanx.v1.ReadLogsRequest": [control_pb2.ReadLogsRequest(job="job-1", rank=0, max_bytes=100)],
    "phalanx.v1.CheckpointJobRequest": [control_pb2.CheckpointJobRequest(id="job-1", deadline_s=0.05)],
    "phalanx.v1.ListEventsRequest": [control_pb2.ListEventsRequest(after_seq=1, limit=10, node="n1", job="job-1")],
    "phalanx.v1.WatchEventsRequest": [control_pb2.WatchEventsRequest(after_seq=1, job="job-1")],
    "phalanx.v1.RegisterRequest": [node_pb2.RegisterRequest(node_name="fz-0", inventory=common_pb2.NodeInventory(
        hostname="fz", gpu_backend=common_pb2.GPU_BACKEND_KIND_SIM, gpus=[common_pb2.GpuInfo(index=0)],
        labels={"switch": "s1"}))],
    "phalanx.v1.JoinRequest": [rendezvous_pb2.JoinRequest(
        **_RUN, settings=rendezvous_pb2.RoundSettings(min_nodes=1, max_nodes=2, last_call_s=0.05),
        join_timeout_s=1.0, store=rendezvous_pb2.StoreAddress(host="127.0.0.1", port=29500), attempt=1)],
    "phalanx.v1.AwaitRoundRequest": [rendezvous_pb2.AwaitRoundRequest(**_RUN, round=1, wait_s=0.05)],
    "phalanx.v1.NumNodesWaitingRequest": [rendezvous_pb2.NumNodesWaitingRequest(**_RUN, round=1)],
    "phalanx.v1.LeaveRequest": [rendezvous_pb2.LeaveRequest(**_RUN, round=1)],
    "phalanx.v1.ReportRequest": [local_pb2.ReportRequest(**_JOB, pid=1, steps=[local_pb2.StepSample(
        step=1, step_s=0.1, compute_s=0.05, end_unix_ns=1)])],
    "phalanx.v1.CheckpointDoneRequest": [local_pb2.CheckpointDoneRequest(**_JOB, request_id=1, step=1)],
    "phalanx.v1.AgentMessage": [
        node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(
            seq=1, sent_unix_ns=1, host=common_pb2.HostTelemetry(cpu_percent=1.0),
            gpus=[common_pb2.GpuTelemetry(index=0, temperature_c=40.0)],
            ranks=[node_pb2.RankStatus(**_JOB, state=common_pb2.RANK_STATE_RUNNING, pid=1)],
            progress=[node_pb2.RankProgress(**_JOB, last_step=5, steps=1, mean_step_s=0.1, compute_samples=[0.05])])),
        node_pb2.AgentMessage(inventory=common_pb2.NodeInventory(gpu_backend=common_pb2.GPU_BACKEND_KIND_SIM)),
        node_pb2.AgentMessage(event=node_pb2.AgentEvent(kind="fuzz", message="fuzz", fields={"a": "b"})),
        node_pb2.AgentMessage(gpu_event=common_pb2.GpuEvent(gpu_index=0, xid=79)),
        node_pb2.AgentMessage(result=node_pb2.CommandResult(id=1, ok=True)),
        node_pb2.AgentMessage(checkpoint_ack=node_pb2.CheckpointAck(**_JOB, request_id=1, step=1)),
    ],
}


STRATEGIES = ps.ProtoStrategies(HINTS, depth=3)


@functools.cache
def messages(descriptor) -> st.SearchStrategy:
    """Seeds mutated (two in three), and messages from the descriptor alone."""
    random = STRATEGIES.message(descriptor)
    seeds = SEEDS.get(descriptor.full_name)
    if not seeds:
        return random
    mutated = st.sampled_from(seeds).flatmap(STRATEGIES.mutations)
    return st.one_of(mutated, mutated, random)


@functools.cache
def encoded(descriptor) -> st.SearchStrategy[bytes]:
    """Encoded messages, and (one time in three) bytes that rarely decode."""
    valid = messages(descriptor)
    as_bytes = valid.map(lambda m: m.SerializeToString())
    return st.one_of(as_bytes, as_bytes, ps.undecodable(valid))


# -- the cluster --------------------------------------------------------------------------------------------------

CONTROLLER_CONFIG = (
    # generous liveness: two shared cores under a fuzzer must not make a healthy agent look dead
    "[liveness]\nsuspect_after_s = 20.0\ndown_after_s = 40.0\n"
    "[jobs]\nstop_grace_s = 1.0\nlaunch_timeout_s = 10.0\n"
    "[recovery]\nmax_restarts = 1\nrestart_backoff_s = 0.2\n")
BIG = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


@dataclass
class Fuzzed:
    total: int  # cases to run, over every method
    cluster: Cluster
    channels: dict[str, grpc.Channel]
    counts: collections.Counter
    codes: dict[str, collections.Counter]


@pytest.fixture(scope="module", params=[pytest.param(QUICK_CASES, id="quick"),
                                        pytest.param(FULL_CASES, id="full", marks=pytest.mark.slow)])
def fuzzed(request, tmp_path_factory):
    """A cluster of its own for each count: the quick run in `make test`, the full one in the slow suite."""
    total = int(os.environ.get("PHALANX_FUZZ_CASES", request.param))
    c = Cluster(tmp_path_factory.mktemp("fuzz"))
    c.start_controller(CONTROLLER_CONFIG)
    for name in AGENTS:
        c.start_agent(name, gpus=2)
    c.wait_states(dict.fromkeys(AGENTS, "UP"))
    ctl = c.control
    # job-1 runs for the whole fuzz, off the node faults are injected into
    ctl.DrainNode(control_pb2.DrainNodeRequest(name=VICTIM, reason="keep job-1 off the fault victim"), timeout=5)
    spec = common_pb2.JobSpec(name="long", command=["sleep", "3600"], nodes=1)
    assert ctl.SubmitJob(control_pb2.SubmitJobRequest(spec=spec, user="fuzz"), timeout=5).id == "job-1"
    c.wait_for(lambda: job_state(c, "job-1") == "RUNNING", "job-1 running")
    ctl.UndrainNode(control_pb2.UndrainNodeRequest(name=VICTIM), timeout=5)
    spec = common_pb2.JobSpec(name="short", command=["true"], nodes=1)
    assert ctl.SubmitJob(control_pb2.SubmitJobRequest(spec=spec, user="fuzz"), timeout=5).id == "job-2"
    c.wait_for(lambda: job_state(c, "job-2") == "SUCCEEDED", "job-2 succeeded")
    spec = common_pb2.JobSpec(name="too-big", command=["true"], nodes=50)
    assert ctl.SubmitJob(control_pb2.SubmitJobRequest(spec=spec, user="fuzz"), timeout=5).id == "job-3"
    channels = {
        "controller": grpc.insecure_channel(c.address, options=BIG),
        "local": grpc.insecure_channel(f"unix://{c.root / 'n1' / 'state' / 'agent.sock'}", options=BIG),
        "nvrx": grpc.insecure_channel(f"unix://{c.root / 'n1' / 'nvhcd.sock'}", options=BIG),
        "snapshot": grpc.insecure_channel(ctl.GetNode(control_pb2.GetNodeRequest(name="n1"), timeout=5)
                                          .inventory.snapshot_address, options=BIG),
    }
    yield Fuzzed(total, c, channels, collections.Counter(), collections.defaultdict(collections.Counter))
    for channel in channels.values():
        channel.close()
    c.close()


def job_state(c: Cluster, job_id: str) -> str:
    job = c.control.GetJob(control_pb2.GetJobRequest(id=job_id), timeout=5)
    return common_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")


# -- calling ------------------------------------------------------------------------------------------------------

def _identity(b: bytes) -> bytes:
    return b


def call(f: Fuzzed, method: Method, payload: bytes | list[bytes], timeout: float | None = None,
         ) -> tuple[grpc.StatusCode, str]:
    """Send one encoded request (or a stream of them); return the final status and its message."""
    d = method.descriptor
    channel = f.channels[WHERE[method.service]]
    timeout = timeout or (WAIT_TIMEOUT_S if method.waits else CALL_TIMEOUT_S)
    decode = ps.message_class(d.output_type).FromString  # a reply that does not decode fails the test
    path = "/" + method.path
    try:
        if not d.client_streaming and not d.server_streaming:
            channel.unary_unary(path, _identity, decode)(payload, timeout=timeout)
            return OK, ""
        if d.client_streaming and not d.server_streaming:
            channel.stream_unary(path, _identity, decode)(iter(payload), timeout=timeout)
            return OK, ""
        stream = (channel.unary_stream(path, _identity, decode)(payload, timeout=timeout)
                  if not d.client_streaming else channel.stream_stream(path, _identity, decode)(iter(payload),
                                                                                               timeout=timeout))
        try:
            for _ in stream:
                if method.waits:
                    break  # it answers; whether it goes on for ever is not for the fuzzer to find out
            return OK, ""
        finally:
            stream.cancel()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def size(payload: bytes | list[bytes]) -> int:
    return len(payload) if isinstance(payload, bytes) else max(map(len, payload), default=0)


def check(f: Fuzzed, method: Method, code: grpc.StatusCode, details: str, sent: int) -> None:
    """`sent`: the largest message of the request, in bytes."""
    f.counts[method.path] += 1
    f.codes[method.path][code.name] += 1
    if os.environ.get("PHALANX_FUZZ_TRACE"):
        f.codes[method.path + " details"][f"{code.name}: {details[:70]}"] += 1
    if (code == grpc.StatusCode.DEADLINE_EXCEEDED and method.waits) or (method.path, code) in LIBRARY:
        return
    assert code in ALLOWED, f"{method.path} answered {code.name}: {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the transport's limit, or a watcher that fell behind;
        # not an answer too long to carry (gRPC sends the message in a trailer, 8 KiB at most)
        assert sent > MAX_TRANSPORT_BYTES or details.startswith("fell behind"), \
            f"{method.path} answered RESOURCE_EXHAUSTED to {sent} bytes: {details}"
    assert code == OK or details.strip(), f"{method.path} answered {code.name} without a message"


def session_payload(f: Fuzzed, data: st.DataObject) -> list[bytes]:
    """A registered fuzz node opens a session (or fails to) and sends random messages."""
    name = data.draw(st.sampled_from(FUZZ_NODES), label="node")
    stub = f.channels["controller"].unary_unary("/phalanx.v1.NodeService/Register",
                                                node_pb2.RegisterRequest.SerializeToString,
                                                node_pb2.RegisterResponse.FromString)
    inventory = common_pb2.NodeInventory(gpu_backend=common_pb2.GPU_BACKEND_KIND_SIM, hostname=name)
    registered = stub(node_pb2.RegisterRequest(node_name=name, inventory=inventory), timeout=CALL_TIMEOUT_S)
    incarnation = registered.incarnation
    first = data.draw(st.sampled_from(["open", "open", "open", "stale", "random"]), label="first")
    if first == "random":
        opening = data.draw(messages(node_pb2.AgentMessage.DESCRIPTOR), label="opening")
    else:
        if first == "stale":
            incarnation = data.draw(small_or_random(), label="incarnation")
        opening = node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name=name, incarnation=incarnation))
    rest = data.draw(st.lists(encoded(node_pb2.AgentMessage.DESCRIPTOR), max_size=5), label="then")
    return [opening.SerializeToString(), *rest]


# -- the fuzz run -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.path)
def test_fuzz(fuzzed, method):
    requests = encoded(method.descriptor.input_type)
    session = method.path == "phalanx.v1.NodeService/Session"

    @settings(max_examples=budget(method, fuzzed.total), derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(data=st.data())
    def fuzz(data):
        if session:
            payload = session_payload(fuzzed, data)
        elif method.descriptor.client_streaming:
            payload = data.draw(st.lists(requests, max_size=4), label="requests")
        else:
            payload = data.draw(requests, label="request")
        code, details = call(fuzzed, method, payload)
        check(fuzzed, method, code, details, size(payload))

    fuzz()


def test_every_method_is_fuzzed():
    """A service or method added to a .proto is fuzzed, or this fails and says what to add."""
    services = all_services()
    unplaced = sorted(set(services) - set(WHERE))
    assert not unplaced, f"services the fuzzer does not know where to call: {unplaced}; add them to WHERE"
    assert set(CONTROLLER_SERVICES) <= {s for s, where in WHERE.items() if where == "controller"}
    declared = {f"{name}/{m.name}" for name, s in services.items() for m in s.methods}
    assert declared == {m.path for m in METHODS}
    gone = (WAITS | set(WEIGHT)) - declared
    assert not gone, f"WAITS or WEIGHT names methods that are gone: {sorted(gone)}"


# -- oversized requests -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.path)
def test_oversized_requests_are_refused(fuzzed, method):
    """Over MAX_REQUEST_BYTES: INVALID_ARGUMENT saying so. Over MAX_TRANSPORT_BYTES: RESOURCE_EXHAUSTED."""
    d = method.descriptor
    over_app = ps.unknown_field(MAX_REQUEST_BYTES + 10)
    over_transport = ps.unknown_field(MAX_TRANSPORT_BYTES + 10)
    streamed = d.client_streaming
    code, details = call(fuzzed, method, [over_app] if streamed else over_app, timeout=CALL_TIMEOUT_S)
    name = d.input_type.name
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               f"{name} is {len(over_app)} bytes; the limit is {MAX_REQUEST_BYTES}")
    code, details = call(fuzzed, method, [over_transport] if streamed else over_transport, timeout=CALL_TIMEOUT_S)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    healthy(fuzzed)


# -- afterwards: alive, consistent, and still doing its job ----------------------------------------------------------

BAD_LOG_LINES = ('"level": "error"', '"level": "critical"', "Traceback", '"exception":')


def healthy(f: Fuzzed) -> None:
    c = f.cluster
    for name, proc in c.procs.items():
        assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{c.log(name, 40)}"
    assert c._serving()
    for path in ("phalanx.v1.LocalService/Report", "nvhcd.HealthCheckService/RunHealthCheck"):
        code, details = call(f, BY_PATH[path], b"")
        assert code == OK, f"{path}: {code.name}: {details}"


def quiet_logs(c: Cluster) -> None:
    for name in c.procs:
        path = c.root / f"{name}.log"
        bad = [line for line in path.read_text(errors="replace").splitlines() if any(b in line for b in BAD_LOG_LINES)]
        assert not bad, f"{name} logged {len(bad)} errors, the first:\n{bad[0][:3000]}"


def test_after_the_fuzz_the_cluster_works_and_restarts_cleanly(fuzzed):
    f, c = fuzzed, fuzzed.cluster
    total = sum(f.counts.values())
    print(f"\nfuzzed {total} cases:")
    for path, n in sorted(f.counts.items()):
        print(f"  {path:50} {n:6}  {dict(f.codes[path].most_common())}")
        details = f.codes.get(path + " details", collections.Counter())
        for what, times in details.most_common(int(os.environ.get("PHALANX_FUZZ_TRACE", "12"))):
            print(f"      {times:5}  {what}")
    if f.counts:  # not when run alone
        assert total >= f.total
    healthy(f)
    quiet_logs(c)
    for args in (["nodes"], ["jobs"], ["events"]):
        result = c.cli(*args, timeout=60)
        assert result.returncode == 0, f"phalanx {' '.join(args)}: {result.stderr}"
    # back to a known state through the public API: end every job, heal the nodes, undrain them
    ctl = c.control
    # (the fuzzer's torchrun rounds are listed too, as torchrun-RUN_ID: torchrun's agents end those, not a cancel)
    def jobs():
        return [j for j in ctl.ListJobs(control_pb2.ListJobsRequest(), timeout=5).jobs
                if not j.id.startswith("torchrun-")]
    for job in jobs():
        if job.state not in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED,
                             common_pb2.JOB_STATE_CANCELLED, common_pb2.JOB_STATE_CANCELLING):
            try:
                ctl.CancelJob(control_pb2.CancelJobRequest(id=job.id), timeout=10)
            except grpc.RpcError as e:  # it ended meanwhile
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e.details()
    c.wait_for(lambda: all(j.state in (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED,
                                       common_pb2.JOB_STATE_CANCELLED)
                           for j in jobs()), "every job ended")
    # the fault victim's GPUs may have failed for good (sticky XIDs, error rates): as an operator would, restart
    # its agent (fresh GPUs, a fresh registration), then undrain whatever the fuzzer or a verdict drained
    c.kill(VICTIM, signal.SIGTERM)
    c.start_agent(VICTIM, gpus=2)
    c.wait_for(lambda: all(c.node(a).connected for a in AGENTS), "every agent connected")
    c.wait_for(lambda: all(c.node(a).health == common_pb2.HEALTH_HEALTHY for a in AGENTS), "agents healthy")
    for name in AGENTS:
        if c.node(name).drain_reason:
            ctl.UndrainNode(control_pb2.UndrainNodeRequest(name=name), timeout=5)
    c.wait_states(dict.fromkeys(AGENTS, "UP"))
    spec = common_pb2.JobSpec(name="after-fuzz", command=["true"], nodes=len(AGENTS), priority=1000)
    job_id = ctl.SubmitJob(control_pb2.SubmitJobRequest(spec=spec, user="fuzz"), timeout=5).id
    c.wait_for(lambda: job_state(c, job_id) == "SUCCEEDED", f"{job_id} to succeed")
    # (torchrun runs live in the controller's memory only: a restart forgets them until their agents join again)
    before = {j.id: (j.state, j.generation) for j in jobs()}
    nodes_before = set(c.states())
    # the controller restarts from its store: the same jobs and nodes, the agents back
    c.kill("controller", signal.SIGTERM)
    db = sqlite3.connect(c.root / "controller.db")
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    c.start_controller(CONTROLLER_CONFIG)
    after = {j.id: (j.state, j.generation) for j in jobs()}
    assert after == before
    assert set(c.states()) == nodes_before
    c.wait_states(dict.fromkeys(AGENTS, "UP"))
    quiet_logs(c)
