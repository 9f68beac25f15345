"""NUMA and PCIe topology of this host: what `nvidia-smi topo -m` shows, read from sysfs.

The controller places ranks near their GPU's NIC and CPUs, so the agent reports the topology at
registration. sysfs gives it on any Linux host, driver or not; NVML, where given, adds NVLink counts,
its own PCIe levels and the GPU numbering. Reading never raises: an odd or missing file becomes a
default plus one sentence in `Topology.warnings`, because a half-known topology beats a dead agent.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any

from phalanx.v1 import common_pb2

NVIDIA_VENDOR = "0x10de"
GPU_CLASS_PREFIXES = ("0x0302", "0x0300")  # 3D controller, VGA controller
RELATIONS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # PCIe relations, nearest first

_BDF = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_ROOT_COMPLEX = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")
_PORT_STATE = re.compile(r"[0-9]+: [A-Z_]+")
_MEMTOTAL = re.compile(r"Node\s+[0-9]+\s+MemTotal:\s+([0-9]{1,15})\s*kB")  # 15 digits of kB fit in uint64
_MAX_CPU = 1 << 16  # kernel NR_CPUS tops out at 8192; anything past this is garbage, not a CPU
_MAX_NODE = 1 << 10  # MAX_NUMNODES with NODES_SHIFT=10
_MAX_READ = 1 << 16
# nvmlDeviceGetTopologyCommonAncestor levels; INTERNAL (0, same board) is left to sysfs.
_NVML_LEVELS = {10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def parse_cpulist(text: str, limit: int = _MAX_CPU) -> list[int]:
    """Ids in a kernel list such as "0-55,112-167" ("" is an empty list: a CPU-less memory node).

    Raises ValueError for anything else, including ids at or past `limit`, so a garbage range
    cannot make us build a list of four billion CPUs.
    """
    text = text.strip()
    if not text:
        return []
    ids: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if match is None:
            raise ValueError(f"{part!r} is not an id or a range of ids")
        low, high = int(match[1]), int(match[2] or match[1])
        if low > high or high >= limit:
            raise ValueError(f"{part!r} is not a range of ids below {limit}")
        ids.update(range(low, high + 1))
    return sorted(ids)


def normalize_bdf(bus_id: str | bytes) -> str | None:
    """"00000000:1B:00.0" (NVML) or "0000:1b:00.0" (sysfs) as sysfs writes it; None if neither."""
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else str(bus_id)
    match = re.fullmatch(r"([0-9a-f]{1,8}):([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])", text.strip().lower())
    return f"{int(match[1], 16):04x}:{match[2]}" if match else None


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that puts mlx5_2 before mlx5_10."""
    return tuple(int(part) if i % 2 else part for i, part in enumerate(re.split(r"([0-9]+)", name)))


@dataclass(frozen=True)
class PciPlace:
    """Where a device hangs in the PCI tree: its root complex and the bridges above it, top first."""

    root: str  # "pci0000:15"
    bridges: tuple[str, ...]  # BDFs from the root port down to the device's own upstream bridge


def pci_place(parts: Sequence[str]) -> PciPlace | None:
    """The place of the device whose resolved sysfs path has these components, or None if it is
    not below a PCI root complex. The last root complex counts (VMD domains nest one inside another)."""
    roots = [i for i, part in enumerate(parts) if _ROOT_COMPLEX.fullmatch(part)]
    if not roots:
        return None
    chain = list(takewhile(_BDF.fullmatch, parts[roots[-1] + 1:]))
    return PciPlace(parts[roots[-1]], tuple(chain[:-1])) if chain else None


def pci_relation(a: PciPlace | None, b: PciPlace | None, numa_a: int, numa_b: int) -> str:
    """nvidia-smi's PCIe relation of two devices (numa -1 = unknown).

    Below one root complex the path runs up to the deepest bridge both share and down again. A PCIe
    switch shows in sysfs as an upstream bridge with a downstream bridge per port, so if each device
    sits at most one bridge below the shared one, the path crosses one switch (or one root port):
    PIX. More bridges mean more switches, still short of the host bridge: PXB. No shared bridge
    means only the root complex is shared: PHB. Across root complexes it is NODE within one known
    NUMA node, else SYS.
    """
    if a is not None and b is not None and a.root == b.root:
        shared = 0
        for x, y in zip(a.bridges, b.bridges, strict=False):
            if x != y:
                break
            shared += 1
        if shared == 0:
            return "PHB"
        return "PIX" if max(len(a.bridges), len(b.bridges)) - shared <= 1 else "PXB"
    return "NODE" if numa_a >= 0 and numa_a == numa_b else "SYS"


def nearest_nics(relations: Sequence[Sequence[str]], nic_names: Sequence[str]) -> list[tuple[str, str]]:
    """(NIC, relation) nearest to each GPU, given relations[gpu][nic]; ("", "") without NICs.

    Among equally near NICs the one fewer earlier GPUs took wins, then the first by name: two GPUs
    and two NICs behind one switch pair up GPU0-NIC0, GPU1-NIC1 instead of both using NIC0.
    """
    taken: Counter[str] = Counter()
    out = []
    for row in relations:
        if not nic_names:
            out.append(("", ""))
            continue
        relation = dict(zip(nic_names, row, strict=True))
        rank = {name: RELATIONS.index(rel) if rel in RELATIONS else len(RELATIONS) for name, rel in relation.items()}
        best = min(nic_names, key=lambda name: (rank[name], taken[name], natural_key(name)))
        taken[best] += 1
        out.append((best, relation[best]))
    return out


class _Sysfs:
    """Reads files below one sysfs root; every failure becomes a warning sentence, never an exception."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.warnings: list[str] = []

    def warn(self, sentence: str) -> None:
        if sentence not in self.warnings:
            self.warnings.append(sentence)

    def rel(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def read(self, path: Path, optional: bool = False) -> str | None:
        """Stripped text of a file; None if unreadable (silently when `optional` and simply absent)."""
        try:
            with open(path, "rb") as f:
                return f.read(_MAX_READ).decode(errors="replace").strip()
        except OSError as e:
            if not (optional and isinstance(e, FileNotFoundError)):
                self.warn(f"Cannot read {self.rel(path)} ({e.strerror or type(e).__name__}).")
            return None

    def integer(self, path: Path, low: int, high: int, optional: bool = False) -> int | None:
        text = self.read(path, optional)
        if text is None:
            return None
        if re.fullmatch(r"-?[0-9]{1,20}", text) and low <= int(text) <= high:
            return int(text)
        self.warn(f"{self.rel(path)} holds {text[:40]!r}, not a number from {low} to {high}.")
        return None

    def cpulist(self, path: Path) -> str:
        text = self.read(path)
        try:
            parse_cpulist(text or "")
        except ValueError as e:
            self.warn(f"{self.rel(path)} is not a CPU list ({e}).")
            return ""
        return text or ""

    def speed(self, path: Path) -> str:
        """A link speed as sysfs words it ("32.0 GT/s PCIe", "Unknown"); "" if absent or not text."""
        text = self.read(path, optional=True) or ""
        if len(text) <= 32 and text.isascii() and text.isprintable():
            return text
        self.warn(f"{self.rel(path)} holds {text[:40]!r}, not a link speed.")
        return ""

    def entries(self, path: Path, optional: bool = False) -> list[Path]:
        try:
            return sorted(path.iterdir(), key=lambda p: natural_key(p.name))
        except OSError as e:
            if not (optional and isinstance(e, FileNotFoundError)):
                self.warn(f"Cannot list {self.rel(path)} ({e.strerror or type(e).__name__}).")
            return []

    def resolve(self, link: Path) -> Path | None:
        """Where `link` really leads, or None (with a warning) if it dangles or leaves the root."""
        real = Path(os.path.realpath(link))
        if real.is_relative_to(self.root) and os.path.exists(real):
            return real
        self.warn(f"{self.rel(link)} points to {self.rel(real)}, which does not exist in this sysfs.")
        return None

    def pci_function(self, link: Path) -> Path | None:
        """The PCI function directory a `device` link leads to (a virtio device counts as its parent)."""
        real = self.resolve(link)
        while real is not None and real != self.root and not _BDF.fullmatch(real.name):
            real = real.parent
        return None if real is None or real == self.root else real


@dataclass
class _Device:
    msg: common_pb2.PciDevice
    place: PciPlace | None


def _read_device(fs: _Sysfs, path: Path, name: str, kind: str) -> _Device:
    numa = fs.integer(path / "numa_node", -1, _MAX_NODE - 1)
    msg = common_pb2.PciDevice(
        name=name, bdf=path.name, kind=kind, numa_node=-1 if numa is None else numa,
        local_cpulist=fs.cpulist(path / "local_cpulist"), sysfs_path=str(path),
        # Conventional PCI (and most VMs) have no link files; absence is normal, garbage is not.
        link_speed=fs.speed(path / "current_link_speed"),
        link_width=fs.integer(path / "current_link_width", 0, 1024, optional=True) or 0,
        max_link_speed=fs.speed(path / "max_link_speed"),
        max_link_width=fs.integer(path / "max_link_width", 0, 1024, optional=True) or 0,
    )
    place = pci_place(path.relative_to(fs.root).parts)
    if place is None:
        fs.warn(f"{name} at {fs.rel(path)} is not below a PCI root complex; its relations use NUMA nodes only.")
    return _Device(msg, place)


def _read_numa(fs: _Sysfs) -> list[common_pb2.NumaNode]:
    base = fs.root / "devices/system/node"
    online = fs.read(base / "online")
    ids: list[int] | None = None
    if online is not None:
        try:
            ids = parse_cpulist(online, limit=_MAX_NODE)
        except ValueError as e:
            fs.warn(f"devices/system/node/online is not a node list ({e}); using the node directories.")
    if ids is None:
        ids = sorted(int(p.name[4:]) for p in fs.entries(base, optional=True)
                     if re.fullmatch(r"node[0-9]{1,4}", p.name) and int(p.name[4:]) < _MAX_NODE)
    nodes = []
    for node_id in ids:
        path = base / f"node{node_id}"
        if not os.path.isdir(path):
            fs.warn(f"NUMA node {node_id} is online but devices/system/node/node{node_id} is missing.")
            continue
        distances = (fs.read(path / "distance") or "").split()
        if not all(re.fullmatch(r"[0-9]{1,3}", d) and int(d) < 256 for d in distances) or len(distances) > _MAX_NODE:
            fs.warn(f"devices/system/node/node{node_id}/distance is not a list of distances.")
            distances = []
        memory = _MEMTOTAL.search(fs.read(path / "meminfo") or "")
        if memory is None:
            fs.warn(f"devices/system/node/node{node_id}/meminfo has no MemTotal line.")
        nodes.append(common_pb2.NumaNode(
            id=node_id, cpulist=fs.cpulist(path / "cpulist"), distances=[int(d) for d in distances],
            memory_total_bytes=int(memory[1]) * 1024 if memory else 0))
    return nodes


def _find_gpus(fs: _Sysfs) -> list[_Device]:
    """NVIDIA 3D/VGA functions under bus/pci/devices, in PCI bus order (NVSwitches are class 0x0680)."""
    gpus = []
    for entry in fs.entries(fs.root / "bus/pci/devices"):
        real = fs.resolve(entry)
        if real is None or (fs.read(real / "vendor") or "").lower() != NVIDIA_VENDOR:
            continue
        if (fs.read(real / "class") or "").lower().startswith(GPU_CLASS_PREFIXES) and _BDF.fullmatch(real.name):
            gpus.append(_read_device(fs, real, "", "gpu"))
    return sorted(gpus, key=lambda d: tuple(int(x, 16) for x in re.split(r"[:.]", d.msg.bdf)))


def _find_nics(fs: _Sysfs) -> list[_Device]:
    """InfiniBand devices, then Ethernet interfaces on PCI functions no InfiniBand device claimed
    (an IB port's own ib0 netdev is the same NIC). Virtual interfaces and SR-IOV VFs are skipped."""
    nics: list[_Device] = []
    for kind, directory in (("infiniband", "class/infiniband"), ("ethernet", "class/net")):
        for entry in fs.entries(fs.root / directory, optional=True):
            link = entry / "device"
            if not os.path.lexists(link):
                continue  # lo, bridges, bonds, veths: no hardware behind them
            function = fs.pci_function(link)
            if function is None or os.path.lexists(function / "physfn"):
                continue
            if any(n.msg.bdf == function.name for n in nics if n.msg.kind == "infiniband"):
                continue
            nic = _read_device(fs, function, entry.name, kind)
            if kind == "infiniband":
                nic.msg.port_states.extend(_port_states(fs, entry / "ports"))
            nics.append(nic)
    return sorted(nics, key=lambda d: natural_key(d.msg.name))


def _port_states(fs: _Sysfs, ports: Path) -> list[str]:
    states = []
    for port in fs.entries(ports):
        state = fs.read(port / "state")
        if state is not None and _PORT_STATE.fullmatch(state):
            states.append(state)
        elif state is not None:
            fs.warn(f"{fs.rel(port / 'state')} holds {state[:40]!r}, not a port state like '4: ACTIVE'.")
    return states


class _Nvml:
    """What NVML adds to sysfs: GPU numbering by bus id, NVLink counts and NVML's own PCIe levels.

    Each query stands alone; an NVML error (NotSupported, or a binding this pynvml lacks) just
    leaves that answer to sysfs.
    """

    def __init__(self, nvml: Any, handles: list | None, fs: _Sysfs) -> None:
        self._nvml = nvml
        self._errors = (getattr(nvml, "NVMLError", Exception), AttributeError)
        if handles is None:
            count = self._call("nvmlDeviceGetCount") or 0
            handles = [self._call("nvmlDeviceGetHandleByIndex", i) for i in range(count)]
        self.handles: dict[str, Any] = {}  # bdf -> handle, in NVML index order
        for i, handle in enumerate(handles):
            info = self._call("nvmlDeviceGetPciInfo", handle) if handle is not None else None
            bdf = normalize_bdf(getattr(info, "busId", ""))
            if bdf is None:
                fs.warn(f"NVML device {i} gave no PCI bus id; it is left out of the GPU numbering.")
            else:
                self.handles[bdf] = handle

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self._nvml, name)(*args)
        except self._errors:
            return None

    def nvlinks(self) -> dict[tuple[str, str], int]:
        """Bonded NVLinks per ordered GPU pair: direct links, plus for GPUs that both reach
        NVSwitches the smaller of their switch link counts (every GPU pair talks through them)."""
        nvml, gpus = self._nvml, set(self.handles)
        direct: Counter[tuple[str, str]] = Counter()
        switched: Counter[str] = Counter()
        for bdf, handle in self.handles.items():
            for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
                if self._call("nvmlDeviceGetNvLinkState", handle, link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                    continue
                if self._call("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link) == getattr(
                        nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                    switched[bdf] += 1
                    continue
                info = self._call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                remote = normalize_bdf(getattr(info, "busId", ""))
                if remote in gpus and remote != bdf:
                    direct[bdf, remote] += 1
        return {(a, b): max(direct[a, b], direct[b, a]) + min(switched[a], switched[b])
                for a in gpus for b in gpus if a != b}

    def pcie_level(self, a: str, b: str) -> str | None:
        if a not in self.handles or b not in self.handles:
            return None
        level = self._call("nvmlDeviceGetTopologyCommonAncestor", self.handles[a], self.handles[b])
        return _NVML_LEVELS.get(level) if isinstance(level, int) else None


def _number_gpus(gpus: list[_Device], nvml: _Nvml | None, fs: _Sysfs) -> list[_Device]:
    """Give GPUs their index (NVML's order when known, else bus order) and name GPU<index>."""
    order = list(nvml.handles) if nvml is not None else []
    found = {g.msg.bdf for g in gpus}
    for i, bdf in enumerate(order):
        if bdf not in found:
            fs.warn(f"NVML device {i} ({bdf}) has no NVIDIA GPU entry under bus/pci/devices.")
    spare = len(order)
    for gpu in gpus:
        if gpu.msg.bdf in order:
            gpu.msg.gpu_index = order.index(gpu.msg.bdf)
        else:
            if nvml is not None:
                fs.warn(f"GPU {gpu.msg.bdf} is not among NVML's devices; it is numbered after them.")
            gpu.msg.gpu_index, spare = spare, spare + 1
        gpu.msg.name = f"GPU{gpu.msg.gpu_index}"
    return sorted(gpus, key=lambda g: g.msg.gpu_index)


def read_topology(sysfs_root: str | Path = "/sys", nvml: object | None = None,
                  nvml_handles: list | None = None) -> common_pb2.Topology:
    """The host's NUMA nodes, GPUs, NICs, their `nvidia-smi topo -m` matrix and each GPU's locality.

    `nvml` is an initialised pynvml module (or a fake of one); `nvml_handles` its device handles in
    index order (looked up through `nvml` when omitted). Never raises for what sysfs or NVML hold.
    """
    fs = _Sysfs(Path(os.path.realpath(sysfs_root)))
    numa = _read_numa(fs)
    view = _Nvml(nvml, nvml_handles, fs) if nvml is not None else None
    gpus = _number_gpus(_find_gpus(fs), view, fs)
    nics = _find_nics(fs)
    devices = gpus + nics

    # A device with no NUMA node on a one-node host is on that node; on a bigger host it is unknown.
    def node_of(device: _Device) -> int:
        if device.msg.numa_node >= 0 or len(numa) != 1:
            return device.msg.numa_node
        return numa[0].id

    if len(numa) > 1:
        for d in devices:
            if d.msg.numa_node < 0:
                fs.warn(f"{d.msg.name} ({d.msg.bdf}) has no NUMA node; its relations across PCI roots are SYS.")
    links = view.nvlinks() if view is not None else {}
    matrix = common_pb2.TopologyMatrix(labels=[d.msg.name for d in devices])
    for a in devices:
        cells = []
        for b in devices:
            both_gpus = a.msg.kind == b.msg.kind == "gpu"
            if a is b:
                cells.append("X")
            elif both_gpus and links.get((a.msg.bdf, b.msg.bdf)):
                cells.append(f"NV{links[a.msg.bdf, b.msg.bdf]}")
            elif both_gpus and view is not None and (level := view.pcie_level(a.msg.bdf, b.msg.bdf)):
                cells.append(level)
            else:
                cells.append(pci_relation(a.place, b.place, node_of(a), node_of(b)))
        matrix.rows.add(cells=cells)

    cpus_of_node = {n.id: n.cpulist for n in numa}
    nic_relations = [list(row.cells[len(gpus):]) for row in matrix.rows[:len(gpus)]]
    locality = [
        common_pb2.GpuLocality(
            gpu_index=gpu.msg.gpu_index, nearest_nic=nic, nic_relation=relation, numa_node=gpu.msg.numa_node,
            cpulist=gpu.msg.local_cpulist or cpus_of_node.get(gpu.msg.numa_node, ""))
        for gpu, (nic, relation) in zip(gpus, nearest_nics(nic_relations, [n.msg.name for n in nics]), strict=True)
    ]
    return common_pb2.Topology(
        numa_nodes=numa, gpus=[g.msg for g in gpus], nics=[n.msg for n in nics], matrix=matrix,
        locality=locality, warnings=fs.warnings)
