"""Issues 6 and 11 benchmark: Phalanx against torchrun on the same job and the same faults.

The job: examples/train_phalanx.py, 2 "nodes" x 1 rank on loopback (gloo, CPU), a durable checkpoint
every 500 steps, an in-memory snapshot every step (Phalanx; torchrun has none), rank 0 printing every
step with its wall time. The faults:
- crash: kill -9 of one rank's process
- xid-79: an injected XID 79 (GPU fallen off the bus) on the GPU of one rank (Phalanx only: torchrun has
  no GPU health signal)
- node-loss: kill -9 of one node's agent (torchrun: its elastic agent) together with its rank
- hang: SIGSTOP of one rank's process group
- remap-pending: an injected predictable failure (Phalanx only): checkpoint, then evict
- crash-cold: the crash again, with warm starts off for the job (PHALANX_WARM_START=0): what the
  standbys save
- crash-rejoin: the crash again, the script run under trainlib.run (--rejoin): the survivor rejoins
  the next generation in its own process

Phalanx's faults come once the job's nodes and spare hold their warm standbys (as they do a few seconds
into any job), except crash-cold's.

A third system (issue 16): the same script under torchrun with `--rdzv-backend=phalanx`, three torchrun
agents on three Phalanx nodes for --nnodes=2 (the third waits as the spare); the faults hit a member node,
and for predictable ones its trainlib workers checkpoint one agreed step before the round restarts.

Then remap-pending again with 128 MB of state a rank (`--state-mb`), three times each way, alternating: the
checkpoint before the eviction committed as in-memory snapshots (each replicated to the other node), and
durably (PHALANX_EVICTION_CHECKPOINT=durable; snapshots are taken all along either way). Besides the fault's
figures, the seconds from the request to every rank's commit (the `job.checkpointed` event).

Measured per fault: seconds from the fault to the first training step after it, and steps computed twice
(the last step done before the fault minus the step training resumed from). "never" means no step
within the observation window. Phalanx runs each fault REPEATS times (median and max); torchrun once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from agent.supervisor import kill_recorded
from bench.common import agent_toml, cli, controller_toml, free_port, log, spawn_daemon, temp_root

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train_phalanx.py"
STEPS = 3000
REPEATS = 5
WINDOW_S = 90.0  # after a fault: how long we wait for training to resume before saying "never"
STEP_LINE = re.compile(r"^step (\d+) loss \S+ at ([\d.]+)$", re.M)
RESUMED = re.compile(r"resumed from step (\d+)")
COMMITTED = re.compile(r"committed step \d+ (.*) \(([\d.]+)s after the request\)")
EVICTION_STATE_MB = 128  # the eviction checkpoint compared in host memory and durably, with this much state a rank
FAULTS = ("crash", "xid-79", "node-loss", "hang", "remap-pending", "crash-cold", "crash-rejoin")
GPU_FAULTS = {"xid-79": "xid=79", "remap-pending": "remap-pending"}  # injected into the simulated GPU


def _train_args(ckpt: Path) -> list[str]:
    return [str(TRAIN), "--steps", str(STEPS), "--step-time", "0.05", "--every", "500", "--print-every", "1"]


def _steps(text: str) -> list[tuple[int, float]]:
    return [(int(m.group(1)), float(m.group(2))) for m in STEP_LINE.finditer(text)]


# Phalanx's rank log marks each generation's start: "starting" (a process) or "rejoining" (trainlib.run)
NEXT_GENERATION = "generation 2 rank 0 "


def _measure(read_log, fault_at: float) -> dict:
    """Wait for a step printed after the fault (with Phalanx: by the next generation, as a predictable fault lets
    training run on until its checkpoint); return seconds to it and steps computed twice."""
    deadline = time.time() + WINDOW_S
    while time.time() < deadline:
        text = read_log()
        if NEXT_GENERATION in text:
            old, new = text.split(NEXT_GENERATION, 1)
            before = [s for s, _ in _steps(old)]
            after = _steps(new)
        else:
            steps = _steps(text)
            before = [s for s, t in steps if t <= fault_at]
            after = [(s, t) for s, t in steps if t > fault_at + 0.5 and "phalanx:" not in text]
        if after and before:
            resumed = [int(x) for x in RESUMED.findall(text)]
            first_step, first_t = after[0]
            start_from = (resumed[-1] + 1) if resumed else first_step
            return {"resumed_s": round(first_t - fault_at, 2), "steps_lost": max(0, max(before) + 1 - start_from),
                    "last_step_before": max(before), "resumed_at_step": start_from}
        time.sleep(0.5)
    return {"resumed_s": None, "steps_lost": None}


def _wait_steps(read_log, at_least: int, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        steps = _steps(read_log())
        if steps and steps[-1][0] >= at_least:
            return
        time.sleep(0.3)
    raise RuntimeError(f"training did not reach step {at_least}")


def _kill_tree(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def stop_cluster(root: Path, procs: dict[str, subprocess.Popen]) -> None:
    """Kill a loopback cluster's ranks (from the agents' records under `root`) and its daemons."""
    for record in root.glob("*/state/ranks/*.json"):
        kill_recorded(record)
    for p in procs.values():
        _kill_tree(p.pid, signal.SIGKILL)
        p.wait()


# -- torchrun ------------------------------------------------------------------------------------

def torchrun_trial(fault: str, root: Path) -> dict:
    if fault in GPU_FAULTS:
        return {"resumed_s": None, "steps_lost": None, "skipped": "no GPU health signal in torchrun"}
    if fault.startswith("crash-"):
        return {"resumed_s": None, "steps_lost": None, "skipped": "the same as crash for torchrun"}
    port = free_port()
    logs = [root / f"torchrun-{i}.log" for i in range(2)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    procs = []
    for i in range(2):
        with open(logs[i], "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                 "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench", "--max-restarts=3",
                 "--monitor-interval=0.5", *_train_args(root / "ckpt")],
                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        def read() -> str:
            return "".join(p.read_text(errors="replace") for p in logs)
        _wait_steps(read, 40)
        workers = [c for c in psutil.Process(procs[1].pid).children(recursive=True) if "train_phalanx" in
                   " ".join(c.cmdline())]
        if not workers:
            raise RuntimeError("no torchrun worker found")
        fault_at = time.time()
        if fault == "crash":
            workers[0].send_signal(signal.SIGKILL)
        elif fault == "hang":
            workers[0].send_signal(signal.SIGSTOP)
        else:  # the whole node: its elastic agent and its worker (which torchrun starts in a session of its own)
            _kill_tree(procs[1].pid, signal.SIGKILL)
            workers[0].send_signal(signal.SIGKILL)
        return _measure(read, fault_at)
    finally:
        for worker in locals().get("workers", []):  # in sessions of their own: the agent's group misses them
            with contextlib.suppress(psutil.Error):
                worker.kill()
        for p in procs:
            _kill_tree(p.pid, signal.SIGKILL)
            p.wait()


# -- torchrun with Phalanx's rendezvous (issue 16) ----------------------------------------------------

TORCHRUN_FAULTS = ("crash", "xid-79", "node-loss", "hang", "remap-pending")


def _measure_round(read_log, fault_at: float) -> dict:
    """torchrun's workers print their steps (with wall times) and "resumed from step S" when a new round starts
    from a checkpoint: the new round's first step is the first line of step S + 1 (or 0: no checkpoint yet) after
    the fault."""
    deadline = time.time() + WINDOW_S
    while time.time() < deadline:
        text = read_log()
        resumed = [int(x) for x in RESUMED.findall(text)]
        steps = _steps(text)
        before = [s for s, t in steps if t <= fault_at]
        if before:
            start = resumed[-1] + 1 if resumed else 0
            after = [t for s, t in steps if s == start and t > fault_at]
            if after:
                return {"resumed_s": round(min(after) - fault_at, 2), "steps_lost": max(0, max(before) + 1 - start),
                        "last_step_before": max(before), "resumed_at_step": start}
        time.sleep(0.5)
    return {"resumed_s": None, "steps_lost": None}


def torchrun_phalanx_trial(fault: str, root: Path) -> dict:
    """Three torchrun agents (--rdzv-backend=phalanx) for --nnodes=2, the third a spare, on three Phalanx nodes."""
    if fault not in TORCHRUN_FAULTS:
        return {"resumed_s": None, "steps_lost": None, "skipped": "the same as crash for torchrun"}
    address = f"127.0.0.1:{free_port()}"
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, argv: list[str], env: dict | None = None) -> None:
        with open(root / f"{name}.log", "ab") as out:
            procs[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                           cwd=root, env=env)

    def daemon(name: str, module: str, text: str) -> None:
        (root / f"{name}.toml").write_text(text)
        spawn(name, [sys.executable, "-m", module, "--config", str(root / f"{name}.toml")])

    daemon("controller", "controller.main", controller_toml(address, root))
    time.sleep(1.5)
    nodes = [f"node-{i}" for i in range(3)]
    for name in nodes:
        daemon(name, "agent.main", 'nvrx_socket = ""\n' + agent_toml(name, address, root, gpus=1))
    logs = [root / f"torchrun-{name}.log" for name in nodes]

    def read() -> str:
        return "".join(p.read_text(errors="replace") for p in logs if p.exists())

    def torchrun(name: str) -> None:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}, "PHALANX_NODE": name,
               "PHALANX_INSECURE": "1", "PHALANX_CHECKPOINT_DIR": str(root / "ckpt"), "OMP_NUM_THREADS": "1"}
        spawn(f"torchrun-{name}", [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                   "--rdzv-backend=phalanx", f"--rdzv-endpoint={address}", "--rdzv-id=bench",
                                   "--max-restarts=3", "--monitor-interval=0.5", "--rdzv-conf=join_timeout=120",
                                   *_train_args(root / "ckpt")], env)
    try:
        deadline = time.time() + 60
        while len(json.loads(_cli(address, "nodes", "--json") or "[]")) < 3 and time.time() < deadline:
            time.sleep(0.3)
        torchrun("node-0")
        torchrun("node-1")
        _wait_steps(read, 40)
        torchrun("node-2")  # the spare: joins once the round of node-0 and node-1 runs
        deadline = time.time() + 60
        while time.time() < deadline:
            run = next((j for j in json.loads(_cli(address, "jobs", "--json") or "[]") if j["id"] == "torchrun-bench"),
                       {})
            if run.get("spares") == ["node-2"]:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("the spare torchrun did not wait in the rendezvous")
        victim = "node-1"
        workers = [c for c in psutil.Process(procs[f"torchrun-{victim}"].pid).children(recursive=True)
                   if "train_phalanx" in " ".join(c.cmdline())]
        fault_at = time.time()
        if fault in GPU_FAULTS:
            _cli(address, "inject", victim, "--gpu", "0", GPU_FAULTS[fault])
        elif fault == "crash":
            workers[0].send_signal(signal.SIGKILL)
        elif fault == "hang":
            workers[0].send_signal(signal.SIGSTOP)
        else:  # the whole node: its Phalanx agent, its torchrun agent and its worker
            procs[victim].send_signal(signal.SIGKILL)
            _kill_tree(procs[f"torchrun-{victim}"].pid, signal.SIGKILL)
            for w in workers:
                with contextlib.suppress(psutil.Error):
                    w.kill()
        result = _measure_round(read, fault_at)
        events = json.loads(_cli(address, "events", "--job", "torchrun-bench", "--json") or "[]")
        result["events"] = [e["kind"] for e in events if e["kind"].startswith("rendezvous.")]
        return result
    finally:
        for name, p in procs.items():
            if name.startswith("torchrun-"):
                with contextlib.suppress(psutil.Error):
                    for c in psutil.Process(p.pid).children(recursive=True):
                        c.kill()
        for p in procs.values():
            _kill_tree(p.pid, signal.SIGKILL)
            p.wait()


# -- Phalanx -------------------------------------------------------------------------------------

def _cli(address: str, *args: str) -> str:
    return cli(address, *args, timeout=120)


def phalanx_trial(fault: str, root: Path, train_extra: tuple[str, ...] = (), env: tuple[str, ...] = ()) -> dict:
    address = f"127.0.0.1:{free_port()}"
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, module: str, text: str) -> None:
        spawn_daemon(procs, root, name, module, text)
    spawn("controller", "controller.main", controller_toml(address, root) +
          "[jobs]\nstop_grace_s = 3.0\n[recovery]\nrestart_backoff_s = 0.2\n")
    time.sleep(1.5)
    # the agents' snapshots on a tmpfs, as the agent's default (/dev/shm/phalanx) puts them
    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="phalanx-bench-")) if Path("/dev/shm").is_dir() else None
    for i in range(3):
        spawn(f"node-{i}", "agent.main", 'nvrx_socket = ""\n' + agent_toml(f"node-{i}", address, root, gpus=2,
                                                                          snapshots=shm))
    try:
        deadline = time.time() + 60
        while len(json.loads(_cli(address, "nodes", "--json") or "[]")) < 3 and time.time() < deadline:
            time.sleep(0.3)
        cold = fault.endswith("-cold")
        job = _cli(address, "submit", "--nodes", "2", "--spares", "1", "--checkpoint-dir", str(root / "ckpt"),
                   *(("--env", "PHALANX_WARM_START=0") if cold else ()), *(a for kv in env for a in ("--env", kv)),
                   "--",
                   sys.executable, *_train_args(root / "ckpt"), *(("--rejoin",) if fault == "crash-rejoin" else ()),
                   *train_extra).strip()

        def read() -> str:
            return _cli(address, "logs", job, "--rank", "0")
        _wait_steps(read, 40)
        info = json.loads(_cli(address, "job", job, "--json"))
        deadline = time.time() + 120
        while not cold and len(info["standbys"]) < 3 and time.time() < deadline:  # both nodes and the spare
            time.sleep(0.5)
            info = json.loads(_cli(address, "job", job, "--json"))
        victim_node, rank = info["ranks"][1]["node"], info["ranks"][1]
        fault_at = time.time()
        if fault in GPU_FAULTS:
            _cli(address, "inject", victim_node, "--gpu", "0", GPU_FAULTS[fault])
        elif fault.startswith("crash"):
            child = psutil.Process(rank["wrapper_pid"]).children()[0]  # the rank itself, under its wrapper
            child.send_signal(signal.SIGKILL)
        elif fault == "hang":
            _kill_tree(rank["wrapper_pid"], signal.SIGSTOP)
        else:
            procs[victim_node].send_signal(signal.SIGKILL)
            _kill_tree(rank["wrapper_pid"], signal.SIGKILL)
        result = _measure(read, fault_at)
        info = json.loads(_cli(address, "job", job, "--json"))
        result["seconds_in_state"] = info["seconds_in_state"]
        result["incident"] = info["incident"]
        logs = read()
        result["warm"] = "(warm) ---" in logs or "rejoining in the same process" in logs
        if fault == "remap-pending":  # how long the ranks took to commit the agreed step, and how
            events = json.loads(_cli(address, "events", "--job", job, "--json") or "[]")
            committed = [e["message"] for e in events if e["kind"] == "job.checkpointed"]
            if committed and (said := COMMITTED.search(committed[0])):
                result["commit_s"], result["committed"] = float(said.group(2)), said.group(1)
        if result.get("steps_lost"):  # more than none: say why, for the results file (which step, from where)
            events = json.loads(_cli(address, "events", "--job", job, "--json") or "[]")
            result["restore"] = [e["message"] for e in events if e["kind"].startswith("job.snapshot")]
            result["trainlib"] = [line for r in (0, 1) for line in _cli(address, "logs", job, "--rank", str(r))
                                  .splitlines() if line.startswith("trainlib:")][-12:]
        return result
    finally:
        stop_cluster(root, procs)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)


def _trial(system: str, trial, fault: str) -> dict:
    with temp_root(prefix=f"phalanx-bench-recovery-{system}-") as tmp:
        log(f"recovery: {system}: {fault} ...")
        try:
            outcome = trial(fault, Path(tmp))
        except Exception as e:
            outcome = {"error": f"{type(e).__name__}: {e}", "resumed_s": None, "steps_lost": None}
        resumed = outcome.get("resumed_s")
        log(f"recovery: {system}: {fault}: " + (f"training again after {resumed} s, {outcome['steps_lost']} steps "
            "computed twice" if resumed is not None else outcome.get("skipped") or
            f"never within {WINDOW_S:g} s {outcome.get('error', '')}"))
        return outcome


def _summary(trials: list[dict]) -> dict:
    """Median and max over the trials; a trial that never resumed counts as never (max) and is listed."""
    import statistics
    done = [t for t in trials if t.get("resumed_s") is not None]
    out = {"trials": trials, "resumed": len(done), "of": len(trials)}
    if done:
        out.update(resumed_s=statistics.median(t["resumed_s"] for t in done),
                   resumed_max_s=max(t["resumed_s"] for t in done),
                   steps_lost=statistics.median(t["steps_lost"] for t in done),
                   steps_lost_max=max(t["steps_lost"] for t in done),
                   warm=sum(1 for t in done if t.get("warm")))
        out["seconds_in_state"] = done[-1].get("seconds_in_state", {})
    else:
        out.update(resumed_s=None, steps_lost=None)
    commits = [t["commit_s"] for t in trials if "commit_s" in t]
    if commits:
        out.update(commit_s=statistics.median(commits), commit_max_s=max(commits),
                   committed=sorted({t["committed"] for t in trials if "committed" in t}))
    return out


def run(quick: bool = False) -> dict:
    results: dict[str, dict] = {}
    repeats = 1 if quick else REPEATS
    for fault in FAULTS:
        results[fault] = {"phalanx": _summary([_trial("phalanx", phalanx_trial, fault) for _ in range(repeats)]),
                          "torchrun": _trial("torchrun", torchrun_trial, fault),
                          "torchrun + phalanx rendezvous": _trial("torchrun-phalanx", torchrun_phalanx_trial, fault)}
    # The checkpoint before an eviction, with a state large enough for its save to count: an in-memory snapshot
    # (replicated) against a durable save, alternating; snapshots are taken all along either way
    big = ("--state-mb", str(EVICTION_STATE_MB))
    modes = {"phalanx, in-memory commit": (), "phalanx, durable commit": ("PHALANX_EVICTION_CHECKPOINT=durable",)}
    trials: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(1 if quick else 3):
        for mode, env in modes.items():
            trials[mode].append(_trial("phalanx", lambda f, r, env=env: phalanx_trial(f, r, big, env),
                                       "remap-pending"))
    results[f"remap-pending, {EVICTION_STATE_MB} MB a rank"] = {mode: _summary(t) for mode, t in trials.items()}
    return {"faults": results, "window_s": WINDOW_S, "repeats": repeats,
            "job": "2 nodes x 1 rank, gloo on CPU, 0.05 s steps, a durable checkpoint every 500 steps, "
                   "Phalanx: an in-memory snapshot every step"}
