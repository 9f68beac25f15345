"""GPU backends: simulated, NVML against a fake `pynvml` that fails the way NVML does, and selection."""

import pytest

from agent.collectors import gpu
from agent.collectors.nvml import NvmlBackend, NvmlUnavailable
from agent.collectors.sim import SimBackend
from phalanx.v1 import common_pb2
from tests.fake_pynvml import FakeNvml

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


def test_nvml_reads_identity_and_telemetry():
    backend = NvmlBackend(FakeNvml(count=2))
    assert backend.kind == common_pb2.GPU_BACKEND_KIND_NVML
    assert backend.driver_version == "550.54.15"
    inv = backend.inventory()
    assert [g.uuid for g in inv] == ["GPU-00000000-0000-4000-8000-000000000000",
                                     "GPU-00000001-0000-4000-8000-000000000001"]
    assert inv[1].pci_bus_id == "00000000:28:00.0" and inv[0].name == "NVIDIA H100 80GB HBM3"
    sample = backend.sample()
    assert (sample[0].temperature_c, sample[0].power_w, sample[0].utilization_percent) == (41.0, 123.456, 97.0)


def test_nvml_not_supported_is_per_field():
    fake = FakeNvml(count=1)
    fake.gpus[0].unsupported("serial", "power_usage_mw", "temperature")
    backend = NvmlBackend(fake)
    (info,) = backend.inventory()
    assert info.serial == "" and info.uuid == "GPU-00000000-0000-4000-8000-000000000000"
    (sample,) = backend.sample()
    assert sample.power_w == 0.0 and sample.temperature_c == 0.0 and sample.utilization_percent == 97.0


def test_nvml_without_a_driver_is_unavailable():
    with pytest.raises(NvmlUnavailable, match="NVML Shared Library Not Found"):
        NvmlBackend(FakeNvml(init_error="NVMLError_LibraryNotFound"))


def test_auto_falls_back_to_no_gpus_and_nvml_refuses(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_error="NVMLError_LibraryNotFound"))
    backend, note = gpu.select("auto", 8, "n1")
    assert isinstance(backend, gpu.NoGpus) and backend.inventory() == [] and backend.sample() == []
    assert note == "no NVIDIA driver found (NVML Shared Library Not Found); reporting no GPUs"
    with pytest.raises(gpu.GpuBackendError, match=r"gpu\.backend is 'nvml' but NVML cannot start"):
        gpu.select("nvml", 8, "n1")


def test_auto_uses_nvml_when_present(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(count=4))
    backend, note = gpu.select("auto", 8, "n1")
    assert isinstance(backend, NvmlBackend) and len(backend.inventory()) == 4
    assert note == "NVML backend with 4 GPUs (driver 550.54.15)"


def test_sim_identities_are_stable_per_node_and_distinct_across_nodes():
    a1, a2, b = SimBackend(8, "node-a"), SimBackend(8, "node-a"), SimBackend(8, "node-b")
    assert [g.uuid for g in a1.inventory()] == [g.uuid for g in a2.inventory()]
    assert not {g.uuid for g in a1.inventory()} & {g.uuid for g in b.inventory()}
    assert len({g.pci_bus_id for g in a1.inventory()}) == 8
    assert [t.index for t in a1.sample()] == list(range(8))


def test_the_real_pynvml_on_this_host():
    """Exercise the real module: on a GPU host NVML answers; elsewhere auto must fall back cleanly."""
    try:
        backend = NvmlBackend()
    except NvmlUnavailable:
        chosen, note = gpu.select("auto", 8, "n1")
        assert isinstance(chosen, gpu.NoGpus) and note.startswith("no NVIDIA driver found (")
        return
    try:
        for info in backend.inventory():
            assert info.uuid.startswith("GPU-")
        assert len(backend.sample()) == len(backend.inventory())
    finally:
        backend.close()
