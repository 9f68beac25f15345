"""Hang and straggler detection: pure functions, virtual time, seeded noise."""

import math
import random

import pytest

from controller.config import RecoveryConfig
from controller.recovery.lifecycle import REQUEST_LATENCY_S, checkpoint_step
from controller.recovery.progress import WARMUP_STEPS, RankTrack, hung, stragglers

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

CFG = RecoveryConfig()


def tracks(n=4):
    return {r: RankTrack(last_advance=0.0) for r in range(n)}


def test_a_rank_without_progress_is_hung_after_the_larger_of_the_floor_and_k_typical_steps():
    t = tracks()
    for second in range(1, 11):  # 10 s of 0.1 s steps on every rank
        for track in t.values():
            track.observe(second * 10, 0.1, [0.08] * 10, float(second))
    # rank 2 stops at t=10 (its trainlib reports on: judged on its own reports, whatever its peers report);
    # the limit is max(2 s, 3 x 0.1 s) = 2 s
    for second in range(11, 13):
        for rank, track in t.items():
            if rank != 2:
                track.observe(second * 10, 0.1, [0.08] * 10, float(second))
            else:
                track.observe(100, 0.0, [], float(second), steps=0)
    assert hung(t, 11.9, CFG) == []
    (finding,) = hung(t, 12.0, CFG)
    assert (finding.rank, finding.kind) == (2, "hang")
    assert finding.reason.startswith("rank 2 made no progress for 2.0s (limit 2.0s = max(2s, 3 x typical step 0.10s))")


def test_slow_steps_raise_the_hang_limit():
    t = tracks(2)
    for step in range(10):
        for track in t.values():
            track.observe(step, 2.0, [1.9], step * 2.0)  # 2 s steps: limit = 3 x 2 s = 6 s after the last
    assert hung(t, 18.0 + 5.9, CFG) == []
    assert [f.rank for f in hung(t, 18.0 + 6.0, CFG)] == [0, 1]


def test_spikes_the_job_has_shown_before_raise_the_limit_and_a_save_holds_every_rank():
    t = tracks(2)
    for step in range(40):  # 0.1 s steps, and every tenth one a 1 s data-loading spike
        for track in t.values():
            track.observe(step, 1.0 if step % 10 == 9 else 0.1, [0.08], step * 0.2)
    last = 39 * 0.2
    assert hung(t, last + 2.9, CFG) == []  # limit max(2 s, 3 x p90 1.0 s) = 3 s
    assert len(hung(t, last + 3.0, CFG)) == 2
    t[0].observe(39, 0.0, [], last + 0.5, steps=0, saving=True)  # rank 0 writes a checkpoint
    assert hung(t, last + 20.0, CFG) == []  # rank 1 waits for it in the next collective: no hang
    assert len(hung(t, last + 0.6 + CFG.checkpoint_deadline_s, CFG)) == 2  # a save past the deadline is one
    t[0].observe(39, 0.0, [], last + 25.0, steps=0, saving=False)  # the save ends: its time was no hang,
    assert hung(t, last + 27.9, CFG) == []  # for the rank that saved nor for the one that waited for it
    assert len(hung(t, last + 28.0, CFG)) == 2


def test_a_rank_that_never_steps_gets_the_startup_allowance_and_so_do_the_first_steps():
    t = tracks(2)
    t[0].observe(0, 0.5, [0.4], 1.0)  # rank 0 stepped once at t=1, then stopped: still in its first steps
    t[1].observe(-1, 0.0, [], 1.0, steps=0)  # rank 1 reports, no step
    for second in range(2, 182):  # both report on, neither steps
        for track in t.values():
            track.observe(track.last_step, 0.0, [], float(second), steps=0)
    assert hung(t, 179.0, CFG) == []
    assert [f.rank for f in hung(t, 180.0, CFG)] == [1]
    assert "has not finished a step for 180s" in hung(t, 180.0, CFG)[0].reason
    assert [f.rank for f in hung(t, 181.0, CFG)] == [0, 1]
    assert "has not made progress (step 0, in its first steps) for 180s" in hung(t, 181.0, CFG)[0].reason


def test_a_silent_rank_is_not_hung_while_a_peer_finishes_steps_past_its_last_report():
    """A rank's reports lost (its trainlib silent) while its peer trains on: in a synchronous job the peer could
    not finish a step the rank has not reached, so the job moves and nothing is hung. A `make test-busy` run saw
    10 s of one rank's reports lost while the job trained on, and a false hang restarted it. Once the peer stops
    too, both are hung a limit after the peer's last step."""
    t = tracks(2)
    for second in range(1, 11):  # 0.1 s steps on both ranks
        for track in t.values():
            track.observe(second * 10, 0.1, [0.08] * 10, float(second))
    for second in range(11, 21):  # rank 1's reports lost: only rank 0's arrive, its steps going on
        t[0].observe(second * 10, 0.1, [0.08] * 10, float(second))
    assert hung(t, 20.0, CFG) == []
    assert hung(t, 21.9, CFG) == []
    assert [f.rank for f in hung(t, 22.0, CFG)] == [0, 1]  # the limit (2 s) after the peer's last step
    t[1].observe(100, 0.0, [], 20.0, steps=0)  # a rank that reports and does not move is judged on its own
    assert [f.rank for f in hung(t, 20.0, CFG)] == [1]


def feed(t, steps, slow_rank=None, factor=1.0, noise=0.05, seed=0):
    """`steps` steps after the warm-up (whose samples the detector ignores)."""
    for track in t.values():
        track.samples_seen = max(track.samples_seen, WARMUP_STEPS)
    rng = random.Random(seed)
    for step in range(steps):
        for rank, track in t.items():
            base = 0.1 * rng.lognormvariate(0, noise)
            track.observe(step, 0.12, [base * (factor if rank == slow_rank else 1.0)], step * 0.12)


def test_a_persistent_straggler_costing_a_tenth_of_the_step_is_found_within_thirty_steps():
    t = tracks(4)
    # 5% step-to-step noise: a rank 12% slower in its 0.1 s compute of a 0.12 s step (it costs the job 10% of
    # its step time) is found within 30 steps in (nearly) every run, and within 45 in all of them; nobody else
    # is ever named.
    within_30 = within_45 = 0
    for seed in range(50):
        t = tracks(4)
        feed(t, 30, slow_rank=3, factor=1.12, seed=seed)
        findings = stragglers(t, CFG)
        assert [f.rank for f in findings] in ([3], [])
        within_30 += len(findings)
        t = tracks(4)
        feed(t, 45, slow_rank=3, factor=1.12, seed=seed)
        assert [f.rank for f in stragglers(t, CFG)] == [3]
        within_45 += 1
    assert within_30 >= 48 and within_45 == 50
    t = tracks(4)
    feed(t, 30, slow_rank=3, factor=1.3)
    assert stragglers(t, CFG)[0].reason.startswith("rank 3 computes 1.3")


def test_a_rank_a_few_per_cent_slower_in_every_step_costs_the_job_too_little_to_be_evicted():
    # what a busy host did to a healthy rank in a full test run: 1.06x the others' compute in most steps, a
    # 4 ms lag in 70 ms steps (6 %): cheaper to keep than to evict; a rank 1.12x slower there (11 %) is found
    for factor, found in ((1.06, []), (1.12, [3])):
        for seed in range(20):
            t = tracks(4)
            for track in t.values():
                track.samples_seen = max(track.samples_seen, WARMUP_STEPS)
            rng = random.Random(seed)
            for step in range(30):
                for rank, track in t.items():
                    compute = 0.065 * rng.lognormvariate(0, 0.01) * (factor if rank == 3 else 1.0)
                    track.observe(step, 0.07, [compute], step * 0.07)
            assert [f.rank for f in stragglers(t, CFG)] == found, (factor, seed)


def test_no_verdict_before_enough_steps():
    t = tracks(4)
    feed(t, 9, slow_rank=1, factor=2.0)
    assert stragglers(t, CFG) == []


def test_no_false_alarm_on_healthy_noise():
    alarms = 0
    for seed in range(200):
        t = tracks(8)
        feed(t, 60, noise=0.05, seed=seed)
        alarms += len(stragglers(t, CFG))
    assert alarms == 0


def test_a_single_slow_burst_is_not_a_straggler():
    t = tracks(4)
    feed(t, 25)
    for step in range(5):  # five slow steps on rank 0: a GC pause, a slow batch
        t[0].observe(25 + step, 0.12, [0.3], 3.0 + step)
        for rank in (1, 2, 3):
            t[rank].observe(25 + step, 0.12, [0.1], 3.0 + step)
    assert stragglers(t, CFG) == []


def test_a_tiny_compute_is_never_a_straggler():
    t = tracks(4)
    rng = random.Random(3)
    for step in range(40):
        for rank, track in t.items():
            track.observe(step, 0.01, [0.0015 * (1.3 if rank == 2 else 1.0) * rng.lognormvariate(0, 0.02)], step)
    assert stragglers(t, CFG) == []  # 30% slower, but by half a millisecond: noise on any real machine


def synchronous_job(compute, steps, ranks=8, sync_s=0.002, report_every=5, seed=0):
    """A synchronous job past its warm-up: each step, rank r computes `compute(r, step, rng)` seconds, then every
    rank waits for the slowest and syncs; trainlib reports every `report_every` steps. Returns, per report, the
    step it ended at and the straggler findings then."""
    t = tracks(ranks)
    for track in t.values():
        track.samples_seen = WARMUP_STEPS
    rng = random.Random(seed)
    verdicts = []
    for first in range(0, steps, report_every):
        samples = {rank: [] for rank in t}
        job_s = 0.0
        for step in range(first, first + report_every):
            for rank in t:
                samples[rank].append(compute(rank, step, rng))
            job_s += max(s[-1] for s in samples.values()) + sync_s
        for rank, track in t.items():
            track.observe(first + report_every, job_s / report_every, samples[rank], 0.0, steps=report_every)
        verdicts.append((first + report_every, stragglers(t, CFG)))
    return verdicts


def found_at(verdicts):
    """{step the first finding came at: ranks found}, or {} when none ever did."""
    return next(({step: [f.rank for f in findings]} for step, findings in verdicts if findings), {})


@pytest.mark.parametrize("factor", [0.5, 0.15])
def test_a_throttled_rank_is_found_within_thirty_steps_of_short_steps(factor):
    # 20 ms steps (18 ms of compute); from step 60 rank 3 computes F slower (slow=F): the job loses 29% of its
    # throughput at F = 0.5 and 10% at F = 0.15
    def compute(rank, step, rng):
        return 0.018 * rng.lognormvariate(0, 0.02) * (1 + factor if rank == 3 and step >= 60 else 1)

    for seed in range(20):
        assert found_at(synchronous_job(compute, steps=90, seed=seed)) in (
            {step: [3]} for step in range(65, 91, 5)), seed


def test_a_rank_slow_in_bursts_is_found_within_thirty_steps():
    # slow-bursts=0.5 on 20 ms steps: stopped 33 ms at a time, about every fifth step. The median step
    # looks healthy; the job loses 24% of its throughput.
    for seed in range(20):
        def compute(rank, step, rng, phase=seed % 5):
            return 0.018 * rng.lognormvariate(0, 0.02) + (0.033 if rank == 3 and step >= 60 and step % 5 == phase
                                                          else 0.0)

        verdicts = synchronous_job(compute, steps=90, seed=seed)
        assert found_at(verdicts) in ({step: [3]} for step in range(65, 91, 5)), seed
        assert verdicts[-1][1][0].reason.startswith("rank 3 costs the job 1")


def test_no_false_alarm_on_healthy_noise_of_short_steps():
    for seed in range(50):
        spike = random.Random(seed).randrange(300)

        def compute(rank, step, rng, spike=spike):
            c = 0.018 * rng.lognormvariate(0, 0.05)  # jitter
            if step == spike and rank == 0:
                c += 0.1  # one GC pause
            if step % 25 == 7:
                c *= 3  # a slow batch on every rank
            if rng.random() < 0.02:
                c *= 2  # ... or on one rank, now and then
            return c

        assert found_at(synchronous_job(compute, steps=300, seed=seed)) == {}, seed


def test_the_warm_up_steps_are_ignored():
    t = tracks(2)
    for step in range(10):  # a slow first few steps on rank 1 (imports, first all-reduce)
        t[0].observe(step, 0.1, [0.1], step)
        t[1].observe(step, 0.1, [0.5], step)
    assert [len(tr.compute_s) for tr in t.values()] == [0, 0]
    feed(t, 20)
    assert stragglers(t, CFG) == []


def test_a_generations_start_up_does_not_set_the_pace_of_the_checkpoint_step():
    """The first reports of a generation run slow (start-up, contention, the first save); the agreed
    checkpoint step must still be REQUEST_LATENCY_S of real steps ahead, or a rank may pass it before the
    request arrives: the ranks then save different steps, and wait for each other in different collectives."""
    t = tracks(2)
    for track in t.values():
        track.observe(4, 1.0, [0.01] * 4, 1.0)  # steps 0-4, the first one after 4 s of start-up
        track.observe(8, 0.3, [0.01] * 4, 2.0)  # slow: the other ranks were starting too, then a save
        track.observe(28, 0.05, [0.01] * 20, 3.0)
    assert checkpoint_step(t) == 28 + math.ceil(REQUEST_LATENCY_S / 0.05) + 2
    assert hung(t, 1.0 + CFG.hang_min_s - 0.1, CFG) == []


def test_the_checkpoint_step_is_reckoned_from_where_the_ranks_are_now_not_from_their_last_report():
    """Reports are up to a report interval and a heartbeat old when a request is made: the ranks went on
    stepping since. With a lead of one second, a step agreed from the report alone could lie behind them."""
    t = tracks(2)
    for track in t.values():
        track.observe(10, 0.05, [0.01] * 10, now=99.0, steps=10, step_at=98.5)
        track.observe(100, 0.05, [0.01] * 90, now=100.0, steps=90, step_at=99.5)  # step 100 ended at 99.5 s
    ahead = math.ceil(REQUEST_LATENCY_S / 0.05) + 2
    assert checkpoint_step(t) == 100 + ahead  # from the report alone
    assert checkpoint_step(t, now=100.52) == 120 + ahead  # 1.02 s after step 100 ended: 20 steps on
    t[1].observe(101, 0.05, [0.01], now=100.6, step_at=101.0)  # a rank clock ahead of ours counts as "now"
    assert t[1].last_step_at == 100.6


def test_the_start_up_report_alone_still_sets_a_lenient_hang_limit():
    t = tracks(2)
    for track in t.values():
        track.observe(0, 100.0, [], 0.0)  # one 100 s step so far (a slow model): no hang before 300 s
    assert hung(t, 299.0, CFG) == []
    assert len(hung(t, 300.0, CFG)) == 2


def test_the_ranks_that_waited_for_a_long_save_are_not_hung_when_it_ends():
    """Before: only the saving rank's progress clock restarted when its save ended; the others, which waited for
    it in the next collective, were past the hang limit at once (and no rank silent: a restart in place)."""
    t = tracks(2)
    for step in range(40):
        for track in t.values():
            track.observe(step, 0.1, [0.08], step * 0.1)
    last = 39 * 0.1
    t[0].observe(39, 0.0, [], last + 0.1, steps=0, saving=True)
    for second in range(1, 20):  # a 20 s save; rank 1 keeps reporting, with no step
        t[1].observe(39, 0.0, [], last + second, steps=0)
    t[0].observe(39, 0.0, [], last + 20.0, steps=0, saving=False)
    assert hung(t, last + 21.0, CFG) == []
    assert [f.rank for f in hung(t, last + 20.0 + CFG.hang_min_s, CFG)] == [0, 1]  # and a real stall after it is
