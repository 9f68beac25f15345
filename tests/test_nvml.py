"""NvmlBackend against the fake NVML: every field, per-field NotSupported, lost GPUs, XID events,
the fixture recorder round trip, recorded fixtures, and the DCGM health source."""

import json
import sys
import threading
import types
from pathlib import Path

import pytest

from agent.collectors import dcgm
from agent.collectors.nvml import QUERY_FIELDS, RECOVERY_ACTIONS, NvmlBackend, NvmlUnavailable, sample_queries
from phalanx.v1 import common_pb2
from tests.fake_pynvml import NOT_SUPPORTED, FakeNvml, Raise

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import record_nvml_fixture  # noqa: E402

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

FIXTURES = sorted((ROOT / "tests" / "fixtures").glob("nvml_*.json"))
OPTIONAL = [f.name for f in common_pb2.GpuTelemetry.DESCRIPTOR.fields if f.has_presence]


def set_fields(t: common_pb2.GpuTelemetry) -> set[str]:
    return {f for f in OPTIONAL if t.HasField(f)}


@pytest.fixture
def fake():
    return FakeNvml(count=2)


@pytest.fixture
def backend(fake):
    b = NvmlBackend(fake, event_wait_ms=20)
    yield b
    b.close()


def test_every_field_is_read_and_converted(fake, backend):
    fake.gpus[1].set(temperature=77, sm_clock=1410, power_usage_mw=512_250, utilization_gpu=55, memory_used=4096,
                     ecc_sbe_volatile=3, ecc_dbe_volatile=1, ecc_sbe_aggregate=30, ecc_dbe_aggregate=2,
                     remapped_rows=[5, 1, 1, 0], retired_pages_sbe=4, retired_pages_dbe=2, retired_pages_pending=1,
                     slowdown_temperature=90, clocks_event_reasons=0x20 | 0x40, power_limit_mw=650_000,
                     pcie_link_gen=4, pcie_link_width=8, pcie_max_link_gen=5, pcie_max_link_width=16,
                     pcie_replay_count=12, recovery_action=fake.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    fake.gpus[1].nvlink_state = {**dict.fromkeys(range(18), 1), 3: 0, 9: 0}
    fake.gpus[1].nvlink_counters = {(0, "DL_REPLAY"): 2, (3, "DL_CRC_FLIT"): 5, (17, "DL_CRC_DATA"): 1,
                                    (9, "DL_RECOVERY"): 4}
    t = backend.sample()[1]
    assert t == common_pb2.GpuTelemetry(
        index=1, temperature_c=77.0, sm_clock_mhz=1410, power_w=512.25, utilization_percent=55.0,
        memory_used_bytes=4096,
        ecc_sbe_volatile=3, ecc_dbe_volatile=1, ecc_sbe_aggregate=30, ecc_dbe_aggregate=2,
        remapped_rows_correctable=5, remapped_rows_uncorrectable=1, remap_pending=True, remap_failure=False,
        retired_pages_sbe=4, retired_pages_dbe=2, retired_pages_pending=True, slowdown_temperature_c=90.0,
        clocks_event_reasons=0x60, power_limit_w=650.0, pcie_link_gen=4, pcie_link_width=8, pcie_max_link_gen=5,
        pcie_max_link_width=16, pcie_replay_count=12, nvlink_links_total=18, nvlink_links_up=16,
        nvlink_error_count=12, recovery_action=common_pb2.GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    assert set_fields(backend.sample()[0]) == set(OPTIONAL)  # the default fake answers everything


@pytest.mark.parametrize("query", [q for q in QUERY_FIELDS if q != "nvlink"])
def test_not_supported_leaves_only_that_field_unset(fake, backend, query):
    fake.gpus[0].unsupported(query)
    t0, t1 = backend.sample()
    missing = {f for f in QUERY_FIELDS[query] if f in OPTIONAL}
    assert set_fields(t0) == set(OPTIONAL) - missing and set_fields(t1) == set(OPTIONAL)
    assert not t0.lost
    if query == "recovery_action":
        assert t0.recovery_action == common_pb2.GPU_RECOVERY_ACTION_UNSPECIFIED


def test_no_permission_and_other_errors_are_per_field_too(fake, backend):
    fake.gpus[0].set(ecc_dbe_volatile=Raise("NVMLError_NoPermission"), pcie_replay_count=Raise("NVMLError_Unknown"))
    t = backend.sample()[0]
    assert set_fields(t) == set(OPTIONAL) - {"ecc_dbe_volatile", "pcie_replay_count"} and not t.lost


def test_a_gpu_without_nvlink_reports_no_nvlink_fields(fake, backend):
    fake.gpus[0].nvlink_state = {}
    assert set_fields(backend.sample()[0]) == set(OPTIONAL) - set(QUERY_FIELDS["nvlink"])


def test_unsupported_queries_and_missing_links_are_not_asked_again(fake, backend):
    fake.gpus[0].unsupported("temperature")
    for _ in range(3):
        backend.sample()
    calls = fake.gpus[0].calls
    assert calls["nvmlDeviceGetTemperature"] == 1 and calls["nvmlDeviceGetPowerUsage"] == 3
    assert calls["nvmlDeviceGetNvLinkState"] == fake.NVML_NVLINK_MAX_LINKS + 2 * 18  # one probe, then 18 links
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 2  # handles looked up once, at start


def test_a_lost_gpu_is_flagged_and_the_others_are_untouched(fake, backend):
    fake.gpus[0].lost = True
    fake.gpus[0].calls.clear()
    t0, t1 = backend.sample()
    assert t0.lost and set_fields(t0) == set() and sum(fake.gpus[0].calls.values()) == 1  # the rest skipped
    assert not t1.lost and set_fields(t1) == set(OPTIONAL)
    fake.gpus[0].lost = False  # lost is not cached: a GPU that answers again is read again
    t0 = backend.sample()[0]
    assert not t0.lost and set_fields(t0) == set(OPTIONAL)


def test_lost_midway_keeps_the_flag(fake, backend):
    fake.gpus[1].set(ecc_sbe_aggregate=Raise("NVMLError_GpuIsLost"))
    t0, t1 = backend.sample()
    assert t1.lost and not t1.HasField("ecc_dbe_aggregate") and not t0.lost


def test_a_gpu_without_a_handle_at_start_does_not_stop_the_others():
    fake = FakeNvml(count=3)
    fake.gpus[1].handle_error = Raise("NVMLError_GpuIsLost")
    backend = NvmlBackend(fake)
    assert [g.uuid for g in backend.inventory()] == [fake.gpus[0].values["uuid"], "", fake.gpus[2].values["uuid"]]
    assert [t.lost for t in backend.sample()] == [False, True, False]


@pytest.mark.parametrize("error", ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission"])
def test_no_driver_is_unavailable(error):
    with pytest.raises(NvmlUnavailable):
        NvmlBackend(FakeNvml(init_error=error))


@pytest.mark.parametrize("nvml_value,proto",
                         [*RECOVERY_ACTIONS.items(), (7, common_pb2.GPU_RECOVERY_ACTION_UNSPECIFIED)])
def test_recovery_action_mapping(fake, backend, nvml_value, proto):
    fake.gpus[0].set(recovery_action=nvml_value)
    assert backend.sample()[0].recovery_action == proto
    assert RECOVERY_ACTIONS[fake.NVML_GPU_RECOVERY_ACTION_GPU_RESET] == common_pb2.GPU_RECOVERY_ACTION_GPU_RESET


def test_recovery_action_is_not_asked_where_pynvml_lacks_the_field(fake):
    del fake.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
    t = NvmlBackend(fake).sample()[0]
    assert t.recovery_action == common_pb2.GPU_RECOVERY_ACTION_UNSPECIFIED
    assert fake.gpus[0].calls["nvmlDeviceGetFieldValues"] == 0 and t.HasField("pcie_replay_count")


def test_clocks_event_reasons_fall_back_to_the_deprecated_call(fake, monkeypatch):
    monkeypatch.delattr(FakeNvml, "nvmlDeviceGetCurrentClocksEventReasons")  # an older pynvml
    fake.gpus[0].set(clocks_event_reasons=0x8)
    assert NvmlBackend(fake).sample()[0].clocks_event_reasons == 0x8
    assert fake.gpus[0].calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1


def test_clocks_event_reasons_fall_back_when_the_driver_lacks_the_new_call(fake):
    fake.nvmlDeviceGetCurrentClocksEventReasons = lambda h: (_ for _ in ()).throw(fake.NVMLError_FunctionNotFound())
    fake.gpus[0].set(clocks_event_reasons=0x4)
    assert NvmlBackend(fake).sample()[0].clocks_event_reasons == 0x4


# -- XID events ------------------------------------------------------------------------------------


class Inbox:
    def __init__(self, want: int = 1) -> None:
        self.events: list[common_pb2.GpuEvent] = []
        self.want, self.done = want, threading.Event()

    def __call__(self, event: common_pb2.GpuEvent) -> None:
        self.events.append(event)
        if len(self.events) >= self.want:
            self.done.set()


def test_xids_are_delivered_and_close_stops_the_thread(fake, backend):
    inbox = Inbox(want=2)
    backend.start_events(inbox)
    fake.inject_xid(1, 79)
    fake.inject_xid(0, 48)
    assert inbox.done.wait(10)
    assert [(e.gpu_index, e.xid) for e in inbox.events] == [(1, 79), (0, 48)]
    assert inbox.events[0].message == "GPU has fallen off the bus" and inbox.events[0].time_unix_ns > 0
    backend.close()
    assert not [t for t in threading.enumerate() if t.name == "phalanx-nvml-xid"]
    assert fake.event_sets[0].freed and fake.shutdowns == 1


def test_gpus_without_xid_events_are_skipped(fake, backend):
    fake.gpus[0].set(supported_event_types=fake.nvmlEventTypeSingleBitEccError)
    inbox = Inbox()
    backend.start_events(inbox)
    fake.inject_xid(0, 13)
    fake.inject_xid(1, 31)
    assert inbox.done.wait(10)
    assert [(e.gpu_index, e.xid) for e in inbox.events] == [(1, 31)]
    assert fake.event_sets[0].registered == {fake.gpus[1].handle}


def test_the_thread_survives_wait_errors_and_a_failing_emit(fake, backend):
    fake.wait_errors = ["NVMLError_Unknown", "NVMLError_GpuIsLost"]
    inbox, calls = Inbox(), []

    def emit(event):
        calls.append(event)
        if len(calls) == 1:
            raise RuntimeError("the link is down")
        inbox(event)

    backend.start_events(emit)
    fake.inject_xid(0, 94)
    fake.inject_xid(0, 95)
    assert inbox.done.wait(10)
    assert [e.xid for e in calls] == [94, 95]


def test_no_gpu_with_xid_events_ends_the_thread_cleanly(fake, backend):
    for gpu in fake.gpus:
        gpu.unsupported("supported_event_types")
    backend.start_events(Inbox())
    backend.close()
    assert fake.event_sets[0].freed and fake.shutdowns == 1


# -- fixtures --------------------------------------------------------------------------------------


def _varied_fake() -> FakeNvml:
    fake = FakeNvml(count=3)
    fake.gpus[0].unsupported("retired_pages_sbe", "retired_pages_dbe", "retired_pages_pending")
    fake.gpus[0].set(ecc_sbe_volatile=7, recovery_action=fake.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    fake.gpus[0].nvlink_state = {**dict.fromkeys(range(18), 1), 4: 0, 11: Raise("NVMLError_Unknown")}
    fake.gpus[0].nvlink_counters = {(2, "DL_REPLAY"): 9, (4, "DL_CRC_DATA"): NOT_SUPPORTED}
    fake.gpus[1].nvlink_state = {}
    fake.gpus[1].unsupported("remapped_rows", "recovery_action")
    fake.gpus[2].lost = True
    return fake


def test_recorder_round_trip_reproduces_the_sample():
    original = _varied_fake()
    fixture = json.loads(json.dumps(record_nvml_fixture.record(original, keep_ids=True)))
    replayed = FakeNvml.from_fixture(fixture)
    a, b = NvmlBackend(original), NvmlBackend(replayed)
    assert a.inventory() == b.inventory() and b.driver_version == "550.54.15"
    assert a.sample() == b.sample()
    assert b.sample()[2].lost and b.sample()[0].nvlink_links_up == 16


def test_recorder_hides_gpu_identities_unless_asked(fake):
    fixture = record_nvml_fixture.record(fake)
    queries = fixture["gpus"][1]["queries"]
    assert queries["uuid"]["value"] != fake.gpus[1].values["uuid"] and queries["serial"]["value"] == "0000000000001"
    assert set(queries) >= set(sample_queries(fake))


def test_recorder_main_writes_a_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _varied_fake())
    out = tmp_path / "nvml_fake.json"
    assert record_nvml_fixture.main(["-o", str(out)]) == 0
    assert json.loads(out.read_text())["format"] == record_nvml_fixture.FORMAT
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_error="NVMLError_LibraryNotFound"))
    assert record_nvml_fixture.main(["-o", str(out)]) == 1


@pytest.mark.parametrize("path", [*FIXTURES, None], ids=[*(p.name for p in FIXTURES), "recorded-from-the-fake"])
def test_recorded_fixture_replays(path):
    """Each fixture recorded on a real GPU: every answered query fills its field, every NotSupported does not.

    One case is always a fixture recorded from the fake, so the test never runs empty (or skipped)
    on a checkout without real recordings.
    """
    fixture = json.loads(path.read_text()) if path else record_nvml_fixture.record(_varied_fake())
    name = path.name if path else "recorded-from-the-fake"
    backend = NvmlBackend(FakeNvml.from_fixture(fixture))
    samples = backend.sample()
    assert len(samples) == len(fixture["gpus"]) == len(backend.inventory())
    for t, gpu in zip(samples, fixture["gpus"], strict=True):
        answers = gpu["queries"]
        if t.lost:
            assert any(a.get("error") == "NVMLError_GpuIsLost" for a in answers.values()) or "error" in gpu["handle"]
            continue
        for query, answer in answers.items():
            for f in (f for f in QUERY_FIELDS.get(query, ()) if f in OPTIONAL):
                assert t.HasField(f) == ("value" in answer), (name, gpu["index"], query)


# -- DCGM ------------------------------------------------------------------------------------------


def test_dcgm_without_bindings_is_none_with_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydcgm", None)
    health, reason = dcgm.DcgmHealth.probe(bindings_dirs=())
    assert health is None and reason.startswith("DCGM Python bindings not installed (pydcgm")
    assert dcgm.DcgmHealth.try_start(bindings_dirs=()) is None


def _fake_dcgm(monkeypatch, incidents, connect_error=None):
    structs = types.SimpleNamespace(DCGM_HEALTH_WATCH_PCIE=0x1, DCGM_HEALTH_WATCH_NVLINK=0x2,
                                    DCGM_HEALTH_WATCH_MEM=0x10, DCGM_HEALTH_WATCH_ALL=0xFFFFFFFF,
                                    DCGM_HEALTH_WATCH_COUNT_V2=12,
                                    DCGM_HEALTH_RESULT_PASS=0, DCGM_HEALTH_RESULT_WARN=10, DCGM_HEALTH_RESULT_FAIL=20)
    state = {"set": None, "checks": 0, "shutdown": False}

    class Health:
        def Set(self, systems):
            state["set"] = systems

        def Check(self):
            state["checks"] += 1
            items = incidents if state["checks"] > 1 else []
            return types.SimpleNamespace(overallHealth=20 if items else 0, incidentCount=len(items), incidents=[
                types.SimpleNamespace(system=s, health=h, error=types.SimpleNamespace(msg=m.encode(), code=0),
                                      entityInfo=types.SimpleNamespace(entityGroupId=g, entityId=e))
                for g, e, s, h, m in items])

    class DcgmHandle:
        def __init__(self, ipAddress=None, timeoutMs=0):
            if connect_error:
                raise connect_error

        def GetSystem(self):
            return types.SimpleNamespace(GetDefaultGroup=lambda: types.SimpleNamespace(health=Health()))

        def Shutdown(self):
            state["shutdown"] = True

    monkeypatch.setitem(sys.modules, "pydcgm", types.SimpleNamespace(DcgmHandle=DcgmHandle))
    monkeypatch.setitem(sys.modules, "dcgm_structs", structs)
    monkeypatch.setitem(sys.modules, "dcgm_fields", types.SimpleNamespace(DCGM_FE_GPU=1, DCGM_FE_SWITCH=3))
    return state


def test_dcgm_incidents_are_mapped_per_gpu(monkeypatch):
    state = _fake_dcgm(monkeypatch, [(1, 3, 0x10, 20, "Detected a volatile DBE on GPU 3"),
                                     (1, 3, 0x2, 10, "NVLink link 4 down"),
                                     (1, 0, 0x1, 10, "PCIe replay rate high"),
                                     (3, 0, 0x800, 20, "NVSwitch fatal error")])
    health = dcgm.DcgmHealth.try_start()
    assert health is not None and state["set"] == 0xFFFFFFFF and state["checks"] == 1
    assert health.check() == {3: ["fail mem: Detected a volatile DBE on GPU 3", "warn nvlink: NVLink link 4 down"],
                              0: ["warn pcie: PCIe replay rate high"]}
    health.close()
    assert state["shutdown"]


def test_dcgm_without_a_host_engine_is_none_with_a_reason(monkeypatch):
    _fake_dcgm(monkeypatch, [], connect_error=ConnectionError("Connection to the host engine is not valid"))
    health, reason = dcgm.DcgmHealth.probe()
    assert health is None
    assert reason == ("cannot connect to nv-hostengine at 127.0.0.1 "
                      "(ConnectionError: Connection to the host engine is not valid)")


def test_a_query_the_bindings_lack_is_treated_as_not_supported(fake, backend, monkeypatch):
    monkeypatch.delattr(FakeNvml, "nvmlDeviceGetRemappedRows")  # an older nvidia-ml-py
    t0, t1 = backend.sample()
    assert set_fields(t0) == set_fields(t1) == set(OPTIONAL) - set(QUERY_FIELDS["remapped_rows"])
