"""Recovery of a running job, as one task per incident walking the transition table of recovery.py:
checkpoint (predictable failures only) -> evict -> rendezvous (a spare first) -> restart.

A mixin of JobManager: it uses the manager's store commits, commands and placement. Every step is
an event; the generation goes up by one per restart, and anything the old generation still runs or
says is fenced (stopped, ignored).
"""

from __future__ import annotations

import asyncio

from controller import recovery
from controller.errors import FailedPrecondition
from controller.placement import GangRequest, Unplaceable, place
from controller.states import DOWN
from phalanx import log
from phalanx.v1 import common_pb2 as pb

logger = log.get("recovery")

RENDEZVOUS_RETRY_S = 1.0
EVICT_MARGIN_S = 10.0  # beyond the stop grace: for agents to come back after a controller restart, and report
EVICT_POLL_S = 0.2


class RecoveryMixin:
    async def _begin_recovery(self, entry, incident: recovery.Incident) -> None:
        async with self._lock:
            job = entry.job
            # A recovery may start another from its own task: a launch refused while restarting.
            busy = entry.recovering is not None and not entry.recovering.done() and \
                entry.recovering is not asyncio.current_task()
            if job.state not in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_RESTARTING) or busy:
                return
            cfg = self.recovery_cfg
            self.incidents[incident.kind] += 1
            if entry.incident_at is None:  # a restart that fails is the same recovery going on
                entry.incident_at, entry.incident_kind = self._clock.monotonic(), incident.kind
            if job.restarts >= cfg.max_restarts:
                await self._finish(entry, pb.JOB_STATE_FAILED, f"gave up after {job.restarts} restarts: "
                                   f"{incident.reason}", incident.exit_code)
                gave_up = True
            else:
                target = pb.JOB_STATE_CHECKPOINTING if incident.predictable else pb.JOB_STATE_EVICTING
                new = self._moved(job, target, incident.reason, incident=incident.reason,
                                  incident_predictable=incident.predictable)
                del new.incident_nodes[:]
                new.incident_nodes.extend(incident.nodes)
                what = "predictable: checkpoint first" if incident.predictable else "sudden: resume from the last " \
                                                                                    "committed checkpoint"
                await self._save(entry, new, self._event(
                    "job.incident", f"{job.id} generation {job.generation}: {incident.kind}: {incident.reason} "
                    f"({what})", job.id))
                entry.recovering = asyncio.create_task(self._recover(entry, incident), name=f"recover-{job.id}")
                gave_up = False
        if gave_up:
            await self._stop_everywhere(job, job.generation)

    def resume_recoveries(self) -> None:
        """After a controller restart: carry on with every recovery the previous process left half done.
        A checkpoint in flight is abandoned (its ranks may be gone): it goes on from the eviction."""
        for entry in self._jobs.values():
            job = entry.job
            if job.state in (pb.JOB_STATE_CHECKPOINTING, pb.JOB_STATE_EVICTING, pb.JOB_STATE_RENDEZVOUS,
                             pb.JOB_STATE_RESTARTING):
                incident = recovery.Incident("resumed", False, tuple(job.incident_nodes), job.incident or
                                             "recovery resumed after a controller restart")
                logger.info("resuming a recovery", job=job.id, state=pb.JobState.Name(job.state))
                entry.recovering = asyncio.create_task(self._recover(entry, incident, resumed=True),
                                                       name=f"recover-{job.id}")

    async def _recover(self, entry, incident: recovery.Incident, resumed: bool = False) -> None:
        try:
            if resumed:
                await self._resume_steps(entry, incident)
            else:
                await self._recover_steps(entry, incident)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("recovery failed", job=entry.job.id)
            async with self._lock:
                if entry.job.state in (pb.JOB_STATE_CHECKPOINTING, pb.JOB_STATE_EVICTING, pb.JOB_STATE_RENDEZVOUS):
                    await self._finish(entry, pb.JOB_STATE_FAILED, f"recovery failed: {e}", 1)

    async def _resume_steps(self, entry, incident: recovery.Incident) -> None:
        job = entry.job
        if job.state == pb.JOB_STATE_RENDEZVOUS:
            await self._rendezvous_and_restart(entry, incident, job.generation)
            return
        if job.state != pb.JOB_STATE_EVICTING:
            async with self._lock:
                await self._save(entry, self._moved(job, pb.JOB_STATE_EVICTING, "resuming recovery after a controller "
                                                    "restart"),
                                 self._event("job.evicting", f"{job.id}: controller restarted during "
                                             f"{pb.JobState.Name(job.state).removeprefix('JOB_STATE_')}; evicting "
                                             f"again", job.id))
        await self._evict_then_restart(entry, incident, entry.job.generation)

    async def _recover_steps(self, entry, incident: recovery.Incident) -> None:
        cfg = self.recovery_cfg
        job = entry.job
        generation = job.generation
        if incident.predictable:
            try:
                step, seconds = await self._request_checkpoint(entry, cfg.checkpoint_deadline_s, incident.reason,
                                                               pause=True)
                note = f"every rank committed step {step} in {seconds:.2f}s"
            except (TimeoutError, FailedPrecondition) as e:
                note = f"checkpoint incomplete ({e}); resuming from the last committed one"
            async with self._lock:
                await self._save(entry, self._moved(entry.job, pb.JOB_STATE_EVICTING, note),
                                 self._event("job.evicting", f"{job.id}: {note}; evicting "
                                             f"{', '.join(incident.nodes) or 'nothing (restart in place)'}", job.id))
        await self._evict_then_restart(entry, incident, generation)

    async def _evict_then_restart(self, entry, incident: recovery.Incident, generation: int) -> None:
        job = entry.job
        await self._evict(entry, incident, generation)
        async with self._lock:
            await self._save(entry, self._moved(entry.job, pb.JOB_STATE_RENDEZVOUS, "choosing the next generation's "
                                                "nodes"),
                             self._event("job.rendezvous", f"{job.id}: generation {generation} stopped; choosing "
                                         "nodes for the next", job.id))
        await self._rendezvous_and_restart(entry, incident, generation)

    async def _rendezvous_and_restart(self, entry, incident: recovery.Incident, generation: int) -> None:
        cfg = self.recovery_cfg
        job = entry.job
        nodes, spares, how = await self._next_nodes(entry, incident)
        delay = recovery.backoff(entry.job.restarts, cfg)
        await asyncio.sleep(delay)
        async with self._lock:
            if entry.job.state != pb.JOB_STATE_RENDEZVOUS:
                return
            new = self._moved(entry.job, pb.JOB_STATE_RESTARTING, f"restarting on {', '.join(nodes)}",
                              generation=generation + 1, restarts=entry.job.restarts + 1)
            del new.nodes[:]
            new.nodes.extend(nodes)
            del new.spares[:]
            new.spares.extend(spares)
            new.evicted.extend(n for n in incident.nodes if n not in new.evicted)
            del new.ranks[:]
            new.ranks.extend(self._rank_table(new))
            await self._save(entry, new, self._event(
                "job.restarting", f"{job.id} generation {generation + 1} on {', '.join(nodes)} ({how}; restart "
                f"{new.restarts} of at most {cfg.max_restarts}, after {delay:g}s)", job.id))
            self.restarts_by_cause[entry.incident_kind or incident.kind] += 1
            entry.missing.clear()
            entry.tracks = {}
        await self._launch(entry, generation + 1)

    async def _evict(self, entry, incident: recovery.Incident, generation: int) -> None:
        """Stop the generation's ranks, drain the bad nodes, and wait until each of the job's nodes has said,
        in a heartbeat after the stop, that none of the generation's ranks runs there any more. A node that
        is DOWN is not waited for (its ranks are fenced if it returns); a node whose agent is not connected
        (after a controller restart, the agents come back one by one) is told as soon as it is."""
        job = entry.job
        for node in incident.nodes:
            try:
                record = self._registry.get(node).record
                if not record.drain_reason:
                    await self._registry.drain(node, f"evicted from {job.id}: {incident.reason}")
            except Exception as e:  # a node that vanished meanwhile needs no drain
                logger.warning("could not drain an evicted node", node=node, error=str(e))
        deadline = self._clock.monotonic() + self.cfg.stop_grace_s + EVICT_MARGIN_S
        told: dict[str, tuple[object, int]] = {}  # node -> the session that took the stop, its heartbeats by then
        while True:
            nodes = self._registry.entries_by_name()
            untold = [nodes[n] for n in job.nodes if n in nodes and nodes[n].record.state is not DOWN
                      and nodes[n].session is not None and told.get(n, (None, 0))[0] is not nodes[n].session]
            for node, stopped in zip(untold, await asyncio.gather(*(self._stop_node(n, job.id, generation)
                                                                    for n in untold)), strict=True):
                if stopped:
                    told[node.record.name] = (node.session, node.heartbeats)
            waiting = [n for n in job.nodes if n in nodes and nodes[n].record.state is not DOWN
                       and not self._stopped_on(nodes[n], told.get(n), job.id, generation)]
            if not waiting:
                return
            if self._clock.monotonic() >= deadline:
                logger.warning("ranks not known to be stopped; they will be fenced", job=job.id,
                               generation=generation, nodes=",".join(waiting))
                return
            await asyncio.sleep(EVICT_POLL_S)

    @staticmethod
    def _stopped_on(node, told: tuple[object, int] | None, job: str, generation: int) -> bool:
        """The node's agent took the stop on its current session and has since reported no rank of the
        generation running."""
        if told is None or told[0] is not node.session or node.heartbeats <= told[1] or node.heartbeat is None:
            return False
        return not any(s.job == job and s.generation == generation and s.state == pb.RANK_STATE_RUNNING
                       for s in node.heartbeat.ranks)

    async def _next_nodes(self, entry, incident: recovery.Incident) -> tuple[list[str], list[str], str]:
        """The next generation's nodes: the good ones kept in rank order, bad ones replaced by the job's
        spares; failing that, a fresh placement; failing that, wait (the reason says for what)."""
        while True:
            job = entry.job
            candidates = {c.name: c for c in self._candidates(exclude=job.id)}
            usable = {n for n, c in candidates.items() if c.schedulable and c.free and
                      c.gpus >= job.spec.ranks_per_node and n not in incident.nodes}
            keep = [n for n in job.nodes if n in usable]
            spares = [n for n in job.spares if n in usable and n not in keep]
            missing = len(job.nodes) - len(keep)
            if missing <= len(spares):
                replacement = iter(spares[:missing])
                nodes = [n if n in usable else next(replacement) for n in job.nodes]
                used = set(nodes)
                how = "same nodes" if not missing else f"spares {', '.join(n for n in nodes if n not in job.nodes)}"
                return nodes, [s for s in job.spares if s not in used and s in usable], how
            request = GangRequest(nodes=job.spec.nodes, ranks_per_node=job.spec.ranks_per_node,
                                  spares=0, segment=job.spec.segment or None)
            decision = place([c for n, c in candidates.items() if n not in incident.nodes], request,
                             self._topology())
            if not isinstance(decision, Unplaceable):
                return list(decision.nodes), [], "a new placement (no spare left in the domain)"
            async with self._lock:
                reason = f"waiting for nodes: {decision.reason}"
                if entry.job.reason != reason:
                    await self._save(entry, self._copy(entry.job, reason=reason),
                                     self._event("job.waiting", f"{job.id}: {reason}", job.id))
            await asyncio.sleep(RENDEZVOUS_RETRY_S)
