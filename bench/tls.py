"""What mutual TLS costs the controller: the capacity benchmark's measurement, plaintext then TLS.

The same N simulated nodes (one TCP connection each, as real agents) run twice in one invocation:
first against a plaintext controller, then against one on mutual TLS where every node presents its
own certificate (issued beforehand, untimed). Reported per mode: controller CPU per heartbeat in the
steady hold, its CPU share, heartbeat lag p99, and how fast the nodes registered during the ramp
(each registration on TLS includes a full handshake). The ratio is the figure to carry to the
capacity numbers, which are measured in plaintext.
"""

from __future__ import annotations

from bench import capacity
from bench.common import log


async def run(nodes: int, hold_s: float, settle_s: float, budget_s: float) -> dict:
    modes = {}
    for mode in ("plaintext", "tls"):
        log(f"tls: {mode}: {nodes} nodes")
        summary = await capacity.run([nodes], hold_s, settle_s, generators=1, per_channel=1, budget_s=budget_s,
                                     max_hold_s=hold_s, tls=mode == "tls")
        step = summary["steps"][-1] if summary.get("steps") else None
        if step is None:
            raise RuntimeError(f"{mode}: no step measured ({summary.get('limited_by', 'no reason given')})")
        modes[mode] = {
            "us_per_heartbeat": step["us_per_heartbeat"],
            "controller_cpu_pct": step["controller_cpu_pct"],
            "lag_p99_ms": step["lag_p99_ms"],
            "registrations_per_s": round(nodes / step["ramp_s"], 1) if step["ramp_s"] else None,
            "sustained": step["sustained"],
            "controller_rss_mb": step["controller_rss_mb"],
        }
        log(f"tls: {mode}: {modes[mode]}")
    plain, tls = modes["plaintext"], modes["tls"]
    ratio = (tls["us_per_heartbeat"] / plain["us_per_heartbeat"]
             if tls["us_per_heartbeat"] and plain["us_per_heartbeat"] else None)
    return {"nodes": nodes, "hold_s": hold_s, **{f"{m}_{k}": v for m, d in modes.items() for k, v in d.items()},
            "cpu_ratio": round(ratio, 2) if ratio else None}
