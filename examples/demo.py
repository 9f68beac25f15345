"""`make demo`: a GPU starts to fail under a real training job, and Phalanx saves the run.

A local cluster (a controller with SQLite state, four agents with simulated GPUs, all on loopback)
runs a real PyTorch (CPU, gloo) data-parallel job on two "nodes" with one hot spare. A few dozen
steps in, a GPU on one of the job's nodes reports a pending row remap (what NVML shows before an
HBM row goes bad). The timeline shows what Phalanx does: the health policy calls the GPU FAILING,
recovery asks every rank to checkpoint at an agreed step, stops the job, drains the node, restarts
on the spare with a new generation, and the ranks resume from the checkpoint. The demo ends by
checking that the final model is bit-for-bit the one an uninterrupted run produces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TRAIN = ROOT / "train_phalanx.py"
STEPS = 150
T0 = time.monotonic()
SHOWN = ("job.", "node.health", "node.drain", "gpu.xid")


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


def phalanx(*args: str, check: bool = True) -> str:
    result = subprocess.run([sys.executable, "-m", "phalanx.cli.main", *args], capture_output=True, text=True,
                            timeout=600)
    if check and result.returncode != 0:
        raise SystemExit(f"demo failed: phalanx {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def reference(workdir: Path) -> str:
    """The same training, uninterrupted: two ranks on loopback without Phalanx."""
    from phalanx.cli.local import free_port
    out, port = workdir / "reference.txt", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    procs = [subprocess.Popen([sys.executable, str(TRAIN), "--steps", str(STEPS), "--out", str(out)],
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}, cwd=workdir, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(2)]
    if any(p.wait(timeout=600) != 0 for p in procs):
        raise SystemExit("demo failed: the reference run did not finish")
    return out.read_text().strip()


def timeline(follow: subprocess.Popen) -> None:
    """Print the controller's events about the job and its nodes as they happen."""
    for line in follow.stdout:
        event = json.loads(line)
        if event["kind"].startswith(SHOWN):
            say(f"  {event['kind']:<16} {event['message']}")


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="phalanx-demo-"))
    os.environ["PHALANX_HOME"] = str(home)
    os.environ.pop("PHALANX_CONTROLLER", None)
    say(f"Phalanx demo: state and logs in {home}/local")
    say("reference: the same training run without Phalanx, uninterrupted ...")
    expected = reference(home)
    say(f"reference model checksum {expected[:16]}")
    follow = None
    try:
        say("$ phalanx local up --nodes 4 --gpus-per-node 2")
        phalanx("local", "up", "--nodes", "4", "--gpus-per-node", "2")
        follow = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "events", "--follow", "--json"],
                                  stdout=subprocess.PIPE, text=True)
        threading.Thread(target=timeline, args=(follow,), daemon=True).start()
        out = home / "result.txt"
        cmd = ["submit", "--nodes", "2", "--spares", "1", "--name", "demo", "--checkpoint-dir", str(home / "ckpt"),
               "--", sys.executable, str(TRAIN), "--steps", str(STEPS), "--step-time", "0.05", "--every", "25",
               "--out", str(out)]
        say("$ phalanx " + " ".join(cmd[:9]) + " -- python train_phalanx.py ...")
        job = phalanx(*cmd).strip()
        deadline = time.monotonic() + 300
        while "step 30 loss" not in phalanx("logs", job, check=False):
            if time.monotonic() > deadline:
                raise SystemExit("demo failed: the job did not get going")
            time.sleep(0.5)
        victim = json.loads(phalanx("job", job, "--json"))["nodes"][1]
        say(f"training under way; now {victim}'s GPU 0 reports a pending row remap")
        say(f"$ phalanx inject {victim} --gpu 0 remap-pending")
        phalanx("inject", victim, "--gpu", "0", "remap-pending")
        say(f"$ phalanx wait {job}")
        waited = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "wait", job, "-q"], timeout=600)
        time.sleep(1.0)
        follow.kill()
        final = json.loads(phalanx("job", job, "--json"))
        say(f"{job} {final['state']} after {final['restarts']} restart(s); generation {final['generation']} ran on "
            f"{', '.join(final['nodes'])} (evicted: {', '.join(final['evicted']) or '-'})")
        times = ", ".join(f"{k} {v:.1f}s" for k, v in final["seconds_in_state"].items())
        say(f"time in each state: {times}")
        got = out.read_text().strip() if out.exists() else ""
        same = waited.returncode == 0 and got == expected
        say(f"final model {got[:16] or '-'} vs uninterrupted {expected[:16]}: "
            f"{'IDENTICAL: no step lost, no step repeated wrongly' if same else 'DIFFERENT'}")
        return 0 if same else 1
    finally:
        if follow is not None:
            follow.kill()
        phalanx("local", "down", check=False)


if __name__ == "__main__":
    sys.exit(main())
