"""Faults injected through the CLI into a real cluster: verdict, drain, event, NVRx answer."""

import json

import grpc
import pytest

from phalanx.nvhcd import nvhcd_pb2, nvhcd_pb2_grpc
from phalanx.v1 import common_pb2, control_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


def phalanx(cluster, *args):
    return cluster.cli(*args, timeout=60)


def health(cluster, node):
    return json.loads(phalanx(cluster, "health", node, "--json").stdout)[0]


def nvrx(cluster, node):
    with grpc.insecure_channel(f"unix://{cluster.root / node / 'nvhcd.sock'}") as channel:
        return nvhcd_pb2_grpc.HealthCheckServiceStub(channel).RunHealthCheck(
            nvhcd_pb2.HealthCheckRequest(args=["--no-slurm"]), timeout=5)


def test_injected_faults_drive_verdicts_drains_and_nvrx(cluster):
    cluster.start_controller()
    for name in ("node-a", "node-b"):
        cluster.start_agent(name, gpus=4)
    cluster.wait_connected(["node-a", "node-b"])  # an injected fault goes down the session
    cluster.wait_for(lambda: health(cluster, "node-a")["health"] == "HEALTHY", "a first verdict")
    assert nvrx(cluster, "node-a").success

    # DEGRADED: watched, still in service
    result = phalanx(cluster, "inject", "node-b", "--gpu", "2", "thermal")
    assert result.returncode == 0 and result.stdout.strip() == "node-b: injected GPU 2: thermal", result.stderr
    cluster.wait_for(lambda: health(cluster, "node-b")["health"] == "DEGRADED", "node-b DEGRADED")
    verdict = health(cluster, "node-b")
    assert verdict["gpus"][2]["reasons"] == ["thermal slowdown (90 C, slowdown at 87 C)"]
    assert cluster.states()["node-b"] == "UP"
    assert nvrx(cluster, "node-b").success

    # FAILED: an XID 79 drains the node at once, with the reason, and NVRx says no
    result = phalanx(cluster, "inject", "node-a", "--gpu", "1", "xid=79")
    assert result.returncode == 0, result.stderr
    cluster.wait_states({"node-a": "DRAINED"})
    node = cluster.node("node-a")
    # the XID event gets there first (it does not wait for a heartbeat)
    assert node.drain_reason == "health FAILED: GPU 1: XID 79: GPU has fallen off the bus: reboot the node"
    assert node.health == common_pb2.HEALTH_FAILED
    cluster.wait_for(lambda: not nvrx(cluster, "node-a").success, "NVRx to hear the verdict")
    answer = nvrx(cluster, "node-a")
    body = json.loads(answer.output)
    assert (answer.exit_code, body["fail_count"], body["health"], body["failing_gpus"]) == (1, 1, "FAILED", [1])
    events = cluster.control.ListEvents(control_pb2.ListEventsRequest(node="node-a"), timeout=5).events
    kinds = [e.kind for e in events]
    assert kinds.index("gpu.xid") < kinds.index("node.health") < kinds.index("node.drain")
    assert next(e for e in events if e.kind == "node.health").fields["target"] == "FAILED"

    # undrain says "fixed"; the GPU is still lost, so the node goes straight back out
    assert phalanx(cluster, "undrain", "node-a").returncode == 0
    cluster.wait_states({"node-a": "DRAINED"})
    assert cluster.node("node-a").drain_reason == "health FAILED: GPU 1: GPU is lost (fell off the bus)"
    events = cluster.control.ListEvents(control_pb2.ListEventsRequest(node="node-a"), timeout=5).events
    assert [e.fields.get("by", "") for e in events if e.kind == "node.drain"] == ["", ""]  # the policy's, both
    assert next(e for e in events if e.kind == "node.undrain").fields["by"]  # the operator's

    # the GPU comes back (the undrain already forgot the XID): healthy, but out of service until undrained
    assert phalanx(cluster, "inject", "node-a", "--gpu", "1", "clear").returncode == 0
    cluster.wait_for(lambda: health(cluster, "node-a")["health"] == "HEALTHY", "GPU 1 back")
    assert cluster.states()["node-a"] == "DRAINED"
    assert phalanx(cluster, "undrain", "node-a").returncode == 0
    cluster.wait_for(lambda: health(cluster, "node-a")["health"] == "HEALTHY", "node-a HEALTHY")
    assert cluster.states()["node-a"] == "UP"

    # FAILING: a pending row remap takes the node out, predictably
    assert phalanx(cluster, "inject", "node-b", "--gpu", "0", "remap-pending").returncode == 0
    cluster.wait_states({"node-b": "DRAINED"})
    assert cluster.node("node-b").drain_reason.startswith("health FAILING: GPU 0: row remap pending")

    table = phalanx(cluster, "health").stdout.splitlines()
    assert table[0].split() == ["NODE", "HEALTH", "GPUS-NOT-HEALTHY", "FIRST-REASON"]

    # this controller's event log, replayed by the simulator as a failure trace: its three faults, each once
    log = cluster.root / "events.json"
    listed = phalanx(cluster, "events", "--json")
    assert listed.returncode == 0, listed.stderr
    log.write_text(listed.stdout)
    scenario = cluster.root / "fleet.toml"
    scenario.write_text("[fleet]\nnodes = 4\n[job]\nnodes = 4\nspares = 0\n[run]\ndays = 1\n")
    replayed = phalanx(cluster, "simulate", str(scenario), "--replay", str(log), "--json")
    assert replayed.returncode == 0, replayed.stderr
    trace = json.loads(replayed.stdout)["replay"]
    # XIDs 79 and 63 (the remap's own event, only watched); the lost GPU after the undrain; the pending remap
    assert trace["log_faults"] == {"node-lost": 0, "xid": 2, "warning": 1, "gpu-failed": 1, "crash": 0,
                                   "straggler": 0}, trace
    assert trace["watched"] == 1, trace


def test_inject_refusals(cluster):
    cluster.start_controller()
    cluster.start_agent("node-a", gpus=2)
    cluster.wait_states({"node-a": "UP"})
    cases = [
        (("inject", "node-a", "--gpu", "0", "xid=abc"), 2, "fault xid: 'abc' is not a whole number"),
        (("inject", "node-a", "--gpu", "5", "ecc-dbe"), 2, "node node-a has 2 GPUs; there is no GPU 5"),
        (("inject", "ghost", "--gpu", "0", "ecc-dbe"), 1, "no node named 'ghost'"),
        (("inject", "node-a", "--gpu", "0", "hang"), 1, "no ranks are running on GPU 0 of node-a"),
        (("inject", "node-a", "--gpu", "0", "sneeze"), 2, "unknown fault 'sneeze'"),
    ]
    for args, code, message in cases:
        result = phalanx(cluster, *args)
        assert result.returncode == code, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert cluster.states() == {"node-a": "UP"}


def test_topology_reaches_phalanx_topo(cluster):
    from tests.sysfs_tree import dgx_h100

    dgx_h100(cluster.root / "sysfs")
    cluster.start_controller()
    cluster.start_agent("dgx-1", gpus=8, extra=f'sysfs_root = "{cluster.root / "sysfs"}"\n')
    cluster.start_agent("this-host")
    cluster.wait_states({"dgx-1": "UP", "this-host": "UP"})
    result = phalanx(cluster, "topo", "dgx-1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:9] == ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "GPU6", "GPU7", "eno1"]
    assert lines[1].split()[:6] == ["GPU0", "X", "PIX", "PHB", "PHB", "SYS"]
    as_json = json.loads(phalanx(cluster, "topo", "dgx-1", "--json").stdout)
    assert [(g["gpu_index"], g["nearest_nic"], g["nic_relation"]) for g in as_json["locality"]][:2] == [
        (0, "mlx5_0", "PIX"), (1, "mlx5_1", "PIX")]
    # the real sysfs of this machine: NUMA node 0 at least, whatever else it has
    real = json.loads(phalanx(cluster, "topo", "this-host", "--json").stdout)
    assert real["numa_nodes"][0]["id"] == 0 and real["numa_nodes"][0]["cpulist"]
    assert phalanx(cluster, "topo", "ghost").returncode == 1
