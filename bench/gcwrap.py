"""Run the controller with its garbage-collector pauses logged (`bench/run.py capacity --gc-trace`).

    python -m bench.gcwrap --config FILE    # exactly `python -m controller.main --config FILE`, plus
                                            # one "GCTRACE <unix time> <generation> <ms>" line on
                                            # stderr per collection that took 20 ms or more
"""

from __future__ import annotations

import gc
import runpy
import sys
import time

THRESHOLD_S = 0.020
_started: list[float] = [0.0]


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _started[0]
    if took >= THRESHOLD_S:
        sys.stderr.write(f"GCTRACE {time.time():.3f} {info['generation']} {took * 1e3:.1f}\n")
        sys.stderr.flush()


def parse(text: str, start: float, end: float) -> dict:
    """Pauses logged between `start` and `end` (unix times): count, total and longest, per generation."""
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for line in text.splitlines():
        if line.startswith("GCTRACE "):
            try:
                _, when, generation, ms = line.split()
                if start <= float(when) <= end:
                    pauses[int(generation)].append(float(ms))
            except ValueError:
                continue
    every = [ms for g in pauses.values() for ms in g]
    return {
        "gc_pauses_over_20ms": len(every),
        "gc_pause_total_ms": round(sum(every), 1),
        "gc_pause_max_ms": round(max(every, default=0.0), 1),
        "gc_gen2_collections": len(pauses[2]),
        "gc_gen2_max_ms": round(max(pauses[2], default=0.0), 1),
    }


if __name__ == "__main__":
    gc.callbacks.append(_callback)
    sys.argv = ["controller.main", *sys.argv[1:]]
    runpy.run_module("controller.main", run_name="__main__", alter_sys=True)
