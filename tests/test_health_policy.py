"""The health policy as a table: signals (and their history) in, verdict and reasons out. Virtual time."""

import pytest

from controller.config import HealthConfig
from controller.nodes.health import DEGRADED, FAILED, FAILING, HEALTHY, GpuHistory, evaluate_gpu, evaluate_node
from phalanx.v1 import common_pb2

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

CFG = HealthConfig()


def healthy(**changes) -> common_pb2.GpuTelemetry:
    """What a simulated H100 reports when nothing is wrong, with `changes` applied."""
    t = common_pb2.GpuTelemetry(
        index=0, temperature_c=40, power_w=120, ecc_sbe_volatile=0, ecc_dbe_volatile=0, ecc_sbe_aggregate=0,
        ecc_dbe_aggregate=0, remapped_rows_correctable=0, remapped_rows_uncorrectable=0, remap_pending=False,
        remap_failure=False, slowdown_temperature_c=87, clocks_event_reasons=0, power_limit_w=700, pcie_link_gen=5,
        pcie_link_width=16, pcie_max_link_gen=5, pcie_max_link_width=16, pcie_replay_count=0, nvlink_links_total=18,
        nvlink_links_up=18, nvlink_error_count=0, recovery_action=common_pb2.GPU_RECOVERY_ACTION_NONE)
    for key, value in changes.items():
        setattr(t, key, value)
    return t


def verdict_of(telemetry, xids=(), cfg=CFG):
    h = GpuHistory()
    h.observe(healthy(), 100.0, 99.0, cfg.window_s)
    h.observe(telemetry, 101.0, 100.0, cfg.window_s)
    for xid in xids:
        h.record_xid(xid, 101.0, cfg.window_s)
    return evaluate_gpu(h, 101.0, cfg)


@pytest.mark.parametrize("changes,xids,health,reason", [
    ({}, (), HEALTHY, None),
    ({"lost": True}, (), FAILED, "GPU is lost (fell off the bus)"),
    ({}, (79,), FAILED, "XID 79: GPU has fallen off the bus: reboot the node"),
    ({"ecc_dbe_volatile": 1}, (48,), FAILED, "XID 48: double-bit ECC error: reset the GPU"),
    ({"ecc_dbe_volatile": 1}, (), FAILED, "uncorrectable ECC errors in the last 60s"),
    ({"remap_failure": True}, (), FAILED, "row remapping failed: RMA the GPU"),
    ({"remap_pending": True, "remapped_rows_uncorrectable": 1}, (), FAILING,
     "row remap pending (applied at the next GPU reset)"),
    ({"retired_pages_pending": True}, (), FAILING, "page retirement pending"),
    ({"ecc_sbe_volatile": 20}, (), FAILING, "corrected ECC errors at 1200/min (limit 600)"),
    ({"ecc_sbe_volatile": 1}, (), DEGRADED, "corrected ECC errors rising: 60/min"),
    ({"temperature_c": 90, "clocks_event_reasons": 0x40}, (), DEGRADED, "thermal slowdown (90 C, slowdown at 87 C)"),
    ({"clocks_event_reasons": 0x80}, (), DEGRADED, "power brake slowdown"),
    ({"pcie_link_width": 8}, (), DEGRADED, "PCIe link x8 of x16"),
    ({"pcie_link_gen": 1}, (), HEALTHY, None),  # idle GPUs downshift the link generation to save power
    ({"pcie_replay_count": 5}, (), DEGRADED, "PCIe replays at 300/min"),
    ({"nvlink_links_up": 16}, (), DEGRADED, "2 of 18 NVLinks down"),
    ({"nvlink_error_count": 200}, (), FAILING, "NVLink errors at 12000/min"),
    ({"recovery_action": common_pb2.GPU_RECOVERY_ACTION_GPU_RESET}, (), FAILED, "driver asks for a GPU reset"),
    ({"recovery_action": common_pb2.GPU_RECOVERY_ACTION_DRAIN_P2P}, (), FAILING,
     "driver asks to drain peer-to-peer traffic"),
    ({}, (13,), HEALTHY, None),  # one application error is the application's business
    ({}, (13, 31, 13), DEGRADED, "3 application XIDs (13, 31) in 60s: repeats on one GPU suggest hardware"),
    ({}, (63,), DEGRADED, "XID 63: row remapping event: watch the trend"),
    ({}, (999,), DEGRADED, "XID 999: unknown XID: watch"),
    ({}, (74,), FAILING, "XID 74: NVLink error"),
])
def test_policy_table(changes, xids, health, reason):
    verdict = verdict_of(healthy(**changes), xids)
    assert verdict.health is health
    if reason is None:
        assert verdict.reasons == ()
    else:
        assert reason in verdict.reasons


def test_unsupported_fields_are_not_signals():
    # A GPU that reports nothing but its temperature is healthy, not broken.
    assert verdict_of(common_pb2.GpuTelemetry(index=0, temperature_c=50)).health is HEALTHY


def test_remap_pending_verdict_is_configurable():
    cfg = HealthConfig(remap_pending="DEGRADED")
    assert verdict_of(healthy(remap_pending=True), cfg=cfg).health is DEGRADED


def test_rates_decay_out_of_the_window_and_sticky_xids_do_not():
    h = GpuHistory()
    h.observe(healthy(), 0.0, 0.0, 60)
    h.observe(healthy(ecc_sbe_volatile=30), 1.0, 0.0, 60)
    h.record_xid(48, 1.0, 60)
    assert evaluate_gpu(h, 1.0, CFG).health is FAILED
    later = evaluate_gpu(h, 200.0, CFG)
    assert later.health is FAILED and later.reasons == ("XID 48: double-bit ECC error: reset the GPU",)
    h.forget()
    assert evaluate_gpu(h, 200.0, CFG).health is HEALTHY
    assert h.is_quiet(200.0, 60)


def test_forget_drops_past_rates_but_not_current_flags():
    h = GpuHistory()
    h.observe(healthy(), 0.0, 0.0, 60)
    h.observe(healthy(ecc_sbe_volatile=30, remap_pending=True), 1.0, 0.0, 60)
    assert evaluate_gpu(h, 2.0, CFG).reasons == ("row remap pending (applied at the next GPU reset)",
                                                 "corrected ECC errors at 900/min (limit 600)")
    h.forget()
    assert evaluate_gpu(h, 2.0, CFG).reasons == ("row remap pending (applied at the next GPU reset)",)
    h.observe(healthy(ecc_sbe_volatile=60), 3.0, 2.0, 60)  # still rising after the undrain: it counts again
    assert evaluate_gpu(h, 3.0, CFG).health is FAILING


def test_a_rate_counts_from_the_last_unchanged_reading_not_from_an_old_baseline():
    h = GpuHistory()
    h.observe(healthy(), 0.0, 0.0, 60)  # baseline an hour ago; nothing changed since
    h.observe(healthy(ecc_sbe_volatile=10), 3600.0, 3599.0, 60)  # 10 errors in the last second
    assert h.per_minute("sbe", 3600.0, 60) == pytest.approx(600.0)
    assert evaluate_gpu(h, 3600.0, CFG).health is FAILING


def test_node_verdict_is_the_worst_gpu_and_names_it():
    a, b = GpuHistory(), GpuHistory()
    a.observe(healthy(), 0.0, 0.0, 60)
    b.observe(healthy(index=1, temperature_c=95, clocks_event_reasons=0x20), 0.0, 0.0, 60)
    b.record_xid(79, 0.0, 60)
    host = common_pb2.HostTelemetry(checkpoint_free_bytes=2 * 2**30, checkpoint_total_bytes=100 * 2**30)
    node, per_gpu = evaluate_node({0: a, 1: b}, host, 0.0, CFG)
    assert node.health is FAILED
    assert node.reasons[0] == "GPU 1: XID 79: GPU has fallen off the bus: reboot the node"
    assert "checkpoint directory has 2.0 GiB free (minimum 10)" in node.reasons
    assert per_gpu[0].health is HEALTHY and per_gpu[1].health is FAILED
