"""A highly available control plane, on real processes: three controllers on a real etcd, real agents."""

from __future__ import annotations

import json
import signal

import psutil
import pytest

from phalanx import framed
from phalanx.v1 import control_pb2
from tests.ha_cluster import HaCluster, with_own_etcd

pytestmark = pytest.mark.netns  # the tier (tests/conftest.py)


@pytest.fixture
def ha(tmp_path, etcd_server):
    c = HaCluster(tmp_path, etcd_server.endpoint)
    yield c
    c.close()


@pytest.fixture(params=["grpc", "session port"])
def ha_transport(request, tmp_path, etcd_server):
    """The same control plane with the agents' sessions on gRPC, then on the controllers' session port."""
    c = HaCluster(tmp_path, etcd_server.endpoint, session_port=request.param == "session port")
    yield c
    c.close()


GONE = "the leader's process is gone"


def connections_of(c: HaCluster, name: str) -> set[str]:
    """HOST:PORT of every TCP connection process `name` has established."""
    return {f"{conn.raddr.ip}:{conn.raddr.port}" for conn in psutil.Process(c.procs[name].pid).net_connections("tcp")
            if conn.raddr and conn.status == psutil.CONN_ESTABLISHED}


def events(c: HaCluster) -> list[control_pb2.Event]:
    return list(c.control.ListEvents(control_pb2.ListEventsRequest(limit=10_000)).events)


def test_every_member_serves_metrics_standing_by_and_leading(ha):
    """Prometheus scrapes every member of the control plane: a standby says it stands by, whose epoch it follows
    and how many sessions are parked at it, and shows no fleet (that is the leader's); after a takeover, the
    endpoint the new leader served while standing by shows the fleet, its epoch and the failover."""
    from tests.test_metrics import promtool_check, scraped, value
    ha.start_controller(metrics=True)
    ha.start_agent("a")
    ha.wait_states({"a": "UP"})
    old, epoch = ha.leader()
    standbys = [n for n in ha.names if n != old]
    ha.wait_for(lambda: value(scraped(ha.metrics[old]), "phalanx_nodes", state="UP") == 1, "the leader's fleet")
    for name in standbys:
        ha.wait_for(lambda n=name: value(scraped(ha.metrics[n]), "phalanx_controller_parked_sessions") == 1,
                    f"the agent's session parked at {name}, in its metrics")
        text = scraped(ha.metrics[name])
        assert value(text, "phalanx_controller_leader") == 0 and value(text, "phalanx_controller_epoch") == epoch
        assert value(text, "phalanx_nodes", state="UP") is None and value(text, "phalanx_controller_info") == 1
        promtool_check(text)
    leading = scraped(ha.metrics[old])
    assert value(leading, "phalanx_controller_leader") == 1 and value(leading, "phalanx_controller_epoch") == epoch
    ha.kill(old)
    ha.wait_for(lambda: (now := ha.leader()) is not None and now[0] != old, "a new leader")
    new, new_epoch = ha.leader()
    ha.wait_for(lambda: value(scraped(ha.metrics[new]), "phalanx_nodes", state="UP") == 1,
                "the new leader's fleet, on the endpoint it served standing by")
    text = scraped(ha.metrics[new])
    assert value(text, "phalanx_controller_leader") == 1 and value(text, "phalanx_controller_epoch") == new_epoch
    assert value(text, "phalanx_controller_failovers_total") == 1
    other = next(n for n in standbys if n != new)
    ha.wait_for(lambda: value(scraped(ha.metrics[other]), "phalanx_controller_epoch") == new_epoch,
                "the other standby following the new leader's epoch")
    assert value(scraped(ha.metrics[other]), "phalanx_controller_leader") == 0


def test_a_standby_takes_over_from_a_killed_leader_and_nothing_is_lost(ha_transport):
    ha = ha_transport
    ha.start_controller()
    for name in ("a", "b"):
        ha.start_agent(name)
    ha.wait_states({"a": "UP", "b": "UP"})
    listing = ha.controllers()
    assert sorted(m.name for m in listing.members) == ["c0", "c1", "c2"]
    assert [m.name for m in listing.members if m.leader] == [listing.leader] and listing.epoch > 0
    assert listing.store == "etcd"
    ha.control.DrainNode(control_pb2.DrainNodeRequest(name="a", reason="fan"))
    ha.wait_states({"a": "DRAINED", "b": "UP"})
    before = events(ha)
    old, epoch = ha.leader()
    standbys = [n for n in ha.names if n != old]
    ha.wait_for(lambda: all(ha.parked(n) == 2 for n in standbys), "both agents' sessions parked at each standby")
    if ha.session_port:  # parked and leading sessions alike in frames on the session port of every controller
        for agent in ("a", "b"):
            peers = connections_of(ha, agent)
            ports = {framed.session_address(a, ha.session_port) for a in ha.addresses.values()}
            assert ports <= peers, f"{agent}'s connections: {peers}"
    # each standby holds a connection to the leader's port: the leader's death closes it, and the port refuses
    ha.wait_for(lambda: all(ha.addresses[old] in connections_of(ha, n) for n in standbys),
                "each standby's probe of the leader's port")

    ha.kill(old, signal.SIGKILL)
    ha.wait_for(lambda: (ha.leader() or (old,))[0] != old, "a new leader")
    new, new_epoch = ha.leader()
    assert new_epoch > epoch
    # it read the node records changed since it last refreshed its cache of them while standing by, not all of them
    ha.wait_for(lambda: "node records loaded" in ha.log(new, 400), "the new leader to load the node records")
    loaded = [json.loads(line) for line in ha.log(new, 400).splitlines() if "node records loaded" in line]
    assert len(loaded) == 1 and loaded[0]["warm"] and loaded[0]["nodes"] == 2, loaded
    # (not after the lease's 2 s: a standby saw the process gone and revoked it)
    ha.wait_for(lambda: any(GONE in ha.log(n, 400) for n in standbys), "a standby to revoke the dead leader's lease")
    # every agent follows the new leader, where its parked session was taken up; the drain and the event log
    # carried over
    ha.wait_for(lambda: ha.control.GetStats(control_pb2.GetStatsRequest()).sessions == 2, "both agents back")
    # (the leader counts a session before its answer reaches the agent, which logs the take-up on reading it)
    ha.wait_for(lambda: all("a parked session was taken up" in (ha.root / f"{agent}.log").read_text()
                            for agent in ("a", "b")), "both agents' sessions taken up")
    for agent in ("a", "b"):
        taken = [line for line in (ha.root / f"{agent}.log").read_text().splitlines()
                 if "a parked session was taken up" in line]
        assert len(taken) == 1 and ha.addresses[new] in taken[0], ha.log(agent)
    assert ha.states() == {"a": "DRAINED", "b": "UP"}
    assert ha.node("a").drain_reason == "fan"
    after = events(ha)
    assert [e.seq for e in after[:len(before)]] == [e.seq for e in before]
    down = [e for e in after[len(before):] if e.kind == "node.state" and "DOWN" in e.message]
    assert down == [], f"an agent that was alive was declared DOWN after the takeover: {down}"
    # the old leader comes back as a standby
    ha.start_controller(name=old)
    ha.wait_for(lambda: len(ha.controllers().members) == 3, "three members again")
    assert ha.leader() == (new, new_epoch)


def test_a_command_queued_while_leading_is_dropped_if_the_lease_lapses_before_it_is_written():
    """Session.push checks the lease when a command is queued; a pause between the queue and the write (the
    stream busy, then SIGSTOP) must not let the command out: its sender hears NotLeading, the agent nothing."""
    import asyncio

    import grpc

    from controller.nodes.session import NotLeading, Session
    from phalanx.v1 import node_pb2

    async def main() -> None:
        lease = {"holds": True}
        session = Session("ipv4:127.0.0.1:1", epoch=3, leading=lambda: lease["holds"])
        stop = asyncio.create_task(session.request(node_pb2.Command(stop=node_pb2.StopRanks(job="j"))))
        await asyncio.sleep(0)  # queued while the lease held
        session.push(node_pb2.ControllerMessage(status=node_pb2.NodeStatus()))
        lease["holds"] = False
        assert (await session.next_message()).WhichOneof("body") == "status"
        with pytest.raises(NotLeading):
            await stop
        session.kick(grpc.StatusCode.OK, "")
        assert await session.next_message() is None

    asyncio.run(main())


def test_a_leader_paused_past_its_lease_is_deposed_and_commits_nothing(ha):
    ha.start_controller()
    ha.start_agent("a")
    ha.wait_states({"a": "UP"})
    old, epoch = ha.leader()
    before = events(ha)
    ha.procs[old].send_signal(signal.SIGSTOP)
    try:
        ha.wait_for(lambda: (ha.leader() or (old,))[0] != old, "a new leader while the old one is paused")
        # the agent gives up on the frozen leader by itself (keepalive) and finds the new one
        ha.wait_for(lambda: ha.control.GetStats(control_pb2.GetStatsRequest()).sessions == 1,
                    "the agent at the new leader")
    finally:
        ha.procs[old].send_signal(signal.SIGCONT)
    new, new_epoch = ha.leader()
    assert new_epoch > epoch
    ha.wait_for(lambda: "no longer the leader" in ha.log(old, 200), "the old leader to find it was deposed")
    ha.control.DrainNode(control_pb2.DrainNodeRequest(name="a", reason="after"))
    ha.wait_states({"a": "DRAINED"})
    assert ha.leader() == (new, new_epoch)
    log = ha.log(old, 400)
    assert "elected leader" in log and "Traceback" not in log
    # a paused process's port still takes connections: its lease lapsed, no one revoked it
    assert not [n for n in ha.names if GONE in ha.log(n, 400)]
    # The frozen leader's liveness sweep, on waking, found the node silent for seconds; whatever it tried to
    # write was refused by the fence: the node never went SUSPECT or DOWN.
    later = events(ha)[len(before):]
    assert not [e for e in later if e.kind == "node.state" and ("SUSPECT" in e.message or "DOWN" in e.message)]


def test_local_up_ha_a_failover_by_hand(tmp_path):
    """`phalanx local up --ha 3` as the README tells a user to try it: kill the leader, the CLI goes on."""
    import json
    import os
    import subprocess
    import sys
    import time

    from phalanx import etcdlocal
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(str(e))
    env = {**os.environ, "PHALANX_HOME": str(tmp_path)}
    env.pop("PHALANX_CONTROLLER", None)

    def phalanx(*args):
        return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                              timeout=120, env=env)

    try:
        up = phalanx("local", "up", "--nodes", "2", "--gpus-per-node", "1", "--ha", "3")
        assert up.returncode == 0, up.stdout + up.stderr
        status = json.loads(phalanx("local", "status", "--json").stdout)
        assert sorted(p["role"] for p in status) == ["agent"] * 2 + ["controller"] * 3 + ["etcd"] * 3
        listing = json.loads(phalanx("controllers", "--json").stdout)
        leader = listing["leader"]
        assert leader and listing["store"] == "etcd" and len(listing["members"]) == 3
        assert phalanx("local", "stop", "etcd-1").returncode == 0  # one etcd member of three: no effect
        shown = {p["name"]: p["running"] for p in json.loads(phalanx("local", "status", "--json").stdout)}
        assert not shown.pop("etcd-1") and all(shown.values()), shown
        assert phalanx("drain", "node-0", "--reason", "two members of three").returncode == 0
        assert phalanx("undrain", "node-0").returncode == 0
        assert json.loads(phalanx("controllers", "--json").stdout)["leader"]
        # an agent stopped and started again by hand: `local status` follows it, its node comes back UP
        def node_0(connected: bool, state: str = "") -> None:
            deadline = time.monotonic() + 120
            while True:
                node = {n["name"]: n for n in json.loads(phalanx("nodes", "--json").stdout)}["node-0"]
                if node["connected"] == connected and node["state"] == (state or node["state"]):
                    return
                assert time.monotonic() < deadline, f"node-0 never {connected=} {state=}: {node}"
                time.sleep(0.1)

        assert phalanx("local", "stop", "node-0").returncode == 0
        assert not {p["name"]: p["running"] for p in json.loads(phalanx("local", "status", "--json").stdout)}[
            "node-0"]
        node_0(connected=False)
        assert phalanx("local", "start", "node-0").returncode == 0
        node_0(connected=True, state="UP")
        stopped = phalanx("local", "stop", leader, "--kill")
        assert stopped.returncode == 0, stopped.stderr
        drained = phalanx("drain", "node-1", "--reason", "after failover")  # reaches whichever leads now
        assert drained.returncode == 0, drained.stdout + drained.stderr
        after = json.loads(phalanx("controllers", "--json").stdout)
        assert after["leader"] not in ("", leader) and after["epoch"] > listing["epoch"]
        nodes = {n["name"]: n["state"] for n in json.loads(phalanx("nodes", "--json").stdout)}
        assert nodes == {"node-0": "UP", "node-1": "DRAINED"}
        assert phalanx("local", "start", leader).returncode == 0
        assert phalanx("local", "start", "etcd-1").returncode == 0
        events = json.loads(phalanx("events", "--json").stdout)
        assert any(e["kind"] == "controller.leader" and e["fields"].get("previous") == leader for e in events)
        status = json.loads(phalanx("local", "status", "--json").stdout)
        assert all(p["running"] for p in status), status  # the processes started by hand are known too
        pids = [p["pid"] for p in status]
    finally:
        phalanx("local", "down")

    def left() -> list[int]:
        return [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]

    deadline = time.monotonic() + 30  # `local down` SIGKILLs what outlives its grace period, without waiting
    while left():
        assert time.monotonic() < deadline, f"still running after `local down`: {left()}"
        time.sleep(0.1)


def test_etcd_unavailable_nobody_decides_and_the_control_plane_catches_up(tmp_path):
    """etcd (one member here) stopped: the leader stands down, every controller says it cannot decide; etcd
    back: a leader is elected, the node is still UP, the drain made before is still there."""
    from phalanx import etcdlocal
    with with_own_etcd(tmp_path) as (c, members):
        c.start_controller()
        c.start_agent("a")
        c.start_agent("b")
        c.wait_states({"a": "UP", "b": "UP"})
        c.control.DrainNode(control_pb2.DrainNodeRequest(name="b", reason="kept"))
        c.wait_states({"b": "DRAINED"})
        etcdlocal.stop(members[0])
        c.wait_for(lambda: c.leader() is None, "no leader while etcd is down")
        c.wait_for(lambda: "etcd unavailable" in (((r := c.controllers()) and r.problem) or ""),
                   "a controller saying it cannot decide")
        etcdlocal.start(members[0], members)  # same data directory: the records are all there
        etcdlocal.wait_healthy(members)
        c.wait_for(lambda: c.leader() is not None, "a leader once etcd is back")
        c.wait_states({"a": "UP", "b": "DRAINED"})
        assert c.node("b").drain_reason == "kept"
        c.wait_for(lambda: c.control.GetStats(control_pb2.GetStatsRequest()).sessions == 2, "both agents back")


def test_a_leader_cut_off_by_a_real_partition_is_replaced_and_fenced(tmp_path):
    """The leader in a network namespace of its own; its link is cut (every packet dropped, both ways), not its
    process stopped: it goes on running, finds it cannot renew its lease and stands down, while a standby takes
    over and both agents follow; healed, it comes back as a standby and the leader stays."""
    from phalanx import etcdlocal
    from tests import netns as nets
    why = nets.available()
    if why:
        pytest.skip(why)
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(str(e))
    ns = nets.Netns()
    members = etcdlocal.plan(tmp_path / "etcd", 1)
    c = None
    try:
        etcdlocal.start(members[0], members, also_listen=(ns.host_ip,))
        etcdlocal.wait_healthy(members)
        c = HaCluster(tmp_path, members[0].endpoint, netns={"c0": ns})
        c.start_controller(name="c0")  # alone: it leads
        assert c.leader()[0] == "c0"
        c.start_controller()
        for name in ("a", "b"):
            c.start_agent(name)
        c.wait_states({"a": "UP", "b": "UP"})
        c.wait_for(lambda: c.control.GetStats(control_pb2.GetStatsRequest()).sessions == 2, "agents at c0")
        # as agents are once settled: a session parked at the standby too (one that had not parked yet would find
        # the new leader only after its keepalive gave the cut link up, and could be declared SUSPECT meanwhile)
        standby = next(n for n in c.names if n != "c0")
        c.wait_for(lambda: c.parked(standby) == 2, "both agents' sessions parked at the standby")
        before = events(c)
        _, epoch = c.leader()

        ns.cut()
        c.wait_for(lambda: (c.leader() or ("c0",))[0] != "c0", "a new leader on this side of the cut")
        new, new_epoch = c.leader()
        assert new_epoch > epoch
        c.wait_for(lambda: c.control.GetStats(control_pb2.GetStatsRequest()).sessions == 2,
                   "both agents at the new leader")
        c.wait_for(lambda: "no longer the leader" in c.log("c0", 400), "c0 to stand down on its side of the cut")
        assert c.procs["c0"].poll() is None  # cut off, not dead
        c.control.DrainNode(control_pb2.DrainNodeRequest(name="b", reason="during the partition"))
        c.wait_states({"b": "DRAINED"})

        ns.heal()
        c.wait_for(lambda: len(c.controllers().members) == 3, "c0 back among the members")
        assert c.leader() == (new, new_epoch)
        later = events(c)[len(before):]
        declared = [f"{e.seq} {e.message}" for e in later
                    if e.kind == "node.state" and ("SUSPECT" in e.message or "DOWN" in e.message)]
        assert not declared, (declared, [f"{e.seq} {e.kind} {e.message}" for e in later], c.log("a", 30))
        assert c.node("b").drain_reason == "during the partition"
    finally:
        if c is not None:
            c.close()
        etcdlocal.stop(members[0])
        ns.close()


def test_a_busy_leader_keeps_its_lease_and_a_wedged_one_lets_it_lapse(etcd_server):
    """The lease is renewed on a thread of its own: an event loop busy for longer than the TTL (a takeover of
    thousands of sessions) costs the leader nothing, one that has not run for LOOP_STALL_S lets it lapse."""
    import asyncio
    import time
    import uuid

    from aetcd import rpc

    from controller.ha import LOOP_STALL_S, Elector
    from controller.store.etcd import Etcd

    async def main() -> None:
        etcd = Etcd([etcd_server.endpoint])
        elector = Elector(etcd, f"/test-lease/{uuid.uuid4().hex}", "c0", "127.0.0.1:1", 2)
        try:
            await elector.campaign()
            holding = asyncio.create_task(elector.hold())
            await asyncio.sleep(0.5)
            time.sleep(3.0)  # the loop runs nothing for longer than the 2 s lease
            assert elector.leading() and not holding.done(), "a busy leader lost its lease"
            await asyncio.sleep(0.5)
            time.sleep(LOOP_STALL_S + 1.0)  # wedged
            reason = await asyncio.wait_for(holding, 10)
            assert "event loop has not run" in reason and not elector.leading()
            for _ in range(100):  # the lease lapses in etcd: a standby may take over
                kvs = (await etcd.call("kv", "Range", rpc.RangeRequest(key=elector.leader_key))).kvs
                if not kvs:
                    break
                await asyncio.sleep(0.1)
            assert not kvs, "the wedged leader's key is still in etcd"
        finally:
            await etcd.close()

    asyncio.run(main())


def test_a_standby_waits_on_the_leader_key_after_etcd_compacted_past_it(etcd_server):
    """A leader holds its key for as long as it leads; once etcd compacted its history past the key's revision (the
    store compacts every 1,000 commits), a standby that watched from there had its watch cancelled at once and
    campaigned in a tight loop. It watches from the revision it read at, and the takeover is still seen."""
    import asyncio
    import uuid

    from aetcd import rpc

    from controller.ha import Elector
    from controller.store.etcd import Etcd

    async def main() -> None:
        a_etcd, b_etcd = Etcd([etcd_server.endpoint]), Etcd([etcd_server.endpoint])
        prefix = f"/test-compacted/{uuid.uuid4().hex}"
        a = Elector(a_etcd, prefix, "c0", "127.0.0.1:1", 2, probe=False)
        b = Elector(b_etcd, prefix, "c1", "127.0.0.1:2", 2, probe=False)
        holding = None
        try:
            term = await a.campaign()
            holding = asyncio.create_task(a.hold())
            for i in range(20):  # history after the leader key's revision, then compacted away
                put = await a_etcd.call("kv", "Put", rpc.PutRequest(key=f"{prefix}/k{i}".encode(), value=b"v"))
            await a_etcd.call("kv", "Compact", rpc.CompactionRequest(revision=put.header.revision))
            standing_by = asyncio.create_task(b.campaign())
            for _ in range(3000):  # until b has read the key: it waits on it now
                if b.leader is not None or standing_by.done():
                    break
                await asyncio.sleep(0.01)
            assert b.leader.name == "c0"
            await a.resign(term)
            await asyncio.wait_for(standing_by, 30)
            assert b.leading() and b.watches_cancelled == 0
        finally:
            if holding is not None:
                holding.cancel()
            await a_etcd.close()
            await b_etcd.close()

    asyncio.run(main())


def test_a_leader_whose_key_is_replaced_while_its_lease_lives_steps_down_at_its_next_commit(etcd_server):
    """Issue 39: the leader key replaced while the leader's lease lives (a hand on etcd, another elector's bug):
    the fenced store refused the leader's commits, but its term went on, sending commands to agents until the
    lease lapsed, which it never did (the lease was still renewed). The store's NotLeader now ends the term."""
    import asyncio
    import uuid

    from aetcd import rpc

    from controller.ha import Elector
    from controller.nodes.states import UP
    from controller.store import NodeRecord
    from controller.store.etcd import Etcd, EtcdStore, Fence, NotLeader

    async def main() -> None:
        etcd = Etcd([etcd_server.endpoint])
        prefix = f"/test-replaced/{uuid.uuid4().hex}"
        a = Elector(etcd, prefix, "c0", "127.0.0.1:1", 5, probe=False)
        holding = None
        try:
            term = await a.campaign()
            holding = asyncio.create_task(a.hold())
            store = EtcdStore(etcd, prefix, fence=Fence(a.leader_key, term.epoch), own_client=False,
                              on_not_leader=a.depose)
            await store.commit(nodes=[NodeRecord("n1", UP)])
            assert a.leading()
            await etcd.call("kv", "DeleteRange", rpc.DeleteRangeRequest(key=a.leader_key))
            await etcd.call("kv", "Put", rpc.PutRequest(key=a.leader_key, value=b"someone else"))
            with pytest.raises(NotLeader):
                await store.commit(nodes=[NodeRecord("n2", UP)])
            assert not a.leading()  # at once: no command goes out from here on
            reason = await asyncio.wait_for(holding, 30)  # the store's word, or a renewal's look at the key first
            assert "not the leader any more" in reason or "while its lease lived" in reason, reason
            # A quiet leader (no commit to find it): its next lease renewal reads the key too.
            b = Elector(etcd, prefix + "-quiet", "c1", "127.0.0.1:2", 2, probe=False)
            await b.campaign()
            holding = asyncio.create_task(b.hold())
            await etcd.call("kv", "Put", rpc.PutRequest(key=b.leader_key, value=b"someone else"))  # a new value
            assert b.leading()  # only a put: the create revision is the same, the term too
            await etcd.call("kv", "DeleteRange", rpc.DeleteRangeRequest(key=b.leader_key))
            await etcd.call("kv", "Put", rpc.PutRequest(key=b.leader_key, value=b"someone else"))
            reason = await asyncio.wait_for(holding, 30)
            assert "while its lease lived" in reason, reason  # deleted, or replaced: whichever a renewal saw
            assert not b.leading()
        finally:
            if holding is not None:
                holding.cancel()
            await etcd.close()

    asyncio.run(main())
