"""The lighthouse as the controller runs it (controller/lighthouse.py): a process per replica-group job that never
imports torch or torchft, outlives its controller and is taken up by the next (or ends after its grace), is started on
the job's stored port again when it is gone, and takes a group the controller judged out of the quorum at once. It
answers as torchft's own lighthouse does (run side by side with it) and torchft's client talks to it."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import psutil
import pytest

from controller.config import ReplicasConfig
from controller.lighthouse import LighthouseError, Lighthouses, describe
from phalanx.torchft import lighthouse_pb2 as ft
from phalanx.torchft import lighthouse_pb2_grpc as ft_grpc
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)
needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed (requirements-dev.txt)")

CFG = ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def closed(port: int) -> None:
    """Until nothing listens on `port` (a lighthouse told to stop, or ending by itself)."""
    for _ in range(600):
        if not listening(port):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"port {port} still listens")


def test_a_lighthouse_outlives_its_controller_and_the_next_one_takes_it_up():
    async def run() -> None:
        first = Lighthouses(CFG, "127.0.0.1")
        held = await first.ensure("job-1")
        port, pid = held.port, held.child.pid
        assert listening(port) and held.url() == f"http://127.0.0.1:{port}" and held.host == "127.0.0.1"
        assert await first.ensure("job-1", port) is held  # looked after here: the same one
        await first.close()  # the controller stops (or dies): the lighthouse serves on
        assert listening(port) and psutil.pid_exists(pid)
        job = common_pb2.Job()
        describe(job, held)
        assert (job.lighthouse_port, job.lighthouse_host, job.lighthouse_control) == (port, "127.0.0.1", held.control)
        # the next controller, from the record: the same process taken up, not another started
        second = Lighthouses(CFG, "127.0.0.1")
        taken = await second.ensure("job-1", job.lighthouse_port, job.lighthouse_host, job.lighthouse_control,
                                    job.lighthouse_token)
        assert taken.child is None and taken.port == port and second.held("job-1") is taken
        await second.stop("job-1")  # the job ended
        await closed(port)
        # a record naming a lighthouse that is gone: one started again, on the port the ranks were told
        again = await second.ensure("job-1", port, job.lighthouse_host, job.lighthouse_control,
                                    job.lighthouse_token)
        assert again.child is not None and again.port == port and again.token != job.lighthouse_token
        await second.stop("job-1")
        await closed(port)
        assert held.child.poll() is not None  # (reaped by the controller that started it)

    asyncio.run(run())


def test_a_lighthouse_no_controller_takes_up_ends_after_its_grace_and_the_token_guards_it():
    async def run() -> None:
        lighthouses = Lighthouses(ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1",
                                                 orphan_grace_s=1.0), "127.0.0.1")
        held = await lighthouses.ensure("job-1")
        # a connection without the token neither holds it nor stops it: the next controller cannot take it up
        control = ("127.0.0.1", int(held.control.rsplit(":", 1)[1]))
        with socket.create_connection(control) as s:
            s.sendall(b"wrong\nstop\n")
            assert s.recv(64) == b""  # closed on it
        with socket.create_connection(control) as s:  # nor one that never finishes its first line
            s.sendall(b"x" * 300)
            assert s.recv(64) == b""
        assert listening(held.port)
        other = Lighthouses(CFG, "127.0.0.1")  # not taken up with another token: one started, on another port
        started = await other.ensure("job-1", held.port, "127.0.0.1", held.control, "not-the-token")
        assert started.child is not None and started.port != held.port
        await other.stop("job-1")
        await lighthouses.close()
        await closed(held.port)  # nobody took it up within its grace: it ended
        held.child.poll()

    asyncio.run(run())


def test_the_lighthouse_process_refuses_to_start_without_its_token():
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_LIGHTHOUSE_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "controller.lighthouse_main", "--bind", "127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "error: no PHALANX_LIGHTHOUSE_TOKEN" in out.stdout


def test_the_lighthouse_process_imports_neither_torch_nor_torchft():
    code = ("import sys, controller.lighthouse_main, controller.lighthouse; "
            "print('torch' in sys.modules, 'torchft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_without_a_lighthouse_the_reason_is_said():
    async def run() -> None:
        with pytest.raises(LighthouseError, match=r"\[replicas\] lighthouse = false"):
            await Lighthouses(ReplicasConfig(lighthouse=False)).ensure("job-1")

    asyncio.run(run())


def test_a_port_taken_starts_the_lighthouse_on_another_and_a_bad_bind_is_a_lighthouse_error_not_a_crash():
    async def run() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            lighthouses = Lighthouses(CFG, "127.0.0.1")
            held = await lighthouses.ensure("job-1", s.getsockname()[1])  # (the nodes' agents relay the ranks to it)
            assert held.port != s.getsockname()[1] and listening(held.port)
            await lighthouses.stop("job-1")
        bad = ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="192.0.2.1")  # no such interface here
        with pytest.raises(LighthouseError):
            await Lighthouses(bad, "127.0.0.1").ensure("job-1", 0)

    asyncio.run(run())


def test_a_launch_cancelled_while_its_lighthouse_starts_leaves_it_looked_after_not_leaked():
    async def run() -> None:
        def started() -> set[int]:
            out = set()
            for p in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    if p.status() != psutil.STATUS_ZOMBIE and "lighthouse_main" in " ".join(p.cmdline()):
                        out.add(p.pid)
            return out

        before = started()
        lighthouses = Lighthouses(CFG, "127.0.0.1")
        first = asyncio.create_task(lighthouses.ensure("job-1"))
        await asyncio.sleep(0.01)  # spawned, not yet ready
        first.cancel()
        again = await lighthouses.ensure("job-1")  # the same start, finished: not a second process
        assert lighthouses.held("job-1") is again and started() - before == {again.child.pid}
        await lighthouses.stop("job-1")
        await closed(again.port)

    asyncio.run(run())


# -- the same answers as torchft's lighthouse; torchft's client; a drop ----------------------------------------------

SLOW = dict(min_replicas=1, join_timeout_ms=60_000, quorum_tick_ms=100, heartbeat_timeout_ms=60_000)


def ask(stub: ft_grpc.LighthouseServiceStub, names: list[str], timeout_s: float = 30.0, **fields) -> dict:
    """Each of `names` asks for the quorum at once: replica id -> (quorum id, its members), or the gRPC status code
    of a refusal."""
    def one(name: str):
        requester = ft.QuorumMember(replica_id=name, address=f"http://{name}", store_address="s:1", step=3,
                                    world_size=2, **fields)
        try:
            quorum = stub.Quorum(ft.LighthouseQuorumRequest(requester=requester), timeout=timeout_s).quorum
        except grpc.RpcError as e:  # (a deadline passed: the client's, or the server's of the same request, first)
            return grpc.StatusCode.DEADLINE_EXCEEDED if e.code() == grpc.StatusCode.CANCELLED else e.code()
        return quorum.quorum_id, tuple(p.replica_id for p in quorum.participants)

    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(one, names), strict=True))


def story(address: str) -> tuple[int, list[dict]]:
    """One run of requests whose answers do not depend on the order they arrive in (see each step): the first
    quorum's id, and each step's answers with the ids counted from it (torchft's first is 1, ours the clock's)."""
    with grpc.insecure_channel(address) as channel:
        stub = ft_grpc.LighthouseServiceStub(channel)
        for name in ("j-group0:a", "j-group1:b"):
            stub.Heartbeat(ft.LighthouseHeartbeatRequest(replica_id=name), timeout=10)
        steps = [ask(stub, ["j-group0:a", "j-group1:b"]),  # both alive: issued once both asked
                 ask(stub, ["j-group1:b", "j-group0:a"])]  # the same members: a fast quorum, the same id
        # a newcomer asks first, alone (its request stays a participant after its deadline): its answer is no
        # quorum (the others have not asked); the old members then ask, and it is in the quorum they get
        steps += [ask(stub, ["j-group2:c"], timeout_s=1.0),
                  ask(stub, ["j-group0:a", "j-group1:b"]),
                  ask(stub, ["j-group0:a", "j-group1:b", "j-group2:c"], commit_failures=1),  # a failed commit: new id
                  ask(stub, ["j-group2:c", "j-group1:b", "j-group0:a"], shrink_only=True)]  # the same: the same id
    first = steps[0]["j-group0:a"][0]
    return first, [{name: (answer[0] - first + 1, answer[1]) if isinstance(answer, tuple) else answer
                    for name, answer in step.items()} for step in steps]


@needs_torchft
def test_the_lighthouse_answers_as_torchfts_own_does():
    from torchft._torchft import LighthouseServer  # (imports torch: this test's process only)

    native = LighthouseServer(bind="127.0.0.1:0", **SLOW)
    try:
        first, theirs = story(f"127.0.0.1:{native.address().rsplit(':', 1)[1]}")
    finally:
        native.shutdown()

    async def ours() -> list[dict]:
        lighthouses = Lighthouses(ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1",
                                                 join_timeout_ms=SLOW["join_timeout_ms"],
                                                 heartbeat_timeout_ms=SLOW["heartbeat_timeout_ms"]), "127.0.0.1")
        held = await lighthouses.ensure("job-1")
        try:
            return await asyncio.to_thread(story, f"127.0.0.1:{held.port}")
        finally:
            await lighthouses.stop("job-1")

    assert first == 1
    started_ms = time.time_ns() // 1_000_000
    first, mine = asyncio.run(ours())
    assert mine == theirs
    assert first > started_ms  # a lighthouse started again never issues an id issued before
    ab, abc = ("j-group0:a", "j-group1:b"), ("j-group0:a", "j-group1:b", "j-group2:c")
    assert mine[2] == {"j-group2:c": grpc.StatusCode.DEADLINE_EXCEEDED}
    del mine[2]
    assert [sorted(set(step.values())) for step in mine] == [[(1, ab)], [(1, ab)], [(2, abc)], [(3, abc)], [(3, abc)]]


@needs_torchft
def test_a_group_dropped_by_the_controller_leaves_the_quorum_at_once_and_torchfts_client_is_answered():
    from torchft._torchft import LighthouseClient

    async def run() -> None:
        # (the join timeout SLOW's too: at the default 1 s, a loaded machine once let group 0's quorum form alone
        # before group 1's request came)
        lighthouses = Lighthouses(ReplicasConfig(lighthouse_host="127.0.0.1", lighthouse_bind="127.0.0.1",
                                                 heartbeat_timeout_ms=SLOW["heartbeat_timeout_ms"],
                                                 join_timeout_ms=SLOW["join_timeout_ms"]), "127.0.0.1")
        held = await lighthouses.ensure("job-1")
        try:
            client = LighthouseClient(f"http://127.0.0.1:{held.port}", connect_timeout=timedelta(seconds=30))
            # both groups heartbeat first: the first quorum then waits for both. With group 1's alone (until CI's
            # run of 7ff2d76), group 1's request, when it came first, formed a quorum of group 1 alone (every group
            # known to be alive had asked), and group 0's then waited for a group 1 that never asked again.
            for name in ("j-group0:a", "j-group1:b"):
                await asyncio.to_thread(client.heartbeat, name)

            def torchfts(name: str) -> tuple[int, list[str]]:
                quorum = client.quorum(replica_id=name, timeout=timedelta(seconds=30), address="http://a",
                                       store_address="s:1", step=3, world_size=2, shrink_only=False)
                return quorum.quorum_id, [p.replica_id for p in quorum.participants]

            both = await asyncio.gather(asyncio.to_thread(torchfts, "j-group0:a"),
                                        asyncio.to_thread(torchfts, "j-group1:b"))
            first = both[0][0]
            assert both == [(first, ["j-group0:a", "j-group1:b"])] * 2
            assert held.drop(1, "node-b lost:  xid 79")
            with grpc.insecure_channel(f"127.0.0.1:{held.port}") as channel:
                stub = ft_grpc.LighthouseServiceStub(channel)
                # taken out (once the lighthouse has heard: the word is not answered), group 1 is answered at once
                # with the quorum as it stands without it, which torchft's manager takes for "not participating"
                for _ in range(600):
                    answer = (await asyncio.to_thread(ask, stub, ["j-group1:b"], 0.5))["j-group1:b"]
                    if answer != grpc.StatusCode.DEADLINE_EXCEEDED:
                        break
                assert answer == (first, ("j-group0:a",))
                # its heartbeats would hold the quorum for 60 s: dropped, it is not waited for
                answers = await asyncio.to_thread(ask, stub, ["j-group0:a"])
            assert answers == {"j-group0:a": (first + 1, ("j-group0:a",))}
            assert await asyncio.to_thread(torchfts, "j-group1:b") == (first + 1, ["j-group0:a"])
        finally:
            await lighthouses.stop("job-1")

    asyncio.run(run())
