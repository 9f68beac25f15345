"""Bad requests get a readable status and never take the controller down (a real controller process)."""

import queue
import time

import grpc
import pytest

from controller.nodes.session import COMMAND_TIMEOUT_S
from phalanx.rpc import MAX_REQUEST_BYTES, MAX_TRANSPORT_BYTES
from phalanx.v1 import common_pb2, control_pb2, node_pb2, node_pb2_grpc

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def inventory(**kw):
    return common_pb2.NodeInventory(gpu_backend=common_pb2.GPU_BACKEND_KIND_SIM, **kw)


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    from tests.cluster import Cluster
    c = Cluster(tmp_path_factory.mktemp("bad-input"))
    c.start_controller()
    channel = grpc.insecure_channel(c.address, options=[("grpc.max_send_message_length", 64 << 20)])
    yield c, node_pb2_grpc.NodeServiceStub(channel)
    channel.close()
    c.close()


def status_of(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def still_serving(c):
    c.wait_for(c._serving, "the controller serving")  # each try has a 1 s deadline: one can miss it on a busy core
    c.control.ListNodes(control_pb2.ListNodesRequest(), timeout=5)
    assert c.procs["controller"].poll() is None


@pytest.mark.parametrize("request_,message", [
    (node_pb2.RegisterRequest(node_name="", inventory=inventory()), "node_name is empty; give the node's name"),
    (node_pb2.RegisterRequest(node_name="a b", inventory=inventory()),
     "node_name 'a b' is not a valid node name: 1-63 characters of letters, digits, '.', '_' or '-', "
     "starting with a letter or digit"),
    (node_pb2.RegisterRequest(node_name="n1"), "inventory is missing"),
    (node_pb2.RegisterRequest(node_name="n1", inventory=common_pb2.NodeInventory(gpu_backend=42)),
     "inventory.gpu_backend 42 is not a known GpuBackendKind"),
    (node_pb2.RegisterRequest(node_name="n1", inventory=common_pb2.NodeInventory()),
     "inventory.gpu_backend is unspecified; say NONE, SIM or NVML"),
    (node_pb2.RegisterRequest(node_name="n1", inventory=inventory(gpus=[common_pb2.GpuInfo(index=0)] * 2)),
     "inventory repeats a GPU index: [0, 0]"),
    (node_pb2.RegisterRequest(node_name="n1", inventory=inventory(gpus=[common_pb2.GpuInfo(index=i)
                                                                        for i in range(65)])),
     "inventory lists 65 GPUs; the limit is 64"),
])
def test_register_rejects_bad_fields(controller, request_, message):
    c, nodes = controller
    assert status_of(lambda: nodes.Register(request_, timeout=5)) == (INVALID, message)
    still_serving(c)
    assert "n1" not in c.states()


def test_oversized_requests(controller):
    c, nodes = controller
    big = node_pb2.RegisterRequest(node_name="n1", inventory=inventory(labels={"blob": "x" * (2 * MAX_REQUEST_BYTES)}))
    code, details = status_of(lambda: nodes.Register(big, timeout=5))
    assert code == INVALID
    assert details.startswith("RegisterRequest is ") and details.endswith(f"bytes; the limit is {MAX_REQUEST_BYTES}")
    blob = "x" * (MAX_TRANSPORT_BYTES + 1)
    huge = node_pb2.RegisterRequest(node_name="n1", inventory=inventory(labels={"blob": blob}))
    code, _ = status_of(lambda: nodes.Register(huge, timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # refused by the transport before any handler runs
    still_serving(c)


def test_control_rejects_bad_fields(controller):
    c, _ = controller
    ctl = c.control
    assert status_of(lambda: ctl.ListNodes(control_pb2.ListNodesRequest(states=[99]), timeout=5)) == (
        INVALID, "states: 99 is not a node state (known: UP, SUSPECT, DOWN, DRAINING, DRAINED)")
    assert status_of(lambda: ctl.DrainNode(control_pb2.DrainNodeRequest(name="", reason="x"), timeout=5)) == (
        INVALID, "name is empty; give the node's name")
    assert status_of(lambda: ctl.DrainNode(control_pb2.DrainNodeRequest(name="ghost", reason="x"), timeout=5)) == (
        grpc.StatusCode.NOT_FOUND, "no node named 'ghost'; `phalanx nodes` lists the known ones")
    assert status_of(lambda: ctl.DrainNode(control_pb2.DrainNodeRequest(name="ghost", reason="a\nb"), timeout=5)) == (
        INVALID, "reason must be one line")
    assert status_of(lambda: ctl.ListEvents(control_pb2.ListEventsRequest(limit=10**6), timeout=5)) == (
        INVALID, "limit 1000000 is larger than 10000")
    code, details = status_of(lambda: next(iter(ctl.WatchEvents(control_pb2.WatchEventsRequest(node="no way"),
                                                                timeout=5))))
    assert code == INVALID and "not a valid node name" in details
    still_serving(c)


def session(nodes, *messages):
    """Open a session, send `messages`, return the final status."""
    call = nodes.Session(iter(messages), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    return info.value.code(), info.value.details()


def test_session_protocol_errors(controller):
    c, nodes = controller
    reply = nodes.Register(node_pb2.RegisterRequest(node_name="s1", inventory=inventory()), timeout=5)
    hb = node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(seq=1))
    assert session(nodes, hb) == (INVALID, "the first session message must be `open` (SessionOpen)")
    assert session(nodes, node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name="s1", incarnation=99))) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        f"node 's1': incarnation 99 is stale (current {reply.incarnation}); register again")
    assert session(nodes, node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name="zz", incarnation=1))) == (
        grpc.StatusCode.FAILED_PRECONDITION, "node 'zz' is not registered; call Register first")
    opened = node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name="s1", incarnation=reply.incarnation))
    assert session(nodes, opened, opened) == (INVALID, "the session is already open")
    assert session(nodes, opened, node_pb2.AgentMessage()) == (INVALID, "empty session message")
    too_many = node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(gpus=[common_pb2.GpuTelemetry()] * 65))
    assert session(nodes, opened, too_many) == (INVALID, "heartbeat carries 65 GPUs; the limit is 64")
    bad_event = node_pb2.AgentMessage(event=node_pb2.AgentEvent(kind="", message="x"))
    assert session(nodes, opened, bad_event) == (INVALID, "event kind '' must be a non-empty word")
    still_serving(c)


def test_garbage_bytes_on_the_wire(controller):
    c, _ = controller
    channel = grpc.insecure_channel(c.address)
    raw = channel.unary_unary("/phalanx.v1.NodeService/Register", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
    # refused before any handler runs, saying what (gRPC alone answers UNKNOWN, which reads like a server bug)
    assert status_of(lambda: raw(b"\xff\xff\xff\xff not a protobuf", timeout=5)) == (
        INVALID, "cannot decode the request as phalanx.v1.RegisterRequest: Wire format was corrupt; are client "
                 "and server built from the same .proto files?")
    unknown = channel.unary_unary("/phalanx.v1.NodeService/Nope", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
    code, _ = status_of(lambda: unknown(b"", timeout=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    channel.close()
    still_serving(c)


def test_garbage_in_a_session(controller):
    c, nodes = controller
    channel = grpc.insecure_channel(c.address)
    raw = channel.stream_stream("/phalanx.v1.NodeService/Session", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    reply = nodes.Register(node_pb2.RegisterRequest(node_name="g1", inventory=inventory()), timeout=5)
    opened = node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name="g1", incarnation=reply.incarnation))
    corrupt = (INVALID, "cannot decode the request as phalanx.v1.AgentMessage: Wire format was corrupt; are client "
                        "and server built from the same .proto files?")
    for messages in ([b"\xff\xff"], [opened.SerializeToString(), b"\xff\xff"]):  # first, then a later message
        call = raw(iter(messages), timeout=10)
        assert status_of(lambda call=call: list(call)) == corrupt
    channel.close()
    still_serving(c)


def test_messages_quote_input_short(controller):
    """A status message travels in a trailer that clients cap at 8 KiB: one quoting a long input in full
    reached the caller as RESOURCE_EXHAUSTED instead of itself."""
    c, _ = controller
    ctl = c.control
    code, details = status_of(lambda: ctl.GetJob(control_pb2.GetJobRequest(id="é" * 5000), timeout=5))
    assert code == INVALID and details.startswith("id 'ééé") and details.endswith(
        "...' is not a job id: ids look like job-17 (`phalanx jobs` lists them)") and len(details) < 200
    reply = node_pb2_grpc.NodeServiceStub(grpc.insecure_channel(c.address)).Register(
        node_pb2.RegisterRequest(node_name="q1", inventory=inventory()), timeout=5)
    assert reply.incarnation
    code, details = status_of(lambda: ctl.InjectFault(control_pb2.InjectFaultRequest(
        node="q1", fault="x" * 5000), timeout=5))
    assert code == INVALID and details.startswith("unknown fault 'xxx") and len(details) < 400
    still_serving(c)


def test_events_after_a_cursor_past_every_event(controller):
    """A uint64 cursor beyond SQLite's int64 once made ListEvents fail with INTERNAL (and WatchEvents UNKNOWN)."""
    c, _ = controller
    reply = c.control.ListEvents(control_pb2.ListEventsRequest(after_seq=2**64 - 1), timeout=5)
    assert list(reply.events) == []
    code, _ = status_of(lambda: next(iter(c.control.WatchEvents(control_pb2.WatchEventsRequest(after_seq=2**64 - 1),
                                                                 timeout=0.5))))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED  # nothing yet: it waits for the next event
    still_serving(c)


def open_session(nodes, name: str, timeout: float):
    """Register `name` and open its session by hand: (the registration, the queue its messages go in, the call),
    past the controller's SessionAccepted."""
    reply = nodes.Register(node_pb2.RegisterRequest(node_name=name, inventory=inventory()), timeout=5)
    outbox: queue.Queue = queue.Queue()
    outbox.put(node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name=name, incarnation=reply.incarnation)))
    call = nodes.Session(iter(outbox.get, None), timeout=timeout)
    assert next(call).WhichOneof("body") == "accepted"
    return reply, outbox, call


def test_fencing_does_not_stop_the_session_reader(controller):
    """The controller fences a stale rank with a StopRanks command, which the agent answers on the session: the
    reader once awaited that answer itself, so it sat out the command timeout with the answer unread and the
    node's heartbeats unread too (long enough to declare a healthy node DOWN)."""
    c, nodes = controller
    reply, outbox, call = open_session(nodes, "f1", timeout=10)
    stale = node_pb2.RankStatus(job="job-404", generation=1, rank=0, state=common_pb2.RANK_STATE_RUNNING)
    outbox.put(node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(seq=1, ranks=[stale])))
    command = next(call).command
    assert command.stop.job == "job-404" and command.stop.generation == 1
    outbox.put(node_pb2.AgentMessage(result=node_pb2.CommandResult(id=command.id, ok=True)))
    outbox.put(node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name="f1", incarnation=reply.incarnation)))
    outbox.put(None)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert (info.value.code(), info.value.details()) == (INVALID, "the session is already open")
    assert time.monotonic() - started < COMMAND_TIMEOUT_S - 0.5  # read at once, not after the command timeout
    still_serving(c)


def test_an_agent_event_whose_fields_are_named_like_the_events_own_is_logged_not_fatal(controller):
    """An agent's event fields are free-form: one named `kind`, `message` or `node` once collided with the event's
    own keywords (TypeError: the node's session ended with INTERNAL). A field `job` files the event under that job
    only when the node has a part in it (the end-to-end tests see a restored snapshot's there): any node could
    name any job."""
    c, nodes = controller
    _, outbox, call = open_session(nodes, "e1", timeout=30)
    fields = {"kind": "k", "message": "m", "node": "n", "job": "job-77"}
    outbox.put(node_pb2.AgentMessage(event=node_pb2.AgentEvent(kind="odd_fields", message="fields", fields=fields)))
    c.wait_for(lambda: any(e.kind == "agent.odd_fields" for e in c.control.ListEvents(
        control_pb2.ListEventsRequest(node="e1"), timeout=5).events), "the agent's event")
    event = next(e for e in c.control.ListEvents(control_pb2.ListEventsRequest(node="e1"), timeout=5).events
                 if e.kind == "agent.odd_fields")
    assert (event.kind, event.node, event.job) == ("agent.odd_fields", "e1", "")  # no job-77 here, nor e1 in it
    assert {k: event.fields[k] for k in fields} == fields
    assert not c.control.ListEvents(control_pb2.ListEventsRequest(job="job-77"), timeout=5).events
    assert c.node("e1").connected  # the session goes on
    outbox.put(None)
    assert list(call) == []  # and ends when the agent ends it, with OK
    still_serving(c)
