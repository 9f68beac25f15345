"""Hang and straggler detection: pure functions of a job's rank progress, its history and `now`.

Progress comes from trainlib in each rank (step number, step time and the compute time before the
gradient synchronisation), folded per heartbeat by the agents.

- Hung rank: its step number has not moved for max(hang_min_s, hang_factor x the job's typical step
  time: the 90th percentile of its recent reports, so spikes it has shown before do not alarm);
  during a generation's first WARMUP_STEPS steps `startup_s` applies instead. While any rank of the
  job is writing a checkpoint (trainlib says so) no rank is hung: the others wait for it in the next
  collective. A save that outlasts `checkpoint_deadline_s` no longer shields them. A rank whose trainlib
  is silent moves, as far as hangs go, when a peer finishes a step past its last report (`vouching`).
- Straggler: a rank found by either of two tests over the last `straggler_window` steps of per-step
  compute time (medians and trimmed means, so healthy noise - a GC pause, a slow batch, jitter - never
  raises an alarm on its own):
  - slow every step: its compute stays >= `straggler_ratio` x the median of the other ranks' in most
    of the window (`straggler_share`), by at least `straggler_min_delta_s` a step;
  - costly: what its compute costs the job - its pace less the others', weighed against the job's own
    step time - is >= `straggler_cost` in every third of a full window. This finds a rank that is slow
    in bursts (the median of its steps looks healthy) and a rank of a job whose steps are too short for
    the ratio test's floor. Each third drops its slowest step and the rank is judged by its best third,
    so a burst no longer than a third of the window, or one outlier per third, does not count.
  The reference is the job itself: the others' pace over the same window, and the job's step time for
  what a lag costs. Not the rank's own earlier compute: a GPU slow from the start has no fast past.
  Evictions do not cascade because lifecycle.straggler_hold acts on another verdict only when the last
  eviction made the job faster, and bounds the evictions per job and hour.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from controller.config import RecoveryConfig

WARMUP_STEPS = 10  # a generation's first steps say nothing about a rank's speed
PACE_REPORTS = 5  # reports a rank's current pace is judged from
PARTS = 3  # a costly straggler must show in each of this many parts of the window: not one burst, however long
# The ratio verdict's bar on the rank's lag, as a share of straggler_cost. A median over 30 steps with 5% noise
# puts a rank that costs the job exactly straggler_cost within about a tenth of that either way, so 0.65 finds it
# (50 of 50 seeded trials in tests/test_monitors.py) and not a rank 1.06x slower in most steps, costing 6%
# (a healthy rank on a host busy with other processes, as a full test run saw: 0 of 20 there).
RATIO_COST_SHARE = 0.65


@dataclass
class RankTrack:
    """What the controller remembers of one rank's progress (mutated as reports arrive)."""

    last_step: int = -1
    last_advance: float = 0.0  # monotonic time the step number last moved (or the rank started)
    last_report: float = 0.0  # monotonic time trainlib in the rank last reported (steps or not)
    last_step_at: float = 0.0  # when the rank finished last_step, by its own clock (never later than the report)
    step_s: deque[float] = field(default_factory=lambda: deque(maxlen=64))  # per report: mean step time
    first_step_s: float = 0.0  # the first report's mean: it carries the rank's start-up (imports, rendezvous, load)
    compute_s: deque[float] = field(default_factory=lambda: deque(maxlen=256))  # per step, after the warm-up
    samples_seen: int = 0
    fastest_s: float = 0.0  # the fastest mean step time of any report past the first (this generation)
    steps_seen: int = 0  # steps reported this generation
    saving: bool = False  # the newest report says the rank is writing a checkpoint
    saving_since: float = 0.0
    saved_at: float = 0.0  # when its last save ended: the other ranks waited for it in the next collective
    finished: bool = False  # the newest report says training has ended in the rank (no step since)

    def observe(self, last_step: int, mean_step_s: float, compute_samples: list[float], now: float,
                steps: int = 1, saving: bool = False, step_at: float = 0.0, finished: bool = False) -> None:
        self.last_report = now
        self.finished = finished
        if saving and not self.saving:
            self.saving_since = now
        elif self.saving and not saving:
            self.last_advance = max(self.last_advance, now)  # the save's time was no hang
            self.saved_at = now
        self.saving = saving
        self.steps_seen += steps
        if steps and last_step > self.last_step:
            self.last_step, self.last_advance = last_step, now
            self.last_step_at = min(step_at, now) if step_at > 0 else now
        if mean_step_s > 0:
            if not self.first_step_s and not self.step_s:
                self.first_step_s = mean_step_s
            else:
                self.step_s.append(mean_step_s)
                self.fastest_s = min(self.fastest_s or mean_step_s, mean_step_s)
        skip = max(0, WARMUP_STEPS - self.samples_seen)  # first steps: imports, allocator, connection set-up
        self.samples_seen += len(compute_samples)
        self.compute_s.extend(compute_samples[skip:])

    def step_times(self) -> list[float]:
        """Mean step times, one per report; the start-up report only while there is no other."""
        return list(self.step_s) or ([self.first_step_s] if self.first_step_s else [])

    def recent_pace(self, reports: int = PACE_REPORTS) -> float:
        """The fastest of the last few reports' mean step times (0.0 before any): how fast the rank can go
        now. A report that took in a checkpoint save, or start-up contention, runs slow; none runs fast."""
        return min(list(self.step_s)[-reports:], default=0.0)


@dataclass(frozen=True)
class Finding:
    rank: int
    kind: str  # "hang" or "straggler"
    reason: str


def typical_step_s(tracks: dict[int, RankTrack]) -> float:
    """The 90th percentile of the ranks' recent step times (0.0 before any)."""
    steps = sorted(s for t in tracks.values() for s in t.step_times())
    return steps[min(len(steps) - 1, int(0.9 * len(steps)))] if steps else 0.0


def hung(tracks: dict[int, RankTrack], now: float, cfg: RecoveryConfig, since: float = 0.0) -> list[Finding]:
    """The ranks that made no progress for the hang limit; none counted from before `since` (when the ranks' quorum
    last changed: a replica group left or joined, and the others' next step waited for it)."""
    if any(t.saving and now - t.saving_since < cfg.checkpoint_deadline_s for t in tracks.values()):
        return []  # a rank is writing a checkpoint; the others wait for it in the next collective
    typical = typical_step_s(tracks)
    limit = max(cfg.hang_min_s, cfg.hang_factor * typical)
    saved = max((t.saved_at for t in tracks.values()), default=0.0)  # the ranks that waited for a save: no hang
    vouched = vouching(tracks, now, cfg.silent_s)
    out = []
    for rank, track in sorted(tracks.items()):
        silent = now - max(track.last_advance, saved, vouched(track), since)
        if track.last_step < 0 or track.steps_seen < WARMUP_STEPS:
            if silent >= max(cfg.startup_s, limit):
                what = "finished a step" if track.last_step < 0 else f"made progress (step {track.last_step}, in " \
                                                                       "its first steps)"
                out.append(Finding(rank, "hang", f"rank {rank} has not {what} for {silent:.0f}s (limit "
                                                 f"{max(cfg.startup_s, limit):g}s)"))
        elif silent >= limit:
            out.append(Finding(rank, "hang", f"rank {rank} made no progress for {silent:.1f}s (limit {limit:.1f}s "
                                             f"= max({cfg.hang_min_s:g}s, {cfg.hang_factor:g} x typical step "
                                             f"{typical:.2f}s)); last step {track.last_step}"))
    return out


def vouching(tracks: Mapping[int, RankTrack], now: float, silent_s: float) -> Callable[[RankTrack], float]:
    """For a rank whose trainlib is silent, when a peer last finished a step past its last reported one (0.0 for a
    rank that reports, or with no such peer): its reports are late or lost, not its steps. The ranks of a
    synchronous job meet in every step's collectives, so a peer cannot finish a step the rank has not reached; a
    rank whose reports stopped (a `make test-busy` run saw 10 s of them lost while its peer trained on, and a false
    hang restarted the job) is not hung while the job moves. A rank that reports but does not move is judged on
    its own reports. The peers are sorted by step once, when a silent rank first asks (a job has 10,000s)."""
    steps: list[int] = []
    latest: list[float] = []  # latest[i]: the newest advance of the ranks from steps[i] on

    def vouched(track: RankTrack) -> float:
        if now - track.last_report < silent_s:
            return 0.0
        if not steps:
            by_step = sorted((t.last_step, t.last_advance) for t in tracks.values())
            steps.extend(step for step, _ in by_step)
            latest.extend(reversed(list(itertools.accumulate((at for _, at in reversed(by_step)), max))))
        i = bisect.bisect_right(steps, track.last_step)
        return latest[i] if i < len(latest) else 0.0

    return vouched


# A node heard this long after a rank's last report (trainlib reports every 0.5 s) was heard without one from it.
HEARD_SINCE_S = 0.6


def culprits(tracks: Mapping[int, RankTrack], heard: Mapping[int, float], now: float, silent_s: float) -> list[int]:
    """Once some rank is hung, the ranks whose trainlib stopped reporting too: in a synchronous job every rank
    stalls when one does, but only a rank that is itself stopped (or dead) falls silent. Silent means its node's
    agent (`heard`: when, per rank) was heard from `silent_s` after the rank's last report, so a late heartbeat
    does not make its ranks look silent. Every rank of the job is a candidate, not only those past the hang
    limit: progress arrives folded into each node's heartbeat, so the stopped rank's last step can reach the
    controller a heartbeat after its peers' and cross the limit later than the ranks waiting for it."""
    return [rank for rank, t in sorted(tracks.items()) if heard.get(rank, now) - t.last_report >= silent_s
            and now - t.last_advance >= silent_s]


def undecided(tracks: Mapping[int, RankTrack], heard: Mapping[int, float], now: float, silent_s: float) -> list[int]:
    """The ranks that may be falling silent: their node was heard from since their last report without a new one
    (a rank that reports has its last report when its node was last heard: reports ride on heartbeats), by more
    than trainlib's report interval, but not yet by `silent_s`. With hang_min_s no longer than silent_s (both 2 s
    by default) the peers waiting for a stopped rank cross the hang limit before its silence can show; judged
    then, with no culprit, the job would restart in place and keep the stopped rank's node. Its node's next
    heartbeats decide, within silent_s; `heard` names only the nodes heard from at a known time, and a rank
    silent for twice silent_s waits no more (its node's own silence is liveness's to judge)."""
    return [rank for rank, t in sorted(tracks.items()) if rank in heard and now - t.last_report < 2 * silent_s
            and HEARD_SINCE_S < heard[rank] - t.last_report < silent_s]


def job_step_s(tracks: Mapping[int, RankTrack], reports: int = PACE_REPORTS) -> float:
    """The job's step time now: the median of its ranks' last few reported step times (0.0 before any). In a
    synchronous job every rank takes as long as the slowest, so this is the job's throughput."""
    recent = sorted(s for t in tracks.values() for s in list(t.step_s)[-reports:])
    return recent[len(recent) // 2] if recent else 0.0


def sustained_pace(compute_s: list[float]) -> float:
    """A rank's compute per step as the job feels it, robust to noise: the mean of each third of the samples
    without its slowest step, and of those the lowest. A one-off spike or a burst up to a third of the samples
    long leaves some third (the lowest) untouched; slowness in bursts, spread through the samples, shows in
    every third's mean where a median would not see it."""
    size = len(compute_s) // PARTS
    parts = [sorted(compute_s[i * size:(i + 1) * size])[:-1] for i in range(PARTS)]
    return min(sum(part) / len(part) for part in parts)


def stragglers(tracks: Mapping[int, RankTrack], cfg: RecoveryConfig) -> list[Finding]:
    window = cfg.straggler_window
    recent = {rank: list(t.compute_s)[-window:] for rank, t in tracks.items()}
    if len(recent) < 2 or any(len(v) < cfg.straggler_min_samples for v in recent.values()):
        return []
    full = all(len(v) == window for v in recent.values())
    paces = {rank: sustained_pace(v) for rank, v in recent.items()} if full else {}
    step_s = job_step_s(tracks)
    out = []
    for rank, mine in sorted(recent.items()):
        others = [statistics.median(v) for r, v in recent.items() if r != rank]
        baseline = statistics.median(others)
        if baseline <= 0:
            continue
        ratios = [c / baseline for c in mine]
        slow = sum(r >= cfg.straggler_ratio for r in ratios)
        lag = statistics.median(mine) - baseline
        # Slow in most steps, and by enough to cost the job about straggler_cost of its step time: a rank a few
        # per cent slower than the others (a busy host's noise) costs the job little, and evicting it costs more.
        if slow >= cfg.straggler_share * len(ratios) and statistics.median(ratios) >= cfg.straggler_ratio and (
                lag >= max(cfg.straggler_min_delta_s, RATIO_COST_SHARE * cfg.straggler_cost * step_s)):
            out.append(Finding(rank, "straggler", f"rank {rank} computes {statistics.median(ratios):.2f}x slower "
                                                  f"than the others' median ({slow} of the last {len(ratios)} "
                                                  f"steps >= {cfg.straggler_ratio:g}x)"))
            continue
        if not paces or step_s <= 0:
            continue
        cost = (paces[rank] - statistics.median(p for r, p in paces.items() if r != rank)) / step_s
        if cost >= cfg.straggler_cost:
            out.append(Finding(rank, "straggler", f"rank {rank} costs the job {cost:.0%} of its step time "
                                                  f"({step_s * 1e3:.1f} ms): its compute runs over the others' in "
                                                  f"every third of the last {window} steps"))
    return out
