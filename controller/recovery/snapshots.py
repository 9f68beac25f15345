"""Which in-memory snapshot a new generation restores from: a pure function of what the nodes hold.

Agents report, in each heartbeat, the complete snapshots they hold: their own ranks', and replicas of a
peer node's. A new generation restores from the newest step of the generation just ended for which
every rank's snapshot survives on a node that is up: on the node the rank now runs on when it is there
(a restart in place), else on whichever node holds it, with every other node that holds it as a fallback
(a copy that fails its CRC is dropped, and the next one is fetched). If the generation just ended left no
whole step (it failed in its own start: a launch refused, a rank lost before every rank had restored), the
newest earlier generation that did is used: its snapshots are still held, and otherwise a second failure
during a recovery would throw them away for the disk checkpoint. All ranks always restore the same step of
one generation: ranks restored from different generations would not have trained the same model. trainlib
loads the durable checkpoint instead when it is as new. When no step is whole, trainlib falls back to the
newest durable checkpoint, and the reason goes to the event log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from phalanx.v1 import node_pb2


@dataclass(frozen=True)
class Restore:
    generation: int  # the generation that took the snapshots
    step: int
    sources: dict[int, str]  # rank -> the node to fetch its snapshot from
    also: dict[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> the other nodes that hold it, to try next


def safe_step(held: Mapping[str, Iterable[node_pb2.SnapshotHeld]], job: str, generation: int,
              world: int) -> int | None:
    """The newest step of `generation` whose every rank's snapshot is held on two nodes or more (its own and a
    replica), so that no one lost node can take it away; None if there is none. Agents keep it (a pin) however
    far their ranks move on: after a node is lost, the survivors' newest steps are seconds past the lost ranks'
    last replicas, and without the pin no step would be whole."""
    where: dict[int, dict[int, set[str]]] = {}
    for node, snapshots in held.items():
        for s in snapshots:
            if s.job == job and s.generation == generation:
                where.setdefault(s.step, {}).setdefault(s.rank, set()).add(node)
    return max((step for step, ranks in where.items()
                if len(ranks) == world and all(len(nodes) >= 2 for nodes in ranks.values())), default=None)


def plan(held: Mapping[str, Iterable[node_pb2.SnapshotHeld]], job: str, generation: int, world: int,
         up: set[str], placement: Mapping[int, str]) -> tuple[Restore | None, str]:
    """(the restore, why not from `generation`: "" when it is) or (None, why there is none). `generation`: the one
    just ended (an earlier one only if it left no whole step); `held`: node -> what it reported; `up`: the nodes a
    snapshot can be fetched from; `placement`: rank -> the node the new generation runs it on."""
    by_generation: dict[int, dict[int, dict[int, set[str]]]] = {}  # generation -> step -> rank -> nodes holding it
    lost: set[str] = set()
    for node, snapshots in held.items():
        for s in snapshots:
            if s.job != job or s.generation > generation:
                continue
            if node not in up:
                if s.generation == generation:
                    lost.add(node)
                continue
            by_generation.setdefault(s.generation, {}).setdefault(s.step, {}).setdefault(s.rank, set()).add(node)
    why = _not_whole(by_generation.get(generation, {}), generation, world, lost)
    for candidate in sorted(by_generation, reverse=True):
        where = by_generation[candidate]
        complete = [step for step, ranks in where.items() if len(ranks) == world]
        if complete:
            step = max(complete)
            sources = {rank: placement[rank] if placement.get(rank) in nodes else min(nodes)
                       for rank, nodes in where[step].items()}
            also = {rank: tuple(sorted(nodes - {sources[rank]})) for rank, nodes in where[step].items()}
            return Restore(candidate, step, sources, also), why if candidate != generation else ""
    return None, why + ("; nor has an earlier generation" if any(g < generation for g in by_generation) else "")


def _not_whole(where: Mapping[int, Mapping[int, set[str]]], generation: int, world: int, lost: set[str]) -> str:
    """Why no step of `generation` (`where`: step -> rank -> the nodes up that hold it) is whole."""
    gone = f" (held on {', '.join(sorted(lost))}, which cannot be reached)" if lost else ""
    if not where:
        return f"generation {generation} left no in-memory snapshot on a node that is up{gone}"
    step = max(where)
    missing = sorted(set(range(world)) - set(where[step]))
    return (f"no step of generation {generation} has every rank's in-memory snapshot on a node that is up: "
            f"the newest, step {step}, lacks rank(s) {', '.join(map(str, missing[:8]))}"
            f"{' and more' if len(missing) > 8 else ''}{gone}")
