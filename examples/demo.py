"""`make demo`: a GPU starts to fail under a real training job, and Phalanx saves the run.

A local cluster (a controller with SQLite state, four agents with simulated GPUs, all on loopback)
runs a real PyTorch (CPU, gloo) data-parallel job on two "nodes" with one hot spare. A few dozen
steps in, a GPU on one of the job's nodes reports a pending row remap (what NVML shows before an
HBM row goes bad). The timeline shows what Phalanx does: the health policy calls the GPU FAILING,
recovery asks every rank to checkpoint at an agreed step, stops the job, drains the node, restarts
on the spare with a new generation, and the ranks resume from the checkpoint.

The story must really take place, however fast or slow the machine: the job has no fixed length
(it would run for hours) but stops RESUMED_STEPS steps after it resumed from a checkpoint, so it
ends only after a recovery. The demo then checks each part of the story from the event log and the
ranks' output (checkpoint committed, failing node evicted, restart on the spare, resume from the
committed step) and that the final model is bit-for-bit the one an uninterrupted run of as many
steps produces; it exits non-zero, naming what did not happen, if any part is missing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
TRAIN = ROOT / "train_phalanx.py"
STEPS = 1_000_000  # no fixed length: the job ends RESUMED_STEPS steps after it resumed
RESUMED_STEPS = 60
INJECT_AT = 30  # the step after which the GPU starts to fail
START_DEADLINE_S = 300  # for the job to reach INJECT_AT
RECOVERY_DEADLINE_S = 300  # from the fault to the job running on the spare
END_DEADLINE_S = 600  # from the restart to the job's end
T0 = time.monotonic()
SHOWN = ("job.", "node.health", "node.drain", "gpu.xid")
ENDED = ("job.succeeded", "job.failed", "job.cancelled")


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


def phalanx(*args: str, check: bool = True) -> str:
    result = subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                            timeout=600)
    if check and result.returncode != 0:
        raise SystemExit(f"demo failed: phalanx {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result.stdout


def reference(workdir: Path, steps: int) -> str:
    """The same training, uninterrupted: two ranks on loopback without Phalanx, for `steps` steps."""
    from cli.local import free_port
    out, port = workdir / "reference.txt", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    procs = [subprocess.Popen([sys.executable, str(TRAIN), "--steps", str(steps), "--out", str(out)],
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}, cwd=workdir, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL) for r in range(2)]
    if any(p.wait(timeout=600) != 0 for p in procs):
        raise SystemExit("demo failed: the reference run did not finish")
    return out.read_text().strip()


class Timeline:
    """Prints the controller's events about the job and its nodes as they happen, and notes the job's restart
    and end so that the demo waits for events, not for a guess of how long things take."""

    def __init__(self, follow: subprocess.Popen) -> None:
        self.follow = follow
        self.job = ""
        self.restarted = threading.Event()
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        for line in self.follow.stdout:
            event = json.loads(line)
            if event["kind"].startswith(SHOWN):
                say(f"  {event['kind']:<16} {event['message']}")
            if self.job and event.get("job") == self.job:
                if event["kind"] == "job.running" and " generation 1 " not in event["message"]:
                    self.restarted.set()
                if event["kind"] in ENDED:
                    self.ended.set()
                    self.restarted.set()  # nothing more will come: stop waiting for it


def story(job: str, victim: str, spare: str, final: dict, events: list[dict], resumed: dict[int, str]) -> \
        tuple[list[tuple[str, bool, str]], int | None]:
    """Each part of the story the demo tells, whether it took place (and what was seen), and the committed step."""
    committed = None
    for event in events:
        if event["kind"] in ("job.checkpointed", "job.evicting"):
            found = re.search(r"every rank committed step (\d+)", event["message"])
            if found:
                committed = int(found.group(1))
                break
    evicting = [e["message"] for e in events if e["kind"] == "job.evicting"]
    restarting = [e["message"] for e in events if e["kind"] == "job.restarting"]
    resume_lines = [line for line in resumed.values() if line]
    parts = [
        ("checkpoint committed by every rank before the eviction", committed is not None,
         f"step {committed}" if committed is not None else
         "no job.checkpointed event, no job.evicting note saying every rank committed"),
        (f"failing node {victim} evicted", any(m.endswith(victim) or f" {victim}," in m for m in evicting)
         and victim in final["evicted"], "; ".join(evicting) or "no job.evicting event"),
        (f"restart on the spare {spare}", any(f"spare {spare} taken" in m for m in restarting)
         and spare in final["nodes"], "; ".join(restarting) or "no job.restarting event"),
        ("every rank resumed from the committed step", committed is not None and len(resume_lines) == len(resumed)
         and all(f"resumed from step {committed} " in line for line in resume_lines),
         "; ".join(resume_lines) or "no rank said it resumed"),
        ("the job succeeded", final["state"] == "SUCCEEDED", final["state"]),
    ]
    return parts, committed


def main() -> int:
    home = Path(tempfile.mkdtemp(prefix="phalanx-demo-"))
    os.environ["PHALANX_HOME"] = str(home)
    os.environ.pop("PHALANX_CONTROLLER", None)
    say(f"Phalanx demo: state and logs in {home}/local")
    follow = None
    try:
        say("$ phalanx local up --nodes 4 --gpus-per-node 2")
        phalanx("local", "up", "--nodes", "4", "--gpus-per-node", "2")
        follow = subprocess.Popen([sys.executable, "-m", "cli.main", "events", "--follow", "--json"],
                                  stdout=subprocess.PIPE, text=True)
        timeline = Timeline(follow)
        out, out_steps = home / "result.txt", home / "steps.txt"
        # no --checkpoint-dir: the local cluster's agents share one checkpoint directory, as on a shared filesystem
        cmd = ["submit", "--nodes", "2", "--spares", "1", "--name", "demo",
               "--", sys.executable, str(TRAIN), "--steps", str(STEPS), "--steps-after-resume", str(RESUMED_STEPS),
               "--step-time", "0.05", "--every", "25", "--out", str(out), "--out-steps", str(out_steps)]
        say("$ phalanx " + " ".join(cmd[:7]) + f" -- python train_phalanx.py --steps-after-resume {RESUMED_STEPS} ...")
        job = phalanx(*cmd).strip()
        timeline.job = job
        deadline = time.monotonic() + START_DEADLINE_S
        while f"step {INJECT_AT} loss" not in phalanx("logs", job, check=False):
            if time.monotonic() > deadline:
                raise SystemExit(f"demo failed: the job did not reach step {INJECT_AT} in {START_DEADLINE_S}s")
            time.sleep(0.5)
        placed = json.loads(phalanx("job", job, "--json"))
        victim, spare = placed["nodes"][1], (placed["spares"] or ["-"])[0]
        say(f"training under way on {', '.join(placed['nodes'])} (spare {spare}); now {victim}'s GPU 0 reports a "
            "pending row remap")
        say(f"$ phalanx inject {victim} --gpu 0 remap-pending")
        phalanx("inject", victim, "--gpu", "0", "remap-pending")
        if not timeline.restarted.wait(RECOVERY_DEADLINE_S):
            say(f"no restart within {RECOVERY_DEADLINE_S}s of the fault; cancelling {job}")
            phalanx("cancel", job, check=False)
        say(f"$ phalanx wait {job}")
        subprocess.run([sys.executable, "-m", "cli.main", "wait", job, "-q"], timeout=END_DEADLINE_S)
        final = json.loads(phalanx("job", job, "--json"))
        events = json.loads(phalanx("events", "--job", job, "--json"))
        say(f"{job} {final['state']} after {final['restarts']} restart(s); generation {final['generation']} ran on "
            f"{', '.join(final['nodes'])} (evicted: {', '.join(final['evicted']) or '-'})")
        times = ", ".join(f"{k} {v:.1f}s" for k, v in final["seconds_in_state"].items())
        say(f"time in each state: {times}")
        resumed = {}
        for rank in range(final["world_size"]):
            lines = phalanx("logs", job, "--rank", str(rank), check=False).splitlines()
            resumed[rank] = next((line for line in reversed(lines)  # the last restart's
                                  if line.startswith(f"rank {rank}: resumed from step")), "")
        parts, committed = story(job, victim, spare, final, events, resumed)
        steps = int(out_steps.read_text()) if out_steps.exists() else 0
        got = out.read_text().strip() if out.exists() else ""
        if steps:
            say(f"reference: the same training without Phalanx, {steps} steps uninterrupted ...")
            expected = reference(home, steps)
        else:
            expected = ""
        parts.append(("final model identical to an uninterrupted run's", bool(got) and got == expected,
                      f"{got[:16] or '-'} vs uninterrupted {expected[:16] or '-'}"
                      + (f" ({steps} steps)" if steps else " (the job wrote no result)")))
        say("the story, checked:")
        for what, ok, seen in parts:
            say(f"  [{'ok' if ok else 'MISSING'}] {what}: {seen}")
        missing = [what for what, ok, _ in parts if not ok]
        if missing:
            say("demo FAILED: did not happen: " + "; ".join(missing))
            return 1
        say(f"IDENTICAL: checkpointed at step {committed}, resumed on {spare}, no step lost, no step repeated wrongly")
        return 0
    finally:
        if follow is not None:
            follow.kill()
        phalanx("local", "down", check=False)


if __name__ == "__main__":
    sys.exit(main())
