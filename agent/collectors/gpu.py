"""The GPU backend interface and backend selection (auto | nvml | sim)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from phalanx import log
from phalanx.errors import PhalanxError
from phalanx.v1 import common_pb2

logger = log.get("gpu")


class GpuBackendError(PhalanxError):
    """The requested GPU backend cannot run on this host."""


class GpuBackend(Protocol):
    kind: int  # a phalanx.v1.GpuBackendKind

    def inventory(self) -> list[common_pb2.GpuInfo]:
        """What GPUs there are; called at start and on every re-registration."""
        ...

    def sample(self) -> list[common_pb2.GpuTelemetry]:
        """One sweep of readings and health counters; called once per heartbeat. Never raises for one
        GPU's or one field's failure: an unsupported field is left unset, a lost GPU has `lost` set."""
        ...

    def start_events(self, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        """Start delivering XID events to `emit` (which may be called from any thread)."""
        ...

    def close(self) -> None:
        """Stop event delivery and release the library."""
        ...


class NoGpus:
    """A node without GPUs (or without a driver): reports an empty inventory."""

    kind = common_pb2.GPU_BACKEND_KIND_NONE

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return []

    def sample(self) -> list[common_pb2.GpuTelemetry]:
        return []

    def start_events(self, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        pass

    def close(self) -> None:
        pass


def select(backend: str, sim_count: int, node_name: str) -> tuple[GpuBackend, str]:
    """The backend to use and a one-line note saying why. Raises GpuBackendError for `nvml` without NVML."""
    from agent.collectors.nvml import NvmlBackend, NvmlUnavailable
    from agent.collectors.sim import SimBackend

    if backend == "sim":
        return SimBackend(sim_count, node_name), f"simulated GPU backend with {sim_count} GPUs"
    try:
        nvml = NvmlBackend()
    except NvmlUnavailable as e:
        if backend == "nvml":
            raise GpuBackendError(f"gpu.backend is 'nvml' but NVML cannot start: {e}") from None
        return NoGpus(), f"no NVIDIA driver found ({e}); reporting no GPUs"
    return nvml, f"NVML backend with {len(nvml.inventory())} GPUs (driver {nvml.driver_version})"
