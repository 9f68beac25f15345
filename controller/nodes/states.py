"""Node states and the one transition table that governs them."""

from __future__ import annotations

import enum

from controller.errors import IllegalTransition
from phalanx.v1 import common_pb2 as pb


class NodeState(enum.Enum):
    UP = "UP"
    SUSPECT = "SUSPECT"
    DOWN = "DOWN"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"

    def to_proto(self) -> int:
        return pb.NodeState.Value(f"NODE_STATE_{self.value}")

    @classmethod
    def from_proto(cls, value: int) -> NodeState:
        """Raises ValueError for UNSPECIFIED or an unknown number."""
        name = pb.NodeState.Name(value)  # ValueError for an unknown number
        if name == "NODE_STATE_UNSPECIFIED":
            raise ValueError("NODE_STATE_UNSPECIFIED is not a state")
        return cls(name.removeprefix("NODE_STATE_"))

    def __str__(self) -> str:
        return self.value


UP, SUSPECT, DOWN, DRAINING, DRAINED = NodeState

# Liveness moves a node between "live" states and SUSPECT/DOWN; an operator moves it between
# UP and DRAINING/DRAINED. A drain survives the node going DOWN: the reason is kept on the record
# and the node comes back DRAINED.
TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    UP: frozenset({SUSPECT, DOWN, DRAINING, DRAINED}),
    SUSPECT: frozenset({UP, DOWN, DRAINING, DRAINED}),
    DOWN: frozenset({UP, DRAINING, DRAINED}),
    DRAINING: frozenset({UP, SUSPECT, DOWN, DRAINED}),
    DRAINED: frozenset({UP, SUSPECT, DOWN}),
}

LIVE = frozenset({UP, DRAINING, DRAINED})


def check_transition(node: str, source: NodeState, target: NodeState) -> None:
    if target not in TRANSITIONS[source]:
        raise IllegalTransition(f"node {node}", source, target)


def resting_state(drain_reason: str, running_ranks: int) -> NodeState:
    """Where a node that is alive and heard from belongs, given its drain and its work."""
    if not drain_reason:
        return UP
    return DRAINING if running_ranks > 0 else DRAINED
