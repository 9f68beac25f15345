"""A local Phalanx cluster on loopback, and what it does when a node dies (`python examples/liveness_demo.py`).

What runs today: a controller with SQLite state and four agents with simulated GPUs. The demo
kills one agent with SIGKILL and times how fast the controller declares the node DOWN, brings it
back, drains a node, makes two GPUs fail (rising corrected ECC errors: FAILING; an XID 79: FAILED)
and times how fast the health policy takes those nodes out of service, restarts the controller and
shows that the drain (and its reason) survived and every agent reconnected. Each step prints the
command a user would type.
The training-job demo (fault -> checkpoint -> evict -> resume on a spare) builds on this.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.2f}s] {text}", flush=True)


def phalanx(*args: str, show: bool = True) -> str:
    if show:
        say("$ phalanx " + " ".join(args))
    result = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                            timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"demo failed: phalanx {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    if show and result.stdout.strip():
        print("\n".join("          " + line for line in result.stdout.rstrip().splitlines()), flush=True)
    return result.stdout


def states() -> dict[str, str]:
    return {n["name"]: n["state"] for n in json.loads(phalanx("nodes", "--json", show=False))}


def wait_for(predicate, what: str, timeout: float = 60.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise SystemExit(f"demo failed: timed out waiting for {what}")


def processes() -> dict[str, dict]:
    return {p["name"]: p for p in json.loads(phalanx("local", "status", "--json", show=False))}


def main() -> int:
    home = tempfile.mkdtemp(prefix="phalanx-demo-")
    os.environ["PHALANX_HOME"] = home
    os.environ.pop("PHALANX_CONTROLLER", None)
    say(f"Phalanx demo (state and logs in {home}/local)")
    try:
        phalanx("local", "up", "--nodes", "4", "--gpus-per-node", "8")
        phalanx("nodes")
        procs = processes()

        victim = procs["node-2"]
        say(f"kill -9 the agent of node-2 (pid {victim['pid']}): the node is silent from now on")
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: states().get("node-2") == "DOWN", "node-2 DOWN")
        say(f"controller declared node-2 DOWN {time.monotonic() - killed_at:.2f}s after the kill "
            "(Slurm's default: 300 s; Kubernetes: 40-50 s to NotReady)")
        phalanx("nodes")

        say("restart node-2's agent (what systemd's Restart=on-failure does)")
        agent = restart("agent.main", victim)
        took = wait_for(lambda: states().get("node-2") == "UP", "node-2 UP")
        say(f"node-2 UP again {took:.2f}s after its agent started")

        phalanx("drain", "node-3", "--reason", "GPU 5 fan at 100% (ticket OPS-1234)")

        say("a GPU starts to fail: corrected ECC errors at 20/s on node-1 GPU 3 (what NVML would report)")
        phalanx("inject", "node-1", "--gpu", "3", "ecc-sbe-rate=20")
        injected_at = time.monotonic()
        wait_for(lambda: states().get("node-1") == "DRAINED", "node-1 drained by the health policy")
        say(f"health policy: node-1 FAILING and drained {time.monotonic() - injected_at:.2f}s after the first errors")
        phalanx("health", "node-1")
        say("an XID 79 (GPU fell off the bus) on node-0 GPU 0")
        phalanx("inject", "node-0", "--gpu", "0", "xid=79")
        injected_at = time.monotonic()
        wait_for(lambda: states().get("node-0") == "DRAINED", "node-0 drained by the health policy")
        say(f"node-0 FAILED and drained {time.monotonic() - injected_at:.2f}s after the XID")
        phalanx("nodes")
        phalanx("inject", "node-0", "--gpu", "0", "clear")
        phalanx("inject", "node-1", "--gpu", "3", "clear")
        # An operator undrains a repaired node once its health has recovered (the ECC rate is judged over a minute):
        # undrained before, the health policy drains it again. The demo leaves them drained.
        say("GPUs repaired (faults cleared): node-0 and node-1 stay drained until `phalanx undrain` once healthy")

        controller = procs["controller"]
        say(f"kill -9 the controller (pid {controller['pid']}) and start it again over the same database")
        os.kill(controller["pid"], signal.SIGKILL)
        restarted = restart("controller.main", controller)
        took = wait_for(all_connected, "agents reconnected")
        say(f"all four agents reconnected and resynced {took:.2f}s after the controller restarted")
        phalanx("nodes")
        if states()["node-3"] != "DRAINED":
            raise SystemExit("demo failed: the drain did not survive the controller restart")
        say("the drain and its reason survived the restart; the event log tells the story:")
        phalanx("events")
        phalanx("undrain", "node-3")
        for proc in (agent, restarted):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    finally:
        phalanx("local", "down")
        subprocess.run(["pkill", "-f", f"{home}/local/"], check=False)
    say("demo finished")
    return 0


def restart(module: str, proc: dict) -> subprocess.Popen:
    """Start a daemon again with the configuration and log file `phalanx local up` gave it."""
    with open(proc["log"], "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module, "--config", proc["config"]], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def all_connected() -> bool:
    """Every node has a session with the (restarted) controller; False while it is still starting."""
    result = subprocess.run([sys.executable, "-m", "cli.main", "nodes", "--json"], capture_output=True,
                            text=True, timeout=60)
    return result.returncode == 0 and all(n["connected"] for n in json.loads(result.stdout))


if __name__ == "__main__":
    sys.exit(main())
