"""Which in-memory snapshot a new generation restores from: a pure function of what the nodes hold.

Agents report, in each heartbeat, the complete snapshots they hold: their own ranks', and replicas of a
peer node's. A new generation restores from the newest step of the generation just ended for which
every rank's snapshot survives on a node that is up: on the node the rank now runs on when it is there
(a restart in place), else on whichever node holds it. Snapshots of any other generation are never
used: ranks restored from different generations would not have trained the same model. When no step
is complete, trainlib falls back to the newest durable checkpoint, and the reason goes to the event log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from phalanx.v1 import node_pb2


@dataclass(frozen=True)
class Restore:
    generation: int  # the generation that took the snapshots
    step: int
    sources: dict[int, str]  # rank -> the node to fetch its snapshot from


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
    """(the restore, "") or (None, why there is none). `held`: node -> what it reported; `up`: the nodes a
    snapshot can be fetched from; `placement`: rank -> the node the new generation runs it on."""
    where: dict[int, dict[int, set[str]]] = {}  # step -> rank -> nodes holding it
    lost: set[str] = set()
    for node, snapshots in held.items():
        for s in snapshots:
            if s.job != job or s.generation != generation:
                continue
            if node not in up:
                lost.add(node)
                continue
            where.setdefault(s.step, {}).setdefault(s.rank, set()).add(node)
    complete = [step for step, ranks in where.items() if len(ranks) == world]
    if complete:
        step = max(complete)
        sources = {rank: placement[rank] if placement.get(rank) in nodes else min(nodes)
                   for rank, nodes in where[step].items()}
        return Restore(generation, step, sources), ""
    gone = f" (held on {', '.join(sorted(lost))}, which cannot be reached)" if lost else ""
    if not where:
        return None, f"generation {generation} left no in-memory snapshot on a node that is up{gone}"
    step = max(where)
    missing = sorted(set(range(world)) - set(where[step]))
    return None, (f"no step of generation {generation} has every rank's in-memory snapshot on a node that is up: "
                  f"the newest, step {step}, lacks rank(s) {', '.join(map(str, missing[:8]))}"
                  f"{' and more' if len(missing) > 8 else ''}{gone}")
