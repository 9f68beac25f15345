"""How the CLI shows a node's topology: the `nvidia-smi topo -m` matrix for people, a dict for --json.

Operators already read nvidia-smi's matrix, so the text keeps its shape and legend; the lines after
it say what the matrix only implies (which NIC and CPUs each GPU should use) and what could not be read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phalanx.v1 import common_pb2

LEGEND = (
    ("X", "Self"),
    ("SYS", "Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)"),
    ("NODE", "Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node"),
    ("PHB", "Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)"),
    ("PXB", "Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)"),
    ("PIX", "Connection traversing at most a single PCIe bridge"),
    ("NV#", "Connection traversing a bonded set of # NVLinks"),
)


def _table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Rows as left-aligned columns two spaces apart, without trailing blanks."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(len(row) for row in rows))]
    return [(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))).rstrip()
            for row in rows]


def _numa(node: int) -> str:
    return str(node) if node >= 0 else "N/A"


def render_topology(topo: common_pb2.Topology) -> str:
    """The matrix (with CPU and NUMA affinity for GPU rows), legend, GPU locality, NUMA nodes, warnings."""
    lines: list[str] = []
    labels = list(topo.matrix.labels)
    if labels:
        locality = {loc.gpu_index: loc for loc in topo.locality}
        gpus = {gpu.name: gpu for gpu in topo.gpus}
        rows = [["", *labels, "CPU Affinity", "NUMA Affinity"]]
        for label, row in zip(labels, topo.matrix.rows, strict=False):
            affinity: list[str] = []
            if label in gpus:
                gpu = gpus[label]
                loc = locality.get(gpu.gpu_index)
                affinity = [(loc.cpulist if loc else gpu.local_cpulist) or "N/A", _numa(gpu.numa_node)]
            rows.append([label, *row.cells, *affinity])
        lines += _table(rows)
    else:
        lines.append("No GPUs or NICs found.")
    lines += ["", "Legend:", "", *(f"  {key:<4} = {meaning}" for key, meaning in LEGEND)]
    if topo.locality:
        names = {gpu.gpu_index: gpu.name for gpu in topo.gpus}
        rows = [["GPU", "Nearest NIC", "Relation", "NUMA", "CPUs"]]
        rows += [[names.get(loc.gpu_index, f"GPU{loc.gpu_index}"), loc.nearest_nic or "-", loc.nic_relation or "-",
                  _numa(loc.numa_node), loc.cpulist or "-"] for loc in topo.locality]
        lines += ["", "GPU locality:", *_table(rows, "  ")]
    if topo.numa_nodes:
        rows = [["Node", "CPUs", "Distances", "Memory"]]
        rows += [[str(node.id), node.cpulist or "-", " ".join(map(str, node.distances)) or "-",
                  f"{node.memory_total_bytes / 2**30:.1f} GiB" if node.memory_total_bytes else "-"]
                 for node in topo.numa_nodes]
        lines += ["", "NUMA nodes:", *_table(rows, "  ")]
    if topo.warnings:
        lines += ["", "Warnings:", *(f"  - {warning}" for warning in topo.warnings)]
    return "\n".join(lines)


def _device_dict(device: common_pb2.PciDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": device.name, "bdf": device.bdf, "kind": device.kind,
        "numa_node": device.numa_node if device.numa_node >= 0 else None,
        "local_cpulist": device.local_cpulist or None,
        "link_speed": device.link_speed or None, "link_width": device.link_width or None,
        "max_link_speed": device.max_link_speed or None, "max_link_width": device.max_link_width or None,
        "sysfs_path": device.sysfs_path,
    }
    if device.kind == "gpu":
        out["gpu_index"] = device.gpu_index
    if device.kind == "infiniband":
        out["port_states"] = list(device.port_states)
    return out


def topology_dict(topo: common_pb2.Topology) -> dict[str, Any]:
    """Plain JSON-able form for `--json`: unknown values are None rather than -1 or ""."""
    return {
        "numa_nodes": [{"id": n.id, "cpulist": n.cpulist, "distances": list(n.distances),
                        "memory_total_bytes": n.memory_total_bytes or None} for n in topo.numa_nodes],
        "gpus": [_device_dict(d) for d in topo.gpus],
        "nics": [_device_dict(d) for d in topo.nics],
        "matrix": {"labels": list(topo.matrix.labels), "rows": [list(r.cells) for r in topo.matrix.rows]},
        "locality": [{"gpu_index": loc.gpu_index, "nearest_nic": loc.nearest_nic or None,
                      "nic_relation": loc.nic_relation or None,
                      "numa_node": loc.numa_node if loc.numa_node >= 0 else None,
                      "cpulist": loc.cpulist or None} for loc in topo.locality],
        "warnings": list(topo.warnings),
    }
