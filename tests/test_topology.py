"""The topology collector on synthetic sysfs trees (DGX-H100-shaped, broken, garbage), this host's
/sys and a fake NVML; and the `topo -m` style renderer."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.collectors.topology import PciPlace, nearest_nics, parse_cpulist, pci_relation, read_topology
from cli.topo import render_topology, topology_dict
from tests.sysfs_tree import DGX_GPU_BDFS, NODE0_CPUS, NODE1_CPUS, SysfsTree, broken, dgx_h100

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

LABELS = ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "GPU6", "GPU7", "eno1",
          "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7"]
#                    GPU0 GPU1 GPU2 GPU3 GPU4 GPU5 GPU6 GPU7 eno1 mlx0 mlx1 mlx2 mlx3 mlx4 mlx5 mlx6 mlx7
EXPECTED_ROWS = {
    "GPU0":   "X    PIX  PHB  PHB  SYS  SYS  SYS  SYS  NODE PIX  PIX  PHB  PHB  SYS  SYS  SYS  SYS",
    "GPU3":   "PHB  PHB  PIX  X    SYS  SYS  SYS  SYS  NODE PHB  PHB  PIX  PIX  SYS  SYS  SYS  SYS",
    "GPU4":   "SYS  SYS  SYS  SYS  X    PIX  NODE NODE SYS  SYS  SYS  SYS  SYS  PIX  PIX  NODE NODE",
    "GPU7":   "SYS  SYS  SYS  SYS  NODE NODE PIX  X    SYS  SYS  SYS  SYS  SYS  NODE NODE PIX  PIX",
    "eno1":   "NODE NODE NODE NODE SYS  SYS  SYS  SYS  X    NODE NODE NODE NODE SYS  SYS  SYS  SYS",
    "mlx5_1": "PIX  PIX  PHB  PHB  SYS  SYS  SYS  SYS  NODE PIX  X    PHB  PHB  SYS  SYS  SYS  SYS",
    "mlx5_6": "SYS  SYS  SYS  SYS  NODE NODE PIX  PIX  SYS  SYS  SYS  SYS  SYS  NODE NODE X    PIX",
}


@pytest.fixture
def dgx(tmp_path):
    dgx_h100(tmp_path)
    return tmp_path


def rows_of(topo):
    return {label: list(row.cells) for label, row in zip(topo.matrix.labels, topo.matrix.rows, strict=True)}


def test_dgx_matrix_is_what_nvidia_smi_would_print(dgx):
    topo = read_topology(dgx)
    assert list(topo.matrix.labels) == LABELS
    rows = rows_of(topo)
    for label, expected in EXPECTED_ROWS.items():
        assert rows[label] == expected.split(), label
    for i, a in enumerate(LABELS):
        for j, b in enumerate(LABELS):
            assert rows[a][j] == rows[b][i], (a, b)
    assert topo.warnings == []


def test_dgx_devices_numa_nodes_and_resolved_paths(dgx):
    topo = read_topology(str(dgx))
    assert [(g.name, g.bdf, g.gpu_index, g.numa_node) for g in topo.gpus] == [
        (f"GPU{i}", bdf, i, 0 if i < 4 else 1) for i, bdf in enumerate(DGX_GPU_BDFS)]  # no NVSwitch among them
    gpu4 = topo.gpus[4]
    # Node 1 is listed through absolute symlinks, node 0 through relative ones: both resolve.
    assert gpu4.sysfs_path == str(dgx / "devices/pci0000:95/0000:95:01.0/0000:96:00.0/0000:97:00.0/0000:98:00.0")
    gpu0_path = "devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0"
    assert topo.gpus[0].sysfs_path == str(dgx / gpu0_path)
    assert (gpu4.link_speed, gpu4.link_width, gpu4.max_link_speed, gpu4.max_link_width, gpu4.local_cpulist) == (
        "32.0 GT/s PCIe", 16, "32.0 GT/s PCIe", 16, NODE1_CPUS)
    # ib0 is mlx5_0's own netdev and lo/docker0 are virtual: none of them is a NIC of its own.
    assert [(n.name, n.kind, n.bdf, n.numa_node) for n in topo.nics][:3] == [
        ("eno1", "ethernet", "0000:00:1f.6", 0), ("mlx5_0", "infiniband", "0000:19:00.0", 0),
        ("mlx5_1", "infiniband", "0000:1b:00.0", 0)]
    assert [list(n.port_states) for n in topo.nics[1:]] == [["4: ACTIVE"]] * 3 + [["1: DOWN"]] + [["4: ACTIVE"]] * 4
    assert topo.nics[0].link_speed == "Unknown"
    assert [(n.id, n.cpulist, list(n.distances), n.memory_total_bytes) for n in topo.numa_nodes] == [
        (0, NODE0_CPUS, [10, 21], 1056330580 * 1024), (1, NODE1_CPUS, [21, 10], 1056964608 * 1024)]


def test_dgx_each_gpu_gets_its_own_nic_and_its_sockets_cpus(dgx):
    topo = read_topology(dgx)
    got = [(loc.gpu_index, loc.nearest_nic, loc.nic_relation, loc.numa_node, loc.cpulist) for loc in topo.locality]
    assert got == [
        (i, f"mlx5_{i}", "PIX", 0 if i < 4 else 1, NODE0_CPUS if i < 4 else NODE1_CPUS) for i in range(8)]


def test_broken_tree_gives_warnings_and_defaults_instead_of_raising(tmp_path):
    broken(tmp_path)
    topo = read_topology(tmp_path)
    text = "\n".join(topo.warnings)
    for fragment in ["0000:18:00.0/numa_node holds 'banana'", "node1/cpulist", "NUMA node 2 is online",
                     "bus/pci/devices/0000:ee:00.0 points to", "class/net/eth9/device points to",
                     "0000:9a:00.0/current_link_width holds 'sixteen'", "mlx5_6/ports/1/state"]:
        assert fragment in text
    assert [n.id for n in topo.numa_nodes] == [0, 1] and topo.numa_nodes[1].cpulist == ""
    gpu0 = topo.gpus[0]
    assert (gpu0.name, gpu0.numa_node, gpu0.local_cpulist) == ("GPU0", -1, NODE0_CPUS)
    assert topo.gpus[5].link_width == 0 and list(topo.nics[7].port_states) == []
    rows = rows_of(topo)
    # Unknown NUMA node on a two-socket host: across roots GPU0 can only be SYS, below its root nothing changes.
    assert rows["GPU0"][LABELS.index("eno1")] == "SYS" and rows["GPU1"][LABELS.index("eno1")] == "NODE"
    assert rows["GPU0"][LABELS.index("mlx5_0")] == "PIX"
    assert topo.locality[0].cpulist == NODE0_CPUS  # from the GPU's local_cpulist, its node being unknown


def test_two_switch_levels_are_pxb(tmp_path):
    tree = SysfsTree(tmp_path)
    tree.write("devices/system/node/online", "0\n")
    tree.numa_node(0, "0-7", "10", 1 << 20)
    top = "pci0000:00/0000:00:01.0/0000:01:00.0"  # root port, upstream port of the top switch
    for bridge in [top, f"{top}/0000:02:00.0", f"{top}/0000:02:01.0", f"{top}/0000:02:01.0/0000:04:00.0",
                   f"{top}/0000:02:01.0/0000:04:00.0/0000:05:00.0"]:
        tree.bridge(bridge, 0, "0-7")
    tree.pci(f"{top}/0000:02:00.0/0000:03:00.0", "0x10de", "0x030200", 0, "0-7")
    nic = tree.pci(f"{top}/0000:02:01.0/0000:04:00.0/0000:05:00.0/0000:06:00.0", "0x15b3", "0x020000", 0, "0-7")
    tree.net("eth0", nic)
    topo = read_topology(tmp_path)
    assert [list(r.cells) for r in topo.matrix.rows] == [["X", "PXB"], ["PXB", "X"]]
    assert (topo.locality[0].nearest_nic, topo.locality[0].nic_relation) == ("eth0", "PXB")


@pytest.mark.parametrize("a,b,numa,expected", [
    (("pci0000:15", "rp", "up", "down1"), ("pci0000:15", "rp", "up", "down2"), (0, 0), "PIX"),
    (("pci0000:15", "rp", "up", "down1"), ("pci0000:15", "rp", "up", "down1"), (0, 0), "PIX"),
    (("pci0000:15", "rp"), ("pci0000:15", "rp"), (0, 0), "PIX"),  # two functions of one card on a root port
    (("pci0000:15", "rp", "up", "down1"), ("pci0000:15", "rp", "up", "down2", "up2", "down3"), (0, 0), "PXB"),
    (("pci0000:15", "rp1", "up", "down1"), ("pci0000:15", "rp2", "up", "down1"), (0, 0), "PHB"),
    (("pci0000:15",), ("pci0000:15", "rp2"), (0, 0), "PHB"),  # an integrated device beside a root port
    (("pci0000:15", "rp"), ("pci0000:95", "rp"), (1, 1), "NODE"),
    (("pci0000:15", "rp"), ("pci0000:95", "rp"), (0, 1), "SYS"),
    (("pci0000:15", "rp"), ("pci0000:95", "rp"), (-1, -1), "SYS"),
    (None, ("pci0000:95", "rp"), (1, 1), "NODE"),
])
def test_pci_relation(a, b, numa, expected):
    def place(spec):
        return None if spec is None else PciPlace(spec[0], tuple(spec[1:]))
    assert pci_relation(place(a), place(b), *numa) == expected
    assert pci_relation(place(b), place(a), *reversed(numa)) == expected


def test_nearest_nic_prefers_the_relation_then_a_nic_no_other_gpu_took_then_the_name():
    names = ["mlx5_10", "mlx5_2", "eth0"]
    relations = [["PIX", "PIX", "SYS"], ["PIX", "PIX", "SYS"], ["PIX", "PIX", "SYS"], ["SYS", "NODE", "PHB"]]
    assert nearest_nics(relations, names) == [("mlx5_2", "PIX"), ("mlx5_10", "PIX"), ("mlx5_2", "PIX"), ("eth0", "PHB")]
    assert nearest_nics([["X"]], []) == [("", "")]


@pytest.mark.parametrize("text,ids", [("0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]), ("", []), ("5", [5])])
def test_parse_cpulist(text, ids):
    assert parse_cpulist(text) == ids


@pytest.mark.parametrize("text", ["0-", "3-1", "a", "0,,1", "0-4294967295", "0:2", "٣"])
def test_parse_cpulist_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_cpulist(text)


@given(st.sets(st.integers(0, 300), max_size=40))
def test_parse_cpulist_reads_back_any_set_written_as_ranges(cpus):
    ranges, ordered = [], sorted(cpus)
    for cpu in ordered:
        if ranges and ranges[-1][1] == cpu - 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    text = ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in ranges)
    assert parse_cpulist(text) == ordered


@given(st.text(max_size=30))
def test_parse_cpulist_either_parses_or_says_value_error(text):
    try:
        ids = parse_cpulist(text)
    except ValueError:
        return
    assert ids == sorted(set(ids))


def test_this_hosts_sys_has_numa_node_0_with_cpus():
    if not Path("/sys/devices/system/node/node0").is_dir():
        pytest.skip("this kernel shows no NUMA nodes")
    topo = read_topology()
    node0 = next(n for n in topo.numa_nodes if n.id == 0)
    assert parse_cpulist(node0.cpulist)
    assert len(topo.matrix.labels) == len(topo.gpus) + len(topo.nics) == len(topo.matrix.rows)


GARBAGE = st.one_of(st.binary(max_size=40), st.sampled_from([
    b"", b"-1", b"-2", b"99999999999999999999999", b"0-4294967295", b"0-2", b"1-0", b"\x00", b"4:", b"0x10de",
    b"0x030200", b"Node 0 MemTotal: 99999999999999999999 kB", b"10 21 999", b"\xff\xfe",
]))


@pytest.fixture(scope="module")
def shared_dgx(tmp_path_factory):
    """One DGX tree for all hypothesis examples (building one per example is slow); each example
    puts back what it changed."""
    root = tmp_path_factory.mktemp("dgx")
    dgx_h100(root)
    return root, sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_garbage_in_any_file_never_raises(shared_dgx, data):
    root, files = shared_dgx
    chosen = data.draw(st.lists(st.sampled_from(files), min_size=1, max_size=8, unique=True))
    originals = {path: path.read_bytes() for path in chosen}
    try:
        for path in chosen:
            if data.draw(st.booleans()):
                path.write_bytes(data.draw(GARBAGE))
            else:
                path.unlink()
        topo = read_topology(root)
        labels = list(topo.matrix.labels)
        assert len(topo.matrix.rows) == len(labels) == len(topo.gpus) + len(topo.nics)
        assert all(row.cells[i] == "X" for i, row in enumerate(topo.matrix.rows))
        assert len(topo.locality) == len(topo.gpus)
        render_topology(topo)
        json.dumps(topology_dict(topo))
    finally:
        for path, content in originals.items():
            path.write_bytes(content)


class FakeNvmlError(Exception):
    pass


class FakeNotSupported(FakeNvmlError):
    pass


class FakeNvml:
    """Just the pynvml calls the collector makes. Handles are ints; `links` maps (handle, link) to the
    remote GPU's bus id or "switch"; every other link, and any query not set up, is NotSupported."""

    NVMLError = FakeNvmlError
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def __init__(self, bdfs, links=None, ancestor=None):
        self.bus_ids = [f"0000{bdf.upper()}" for bdf in bdfs]  # NVML writes an 8-digit domain, upper case
        self.links = links or {}
        self.ancestor = ancestor

    def _link(self, handle, link):
        if (handle, link) not in self.links:
            raise FakeNotSupported()
        return self.links[handle, link]

    def nvmlDeviceGetCount(self):
        return len(self.bus_ids)

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetPciInfo(self, handle):
        return SimpleNamespace(busId=self.bus_ids[handle].encode())

    def nvmlDeviceGetNvLinkState(self, handle, link):
        self._link(handle, link)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        switch = self._link(handle, link) == "switch"
        return self.NVML_NVLINK_DEVICE_TYPE_SWITCH if switch else self.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        return SimpleNamespace(busId=f"0000{self._link(handle, link).upper()}".encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        if self.ancestor is None:
            raise FakeNotSupported()
        return self.ancestor


def test_direct_nvlinks_are_counted_per_gpu_pair_and_the_rest_comes_from_sysfs(dgx):
    links = {(0, link): DGX_GPU_BDFS[1] for link in range(4)} | {(1, link): DGX_GPU_BDFS[0] for link in range(4)}
    topo = read_topology(dgx, nvml=FakeNvml(DGX_GPU_BDFS, links))
    rows = rows_of(topo)
    assert rows["GPU0"] == ["X", "NV4", *EXPECTED_ROWS["GPU0"].split()[2:]]
    assert rows["GPU1"][:3] == ["NV4", "X", "PHB"]
    assert rows["mlx5_1"] == EXPECTED_ROWS["mlx5_1"].split()
    assert topo.warnings == []


def test_gpus_on_nvswitches_are_nv18_to_each_other_and_nvml_levels_win_for_pcie(dgx):
    links = {(gpu, link): "switch" for gpu in range(7) for link in range(18)}  # GPU7's NVLinks are down
    topo = read_topology(dgx, nvml=FakeNvml(DGX_GPU_BDFS, links, ancestor=20),
                         nvml_handles=list(range(8)))
    rows = rows_of(topo)
    assert rows["GPU0"][:8] == ["X", "NV18", "NV18", "NV18", "NV18", "NV18", "NV18", "PXB"]
    assert rows["GPU7"][:8] == ["PXB"] * 7 + ["X"]
    assert rows["GPU0"][8:] == EXPECTED_ROWS["GPU0"].split()[8:]  # NICs stay sysfs relations


def test_nvml_order_numbers_the_gpus(dgx):
    order = list(reversed(DGX_GPU_BDFS[:7]))  # NVML sees 7 GPUs, the last in bus order first
    topo = read_topology(dgx, nvml=FakeNvml(order))
    assert [(g.name, g.bdf) for g in topo.gpus] == [(f"GPU{i}", bdf) for i, bdf in enumerate(order)] + [
        ("GPU7", DGX_GPU_BDFS[7])]
    assert topo.warnings == [f"GPU {DGX_GPU_BDFS[7]} is not among NVML's devices; it is numbered after them."]
    assert (topo.locality[0].nearest_nic, topo.locality[0].cpulist) == ("mlx5_6", NODE1_CPUS)


def test_render_looks_like_nvidia_smi_topo_m(dgx):
    text = render_topology(read_topology(dgx))
    lines = text.splitlines()
    assert lines[0].split() == [*LABELS, "CPU", "Affinity", "NUMA", "Affinity"]
    assert lines[1].split() == ["GPU0", *EXPECTED_ROWS["GPU0"].split(), NODE0_CPUS, "0"]
    assert lines[9].split() == ["eno1", *EXPECTED_ROWS["eno1"].split()]
    for line in ["Legend:", "  X    = Self", "  PIX  = Connection traversing at most a single PCIe bridge",
                 "  NV#  = Connection traversing a bonded set of # NVLinks", "GPU locality:", "NUMA nodes:"]:
        assert line in lines
    assert "  GPU5  mlx5_5       PIX       1     56-111,168-223" in lines
    assert "  1     56-111,168-223  21 10      1008.0 GiB" in lines
    assert "Warnings:" not in lines


def test_render_lists_warnings_and_json_is_plain(tmp_path):
    broken(tmp_path)
    topo = read_topology(tmp_path)
    lines = render_topology(topo).splitlines()
    assert "Warnings:" in lines and f"  - {topo.warnings[0]}" in lines
    assert lines[1].split()[-2:] == [NODE0_CPUS, "N/A"]
    out = json.loads(json.dumps(topology_dict(topo)))
    assert out["matrix"]["labels"] == LABELS and out["matrix"]["rows"][0][:2] == ["X", "PIX"]
    assert out["gpus"][0]["numa_node"] is None and out["gpus"][0]["gpu_index"] == 0
    assert out["nics"][1]["port_states"] == ["4: ACTIVE"]
    assert out["locality"][1] == {"gpu_index": 1, "nearest_nic": "mlx5_1", "nic_relation": "PIX", "numa_node": 0,
                                  "cpulist": NODE0_CPUS}
    assert out["warnings"] == list(topo.warnings)


def test_directory_where_a_file_belongs_is_a_warning(dgx):
    path = dgx / "devices/system/node/node1/distance"
    path.unlink()
    path.mkdir()
    topo = read_topology(dgx)
    assert list(topo.numa_nodes[1].distances) == []
    assert "Cannot read devices/system/node/node1/distance (Is a directory)." in topo.warnings


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_a_warning(dgx):
    path = dgx / "devices/system/node/node0/distance"
    path.chmod(0)
    topo = read_topology(dgx)
    assert list(topo.numa_nodes[0].distances) == []
    assert "Cannot read devices/system/node/node0/distance (Permission denied)." in topo.warnings
