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


def decide(nodes: Iterable[Seen], now: float, policy: LivenessConfig) -> list[Change]:
    """The state changes liveness calls for at `now`. Recovery from SUSPECT is the heartbeat's job."""
    changes = []
    for node in nodes:
        if node.state is DOWN:
            continue
        silence = now - node.last_seen
        if silence >= policy.down_after_s:
            changes.append(Change(node.name, DOWN, f"no heartbeat for {silence:.1f}s (limit {policy.down_after_s:g}s)"))
        elif node.state in LIVE and silence >= policy.suspect_after_s:
            changes.append(Change(node.name, SUSPECT, f"no heartbeat for {silence:.1f}s"))
        elif node.state in LIVE and node.session_lost:
            changes.append(Change(node.name, SUSPECT, "session lost"))
    return changes
