"""Host telemetry through psutil: CPU, memory, load, and the checkpoint directory's free space."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from phalanx import log
from phalanx.v1 import common_pb2

logger = log.get("host")


class HostCollector:
    def __init__(self, checkpoint_dir: str) -> None:
        self._checkpoint_dir = Path(checkpoint_dir)
        self._warned = False
        psutil.cpu_percent(interval=None)  # prime: the first call always says 0.0

    def sample(self) -> common_pb2.HostTelemetry:
        memory = psutil.virtual_memory()
        load1, load5, load15 = os.getloadavg()
        out = common_pb2.HostTelemetry(
            cpu_percent=psutil.cpu_percent(interval=None),
            memory_used_bytes=memory.total - memory.available,
            memory_available_bytes=memory.available,
            load1=load1, load5=load5, load15=load15,
        )
        try:
            disk = psutil.disk_usage(str(self._checkpoint_dir))
            out.checkpoint_free_bytes, out.checkpoint_total_bytes = disk.free, disk.total
        except OSError as e:
            if not self._warned:
                logger.warning("cannot read checkpoint directory free space; reporting 0",
                               path=str(self._checkpoint_dir), error=str(e))
                self._warned = True
        return out


def inventory_basics() -> tuple[int, int]:
    """(logical CPUs, total memory in bytes)."""
    return psutil.cpu_count(logical=True) or 0, psutil.virtual_memory().total
