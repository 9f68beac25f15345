"""Slurm's topology.conf, read as it is: tree syntax (SwitchName= with Nodes= or Switches=) and block
syntax (BlockName=, BlockSizes=), with Slurm hostlist expressions. Errors name the file and line."""

from __future__ import annotations

from collections.abc import Iterable

from controller.jobs.topology import ClusterTopology, TopologyConfError, TopologyError, check_block_sizes, find_cycle
from phalanx import hostlist


def expand_hostlist(expr: str) -> list[str]:
    """Slurm hostlist expression to names (phalanx.hostlist). Raises TopologyError saying what is malformed."""
    try:
        return hostlist.expand(expr)
    except hostlist.HostlistError as e:
        raise TopologyError(str(e)) from None


# --- topology.conf ---------------------------------------------------------------------------------
_RECORD_KEYS = {  # first key of a line -> the keys that may follow it
    "switchname": {"nodes": "Nodes", "switches": "Switches", "linkspeed": "LinkSpeed"},
    "blockname": {"nodes": "Nodes"},
    "blocksizes": {},
}


def parse_topology_conf(text: str, source: str = "topology.conf") -> ClusterTopology:
    """Slurm's topology.conf, tree (`SwitchName= Nodes=|Switches= [LinkSpeed=]`) or block (`BlockName=
    Nodes=`, `BlockSizes=`) syntax: keys case-insensitive, `#` comments, `\\` continues a line, names as
    hostlist expressions. Raises TopologyConfError("SOURCE:LINE: ...") at the first problem; a
    continued line reports the line it starts on. LinkSpeed is checked and dropped (Slurm ignores it)."""

    def fail(line: int, what: str) -> TopologyConfError:
        return TopologyConfError(f"{source}:{line}: {what}")

    def hostlist(line: int, expr: str) -> list[str]:
        try:
            return list(dict.fromkeys(expand_hostlist(expr)))
        except TopologyError as e:
            raise fail(line, f"malformed hostlist {expr!r}: {e}") from None

    switches: dict[str, tuple[int, list[str], list[str]]] = {}  # name -> (line, nodes, child switches)
    blocks: dict[str, tuple[int, list[str]]] = {}
    sizes: tuple[int, str] | None = None  # (line, value)
    first: dict[str, tuple[int, str]] = {}  # "tree"/"block" -> (line, key) of its first line
    for line, fields in _records(text, fail):
        head, (key, name) = next(iter(fields.items()))
        if head == "ringname":
            raise fail(line, "RingName= (topology/ring) is not supported; use SwitchName= or BlockName=")
        if head not in _RECORD_KEYS:
            raise fail(line, f"unknown key {key!r}: a line starts with SwitchName=, BlockName= or BlockSizes=")
        allowed = _RECORD_KEYS[head]
        for extra, (extra_key, _) in list(fields.items())[1:]:
            if extra not in allowed:
                expected = " or ".join(f"{k}=" for k in allowed.values()) or "nothing else"
                raise fail(line, f"unknown key {extra_key!r} after {key}= (expected {expected})")
        kind, other = ("tree", "block") if head == "switchname" else ("block", "tree")
        if other in first:
            raise fail(line, f"{key}= in a file that already uses {first[other][1]}= (line {first[other][0]}); "
                             "a topology.conf describes a tree or blocks, not both")
        first.setdefault(kind, (line, key))
        if head == "switchname":
            if name in switches:
                raise fail(line, f"switch {name} is already defined on line {switches[name][0]}")
            if "nodes" in fields and "switches" in fields:
                raise fail(line, f"switch {name} has both Nodes= and Switches=; a switch holds nodes or switches")
            speed = fields.get("linkspeed", ("", "0"))[1]
            if not speed.isdigit():
                raise fail(line, f"LinkSpeed={speed} is not a whole number")
            switches[name] = (line, hostlist(line, fields["nodes"][1]) if "nodes" in fields else [],
                              hostlist(line, fields["switches"][1]) if "switches" in fields else [])
        elif head == "blockname":
            if name in blocks:
                raise fail(line, f"block {name} is already defined on line {blocks[name][0]}")
            if "nodes" not in fields:
                raise fail(line, f"block {name} has no Nodes=")
            blocks[name] = (line, hostlist(line, fields["nodes"][1]))
        else:
            if sizes is not None:
                raise fail(line, f"BlockSizes= is already set on line {sizes[0]}")
            for item in name.split(","):
                if not item.isdigit() or int(item) == 0:
                    raise fail(line, f"BlockSizes={name}: {item!r} is not a positive whole number")
            try:
                check_block_sizes(tuple(int(x) for x in name.split(",")))
            except TopologyError as e:
                raise fail(line, f"BlockSizes={name}: {e}") from None
            sizes = (line, name)
    if not first:
        raise fail(1, "no SwitchName= or BlockName= lines")
    if "block" in first:
        return _conf_blocks(blocks, sizes, fail)
    node_leaf: dict[str, str] = {}
    parents: dict[str, list[str]] = {name: [] for name in switches}
    for name, (line, nodes, kids) in switches.items():
        for node in nodes:
            prior = node_leaf.setdefault(node, name)
            if prior != name:
                raise fail(line, f"node {node} is on leaf switches {prior} (line {switches[prior][0]}) and {name}")
        for kid in kids:
            if kid == name:
                raise fail(line, f"switch {name} lists itself")
            if kid not in switches:
                raise fail(line, f"switch {name} lists unknown switch {kid}")
            if name not in parents[kid]:
                parents[kid].append(name)
    cycle = find_cycle({name: kids for name, (_, _, kids) in switches.items()})
    if cycle:
        raise fail(switches[cycle[0]][0], f"switches form a cycle: {' -> '.join(cycle)}")
    return ClusterTopology(node_leaf, {s: tuple(p) for s, p in parents.items()})


def _conf_blocks(blocks: dict[str, tuple[int, list[str]]], sizes: tuple[int, str] | None,
                 fail) -> ClusterTopology:
    if not blocks:
        raise fail(sizes[0] if sizes else 1, "BlockSizes= without any BlockName= line")
    node_block: dict[str, str] = {}
    for name, (line, nodes) in blocks.items():
        for node in nodes:
            prior = node_block.setdefault(node, name)
            if prior != name:
                raise fail(line, f"node {node} is in blocks {prior} (line {blocks[prior][0]}) and {name}")
    if sizes is None:
        return ClusterTopology(node_block=node_block)
    values = tuple(int(x) for x in sizes[1].split(","))
    for name, (line, nodes) in blocks.items():
        if len(nodes) < values[0]:
            raise fail(line, f"block {name} has {len(nodes)} nodes, fewer than the base block size {values[0]} "
                             f"(BlockSizes={sizes[1]})")
    return ClusterTopology(node_block=node_block, block_sizes=values)


def _records(text: str, fail) -> Iterable[tuple[int, dict[str, tuple[str, str]]]]:
    """Logical lines as {lowercase key: (key, value)}: comments gone, a line ending in `\\` joined to
    the next as Slurm does (backslash removed, nothing added: indent a continued line to separate)."""
    pending: list[str] = []
    start = 0
    lines = text.splitlines()
    for number, raw in enumerate([*lines, ""], 1):
        body = raw.split("#", 1)[0].rstrip()
        if not pending:
            start = number
        if body.endswith("\\") and number <= len(lines):
            pending.append(body[:-1])
            continue
        logical = "".join([*pending, body]).split()
        pending = []
        if not logical:
            continue
        fields: dict[str, tuple[str, str]] = {}
        for token in logical:
            key, eq, value = token.partition("=")
            if not eq or not key:
                raise fail(start, f"expected Key=Value, found {token!r}")
            if not value:
                raise fail(start, f"{key}= has no value")
            if key.lower() in fields:
                raise fail(start, f"{key}= is given twice")
            fields[key.lower()] = (key, value.strip("\"'"))
        yield start, fields


# --- labels ----------------------------------------------------------------------------------------
