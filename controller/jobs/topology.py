"""The cluster's network topology as a pure value: the leaf switch each node hangs off, how switches
nest, and which NVLink-style block each node belongs to.

Built from Slurm's topology.conf (`controller.jobs.slurm_topology.parse_topology_conf`, tree or block syntax), from
the agents' labels (`from_labels`), or both (`merged`: the file wins). Placement
(controller/jobs/placement.py) only reads it. Everything a placement asks for is precomputed once, so a
16,384-node tree answers in constant or subtree-sized time.

Slurm semantics kept on purpose: a switch may be listed by several parents (a fat tree with redundant
spines, as in Slurm's topology guide); top-level switches without a common parent are separate fabrics
that no job spans. Topologies built from labels join their top-level switches under `FABRIC` instead:
a missing spine label means "unknown", not "not connected".
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from controller.errors import ControllerError

DEFAULT_LEAF = "default"  # the leaf switch of nodes nothing places elsewhere
FABRIC = "(fabric)"  # the implicit root joining top-level switches that came from labels


class TopologyError(ControllerError):
    """The topology is inconsistent: a cycle, a switch with nodes and child switches, labels that disagree."""


class TopologyConfError(TopologyError):
    """topology.conf is malformed; the message reads `topology.conf:LINE: what is wrong`."""


@dataclass(frozen=True)
class ClusterTopology:
    """Nodes on leaf switches, switches under parent switches, nodes in blocks.

    `switch_parents` has every switch as a key (top-level ones map to `()`); its order is the order
    switches were defined and breaks ties in placement. `block_sizes` are node counts: the base block
    size, then aggregates of 2, 4, ... consecutive blocks (Slurm's `BlockSizes=`).
    """

    node_leaf: Mapping[str, str] = field(default_factory=dict, repr=False)
    switch_parents: Mapping[str, tuple[str, ...]] = field(default_factory=dict, repr=False)
    node_block: Mapping[str, str] = field(default_factory=dict, repr=False)
    block_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        parents = {s: tuple(p) for s, p in self.switch_parents.items()}
        for leaf in self.node_leaf.values():
            parents.setdefault(leaf, ())
        children: dict[str, list[str]] = {s: [] for s in parents}
        for s, ps in parents.items():
            for p in ps:
                if p not in children:
                    raise TopologyError(f"switch {s} has unknown parent switch {p}")
                if p == s:
                    raise TopologyError(f"switch {s} is its own parent")
                children[p].append(s)
        leaf_nodes: dict[str, list[str]] = {s: [] for s, c in children.items() if not c}
        for node, leaf in self.node_leaf.items():
            if children[leaf]:
                raise TopologyError(f"switch {leaf} holds node {node} and child switches ({children[leaf][0]})")
            leaf_nodes[leaf].append(node)
        bottom_up = _bottom_up(children)
        if len(bottom_up) < len(children):
            raise TopologyError(f"switches form a cycle: {' -> '.join(find_cycle(children) or [])}")
        level: dict[str, int] = {}
        under: dict[str, tuple[str, ...]] = {}
        for s in bottom_up:
            level[s] = 1 + max(level[c] for c in children[s]) if children[s] else 0
            under[s] = (s,) if not children[s] else tuple(dict.fromkeys(x for c in children[s] for x in under[c]))
        # Depth-first order along each switch's first parent: leaves under one switch are adjacent.
        order: list[str] = []
        stack = [s for s, ps in reversed(parents.items()) if not ps]
        while stack:
            s = stack.pop()
            order.append(s)
            stack.extend(c for c in reversed(children[s]) if parents[c][0] == s)
        rank = {s: i for i, s in enumerate(order)}
        blocks: dict[str, list[str]] = {}
        for node, block in self.node_block.items():
            blocks.setdefault(block, []).append(node)
        sizes = tuple(self.block_sizes)
        if blocks and not sizes:
            base = min(len(b) for b in blocks.values())
            sizes = (base, 2 * base, 4 * base, 8 * base)  # Slurm's default: up to 8 blocks together
        check_block_sizes(sizes)
        for name, members in blocks.items():
            if len(members) < sizes[0]:
                raise TopologyError(f"block {name} has {len(members)} nodes, fewer than the base block size {sizes[0]}")
        nodes = dict.fromkeys([*self.node_leaf, *self.node_block])
        for key, value in [
            ("node_leaf", MappingProxyType(dict(self.node_leaf))), ("switch_parents", MappingProxyType(parents)),
            ("node_block", MappingProxyType(dict(self.node_block))), ("block_sizes", sizes),
            ("_children", {s: tuple(c) for s, c in children.items()}), ("_level", level), ("_rank", rank),
            ("_leaf_nodes", {s: tuple(n) for s, n in leaf_nodes.items()}), ("_under", under),
            ("_under_set", {s: frozenset(u) for s, u in under.items()}),
            ("_block_nodes", {b: tuple(n) for b, n in blocks.items()}),
            ("_node_index", {n: i for i, n in enumerate(nodes)}),
        ]:
            object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        return (f"ClusterTopology({len(self._node_index)} nodes, {len(self.switch_parents)} switches, "
                f"{self.levels} levels, {len(self._block_nodes)} blocks)")

    # --- what there is ---------------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node the topology places (on a leaf switch, in a block, or both), in definition order."""
        return tuple(self._node_index)

    @property
    def switches(self) -> tuple[str, ...]:
        """All switches, depth-first (a switch before its children, siblings in definition order)."""
        return tuple(self._rank)

    @property
    def leaves(self) -> tuple[str, ...]:
        """Leaf switches (no child switches), depth-first: leaves under one spine are adjacent."""
        return tuple(s for s in self._rank if not self._children[s])

    @property
    def roots(self) -> tuple[str, ...]:
        return tuple(s for s in self._rank if not self.switch_parents[s])

    @property
    def levels(self) -> int:
        """How many switch levels there are: 1 for leaves only, 3 for leaf/spine/core; 0 without switches."""
        return 1 + max(self._level.values()) if self._level else 0

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(self._block_nodes)

    @property
    def has_blocks(self) -> bool:
        return bool(self._block_nodes)

    def node_index(self, node: str) -> int:
        """The node's position in definition order (placement keeps neighbours in this order)."""
        return self._node_index[node]

    # --- switches ----------------------------------------------------------------------------------
    def leaf(self, node: str) -> str | None:
        return self.node_leaf.get(node)

    def parent(self, switch: str) -> str | None:
        """The first switch that lists `switch` (Slurm allows several); None at the top."""
        ps = self.switch_parents[switch]
        return ps[0] if ps else None

    def children(self, switch: str) -> tuple[str, ...]:
        return self._children[switch]

    def level(self, switch: str) -> int:
        """0 for a leaf switch, else one more than its highest child."""
        return self._level[switch]

    def rank(self, switch: str) -> int:
        """The switch's depth-first position (tie-breaker and rank-order key)."""
        return self._rank[switch]

    def ancestors(self, switch: str) -> tuple[str, ...]:
        """Every switch above `switch` (all parents, not only the first), lowest level first."""
        seen: dict[str, None] = {}
        todo = list(self.switch_parents[switch])
        while todo:
            s = todo.pop()
            if s not in seen:
                seen[s] = None
                todo.extend(self.switch_parents[s])
        return tuple(sorted(seen, key=lambda s: (self._level[s], self._rank[s])))

    def leaves_under(self, switch: str) -> tuple[str, ...]:
        """The leaf switches in `switch`'s subtree (itself for a leaf), depth-first."""
        return self._under[switch]

    def nodes_under(self, switch: str) -> tuple[str, ...]:
        return tuple(n for leaf in self._under[switch] for n in self._leaf_nodes[leaf])

    def lowest_common_switch(self, nodes: Iterable[str]) -> str | None:
        """The lowest switch whose subtree holds every node; None if none does or a node has no leaf."""
        leaves = set()
        for n in nodes:
            leaf = self.node_leaf.get(n)
            if leaf is None:
                return None
            leaves.add(leaf)
        if not leaves:
            return None
        first = next(iter(leaves))
        if len(leaves) == 1:
            return first
        return next((s for s in self.ancestors(first) if self._under_set[s] >= leaves), None)

    # --- blocks ------------------------------------------------------------------------------------
    def block(self, node: str) -> str | None:
        return self.node_block.get(node)

    def block_nodes(self, block: str) -> tuple[str, ...]:
        return self._block_nodes[block]

    @property
    def block_aggregates(self) -> tuple[int, ...]:
        """How many consecutive blocks each level of `block_sizes` joins: (1, 2, 4) for 18,36,72."""
        return tuple(size // self.block_sizes[0] for size in self.block_sizes)


def check_block_sizes(sizes: tuple[int, ...]) -> None:
    """Slurm's rule: positive, increasing, each the base size times a power of two. Raises TopologyError."""
    if not sizes:
        return
    if any(s <= 0 for s in sizes):
        raise TopologyError("block sizes must be positive")
    for prior, size in itertools.pairwise(sizes):
        if size <= prior:
            raise TopologyError("block sizes must increase")
        ratio, rest = divmod(size, sizes[0])
        if rest or ratio & (ratio - 1):
            raise TopologyError(f"{size} is not {sizes[0]} times a power of two")


def find_cycle(children: Mapping[str, Iterable[str]]) -> list[str] | None:
    """A cycle among switches as a path back to its start, or None. O(switches + links)."""
    done = set(_bottom_up(children))
    if len(done) == len(children):
        return None
    # A switch left over by Kahn's algorithm always has a child that is left over too: walk until one repeats.
    path = [next(s for s in children if s not in done)]
    at = {path[0]: 0}
    while True:
        step = next(c for c in children[path[-1]] if c not in done)
        if step in at:
            return [*path[at[step]:], step]
        at[step] = len(path)
        path.append(step)


def _bottom_up(children: Mapping[str, Iterable[str]]) -> list[str]:
    """Switches children-first (Kahn's algorithm on an acyclic graph)."""
    parents_of: dict[str, list[str]] = {s: [] for s in children}
    waiting = {s: 0 for s in children}
    for s, cs in children.items():
        for c in cs:
            parents_of[c].append(s)
            waiting[s] += 1
    ready = [s for s, n in waiting.items() if n == 0]
    out: list[str] = []
    while ready:
        s = ready.pop()
        out.append(s)
        for p in parents_of[s]:
            waiting[p] -= 1
            if waiting[p] == 0:
                ready.append(p)
    return out


# --- Slurm hostlists -------------------------------------------------------------------------------
def flat(nodes: Iterable[str], leaf: str = DEFAULT_LEAF) -> ClusterTopology:
    """One leaf switch holding every node: one domain, every placement uses one 'leaf'."""
    return ClusterTopology({n: leaf for n in nodes}, {leaf: ()})


def from_labels(labels: Mapping[str, Mapping[str, str]]) -> ClusterTopology:
    """From the agents' labels: `switch` (leaf), optional `spine` and `superspine` above it, `block`.
    A node without a `switch` label goes on the leaf "default"; top-level switches are joined under
    FABRIC. Raises TopologyError when labels disagree (one switch under two different spines)."""
    node_leaf, ups, node_block = _label_maps(labels)
    return ClusterTopology(node_leaf, _join(ups, FABRIC), node_block)


def merged(conf: ClusterTopology, labels: Mapping[str, Mapping[str, str]]) -> ClusterTopology:
    """topology.conf wins: a node it lists keeps its place there; any other node takes its labels (or
    the default leaf). New top-level switches go under the file's only top switch, else under FABRIC."""
    listed = set(conf.node_leaf) | set(conf.node_block)
    node_leaf, ups, node_block = _label_maps({n: lab for n, lab in labels.items() if n not in listed})
    parents = dict(conf.switch_parents)
    parents.update({s: ups[s] for s in ups if s not in parents})
    new_roots = [s for s in ups if s not in conf.switch_parents and not parents[s]]
    if new_roots and len(conf.roots) == 1:
        parents.update({s: conf.roots for s in new_roots})
    elif new_roots:
        parents = _join(parents, FABRIC)
    return ClusterTopology({**conf.node_leaf, **node_leaf}, parents, {**conf.node_block, **node_block},
                           conf.block_sizes if conf.has_blocks else ())


def _label_maps(labels: Mapping[str, Mapping[str, str]]) -> tuple[dict[str, str], dict[str, tuple[str, ...]],
                                                                  dict[str, str]]:
    node_leaf: dict[str, str] = {}
    ups: dict[str, tuple[str, ...]] = {}
    named_by: dict[str, str] = {}
    node_block: dict[str, str] = {}
    for node, lab in labels.items():
        chain = [lab[k] for k in ("switch", "spine", "superspine") if lab.get(k)] if lab.get("switch") else []
        chain = chain or [DEFAULT_LEAF]
        node_leaf[node] = chain[0]
        for child, parent in zip(chain, [*chain[1:], None], strict=True):
            prior = ups.setdefault(child, (parent,) if parent else ())
            if parent and prior != (parent,):
                if prior:
                    raise TopologyError(f"labels disagree: switch {child} is under {prior[0]} "
                                        f"(node {named_by[child]}) and under {parent} (node {node})")
                ups[child] = (parent,)
            if parent:
                named_by.setdefault(child, node)
        if lab.get("block"):
            node_block[node] = lab["block"]
    return node_leaf, ups, node_block


def _join(parents: Mapping[str, tuple[str, ...]], root: str) -> dict[str, tuple[str, ...]]:
    """Put every top-level switch under `root` when there are several."""
    if sum(1 for p in parents.values() if not p) < 2:
        return dict(parents)
    return {root: (), **{s: p or (root,) for s, p in parents.items()}}
