"""The switchboard: one gRPC server whose methods and interceptors follow the controller's role, a call
under way kept through a change of role (controller/switchboard.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from controller.switchboard import Methods, Switchboard

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def handler(method: str, behaviour, streaming: bool = False) -> grpc.GenericRpcHandler:
    factory = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler

    class Handler(grpc.GenericRpcHandler):
        def service(self, details):
            return factory(behaviour) if details.method == method else None

    return Handler()


class Tag(grpc.aio.ServerInterceptor):
    """Records, in `seen`, the calls it let through under its name."""

    def __init__(self, name: str, seen: list[str]) -> None:
        self.name, self.seen = name, seen

    async def intercept_service(self, continuation, details):
        self.seen.append(f"{self.name}:{details.method}")
        return await continuation(details)


def served(test):
    """Run `test(board, channel)` on a fresh event loop against a server with a switchboard."""
    async def serve():
        board = Switchboard()
        server = grpc.aio.server(interceptors=[board.interceptor])
        server.add_generic_rpc_handlers((board,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            await test(board, channel)
        finally:
            await channel.close()
            await server.stop(0)

    def wrapper():
        asyncio.run(serve())
    wrapper.__name__ = test.__name__
    return wrapper


@served
async def test_calls_go_to_the_role_of_the_moment_through_its_interceptors(board, channel):
    seen: list[str] = []

    async def standby(request, context):
        return b"standby"

    async def leader(request, context):
        return b"leader"

    board.route(Methods.of(handler("/t.T/Who", standby)), [Tag("outer", seen), Tag("inner", seen)])
    who = channel.unary_unary("/t.T/Who")
    assert await who(b"") == b"standby"
    assert seen == ["outer:/t.T/Who", "inner:/t.T/Who"]
    leading = Methods()
    leading.add_registered_method_handlers("t.T", {"Who": grpc.unary_unary_rpc_method_handler(leader)})
    board.route(leading, [Tag("leader", seen)])
    assert await who(b"") == b"leader"
    assert seen[2:] == ["leader:/t.T/Who"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await channel.unary_unary("/t.T/Other")(b"")
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


@served
async def test_a_stream_opened_under_one_role_carries_on_through_the_change(board, channel):
    """What a parked session needs: the stream a standby holds is the one the leader answers."""
    decided = asyncio.Event()

    async def held(request_iterator, context):
        await context.write(b"standing by")
        await decided.wait()
        await context.write(b"accepted")
        async for message in request_iterator:
            await context.write(b"got " + message)

    board.route(Methods.of(handler("/t.T/Session", held, streaming=True)), [])
    call = channel.stream_stream("/t.T/Session")()
    assert await call.read() == b"standing by"
    board.route(Methods(), [])  # the leader's methods, which know nothing of this stream
    decided.set()
    assert await call.read() == b"accepted"
    await call.write(b"heartbeat")
    assert await call.read() == b"got heartbeat"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


class _Aborted(Exception):
    pass


class _Context:
    """Enough of a ServicerContext for Standby.refuse: what it set and how it ended the call."""

    def __init__(self) -> None:
        self.trailing: tuple = ()
        self.ended: tuple = ()

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    async def abort(self, code, details):
        self.ended = (code, details)
        raise _Aborted


@pytest.mark.parametrize("problem, said", [
    ("", "controller c2 is a standby: the leader is c1 at 127.0.0.1:7001"),
    ("etcd unavailable: connection refused", "controller c2 is a standby: the leader was c1 at 127.0.0.1:7001 when "
                                             "etcd last answered (etcd unavailable: connection refused)"),
])
def test_a_standby_names_the_leader_and_says_when_etcd_no_longer_answers(problem, said):
    """A standby cut off from etcd knows only who led when etcd last answered: it says so (the hint still goes with
    the refusal: clients try it, and a deposed leader refuses in turn)."""
    from types import SimpleNamespace

    from controller.ha import LEADER_METADATA, LeaderInfo, Standby
    from phalanx.clock import RealClock
    elector = SimpleNamespace(name="c2", ttl_s=2.0, problem=problem, leader=LeaderInfo("c1", "127.0.0.1:7001", 5, 0),
                              clock=RealClock())
    context = _Context()

    async def refuse():
        with pytest.raises(_Aborted):
            await Standby(elector).refuse(context)
    asyncio.run(refuse())
    assert context.ended == (grpc.StatusCode.UNAVAILABLE, said)
    assert context.trailing == ((LEADER_METADATA, "127.0.0.1:7001"),)


class _ParkedServer:
    """ParkedSessions behind a real gRPC server on loopback; `park(n)` parks `n` sessions, one after the other (each
    in the queue before the next parks), and returns the calls with their StandingBy."""

    def __init__(self, leader) -> None:
        from controller.api.node_service import ParkedSessions

        async def refuse(context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "standby")

        self.parked = ParkedSessions("c2", refuse, leader, 7.0)
        self.served: list[str] = []

    async def serve(self, context, first) -> None:
        from phalanx.v1 import node_pb2
        self.served.append(first.open.node_name)
        await context.write(node_pb2.ControllerMessage(accepted=node_pb2.SessionAccepted(incarnation=1)))

    async def __aenter__(self) -> _ParkedServer:
        from phalanx.v1 import node_pb2_grpc
        parked = self.parked

        class Service(node_pb2_grpc.NodeServiceServicer):
            async def Session(self, request_iterator, context):
                await parked.Session(request_iterator, context)

        self.server = grpc.aio.server()
        node_pb2_grpc.add_NodeServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.server.stop(0)

    async def park(self, n: int) -> list:
        from phalanx.v1 import node_pb2, node_pb2_grpc
        calls = []
        for i in range(n):
            call = node_pb2_grpc.NodeServiceStub(self.channel).Session()
            await call.write(node_pb2.AgentMessage(open=node_pb2.SessionOpen(
                node_name=f"n{i}", incarnation=1, standby=True)))
            calls.append((call, (await call.read()).standing_by))
        return calls


def test_parked_sessions_are_promised_a_takeover_window_for_their_place_in_the_queue_and_taken_up_in_order():
    """A standby tells each parked session how long to wait for the take-up: the lease and a margin, and more the
    later it parked (first parked, first taken up, at no less than TAKE_RATE a second). An agent that stopped
    waiting too early would open a session of its own, which costs a busy new leader more than the take-up."""
    from controller.api import node_service

    async def go():
        async with _ParkedServer(lambda: "127.0.0.1:7001") as standby:
            parked_calls = await standby.park(3)
            for _, standing_by in parked_calls:
                assert standing_by.controller == "c2" and standing_by.leader == "127.0.0.1:7001"
            windows = [standing_by.takeover_s for _, standing_by in parked_calls]
            assert windows == [pytest.approx(7.0 + i / node_service.TAKE_RATE) for i in range(3)]
            done = asyncio.Event()
            standby.parked.take(standby.serve, done=done.set)  # done: the take-up is over (health is judged then)
            for call, _ in parked_calls:
                assert (await call.read()).WhichOneof("body") == "accepted"
            assert standby.served == ["n0", "n1", "n2"]
            await asyncio.wait_for(done.wait(), 30)
            for call, _ in parked_calls:
                call.cancel()
    asyncio.run(go())


def test_a_new_leader_takes_no_more_sessions_up_while_too_many_taken_up_are_unheard(monkeypatch):
    """Sessions taken up faster than their agents answer (a first heartbeat) would be found silent: the take-up
    waits while TAKE_AHEAD of them are unheard from."""
    from controller.api import node_service
    from controller.api.node_service import ParkedSessions

    monkeypatch.setattr(node_service, "TAKE_BATCH", 1)
    monkeypatch.setattr(node_service, "TAKE_AHEAD", 1)
    monkeypatch.setattr(node_service, "TAKE_WAIT_MAX_S", 3600.0)

    async def go():
        parked = ParkedSessions("c2", None, lambda: "", 7.0)
        turns = [node_service._Parked(), node_service._Parked()]
        parked._waiters.extend(turns)
        heard = [0]
        done = asyncio.Event()
        parked.take(None, done=done.set, unheard=lambda: sum(t.taken for t in turns) - heard[0])
        await asyncio.wait_for(turns[0].wake.wait(), 30)
        for _ in range(10):
            await asyncio.sleep(node_service.TAKE_PAUSE_S)
            assert not turns[1].taken  # the first is not heard from yet
        heard[0] = 1  # its first heartbeat
        await asyncio.wait_for(turns[1].wake.wait(), 30)
        assert turns[1].taken
        await asyncio.wait_for(done.wait(), 30)
    asyncio.run(go())


def test_parked_sessions_are_told_of_a_new_leader_and_still_taken_up(monkeypatch):
    """A standby that sees another controller elected sends each parked session StandingBy again, naming it (an
    agent not parked at the new leader goes there at once); the sessions stay parked, and are taken up in order
    should this standby win a later election. Once it leads, it names no one."""
    from controller.api import node_service

    monkeypatch.setattr(node_service, "NAME_DELAY_S", 0.0)
    monkeypatch.setattr(node_service, "TAKE_BATCH", 2)  # the naming goes in batches too

    async def go():
        leader = ["127.0.0.1:7001"]
        async with _ParkedServer(lambda: leader[0]) as standby:
            parked = standby.parked
            parked_calls = await standby.park(3)
            assert all(standing_by.leader == "127.0.0.1:7001" for _, standing_by in parked_calls)
            while parked.waiting < 3:
                await asyncio.sleep(0.01)
            leader[0] = "127.0.0.1:7003"  # another election, another winner
            parked.name_leader()
            for call, _ in parked_calls:
                named = await asyncio.wait_for(call.read(), 30)
                assert named.standing_by.controller == "c2" and named.standing_by.leader == "127.0.0.1:7003"
            assert parked.waiting == 3
            parked.take(standby.serve)
            for call, _ in parked_calls:
                assert (await asyncio.wait_for(call.read(), 30)).WhichOneof("body") == "accepted"
            assert standby.served == ["n0", "n1", "n2"]
            parked._naming = None
            parked.name_leader()  # leads now: nothing more on the sessions taken up
            assert parked._naming is None
            for call, _ in parked_calls:
                call.cancel()
    asyncio.run(go())
