"""What mutual TLS costs the controller, and what the session port wins back: the capacity benchmark's
measurement, three times in one invocation.

The same N simulated nodes (one TCP connection each, as real agents) run against a plaintext controller,
then one on mutual TLS where every node presents its own certificate (issued beforehand, untimed), then the
same mutual TLS with the sessions in frames on the controller's session port (`session_listen`; Register
stays on gRPC). Reported per mode: controller CPU per heartbeat in the steady hold, its CPU share,
heartbeat lag p99, and how fast the nodes registered during the ramp (each registration on TLS includes a
full handshake; on the session port a second one, for the session's own connection). The ratios are the
figures to carry to the capacity numbers, which are measured in plaintext gRPC unless asked otherwise.
"""

from __future__ import annotations

from bench import capacity
from bench.common import log

MODES = ("plaintext", "tls", "tls_session")  # gRPC in plaintext; gRPC on mutual TLS; the session port on it


async def run(nodes: int, hold_s: float, settle_s: float, budget_s: float) -> dict:
    modes = {}
    for mode in MODES:
        log(f"tls: {mode}: {nodes} nodes")
        summary = await capacity.run([nodes], hold_s, settle_s, generators=1, per_channel=1, budget_s=budget_s,
                                     max_hold_s=hold_s, tls=mode != "plaintext", session_port=mode == "tls_session")
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
    return {"nodes": nodes, "hold_s": hold_s, **{f"{m}_{k}": v for m, d in modes.items() for k, v in d.items()},
            "cpu_ratio": _ratio(modes["tls"], modes["plaintext"]),
            "session_cpu_ratio": _ratio(modes["tls_session"], modes["tls"])}


def _ratio(a: dict, b: dict) -> float | None:
    """a's controller CPU per heartbeat over b's."""
    return round(a["us_per_heartbeat"] / b["us_per_heartbeat"], 2) if a["us_per_heartbeat"] and b["us_per_heartbeat"] \
        else None
