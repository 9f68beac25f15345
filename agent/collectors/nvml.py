"""GPUs through NVML (`pynvml` from nvidia-ml-py).

Identity and the basic per-heartbeat readings; every query tolerates NotSupported on its own field.
The full health collector (ECC, remapping, XID events, NVLink, PCIe) builds on this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from phalanx import log
from phalanx.v1 import common_pb2

logger = log.get("nvml")

T = TypeVar("T")


class NvmlUnavailable(Exception):
    """NVML could not start here (no driver, no library, no permission)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    kind = common_pb2.GPU_BACKEND_KIND_NVML

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as e:
                raise NvmlUnavailable(f"the pynvml module is not installed ({e})") from None
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(str(e) or type(e).__name__) from None
        except OSError as e:
            raise NvmlUnavailable(str(e)) from None
        self.driver_version = self._optional(lambda: _text(nvml.nvmlSystemGetDriverVersion()), "unknown")
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        self._inventory = [self._identity(i, h) for i, h in enumerate(self._handles)]

    def _optional(self, query: Callable[[], T], default: T) -> T:
        """Run one query; NotSupported (or any NVML error on this one field) gives `default`."""
        try:
            return query()
        except self._nvml.NVMLError:
            return default

    def _identity(self, index: int, handle: Any) -> common_pb2.GpuInfo:
        nvml, opt = self._nvml, self._optional
        return common_pb2.GpuInfo(
            index=index,
            uuid=opt(lambda: _text(nvml.nvmlDeviceGetUUID(handle)), ""),
            name=opt(lambda: _text(nvml.nvmlDeviceGetName(handle)), ""),
            pci_bus_id=opt(lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId), ""),
            serial=opt(lambda: _text(nvml.nvmlDeviceGetSerial(handle)), ""),
            memory_total_bytes=opt(lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total), 0),
        )

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return list(self._inventory)

    def sample(self) -> list[common_pb2.GpuTelemetry]:
        nvml, opt = self._nvml, self._optional
        out = []
        for index, handle in enumerate(self._handles):
            out.append(common_pb2.GpuTelemetry(
                index=index,
                temperature_c=opt(lambda h=handle: float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                                  0.0),
                power_w=opt(lambda h=handle: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0, 0.0),
                utilization_percent=opt(lambda h=handle: float(nvml.nvmlDeviceGetUtilizationRates(h).gpu), 0.0),
                memory_used_bytes=opt(lambda h=handle: int(nvml.nvmlDeviceGetMemoryInfo(h).used), 0),
            ))
        return out

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
