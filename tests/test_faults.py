"""The fault language: what `phalanx inject` accepts, and that the text the controller hands on parses the same."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.collectors.sim import SimBackend
from phalanx import faults

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


@pytest.mark.parametrize("text,message", [
    # a rate of infinity (or one that reaches it) left the simulated GPU unable to report: the agent's
    # every heartbeat failed, and with it every session, until the agent was restarted
    ("ecc-sbe-rate=inf", "fault ecc-sbe-rate=inf must be between 0 and 1000000 (errors per second)"),
    ("ecc-sbe-rate=nan", "fault ecc-sbe-rate=nan must be between 0 and 1000000 (errors per second)"),
    ("ecc-sbe-rate=1e300", "fault ecc-sbe-rate=1e300 must be between 0 and 1000000 (errors per second)"),
    ("pcie-replay=18446744073709551616", "fault pcie-replay=18446744073709551616 must be between 0 and 1000000000"),
    ("nvlink-errors=-1", "fault nvlink-errors=-1 must be between 0 and 1000000000"),
    ("slow=nan", "fault slow=nan must be between 0 and 1 (0.3 = 30% slower)"),
    ("slow-bursts=1", "fault slow-bursts=1 must be between 0 and 1 (0.3 = 30% slower)"),
    ("xid=1000", "fault xid=1000 must be between 1 and 999"),
    ("xid=1e3", "fault xid: '1e3' is not a whole number"),
])
def test_out_of_range_values_are_refused(text, message):
    with pytest.raises(ValueError) as info:
        faults.parse(text)
    assert str(info.value) == message


@pytest.mark.parametrize("text", ["pcie-replay=1234567", "nvlink-errors=1000000000", "ecc-sbe-rate=0.1234567",
                                  "ecc-sbe-rate=5", "slow=0.3", "slow-bursts=0.5", "xid=79", "thermal"])
def test_the_text_handed_on_parses_to_the_same_fault(text):
    # str() once wrote 1234567 as "1.23457e+06", which the agent then refused as not a whole number
    fault = faults.parse(text)
    assert faults.parse(str(fault)) == fault
    assert str(fault) == text


@given(st.sampled_from(["pcie-replay", "nvlink-errors", "xid"]), st.integers(1, 999))
def test_counts_round_trip(name, value):
    fault = faults.parse(f"{name}={value}")
    assert faults.parse(str(fault)) == fault


@given(st.sampled_from(["ecc-sbe-rate", "slow", "slow-bursts"]), st.floats(0.0, 1e6, exclude_min=True,
                                                                           exclude_max=True))
def test_rates_round_trip(name, value):
    try:
        fault = faults.parse(f"{name}={value!r}")
    except ValueError:
        return  # slow must stay below 1
    assert faults.parse(str(fault)) == fault


fault_texts = st.one_of(
    st.tuples(st.sampled_from(sorted(faults.GPU_FAULTS)),
              st.one_of(st.floats().map(repr), st.integers().map(str), st.text(max_size=8))).map("=".join),
    st.sampled_from(sorted(faults.GPU_FAULTS)))


@given(st.lists(fault_texts, max_size=6), st.floats(0, 3e8))  # up to ten years after the faults
def test_a_simulated_gpu_still_reports_after_any_fault_accepted(texts, seconds):
    """ecc-sbe-rate=inf was accepted, and the simulated GPU's next reading (int(inf)) failed the agent's
    every heartbeat: its session ended at once each time it reconnected, until the agent was restarted."""
    now = [0.0]
    sim = SimBackend(1, "node", seed=0, clock=lambda: now[0])
    for text in texts:
        try:
            fault = faults.parse(text)
        except ValueError:
            continue
        sim.inject(0, fault)
    now[0] += seconds
    for reading in sim.sample():
        reading.SerializeToString()
