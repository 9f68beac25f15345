"""Gang placement as a pure function: candidates, a request and the topology in; a `Placement` (the
job's nodes and its spares, all at once) or an `Unplaceable` with a sentence a person understands out.

The policy, most important first:

1. All or nothing. The job's nodes and its spares lie together in one *domain* (a switch's subtree; a
   block; for a segmented job, an aggregate of blocks from `BlockSizes` or all blocks), or nothing is
   placed. Only nodes that are schedulable (UP, HEALTHY or DEGRADED), free, with `gpus >=
   ranks_per_node` and known to the topology are used, each once.
2. The fewest leaf switches (blocks, in a block topology) for the job's nodes. Every domain that can
   hold job + spares is scored by the fewest of its leaves that hold the job; the best wins, so the
   result is the lower bound (`lower_bound_leaves`) whenever some domain can reach it.
3. The fewest DEGRADED nodes. DEGRADED nodes are used only when the minimal leaf count, or fitting at
   all, needs them: if HEALTHY nodes alone fit on that many leaves, only HEALTHY nodes are taken.
4. Slurm's tree rule: the lowest switch, then the tightest domain (fewest free nodes: best fit). In it,
   leaves with the most free nodes first and the tightest fit for the last one.

Spares: first the job's own leaves, then the leaves of the next domain up (the lowest switch holding
the job's leaves, then its ancestors) up to the chosen domain; HEALTHY before DEGRADED within each step,
fullest leaves first. `Placement.domain` is the lowest domain holding the job and its spares.

Spread (`per_leaf=L`, replica groups): at most L segments on any one leaf (block), so that a leaf switch lost
takes the fewest groups with it; the fewest leaves is then counted under that cap.

Blocks: a topology with blocks places by blocks (its switches, if any, are not used) and nodes outside
every block are not used. Segments (`segment=S`): nodes come in whole segments of S, each inside one
block (one leaf switch in a tree topology); without a segment the job and its spares share one block.

Rank order: leaves depth-first (leaves under one spine are adjacent), nodes in topology order inside a
leaf, so neighbouring ranks share switches and each segment is S consecutive ranks in one block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from controller.errors import InvalidArgument
from controller.jobs.topology import ClusterTopology
from controller.nodes.health import Health
from controller.nodes.states import NodeState

ALL_BLOCKS = "(all blocks)"  # the domain of a segmented job that no aggregate of blocks holds


@dataclass(frozen=True)
class Candidate:
    """A node as placement sees it. `schedulable` is False for DOWN, SUSPECT, DRAINING, DRAINED and for
    FAILING/FAILED health; `healthy` tells HEALTHY from DEGRADED; `free` means no other job holds it."""

    name: str
    schedulable: bool
    healthy: bool
    free: bool
    gpus: int
    lost: bool = False  # DOWN, drained or FAILING/FAILED: it will not be schedulable again by itself

    @classmethod
    def of(cls, name: str, state: NodeState, health: Health, free: bool, gpus: int, connected: bool = True,
           drained: bool = False) -> Candidate:
        """The one definition of schedulable: UP, not drained, its agent connected, and not FAILING/FAILED."""
        schedulable = state is NodeState.UP and not drained and connected and health in (Health.HEALTHY,
                                                                                          Health.DEGRADED)
        lost = state is NodeState.DOWN or drained or health in (Health.FAILING, Health.FAILED)
        return cls(name, schedulable, health is Health.HEALTHY, free, gpus, lost)


@dataclass(frozen=True)
class GangRequest:
    """`nodes` nodes running `ranks_per_node` ranks each, plus `spares` idle nodes held for the job.
    `segment`: nodes come in groups of that many, each inside one block (leaf switch in a tree); `per_leaf`: at
    most that many segments (nodes, without one) on any one leaf switch or block."""

    nodes: int
    ranks_per_node: int = 1
    spares: int = 0
    segment: int | None = None
    per_leaf: int | None = None

    def __post_init__(self) -> None:
        for name, value, least in (("nodes", self.nodes, 1), ("ranks_per_node", self.ranks_per_node, 1),
                                   ("spares", self.spares, 0), ("segment", self.segment, 1),
                                   ("per_leaf", self.per_leaf, 1)):
            if value is not None and value < least:
                raise InvalidArgument(f"{name} ({value}) must be at least {least}")
        if self.segment and self.nodes % self.segment:
            raise InvalidArgument(f"nodes ({self.nodes}) must be a multiple of segment ({self.segment})")


@dataclass(frozen=True)
class Placement:
    """Where a gang goes. `nodes` in rank order (node i runs ranks i*ranks_per_node onwards); `leaves`:
    the leaf switches (blocks) holding them, in rank order; `domain`: the lowest switch (block,
    aggregate) holding nodes and spares; `lower_bound`: the fewest leaves any placement of the job's
    nodes could use given the free nodes; `degraded`: the DEGRADED nodes among nodes and spares."""

    nodes: tuple[str, ...]
    spares: tuple[str, ...]
    leaves: tuple[str, ...]
    domain: str
    lower_bound: int
    degraded: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unplaceable:
    reason: str


def lower_bound_leaves(free: Iterable[int], nodes: int, unit: int = 1, per_leaf: int | None = None) -> int | None:
    """The fewest leaves that could hold `nodes` (in whole segments of `unit`, at most `per_leaf` of them on
    a leaf), given each leaf's free node count: the k fullest leaves. None when all of them together cannot."""
    return _fewest([_capped(f // unit, per_leaf) for f in free], -(-nodes // unit))


def _capped(units: int, per_leaf: int | None) -> int:
    return units if per_leaf is None else min(units, per_leaf)


def place(candidates: Iterable[Candidate], request: GangRequest,
          topology: ClusterTopology) -> Placement | Unplaceable:
    """Decide where `request` goes (see the module docstring for the policy). Pure; O(nodes + the
    topology's switch-to-leaf links). Raises InvalidArgument for a candidate listed twice."""
    blocks = topology.has_blocks
    where = topology.node_block if blocks else topology.node_leaf
    found: dict[str, tuple[list[str], list[str]]] = {}
    seen: set[str] = set()
    down = busy = small = outside = 0
    for c in candidates:
        if c.name in seen:
            raise InvalidArgument(f"candidate {c.name} is listed twice")
        seen.add(c.name)
        if not c.schedulable:
            down += 1
        elif not c.free:
            busy += 1
        elif c.gpus < request.ranks_per_node:
            small += 1
        elif (group := where.get(c.name)) is None:
            outside += 1
        else:
            found.setdefault(group, ([], []))[0 if c.healthy else 1].append(c.name)
    need = request.nodes + request.spares
    usable = sum(len(h) + len(d) for h, d in found.values())
    if usable < need:
        return Unplaceable(_shortage(request, usable, down, busy, small, outside))
    block_rank = {b: i for i, b in enumerate(topology.blocks)}
    rank_of = block_rank.__getitem__ if blocks else topology.rank
    key = topology.node_index
    groups = sorted((_Group(name, rank_of(name), sorted(h, key=key), sorted(d, key=key))
                     for name, (h, d) in found.items()), key=lambda g: g.rank)
    index = {g.name: i for i, g in enumerate(groups)}
    unit = request.segment or 1
    if blocks:
        domains = _block_domains(topology, index, segmented=request.segment is not None)
    else:
        domains = _switch_domains(topology, index)
    best: tuple[tuple[int, ...], _Domain, list[int], dict[int, int]] | None = None
    for d in domains:
        free = sum(groups[i].free for i in d.groups)
        if free < need:
            continue
        pick = _choose(groups, d.groups, unit, request.nodes // unit, best[0][0] if best else None,
                       request.per_leaf)
        if pick is None:
            continue
        chosen, take, degraded = pick
        score = (len(chosen), degraded, d.level, free, d.rank)
        if best is None or score < best[0]:
            best = (score, d, chosen, take)
    lower = lower_bound_leaves((g.free for g in groups), request.nodes, unit, request.per_leaf)
    if best is None or lower is None:
        return Unplaceable(_no_domain(request, groups, domains, blocks))
    _, domain, chosen, take = best
    return _finish(groups, domains, domain, chosen, take, unit, request.spares, lower, key)


@dataclass
class _Group:
    """A leaf switch (or block) with its usable nodes, HEALTHY and DEGRADED apart, in topology order."""

    name: str
    rank: int
    healthy: list[str]
    degraded: list[str]

    @property
    def free(self) -> int:
        return len(self.healthy) + len(self.degraded)


@dataclass(frozen=True)
class _Domain:
    name: str
    level: int
    rank: int
    groups: tuple[int, ...]
    members: frozenset[int]


def _switch_domains(topology: ClusterTopology, index: dict[str, int]) -> list[_Domain]:
    out = []
    for s in topology.switches:
        groups = tuple(index[leaf] for leaf in topology.leaves_under(s) if leaf in index)
        if groups:
            out.append(_Domain(s, topology.level(s), topology.rank(s), groups, frozenset(groups)))
    return out


def _block_domains(topology: ClusterTopology, index: dict[str, int], segmented: bool) -> list[_Domain]:
    """Each block; for a segmented job also Slurm's aggregates (BlockSizes: 2, 4, ... consecutive
    blocks) and, above them, all blocks."""
    names = topology.blocks
    out = [_Domain(b, 0, i, (index[b],), frozenset((index[b],))) for i, b in enumerate(names) if b in index]
    if not segmented:
        return out
    spans = [m for m in topology.block_aggregates if 1 < m < len(names)] + [len(names)]
    for level, m in enumerate(spans, 1):
        for start in range(0, len(names), m):
            part = names[start:start + m]
            groups = tuple(index[b] for b in part if b in index)
            if groups and len(part) > 1:
                name = ALL_BLOCKS if m == len(names) else f"{part[0]}..{part[-1]}"
                out.append(_Domain(name, level, start, groups, frozenset(groups)))
    return out


def _fewest(counts: list[int], need: int) -> int | None:
    total = 0
    for k, c in enumerate(sorted(counts, reverse=True), 1):
        total += c
        if total >= need:
            return k
    return None


def _choose(groups: list[_Group], idx: tuple[int, ...], unit: int, n: int, bound: int | None,
            per_leaf: int | None = None) -> tuple[list[int], dict[int, int], int] | None:
    """The fewest leaves of one domain holding `n` units: HEALTHY-only if that needs no more leaves,
    else counting DEGRADED; fullest first, tightest fit last. Returns (leaves, units per leaf, DEGRADED
    nodes used), or None when the domain cannot hold the job or needs more leaves than `bound`."""
    cap = {i: _capped(groups[i].free // unit, per_leaf) for i in idx}
    k = _fewest(list(cap.values()), n)
    if k is None or (bound is not None and k > bound):
        return None
    healthy = {i: _capped(len(groups[i].healthy) // unit, per_leaf) for i in idx}
    first, second = (healthy, cap) if _fewest(list(healthy.values()), n) == k else (cap, healthy)
    ordered = sorted(idx, key=lambda i: (-first[i], -second[i], groups[i].rank))
    chosen = ordered[:k - 1]
    rest = n - sum(first[i] for i in chosen)
    chosen.append(min((i for i in ordered[k - 1:] if first[i] >= rest),
                      key=lambda i: (first[i], -second[i], groups[i].rank)))
    take = _units(groups, chosen, unit, n, per_leaf)
    return chosen, take, sum(max(0, take[i] * unit - len(groups[i].healthy)) for i in chosen)


def _units(groups: list[_Group], chosen: list[int], unit: int, n: int, per_leaf: int | None = None) -> dict[int, int]:
    """How many units each chosen leaf gives, spending as few DEGRADED nodes as possible. Every chosen
    leaf keeps at least one unit: k is minimal, so no k-1 of them hold n units."""
    take = {i: _capped(len(groups[i].healthy) // unit, per_leaf) for i in chosen}
    total = sum(take.values())
    for i in reversed(chosen):  # more HEALTHY units than needed: give back from the tightest leaf first
        give = min(take[i], total - n) if total > n else 0
        take[i] -= give
        total -= give
    if total < n:  # one more unit where HEALTHY leftovers make it cheapest, then anywhere
        room = {i: _capped(groups[i].free // unit, per_leaf) - take[i] for i in chosen}
        cheapest = sorted(chosen, key=lambda i: take[i] * unit - len(groups[i].healthy))
        for i in cheapest:
            if total < n and room[i]:
                take[i], room[i], total = take[i] + 1, room[i] - 1, total + 1
        for i in chosen:
            extra = min(room[i], n - total)
            take[i] += extra
            total += extra
    return take


def _finish(groups: list[_Group], domains: list[_Domain], domain: _Domain, chosen: list[int],
            take: dict[int, int], unit: int, spares: int, lower: int, key: Callable[[str], int]) -> Placement:
    left: dict[int, tuple[list[str], list[str]]] = {}
    nodes: list[str] = []
    degraded: list[str] = []
    for i in sorted(chosen, key=lambda i: groups[i].rank):
        g, count = groups[i], take[i] * unit
        h = min(count, len(g.healthy))
        used = g.healthy[:h] + g.degraded[:count - h]
        degraded.extend(g.degraded[:count - h])
        nodes.extend(sorted(used, key=key))
        left[i] = (g.healthy[h:], g.degraded[count - h:])
    job = frozenset(chosen)
    rings = sorted((e for e in domains if job <= e.members <= domain.members), key=lambda e: (e.level, e.rank))
    where = rings[0]
    picked: list[tuple[int, str]] = []
    visited: set[int] = set()
    for tier, members in enumerate([list(chosen)] + [list(e.groups) for e in rings]):
        if len(picked) == spares:
            break
        fresh = [i for i in members if i not in visited]
        visited.update(fresh)
        for i in fresh:
            left.setdefault(i, (groups[i].healthy, groups[i].degraded))
        fresh.sort(key=lambda i: (-len(left[i][0]) - len(left[i][1]), groups[i].rank))
        for kind in (0, 1):  # HEALTHY first, then DEGRADED
            for i in fresh:
                pool = left[i][kind][:spares - len(picked)]
                picked.extend((i, n) for n in pool)
                if kind:
                    degraded.extend(pool)
        where = rings[max(0, tier - 1)]
    spare_nodes = tuple(n for _, n in sorted(picked, key=lambda p: (groups[p[0]].rank, key(p[1]))))
    leaves = tuple(groups[i].name for i in sorted(chosen, key=lambda i: groups[i].rank))
    return Placement(tuple(nodes), spare_nodes, leaves, where.name, lower, tuple(degraded))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _needs(request: GangRequest) -> str:
    total = request.nodes + request.spares
    spares = f" ({request.nodes} + {_plural(request.spares, 'spare')})" if request.spares else ""
    return f"{total} nodes{spares}"


def _shortage(request: GangRequest, usable: int, down: int, busy: int, small: int, outside: int) -> str:
    gpus = _plural(request.ranks_per_node, "GPU")
    parts = [(down, "DOWN, suspect, draining, drained or failing"), (busy, "busy"),
             (small, f"with fewer than {gpus}"), (outside, "not in the topology")]
    detail = ", ".join(f"{n} {what}" for n, what in parts if n)
    return (f"needs {_needs(request)} with {gpus}; {usable} {'is' if usable == 1 else 'are'} free and schedulable"
            + (f" ({detail})" if detail else ""))


def _no_domain(request: GangRequest, groups: list[_Group], domains: list[_Domain], blocks: bool) -> str:
    unit = request.segment or 1
    where = "block" if blocks else "leaf switch"
    segments = sum(g.free // unit for g in groups)
    if unit > 1 and segments < request.nodes // unit:
        return (f"needs {_plural(request.nodes // unit, 'segment')} of {unit} nodes, each inside one {where}; "
                f"the free nodes make only {segments}")
    if blocks and request.segment is None:
        largest = max(groups, key=lambda g: g.free)
        return f"no single block has {_needs(request)} free; the largest has {largest.free} ({largest.name})"
    most = max(domains, key=lambda d: sum(groups[i].free for i in d.groups))
    return (f"no switch connects {_needs(request)} free" + (f" in segments of {unit}" if unit > 1 else "")
            + f"; the most under one switch is {sum(groups[i].free for i in most.groups)} ({most.name})")
