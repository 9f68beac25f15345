"""Issue 40 benchmark: the end of a job, and what Phalanx's own work costs it.

The job is the issue's: a script written as users write them (examples/train_user.py: the loop, a barrier, rank 0
saves the final model, destroy_process_group, `sys.exit(main())`), 2 nodes x 2 ranks + 1 spare on a 4-node local
cluster with warm standbys on, STEPS steps of ~20 ms. Trials: no fault, and a kill -9 of one rank at about step
FAULT_AT, each with and without `trainlib.snapshot()` every step. Measured:

- outcome: the job's end state and its restarts; every incident besides the injected one is a false verdict (a
  hang at the end, a straggler after a restart) and counted;
- exit: for each rank of the last generation, seconds from its last line after training (before the barrier, the
  final save and the teardown) to its exit (the wrapper's exit file), warm-started ranks apart from cold ones;
- pace: the job's median step time from rank 0's progress lines (every 50 steps, wall clock, from step PACE_FROM
  on), with snapshots against without, of the fault-free trials: the slowdown snapshots cost the job, background
  work included; beside it what trainlib said they cost (its probe every 512 steps).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.supervisor import kill_recorded
from bench.common import agent_toml, cli, controller_toml, free_port, log, spawn_daemon, temp_root

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_user.py"
STEPS = 1200
FAULT_AT = 150
REPEATS = 2
PACE_FROM = 512  # the job's step time is taken from here on: past trainlib's first measurement of its snapshots' cost
PROGRESS = re.compile(r"^step (\d+) loss \S+ at ([\d.]+)$", re.M)
TRAINED = re.compile(r"^rank (\d+) trained \d+ steps at ([\d.]+)$", re.M)
SAID = re.compile(r"cost the job ([\d.]+)% of its step time")


def _cli(address: str, *args: str) -> str:
    return cli(address, *args, timeout=600)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def trial(root: Path, fault: str, snapshots: bool) -> dict:
    address = f"127.0.0.1:{free_port()}"
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, module: str, text: str) -> None:
        spawn_daemon(procs, root, name, module, text)

    spawn("controller", "controller.main", controller_toml(address, root) + "[jobs]\nstop_grace_s = 3.0\n")
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="phalanx-bench-")) if Path("/dev/shm").is_dir() else None
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not _cli(address, "nodes", "--json"):
            time.sleep(0.3)
        for i in range(4):
            spawn(f"node-{i}", "agent.main", 'nvrx_socket = ""\n' + agent_toml(f"node-{i}", address, root, gpus=2,
                                                                              snapshots=shm))
        while time.time() < deadline and len(json.loads(_cli(address, "nodes", "--json") or "[]")) < 4:
            time.sleep(0.3)
        job = _cli(address, "submit", "--nodes", "2", "--ranks-per-node", "2", "--spares", "1", "--checkpoint-dir",
                   str(root / "ckpt"), "--", sys.executable, str(SCRIPT), "--steps", str(STEPS),
                   *(("--snapshot",) if snapshots else ())).strip()
        if fault == "crash":
            while time.time() < deadline + 120:
                info = json.loads(_cli(address, "job", job, "--json"))
                if len(info["standbys"]) >= 3 and any(int(s) >= FAULT_AT for s, _ in PROGRESS.findall(
                        _cli(address, "logs", job, "--rank", "0"))):
                    break
                time.sleep(0.5)
            rank = next(r for r in info["ranks"] if r["rank"] == 1)
            os.kill(rank["pid"], signal.SIGKILL)
        _cli(address, "wait", job)
        info = json.loads(_cli(address, "job", job, "--json"))
        events = json.loads(_cli(address, "events", "--job", job, "--json") or "[]")
        incidents = [e["message"] for e in events if e["kind"] == "job.incident"]
        injected = [m for m in incidents if fault == "crash" and ": crash: rank 1 " in m][:1]
        exits = {"warm": [], "cold": []}
        for r in info["ranks"]:
            logs = _cli(address, "logs", job, "--rank", str(r["rank"]))
            header = [line for line in logs.splitlines() if f" generation {info['generation']} rank " in line]
            trained = TRAINED.findall(logs)
            exit_file = next(root.glob(f"node-*/state/**/{job}.g{info['generation']}.r{r['rank']}.exit"), None)
            if header and trained and exit_file is not None:
                how = "warm" if header[-1].endswith("(warm) ---") else "cold"
                exits[how].append(round(exit_file.stat().st_mtime - float(trained[-1][1]), 3))
        last = _cli(address, "logs", job, "--rank", "0").split(f" generation {info['generation']} rank 0 ")[-1]
        progress = [(int(s), float(t)) for s, t in PROGRESS.findall(last) if int(s) >= PACE_FROM]
        said = [float(x) / 100 for x in SAID.findall(last)]  # what trainlib said its snapshots cost the job
        paces = [(t2 - t1) / (s2 - s1) for (s1, t1), (s2, t2) in itertools.pairwise(progress) if s2 > s1]
        return {"state": info["state"], "restarts": info["restarts"], "incidents": incidents,
                "false_verdicts": len(incidents) - len(injected),
                "exit_s": exits, "step_s": round(statistics.median(paces), 5) if paces else None,
                "trainlib_said": said}
    finally:
        for record in root.glob("*/state/ranks/*.json"):
            kill_recorded(record)
        for p in procs.values():
            _kill_group(p.pid)
            p.wait()
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


# Why a warm rank exited later than a cold one: a script (a model, an optimizer step: torch._dynamo imported) as a
# cold `python -c` and as the child of a process that imported torch first (agent/warmstart.py's standby), ending
# by the interpreter's teardown (as warm ranks did before issue 40) or by atexit and os._exit (as they do now).
TEARDOWN_SCRIPT = """
import time, torch, torch.distributed
m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
o = torch.optim.SGD(m.parameters(), lr=0.1); m(torch.ones(2, 16)).sum().backward(); o.step()
print(time.time(), flush=True)
"""


def _cold_exit() -> float:
    p = subprocess.Popen([sys.executable, "-c", TEARDOWN_SCRIPT], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    p.wait()
    return time.time() - float(line)


def _warm_exit(teardown: bool) -> float:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the standby: imports first, then forks the rank
        import atexit

        import torch
        import torch._dynamo
        import torch.distributed  # noqa: F401
        child = os.fork()
        if child == 0:
            os.dup2(write, 1)
            exec(compile(TEARDOWN_SCRIPT, "<script>", "exec"), {"__name__": "__main__"})
            if teardown:
                sys.exit(0)
            atexit._run_exitfuncs()
            sys.stdout.flush()
            os._exit(0)
        os.waitpid(child, 0)
        os.write(write, f"{time.time()}\n".encode())
        os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 4096):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    printed, exited = (float(x) for x in data.split()[-2:])
    return exited - printed


def teardown(trials: int) -> dict:
    """The three ways of ending, measured in a fresh process of their own: a fork from a process with threads (the
    benchmark runner's) can deadlock in the child."""
    import json
    done = subprocess.run([sys.executable, "-m", "bench.ending", "teardown", str(trials)], capture_output=True,
                          text=True, timeout=1200, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"the teardown measurement failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for name, figures in out.items():
        log(f"ending: exit after the last line, {name}: {figures}")
    return out


def _teardown_here(trials: int) -> dict:
    out = {}
    for name, measure in (("cold", _cold_exit), ("warm, interpreter teardown (before)", lambda: _warm_exit(True)),
                          ("warm, os._exit after atexit (now)", lambda: _warm_exit(False))):
        times = [measure() for _ in range(trials)]
        out[name] = {"median_s": round(statistics.median(times), 3), "max_s": round(max(times), 3)}
    return out


def run(quick: bool = False) -> dict:
    trials: dict[str, list[dict]] = {}
    for _ in range(1 if quick else REPEATS):
        for fault in ("none", "crash"):
            for snapshots in (False, True):
                name = f"{fault}, {'snapshots' if snapshots else 'no snapshots'}"
                with temp_root(prefix="phalanx-bench-ending-") as tmp:
                    log(f"ending: {name} ...")
                    try:
                        outcome = trial(Path(tmp), fault, snapshots)
                    except Exception as e:
                        outcome = {"error": f"{type(e).__name__}: {e}"}
                    log(f"ending: {name}: {outcome}")
                    trials.setdefault(name, []).append(outcome)
    summary: dict[str, dict] = {}
    for name, ts in trials.items():
        done = [t for t in ts if "error" not in t]
        warm = [s for t in done for s in t["exit_s"]["warm"]]
        cold = [s for t in done for s in t["exit_s"]["cold"]]
        summary[name] = {
            "succeeded": sum(t["state"] == "SUCCEEDED" for t in done), "of": len(ts),
            "false_verdicts": sum(t["false_verdicts"] for t in done),
            "exit_warm_s": statistics.median(warm) if warm else None, "exit_warm_max_s": max(warm, default=None),
            "exit_cold_s": statistics.median(cold) if cold else None, "exit_cold_max_s": max(cold, default=None),
            "step_s": statistics.median(t["step_s"] for t in done if t["step_s"]) if done else None,
            "trainlib_said": [x for t in done for x in t.get("trainlib_said", [])]}
    plain, snap = summary.get("none, no snapshots", {}), summary.get("none, snapshots", {})
    slowdown = (snap["step_s"] / plain["step_s"] - 1) if plain.get("step_s") and snap.get("step_s") else None
    return {"summary": summary, "trials": trials, "snapshot_slowdown": slowdown,
            "teardown": teardown(3 if quick else 9),
            "job": f"examples/train_user.py, 2 nodes x 2 ranks + 1 spare, {STEPS} steps of ~20 ms, warm standbys on"}


if __name__ == "__main__":  # python -m bench.ending teardown N: the exit measurement, in this fresh process
    import json
    print(json.dumps(_teardown_here(int(sys.argv[2]))))
