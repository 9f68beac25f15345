"""Synthetic sysfs trees for the topology collector: a builder, a DGX-H100-shaped host, a broken one.

The trees copy the real layout: devices live under devices/pciDDDD:BB/<root port>/<switch
up>/<switch down>/<device>, and bus/pci/devices, class/net and class/infiniband reach them through
symlinks (relative as the kernel writes them, or absolute where a test asks for it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NODE0_CPUS = "0-55,112-167"
NODE1_CPUS = "56-111,168-223"
H100_SPEED = "32.0 GT/s PCIe"

# DGX-H100-shaped host. Per NUMA node two PCIe switches, each below its own root port; a switch holds
# two GPUs and two ConnectX NICs. Node 0's switches share root complex pci0000:15 (GPU0-GPU2: PHB);
# node 1's sit in pci0000:95 and pci0000:c5 (GPU4-GPU6: NODE). eno1 is an integrated NIC of
# pci0000:00 on node 0, beside an NVSwitch that must not count as a GPU.
# (root complex, root port, switch upstream port, [(downstream port, device, kind, name)], numa node)
DGX_SWITCHES = [
    ("pci0000:15", "0000:15:01.0", "0000:16:00.0",
     [("0000:17:00.0", "0000:18:00.0", "gpu", "GPU0"), ("0000:17:01.0", "0000:19:00.0", "ib", "mlx5_0"),
      ("0000:17:02.0", "0000:1a:00.0", "gpu", "GPU1"), ("0000:17:03.0", "0000:1b:00.0", "ib", "mlx5_1")], 0),
    ("pci0000:15", "0000:15:02.0", "0000:1c:00.0",
     [("0000:1d:00.0", "0000:1e:00.0", "gpu", "GPU2"), ("0000:1d:01.0", "0000:1f:00.0", "ib", "mlx5_2"),
      ("0000:1d:02.0", "0000:20:00.0", "gpu", "GPU3"), ("0000:1d:03.0", "0000:21:00.0", "ib", "mlx5_3")], 0),
    ("pci0000:95", "0000:95:01.0", "0000:96:00.0",
     [("0000:97:00.0", "0000:98:00.0", "gpu", "GPU4"), ("0000:97:01.0", "0000:99:00.0", "ib", "mlx5_4"),
      ("0000:97:02.0", "0000:9a:00.0", "gpu", "GPU5"), ("0000:97:03.0", "0000:9b:00.0", "ib", "mlx5_5")], 1),
    ("pci0000:c5", "0000:c5:01.0", "0000:c6:00.0",
     [("0000:c7:00.0", "0000:c8:00.0", "gpu", "GPU6"), ("0000:c7:01.0", "0000:c9:00.0", "ib", "mlx5_6"),
      ("0000:c7:02.0", "0000:ca:00.0", "gpu", "GPU7"), ("0000:c7:03.0", "0000:cb:00.0", "ib", "mlx5_7")], 1),
]
DGX_GPU_BDFS = [dev for *_, members, _ in DGX_SWITCHES for _, dev, kind, _ in members if kind == "gpu"]


@dataclass
class SysfsTree:
    """Writes a fake sysfs below `root`; paths given to it are relative to that root."""

    root: Path

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def link(self, rel: str, target: str, absolute: bool = False) -> None:
        """Symlink `rel` to `target` (relative to the root), written relative unless `absolute`."""
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        full = self.root / target
        path.symlink_to(full if absolute else os.path.relpath(full, path.parent))

    def numa_node(self, node: int, cpulist: str, distance: str, mem_kb: int) -> None:
        base = f"devices/system/node/node{node}"
        self.write(f"{base}/cpulist", cpulist + "\n")
        self.write(f"{base}/distance", distance + "\n")
        self.write(f"{base}/meminfo", f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree:  1 kB\n")

    def pci(self, path: str, vendor: str, cls: str, numa: int = 0, cpulist: str = "",
            speed: str = H100_SPEED, width: int = 16, absolute: bool = False) -> str:
        """A PCI function at devices/<path>, listed in bus/pci/devices; returns its devices/ path."""
        rel = f"devices/{path}"
        for name, value in [("vendor", vendor), ("class", cls), ("numa_node", numa), ("local_cpulist", cpulist),
                            ("current_link_speed", speed), ("max_link_speed", speed),
                            ("current_link_width", width), ("max_link_width", width)]:
            self.write(f"{rel}/{name}", f"{value}\n")
        self.link(f"bus/pci/devices/{Path(path).name}", rel, absolute)
        return rel

    def bridge(self, path: str, numa: int, cpulist: str) -> str:
        return self.pci(path, "0x1000", "0x060400", numa, cpulist)

    def net(self, name: str, device: str | None) -> None:
        """An interface in class/net; `device` is the PCI function's devices/ path, None for a virtual one."""
        rel = f"{device}/net/{name}" if device else f"devices/virtual/net/{name}"
        self.write(f"{rel}/type", "1\n")
        if device:
            self.link(f"{rel}/device", device)
        self.link(f"class/net/{name}", rel)

    def infiniband(self, name: str, device: str, ports: dict[int, str]) -> None:
        rel = f"{device}/infiniband/{name}"
        for port, state in ports.items():
            self.write(f"{rel}/ports/{port}/state", state + "\n")
        self.link(f"{rel}/device", device)
        self.link(f"class/infiniband/{name}", rel)


def dgx_h100(root: Path) -> SysfsTree:
    """Two sockets, 8 H100s and 8 ConnectX-7 behind 4 PCIe switches, one on-board Ethernet NIC.

    Node 1's devices are listed in bus/pci/devices through absolute symlinks, node 0's through
    relative ones, as the collector must follow both. mlx5_3's port is down; mlx5_0 has an ib0.
    """
    tree = SysfsTree(root)
    tree.write("devices/system/node/online", "0-1\n")
    tree.numa_node(0, NODE0_CPUS, "10 21", 1056330580)
    tree.numa_node(1, NODE1_CPUS, "21 10", 1056964608)
    for complex_, root_port, upstream, members, numa in DGX_SWITCHES:
        cpus = NODE0_CPUS if numa == 0 else NODE1_CPUS
        tree.bridge(f"{complex_}/{root_port}", numa, cpus)
        tree.bridge(f"{complex_}/{root_port}/{upstream}", numa, cpus)
        for downstream, device, kind, name in members:
            tree.bridge(f"{complex_}/{root_port}/{upstream}/{downstream}", numa, cpus)
            path = f"{complex_}/{root_port}/{upstream}/{downstream}/{device}"
            if kind == "gpu":
                tree.pci(path, "0x10de", "0x030200", numa, cpus, absolute=numa == 1)
            else:
                rel = tree.pci(path, "0x15b3", "0x020700", numa, cpus, absolute=numa == 1)
                tree.infiniband(name, rel, {1: "1: DOWN" if name == "mlx5_3" else "4: ACTIVE"})
                if name == "mlx5_0":
                    tree.net("ib0", rel)  # the IPoIB netdev of mlx5_0: the same NIC, listed once
    tree.pci("pci0000:00/0000:00:01.0/0000:05:00.0", "0x10de", "0x068000", 0, NODE0_CPUS)  # NVSwitch
    eno1 = tree.pci("pci0000:00/0000:00:1f.6", "0x8086", "0x020000", 0, NODE0_CPUS, speed="Unknown", width=0)
    tree.net("eno1", eno1)
    tree.net("lo", None)
    tree.net("docker0", None)
    return tree


def broken(root: Path) -> SysfsTree:
    """The DGX tree after bad luck: garbage numa_node on GPU0, node1 without a cpulist, node 2 online
    but without a directory, a dangling PCI symlink, an interface whose device link dangles, a garbage
    link width on GPU5 and a garbage port state on mlx5_6."""
    tree = dgx_h100(root)
    gpu0 = next(root.glob("devices/pci0000:15/*/*/*/0000:18:00.0"))
    (gpu0 / "numa_node").write_text("banana\n")
    (root / "devices/system/node/node1/cpulist").unlink()
    tree.write("devices/system/node/online", "0-2\n")
    tree.link("bus/pci/devices/0000:ee:00.0", "devices/pci0000:ee/0000:ee:00.0")
    tree.write("devices/virtual/net/eth9/type", "1\n")
    tree.link("devices/virtual/net/eth9/device", "devices/pci0000:ee/0000:ee:01.0")
    tree.link("class/net/eth9", "devices/virtual/net/eth9")
    (next(root.glob("devices/pci0000:95/*/*/*/0000:9a:00.0")) / "current_link_width").write_text("sixteen\n")
    (next(root.glob("devices/pci0000:c5/**/mlx5_6")) / "ports/1/state").write_text("\x00\xff garbage")
    return tree
