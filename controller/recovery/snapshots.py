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

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field

from phalanx.v1 import node_pb2


@dataclass(frozen=True)
class Restore:
    generation: int  # the generation that took the snapshots
    step: int
    sources: dict[int, str]  # rank -> the node to fetch its snapshot from
    also: dict[int, tuple[str, ...]] = field(default_factory=dict)  # rank -> the other nodes that hold it, to try next


Key = tuple[int, int, int]  # a snapshot a node holds: (generation, step, rank), of the job it is kept for


def by_job(snapshots: Iterable[node_pb2.SnapshotHeld]) -> dict[str, set[Key]]:
    """A node's report, per job: one pass over what it holds (each heartbeat: 64 snapshots from a node of 8 ranks)."""
    jobs: dict[str, set[Key]] = {}
    for s in snapshots:
        jobs.setdefault(s.job, set()).add((s.generation, s.step, s.rank))
    return jobs


class Held(MutableMapping[str, set[Key]]):
    """node -> the in-memory snapshots of one job it holds, from its newest heartbeat, with a tally kept as each node
    reports: per (generation, step), how many ranks are held at all and how many on two nodes or more.
    `safe(generation, world)`, the step the agents pin, then needs no pass over every node's snapshots: at 16,384
    nodes x 8 ranks (each node holding 4 steps of its own ranks and of a peer's) a million of them, once a heartbeat
    interval. A node's report costs its own snapshots: the few that came or went since its last."""

    def __init__(self) -> None:
        self._keys: dict[str, set[Key]] = {}  # node -> what it holds
        self._holders: dict[Key, int] = {}  # how many nodes hold each
        # (generation, step) -> [ranks held, ranks held twice or more, the sum of the ranks held]: `world` distinct
        # ranks whose sum is world * (world - 1) / 2 are ranks 0 to world - 1 (a rank a node made up, one past the
        # job's world, does not stand in for one missing)
        self._steps: dict[tuple[int, int], list[int]] = {}

    def __getitem__(self, node: str) -> set[Key]:
        return self._keys[node]

    def __setitem__(self, node: str, keys: set[Key]) -> None:
        """What `node` holds now: `keys`, kept (not copied), as by_job made them."""
        old = self._keys.get(node)
        if keys == old:  # most heartbeats: nothing came or went since the node's last
            return
        old = old or set()
        for key in old - keys:
            self._drop(key)
        for key in keys - old:
            self._add(key)
        self._keys[node] = keys

    def __delitem__(self, node: str) -> None:
        for key in self._keys.pop(node):
            self._drop(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def _add(self, key: Key) -> None:
        n = self._holders[key] = self._holders.get(key, 0) + 1
        if n <= 2:  # the rank is now held (n = 1), or held twice (n = 2), at this step
            tally = self._steps.setdefault(key[:2], [0, 0, 0])
            tally[n - 1] += 1
            if n == 1:
                tally[2] += key[2]

    def _drop(self, key: Key) -> None:
        n = self._holders[key] - 1
        if n:
            self._holders[key] = n
        else:
            del self._holders[key]
        if n < 2:  # the rank is held once no more (n = 1), or no longer at all (n = 0), at this step
            tally = self._steps[key[:2]]
            tally[n] -= 1
            if not n:
                tally[2] -= key[2]
            if not tally[0]:
                del self._steps[key[:2]]

    def safe(self, generation: int, world: int) -> int | None:
        """The newest step of `generation` whose every rank of `world` is held on two nodes or more (its own and a
        replica), so that no one lost node can take it away; None if there is none. Agents keep it (a pin) however
        far their ranks move on: after a node is lost, the survivors' newest steps are seconds past the lost ranks'
        last replicas, and without the pin no step would be whole. Reads the tally: a few steps per generation."""
        whole = world * (world - 1) // 2
        return max((step for (g, step), (held, twice, ranks) in self._steps.items()
                    if g == generation and held == world and twice == world and ranks == whole), default=None)


def plan(held: Mapping[str, Iterable[Key]], generation: int, world: int, up: set[str],
         placement: Mapping[int, str]) -> tuple[Restore | None, str]:
    """(the restore, why not from `generation`: "" when it is) or (None, why there is none). `generation`: the one
    just ended (an earlier one only if it left no whole step); `held`: node -> what it reported of the job (Held);
    `up`: the nodes a snapshot can be fetched from; `placement`: rank -> the node the new generation runs it on."""
    by_generation: dict[int, dict[int, dict[int, set[str]]]] = {}  # generation -> step -> rank -> nodes holding it
    lost: set[str] = set()
    for node, keys in held.items():
        for g, step, rank in keys:
            if g > generation or rank >= world:  # (a rank past the job's world: made up, and no stand-in for one)
                continue
            if node not in up:
                if g == generation:
                    lost.add(node)
                continue
            by_generation.setdefault(g, {}).setdefault(step, {}).setdefault(rank, set()).add(node)
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
