"""The fault language of `phalanx inject NODE --gpu N FAULT`, parsed once and shared by CLI, controller and agent."""

from __future__ import annotations

import math
from dataclasses import dataclass

# fault -> (kind of value, what it does)
GPU_FAULTS: dict[str, tuple[type | None, str]] = {
    "xid": (int, "an XID event (and the counters that go with it), e.g. xid=79"),
    "ecc-dbe": (None, "one uncorrectable (double-bit) ECC error, with XID 48"),
    "ecc-sbe-rate": (float, "corrected (single-bit) ECC errors at R per second, e.g. ecc-sbe-rate=5"),
    "remap-pending": (None, "a row remap pending until the next GPU reset, with XID 63"),
    "remap-failure": (None, "a failed row remap, with XID 64"),
    "thermal": (None, "temperature over the slowdown threshold, thermal clocks-event reasons set"),
    "gpu-lost": (None, "the GPU falls off the bus, with XID 79"),
    "pcie-replay": (int, "N PCIe replays"),
    "nvlink-errors": (int, "N NVLink errors"),
    "clear": (None, "undo every fault on this GPU"),
}
RANK_FAULTS: dict[str, tuple[type | None, str]] = {
    "slow": (float, "throttle the GPU's ranks, as a hot GPU is: every step's compute takes (1 + F)x as long "
                    "(trainlib in the rank waits out the difference), e.g. slow=0.3"),
    "slow-bursts": (float, "stop the GPU's ranks in bursts (SIGSTOP/SIGCONT over a 0.1 s cycle) so they run F "
                           "slower on average, e.g. slow-bursts=0.3"),
    "hang": (None, "SIGSTOP the GPU's ranks until they are evicted"),
}


@dataclass(frozen=True)
class Fault:
    name: str
    value: float | int | None = None

    @property
    def on_ranks(self) -> bool:
        return self.name in RANK_FAULTS

    def __str__(self) -> str:  # parse(str(fault)) == fault: the controller hands faults on to agents as text
        if self.value is None:
            return self.name
        if isinstance(self.value, int):
            return f"{self.name}={self.value}"
        short = f"{self.value:g}"
        return f"{self.name}={short if float(short) == self.value else repr(self.value)}"


def parse(text: str) -> Fault:
    """Parse one fault; ValueError says what is wrong and lists what is allowed."""
    name, sep, raw = text.strip().partition("=")
    known = {**GPU_FAULTS, **RANK_FAULTS}
    if name not in known:
        raise ValueError(f"unknown fault {_shown(text)!r}; known faults: {', '.join(_usage(known))}")
    kind = known[name][0]
    if kind is None:
        if sep:
            raise ValueError(f"fault {name} takes no value (got {_shown(text)!r})")
        return Fault(name)
    if not sep or not raw:
        raise ValueError(f"fault {name} needs a value: {_usage({name: known[name]})[0]}")
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"fault {name}: {_shown(raw)!r} is not {'a whole number' if kind is int else 'a number'}") \
            from None
    low, high, rule = _RANGES.get(name, (0, MAX_COUNT, f"between 0 and {MAX_COUNT}"))
    if not low <= value <= high:  # also false for NaN
        raise ValueError(f"fault {name}={_shown(raw)} must be {rule}")
    return Fault(name, value)


# What a value may be: the simulated counters are uint64 and must stay within range however often a
# fault is injected, and a rate of errors must add up to a number.
MAX_COUNT = 1_000_000_000
MAX_RATE = 1_000_000.0
_RANGES: dict[str, tuple[float, float, str]] = {
    "slow": (math.ulp(0.0), 1 - math.ulp(1.0), "between 0 and 1 (0.3 = 30% slower)"),
    "slow-bursts": (math.ulp(0.0), 1 - math.ulp(1.0), "between 0 and 1 (0.3 = 30% slower)"),
    "xid": (1, 999, "between 1 and 999"),
    "ecc-sbe-rate": (0.0, MAX_RATE, f"between 0 and {MAX_RATE:.0f} (errors per second)"),
}


def _shown(text: str) -> str:
    """Typed text, cut short for a message that repeats it."""
    return text if len(text) <= 80 else text[:77] + "..."


def _usage(faults: dict[str, tuple[type | None, str]]) -> list[str]:
    return [usage(name, kind) for name, (kind, _) in faults.items()]


def usage(name: str, kind: type | None) -> str:
    """How the help and the README write a fault: `hang`, `xid=N` (a count), `ecc-sbe-rate=R` (a rate), `slow=F`
    (a factor)."""
    if kind is None:
        return name
    return f"{name}={'N' if kind is int else 'F' if name.startswith('slow') else 'R'}"
