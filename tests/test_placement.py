"""Gang placement: known optima, the sentences of Unplaceable, and properties over random trees, blocks
and node states (never over-allocates, never splits a gang, reaches the best leaf count the rules allow)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.errors import InvalidArgument
from controller.jobs.placement import (
    ALL_BLOCKS,
    Candidate,
    GangRequest,
    Placement,
    Unplaceable,
    lower_bound_leaves,
    place,
)
from controller.jobs.slurm_topology import parse_topology_conf
from controller.jobs.topology import ClusterTopology
from controller.nodes.health import Health
from controller.nodes.states import NodeState

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

# --- builders ---------------------------------------------------------------------------------------


def tree(spines: list[list[int]], core: bool = True) -> ClusterTopology:
    """Leaves l0, l1, ... with the given node counts, grouped under spines s0, s1, ..., under `core`."""
    lines, node, leaf = [], 0, 0
    for s, sizes in enumerate(spines):
        kids = []
        for size in sizes:
            nodes = f" Nodes=n[{node:03d}-{node + size - 1:03d}]" if size else ""
            lines.append(f"SwitchName=l{leaf}{nodes}")
            kids.append(f"l{leaf}")
            node, leaf = node + size, leaf + 1
        lines.append(f"SwitchName=s{s} Switches={','.join(kids)}")
    if core:
        lines.append(f"SwitchName=core Switches=s[0-{len(spines) - 1}]")
    return parse_topology_conf("\n".join(lines))


def blocks(sizes: list[int], block_sizes: str = "") -> ClusterTopology:
    lines, node = [], 0
    for b, size in enumerate(sizes):
        lines.append(f"BlockName=b{b} Nodes=n[{node:03d}-{node + size - 1:03d}]")
        node += size
    return parse_topology_conf("\n".join(lines) + (f"\nBlockSizes={block_sizes}" if block_sizes else ""))


def candidates(groups: dict[str, list[str]], topo: ClusterTopology, gpus: int = 8) -> list[Candidate]:
    """Per leaf (or block), one letter per node in order: H free HEALTHY, D free DEGRADED, B busy,
    X unschedulable, S too few GPUs. Nodes beyond the string are busy."""
    out = []
    for group, states in groups.items():
        members = topo.block_nodes(group) if topo.has_blocks else topo.nodes_under(group)
        for i, node in enumerate(members):
            s = states[i] if i < len(states) else "B"
            out.append(Candidate(node, s != "X", s != "D", s not in "B", gpus // 2 if s == "S" else gpus))
    return out


def free_leaves(topo: ClusterTopology, free: list[int]) -> list[Candidate]:
    return candidates({leaf: "H" * f for leaf, f in zip(topo.leaves, free, strict=True)}, topo)


def leaf_of(topo: ClusterTopology, node: str) -> str:
    return topo.block(node) if topo.has_blocks else topo.leaf(node)


# --- known cases ---------------------------------------------------------------------------------------


def test_free_7_5_3_3_and_a_10_node_job_use_2_leaves_the_fullest_and_the_tightest():
    topo = tree([[8, 8, 8, 8]])
    p = place(free_leaves(topo, [7, 5, 3, 3]), GangRequest(10, 8), topo)
    assert isinstance(p, Placement)
    assert p.leaves == ("l0", "l2")  # 7 from the fullest, the last 3 from the leaf with exactly 3 free
    assert p.lower_bound == 2 == lower_bound_leaves([7, 5, 3, 3], 10)
    assert p.nodes == ("n000", "n001", "n002", "n003", "n004", "n005", "n006", "n016", "n017", "n018")
    assert p.domain == "s0" and p.spares == () and p.degraded == ()


def test_the_lowest_switch_that_holds_the_job():
    topo = tree([[4, 4], [4, 4]])
    p = place(free_leaves(topo, [1, 2, 4, 3]), GangRequest(6), topo)
    assert p.domain == "s1" and p.leaves == ("l2", "l3")
    p = place(free_leaves(topo, [1, 2, 4, 3]), GangRequest(4, spares=1), topo)
    assert p.leaves == ("l2",) and p.domain == "s1" and p.spares == ("n012",)


def test_fewest_leaves_beats_slurms_best_fit_switch():
    """Best fit alone would pick spine s0 (12 free) and spread over 3 leaves; s1 holds it on one."""
    topo = tree([[4, 4, 4], [10, 10]])
    p = place(free_leaves(topo, [4, 4, 4, 10, 10]), GangRequest(10), topo)
    assert len(p.leaves) == 1 == p.lower_bound and p.domain == "l3"


def test_the_job_crosses_the_core_when_no_spine_holds_it():
    topo = tree([[4, 4], [4, 4]])
    p = place(free_leaves(topo, [4, 4, 4, 0]), GangRequest(10), topo)
    assert p.domain == "core" and p.leaves == ("l0", "l1", "l2")


def test_rank_order_groups_nodes_by_leaf_depth_first():
    """Leaves a and c share spine p, b hangs off q: ranks go a, c (neighbours under p), then b."""
    topo = parse_topology_conf("SwitchName=a Nodes=x[1-3]\nSwitchName=b Nodes=y[1-3]\nSwitchName=c Nodes=z[1-3]\n"
                               "SwitchName=p Switches=a,c\nSwitchName=q Switches=b\nSwitchName=top Switches=p,q\n")
    p = place(candidates({"a": "HHH", "b": "HHH", "c": "HHH"}, topo), GangRequest(7), topo)
    assert p.leaves == ("a", "c", "b")
    assert p.nodes == ("x1", "x2", "x3", "z1", "z2", "z3", "y1")


def test_healthy_nodes_are_preferred_on_the_same_leaves():
    topo = tree([[12, 8]])
    p = place(candidates({"l0": "DDDDHHHHHHHH"}, topo), GangRequest(6), topo)
    assert p.degraded == () and p.nodes == ("n004", "n005", "n006", "n007", "n008", "n009")
    p = place(candidates({"l0": "DDDDHHHH", "l1": "HHHHHHHH"}, topo), GangRequest(8), topo)
    assert p.leaves == ("l1",) and p.degraded == ()  # both leaves hold it alone; the HEALTHY one wins


def test_degraded_nodes_keep_the_leaf_count_minimal():
    """The policy: leaf count first, then fewest DEGRADED; a DEGRADED node is used only when needed."""
    topo = tree([[8, 8, 8]])
    p = place(candidates({"l0": "HHHHDDDD", "l1": "HHHH", "l2": "HHHH"}, topo), GangRequest(8), topo)
    assert p.leaves == ("l0",) and p.degraded == ("n004", "n005", "n006", "n007")
    p = place(candidates({"l0": "HHHHDDDD", "l1": "HHHH", "l2": "HHHH"}, topo), GangRequest(9), topo)
    assert len(p.leaves) == 2 and len(p.degraded) == 1  # l0 + l1: 8 HEALTHY, one DEGRADED


def test_spares_stay_on_the_jobs_leaves_then_its_spine():
    topo = tree([[8, 8], [8, 8]])
    p = place(candidates({"l0": "HHHHHH", "l1": "HHH", "l2": "HHHHHHH"}, topo), GangRequest(5, spares=2), topo)
    assert p.leaves == ("l2",) and p.spares == ("n021", "n022") and p.domain == "l2"  # one leaf holds both
    p = place(candidates({"l0": "HHHHHH", "l1": "HHH", "l2": "HHHHHHH"}, topo), GangRequest(6, spares=2), topo)
    assert p.leaves == ("l0",) and p.spares == ("n008", "n009") and p.domain == "s0"  # the neighbour leaf
    p = place(candidates({"l0": "HHHHHH", "l1": "H", "l2": "HH"}, topo), GangRequest(5, spares=3), topo)
    assert p.leaves == ("l0",) and p.spares == ("n005", "n008", "n016") and p.domain == "core"


def test_healthy_spares_before_degraded_ones():
    topo = tree([[8]])
    p = place(candidates({"l0": "HHDDHH"}, topo), GangRequest(3, spares=2), topo)
    assert p.nodes == ("n000", "n001", "n004") and p.spares == ("n002", "n005") and p.degraded == ("n002",)


def test_a_block_job_goes_in_one_block_best_fit():
    topo = blocks([18, 18, 18])
    p = place(candidates({"b0": "H" * 10, "b1": "H" * 6, "b2": "H" * 8}, topo), GangRequest(5, spares=1), topo)
    assert p.leaves == ("b1",) and p.domain == "b1" and len(p.spares) == 1


def test_segments_lie_inside_blocks():
    topo = blocks([18, 18, 18], "18,36")
    p = place(candidates({"b0": "H" * 18, "b1": "H" * 17, "b2": "H" * 18}, topo),
              GangRequest(36, 4, spares=2, segment=18), topo)
    assert p.leaves == ("b0", "b2") and p.domain == ALL_BLOCKS
    assert {topo.block(n) for n in p.nodes[:18]} == {"b0"} and {topo.block(n) for n in p.nodes[18:]} == {"b2"}
    assert {topo.block(n) for n in p.spares} == {"b1"}
    p = place(candidates({"b0": "H" * 12, "b1": "H" * 12, "b2": "H" * 18}, topo), GangRequest(12, segment=6), topo)
    assert p.leaves == ("b0",) and p.domain == "b0"
    p = place(candidates({"b0": "H" * 12, "b1": "H" * 12, "b2": "H" * 12}, topo), GangRequest(24, segment=6), topo)
    assert p.leaves == ("b0", "b1") and p.domain == "b0..b1"  # the aggregate of 2 blocks (BlockSizes=36)


@pytest.mark.parametrize("topo,groups,request_,reason", [
    (tree([[8]]), {"l0": "HHHHXXBS"}, GangRequest(6, 8),
     "needs 6 nodes with 8 GPUs; 4 are free and schedulable (2 DOWN, suspect, draining, drained or failing, "
     "1 busy, 1 with fewer than 8 GPUs)"),
    (tree([[8]]), {"l0": "HHHH"}, GangRequest(4, 1, spares=1),
     "needs 5 nodes (4 + 1 spare) with 1 GPU; 4 are free and schedulable (4 busy)"),
    (blocks([4, 4]), {"b0": "HHH", "b1": "HHH"}, GangRequest(4),
     "no single block has 4 nodes free; the largest has 3 (b0)"),
    (blocks([4, 4]), {"b0": "HHH", "b1": "HHH"}, GangRequest(3, spares=1),
     "no single block has 4 nodes (3 + 1 spare) free; the largest has 3 (b0)"),
    (blocks([4, 4]), {"b0": "HHH", "b1": "HHH"}, GangRequest(4, segment=4),
     "needs 1 segment of 4 nodes, each inside one block; the free nodes make only 0"),
    (blocks([4, 4]), {"b0": "HHH", "b1": "HHH"}, GangRequest(6, segment=2),
     "needs 3 segments of 2 nodes, each inside one block; the free nodes make only 2"),
    (tree([[4], [4]], core=False), {"l0": "HHH", "l1": "HHHH"}, GangRequest(5),
     "no switch connects 5 nodes free; the most under one switch is 4 (s1)"),
])
def test_unplaceable_says_why(topo, groups, request_, reason):
    assert place(candidates(groups, topo), request_, topo) == Unplaceable(reason)


def test_nodes_outside_the_topology_are_counted():
    topo = tree([[2]])
    cands = [*candidates({"l0": "HH"}, topo), Candidate("stranger", True, True, True, 8)]
    assert place(cands, GangRequest(3), topo).reason.endswith("2 are free and schedulable (1 not in the topology)")


@pytest.mark.parametrize("kwargs,message", [
    ({"nodes": 0}, "nodes (0) must be at least 1"),
    ({"nodes": 2, "ranks_per_node": 0}, "ranks_per_node (0) must be at least 1"),
    ({"nodes": 2, "spares": -1}, "spares (-1) must be at least 0"),
    ({"nodes": 2, "segment": 0}, "segment (0) must be at least 1"),
    ({"nodes": 8, "segment": 3}, "nodes (8) must be a multiple of segment (3)"),
])
def test_requests_are_checked(kwargs, message):
    with pytest.raises(InvalidArgument) as e:
        GangRequest(**kwargs)
    assert str(e.value) == message


def test_a_candidate_listed_twice_is_a_bug_in_the_caller():
    topo = tree([[2]])
    with pytest.raises(InvalidArgument, match="candidate n000 is listed twice"):
        place([*candidates({"l0": "HH"}, topo), Candidate("n000", True, True, True, 8)], GangRequest(1), topo)


@pytest.mark.parametrize("state,health,schedulable,healthy", [
    (NodeState.UP, Health.HEALTHY, True, True),
    (NodeState.UP, Health.DEGRADED, True, False),
    (NodeState.UP, Health.FAILING, False, False),
    (NodeState.UP, Health.FAILED, False, False),
    (NodeState.SUSPECT, Health.HEALTHY, False, True),
    (NodeState.DOWN, Health.HEALTHY, False, True),
    (NodeState.DRAINING, Health.HEALTHY, False, True),
    (NodeState.DRAINED, Health.HEALTHY, False, True),
])
def test_candidates_from_node_state_and_health(state, health, schedulable, healthy):
    c = Candidate.of("n1", state, health, True, 8)
    assert (c.schedulable, c.healthy) == (schedulable, healthy)


def test_lower_bound_leaves():
    assert lower_bound_leaves([7, 5, 3, 3], 10) == 2
    assert lower_bound_leaves([7, 5, 3, 3], 18) == 4
    assert lower_bound_leaves([7, 5, 3, 3], 19) is None
    assert lower_bound_leaves([17, 18, 12], 36, unit=18) is None
    assert lower_bound_leaves([18, 18, 12], 36, unit=18) == 2


# --- properties -------------------------------------------------------------------------------------------

STATES = "HHHHHHDDBXS"  # mostly free, so that multi-leaf placements are common


def states(n: int) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(STATES), min_size=n, max_size=n).map("".join)


@st.composite
def tree_cases(draw):
    spines = draw(st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4), min_size=1, max_size=3))
    topo = tree(spines, core=draw(st.booleans()))
    groups = {leaf: draw(states(len(topo.nodes_under(leaf)))) for leaf in topo.leaves}
    segment = draw(st.sampled_from([None, None, 1, 2, 3]))
    nodes = draw(st.integers(1, max(1, len(topo.nodes) // (segment or 1) // 2))) * (segment or 1)
    return topo, candidates(groups, topo), GangRequest(nodes, 8, draw(st.integers(0, 3)), segment)


@st.composite
def block_cases(draw):
    sizes = draw(st.lists(st.integers(2, 6), min_size=1, max_size=6))
    base = min(sizes)
    topo = blocks(sizes, draw(st.sampled_from(["", f"{base}", f"{base},{2 * base}", f"{base},{4 * base}"])))
    groups = {b: draw(states(s)) for b, s in zip(topo.blocks, sizes, strict=True)}
    segment = draw(st.sampled_from([None, 1, 2, 3]))
    nodes = draw(st.integers(1, max(1, sum(sizes) // (segment or 1) // 2))) * (segment or 1)
    return topo, candidates(groups, topo), GangRequest(nodes, 8, draw(st.integers(0, 2)), segment)


def usable(cands: list[Candidate], request: GangRequest, topo: ClusterTopology) -> dict[str, Candidate]:
    return {c.name: c for c in cands if c.schedulable and c.free and c.gpus >= request.ranks_per_node
            and leaf_of(topo, c.name) is not None}


def fewest(counts: list[int], need: int) -> int | None:
    """Brute force: the smallest number of counts summing to `need` or more."""
    for k in range(1, len(counts) + 1):
        if any(sum(combo) >= need for combo in itertools.combinations(counts, k)):
            return k
    return None


def check_common(p: Placement | Unplaceable, cands, request: GangRequest, topo: ClusterTopology) -> None:
    if isinstance(p, Unplaceable):
        assert p.reason
        return
    ok = usable(cands, request, topo)
    everyone = p.nodes + p.spares
    assert len(p.nodes) == request.nodes and len(p.spares) == request.spares  # never more, never fewer
    assert len(set(everyone)) == len(everyone)  # no node twice
    assert all(n in ok for n in everyone)  # never busy, unschedulable, too small or unknown
    assert set(p.degraded) == {n for n in everyone if not ok[n].healthy}
    used = [leaf_of(topo, n) for n in p.nodes]
    assert tuple(dict.fromkeys(used)) == p.leaves
    assert len([k for k, _ in itertools.groupby(used)]) == len(p.leaves)  # ranks grouped by leaf
    seg = request.segment or 1
    for start in range(0, len(p.nodes), seg):  # each segment in one leaf / block
        assert len({leaf_of(topo, n) for n in p.nodes[start:start + seg]}) == 1
    for leaf in p.leaves:  # DEGRADED on a leaf only after all its HEALTHY nodes
        mine = [n for n in p.nodes if leaf_of(topo, n) == leaf]
        if any(not ok[n].healthy for n in mine):
            assert all(n in mine for n in ok if ok[n].healthy and leaf_of(topo, n) == leaf)
    if any(leaf_of(topo, s) not in p.leaves for s in p.spares):  # spares on the job's leaves first
        assert all(n in everyone for n in ok if leaf_of(topo, n) in p.leaves)


@settings(max_examples=300, deadline=None)
@given(tree_cases())
def test_tree_placements_are_whole_valid_and_use_the_fewest_leaves(case):
    topo, cands, request = case
    p = place(cands, request, topo)
    check_common(p, cands, request, topo)
    ok = usable(cands, request, topo)
    seg, need = request.segment or 1, request.nodes + request.spares
    free = {leaf: sum(1 for n in ok if topo.leaf(n) == leaf) for leaf in topo.leaves}
    healthy = {leaf: sum(1 for n in ok if topo.leaf(n) == leaf and ok[n].healthy) for leaf in topo.leaves}
    best, best_healthy = None, None
    for s in topo.switches:  # the oracle: every domain that holds job + spares, by brute force
        under = topo.leaves_under(s)
        if sum(free[leaf] for leaf in under) < need:
            continue
        k = fewest([free[leaf] // seg for leaf in under], request.nodes // seg)
        if k is not None and (best is None or k < best):
            best = k
        kh = fewest([healthy[leaf] // seg for leaf in under], request.nodes // seg)
        if kh is not None and (best_healthy is None or kh < best_healthy):
            best_healthy = kh
    if best is None:
        assert isinstance(p, Unplaceable)  # all or nothing: no domain holds the gang, nothing placed
        return
    assert isinstance(p, Placement)
    assert len(p.leaves) == best
    if len(topo.roots) == 1:
        assert len(p.leaves) == p.lower_bound == lower_bound_leaves(free.values(), request.nodes, seg)
    if best_healthy == best:  # HEALTHY alone fit on that few leaves somewhere: no DEGRADED job node
        assert not set(p.degraded) & set(p.nodes)
    everyone = p.nodes + p.spares
    assert p.domain == topo.lowest_common_switch(everyone)  # spares inside the lowest common switch


@settings(max_examples=300, deadline=None)
@given(block_cases())
def test_block_placements_keep_gangs_and_segments_inside_blocks(case):
    topo, cands, request = case
    p = place(cands, request, topo)
    check_common(p, cands, request, topo)
    ok = usable(cands, request, topo)
    free = {b: sum(1 for n in ok if topo.block(n) == b) for b in topo.blocks}
    need = request.nodes + request.spares
    if request.segment is None:
        fits = [b for b in topo.blocks if free[b] >= need]
        assert isinstance(p, Placement) == bool(fits)
        if fits:
            assert p.leaves == (p.domain,) and {topo.block(n) for n in p.nodes + p.spares} == {p.domain}
            healthy = {b: sum(1 for n in ok if topo.block(n) == b and ok[n].healthy) for b in topo.blocks}
            job_degraded = len(set(p.degraded) & set(p.nodes))  # fewest DEGRADED, then best fit
            assert (job_degraded, free[p.domain]) == min((max(0, request.nodes - healthy[b]), free[b]) for b in fits)
        return
    seg = request.segment
    segments = sum(f // seg for f in free.values())
    assert isinstance(p, Placement) == (segments >= request.nodes // seg and sum(free.values()) >= need)
    if isinstance(p, Placement):
        assert len(p.leaves) == p.lower_bound == fewest([f // seg for f in free.values()], request.nodes // seg)
        held = {topo.block(n) for n in p.nodes + p.spares}
        assert p.domain in (*held, ALL_BLOCKS) or ".." in p.domain


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=12), st.integers(1, 4), st.data())
def test_the_lower_bound_is_reached_whenever_free_capacity_allows(free, spines, data):
    """Known optimum: HEALTHY free counts per leaf, leaves dealt over spines under one core."""
    total = sum(free)
    if total == 0:
        return
    nodes = data.draw(st.integers(1, total))
    spares = data.draw(st.integers(0, total - nodes))
    groups = [free[i::spines] for i in range(spines) if free[i::spines]]
    topo = tree([[8] * len(g) for g in groups])
    p = place(free_leaves(topo, [f for g in groups for f in g]), GangRequest(nodes, spares=spares), topo)
    assert isinstance(p, Placement)
    assert len(p.leaves) == p.lower_bound == fewest(free, nodes)
    assert p.domain == topo.lowest_common_switch(p.nodes + p.spares)


def test_per_leaf_caps_the_segments_on_each_leaf_and_the_lower_bound_counts_under_the_cap():
    topo = tree([[4, 4, 4, 4]])
    free = candidates({f"l{i}": "HHHH" for i in range(4)}, topo)
    tight = place(free, GangRequest(nodes=4, segment=2), topo)
    assert isinstance(tight, Placement) and len(tight.leaves) == 1
    spread = place(free, GangRequest(nodes=4, segment=2, per_leaf=1), topo)
    assert isinstance(spread, Placement) and len(spread.leaves) == 2 and spread.lower_bound == 2
    assert [topo.leaf(n) for n in spread.nodes[:2]] == [spread.leaves[0]] * 2  # each segment inside one leaf
    assert [topo.leaf(n) for n in spread.nodes[2:]] == [spread.leaves[1]] * 2
    assert isinstance(place(free, GangRequest(nodes=12, segment=2, per_leaf=1), topo), Unplaceable)  # 6 > 4 leaves
    assert lower_bound_leaves([4, 4, 4], 8, unit=2, per_leaf=1) is None
    assert lower_bound_leaves([4, 4, 4], 6, unit=2, per_leaf=1) == 3
    with pytest.raises(InvalidArgument, match="per_leaf"):
        GangRequest(nodes=4, per_leaf=0)
