import itertools

import pytest

from controller.errors import IllegalTransition
from controller.nodes.states import (
    DOWN,
    DRAINED,
    DRAINING,
    SUSPECT,
    TRANSITIONS,
    UP,
    NodeState,
    check_transition,
    resting_state,
)
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def test_every_state_has_a_row_and_no_self_loops():
    assert set(TRANSITIONS) == set(NodeState)
    for state, targets in TRANSITIONS.items():
        assert state not in targets


@pytest.mark.parametrize("source,target", [(s, t) for s, t in itertools.product(NodeState, NodeState)
                                           if t not in TRANSITIONS[s]])
def test_illegal_transition_names_both_states(source, target):
    with pytest.raises(IllegalTransition) as info:
        check_transition("n1", source, target)
    assert str(info.value) == f"node n1: illegal transition {source} -> {target}"


def test_drain_outlives_liveness():
    # A drained node that dies and comes back is still drained: DOWN must lead back to DRAINED.
    assert DRAINED in TRANSITIONS[DOWN]
    assert DOWN in TRANSITIONS[DRAINED]
    assert UP not in TRANSITIONS[DOWN] or resting_state("bad fan", 0) is DRAINED


def test_resting_state():
    assert resting_state("", 0) is UP
    assert resting_state("", 3) is UP
    assert resting_state("bad fan", 0) is DRAINED
    assert resting_state("bad fan", 2) is DRAINING


def test_proto_round_trip_and_unknown_values():
    for state in NodeState:
        assert NodeState.from_proto(state.to_proto()) is state
    with pytest.raises(ValueError):
        NodeState.from_proto(common_pb2.NODE_STATE_UNSPECIFIED)
    with pytest.raises(ValueError):
        NodeState.from_proto(99)
    assert tuple(NodeState) == (UP, SUSPECT, DOWN, DRAINING, DRAINED)
