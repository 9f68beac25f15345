"""Issue 43 benchmark: a job of replica groups (torchft) against today's whole-gang restart, on the same faults.

The cluster: a controller and five agents on loopback (gloo, CPU). The same fault is injected on a rank of a job of 4
nodes x 1 rank with a spare, steps of ~60 ms:
- groups: examples/train_ft.py as 2 replica groups of 2 nodes (`--replicas 2`), the controller's lighthouse (a
  judged group taken out of the quorum at once; heartbeat timeout 1 s);
- gang: examples/train_phalanx.py as one gang (in-memory snapshots every step, warm standbys): today's recovery.
The faults, all on rank 1 (node-1): crash (kill -9 of its process), xid-79 (an XID 79 on its GPU: the node is drained
and replaced by the spare), node-lost (its agent and its ranks killed: power lost), hang (its process stopped),
remap-pending (its GPU turns FAILING: a predictable eviction) and straggler (its GPU throttled, slow=0.9: its compute
takes 1.9x; the straggler rule tuned as tests/test_recovery_e2e.py tunes it for a shared 2-core machine).

Measured for each: the longest pause of a healthy rank's step loop (groups: a rank of the group the fault did not
strike; gang: rank 0, which every restart stops too), the seconds from the fault until the job trains at full strength
again (every group in the quorum; for the gang, training again), the samples skipped (groups: the struck group's
batches of the steps the other trained alone) and the steps computed twice (gang: from its snapshot); for the groups
also the steps the healthy group took but could not commit and took again (a sudden fault fails the step in flight;
a predictable one should cost none).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench.common import agent_toml, cli, controller_toml, free_port, log, spawn_daemon, temp_root
from bench.recovery import _measure, _steps, _wait_steps, stop_cluster

REPO = Path(__file__).resolve().parent.parent
TRAIN_FT = REPO / "examples" / "train_ft.py"
TRAIN_GANG = REPO / "examples" / "train_phalanx.py"
FAULTS = ("crash", "xid-79", "node-lost", "hang", "remap-pending", "straggler")
PREDICTABLE = ("remap-pending", "straggler")  # their group finishes its step before it is stopped
INJECTED = {"xid-79": "xid=79", "remap-pending": "remap-pending", "straggler": "slow=0.9"}  # `phalanx inject` faults
STRAGGLER = "straggler_ratio = 1.2\nstraggler_cost = 0.2\nstraggler_min_samples = 30\nstraggler_max_evictions = 1\n"
BATCH = 64  # examples/train_ft.py's batch a rank
RANKS_PER_GROUP = 2
WINDOW_S = 90.0
STEP_TIME = "0.05"


def _cluster(root: Path, fault: str) -> tuple[str, dict[str, subprocess.Popen]]:
    address = f"127.0.0.1:{free_port()}"
    procs: dict[str, subprocess.Popen] = {}
    spawn_daemon(procs, root, "controller", "controller.main", controller_toml(address, root) +
                 "[jobs]\nstop_grace_s = 3.0\nkeep_spares = false\n[recovery]\nrestart_backoff_s = 0.2\n"
                 + (STRAGGLER if fault == "straggler" else "") +
                 '[replicas]\nlighthouse_host = "127.0.0.1"\nlighthouse_bind = "127.0.0.1"\n')
    time.sleep(1.5)
    for i in range(5):
        spawn_daemon(procs, root, f"node-{i}", "agent.main",
                     'nvrx_socket = ""\n' + agent_toml(f"node-{i}", address, root, gpus=2))
    deadline = time.time() + 60
    while len(json.loads(cli(address, "nodes", "--json") or "[]")) < 5 and time.time() < deadline:
        time.sleep(0.3)
    return address, procs


def _inject(address: str, fault: str, rank: dict, procs: dict[str, subprocess.Popen]) -> float:
    fault_at = time.time()
    process = psutil.Process(rank["wrapper_pid"]).children()[0]  # the rank, under its wrapper
    if fault == "crash":
        process.send_signal(signal.SIGKILL)
    elif fault == "hang":
        process.send_signal(signal.SIGSTOP)
    elif fault == "node-lost":  # its agent, then its ranks: nothing of the node runs on
        procs[rank["node"]].kill()
        os.killpg(rank["wrapper_pid"], signal.SIGKILL)
    else:
        cli(address, "inject", rank["node"], "--gpu", "0", INJECTED[fault])
    return fault_at


def _lines(path: Path) -> list[dict]:
    """A JSON-lines file the example writes (its last line may be half written); [] while there is none."""
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _commits(out: Path) -> dict[int, list[dict]]:
    return {int(path.stem.removeprefix("rank-")): _lines(path) for path in out.glob("rank-*.jsonl")}


def groups_trial(fault: str, root: Path, step_time: str = STEP_TIME) -> dict:
    address, procs = _cluster(root, fault)
    try:
        out = root / "out"
        out.mkdir()
        job = cli(address, "submit", "--nodes", "4", "--replicas", "2", "--spares", "1", "--", sys.executable,
                  str(TRAIN_FT), "--steps", "100000", "--out", str(out), "--step-time", step_time).strip()
        deadline = time.time() + 120
        while time.time() < deadline and not (len(c := _commits(out)) == 4 and min(len(v) for v in c.values()) >= 40
                                               and all(v[-1]["groups"] == 2 for v in c.values())):
            time.sleep(0.3)
        info = json.loads(cli(address, "job", job, "--json"))
        before = {r: v[-1]["pid"] for r, v in _commits(out).items()}
        fault_at = _inject(address, fault, info["ranks"][1], procs)
        back_at = None
        deadline = time.time() + WINDOW_S
        while time.time() < deadline and back_at is None:
            time.sleep(0.5)
            rejoined = [c for c in _commits(out).get(1, []) if c["pid"] != before[1] and c["groups"] == 2
                        and c["time"] > fault_at]
            back_at = rejoined[0]["time"] if rejoined else None
        time.sleep(2.0)
        healthy = [c for c in _commits(out)[2] if c["time"] >= fault_at - 5]
        gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(healthy)]
        alone = [c for c in healthy if c["groups"] == 1 and c["time"] >= fault_at]
        step_s = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
        events = json.loads(cli(address, "events", "--job", job, "--json") or "[]")
        same = all(_commits(out)[r][-1]["pid"] == before[r] for r in (2, 3))
        retaken = {x["step"] for r in (2, 3) for x in _lines(out / f"retaken-{r}.jsonl") if x["time"] >= fault_at}
        return {"pause_s": round(max(gaps), 2) if gaps else None, "step_s": round(step_s, 3),
                "full_strength_s": round(back_at - fault_at, 2) if back_at else None,
                "samples_skipped": len(alone) * BATCH * RANKS_PER_GROUP, "steps_alone": len(alone),
                "healthy_restarted": not same, "healthy_steps_taken_again": len(retaken),
                "events": [e["kind"] for e in events if e["kind"].startswith("job.group")
                           or e["kind"] == "job.incident"]}
    finally:
        stop_cluster(root, procs)


def gang_trial(fault: str, root: Path) -> dict:
    address, procs = _cluster(root, fault)
    try:
        job = cli(address, "submit", "--nodes", "4", "--spares", "1", "--checkpoint-dir", str(root / "ckpt"), "--",
                  sys.executable, str(TRAIN_GANG), "--steps", "100000", "--step-time", STEP_TIME, "--every", "500",
                  "--print-every", "1").strip()

        def read() -> str:
            return cli(address, "logs", job, "--rank", "0")
        _wait_steps(read, 40)
        info = json.loads(cli(address, "job", job, "--json"))
        deadline = time.time() + 120
        while len(info["standbys"]) < 5 and time.time() < deadline:  # warm standbys on its nodes and the spare
            time.sleep(0.5)
            info = json.loads(cli(address, "job", job, "--json"))
        fault_at = _inject(address, fault, info["ranks"][1], procs)
        result = _measure(read, fault_at)
        steps = [t for _, t in _steps(read()) if t >= fault_at - 5]
        gaps = [b - a for a, b in itertools.pairwise(steps)]
        return {"pause_s": round(max(gaps), 2) if gaps else None, "full_strength_s": result["resumed_s"],
                "steps_computed_twice": result["steps_lost"], "samples_skipped": 0}
    finally:
        stop_cluster(root, procs)


def run(quick: bool = False) -> dict:
    if importlib.util.find_spec("torchft") is None:
        return {"skipped": "torchft is not installed (pip install 'phalanx[ft]')"}
    out: dict = {"faults": {}}
    for fault in FAULTS[:1] if quick else FAULTS:
        out["faults"][fault] = {}
        for system, trial in (("groups", groups_trial), ("gang", gang_trial)):
            with temp_root(f"phalanx-bench-replicas-{system}-") as root:
                try:
                    result = trial(fault, Path(root))
                except Exception as e:  # one trial's failure is its result, the others go on
                    result = {"error": f"{type(e).__name__}: {e}"}
            out["faults"][fault][system] = result
            log(f"replicas: {fault}: {system}: {result}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Replica-group trials alone, e.g. with steps that are nearly all collective, where a group's stop that fails
    the healthy group's step shows (`python -m bench.replicas --step-time 0 --trials 2 crash remap-pending`)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=main.__doc__)
    p.add_argument("faults", nargs="*", metavar="FAULT", help=f"of {', '.join(FAULTS)} (default: all)")
    p.add_argument("--step-time", type=float, default=float(STEP_TIME),
                   help="seconds each step of examples/train_ft.py sleeps")
    p.add_argument("--trials", type=int, default=1)
    args = p.parse_args(argv)
    if unknown := [f for f in args.faults if f not in FAULTS]:
        p.error(f"no such fault: {', '.join(unknown)}; the faults: {', '.join(FAULTS)}")
    if args.step_time < 0 or args.trials < 1:
        p.error("--step-time must be 0 or more and --trials at least 1")
    for fault in args.faults or FAULTS:
        for trial in range(args.trials):
            with temp_root("phalanx-bench-replicas-groups-") as root:
                try:
                    result = groups_trial(fault, Path(root), f"{args.step_time:g}")
                except Exception as e:  # one trial's failure is its result, the others go on
                    result = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps({"fault": fault, "trial": trial, **{k: result[k] for k in (
                "pause_s", "step_s", "healthy_steps_taken_again", "healthy_restarted", "error") if k in result}}),
                flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
