"""GPU and node health: a pure policy from signals (with their recent history) and `now` to a verdict.

    HEALTHY   nothing to see
    DEGRADED  watch it (rising corrected errors, thermal slowdown, PCIe replays, ...): stays in service
    FAILING   predictably lost soon: checkpoint, then evict
    FAILED    lost now

The history keeps counter samples only when they change (the agent's health digest tells the
controller when), so a healthy node costs nothing between changes. XIDs that call for FAILING or
FAILED stick until the node registers again (agent restart, GPU reset) or an operator undrains it.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from controller.config import HealthConfig
from phalanx.v1 import common_pb2


class Health(enum.IntEnum):
    HEALTHY = 1
    DEGRADED = 2
    FAILING = 3
    FAILED = 4

    def to_proto(self) -> int:
        return int(self)

    def __str__(self) -> str:
        return self.name


HEALTHY, DEGRADED, FAILING, FAILED = Health

# NVIDIA's XID catalogue (REFERENCE.md), bucketed by what it means for the GPU and the job on it.
_APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68})  # application errors; repeats suggest hardware
XID_POLICY: dict[int, tuple[Health, str]] = {
    46: (FAILED, "GPU stopped processing: reset the GPU"),
    48: (FAILED, "double-bit ECC error: reset the GPU"),
    61: (DEGRADED, "micro-controller breakpoint: report"),
    62: (FAILED, "micro-controller halt: reset the GPU"),
    63: (DEGRADED, "row remapping event: watch the trend"),
    64: (FAILED, "row remapping failure: reset the GPU, RMA"),
    74: (FAILING, "NVLink error"),
    79: (FAILED, "GPU has fallen off the bus: reboot the node"),
    92: (DEGRADED, "excessive single-bit ECC errors: watch the trend"),
    94: (FAILING, "contained ECC error: memory is degrading"),
    95: (FAILED, "uncontained ECC error: reset the GPU"),
    109: (FAILED, "context switch timeout: reset the GPU"),
    110: (FAILED, "security fault: reset the GPU"),
    119: (FAILED, "GSP RPC timeout: reset the GPU"),
    120: (FAILED, "GSP error: reset the GPU"),
    136: (FAILED, "NVLink training failure: reset the GPU"),
    140: (FAILED, "unrecoverable ECC error escape: reset the GPU"),
    143: (FAILED, "GPU initialization failure: reset the GPU"),
    158: (FAILED, "fatal timeout: reset the GPU"),
}
_RECOVERY = {
    common_pb2.GPU_RECOVERY_ACTION_GPU_RESET: (FAILED, "driver asks for a GPU reset"),
    common_pb2.GPU_RECOVERY_ACTION_NODE_REBOOT: (FAILED, "driver asks for a node reboot"),
    common_pb2.GPU_RECOVERY_ACTION_DRAIN_AND_RESET: (FAILED, "driver asks to drain and reset the GPU"),
    common_pb2.GPU_RECOVERY_ACTION_DRAIN_P2P: (FAILING, "driver asks to drain peer-to-peer traffic"),
}
_THERMAL_BITS = 0x08 | 0x20 | 0x40  # HwSlowdown, SwThermalSlowdown, HwThermalSlowdown
_POWER_BRAKE = 0x80


@dataclass(frozen=True)
class Verdict:
    health: Health
    reasons: tuple[str, ...] = ()


@dataclass
class _Sample:
    t: float
    sbe: int
    dbe: int
    replays: int
    nvlink_errors: int


@dataclass
class GpuHistory:
    """What the policy remembers of one GPU. Mutated only by `observe` and `record_xid`."""

    last: common_pb2.GpuTelemetry | None = None
    samples: deque[_Sample] = field(default_factory=deque)
    xids: deque[tuple[float, int]] = field(default_factory=deque)
    sticky: dict[int, tuple[Health, str]] = field(default_factory=dict)  # XIDs that stay until cleared

    def observe(self, telemetry: common_pb2.GpuTelemetry, now: float, previous_t: float, window_s: float) -> None:
        """Record a sweep. `previous_t` is when the GPU was last heard from, unchanged: a counter
        that moves now moved after it, so rates start from there and not from the window's start."""
        self.last = telemetry
        sample = _Sample(now, telemetry.ecc_sbe_volatile, telemetry.ecc_dbe_volatile, telemetry.pcie_replay_count,
                         telemetry.nvlink_error_count)
        if self.samples:
            prev = self.samples[-1]
            if (prev.sbe, prev.dbe, prev.replays, prev.nvlink_errors) == (sample.sbe, sample.dbe, sample.replays,
                                                                          sample.nvlink_errors):
                return
            if prev.t < previous_t < now:
                self.samples.append(_Sample(previous_t, prev.sbe, prev.dbe, prev.replays, prev.nvlink_errors))
        self.samples.append(sample)
        self._prune(now, window_s)

    def record_xid(self, xid: int, now: float, window_s: float) -> None:
        self.xids.append((now, xid))
        severity = XID_POLICY.get(xid)
        if severity and severity[0] >= FAILING:
            self.sticky[xid] = (severity[0], f"XID {xid}: {severity[1]}")
        self._prune(now, window_s)

    def forget(self) -> None:
        """An operator says the GPU is fixed: forget its XIDs and past counter movements. Flags that are
        still set (lost, remap pending) and counters that keep moving still speak for themselves."""
        self.sticky.clear()
        self.xids.clear()
        while len(self.samples) > 1:
            self.samples.popleft()

    def _prune(self, now: float, window_s: float) -> None:
        # keep one sample older than the window: it is the baseline for rates
        while len(self.samples) > 1 and self.samples[1].t <= now - window_s:
            self.samples.popleft()
        while self.xids and self.xids[0][0] < now - window_s:
            self.xids.popleft()

    def per_minute(self, attr: str, now: float, window_s: float) -> float:
        """Increase of a counter over the window, per minute, measured from the last reading at which
        it still had its value from the window's start (so a burst that starts now shows at once)."""
        if len(self.samples) < 2:
            return 0.0
        horizon = now - window_s
        base = next((s for s in reversed(self.samples) if s.t <= horizon), self.samples[0])
        value = getattr(base, attr)
        start = max(base.t, horizon)
        for sample in self.samples:
            if sample.t > start:
                if getattr(sample, attr) != value:
                    break
                start = sample.t
        increase = getattr(self.samples[-1], attr) - value
        return increase / max(now - start, 1.0) * 60.0 if increase > 0 else 0.0

    def is_quiet(self, now: float, window_s: float) -> bool:
        """Nothing left that time alone could change: no rate in the window, no XID in it."""
        horizon = now - window_s
        return all(t < horizon for t, _ in self.xids) and (len(self.samples) < 2 or self.samples[-1].t < horizon)


def evaluate_gpu(history: GpuHistory, now: float, cfg: HealthConfig) -> Verdict:
    """The verdict for one GPU, from its latest readings and its history. Pure."""
    found: list[tuple[Health, str]] = []
    t = history.last
    if t is not None:
        found += _from_readings(t, history, now, cfg)
    found += history.sticky.values()
    found += _from_recent_xids([x for t, x in history.xids if t >= now - cfg.window_s], history, cfg)
    if not found:
        return Verdict(HEALTHY)
    worst = max(h for h, _ in found)
    return Verdict(worst, tuple(reason for h, reason in sorted(found, key=lambda f: -f[0])))


def _from_readings(t: common_pb2.GpuTelemetry, history: GpuHistory, now: float,
                   cfg: HealthConfig) -> list[tuple[Health, str]]:
    if t.lost:
        return [(FAILED, "GPU is lost (fell off the bus)")]
    found = []
    window = cfg.window_s
    if t.HasField("remap_failure") and t.remap_failure:
        found.append((FAILED, "row remapping failed: RMA the GPU"))
    dbe_rate = history.per_minute("dbe", now, window)
    if dbe_rate > 0:
        found.append((FAILED, f"uncorrectable ECC errors in the last {window:g}s"))
    if t.recovery_action in _RECOVERY:
        found.append(_RECOVERY[t.recovery_action])
    if t.HasField("remap_pending") and t.remap_pending:
        found.append((Health[cfg.remap_pending], "row remap pending (applied at the next GPU reset)"))
    if t.HasField("retired_pages_pending") and t.retired_pages_pending:
        found.append((FAILING, "page retirement pending"))
    sbe = history.per_minute("sbe", now, window)
    if sbe >= cfg.ecc_sbe_failing_per_min:
        found.append((FAILING, f"corrected ECC errors at {sbe:.0f}/min (limit {cfg.ecc_sbe_failing_per_min:g})"))
    elif sbe >= cfg.ecc_sbe_degraded_per_min:
        found.append((DEGRADED, f"corrected ECC errors rising: {sbe:.0f}/min"))
    thermal = t.HasField("clocks_event_reasons") and t.clocks_event_reasons & _THERMAL_BITS
    hot = t.HasField("slowdown_temperature_c") and t.slowdown_temperature_c > 0 and (
        t.temperature_c >= t.slowdown_temperature_c)
    if thermal or hot:
        limit = f", slowdown at {t.slowdown_temperature_c:g} C" if t.HasField("slowdown_temperature_c") else ""
        found.append((DEGRADED, f"thermal slowdown ({t.temperature_c:g} C{limit})"))
    if t.HasField("clocks_event_reasons") and t.clocks_event_reasons & _POWER_BRAKE:
        found.append((DEGRADED, "power brake slowdown"))
    if t.HasField("pcie_link_width") and t.HasField("pcie_max_link_width") and (
            0 < t.pcie_link_width < t.pcie_max_link_width):
        found.append((DEGRADED, f"PCIe link x{t.pcie_link_width} of x{t.pcie_max_link_width}"))
    replays = history.per_minute("replays", now, window)
    if replays >= cfg.pcie_replay_degraded_per_min:
        found.append((DEGRADED, f"PCIe replays at {replays:.0f}/min"))
    if t.HasField("nvlink_links_up") and t.HasField("nvlink_links_total") and t.nvlink_links_up < t.nvlink_links_total:
        found.append((DEGRADED, f"{t.nvlink_links_total - t.nvlink_links_up} of {t.nvlink_links_total} NVLinks down"))
    nvlink = history.per_minute("nvlink_errors", now, window)
    if nvlink >= cfg.nvlink_errors_failing_per_min:
        found.append((FAILING, f"NVLink errors at {nvlink:.0f}/min"))
    elif nvlink >= cfg.nvlink_errors_degraded_per_min:
        found.append((DEGRADED, f"NVLink errors rising: {nvlink:.0f}/min"))
    return found


def _from_recent_xids(recent: list[int], history: GpuHistory, cfg: HealthConfig) -> list[tuple[Health, str]]:
    found = []
    application = [x for x in recent if x in _APPLICATION_XIDS]
    if len(application) >= cfg.application_xid_repeats:
        found.append((DEGRADED, f"{len(application)} application XIDs ({', '.join(map(str, sorted(set(application))))})"
                                f" in {cfg.window_s:g}s: repeats on one GPU suggest hardware"))
    for xid in sorted(set(recent)):
        if xid in _APPLICATION_XIDS or xid in history.sticky:
            continue
        health, action = XID_POLICY.get(xid, (DEGRADED, "unknown XID: watch"))
        if xid == 154:
            continue  # "recovery action changed": the recovery-action field carries the verdict
        found.append((health, f"XID {xid}: {action}"))
    return found


def evaluate_node(gpus: dict[int, GpuHistory], host: common_pb2.HostTelemetry | None, now: float,
                  cfg: HealthConfig) -> tuple[Verdict, dict[int, Verdict]]:
    """Node verdict = the worst of its GPUs and its host; reasons name the GPU they come from."""
    per_gpu = {index: evaluate_gpu(history, now, cfg) for index, history in sorted(gpus.items())}
    found = [(v.health, f"GPU {i}: {r}") for i, v in per_gpu.items() for r in v.reasons]
    if host is not None and host.checkpoint_total_bytes:
        free_gib = host.checkpoint_free_bytes / 2**30
        if free_gib < cfg.checkpoint_free_min_gib:
            found.append((DEGRADED, f"checkpoint directory has {free_gib:.1f} GiB free "
                                    f"(minimum {cfg.checkpoint_free_min_gib:g})"))
    if not found:
        return Verdict(HEALTHY), per_gpu
    found.sort(key=lambda f: -f[0])
    return Verdict(found[0][0], tuple(r for _, r in found)), per_gpu
