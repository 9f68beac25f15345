"""Clients given several controllers reach the one that leads: the CLI (as a user runs it) and torchrun's
rendezvous handler, against standbys that answer as controller/ha.py's do, real controllers, and dead ports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from concurrent import futures

import grpc
import pytest

from phalanx import leader
from phalanx.leader import Follower, leader_hint, next_address, parse_controllers, pause_after
from phalanx.ports import free_port
from phalanx.v1 import control_pb2, control_pb2_grpc
from tests.cluster import TIMEOUT_S, Cluster

pytestmark = pytest.mark.etcd  # the tier (tests/conftest.py)

LIST_CONTROLLERS = "/phalanx.v1.ControlService/ListControllers"


class FakeStandby:
    """A standby controller on loopback: every call but ListControllers is refused UNAVAILABLE, with the leader
    in the `phalanx-leader` trailing metadata while `leader` is set (as controller/ha.py's Standby does)."""

    def __init__(self, leader_address: str | None, listing: control_pb2.ListControllersResponse | None = None):
        self.leader = leader_address
        self.listing = listing or control_pb2.ListControllersResponse(store="etcd", answered_by="c2")
        self.refused = threading.Event()  # set at the first refusal
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((self._Handler(self),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    class _Handler(grpc.GenericRpcHandler):
        def __init__(self, standby: FakeStandby) -> None:
            self.standby = standby

        def service(self, call_details):
            if call_details.method == LIST_CONTROLLERS:
                return grpc.unary_unary_rpc_method_handler(
                    lambda request, context: self.standby.listing,
                    request_deserializer=control_pb2.ListControllersRequest.FromString,
                    response_serializer=control_pb2.ListControllersResponse.SerializeToString)
            return grpc.stream_stream_rpc_method_handler(self.standby.refuse)

    def refuse(self, requests, context):
        where = "no leader is elected yet; try again shortly"
        if self.leader:
            context.set_trailing_metadata(((leader.LEADER_METADATA, self.leader),))
            where = f"the leader is c1 at {self.leader}"
        self.refused.set()
        context.abort(grpc.StatusCode.UNAVAILABLE, f"controller c2 is a standby: {where}")

    def stop(self) -> None:
        self.server.stop(None)


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    """One real controller (SQLite, plaintext): the leader the standbys name."""
    c = Cluster(tmp_path_factory.mktemp("leader"))
    c.start_controller()
    yield c
    c.close()


@pytest.fixture
def standby(controller):
    s = FakeStandby(controller.address)
    yield s
    s.stop()


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


def phalanx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PHALANX_CONTROLLER", "PHALANX_HOME")}
    return subprocess.run([sys.executable, "-m", "cli.main", "--insecure", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


# --- parsing and decisions ------------------------------------------------------------------------------------------

def test_a_controller_list_is_split_trimmed_and_deduplicated():
    assert parse_controllers("ctl:7370") == ["ctl:7370"]
    assert parse_controllers(" a:1 , b:2,,a:1, c:3 ,") == ["a:1", "b:2", "c:3"]
    for text in ("", " ", ",", " , ,"):
        with pytest.raises(ValueError) as info:
            parse_controllers(text)
        assert str(info.value) == (f"no controller address in {text!r}: give HOST:PORT, or several as "
                                   "HOST:PORT,HOST:PORT")
    assert parse_controllers("[::1]:7370,ctl.example:1") == ["[::1]:7370", "ctl.example:1"]
    for text, bad in (("127.0.0.1:99999", "127.0.0.1:99999"), ("127.0.0.1", "127.0.0.1"), ("a:1,b", "b"),
                      (":7370", ":7370"), ("a:0", "a:0"), ("a:x", "a:x")):
        with pytest.raises(ValueError, match=f"controller address '{re.escape(bad)}' must be HOST:PORT"):
            parse_controllers(text)


def test_the_next_address_is_the_hinted_leader_then_the_list_in_order():
    addresses = ["a", "b", "c"]
    assert next_address(addresses, {"a"}, "c") == "c"
    assert next_address(addresses, {"a"}, "elsewhere") == "elsewhere"  # a leader not in the list is followed
    assert next_address(addresses, {"a"}, None) == "b"
    assert next_address(addresses, {"a", "b"}, "a") == "c"  # a stale hint is not followed in circles
    assert next_address(addresses, {"a", "b", "c"}, "b") is None


def test_passes_go_on_while_a_standby_answers_and_stop_after_one_retry_when_nothing_does():
    assert [pause_after(n, True, 0.0, 10.0) for n in (1, 2, 3, 4, 5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert pause_after(1, False, 0.0, 10.0) == 0.2
    assert pause_after(2, False, 0.0, 10.0) is None
    assert pause_after(3, True, 9.5, 10.0) is None  # the next pause would end past the deadline


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, hint: str | None = None) -> None:
        super().__init__(details)
        self._code, self._details, self._hint = code, details, hint

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self):
        return ((leader.LEADER_METADATA, self._hint),) if self._hint else ()


class FakeChannel:
    """Connects at once (what connects() watches for); calls are answered by the test's `answers`."""

    def __init__(self, address: str, silent: bool = False) -> None:
        self.address, self.silent = address, silent  # silent: never connects (a host that drops packets)
        self.watched, self.closed = 0, False

    def subscribe(self, callback, try_to_connect=False) -> None:
        self.watched += 1
        callback(grpc.ChannelConnectivity.CONNECTING if self.silent else grpc.ChannelConnectivity.READY)

    def unsubscribe(self, callback) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class Run:
    """A Follower on fake channels and fake time: `answers` maps an address to what a call there gets."""

    def __init__(self, addresses: list[str], answers: dict[str, object], silent: frozenset[str] = frozenset()):
        self.answers, self.asked, self.pauses, self.now, self.silent = answers, [], [], 0.0, set(silent)
        self.channels: list[FakeChannel] = []
        self.follower = Follower(addresses, self._channel, connect_s=0.001, monotonic=lambda: self.now,
                                 sleep=self._sleep)

    def _channel(self, address: str) -> FakeChannel:
        self.channels.append(FakeChannel(address, silent=address in self.silent))
        return self.channels[-1]

    def _sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds

    def call(self):
        def fn(channel: FakeChannel):
            self.asked.append(channel.address)
            answer = self.answers.get(channel.address, Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused"))
            if isinstance(answer, Exception):
                raise answer
            return answer
        return self.follower.call(fn)


STANDBY_NO_LEADER = Refusal(grpc.StatusCode.UNAVAILABLE, "controller c2 is a standby: no leader is elected yet")


def test_the_follower_goes_where_a_standby_points_and_starts_there_next_time():
    run = Run(["a", "b"], {"a": Refusal(grpc.StatusCode.UNAVAILABLE, "standby", hint="x:1"), "x:1": "ok"})
    assert run.call() == "ok" and run.asked == ["a", "x:1"] and run.pauses == []
    assert run.call() == "ok" and run.asked == ["a", "x:1", "x:1"]


def test_the_follower_waits_out_an_election_until_its_patience_ends():
    run = Run(["a", "b"], {"a": STANDBY_NO_LEADER, "b": STANDBY_NO_LEADER})
    with pytest.raises(Refusal) as info:
        run.call()
    assert info.value is STANDBY_NO_LEADER
    assert run.pauses[:5] == [0.2, 0.4, 0.8, 1.0, 1.0] and sum(run.pauses) <= leader.FOLLOW_S
    assert sum(run.pauses) + 1.0 > leader.FOLLOW_S  # it used its patience
    run.answers["b"] = "elected"
    assert run.call() == "elected"


def test_a_channel_is_watched_once():
    run = Run(["a", "b"], {"a": STANDBY_NO_LEADER, "b": "ok"})
    assert run.call() == "ok" and run.call() == "ok"
    run.answers.update(a="ok", b=Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused"))  # a leads now
    assert run.call() == "ok"
    assert [(c.address, c.watched) for c in run.channels] == [("a", 1), ("b", 1)]


def test_a_controller_that_does_not_connect_is_passed_over_and_its_channel_replaced():
    run = Run(["a", "b"], {"a": "from a", "b": "from b"}, silent=frozenset("a"))
    assert run.call() == "from b" and run.asked == ["b"]  # nothing was sent to a
    assert [(c.address, c.closed) for c in run.channels] == [("a", True), ("b", False)]
    run.silent.clear()  # a's host is back
    run.answers["b"] = Refusal(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert run.call() == "from a"
    assert [(c.address, c.watched) for c in run.channels] == [("a", 1), ("b", 1), ("a", 1)]


def test_a_dead_controller_is_reported_after_one_short_retry():
    run = Run(["a"], {})
    with pytest.raises(Refusal, match="connection refused"):
        run.call()
    assert run.asked == ["a", "a"] and run.pauses == [0.2]


def test_an_answer_that_is_not_unavailable_is_raised_at_once():
    denied = Refusal(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    run = Run(["a", "b"], {"a": STANDBY_NO_LEADER, "b": denied})
    with pytest.raises(Refusal) as info:
        run.call()
    assert info.value is denied and run.asked == ["a", "b"] and run.pauses == []
    assert run.follower.current == "b"  # it answered: the next call starts there


def test_a_leader_that_stops_answering_is_left_for_the_next_controller():
    """A leader whose host went down after its channel connected: calls time out (gRPC says UNAVAILABLE only once
    its reconnect gives up), and the follower stayed there. The timeout is raised (the call may have been applied),
    and the next call goes to the next controller, on a fresh channel; a standby there names the new leader."""
    timeout = Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    run = Run(["a", "b", "c"], {"a": "ok"})
    assert run.call() == "ok"
    run.answers.update(a=timeout, b=Refusal(grpc.StatusCode.UNAVAILABLE, "standby", hint="c"), c="from c")
    with pytest.raises(Refusal) as info:
        run.call()
    assert info.value is timeout and run.asked == ["a", "a"] and run.channels[0].closed
    assert run.call() == "from c" and run.asked == ["a", "a", "b", "c"]
    alone = Run(["a"], {"a": timeout})  # no other controller to go to: stays
    with pytest.raises(Refusal):
        alone.call()
    assert alone.follower.current == "a" and not alone.channels[0].closed


def test_a_stream_that_broke_moves_to_the_hint_or_the_next_controller():
    follower = Follower(["a", "b", "c"], FakeChannel)
    assert follower.moved(Refusal(grpc.StatusCode.UNAVAILABLE, "standby", hint="c")) is True
    assert follower.current == "c"
    assert follower.moved(Refusal(grpc.StatusCode.UNAVAILABLE, "gone")) is False
    assert follower.current == "a"  # round the list
    follower.close()


def test_the_hint_is_read_from_sync_and_asyncio_errors(standby, controller):
    with grpc.insecure_channel(standby.address) as channel, pytest.raises(grpc.RpcError) as info:
        control_pb2_grpc.ControlServiceStub(channel).ListNodes(control_pb2.ListNodesRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and leader_hint(info.value) == controller.address
    assert leader.from_standby(info.value)

    async def ask() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(standby.address) as channel:
            try:
                await control_pb2_grpc.ControlServiceStub(channel).ListNodes(control_pb2.ListNodesRequest(),
                                                                             timeout=10)
            except grpc.aio.AioRpcError as e:
                return e
        raise AssertionError("the standby answered")

    assert leader_hint(asyncio.run(ask())) == controller.address

    with grpc.insecure_channel(dead_address()) as channel, pytest.raises(grpc.RpcError) as info:
        control_pb2_grpc.ControlServiceStub(channel).ListNodes(control_pb2.ListNodesRequest(), timeout=10)
    assert leader_hint(info.value) is None and not leader.from_standby(info.value)


# --- the CLI --------------------------------------------------------------------------------------------------------

def test_the_cli_gets_its_answers_from_the_leader_through_a_standby(controller, standby):
    submitted = phalanx("--controller", f"{standby.address},{controller.address}", "submit", "--name", "follow",
                        "--", "true")
    assert submitted.returncode == 0, submitted.stderr
    assert standby.refused.is_set()
    job_id = submitted.stdout.strip()
    # the leader is not in the list: only the standby's hint leads there
    job = phalanx("--controller", f"{dead_address()},{standby.address}", "job", job_id, "--json")
    assert job.returncode == 0, job.stderr
    assert json.loads(job.stdout)["name"] == "follow"


def test_the_cli_waits_for_an_election_and_then_follows_the_new_leader(controller):
    standby = FakeStandby(None)
    try:
        cli = subprocess.Popen([sys.executable, "-m", "cli.main", "--insecure", "--controller",
                                standby.address, "jobs", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
        assert standby.refused.wait(TIMEOUT_S), "the CLI never asked the standby"
        standby.leader = controller.address  # elected
        out, err = cli.communicate(timeout=TIMEOUT_S)
    finally:
        standby.stop()
    assert cli.returncode == 0, err
    assert isinstance(json.loads(out), list)


def test_a_controller_that_never_connects_is_passed_over(controller):
    silent = socket.socket()  # accepts TCP but never speaks HTTP/2: a host whose controller hangs
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        result = phalanx("--controller", f"127.0.0.1:{silent.getsockname()[1]},{controller.address}", "jobs", "--json")
    finally:
        silent.close()
    assert result.returncode == 0, result.stderr
    assert isinstance(json.loads(result.stdout), list)


def test_the_error_names_every_controller_when_none_answers():
    first, second = dead_address(), dead_address()
    result = phalanx("--controller", f"{first}, {second}", "nodes")
    assert result.returncode == 1
    assert result.stderr.startswith(f"phalanx: error: cannot reach the controller at {first},{second}: ")
    empty = phalanx("--controller", " , ", "nodes")
    assert empty.returncode == 2
    assert empty.stderr.strip() == ("phalanx: error: no controller address in ' , ': give HOST:PORT, or several as "
                                    "HOST:PORT,HOST:PORT")
    portless = phalanx("--controller", "127.0.0.1", "nodes")  # gRPC would have dialled port 443
    assert portless.returncode == 2 and "controller address '127.0.0.1' must be HOST:PORT" in portless.stderr


def test_an_election_that_outlasts_the_cli_says_so():
    import argparse

    from cli.main import FAILED, rpc_error

    error = rpc_error(STANDBY_NO_LEADER, argparse.Namespace(controller="a:1, b:2"))
    assert (str(error), error.code) == ("cannot reach a leading controller at a:1,b:2: controller c2 is a standby: "
                                        "no leader is elected yet", FAILED)


def test_controllers_on_a_single_sqlite_controller(controller):
    listing = phalanx("--controller", f"{dead_address()},{controller.address}", "controllers", "--json")
    assert listing.returncode == 0, listing.stderr
    reply = json.loads(listing.stdout)
    assert reply["store"] == "sqlite" and reply["problem"] is None
    assert [(m["address"], m["role"]) for m in reply["members"]] == [(controller.address, "leader")]
    assert reply["leader"] == reply["members"][0]["name"] and reply["leader_address"] == controller.address
    assert reply["members"][0]["started"] and reply["members"][0]["epoch"] == 0  # no election: no epoch
    text = phalanx("--controller", controller.address, "controllers")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].split() == ["NAME", "ADDRESS", "ROLE", "EPOCH", "STARTED"]
    assert lines[1].split()[1:3] == [controller.address, "leader"] and lines[1].endswith(" ago")
    assert any(line.startswith(f"leader: {reply['leader']} at {controller.address} (leading for ") for line in lines)
    assert any(line.startswith("store: sqlite") for line in lines)


def test_controllers_as_a_standby_tells_them(controller):
    now = 1_700_000_000 * 10**9
    standby = FakeStandby(controller.address, control_pb2.ListControllersResponse(
        members=[control_pb2.ControllerMember(name="c0", address="10.0.0.1:7370", started_unix_ns=now),
                 control_pb2.ControllerMember(name="c1", address="10.0.0.2:7370", leader=True, epoch=3,
                                              started_unix_ns=now, leader_since_unix_ns=now),
                 control_pb2.ControllerMember(name="c2", address="10.0.0.3:7370")],
        leader="c1", leader_address="10.0.0.2:7370", epoch=3, store="etcd", answered_by="c2"))
    try:
        text = phalanx("--controller", standby.address, "controllers")
        as_json = phalanx("--controller", standby.address, "controllers", "--json")
        standby.listing = control_pb2.ListControllersResponse(
            members=[control_pb2.ControllerMember(name="c2", address="10.0.0.3:7370")], store="etcd",
            answered_by="c2", problem="etcd unavailable: connection refused")
        no_leader = phalanx("--controller", standby.address, "controllers")
    finally:
        standby.stop()
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert [line.split()[:3] for line in lines[1:4]] == [["c0", "10.0.0.1:7370", "standby"],
                                                          ["c1", "10.0.0.2:7370", "leader"],
                                                          ["c2", "10.0.0.3:7370", "standby"]]
    assert lines[2].split()[3] == "3" and lines[3].split()[3:] == ["-", "-"]
    assert lines[4].startswith("leader: c1 at 10.0.0.2:7370, epoch 3 (leading for ")
    assert lines[5:] == ["store: etcd (answered by c2)"]
    reply = json.loads(as_json.stdout)
    assert {k: reply[k] for k in ("leader", "leader_address", "epoch", "store", "answered_by", "problem")} == {
        "leader": "c1", "leader_address": "10.0.0.2:7370", "epoch": 3, "store": "etcd", "answered_by": "c2",
        "problem": None}
    assert reply["members"][1] == {"name": "c1", "address": "10.0.0.2:7370", "role": "leader", "epoch": 3,
                                   "started": "2023-11-14T22:13:20.000Z", "leader_since": "2023-11-14T22:13:20.000Z"}
    assert reply["members"][2]["started"] is None
    assert no_leader.returncode == 1  # no leader: a script can tell
    assert no_leader.stdout.splitlines()[2:] == ["leader: none elected", "store: etcd (answered by c2)",
                                                 "problem: etcd unavailable: connection refused"]


def test_events_follow_goes_to_the_leader(controller, standby):
    submitted = phalanx("--controller", controller.address, "submit", "--name", "watched", "--", "true")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    follow = subprocess.Popen([sys.executable, "-m", "cli.main", "--insecure", "--controller",
                               f"{standby.address},{controller.address}", "events", "--follow", "--json", "--job",
                               job_id], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT_S, follow.kill)
    watchdog.start()
    try:
        line = follow.stdout.readline()
    finally:
        watchdog.cancel()
        follow.kill()
        _, err = follow.communicate()
    assert line, f"no event came: {err}"
    assert json.loads(line)["job"] == job_id
    assert standby.refused.is_set() and "lost the controller" not in err  # the hint was followed at once


# --- a real highly available control plane --------------------------------------------------------------------------

def test_the_cli_follows_a_real_failover(tmp_path, etcd_server):
    c = Cluster(tmp_path)
    addresses = {f"c{i}": f"127.0.0.1:{free_port()}" for i in range(3)}
    prefix = f"/test-follow/{uuid.uuid4().hex}/"
    everyone = ",".join(addresses.values())
    try:
        for name, address in addresses.items():
            c._spawn(name, "controller.main",
                     f'listen = "{address}"\n[store]\nbackend = "etcd"\netcd_endpoints = "{etcd_server.endpoint}"\n'
                     f'etcd_prefix = "{prefix}"\netcd_tls = false\nname = "{name}"\nadvertise = "{address}"\n'
                     'lease_ttl_s = 2\n[security]\ninsecure = true\n')

        def listing() -> dict | None:
            result = phalanx("--controller", everyone, "controllers", "--json")
            return json.loads(result.stdout) if result.returncode == 0 else None

        c.wait_for(lambda: (reply := listing()) is not None and len(reply["members"]) == 3, "three members, a leader")
        reply = listing()
        assert reply["store"] == "etcd" and reply["epoch"] > 0
        assert [m["name"] for m in reply["members"] if m["role"] == "leader"] == [reply["leader"]]
        submitted = phalanx("--controller", everyone, "submit", "--name", "survivor", "--", "true")
        assert submitted.returncode == 0, submitted.stderr

        c.kill(reply["leader"], signal.SIGKILL)
        # at once: the CLI waits out the election (standbys answer meanwhile) and asks the new leader
        jobs = phalanx("--controller", everyone, "jobs", "--json")
        assert jobs.returncode == 0, jobs.stderr
        assert [j["name"] for j in json.loads(jobs.stdout)] == ["survivor"]
        after = listing()
        assert after["leader"] != reply["leader"] and after["epoch"] > reply["epoch"]
    finally:
        c.close()


# --- torchrun's rendezvous handler ----------------------------------------------------------------------------------

def test_rdzv_endpoint_takes_a_list(monkeypatch):
    pytest.importorskip("torch")
    from trainlib.torchrun_plugin import parse_endpoints

    monkeypatch.delenv("PHALANX_CONTROLLER", raising=False)
    assert parse_endpoints("ctl") == ("ctl:7370",)
    assert parse_endpoints(" a:1, b , [::1]:9000,a:1,b:7370 ") == ("a:1", "b:7370", "[::1]:9000")
    with pytest.raises(ValueError) as info:
        parse_endpoints("a:1,host:port")
    assert str(info.value) == "--rdzv-endpoint 'host:port': the port ('port') must be a number from 1 to 65535"
    with pytest.raises(ValueError) as info:
        parse_endpoints(" , ")
    assert str(info.value) == ("--rdzv-endpoint is empty; give the Phalanx controller's address as HOST:PORT "
                               "(or set PHALANX_CONTROLLER)")
    monkeypatch.setenv("PHALANX_CONTROLLER", "c1:7000,c2")
    assert parse_endpoints("") == ("c1:7000", "c2:7370")


def test_the_rendezvous_handler_follows_the_leader(controller, standby, monkeypatch):
    pytest.importorskip("torch")
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainlib.torchrun_plugin import create_handler

    monkeypatch.setenv("PHALANX_INSECURE", "1")
    handler = create_handler(RendezvousParameters(backend="phalanx", endpoint=f"{dead_address()},{standby.address}",
                                                  run_id="followed", min_nodes=1, max_nodes=1))
    assert handler.is_closed() is False
    assert standby.refused.is_set()
    handler.set_closed()
    assert handler.is_closed() is True
    assert handler.shutdown()
