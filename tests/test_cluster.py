"""Real processes on loopback: a controller and three agents."""

import os
import signal
import time

import pytest

from phalanx.v1 import control_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

NODES = ["node-a", "node-b", "node-c"]


def test_nodes_come_up_die_come_back_and_survive_a_controller_restart(cluster):
    cluster.start_controller()
    for name in NODES:
        cluster.start_agent(name)
    cluster.wait_connected(NODES)
    node = cluster.node("node-a")
    assert len(node.inventory.gpus) == 2 and node.connected and node.inventory.agent_pid == cluster.procs["node-a"].pid
    cluster.wait_for(lambda: cluster.node("node-a").host.memory_available_bytes > 0, "host telemetry")

    # kill -9 an agent: its node goes DOWN, the others stay UP
    cluster.kill("node-b")
    cluster.wait_states({"node-b": "DOWN"})
    assert cluster.states() == {"node-a": "UP", "node-b": "DOWN", "node-c": "UP"}
    cluster.start_agent("node-b")
    # in session, not only UP: an agent killed between its registration and its session's open has no incarnation
    # to resume with, and registers again (what the restart below must not need)
    cluster.wait_connected(["node-b"])

    # drain one node, then restart the controller: everyone reconnects, the drain and its reason are kept
    cluster.control.DrainNode(control_pb2.DrainNodeRequest(name="node-c", reason="fan failure in PSU 2"), timeout=5)
    cluster.wait_states({"node-c": "DRAINED"})
    before = {n: cluster.node(n).incarnation for n in NODES}
    registered = registrations(cluster)
    cluster.kill("controller", signal.SIGKILL)
    cluster.start_controller()
    cluster.wait_for(lambda: all(cluster.node(n).connected for n in NODES), "agents reconnected")
    assert cluster.states() == {"node-a": "UP", "node-b": "UP", "node-c": "DRAINED"}
    assert cluster.node("node-c").drain_reason == "fan failure in PSU 2"
    # they resumed their sessions: the controller knew them from its store, and nothing was registered again
    assert {n: cluster.node(n).incarnation for n in NODES} == before
    assert registrations(cluster) == registered
    log = cluster.log("controller", lines=200)
    assert "session resumed" in log or "sessions resumed" in log
    cluster.wait_for(lambda: all(cluster.node(n).host.memory_available_bytes > 0 for n in NODES), "heartbeats")

    # the event log survived the restart too
    events = cluster.control.ListEvents(control_pb2.ListEventsRequest(limit=1000), timeout=5).events
    assert any(e.kind == "node.state" and e.node == "node-b" and e.fields["target"] == "DOWN" for e in events)
    assert any(e.kind == "node.drain" and e.fields["reason"] == "fan failure in PSU 2" for e in events)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def registrations(cluster) -> int:
    events = cluster.control.ListEvents(control_pb2.ListEventsRequest(limit=1000), timeout=5).events
    return sum(1 for e in events if e.kind == "node.registered")


def test_an_agent_declared_down_while_away_registers_again(cluster):
    cluster.start_controller()
    cluster.start_agent("node-a")
    cluster.wait_states({"node-a": "UP"})
    before = cluster.node("node-a").incarnation
    # The node is UP once registered; its session opens just after. Paused between the two, the agent would find
    # its fresh registration DOWN at the open and register again after a backoff, without resuming: not this case.
    cluster.wait_for(lambda: "session open" in cluster.log("node-a", lines=200), "the agent's session")
    # paused past down_after_s: the node is DOWN, and its old incarnation is refused when the agent comes back
    os.kill(cluster.procs["node-a"].pid, signal.SIGSTOP)
    try:
        cluster.wait_states({"node-a": "DOWN"})
    finally:
        os.kill(cluster.procs["node-a"].pid, signal.SIGCONT)
    cluster.wait_states({"node-a": "UP"})
    assert cluster.node("node-a").incarnation == before + 1
    cluster.wait_for(lambda: "registering" in cluster.log("node-a", lines=200), "the agent's word on it")


def test_graceful_controller_stop_and_agents_waiting_for_it(cluster):
    # Agents started before the controller keep retrying and come up once it serves.
    cluster.start_agent("node-a")
    cluster.start_controller()
    cluster.wait_states({"node-a": "UP"})
    cluster.kill("controller", signal.SIGTERM)
    assert cluster.procs["controller"].returncode == 0
    cluster.start_controller()
    cluster.wait_for(lambda: cluster.node("node-a").connected, "agent reconnected")
    # SIGTERM stops an agent cleanly; its node then goes DOWN like any silent node.
    cluster.kill("node-a", signal.SIGTERM)
    assert cluster.procs["node-a"].returncode == 0
    cluster.wait_states({"node-a": "DOWN"})


def test_a_stalled_controller_charges_its_own_silence_to_no_node_and_still_finds_the_lost_one(cluster):
    """A controller that stops reading (here SIGSTOP; a GC pause, a starved core or a takeover's storm in life) hears
    no heartbeat meanwhile, and the first sweep after the stall runs before the heartbeats that waited are read: it
    used to declare every node DOWN. The stall is the controller's own silence; a node lost during it is still
    found once it has been silent that long on top."""
    # Short limits, so that the stall passes down_after_s well inside the agents' session keepalive: a ping sent just
    # after the SIGSTOP goes unanswered for the whole stall, and the agent drops its session after 2 s of that.
    cluster.start_controller(extra="[liveness]\nheartbeat_interval_s = 0.25\nsuspect_after_s = 0.75\n"
                                   "down_after_s = 1.0\ntick_s = 0.05\n")
    for name in NODES:
        cluster.start_agent(name)
    cluster.wait_states(dict.fromkeys(NODES, "UP"))
    cluster.wait_for(lambda: all(cluster.node(n).last_heartbeat_unix_ns for n in NODES), "heartbeats")
    seq = cluster.control.ListEvents(control_pb2.ListEventsRequest(limit=1, newest=True), timeout=5).events[-1].seq
    controller = cluster.procs["controller"].pid
    os.kill(controller, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        cluster.kill("node-c")  # lost while the controller was away
        # The injected stall, counted from the SIGSTOP (the kill's wait is part of it): past down_after_s, 0.6 s short
        # of the agents' keepalive timeout.
        time.sleep(max(0.0, stopped + 1.4 - time.monotonic()))
    finally:
        os.kill(controller, signal.SIGCONT)
    cluster.wait_states({"node-c": "DOWN"})
    events = cluster.control.ListEvents(control_pb2.ListEventsRequest(after_seq=seq, limit=1000), timeout=5).events
    declared = [(e.node, e.fields["target"], e.fields["reason"]) for e in events
                if e.kind == "node.state" and e.fields.get("target") in ("SUSPECT", "DOWN")]
    assert [d for d in declared if d[0] != "node-c"] == [], declared
    assert cluster.states() == {"node-a": "UP", "node-b": "UP", "node-c": "DOWN"}
    assert "liveness held back" in cluster.log("controller", lines=400)
