"""Simulated GPUs: the readings and health signals a real node reports, and the faults that change them.

A fault produces what NVML would show: the XID event (delivered like the NVML event thread does)
and the counters and flags that go with it, so the controller cannot tell a simulated fault from a
real one by its shape.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.faults import Fault
from phalanx.v1 import common_pb2

SIM_MODEL = "NVIDIA H100 80GB HBM3 (simulated)"
SIM_MEMORY_BYTES = 80 * 1024**3
SLOWDOWN_C = 87.0
SM_CLOCK_MHZ = 1980  # an H100 SXM's boost clock; thermal slowdown drops it
THERMAL_SM_CLOCK_MHZ = 1200
POWER_LIMIT_W = 700.0
NVLINKS = 18
THERMAL_REASONS = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown

# XIDs and the counters that move with them on a real GPU.
XID_MESSAGES = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 46: "GPU stopped processing (timeout)", 48: "double-bit ECC error",
    61: "internal micro-controller breakpoint", 62: "internal micro-controller halt", 63: "row remapping event",
    64: "row remapping failure", 74: "NVLink error", 79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate", 94: "contained ECC error", 95: "uncontained ECC error",
    109: "context switch timeout", 119: "GSP RPC timeout", 120: "GSP error", 136: "NVLink training failure",
    140: "unrecoverable ECC error escape", 143: "GPU initialization failure", 154: "recovery action changed",
}


@dataclass
class _GpuState:
    sbe: float = 0.0  # corrected errors, float so that a rate accumulates smoothly
    dbe: int = 0
    sbe_rate: float = 0.0
    remap_correctable: int = 0
    remap_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    thermal: bool = False
    lost: bool = False
    pcie_replays: int = 0
    nvlink_errors: int = 0
    nvlink_up: int = NVLINKS
    recovery_action: int = common_pb2.GPU_RECOVERY_ACTION_NONE


class SimBackend:
    kind = common_pb2.GPU_BACKEND_KIND_SIM

    def __init__(self, count: int, node_name: str, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rng = random.Random(seed)
        self._clock = clock
        self._lock = threading.Lock()
        self._emit: Callable[[common_pb2.GpuEvent], None] | None = None
        digest = hashlib.sha256(node_name.encode()).hexdigest()
        self._gpus = [
            common_pb2.GpuInfo(
                index=i,
                uuid=f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{i:04x}-{digest[16:28]}",
                name=SIM_MODEL,
                pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                serial=f"SIM{int(digest[:10], 16) % 10**10:010d}{i}",
                memory_total_bytes=SIM_MEMORY_BYTES,
            )
            for i in range(count)
        ]
        self._state = [_GpuState() for _ in range(count)]
        self._last_sample = clock()

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return list(self._gpus)

    def sample(self) -> list[common_pb2.GpuTelemetry]:
        rng = self._rng
        with self._lock:
            now = self._clock()
            elapsed, self._last_sample = now - self._last_sample, now
            out = []
            for gpu, s in zip(self._gpus, self._state, strict=True):
                s.sbe += s.sbe_rate * elapsed
                if s.lost:  # NVML answers GpuIsLost to every query: nothing but the flag
                    out.append(common_pb2.GpuTelemetry(index=gpu.index, lost=True))
                    continue
                temperature = SLOWDOWN_C + 3 if s.thermal else round(38 + 4 * rng.random(), 1)
                out.append(common_pb2.GpuTelemetry(
                    index=gpu.index,
                    temperature_c=temperature,
                    sm_clock_mhz=THERMAL_SM_CLOCK_MHZ if s.thermal else SM_CLOCK_MHZ,
                    power_w=round(110 + 20 * rng.random(), 1),
                    utilization_percent=0.0,
                    memory_used_bytes=0,
                    ecc_sbe_volatile=int(s.sbe), ecc_dbe_volatile=s.dbe,
                    ecc_sbe_aggregate=int(s.sbe), ecc_dbe_aggregate=s.dbe,
                    remapped_rows_correctable=s.remap_correctable,
                    remapped_rows_uncorrectable=s.remap_uncorrectable,
                    remap_pending=s.remap_pending, remap_failure=s.remap_failure,
                    slowdown_temperature_c=SLOWDOWN_C,
                    clocks_event_reasons=THERMAL_REASONS if s.thermal else 0,
                    power_limit_w=POWER_LIMIT_W,
                    pcie_link_gen=5, pcie_link_width=16, pcie_max_link_gen=5, pcie_max_link_width=16,
                    pcie_replay_count=s.pcie_replays,
                    nvlink_links_total=NVLINKS, nvlink_links_up=s.nvlink_up,
                    nvlink_error_count=s.nvlink_errors,
                    recovery_action=s.recovery_action,
                ))
            return out

    def start_events(self, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        self._emit = emit

    def close(self) -> None:
        self._emit = None

    def inject(self, index: int, fault: Fault) -> str:
        """Apply a GPU fault; returns what was done. Raises ValueError for a bad index or a rank fault."""
        if not 0 <= index < len(self._state):
            raise ValueError(f"GPU {index} does not exist (this node has {len(self._state)} GPUs)")
        if fault.on_ranks:
            raise ValueError(f"{fault} is a fault on ranks, not on the GPU")
        with self._lock:
            s = self._state[index]
            xid = self._apply(s, fault)
        if xid:
            self._xid(index, xid)
        return f"GPU {index}: {fault}" + (f" (XID {xid})" if xid else "")

    def _apply(self, s: _GpuState, fault: Fault) -> int | None:
        """Change the counters; return the XID a real GPU would raise with them."""
        name, value = fault.name, fault.value
        if name == "xid":
            return self._apply_xid(s, int(value))
        if name == "ecc-dbe":
            return self._apply_xid(s, 48)
        if name == "ecc-sbe-rate":
            s.sbe_rate = float(value)
        elif name == "remap-pending":
            return self._apply_xid(s, 63)
        elif name == "remap-failure":
            return self._apply_xid(s, 64)
        elif name == "thermal":
            s.thermal = True
        elif name == "gpu-lost":
            return self._apply_xid(s, 79)
        elif name == "pcie-replay":
            s.pcie_replays += int(value)
        elif name == "nvlink-errors":
            s.nvlink_errors += int(value)
        elif name == "clear":
            s.__dict__.update(_GpuState().__dict__)
        return None

    @staticmethod
    def _apply_xid(s: _GpuState, xid: int) -> int:
        if xid in (48, 94, 95, 140):  # uncorrectable ECC of one kind or another
            s.dbe += 1
        elif xid == 63:
            s.remap_uncorrectable += 1
            s.remap_pending = True
        elif xid == 64:
            s.remap_failure = True
        elif xid == 79:
            s.lost = True
        elif xid == 92:
            s.sbe += 1000
        elif xid == 74:
            s.nvlink_errors += 100
        elif xid == 136:
            s.nvlink_up = max(0, s.nvlink_up - 1)
        if xid in (46, 62, 109, 119, 120, 143):
            s.recovery_action = common_pb2.GPU_RECOVERY_ACTION_GPU_RESET
        return xid

    def _xid(self, index: int, xid: int) -> None:
        if self._emit is not None:
            self._emit(common_pb2.GpuEvent(gpu_index=index, xid=xid, time_unix_ns=time.time_ns(),
                                           message=XID_MESSAGES.get(xid, "XID event")))
