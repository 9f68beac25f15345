import random

import pytest

from agent.backoff import Backoff

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def test_delays_grow_jittered_within_bounds_and_reset():
    backoff = Backoff(0.2, 5.0, random.Random(7))
    delays = [backoff.next() for _ in range(10)]
    ceilings = [min(5.0, 0.2 * 2**i) for i in range(10)]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert max(delays) <= 5.0 and delays[-1] >= 2.5
    backoff.reset()
    assert backoff.next() <= 0.2


def test_jitter_spreads_a_herd():
    # 1000 agents losing the controller at once must not all come back at the same instant.
    firsts = [Backoff(1.0, 5.0, random.Random(seed)).next() for seed in range(1000)]
    assert max(firsts) - min(firsts) > 0.4
