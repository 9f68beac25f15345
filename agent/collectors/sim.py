"""Simulated GPUs: the same signals a real node reports, for tests, demos and local clusters."""

from __future__ import annotations

import hashlib
import random

from phalanx.v1 import common_pb2

SIM_MODEL = "NVIDIA H100 80GB HBM3 (simulated)"
SIM_MEMORY_BYTES = 80 * 1024**3


class SimBackend:
    kind = common_pb2.GPU_BACKEND_KIND_SIM

    def __init__(self, count: int, node_name: str, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
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

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return list(self._gpus)

    def sample(self) -> list[common_pb2.GpuTelemetry]:
        rng = self._rng
        return [
            common_pb2.GpuTelemetry(
                index=gpu.index,
                temperature_c=round(38 + 4 * rng.random(), 1),
                power_w=round(110 + 20 * rng.random(), 1),
                utilization_percent=0.0,
                memory_used_bytes=0,
            )
            for gpu in self._gpus
        ]

    def close(self) -> None:
        pass
