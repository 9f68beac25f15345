"""A fake `pynvml` that answers and fails the way NVML does, for tests on hosts without a GPU.

It takes its constants from the real pynvml, so codes and enums match, and defines the NVMLError
hierarchy the same way pynvml does (one `NVMLError_<Name>` subclass per NVML_ERROR_* code,
`NVMLError(code)` gives the subclass). Each GPU keeps its answers in a dict keyed by the query
names of `agent.collectors.nvml`; an answer is a value or `Raise("NVMLError_NotSupported")`. A
JSON fixture from tools/record_nvml_fixture.py loads into the same dicts, so a real GPU's answers
can drive the fake.
"""

from __future__ import annotations

import json
import string
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as _real


class NVMLError(Exception):
    """Base of the fake hierarchy. `NVMLError(code)` returns the subclass for that code, as in pynvml."""

    code: int = _real.NVML_ERROR_UNKNOWN
    by_code: dict[int, type[NVMLError]] = {}

    def __new__(cls, *args: Any) -> NVMLError:
        if cls is NVMLError and args and args[0] in NVMLError.by_code:
            cls = NVMLError.by_code[args[0]]
        return Exception.__new__(cls)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.value = type(self).code

    def __str__(self) -> str:
        return str(_real.NVMLError(self.value))  # pynvml's own wording for the code


ERRORS: dict[str, type[NVMLError]] = {"NVMLError": NVMLError}
for _name in dir(_real):
    if _name.startswith("NVML_ERROR_"):
        _cls_name = "NVMLError_" + string.capwords(_name.removeprefix("NVML_ERROR_"), "_").replace("_", "")
        _cls = type(_cls_name, (NVMLError,), {"code": getattr(_real, _name), "__module__": __name__})
        ERRORS[_cls_name] = NVMLError.by_code[_cls.code] = _cls
        globals()[_cls_name] = _cls
CONSTANTS = {k: v for k, v in vars(_real).items()
             if isinstance(v, int) and (k.startswith("NVML_") or k.startswith("nvmlEventType"))}
NVLINK_COUNTERS = ("DL_REPLAY", "DL_RECOVERY", "DL_CRC_FLIT", "DL_CRC_DATA")


@dataclass(frozen=True)
class Raise:
    """An answer that is an NVML error, named by its pynvml class (unknown names raise NVMLError_Unknown)."""

    error: str

    def exception(self) -> NVMLError:
        return ERRORS.get(self.error, ERRORS["NVMLError_Unknown"])()


NOT_SUPPORTED = Raise("NVMLError_NotSupported")


class FakeHandle:
    """An opaque device handle, deliberately not the index, as pynvml's are not."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<FakeHandle {self.index}>"


def default_values(index: int) -> dict[str, Any]:
    """Every query answered, so that a test can take away exactly one."""
    return {
        "uuid": f"GPU-{index:08x}-0000-4000-8000-{index:012x}", "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"00000000:{0x18 + 0x10 * index:02X}:00.0", "serial": f"1650923{index:06d}",
        "memory_total": 85_520_809_984, "memory_used": 1_048_576 * (index + 1),
        "temperature": 41, "sm_clock": 1980, "power_usage_mw": 123_456, "utilization_gpu": 97,
        "ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0, "ecc_sbe_aggregate": 0, "ecc_dbe_aggregate": 0,
        "remapped_rows": [0, 0, 0, 0], "retired_pages_sbe": 0, "retired_pages_dbe": 0, "retired_pages_pending": 0,
        "slowdown_temperature": 87, "clocks_event_reasons": 0, "power_limit_mw": 700_000,
        "pcie_link_gen": 5, "pcie_link_width": 16, "pcie_max_link_gen": 5, "pcie_max_link_width": 16,
        "pcie_replay_count": 0, "recovery_action": _real.NVML_GPU_RECOVERY_ACTION_NONE,
        "supported_event_types": _real.nvmlEventTypeAll,
    }


@dataclass(eq=False)
class FakeGpu:
    index: int
    values: dict[str, Any]
    nvlink_state: dict[int, Any] = field(default_factory=lambda: dict.fromkeys(range(18), 1))
    nvlink_counters: dict[tuple[int, str], Any] = field(default_factory=dict)  # absent = 0
    lost: bool = False  # every device query raises GpuIsLost
    handle_error: Raise | None = None  # nvmlDeviceGetHandleByIndex fails
    calls: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.handle = FakeHandle(self.index)

    def set(self, **values: Any) -> FakeGpu:
        self.values.update(values)
        return self

    def unsupported(self, *queries: str) -> FakeGpu:
        for q in queries:
            self.values[q] = NOT_SUPPORTED
        return self


@dataclass(eq=False)
class FakeEventSet:
    registered: set[FakeHandle] = field(default_factory=set)
    freed: bool = False


class FakeNvml:
    """Stands in for the pynvml module: pass it to NvmlBackend or put it in sys.modules["pynvml"]."""

    NVMLError = NVMLError

    def __init__(self, count: int = 2, *, init_error: str | None = None, driver_version: str = "550.54.15") -> None:
        self.__dict__.update(CONSTANTS)
        self.__dict__.update(ERRORS)
        self.gpus = [FakeGpu(i, default_values(i)) for i in range(count)]
        self.init_error = init_error
        self.driver_version: Any = driver_version
        self.calls: Counter[str] = Counter()
        self.shutdowns = 0
        self.event_sets: list[FakeEventSet] = []
        self.wait_errors: list[str] = []  # raised, in order, by the next nvmlEventSetWait calls
        self._pending: list[tuple[FakeHandle, int]] = []
        self._cond = threading.Condition()

    @classmethod
    def from_fixture(cls, fixture: dict[str, Any] | str | Path) -> FakeNvml:
        """Take every answer from a fixture written by tools/record_nvml_fixture.py."""
        data = fixture if isinstance(fixture, dict) else json.loads(Path(fixture).read_text())
        fake = cls(count=len(data["gpus"]))
        fake.driver_version = _answer(data["driver_version"])
        for gpu, recorded in zip(fake.gpus, data["gpus"], strict=True):
            if "error" in recorded["handle"]:
                gpu.handle_error = Raise(recorded["handle"]["error"])
            gpu.values = {name: _answer(a) for name, a in recorded["queries"].items()}
            gpu.nvlink_state = {int(link): _answer(a["state"]) for link, a in recorded["nvlink"].items()}
            gpu.nvlink_counters = {(int(link), c): _answer(v) for link, a in recorded["nvlink"].items()
                                   for c, v in a.get("counters", {}).items()}
        return fake

    def inject_xid(self, index: int, xid: int) -> None:
        """Queue an XID for GPU `index`; a wait on an event set that GPU is registered in delivers it."""
        with self._cond:
            self._pending.append((self.gpus[index].handle, xid))
            self._cond.notify_all()

    # -- library ---------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error:
            raise Raise(self.init_error).exception()

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._give(self.driver_version)

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self.calls["nvmlDeviceGetHandleByIndex"] += 1
        if not 0 <= index < len(self.gpus):
            raise ERRORS["NVMLError_InvalidArgument"]()
        gpu = self.gpus[index]
        if gpu.handle_error:
            raise gpu.handle_error.exception()
        return gpu.handle

    def _gpu(self, handle: FakeHandle, fn: str) -> FakeGpu:
        gpu = self.gpus[handle.index]
        gpu.calls[fn] += 1
        if gpu.lost:
            raise ERRORS["NVMLError_GpuIsLost"]()
        return gpu

    @staticmethod
    def _give(answer: Any) -> Any:
        if isinstance(answer, Raise):
            raise answer.exception()
        return answer

    def _value(self, handle: FakeHandle, fn: str, query: str) -> Any:
        gpu = self._gpu(handle, fn)
        if query not in gpu.values:
            raise ERRORS["NVMLError_NotSupported"]()
        return self._give(gpu.values[query])

    # -- device queries --------------------------------------------------------------------------

    def nvmlDeviceGetIndex(self, h: FakeHandle) -> int:
        return self._gpu(h, "nvmlDeviceGetIndex").index

    def nvmlDeviceGetUUID(self, h: FakeHandle) -> str:
        return self._value(h, "nvmlDeviceGetUUID", "uuid")

    def nvmlDeviceGetName(self, h: FakeHandle) -> str:
        return self._value(h, "nvmlDeviceGetName", "name")

    def nvmlDeviceGetSerial(self, h: FakeHandle) -> str:
        return self._value(h, "nvmlDeviceGetSerial", "serial")

    def nvmlDeviceGetPciInfo(self, h: FakeHandle) -> SimpleNamespace:
        return SimpleNamespace(busId=self._value(h, "nvmlDeviceGetPciInfo", "pci_bus_id"))

    def nvmlDeviceGetMemoryInfo(self, h: FakeHandle) -> SimpleNamespace:
        total = self._value(h, "nvmlDeviceGetMemoryInfo", "memory_total")
        used = self._value(h, "nvmlDeviceGetMemoryInfo", "memory_used")
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetTemperature(self, h: FakeHandle, sensor: int) -> int:
        if sensor != _real.NVML_TEMPERATURE_GPU:
            raise ERRORS["NVMLError_InvalidArgument"]()
        return self._value(h, "nvmlDeviceGetTemperature", "temperature")

    def nvmlDeviceGetClockInfo(self, h: FakeHandle, clock_type: int) -> int:
        if clock_type != _real.NVML_CLOCK_SM:
            raise ERRORS["NVMLError_NotSupported"]()
        return self._value(h, "nvmlDeviceGetClockInfo", "sm_clock")

    def nvmlDeviceGetTemperatureThreshold(self, h: FakeHandle, threshold: int) -> int:
        if threshold != _real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            raise ERRORS["NVMLError_NotSupported"]()
        return self._value(h, "nvmlDeviceGetTemperatureThreshold", "slowdown_temperature")

    def nvmlDeviceGetPowerUsage(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetPowerUsage", "power_usage_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetEnforcedPowerLimit", "power_limit_mw")

    def nvmlDeviceGetUtilizationRates(self, h: FakeHandle) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._value(h, "nvmlDeviceGetUtilizationRates", "utilization_gpu"), memory=0)

    def nvmlDeviceGetTotalEccErrors(self, h: FakeHandle, error_type: int, counter_type: int) -> int:
        kind = {_real.NVML_MEMORY_ERROR_TYPE_CORRECTED: "sbe", _real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: "dbe"}
        scope = {_real.NVML_VOLATILE_ECC: "volatile", _real.NVML_AGGREGATE_ECC: "aggregate"}
        if error_type not in kind or counter_type not in scope:
            raise ERRORS["NVMLError_InvalidArgument"]()
        return self._value(h, "nvmlDeviceGetTotalEccErrors", f"ecc_{kind[error_type]}_{scope[counter_type]}")

    def nvmlDeviceGetRemappedRows(self, h: FakeHandle) -> tuple[int, int, int, int]:
        return tuple(self._value(h, "nvmlDeviceGetRemappedRows", "remapped_rows"))

    def nvmlDeviceGetRetiredPages(self, h: FakeHandle, cause: int) -> list[int]:
        causes = {_real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: "retired_pages_sbe",
                  _real.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: "retired_pages_dbe"}
        if cause not in causes:
            raise ERRORS["NVMLError_InvalidArgument"]()
        return [0x1000 * (i + 1) for i in range(self._value(h, "nvmlDeviceGetRetiredPages", causes[cause]))]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetRetiredPagesPendingStatus", "retired_pages_pending")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetCurrentClocksEventReasons", "clocks_event_reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetCurrentClocksThrottleReasons", "clocks_event_reasons")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetCurrPcieLinkGeneration", "pcie_link_gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetCurrPcieLinkWidth", "pcie_link_width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetMaxPcieLinkGeneration", "pcie_max_link_gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetMaxPcieLinkWidth", "pcie_max_link_width")

    def nvmlDeviceGetPcieReplayCounter(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetPcieReplayCounter", "pcie_replay_count")

    def nvmlDeviceGetNvLinkState(self, h: FakeHandle, link: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkState")
        if link not in gpu.nvlink_state:  # past the GPU's links, or a GPU without NVLink at all
            raise ERRORS["NVMLError_InvalidArgument" if gpu.nvlink_state else "NVMLError_NotSupported"]()
        return self._give(gpu.nvlink_state[link])

    def nvmlDeviceGetNvLinkErrorCounter(self, h: FakeHandle, link: int, counter: int) -> int:
        gpu = self._gpu(h, "nvmlDeviceGetNvLinkErrorCounter")
        names = {getattr(_real, f"NVML_NVLINK_ERROR_{c}"): c for c in NVLINK_COUNTERS}
        if link not in gpu.nvlink_state or counter not in names:
            raise ERRORS["NVMLError_InvalidArgument"]()
        return self._give(gpu.nvlink_counters.get((link, names[counter]), 0))

    def nvmlDeviceGetFieldValues(self, h: FakeHandle, field_ids: list[int]) -> list[SimpleNamespace]:
        """Per-field return codes, as NVML gives them; a lost GPU fails the whole call."""
        gpu = self._gpu(h, "nvmlDeviceGetFieldValues")
        out = []
        for fid in field_ids:
            answer = gpu.values.get("recovery_action", NOT_SUPPORTED) \
                if fid == _real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION else NOT_SUPPORTED
            ret = answer.exception().value if isinstance(answer, Raise) else _real.NVML_SUCCESS
            out.append(SimpleNamespace(fieldId=fid, scopeId=0, timestamp=0, latencyUsec=0, nvmlReturn=ret,
                                       valueType=_real.NVML_VALUE_TYPE_UNSIGNED_INT,
                                       value=SimpleNamespace(uiVal=0 if ret else int(answer))))
        return out

    # -- events ----------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeHandle) -> int:
        return self._value(h, "nvmlDeviceGetSupportedEventTypes", "supported_event_types")

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self.event_sets.append(FakeEventSet())
        return self.event_sets[-1]

    def nvmlDeviceRegisterEvents(self, h: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        supported = self._value(h, "nvmlDeviceRegisterEvents", "supported_event_types")
        if event_types & ~supported:
            raise ERRORS["NVMLError_NotSupported"]()
        event_set.registered.add(h)

    def nvmlEventSetWait(self, event_set: FakeEventSet, timeout_ms: int) -> SimpleNamespace:
        """Blocks up to `timeout_ms` for an XID on a registered GPU, then raises NVMLError_Timeout."""
        deadline = time.monotonic() + timeout_ms / 1000
        with self._cond:
            while True:
                if event_set.freed:
                    raise ERRORS["NVMLError_Uninitialized"]()
                if self.wait_errors:
                    raise Raise(self.wait_errors.pop(0)).exception()
                for i, (handle, xid) in enumerate(self._pending):
                    if handle in event_set.registered:
                        del self._pending[i]
                        return SimpleNamespace(device=handle, eventType=_real.nvmlEventTypeXidCriticalError,
                                               eventData=xid, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ERRORS["NVMLError_Timeout"]()
                self._cond.wait(remaining)

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        event_set.freed = True


def _answer(recorded: dict[str, Any]) -> Any:
    return Raise(recorded["error"]) if "error" in recorded else recorded["value"]
