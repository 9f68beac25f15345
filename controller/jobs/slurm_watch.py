"""Jobs that run in a Slurm allocation (`phalanx run`) end when their allocation does.

`phalanx run` ends its Phalanx job itself when the Slurm job ends: on scancel, a time limit or preemption
it checkpoints and cancels it. But a `phalanx run` killed outright (SIGKILL, the OOM killer, a node's
batch host lost) cannot, and the ranks are the agents' children, outside the Slurm job's cgroup: they
would train on for ever on nodes Slurm has given to other jobs. So the controller asks Slurm
(`scontrol show job`, every jobs.slurm_watch_s) whether each such job's Slurm job still holds its
allocation (running, and not requeued since: Restarts unchanged), and cancels the Phalanx job, with
the reason, once it has not for jobs.slurm_orphan_s (longer than Slurm's KillWait, so a `phalanx run`
that is ending the job itself is not cut short). A Slurm that cannot be asked (no config on the
controller's host, slurmctld down) cancels nothing: it is logged once per job and asked again later.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.errors import FailedPrecondition, NotFound
from controller.recovery.table import ACTIVE, CANCELLING
from phalanx import log, slurm

if TYPE_CHECKING:
    from controller.config import JobsConfig
    from controller.jobs.manager import JobManager

logger = log.get("jobs")


class SlurmWatch:
    def __init__(self, jobs: JobManager, cfg: JobsConfig) -> None:
        self.jobs = jobs
        self.cfg = cfg
        self._ended: dict[str, float] = {}  # job id -> when its Slurm job was first seen without its allocation
        self._unaskable: set[str] = set()  # jobs whose Slurm job Slurm could not be asked about (logged once)
        self._restarts: dict[str, str] = {}  # job id -> its Slurm job's Restarts when first seen holding it

    async def tick(self) -> None:
        now = self.jobs.clock.monotonic()
        watched = {e.job.id: e.job for e in self.jobs.entries.values()
                   if e.job.spec.slurm_job_id and e.job.state in ACTIVE and e.job.state != CANCELLING}
        for gone in set(self._ended) - set(watched):
            del self._ended[gone]
        for gone in set(self._restarts) - set(watched):
            del self._restarts[gone]
        self._unaskable &= set(watched)
        for job_id, job in watched.items():
            slurm_job = job.spec.slurm_job_id
            try:
                record = await slurm.ajob_record(self.cfg.scontrol, slurm_job)
            except slurm.SlurmError as e:
                if job_id not in self._unaskable:
                    self._unaskable.add(job_id)
                    logger.warning("cannot ask Slurm whether a job's allocation is still there", job=job_id,
                                   slurm_job=slurm_job, error=str(e))
                continue
            self._unaskable.discard(job_id)
            state = record["JobState"].split()[0] if record else slurm.GONE
            restarts = record.get("Restarts", "0")
            first = self._restarts.setdefault(job_id, restarts) if record else self._restarts.get(job_id, "0")
            if state in slurm.HOLDS_ALLOCATION and first == restarts:
                self._ended.pop(job_id, None)
                continue
            if state in slurm.HOLDS_ALLOCATION:  # requeued and running again: a new allocation, a new `phalanx run`
                state = f"requeued: {state} again, restart {restarts}"
            await self._maybe_cancel(job_id, slurm_job, state, now)

    async def _maybe_cancel(self, job_id: str, slurm_job: str, state: str, now: float) -> None:
        """The Slurm job does not hold the allocation the Phalanx job runs in: cancel it once that has lasted."""
        since = self._ended.setdefault(job_id, now)
        if now - since >= self.cfg.slurm_orphan_s:
            await self._cancel(job_id, slurm_job, state)

    async def _cancel(self, job_id: str, slurm_job: str, state: str) -> None:
        why = (f"its Slurm job {slurm_job} ended ({state}) {self.cfg.slurm_orphan_s:g}s ago or more, but `phalanx "
               "run` did not end this job (killed?): its ranks must not run on nodes Slurm has given back")
        try:
            await self.jobs.cancel(job_id, why)
        except (FailedPrecondition, NotFound):  # it ended meanwhile
            return
        finally:
            self._ended.pop(job_id, None)
        logger.warning("job cancelled: its Slurm allocation is gone", job=job_id, slurm_job=slurm_job, state=state)
