"""In-memory snapshots of a rank's training state, and restoring from them.

`trainlib.snapshot(state, step)` copies the state into host memory on the training thread (the only
time it blocks training), then a writer thread serializes the copy into the node agent's snapshot
directory (tmpfs: memory that outlives this process) and hands it to the agent, which replicates it to
a peer node. The copy goes into host buffers kept from one snapshot to the next (checkpoint.Staging):
pinned memory and an asynchronous device-to-host copy for GPU tensors, which the training thread only
queues and the writer waits for. There are two sets of them (double-buffered), the second made only when
a copy is due while the writer still works on the first: a step's copy never waits for the previous
snapshot's write. A copy is taken at the steps that are multiples of `interval`: every step when snapshots
cost the job at most OVERHEAD_BUDGET of its step time, else the smallest power of two that keeps it there. The
cost is measured as training runs, as the job's own slowdown with the background work (see PROBE_PERIOD);
before the first measurement, the copy's time on the training thread sets the interval
(PHALANX_SNAPSHOT_EVERY=N fixes it; 0 turns snapshots off). Multiples of powers of two
line the ranks up: each tunes its own interval, and a restore needs a step every rank has; ranks that
chose 4 and 8 both have every multiple of 8. While the writer is busy with both buffers (one being
written, one queued), a due snapshot is skipped rather than waited for.

On a restart the controller names, in PHALANX_RESTORE, the newest step of the last generation for
which every rank's snapshot survives (an earlier generation's if the last one left no whole step), and
the nodes that hold each rank's, to be tried in turn. `trainlib.load_latest()` fetches this rank's
(checked against its CRC-32 on the way) and the ranks agree, in one collective, that every one of them
has its snapshot; otherwise all of them load the newest durable checkpoint instead, so the ranks never
resume from different steps.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

OVERHEAD_BUDGET = 0.03  # share of the job's step time its snapshots may cost (the copy, and the work behind it)
# What snapshots cost the job is measured, not assumed from the copy: once in every PROBE_PERIOD steps, the last
# PROBE_STEPS of them take no snapshot, on every rank (the same step numbers: the ranks' collectives make one rank's
# work every rank's cost), and the job's step time then is set against its step time the rest of the period,
# background work included (the writer's serialization, the agent's replication). The first PROBE_SETTLE steps
# of a probe are left out: the last snapshot's write may still be under way. A failure inside a probe recomputes
# up to PROBE_STEPS more steps.
PROBE_PERIOD = 512
PROBE_STEPS = 16
PROBE_SETTLE = 4
CAP = 4.0  # a step time counts as at most this many times the median of its side (a GC pause, a slow batch)
MAX_INTERVAL = 1 << 12
# The copy's and the step's times are the medians of their last SAMPLES: one copy stalled by a busy machine (100 ms
# against a 0.4 ms habit) used to move a moving average far enough to take a snapshot only every 16 steps, and
# as the average decayed only when a snapshot was taken, it stayed there for seconds: a failure then lost up to
# 15 steps. A copy slow in most of the recent ones still widens the interval.
SAMPLES = 9
BUFFERS = 2  # sets of host buffers a rank's copies go into: one being written out, one taking the next copy
SETTLE = 5  # snapshots before the interval is said (the first steps carry start-up, not the step's own time)


class Snapshotter:
    """One rank's snapshots. `tell(request)` sends a SnapshotTakenRequest to the agent and returns its reply."""

    def __init__(self, directory: Path, job: str, generation: int, rank: int, tell: Any,
                 every: int | None = None) -> None:
        self.directory = directory / job / f"g{generation}" / f"r{rank}"
        self.job, self.generation, self.rank = job, generation, rank
        self._tell = tell
        self.fixed = every  # None: tuned to OVERHEAD_BUDGET as training runs
        self.interval = every or 1
        self.copy_s = 0.0  # median of the recent copies into host memory
        self.step_s = 0.0  # median of the recent steps' own times (without a copy of ours in them)
        self._copies: deque[float] = deque(maxlen=SAMPLES)
        self._steps: deque[float] = deque(maxlen=SAMPLES)
        self._grown = -1  # the copy count when the interval last grew
        self._last_copy_s = 0.0
        self.taken = self.skipped = self.failed = 0
        self.disabled = "" if every != 0 else "PHALANX_SNAPSHOT_EVERY=0"
        self._last = -1
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainlib-snapshot")
        self._stagings: list[Any] = []  # checkpoint.Staging: at most two, the second made when first needed
        self._device_s = 0.0  # the last GPU copy's time on the device (the writer measures it)
        self._writes: list[Future | None] = []  # per staging, its write in flight (or done)
        self._said = 0  # the interval last printed
        self._made_dir = False  # the writer makes the directory once
        self.cost: float | None = None  # what snapshots cost the job's step time, as measured at the last probe
        self._floor = 1  # the interval the last probe asked for (the copy's own time may ask for more)
        self._with: list[float] = []  # step times this period, outside the probe
        self._without: list[float] = []  # step times in this period's probe, past its settling steps

    def offer(self, state: Any, step: int, step_s: float) -> bool:
        """Snapshot `state` (a state tree, or a function returning one: called only when a snapshot is due) as of
        `step` if one is due and the writer is free; True if a copy was taken. `step_s`: the step's time, which
        takes in the copy made after the previous step, if one was."""
        own = step_s - (self._last_copy_s if self._last == step - 1 else 0.0)
        if own > 0:
            self._steps.append(own)
            self.step_s = statistics.median(self._steps)
            self._tune()
        if self._probe(step, step_s) or self.disabled or step % self.interval:
            return False
        from trainlib.checkpoint import Staging, snapshot_to_cpu

        free = next((i for i, w in enumerate(self._writes) if w is None or w.done()), None)
        if free is None and len(self._stagings) < BUFFERS:
            self._stagings.append(Staging())
            self._writes.append(None)
            free = len(self._stagings) - 1
        if free is None:
            self.skipped += 1
            return False
        staging = self._stagings[free]
        started = time.perf_counter()
        tree = state() if callable(state) else state  # the script's own errors are its own
        try:
            staging.begin()
            copy = snapshot_to_cpu(tree, staging=staging)
            staging.end()
        except Exception as e:  # e.g. no pinned memory left for the buffers: training goes on without this one
            if not self.failed:
                print(f"trainlib: in-memory snapshot of step {step} not taken: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
            self.failed += 1
            return False
        # A GPU's copy runs on the device after this returns and delays the next step instead: count the last
        # one measured, so the interval keeps the copies within the budget.
        copy_s = time.perf_counter() - started + self._device_s
        self._copies.append(copy_s)
        self.copy_s = statistics.median(self._copies)
        self._last, self.taken, self._last_copy_s = step, self.taken + 1, copy_s
        self._tune()
        self._writes[free] = self._writer.submit(self._write, copy, step, staging)
        return True

    def commit(self, state: Any, step: int) -> bool:
        """The snapshot of `step`, whatever the interval, written on this thread beside any write of an earlier step
        the writer thread is still busy with: True once the agent keeps it (an eviction's checkpoint). The training
        thread waits for it, so host memory is written from where it is, with no copy into host buffers first; GPU
        memory is copied to the host, so that a restore finds what the other snapshots hold."""
        if self.disabled:
            return False
        from trainlib.checkpoint import snapshot_to_cpu

        kept = self._write(snapshot_to_cpu(state() if callable(state) else state, staging=_HostAsIs()), step, None)
        if kept:
            self._last, self.taken = step, self.taken + 1
        return kept

    def wait(self) -> None:
        """Wait for the snapshot being written, if any (tests, and a clean exit)."""
        for write in self._writes:
            if write is not None:
                write.result()

    def _probe(self, step: int, step_s: float) -> bool:
        """Count `step`'s time toward this period's measurement; True while the period's probe takes no snapshot."""
        if self.fixed is not None or self.disabled or step_s <= 0:
            return False
        phase = step % PROBE_PERIOD
        if phase < PROBE_PERIOD - PROBE_STEPS:
            self._with.append(step_s)
            return False
        if phase >= PROBE_PERIOD - PROBE_STEPS + PROBE_SETTLE and all(w is None or w.done() for w in self._writes):
            self._without.append(step_s)
        if phase == PROBE_PERIOD - 1:
            self._judge()
        return True

    def _judge(self) -> None:
        """The end of a probe: what snapshots cost the job this period, and the interval that keeps it in budget."""
        with_s, without_s = capped_mean(self._with), capped_mean(self._without)
        self._with, self._without = [], []
        if not with_s or not without_s or not self.taken:
            return
        self.cost = max(0.0, with_s / without_s - 1)
        before = self.interval
        if self.cost > OVERHEAD_BUDGET:  # the cost falls about as the interval grows
            self._floor = min(MAX_INTERVAL, self.interval << max(1, math.ceil(math.log2(self.cost / OVERHEAD_BUDGET))))
        elif self.cost < OVERHEAD_BUDGET / 4 and self._floor > 1:
            self._floor //= 2
        self._grown = -1  # the probe's word is taken at once
        self._tune()
        print(f"trainlib: in-memory snapshots every {before} step(s) cost the job {self.cost:.1%} of its step time "
              f"({with_s * 1e3:.1f} ms a step with them, {without_s * 1e3:.1f} ms without, background work included; "
              f"budget {OVERHEAD_BUDGET:.0%})" + _change(before, self.interval, max(self.interval, self._floor)),
              file=sys.stderr, flush=True)

    def _tune(self) -> None:
        if self.fixed is not None or self.step_s <= 0:
            return
        needed = self.copy_s / (OVERHEAD_BUDGET * self.step_s)
        wanted = max(self._floor, 1 << max(0, math.ceil(math.log2(needed))) if needed > 1 else 1)
        if wanted > self.interval:  # at most twice as far apart per copy taken: a slow first copy (a new process,
            if self._grown == self.taken:  # its median a sample or two) cannot set it to hundreds of steps
                wanted = self.interval
            else:
                wanted, self._grown = min(wanted, 2 * self.interval), self.taken
        self.interval = wanted
        if self.taken >= SETTLE and (self._said == 0 or not 0.5 <= self.interval / self._said <= 2):
            self._said = self.interval
            print(f"trainlib: in-memory snapshots every {self.interval} step(s): the copy on the training thread "
                  f"takes {self.copy_s * 1e3:.2f} ms of a {self.step_s * 1e3:.1f} ms step; what they cost the job, "
                  f"background work included, is measured every {PROBE_PERIOD} steps (budget "
                  f"{OVERHEAD_BUDGET:.0%})", file=sys.stderr, flush=True)

    @property
    def host_bytes(self) -> int:
        """Host memory this rank keeps for its copies (both buffers)."""
        return sum(s.nbytes for s in self._stagings)

    def _write(self, copy: dict[str, Any], step: int, staging: Any) -> bool:
        """Write the copy of `step` out and hand it to the agent: True if the agent keeps it."""
        from phalanx.v1 import local_pb2
        from trainlib._atomic import make_dirs_durable, write_atomic
        from trainlib.checkpoint import _torch_save

        path = self.directory / f"s{step}.pt"
        try:
            if staging is not None:
                self._device_s = staging.ready()  # a GPU's copy into pinned memory has landed
            if not self._made_dir:
                make_dirs_durable(self.directory)
                self._made_dir = True
            digest = write_atomic(path, lambda w: _torch_save(copy, w))
            reply = self._tell(local_pb2.SnapshotTakenRequest(
                job=self.job, generation=self.generation, rank=self.rank, step=step, path=str(path),
                size=digest.size, crc32=int(digest.value, 16)))
        except Exception as e:  # a full tmpfs, the agent restarting: this one is lost, the next may do
            path.unlink(missing_ok=True)  # nobody holds it: its memory goes back
            if not self.failed:
                print(f"trainlib: in-memory snapshot of step {step} not kept: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
            self.failed += 1
            return False
        if reply.error:  # the agent refused it (over the node's budget): it would refuse the next ones too
            self.disabled = reply.error
            print(f"trainlib: in-memory snapshots off for this rank: {reply.error}", file=sys.stderr, flush=True)
            return False
        return True


def capped_mean(values: list[float]) -> float:
    """The mean of the values, each counted as at most CAP x their median (0.0 for none): a snapshot every N steps
    costs the job in one step of N, which a median or a trimmed mean would not see; a GC pause of seconds among
    hundreds of steps counts no more than a slow step."""
    if not values:
        return 0.0
    cap = CAP * statistics.median(values)
    return sum(min(v, cap) for v in values) / len(values)


class _HostAsIs:
    """For snapshot_to_cpu: host memory as it is (the training thread waits while it is written), GPU memory copied
    to the host."""

    @staticmethod
    def take(storage: Any) -> Any:
        return storage if storage.device.type == "cpu" else storage.cpu()


def parse_restore(spec: str) -> tuple[int, int, str]:
    """PHALANX_RESTORE "generation:step:NODE@HOST:PORT[,NODE@HOST:PORT...]" as (generation, step, sources: the
    agent tries them in turn)."""
    generation, step, source = spec.split(":", 2)
    return int(generation), int(step), source


def restore(ctx: Any, checkpointer: Any, agent: Any, map_location: Any, agree: Any, tell: Any) -> Any:
    """This rank's state from the in-memory snapshot PHALANX_RESTORE names, as a checkpoint.Loaded; None when the
    durable checkpoint is to be loaded instead. `agree(ok)` is True only if every rank's `ok` is; None when the
    ranks cannot agree (several ranks, no process group yet): then none restores a snapshot."""
    from phalanx.v1 import local_pb2
    from trainlib.checkpoint import Loaded

    spec = os.environ.get("PHALANX_RESTORE", "")
    if not spec:
        return None
    if agree is None:
        why = ("an in-memory snapshot is restored only when torch.distributed is initialized before load_latest() "
               "(the ranks must agree on it)")
        print(f"trainlib: {why}; loading the newest durable checkpoint", file=sys.stderr, flush=True)
        if ctx.rank == 0:
            tell("snapshot_fallback", f"{ctx.job} generation {ctx.generation}: {why}; every rank loads the newest "
                                      "durable checkpoint instead")
        return None
    state, why = None, ""
    try:
        generation, step, source = parse_restore(spec)
    except ValueError:
        generation, step, source = 0, 0, ""
        why = f"PHALANX_RESTORE={spec!r} is not generation:step:NODE@HOST:PORT[,...]"
    disk = checkpointer.latest_step() if not why else None
    newer_disk = disk is not None and disk >= step  # the same on every rank (a shared directory): rank 0 says it
    reply = None
    if newer_disk:
        why = f"the durable checkpoint of step {disk} is as new"
    elif not why:
        try:
            reply = agent.FetchSnapshot(local_pb2.FetchSnapshotRequest(
                job=ctx.job, generation=generation, rank=ctx.rank, step=step, source=source), timeout=300)
            why = reply.error
        except Exception as e:  # the agent gone: this rank votes no, and no rank is left waiting in the vote
            why = f"the agent could not be asked for it: {e}"
        if not why:
            import torch
            try:
                state = torch.load(reply.path, map_location=map_location, weights_only=True)
            except Exception as e:
                why = f"{reply.path} does not load: {e}"
    if not agree(state is not None):
        if why:
            print(f"trainlib: rank {ctx.rank} does not restore its in-memory snapshot of step {step}: {why}",
                  file=sys.stderr, flush=True)
        if why and (ctx.rank == 0 or not newer_disk):
            tell("snapshot_fallback", f"{ctx.job} generation {ctx.generation}: rank {ctx.rank} does not restore from "
                                      f"the in-memory snapshot of step {step}: {why}; every rank loads the newest "
                                      "durable checkpoint instead")
        return None
    _keep_as_own(ctx, Path(reply.path), step, reply.crc32, agent)
    print(f"trainlib: rank {ctx.rank} restored its in-memory snapshot of step {step} (generation {generation})",
          file=sys.stderr, flush=True)
    if ctx.rank == 0:
        tell("snapshot_restored", f"{ctx.job} generation {ctx.generation}: every rank restored its in-memory "
                                  f"snapshot of step {step} (generation {generation})")
    return Loaded(step, state, generation)


def _keep_as_own(ctx: Any, path: Path, step: int, crc32: int, agent: Any) -> None:
    """The restored snapshot is this generation's first one too (a link, not a copy): should it fail before
    its first snapshot, the next one restores from here rather than from disk."""
    from phalanx.v1 import local_pb2

    directory = Path(os.environ.get("PHALANX_SNAPSHOT_DIR", "")) / ctx.job / f"g{ctx.generation}" / f"r{ctx.rank}"
    target = directory / f"s{step}.pt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.link(path, target)
        agent.SnapshotTaken(local_pb2.SnapshotTakenRequest(job=ctx.job, generation=ctx.generation, rank=ctx.rank,
                                                           step=step, path=str(target), size=target.stat().st_size,
                                                           crc32=crc32), timeout=30)
    except Exception as e:  # only a lost head start: the first snapshot taken from here on will do
        print(f"trainlib: could not keep the restored snapshot for this generation: {e}", file=sys.stderr, flush=True)


def _change(before: int, now: int, target: int) -> str:
    """What a probe's verdict changes, said as it happens: the interval at most doubles per snapshot taken."""
    if target == before:
        return ""
    if now == target:
        return f": every {target} step(s) from now on"
    return f": every {now} step(s) now, {target} within a few snapshots (the interval at most doubles per snapshot)"
