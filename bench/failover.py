"""Failover of a highly available control plane: kill -9 of the leader -> a new leader serving and every agent
back in session with it.

A real `phalanx local up --ha 3` (three etcd members, three controllers, real agents) in a directory of its
own; each trial kills the leader, times until a controller answers GetStats as the leader with every node in
session, counts node.state events to SUSPECT/DOWN (goal: none: no live node is wrongly declared DOWN), then
starts the killed controller again and waits for it to stand by with every agent's session parked there. Then as
many trials that kill the new leader as soon as the controller killed before stands by again, before the agents
park there (they retry parking every 5-30 s): when it wins, the agents come back because the losing standby names
it to them (StandingBy again), not after their StandingBy.takeover_s. Also:
the latency of a drain (a store commit) on the etcd store against the same on SQLite.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
import time
from pathlib import Path

import grpc

from bench.common import log, temp_root
from cli import local
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc

GOAL_S = 3.0
AGENTS = 4


def _stub(address: str):
    channel = grpc.insecure_channel(address)
    return channel, control_pb2_grpc.ControlServiceStub(channel)


def _leader(addresses: list[str]) -> tuple[str, str, int] | None:
    for address in addresses:
        channel, stub = _stub(address)
        try:
            r = stub.ListControllers(control_pb2.ListControllersRequest(), timeout=1)
            if r.leader:
                return r.leader, r.leader_address, r.epoch
        except grpc.RpcError:
            pass
        finally:
            channel.close()
    return None


def _serving_with(address: str, nodes: int) -> bool:
    channel, stub = _stub(address)
    try:
        return stub.GetStats(control_pb2.GetStatsRequest(), timeout=1).sessions >= nodes
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def _wrongly_down(address: str, after_seq: int) -> int:
    channel, stub = _stub(address)
    try:
        events = stub.ListEvents(control_pb2.ListEventsRequest(after_seq=after_seq, limit=10_000), timeout=5).events
    finally:
        channel.close()
    return sum(1 for e in events if e.kind == "node.state" and ("SUSPECT" in e.message or "DOWN" in e.message))


def _last_seq(address: str) -> int:
    channel, stub = _stub(address)
    seq = 0
    try:
        while events := stub.ListEvents(control_pb2.ListEventsRequest(after_seq=seq, limit=10_000), timeout=5).events:
            seq = events[-1].seq
        return seq
    finally:
        channel.close()


def _drain_latency(address: str, node: str, n: int) -> float:
    """Median seconds of a drain + undrain pair's drain (one store commit each), n times."""
    channel, stub = _stub(address)
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            stub.DrainNode(control_pb2.DrainNodeRequest(name=node, reason="bench"), timeout=10)
            times.append(time.perf_counter() - t0)
            stub.UndrainNode(control_pb2.UndrainNodeRequest(name=node), timeout=10)
    finally:
        channel.close()
    return statistics.median(times)


def _submit_latency(address: str, n: int) -> float:
    """Median seconds of a SubmitJob (one store commit; the job asks for more nodes than there are, so it waits
    PENDING and launches nothing), n times; each is cancelled afterwards."""
    channel, stub = _stub(address)
    times = []
    try:
        for i in range(n):
            spec = common_pb2.JobSpec(name=f"bench-{i}", command=["true"], nodes=AGENTS + 1, ranks_per_node=1)
            t0 = time.perf_counter()
            job = stub.SubmitJob(control_pb2.SubmitJobRequest(spec=spec), timeout=10)
            times.append(time.perf_counter() - t0)
            stub.CancelJob(control_pb2.CancelJobRequest(id=job.id), timeout=10)
    finally:
        channel.close()
    return statistics.median(times)


@contextlib.contextmanager
def _cluster(home: Path, ha: int):
    """A local cluster in `home`: its controllers; it is taken down on the way out, whatever happens."""
    old_home = os.environ.get("PHALANX_HOME")
    os.environ["PHALANX_HOME"] = str(home)
    try:
        try:
            local.up(AGENTS, 1, "sim", out=io.StringIO(), ha=ha)
            yield [p for p in local.read_cluster() if p.role == "controller"]
        finally:
            if local.read_cluster():
                local.down(out=io.StringIO())
    finally:
        if old_home is None:
            os.environ.pop("PHALANX_HOME", None)
        else:
            os.environ["PHALANX_HOME"] = old_home


def _rejoined(address: str, parked: bool = True) -> bool:
    """The controller at `address` stands by again, with every agent's session parked there if `parked` (a steady
    state: without naming, an agent not parked at the controller that wins next waited StandingBy.takeover_s)."""
    channel, stub = _stub(address)
    try:
        reply = stub.ListControllers(control_pb2.ListControllersRequest(), timeout=1)
        return len(reply.members) == 3 and (not parked or reply.parked_sessions == AGENTS)
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def _failover(i: int, trials: int, addresses: list[str], what: str) -> tuple[float, int, str, str]:
    """Kill -9 the leader; the seconds until a new one serves with every agent back, the nodes wrongly declared
    SUSPECT/DOWN meanwhile, the name killed and the new leader's name."""
    name, address, epoch = _leader(addresses)
    seq = _last_seq(address)
    t0 = time.monotonic()
    local.stop_member(name, kill=True)
    deadline = t0 + 60
    while time.monotonic() < deadline:
        now = _leader([a for a in addresses if a != address])
        if now and now[2] > epoch and _serving_with(now[1], AGENTS):
            break
        time.sleep(0.02)
    else:
        raise RuntimeError(f"{what} trial {i}: no new leader with every agent back within 60 s")
    elapsed = time.monotonic() - t0
    down = _wrongly_down(now[1], seq)
    log(f"failover ({what}) {i + 1}/{trials}: {elapsed:.2f} s ({name} -> {now[0]}, epoch {epoch} -> {now[2]}), "
        f"nodes wrongly SUSPECT/DOWN: {down}")
    return elapsed, down, name, now[0]


def _restart(name: str, address: str, parked: bool) -> None:
    local.start_member(name)
    deadline = time.monotonic() + 90  # (agents park again at their retry's pace: 5-30 s)
    while time.monotonic() < deadline and not _rejoined(address, parked):
        time.sleep(0.1)


def _steady(addresses: list[str]) -> None:
    """Until every agent's session is parked at every standby."""
    leader = _leader(addresses)
    deadline = time.monotonic() + 90
    for address in addresses if leader else []:
        while address != leader[1] and time.monotonic() < deadline and not _rejoined(address):
            time.sleep(0.1)


def run(trials: int = 10) -> dict:
    """`trials` failovers from a steady state (the controller killed before is back, with every agent parked
    there); then `trials` pairs from a steady state: a failover, and one more as soon as the controller killed in
    the first stands by again, before the agents have parked there. When that one wins the second, the agents come
    back because the other standby, where they are parked, names it to them."""
    out: dict = {"trials": trials, "agents": AGENTS, "goal_s": GOAL_S}
    with temp_root("phalanx-failover-") as d:
        with _cluster(Path(d) / "sqlite", 0) as controllers:
            out["drain_sqlite_ms"] = round(_drain_latency(controllers[0].address, "node-0", 20) * 1000, 2)
            out["submit_sqlite_ms"] = round(_submit_latency(controllers[0].address, 20) * 1000, 2)
        with _cluster(Path(d) / "etcd", 3) as controllers:
            addresses = [c.address for c in controllers]
            by_name = {c.name: c.address for c in controllers}
            out["drain_etcd_ms"] = round(_drain_latency(_leader(addresses)[1], "node-0", 20) * 1000, 2)
            out["submit_etcd_ms"] = round(_submit_latency(_leader(addresses)[1], 20) * 1000, 2)
            times, wrongly_down = [], 0
            for i in range(trials):
                elapsed, down, killed, _ = _failover(i, trials, addresses, "steady")
                times.append(elapsed)
                wrongly_down += down
                _restart(killed, by_name[killed], parked=True)
            soon, soon_down, restarted_won = [], 0, []
            for i in range(trials):
                _steady(addresses)  # every agent parked at both standbys; then one of them is killed and restarted
                _, _, before, _ = _failover(i, trials, addresses, "before a soon one")
                _restart(before, by_name[before], parked=False)
                elapsed, down, killed, winner = _failover(i, trials, addresses, "soon after a restart")
                soon.append(elapsed)
                soon_down += down
                restarted_won.append(winner == before)
                _restart(killed, by_name[killed], parked=True)
    out.update(median_s=round(statistics.median(times), 3), max_s=round(max(times), 3),
               times_s=[round(t, 3) for t in times], wrongly_down=wrongly_down,
               soon_median_s=round(statistics.median(soon), 3), soon_max_s=round(max(soon), 3),
               soon_times_s=[round(t, 3) for t in soon], soon_wrongly_down=soon_down,
               soon_restarted_won=sum(restarted_won), soon_restarted_won_of=len(restarted_won),
               soon_when_restarted_won_s=[round(t, 3) for t, won in zip(soon, restarted_won, strict=True) if won])
    return out
