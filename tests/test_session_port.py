"""The session port (controller `session_listen`, agent `session_port`): an agent's session in frames on mutual
TLS, with gRPC's semantics and checks. Real daemons and certificates; the port's own behaviour in process."""

from __future__ import annotations

import asyncio
import socket
import ssl

import grpc
import psutil
import pytest

from controller.api.session_port import SessionPort
from controller.switchboard import Methods, Switchboard
from phalanx import framed, pki
from phalanx.leader import LEADER_METADATA, leader_hint
from phalanx.ports import free_port
from phalanx.request_guard import RequestGuard
from phalanx.v1 import node_pb2
from tests.cluster import TIMEOUT_S, Cluster

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    pki.init_ca(d, cluster="test")
    pki.issue(d, "controller", "controller", ("127.0.0.1", "localhost"))
    return d


@pytest.fixture(scope="module")
def cluster(ca, tmp_path_factory):
    """A controller on mutual TLS with a session port, and two agents whose sessions go there."""
    c = Cluster(tmp_path_factory.mktemp("session-port"), pki=ca)
    c.session_port = free_port()
    c.start_controller(f'session_listen = "127.0.0.1:{c.session_port}"')
    for name in ("node-a", "node-b"):
        c.start_agent(name, gpus=1, extra=f"session_port = {c.session_port}")
    c.wait_states({"node-a": "UP", "node-b": "UP"})
    yield c
    c.close()


def context(ca, name: str | None) -> ssl.SSLContext:
    if name is None:
        return ssl.create_default_context(cafile=str(ca / "ca.crt"))
    return framed.client_context(str(ca / "ca.crt"), str(ca / f"{name}.crt"), str(ca / f"{name}.key"))


async def open_as(cluster, ca, cert: str | None, node: str, incarnation: int = 1):
    """A session opened by hand on the session port: its first answer, or the AioRpcError it ended with."""
    call = await framed.FramedCall.open(f"127.0.0.1:{cluster.session_port}", context(ca, cert))
    try:
        try:
            await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name=node, incarnation=incarnation)))
        except asyncio.InvalidStateError:  # refused as it connected (a certificate's role), before the write:
            pass                           # read() raises its status, as the agent's link does
        return await call.read()
    finally:
        call.cancel()


def status_of(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(coro)
    return info.value.code(), info.value.details()


def test_the_agents_sessions_go_over_the_session_port_and_commands_come_down_it(cluster):
    def ports(name: str) -> set[int]:
        return {c.raddr.port for c in psutil.Process(cluster.procs[name].pid).net_connections("tcp")
                if c.raddr and c.status == psutil.CONN_ESTABLISHED}

    for name in ("node-a", "node-b"):
        # UP is recorded at the registration, over gRPC; the session opens on the session port just after
        cluster.wait_for(lambda n=name: cluster.session_port in ports(n), f"{name}'s session on the session port")
    result = cluster.cli("drain", "node-b", "--reason", "session port test")
    assert result.returncode == 0, result.stderr
    # the controller tells the agent in its session: the agent logs the change it was told of
    cluster.wait_for(lambda: "controller changed this node" in (cluster.root / "node-b.log").read_text(),
                     "node-b told of its drain")
    assert cluster.cli("undrain", "node-b").returncode == 0
    cluster.wait_states({"node-a": "UP", "node-b": "UP"})


def test_a_killed_agent_is_found_silent_as_over_grpc(cluster):
    cluster.start_agent("node-c", gpus=1, extra=f"session_port = {cluster.session_port}")
    cluster.wait_states({"node-a": "UP", "node-b": "UP", "node-c": "UP"})
    cluster.kill("node-c")
    cluster.wait_for(lambda: cluster.states().get("node-c") in ("SUSPECT", "DOWN"), "node-c declared silent")


def test_a_session_for_another_node_or_without_a_good_certificate_is_refused(cluster, ca):
    code, details = status_of(open_as(cluster, ca, "node-a", "node-b"))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert details == "this certificate is for node 'node-a'; it cannot act as node 'node-b'"
    code, details = status_of(open_as(cluster, ca, "operator", "node-a"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "may not call phalanx.v1.NodeService" in details
    code, details = status_of(open_as(cluster, ca, None, "node-a"))  # no client certificate: no handshake
    assert code == grpc.StatusCode.UNAVAILABLE and "session port" in details
    code, details = status_of(open_as(cluster, ca, "node-a", "node-a", incarnation=999))
    assert code == grpc.StatusCode.FAILED_PRECONDITION  # a stale incarnation: the agent would register again
    states = cluster.states()
    assert states["node-a"] == states["node-b"] == "UP"


def test_garbage_on_the_session_port_ends_that_connection_only(cluster, ca):
    async def garbage(payload: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", cluster.session_port, ssl=context(ca, "node-a"),
                                                       server_hostname="127.0.0.1")
        writer.write(payload)
        data = await asyncio.wait_for(reader.read(), TIMEOUT_S)  # until the controller closes it
        writer.close()
        return data

    assert asyncio.run(garbage(b"\x07" + b"\xff" * 64)) == b""  # an unknown frame type: closed at once
    # a message that does not decode: the session ends with INVALID_ARGUMENT, as over gRPC
    data = asyncio.run(garbage(framed.frame(framed.MESSAGE, b"\xff\xff\xff")))
    kind, size = framed.HEADER.unpack_from(data)
    code, details, _ = framed.parse_close(data[framed.HEADER.size:framed.HEADER.size + size])
    assert kind == framed.CLOSE and code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot decode the request as phalanx.v1.AgentMessage" in details
    assert cluster._serving() and cluster.states()["node-a"] == "UP"


# -- the port in process: a standby's refusal, and the end of a session ------------------------------------------

def _port_with(handler) -> Switchboard:
    board = Switchboard()
    methods = Methods.of(_Only(grpc.stream_stream_rpc_method_handler(
        handler, request_deserializer=node_pb2.AgentMessage.FromString,
        response_serializer=node_pb2.ControllerMessage.SerializeToString)))
    board.route(methods, [RequestGuard()])
    return board


class _Only(grpc.GenericRpcHandler):
    def __init__(self, handler) -> None:
        self._handler = handler

    def service(self, details):
        return self._handler if details.method == "/phalanx.v1.NodeService/Session" else None


def test_a_refusal_carries_its_status_and_the_leader_it_names():
    async def refuse(requests, context):
        context.set_trailing_metadata(((LEADER_METADATA, "10.0.0.7:7370"),))
        await context.abort(grpc.StatusCode.UNAVAILABLE, "controller b is a standby: the leader is a")

    async def main():
        port = SessionPort(_port_with(refuse).resolve, None)
        number = await port.start("127.0.0.1:0")
        try:
            call = await framed.FramedCall.open(f"127.0.0.1:{number}", None)
            try:
                await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(node_name="n", incarnation=1)))
            except asyncio.InvalidStateError:  # refused before the write (a busy machine): read() has the status
                pass
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            return info.value
        finally:
            await port.stop()

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "is a standby" in error.details()
    assert leader_hint(error) == "10.0.0.7:7370"


def test_messages_go_both_ways_and_the_handler_ends_when_the_agent_goes():
    ended = []
    both_ended = asyncio.Event()

    async def echo(requests, context):
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                await context.write(node_pb2.ControllerMessage(
                    accepted=node_pb2.SessionAccepted(incarnation=message.heartbeat.seq)))
        finally:
            ended.append(context.peer())
            if len(ended) == 2:
                both_ended.set()

    async def main():
        port = SessionPort(_port_with(echo).resolve, None)
        number = await port.start("127.0.0.1:0")
        try:
            call = await framed.FramedCall.open(f"127.0.0.1:{number}", None)
            seen = []
            for seq in range(1, 201):  # more than the frames the port queues unread
                await call.write(node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(seq=seq)))
            for _ in range(200):
                seen.append((await call.read()).accepted.incarnation)
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK
            second = await framed.FramedCall.open(f"127.0.0.1:{number}", None)
            await second.write(node_pb2.AgentMessage(heartbeat=node_pb2.Heartbeat(seq=7)))
            assert (await second.read()).accepted.incarnation == 7
            second.cancel()  # the agent goes away: the handler is cancelled, as gRPC's is
            await asyncio.wait_for(both_ended.wait(), TIMEOUT_S)
            return seen
        finally:
            await port.stop()

    assert asyncio.run(main()) == list(range(1, 201))
    assert all(peer.startswith("ipv4:127.0.0.1:") for peer in ended)


def test_a_connection_whose_frames_are_not_taken_stops_being_read_at_a_few_megabytes():
    """Issue 39: the port read up to 64 frames ahead of the handler whatever their size: 64 x 16 MiB, 1 GiB of
    memory per connection for any node certificate. It stops reading at QUEUED_BYTES as well."""
    from controller.api import session_port

    frame = 1 << 20

    async def stuck(requests, context):
        await asyncio.Event().wait()  # takes no frame

    async def main():
        port = SessionPort(_port_with(stuck).resolve, None)
        number = await port.start("127.0.0.1:0")
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", number)
            payload = framed.frame(framed.MESSAGE, b"\0" * frame)
            for _ in range(40):  # fewer frames than QUEUED_FRAMES, 40 MiB of them
                writer.write(payload)
            drained = asyncio.ensure_future(writer.drain())  # never done: the port stops reading
            deadline = asyncio.get_running_loop().time() + TIMEOUT_S
            while not any(not c.reading for c in port.connections):
                assert asyncio.get_running_loop().time() < deadline, [c.queued for c in port.connections]
                await asyncio.sleep(0.01)
            (connection,) = port.connections
            queued = connection.queued
            drained.cancel()
            writer.close()
            return queued
        finally:
            await port.stop()

    queued = asyncio.run(main())
    assert session_port.QUEUED_BYTES <= queued < session_port.QUEUED_BYTES + 2 * frame, queued


def test_an_agent_refuses_a_session_port_that_shows_a_nodes_certificate(ca, tmp_path):
    """Issue 39 (controller impersonation): a node's certificate is a server certificate too (its snapshot port),
    signed by the same CA; a node that takes a controller's place (an address, a name) passed the TLS check. The
    agent's session client now also asks that the certificate be a controller's."""
    for name in ("imposter", "honest"):
        if not (ca / f"{name}.crt").exists():
            pki.issue(ca, name, "node")
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(str(ca / "imposter.crt"), str(ca / "imposter.key"))
    server_context.load_verify_locations(str(ca / "ca.crt"))
    server_context.verify_mode = ssl.CERT_REQUIRED

    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0, ssl=server_context)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await framed.FramedCall.open(f"127.0.0.1:{port}", context(ca, "honest"), server_name="imposter")
            return info.value
        finally:
            server.close()

    error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "presented the certificate of a node 'imposter', not a controller's" in error.details(), error.details()


def test_a_session_port_that_cannot_listen_says_which_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"

        async def main():
            await SessionPort(_port_with(None).resolve, None).start(address)

        with pytest.raises(OSError, match=f"cannot listen on session_listen {address}"):
            asyncio.run(main())


def test_an_agent_pointed_at_a_session_port_nothing_listens_on_is_told_which_settings_to_check():
    port = free_port()
    code, details = status_of(framed.FramedCall.open(f"127.0.0.1:{port}", None))
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert f"cannot reach the session port 127.0.0.1:{port}" in details and "session_listen" in details, details
