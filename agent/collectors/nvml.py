"""GPUs through NVML (`pynvml` from nvidia-ml-py): identity, per-heartbeat health, XID events.

Every reading is its own NVML query, because drivers and GPU generations each leave out different
ones: NotSupported (or any other NVML error) leaves that one field unset, while GpuIsLost marks the
GPU lost and skips the rest of its queries for this sweep. A failure on one GPU never touches another.

The queries live in tables (`IDENTITY_QUERIES`, `sample_queries()`) so that
`tools/record_nvml_fixture.py` asks a real GPU exactly what this backend asks, and a recorded
fixture can drive the fake NVML in the tests.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agent.collectors.sim import XID_MESSAGES
from phalanx import log
from phalanx.v1 import common_pb2

logger = log.get("nvml")

T = TypeVar("T")
Query = Callable[[Any, Any], Any]  # (pynvml module, device handle) -> a JSON-able raw value

# NVML's GPU recovery actions 0..4 (NVML_GPU_RECOVERY_ACTION_*), shifted by one in the proto so
# that 0 stays "not reported". Newer drivers define more (IMEX domain, bus reset, system reboot)
# that the proto has no value for yet: those are logged and left unset.
RECOVERY_ACTIONS = {
    0: common_pb2.GPU_RECOVERY_ACTION_NONE,
    1: common_pb2.GPU_RECOVERY_ACTION_GPU_RESET,
    2: common_pb2.GPU_RECOVERY_ACTION_NODE_REBOOT,
    3: common_pb2.GPU_RECOVERY_ACTION_DRAIN_P2P,
    4: common_pb2.GPU_RECOVERY_ACTION_DRAIN_AND_RESET,
}
# The NVLink error counters summed into nvlink_error_count (suffixes of NVML_NVLINK_ERROR_*).
NVLINK_COUNTERS = ("DL_REPLAY", "DL_RECOVERY", "DL_CRC_FLIT", "DL_CRC_DATA")
# Field values carry a union; which member holds the number depends on valueType.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class NvmlUnavailable(Exception):
    """NVML could not start here (no driver, no library, no permission)."""


class _GpuLost(Exception):
    """Internal: a query answered GpuIsLost, so the rest of this GPU's sweep is skipped."""


class _Never(Exception):
    """Stands in for an NVML error class the module in use does not define, so `except` stays valid."""


def _error(nvml: Any, name: str) -> type[BaseException]:
    return getattr(nvml, name, _Never)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _clocks_event_reasons(nvml: Any, h: Any) -> int:
    """The newer call where the module and driver have it, else the deprecated throttle-reasons call."""
    newer = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
    if newer is not None:
        try:
            return int(newer(h))
        except _error(nvml, "NVMLError_FunctionNotFound"):
            pass  # a driver older than the bindings
    return int(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))


def _recovery_action(nvml: Any, h: Any) -> int:
    """NVML reports the recovery action only as a field value, with a per-field return code."""
    (fv,) = nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])
    if fv.nvmlReturn != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(fv.nvmlReturn)  # pynvml maps the code to its NVMLError_* subclass
    return int(getattr(fv.value, _VALUE_MEMBERS.get(fv.valueType, "uiVal")))


def _ecc(error_type: str, counter_type: str) -> Query:
    return lambda n, h: int(n.nvmlDeviceGetTotalEccErrors(h, getattr(n, error_type), getattr(n, counter_type)))


IDENTITY_QUERIES: dict[str, Query] = {
    "uuid": lambda n, h: _text(n.nvmlDeviceGetUUID(h)),
    "name": lambda n, h: _text(n.nvmlDeviceGetName(h)),
    "pci_bus_id": lambda n, h: _text(n.nvmlDeviceGetPciInfo(h).busId),
    "serial": lambda n, h: _text(n.nvmlDeviceGetSerial(h)),
    "memory_total": lambda n, h: int(n.nvmlDeviceGetMemoryInfo(h).total),
}


def sample_queries(nvml: Any) -> dict[str, Query]:
    """Per-heartbeat queries, in the order they run. The recovery action only where pynvml knows the field."""
    queries: dict[str, Query] = {
        "temperature": lambda n, h: int(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
        "sm_clock": lambda n, h: int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
        "power_usage_mw": lambda n, h: int(n.nvmlDeviceGetPowerUsage(h)),
        "utilization_gpu": lambda n, h: int(n.nvmlDeviceGetUtilizationRates(h).gpu),
        "memory_used": lambda n, h: int(n.nvmlDeviceGetMemoryInfo(h).used),
        "ecc_sbe_volatile": _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
        "ecc_dbe_volatile": _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
        "ecc_sbe_aggregate": _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
        "ecc_dbe_aggregate": _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
        "remapped_rows": lambda n, h: [int(v) for v in n.nvmlDeviceGetRemappedRows(h)],
        "retired_pages_sbe": lambda n, h: len(n.nvmlDeviceGetRetiredPages(
            h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)),
        "retired_pages_dbe": lambda n, h: len(n.nvmlDeviceGetRetiredPages(
            h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
        "retired_pages_pending": lambda n, h: int(n.nvmlDeviceGetRetiredPagesPendingStatus(h)),
        "slowdown_temperature": lambda n, h: int(n.nvmlDeviceGetTemperatureThreshold(
            h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
        "clocks_event_reasons": _clocks_event_reasons,
        "power_limit_mw": lambda n, h: int(n.nvmlDeviceGetEnforcedPowerLimit(h)),
        "pcie_link_gen": lambda n, h: int(n.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        "pcie_link_width": lambda n, h: int(n.nvmlDeviceGetCurrPcieLinkWidth(h)),
        "pcie_max_link_gen": lambda n, h: int(n.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        "pcie_max_link_width": lambda n, h: int(n.nvmlDeviceGetMaxPcieLinkWidth(h)),
        "pcie_replay_count": lambda n, h: int(n.nvmlDeviceGetPcieReplayCounter(h)),
    }
    if hasattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"):
        queries["recovery_action"] = _recovery_action
    return queries


def _milliwatts(mw: Any) -> float:
    return int(mw) / 1000.0


# query -> (GpuTelemetry field, conversion). remapped_rows and recovery_action are handled apart.
_SCALARS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "temperature": ("temperature_c", float),
    "sm_clock": ("sm_clock_mhz", int),
    "power_usage_mw": ("power_w", _milliwatts),
    "utilization_gpu": ("utilization_percent", float),
    "memory_used": ("memory_used_bytes", int),
    "ecc_sbe_volatile": ("ecc_sbe_volatile", int),
    "ecc_dbe_volatile": ("ecc_dbe_volatile", int),
    "ecc_sbe_aggregate": ("ecc_sbe_aggregate", int),
    "ecc_dbe_aggregate": ("ecc_dbe_aggregate", int),
    "retired_pages_sbe": ("retired_pages_sbe", int),
    "retired_pages_dbe": ("retired_pages_dbe", int),
    "retired_pages_pending": ("retired_pages_pending", bool),
    "slowdown_temperature": ("slowdown_temperature_c", float),
    "clocks_event_reasons": ("clocks_event_reasons", int),
    "power_limit_mw": ("power_limit_w", _milliwatts),
    "pcie_link_gen": ("pcie_link_gen", int),
    "pcie_link_width": ("pcie_link_width", int),
    "pcie_max_link_gen": ("pcie_max_link_gen", int),
    "pcie_max_link_width": ("pcie_max_link_width", int),
    "pcie_replay_count": ("pcie_replay_count", int),
}
_REMAP_FIELDS = ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failure")
# Which GpuTelemetry fields each query fills (the NVLink walk is the pseudo-query "nvlink").
QUERY_FIELDS: dict[str, tuple[str, ...]] = {
    **{name: (f,) for name, (f, _) in _SCALARS.items()},
    "remapped_rows": _REMAP_FIELDS,
    "recovery_action": ("recovery_action",),
    "nvlink": ("nvlink_links_total", "nvlink_links_up", "nvlink_error_count"),
}


def handle_key(handle: Any) -> Any:
    """A hashable identity for a device handle: pynvml's handles are ctypes pointers, equal by address."""
    if isinstance(handle, ctypes._Pointer):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


@dataclass
class _Gpu:
    index: int
    handle: Any  # None when NVML gave no handle at start; such a GPU reports only its index (and lost)
    lost_at_start: bool = False
    unsupported: set[str] = field(default_factory=set)  # queries that answered NotSupported once
    links: list[int] | None = None  # NVLink links that exist; None until one full probe finished
    dead_counters: set[tuple[int, int]] = field(default_factory=set)  # (link, counter) NotSupported
    warned: set[str] = field(default_factory=set)  # queries whose other errors were logged once


_UNSET = object()


class NvmlBackend:
    kind = common_pb2.GPU_BACKEND_KIND_NVML

    def __init__(self, nvml: Any = None, *, event_wait_ms: int = 500) -> None:
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
        self._lost_error = _error(nvml, "NVMLError_GpuIsLost")
        self._not_supported = _error(nvml, "NVMLError_NotSupported")
        self._no_link = (self._not_supported, _error(nvml, "NVMLError_InvalidArgument"))
        self.driver_version = self._optional(lambda: _text(nvml.nvmlSystemGetDriverVersion()), "unknown")
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as e:
            self._optional(nvml.nvmlShutdown, None)
            raise NvmlUnavailable(f"NVML started but cannot count the GPUs ({e})") from None
        self._gpus = [self._open(i) for i in range(count)]  # handles looked up once, not per sweep
        self._index_by_handle = {handle_key(g.handle): g.index for g in self._gpus if g.handle is not None}
        self._inventory = [self._identity(g) for g in self._gpus]
        self._queries = sample_queries(nvml)
        self._max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))
        self._counters = [getattr(nvml, f"NVML_NVLINK_ERROR_{c}") for c in NVLINK_COUNTERS
                          if hasattr(nvml, f"NVML_NVLINK_ERROR_{c}")]
        self._event_wait_ms = event_wait_ms
        self._stop = threading.Event()
        self._events_thread: threading.Thread | None = None
        self._closed = False

    @property
    def library(self) -> Any:
        """The pynvml module in use (the topology reader asks it about NVLinks and PCIe ancestors)."""
        return self._nvml

    # -- identity --------------------------------------------------------------------------------

    def _optional(self, query: Callable[[], T], default: T) -> T:
        """Run one query; NotSupported (or any NVML error on this one field) gives `default`."""
        try:
            return query()
        except self._nvml.NVMLError:
            return default

    def _open(self, index: int) -> _Gpu:
        try:
            return _Gpu(index, self._nvml.nvmlDeviceGetHandleByIndex(index))
        except self._nvml.NVMLError as e:
            lost = isinstance(e, self._lost_error)
            logger.warning("nvml_gpu_unreachable", gpu=index, error=type(e).__name__, lost=lost)
            return _Gpu(index, None, lost_at_start=lost)

    def _identity(self, gpu: _Gpu) -> common_pb2.GpuInfo:
        info = common_pb2.GpuInfo(index=gpu.index)
        if gpu.handle is None:
            return info
        nvml, h, q = self._nvml, gpu.handle, IDENTITY_QUERIES
        info.uuid = self._optional(lambda: q["uuid"](nvml, h), "")
        info.name = self._optional(lambda: q["name"](nvml, h), "")
        info.pci_bus_id = self._optional(lambda: q["pci_bus_id"](nvml, h), "")
        info.serial = self._optional(lambda: q["serial"](nvml, h), "")
        info.memory_total_bytes = self._optional(lambda: q["memory_total"](nvml, h), 0)
        return info

    def inventory(self) -> list[common_pb2.GpuInfo]:
        return list(self._inventory)

    # -- one sweep -------------------------------------------------------------------------------

    def sample(self) -> list[common_pb2.GpuTelemetry]:
        return [self._sample_gpu(gpu) for gpu in self._gpus]

    def _sample_gpu(self, gpu: _Gpu) -> common_pb2.GpuTelemetry:
        t = common_pb2.GpuTelemetry(index=gpu.index)
        if gpu.handle is None:
            t.lost = gpu.lost_at_start
            return t
        try:
            for name, query in self._queries.items():
                if name in gpu.unsupported:
                    continue
                raw = self._ask(gpu, name, query)
                if raw is not _UNSET:
                    self._apply(gpu, t, name, raw)
            if "nvlink" not in gpu.unsupported:
                self._nvlink(gpu, t)
        except _GpuLost:
            t.lost = True  # what was read before the loss stays; the flag is what matters
        except Exception:  # a bug reading one GPU must not cost the others their sample
            logger.exception("nvml_sample_failed", gpu=gpu.index)
        return t

    def _ask(self, gpu: _Gpu, name: str, query: Query) -> Any:
        try:
            return query(self._nvml, gpu.handle)
        except self._lost_error:
            raise _GpuLost from None
        except self._not_supported:
            gpu.unsupported.add(name)  # the answer will not change until the driver reloads
            return _UNSET
        except AttributeError as e:  # bindings older than the query: as good as NotSupported
            gpu.unsupported.add(name)
            logger.info("nvml_query_missing", gpu=gpu.index, query=name, detail=str(e))
            return _UNSET
        except self._nvml.NVMLError as e:
            if name not in gpu.warned:
                gpu.warned.add(name)
                logger.info("nvml_query_failed", gpu=gpu.index, query=name, error=type(e).__name__)
            return _UNSET

    def _apply(self, gpu: _Gpu, t: common_pb2.GpuTelemetry, name: str, raw: Any) -> None:
        if name in _SCALARS:
            proto_field, convert = _SCALARS[name]
            setattr(t, proto_field, convert(raw))
        elif name == "remapped_rows":
            corr, unc, pending, failure = raw
            t.remapped_rows_correctable, t.remapped_rows_uncorrectable = int(corr), int(unc)
            t.remap_pending, t.remap_failure = bool(pending), bool(failure)
        elif name == "recovery_action":
            action = RECOVERY_ACTIONS.get(int(raw))
            if action is not None:
                t.recovery_action = action
            elif f"recovery_action={raw}" not in gpu.warned:
                gpu.warned.add(f"recovery_action={raw}")
                logger.warning("nvml_recovery_action_unmapped", gpu=gpu.index, nvml_value=int(raw))

    def _nvlink(self, gpu: _Gpu, t: common_pb2.GpuTelemetry) -> None:
        """Links that answer NotSupported/InvalidArgument do not exist; the rest are counted and summed."""
        nvml, h = self._nvml, gpu.handle
        existing, up = [], 0
        for link in gpu.links if gpu.links is not None else range(self._max_links):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(h, link)
            except self._lost_error:
                raise _GpuLost from None
            except self._no_link:
                continue
            except nvml.NVMLError:
                existing.append(link)  # the link is there; its state could not be read, so not "up"
                continue
            existing.append(link)
            up += bool(state)
        gpu.links = existing
        if not existing:
            gpu.unsupported.add("nvlink")
            return
        errors, counted = 0, False
        for link in existing:
            for counter in self._counters:
                if (link, counter) in gpu.dead_counters:
                    continue
                try:
                    errors += int(nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                    counted = True
                except self._lost_error:
                    raise _GpuLost from None
                except self._not_supported:
                    gpu.dead_counters.add((link, counter))
                except nvml.NVMLError:
                    pass
        t.nvlink_links_total, t.nvlink_links_up = len(existing), up
        if counted:
            t.nvlink_error_count = errors

    # -- XID events ------------------------------------------------------------------------------

    def start_events(self, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        """Start the one XID thread. It blocks in NVML, so it is a daemon that close() stops by flag."""
        if self._events_thread is not None or self._closed:
            logger.warning("nvml_events_not_started", reason="already started" if self._events_thread else "closed")
            return
        self._events_thread = threading.Thread(target=self._events_main, args=(emit,), name="phalanx-nvml-xid",
                                               daemon=True)
        self._events_thread.start()

    def _events_main(self, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except Exception as e:
            logger.error("nvml_xid_unavailable", error=type(e).__name__, detail=str(e))
            return
        try:
            if self._register_xid(event_set):
                self._wait_loop(event_set, emit)
            else:
                logger.warning("nvml_xid_off", reason="no GPU reports XID events")
        except Exception:
            logger.exception("nvml_xid_thread_failed")
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except Exception as e:
                logger.warning("nvml_event_set_free_failed", error=type(e).__name__)

    def _register_xid(self, event_set: Any) -> int:
        """Register every GPU that supports XID events; log each one that does not, once. Returns the count."""
        nvml, xid_type, registered = self._nvml, self._nvml.nvmlEventTypeXidCriticalError, 0
        for gpu in self._gpus:
            if gpu.handle is None:
                continue
            try:
                if not int(nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle)) & xid_type:
                    logger.warning("nvml_xid_unsupported", gpu=gpu.index)
                    continue
                nvml.nvmlDeviceRegisterEvents(gpu.handle, xid_type, event_set)
                registered += 1
            except nvml.NVMLError as e:
                logger.warning("nvml_xid_unsupported", gpu=gpu.index, error=type(e).__name__)
        return registered

    def _wait_loop(self, event_set: Any, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        nvml, timeout, failures = self._nvml, _error(self._nvml, "NVMLError_Timeout"), 0
        while not self._stop.is_set():
            try:
                data = nvml.nvmlEventSetWait(event_set, self._event_wait_ms)
            except timeout:
                failures = 0
                continue
            except nvml.NVMLError as e:
                failures += 1  # back off so a persistent error (a lost GPU) does not spin; events stay queued
                logger.warning("nvml_xid_wait_failed", error=type(e).__name__, consecutive=failures)
                self._stop.wait(min(5.0, self._event_wait_ms / 1000 * 2 ** min(failures, 10)))
                continue
            failures = 0
            self._deliver(data, emit)

    def _deliver(self, data: Any, emit: Callable[[common_pb2.GpuEvent], None]) -> None:
        xid = int(data.eventData)
        index = self._index_by_handle.get(handle_key(data.device))
        if index is None:
            index = self._optional(lambda: int(self._nvml.nvmlDeviceGetIndex(data.device)), None)
        if index is None:
            logger.error("nvml_xid_unattributed", xid=xid)
            return
        message = XID_MESSAGES.get(xid, "XID event")
        logger.warning("nvml_xid", gpu=index, xid=xid, message=message)
        try:
            emit(common_pb2.GpuEvent(gpu_index=index, xid=xid, time_unix_ns=time.time_ns(), message=message))
        except Exception:
            logger.exception("nvml_xid_emit_failed", gpu=index, xid=xid)

    def close(self) -> None:
        """Stop the XID thread (it frees its event set on the way out), then shut NVML down."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        thread = self._events_thread
        if thread is not None:
            thread.join(timeout=self._event_wait_ms / 1000 + 5)
            if thread.is_alive():  # never pull NVML out from under a thread still inside it
                logger.warning("nvml_xid_thread_stuck", waited_s=self._event_wait_ms / 1000 + 5)
                return
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass
