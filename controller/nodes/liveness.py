"""Liveness: pure decisions from the last time each node was heard from, and `now`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from controller.config import LivenessConfig
from controller.nodes.states import DOWN, LIVE, SUSPECT, NodeState


@dataclass(frozen=True)
class Seen:
    """What liveness needs to know of one node."""

    name: str
    state: NodeState
    last_seen: float  # monotonic seconds of the last heartbeat (or registration, or controller start)
    session_lost: bool  # its session with this controller ended and no new one is open


@dataclass(frozen=True)
class Change:
    name: str
    target: NodeState
    reason: str


def decide(nodes: Iterable[Seen], now: float, policy: LivenessConfig, behind: float = 0.0) -> list[Change]:
    """The state changes liveness calls for at `now`, not counting the last `behind` seconds of silence (the
    controller's own: Backlog). Recovery from SUSPECT is the heartbeat's job."""
    changes = []
    also = f", besides {behind:.1f}s this controller was behind at reading heartbeats" if behind else ""
    for node in nodes:
        if node.state is DOWN:
            continue
        silence = now - behind - node.last_seen
        if silence >= policy.down_after_s:
            changes.append(Change(node.name, DOWN,
                                  f"no heartbeat for {silence:.1f}s (limit {policy.down_after_s:g}s){also}"))
        elif node.state in LIVE and silence >= policy.suspect_after_s:
            changes.append(Change(node.name, SUSPECT, f"no heartbeat for {silence:.1f}s{also}"))
        elif node.state in LIVE and node.session_lost:
            changes.append(Change(node.name, SUSPECT, "session lost"))
    return changes


# A node's lag floor rises by this much with each of its heartbeats, so that a clock stepped back on the node (all its
# lags higher from then on) is absorbed in time, here about a millisecond per second: slow enough that a backlog
# of seconds lasting a minute moves it by tens of milliseconds.
LAG_FLOOR_CREEP_S = 0.001
BACKLOG_WINDOW_S = 1.0  # the heartbeats whose lag says how far behind the controller is now
BACKLOG_SAMPLES = 1024  # of them, the newest (at 10,000 nodes, the last tenth of a second)
MAX_ALLOWANCE_S = 30.0  # a controller further behind than this must not go blind to every loss for longer


class Backlog:
    """How far behind this controller is at hearing heartbeats: silence that is its own, not the nodes'.

    A controller whose event loop stalls or saturates (a takeover's reconnect storm, a GC pause, a starved core)
    reads heartbeats late; a sweep that then charged every node for the silence would declare live nodes SUSPECT
    or DOWN, and a loaded controller would drain a fleet that was fine. Two measures, the larger counts:

    - stalls: a gap from the end of one sweep to the start of the next longer than a heartbeat interval, all of it
      but one sweep interval (the loop ran no sweep on time, nor read heartbeats meanwhile; libuv runs due timers
      before it polls for I/O, so the first sweep after a stall comes before the heartbeats that waited), summed
      over the last `down_after_s`. A shorter stall is left to the slack between the interval and suspect_after_s
      (twice it by default). A sweep's own wait for the registry's lock is not a stall;
    - queueing: each heartbeat's lag (applied - sent) over its node's own floor (its lowest lag, creeping up), so
      that the hosts' clock offsets cancel out; the lower median of the heartbeats heard in the last second, which
      a few nodes with a slow link or a stepped clock do not move.

    Pure: the registry feeds it times from its clock.
    """

    def __init__(self, tick_s: float, interval_s: float, window_s: float) -> None:
        self.tick_s, self.interval_s, self.window_s = tick_s, interval_s, window_s
        self._at = [0.0] * BACKLOG_SAMPLES
        self._excess = [0.0] * BACKLOG_SAMPLES
        self._heard = 0
        self._last_sweep: float | None = None
        self._stalls: list[tuple[float, float]] = []  # (when, seconds) of recent stalls
        self.allowance = 0.0  # as of the last sweep

    def heard(self, at: float, excess: float) -> None:
        """A heartbeat applied at monotonic `at`, `excess` seconds later than its node's floor."""
        i = self._heard % BACKLOG_SAMPLES
        self._at[i], self._excess[i] = at, excess
        self._heard += 1

    def sweep(self, now: float) -> float:
        """Called at the start of each liveness sweep: the seconds of silence not to charge to the nodes now."""
        if self._last_sweep is not None and (gap := now - self._last_sweep) > self.interval_s:
            self._stalls.append((now, gap - self.tick_s))
        while self._stalls and self._stalls[0][0] < now - self.window_s:
            self._stalls.pop(0)
        stalled = sum(s for _, s in self._stalls)
        since = now - BACKLOG_WINDOW_S
        recent = sorted(e for t, e in zip(self._at[: self._heard], self._excess[: self._heard], strict=True)
                        if t >= since)
        queued = recent[(len(recent) - 1) // 2] if recent else 0.0
        self.allowance = min(max(stalled, queued, 0.0), MAX_ALLOWANCE_S)
        return self.allowance

    def swept(self, now: float) -> None:
        """Called at the end of each sweep. A sweep that waited for the registry's lock (commits ahead of it) is not
        a stalled loop: the gap to the next sweep counts from here."""
        self._last_sweep = now
