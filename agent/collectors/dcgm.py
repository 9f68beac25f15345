"""DCGM health watches as an extra source of GPU incidents, where NVIDIA DCGM is installed.

NVML gives raw counters; DCGM's health module turns them into judgements (a DBE, a PCIe replay
storm, an NVLink down, an InfoROM problem) with NVIDIA's own thresholds and wording. The agent
uses it when the DCGM Python bindings and a running `nv-hostengine` are both present, and runs
fine without: `DcgmHealth.try_start()` then returns None and logs why, once.

The API is the one the bindings ship (`pydcgm.DcgmHandle`, `DcgmSystem.GetDefaultGroup()`,
`DcgmGroup.health.Set/Check`, `c_dcgmHealthResponse_v5` with `incidents[i].entityInfo`,
`.system`, `.health`, `.error.msg`), as in NVIDIA/DCGM testing/python3.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from phalanx import log

logger = log.get("dcgm")

# Where DCGM packages put the bindings: DCGM 4 and DCGM 3.
BINDINGS_DIRS = ("/usr/share/datacenter-gpu-manager-4/bindings/python3", "/usr/local/dcgm/bindings/python3")
HOSTENGINE = "127.0.0.1"  # nv-hostengine's default (port 5555)
CONNECT_TIMEOUT_MS = 2000  # DCGM's own default is 5 s; the agent should not stall its start that long


def _import_bindings(dirs: Sequence[str]) -> tuple[Any, Any, Any]:
    """pydcgm, dcgm_structs and dcgm_fields, from sys.path or else from the packaged bindings folders."""
    try:
        return (importlib.import_module("pydcgm"), importlib.import_module("dcgm_structs"),
                importlib.import_module("dcgm_fields"))
    except ImportError:
        if not dirs:
            raise
    for d in dirs:
        if d not in sys.path:
            sys.path.append(d)  # appended, so the bindings never shadow anything already importable
    return (importlib.import_module("pydcgm"), importlib.import_module("dcgm_structs"),
            importlib.import_module("dcgm_fields"))


def _names(module: Any, prefix: str, skip: tuple[str, ...] = ()) -> dict[int, str]:
    """Constant value -> short lower-case name, e.g. DCGM_HEALTH_WATCH_MEM = 0x10 -> {0x10: "mem"}."""
    out = {}
    for name, value in vars(module).items():
        if name.startswith(prefix) and isinstance(value, int) and not name.startswith(skip):
            out.setdefault(value, name.removeprefix(prefix).lower())
    return out


def _text(value: Any) -> str:
    return value.decode(errors="replace").strip() if isinstance(value, bytes) else str(value).strip()


class DcgmHealth:
    """Health watches on DCGM's all-GPUs group; `check()` reports what DCGM found since the last call."""

    def __init__(self, handle: Any, group: Any, structs: Any, fields: Any, address: str) -> None:
        self._handle, self._group, self._structs, self._address = handle, group, structs, address
        self._gpu_entity = fields.DCGM_FE_GPU
        self._systems = _names(structs, "DCGM_HEALTH_WATCH_", ("DCGM_HEALTH_WATCH_ALL", "DCGM_HEALTH_WATCH_COUNT",
                                                                "DCGM_HEALTH_WATCH_MAX"))
        self._results = _names(structs, "DCGM_HEALTH_RESULT_")
        self._failing = False  # so a dead host engine is logged when it goes, not on every heartbeat

    @classmethod
    def probe(cls, address: str = HOSTENGINE, bindings_dirs: Sequence[str] = BINDINGS_DIRS,
              timeout_ms: int = CONNECT_TIMEOUT_MS) -> tuple[DcgmHealth | None, str]:
        """Connect and enable the watches; returns (health, note) or (None, the reason in one line)."""
        try:
            pydcgm, structs, fields = _import_bindings(bindings_dirs)
        except ImportError as e:
            where = ", ".join(bindings_dirs) or "sys.path"
            return None, f"DCGM Python bindings not installed ({e.name or e}; looked in {where})"
        try:
            handle = pydcgm.DcgmHandle(ipAddress=address, timeoutMs=timeout_ms)
        except Exception as e:  # the bindings raise DCGMError_* for a missing library or host engine
            return None, f"cannot connect to nv-hostengine at {address} ({type(e).__name__}: {e})"
        try:
            group = handle.GetSystem().GetDefaultGroup()
            group.health.Set(structs.DCGM_HEALTH_WATCH_ALL)
            group.health.Check()  # the first check only sets up DCGM's state and reports nothing
        except Exception as e:
            _shutdown(handle)
            return None, f"DCGM health watches could not be enabled ({type(e).__name__}: {e})"
        return cls(handle, group, structs, fields, address), f"DCGM health watches on all GPUs via {address}"

    @classmethod
    def try_start(cls, address: str = HOSTENGINE, bindings_dirs: Sequence[str] = BINDINGS_DIRS) -> DcgmHealth | None:
        """The watches, or None where DCGM is not available here; logs which, in one line."""
        health, note = cls.probe(address, bindings_dirs)
        logger.info("dcgm_health_on" if health else "dcgm_health_off", note=note)
        return health

    def check(self) -> dict[int, list[str]]:
        """GPU index -> incident messages (e.g. "fail mem: ...") since the last check; {} when all pass.

        DCGM numbers GPUs as NVML enumerates them, so its GPU id is the NVML index. Incidents on other
        entities (NVSwitches, instances) are logged, not returned. Never raises: a host engine that went
        away is logged once and gives {} until it answers again.
        """
        try:
            response = self._group.health.Check()
        except Exception as e:
            if not self._failing:
                logger.warning("dcgm_health_check_failed", address=self._address, error=type(e).__name__,
                               detail=str(e))
            self._failing = True
            return {}
        if self._failing:
            logger.info("dcgm_health_check_recovered", address=self._address)
        self._failing = False
        incidents: dict[int, list[str]] = {}
        for i in range(int(response.incidentCount)):
            incident = response.incidents[i]
            health = self._results.get(int(incident.health), str(incident.health))
            system = self._systems.get(int(incident.system), hex(int(incident.system)))
            message = f"{health} {system}: {_text(incident.error.msg)}"
            entity = incident.entityInfo
            if int(entity.entityGroupId) != self._gpu_entity:
                logger.warning("dcgm_incident_not_gpu", entity_group=int(entity.entityGroupId),
                               entity=int(entity.entityId), message=message)
                continue
            incidents.setdefault(int(entity.entityId), []).append(message)
        return incidents

    def close(self) -> None:
        _shutdown(self._handle)


def _shutdown(handle: Any) -> None:
    try:
        handle.Shutdown()
    except Exception as e:
        logger.warning("dcgm_shutdown_failed", error=type(e).__name__)
