"""trainlib's state inside one rank: the environment Phalanx gave it, step timing, checkpoint requests.

The per-step hook only writes numbers into preallocated rings (no lock, no system call); a daemon
thread sends the batch to the node's agent twice a second over its Unix socket. What the controller
wants of this rank (a checkpoint) is pushed by the agent down a `Watch` stream that a second daemon
thread holds open, so a request agreed a second ahead arrives in milliseconds; each report's reply
carries it too, in case the stream is broken. SIGUSR1 — what Slurm's `--signal` sends — is a
checkpoint request too.

When the agent answers that this rank's generation is no longer current (a newer one of the job
runs), the reporter thread ends the process itself, with one line on stderr and exit code
STALE_EXIT_CODE: the training thread may be blocked in a collective whose peers are gone and never
reach another step, and whatever it did next (a step, a checkpoint) would be thrown away or worse.

A script that hands its training function to `run(train_fn)` lets the rank outlive its generation:
the agent's stop (SIGTERM) raises GenerationEnded in the training thread, and an exception out of
the function (a collective whose peer died) ends the generation the same way. The process then
tears down its process group, tells the agent (Park), and waits; when the next generation is
launched on this node with this rank in it, the agent hands it the new environment and run() calls
the function again: no new process, no imports, the script's module state kept.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REPORT_INTERVAL_S = 0.5
EVICTION_WAIT_S = 120.0
RPC_TIMEOUT_S = 2.0  # a report that cannot reach the agent in this time is dropped, not retried
WATCH_RETRY_S = 1.0  # a broken Watch stream is opened again after this long (reports carry requests meanwhile)
PARK_WAIT_S = 300.0  # a parked rank waits this long at most for the agent's answer (the agent answers sooner)
STALE_EXIT_CODE = 75  # EX_TEMPFAIL: this generation is over; the job goes on in a newer one
FATAL_EXIT_CODE = 78  # EX_CONFIG: the job cannot work as submitted (Phalanx fails it rather than restart it)
# How long rank 0, at its first save, waits to see every rank's marker in the checkpoint directory (a shared
# filesystem may show another node's new file late); PHALANX_CHECKPOINT_SHARED_WAIT_S overrides it.
SHARED_WAIT_S = 60.0

# NCCL watchdog defaults (REFERENCE.md), set unless the user already set them. Phalanx finds hung
# collectives itself within seconds; these make sure a hang leaves a flight-recorder dump behind.
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}
# The flight recorder's buffer size has two names: torch renamed TORCH_NCCL_TRACE_BUFFER_SIZE to
# TORCH_FR_BUFFER_SIZE and warns, on every rank, when the old name is set. Only the name the installed
# torch reads is set (flight_recorder_env), and neither when the user set one of them.
FR_BUFFER_ENV_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_BUFFER_SIZE = "2000"
FR_RENAMED_IN = (2, 9)  # only consulted when torch's headers are not installed (see flight_recorder_env)


@dataclass(frozen=True)
class Context:
    active: bool  # running under Phalanx
    job: str
    generation: int
    rank: int
    local_rank: int
    world_size: int
    checkpoint_dir: str
    agent_socket: str
    node: str = ""
    local_world_size: int = 1
    # Who saves durable checkpoints, and with whom: the job's ranks; in a job of replica groups, the rank's own group
    # (each group saves a whole copy in checkpoint_dir/group-G, its generations its own: a group rebuilt alone has a
    # newer generation than the others, and must not wait for their markers nor fence their saves)
    save_rank: int = 0
    save_world_size: int = 1


_ctx: Context | None = None
# Step samples live in preallocated rings: the hook writes numbers into existing slots, so it never
# allocates memory (an allocation can mean an mmap, a system call). The reporter reads behind it.
RING = 65_536
_ring_step = array("q", bytes(8 * RING))
_ring_step_s = array("d", bytes(8 * RING))
_ring_compute_s = array("d", bytes(8 * RING))
_ring_end_ns = array("q", bytes(8 * RING))
_head = 0  # samples written, ever
_tail = 0  # samples sent, ever
_last_end = time.perf_counter()
_compute_mark = 0.0
_steps_seen = 0
_requested = False
_request_id = 0
_pause_after = False  # the pending request precedes an eviction: stop stepping once committed
_at_step = 0  # the pending request is for the end of this step (every rank saves the same one)
_deadline = 0.0  # time.monotonic() by which the pending request must be committed (0: none said)
_no_in_memory = ""  # why the agent cannot keep the pending eviction's checkpoint in host memory ("": it can)
_last_step = -1
_handled: set[int] = set()
_callback: Callable[[int], None] | None = None
_checkpointer: Any = None
_reporter: threading.Thread | None = None
_stub_lock = threading.Lock()
_saving = False  # save() is writing: reports say so, and the hang detector waits
_stale = False  # the agent said a newer generation of the job runs: this process is ending
_shared_checked = False  # rank 0 has seen every rank's marker in the checkpoint directory
_snapshotter: Any = None  # trainlib._snapshot.Snapshotter, once snapshot() is first called under Phalanx
_slow = 0.0  # a slow=F fault on this rank's GPU, from the agent's replies: each step's compute takes (1 + F)x
_ending = False  # a stop came: the training function is unwinding (a second stop changes nothing)
_parked = False  # waiting for the agent to say whether this process rejoins (a stop now ends it)
# _head when training was last said to have ended here (the default process group destroyed, the interpreter exiting,
# trainlib.finish()); -1: never. Training has ended while no step came since: a step undoes it without the hook
# writing anything more than it did.
_finished_head = -1
_flush_lock = threading.Lock()  # one report at a time: the reporter's, or the one that says training has ended
_crashed = False  # an exception reached the top of the main thread: the exit that follows is no end of training
# Held while this process parks or takes its next generation, and by a reply's "stale" while it decides to end the
# process: a stale answer about a generation the process has already left must not end it in its next one.
_generation_lock = threading.Lock()
_rdzv: Any = None  # trainlib._rdzv_worker.Reporter: a torchrun worker's reports to the controller's rendezvous


class GenerationEnded(BaseException):
    """Raised in the training thread of a rank run by `trainlib.run` when the agent stops its generation. A
    BaseException, as KeyboardInterrupt is: an `except Exception` in the training loop must not swallow it."""


def init() -> Context:
    """Read the environment the agent gave this rank; start the reporter. Idempotent."""
    global _ctx, _reporter, _rdzv
    if _ctx is not None:
        return _ctx
    env = os.environ
    active = bool(env.get("PHALANX_JOB"))
    group = env.get("PHALANX_REPLICA_GROUP", "")  # a replica-group job of Phalanx's (--replicas)
    checkpoint_dir = env.get("PHALANX_CHECKPOINT_DIR") or os.path.abspath("checkpoints")
    _ctx = Context(
        active=active,
        job=env.get("PHALANX_JOB", ""),
        generation=int(env.get("PHALANX_GENERATION", "1")),
        # the job's rank: RANK and WORLD_SIZE are a replica group's own in a job of replica groups (PHALANX_RANK and
        # PHALANX_WORLD_SIZE are the job's; the agent and the controller know each rank by it)
        rank=int(env.get("PHALANX_RANK") or env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env.get("PHALANX_WORLD_SIZE") or env.get("WORLD_SIZE", "1")),
        checkpoint_dir=os.path.join(checkpoint_dir, f"group-{group}") if group else checkpoint_dir,
        agent_socket=env.get("PHALANX_AGENT_SOCKET", ""),
        node=env.get("PHALANX_NODE", ""),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        save_rank=int(env.get("RANK", "0") if group else env.get("PHALANX_RANK") or env.get("RANK", "0")),
        save_world_size=int(env.get("WORLD_SIZE", "1") if group else
                            env.get("PHALANX_WORLD_SIZE") or env.get("WORLD_SIZE", "1")),
    )
    if not active:
        from trainlib import _rdzv_worker
        if _rdzv is None:  # started by torchrun with Phalanx's rendezvous: checkpoint requests come from there
            _rdzv = _rdzv_worker.start(env, progress=_rdzv_progress, heed=_heed_request)
            if _rdzv is not None:  # its end of training is told as a Phalanx-launched rank's is
                atexit.register(_flush_at_exit)
                _hook_excepthook()
                _hook_destroy()
        if _rdzv is not None:
            return _ctx
        warnings.warn("trainlib: not running under Phalanx (no PHALANX_JOB); step hooks are no-ops and checkpoints "
                      f"go to {_ctx.checkpoint_dir}", stacklevel=2)
        return _ctx
    for key, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not any(name in os.environ for name in FR_BUFFER_ENV_NAMES):
        os.environ[flight_recorder_env()] = FR_BUFFER_SIZE
    try:  # every rank checks at its first save that it sees every rank's marker (trainlib/shared_dir.py)
        from pathlib import Path

        from trainlib.shared_dir import announce
        announce(Path(_ctx.checkpoint_dir), _ctx.generation, _ctx.save_rank, _ctx.node or socket.gethostname())
    except OSError as e:
        print(f"trainlib: cannot write this rank's marker in the checkpoint directory {_ctx.checkpoint_dir}: {e}",
              file=sys.stderr, flush=True)
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None) and threading.current_thread() is \
            threading.main_thread():
        signal.signal(signal.SIGUSR1, _on_sigusr1)
    if _ctx.agent_socket:
        if _reporter is None:  # one for the life of the process: it reports for whichever generation is current
            _reporter = threading.Thread(target=_report_loop, name="trainlib-reporter", daemon=True)
            _reporter.start()
            atexit.register(_flush_at_exit)
            _hook_excepthook()
        _hook_destroy()
        threading.Thread(target=_watch_loop, args=(_ctx,), name="trainlib-watcher", daemon=True).start()
    return _ctx


def flight_recorder_env() -> str:
    """The name the installed torch reads for the flight recorder's buffer size, found without importing torch
    (seconds): torch's own FlightRecorder.hpp, installed with it, lists the names it reads, newest first;
    without the headers, torch's version decides."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("torch")
    for directory in (spec.submodule_search_locations or []) if spec is not None else []:
        header = os.path.join(directory, "include", "torch", "csrc", "distributed", "c10d", "FlightRecorder.hpp")
        try:
            with open(header, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        return next((name for name in FR_BUFFER_ENV_NAMES if f'"{name}"' in text), FR_BUFFER_ENV_NAMES[1])
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return FR_BUFFER_ENV_NAMES[0]
    parts = [int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit()]
    return FR_BUFFER_ENV_NAMES[0] if tuple(parts) >= FR_RENAMED_IN else FR_BUFFER_ENV_NAMES[1]


def step(number: int | None = None) -> None:
    """Mark the end of a training step. Cheap enough for every step: no lock, no allocation, no system call."""
    global _last_end, _compute_mark, _steps_seen, _head, _last_step
    now = time.perf_counter()
    if _slow and _compute_mark <= _last_end:  # slow=F, and the script marks no compute: the whole step is slowed
        now = _throttle(_last_end, now)
    slot = _head % RING
    _last_step = _steps_seen if number is None else number
    _ring_step[slot] = _last_step
    _ring_step_s[slot] = now - _last_end
    _ring_compute_s[slot] = _compute_mark - _last_end if _compute_mark > _last_end else 0.0
    _ring_end_ns[slot] = time.time_ns()
    _head += 1
    _last_end = now
    _steps_seen += 1


def compute_done() -> None:
    """Mark, within a step, the end of the compute before the gradient synchronisation."""
    global _compute_mark
    _compute_mark = time.perf_counter()
    if _slow:
        _compute_mark = _throttle(_last_end, _compute_mark)


def _throttle(start: float, now: float) -> float:
    """slow=F as a throttled GPU shows it: the work since `start` takes (1 + F)x as long. The difference is slept,
    not spun, so the rank takes no CPU from its neighbours. Returns the clock after it."""
    time.sleep(_slow * (now - start))
    return time.perf_counter()


def checkpoint_requested() -> bool:
    """True when Phalanx (or SIGUSR1) asked this rank to checkpoint, the step it named is done, and the
    rank has not saved since."""
    return _requested and (_at_step == 0 or _last_step >= _at_step)


def on_checkpoint_request(callback: Callable[[int], None]) -> None:
    """Call `callback(request_id)` (from trainlib's reporter thread, or the signal handler) on each request."""
    global _callback
    _callback = callback


def _request(request_id: int, pause: bool = False, at_step: int = 0, deadline_s: float | None = None,
             no_in_memory: str = "") -> None:
    global _requested, _request_id, _pause_after, _at_step, _deadline, _no_in_memory
    _requested, _request_id, _pause_after, _at_step = True, request_id, pause, at_step
    _deadline = time.monotonic() + deadline_s if deadline_s is not None and math.isfinite(deadline_s) else 0.0
    _no_in_memory = no_in_memory
    if _callback is not None:
        _callback(request_id)


def _heed_request(request_id: int, at_step: int, pause: bool, deadline_s: float | None = None,
                  no_in_memory: str = "") -> None:
    """A checkpoint request from the controller (pushed, reported or polled): taken once. `deadline_s`: the seconds
    left to commit it (None: not said); `no_in_memory`: why the agent cannot keep an eviction's checkpoint in host
    memory."""
    if request_id and request_id not in _handled and (not _requested or _request_id != request_id):
        if at_step and _last_step > at_step:  # the ranks that heard it in time save at_step; this one a later step
            print(f"trainlib: checkpoint request {request_id} (after step {at_step}) reached rank "
                  f"{_ctx.rank if _ctx else '?'} only at step {_last_step}: its save will not match the other ranks' "
                  "(recovery.checkpoint_lead_s may be too short for this machine)", file=sys.stderr, flush=True)
        _request(request_id, pause, at_step, deadline_s, no_in_memory)


PACE_SAMPLES = 32  # the recent step times a torchrun worker's pace is the median of
RDZV_COMPUTE_SAMPLES = 256  # at most this many compute times a report (controller.rendezvous.book.MAX_COMPUTE_SAMPLES)
_rdzv_tail = 0  # samples a torchrun worker's reports have taken the compute times of


def _rdzv_progress() -> tuple[int, float, bool, bool, list[float]]:
    """For a torchrun worker's report: the last step done (-1: none yet), the median of the recent step times (0:
    none yet), whether save() is writing, whether training has ended, and the compute time of each step since the
    previous report (the newest RDZV_COMPUTE_SAMPLES; 0.0 for a step whose compute the script did not mark)."""
    global _rdzv_tail
    _hook_destroy()  # a script that imported torch.distributed only after init()
    head = _head
    times = sorted(_ring_step_s[i % RING] for i in range(max(0, head - PACE_SAMPLES), head))
    compute = [_ring_compute_s[i % RING] for i in range(max(_rdzv_tail, head - RDZV_COMPUTE_SAMPLES), head)]
    _rdzv_tail = head
    return _last_step, times[len(times) // 2] if times else 0.0, _saving, _finished_head == head, compute


def _on_sigusr1(signum: int, frame: object) -> None:
    _request(0)


def _checkpoint():
    global _checkpointer
    if _checkpointer is None:
        from trainlib.checkpoint import Checkpointer
        ctx = init()
        barrier = None
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                barrier = dist.barrier
        except ImportError:
            pass
        _checkpointer = Checkpointer(ctx.checkpoint_dir, rank=ctx.save_rank, world_size=ctx.save_world_size,
                                     generation=ctx.generation, barrier=barrier)
        _checkpointer.claim_generation()
    return _checkpointer


def save(state: dict, step_number: int) -> Any:
    """Write this rank's checkpoint for `step_number` atomically and durably (see trainlib.checkpoint);
    if Phalanx asked for it, tell Phalanx the step is safe."""
    global _requested
    if _stale:  # between the agent's answer and the end of the process: commit nothing
        from trainlib.checkpoint import StaleGenerationError
        raise StaleGenerationError(f"generation {_ctx.generation if _ctx else '?'} is no longer current; "
                                   f"refusing to save step {step_number}")
    global _saving
    answers = checkpoint_requested()  # a periodic save before the agreed step does not answer a request
    _check_shared()
    _saving = True  # the reporter says so: a long save is not a hang
    try:
        result = _checkpoint().save(state, step_number)
    finally:
        _saving = False
    if answers:
        request_id, pause = _request_id, _pause_after
        _requested = False
        if request_id:
            _handled.add(request_id)
        _send_done(request_id, step_number)
        if pause and step_number == _at_step:  # saved where every rank saves: nothing after it would be kept
            _wait_for_eviction(step_number)
    return result


def _check_shared() -> None:
    """A rank's first save under Phalanx: every rank's marker must be visible, or the job can never checkpoint.
    Every rank checks (not only rank 0): a rank that cannot see the others reports the reason itself, instead of
    crashing in a collective when rank 0 leaves, which would look like an ordinary crash and be restarted."""
    global _shared_checked
    ctx = _ctx
    if _shared_checked or ctx is None or not ctx.active:
        return
    from pathlib import Path

    from trainlib.shared_dir import check
    wait_s = float(os.environ.get("PHALANX_CHECKPOINT_SHARED_WAIT_S") or SHARED_WAIT_S)
    problem = check(Path(ctx.checkpoint_dir), ctx.generation, ctx.save_world_size, ctx.local_world_size,
                    ctx.node or socket.gethostname(), wait_s, rank=ctx.save_rank)
    if problem:
        _end_fatal(problem)
    _shared_checked = True


def _end_fatal(reason: str) -> None:
    """This job cannot work as submitted: say why, tell Phalanx (the job fails with the reason instead of
    restarting), and end the process."""
    print(f"trainlib: fatal: {reason}", file=sys.stderr, flush=True)
    if _ctx is not None and _ctx.agent_socket:
        from phalanx.v1 import local_pb2
        try:
            _agent().Report(local_pb2.ReportRequest(job=_ctx.job, generation=_ctx.generation, rank=_ctx.rank,
                                                    pid=os.getpid(), fatal=reason), timeout=RPC_TIMEOUT_S)
        except Exception as e:
            print(f"trainlib: could not tell the agent why this rank stops: {e}", file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(FATAL_EXIT_CODE)


def _wait_for_eviction(step_number: int, how: str = "durably") -> None:
    """Phalanx checkpointed this rank to evict it: take no further step (none would be kept) and wait for
    the stop. If no stop comes (the eviction was called off), carry on after the deadline."""
    print(f"trainlib: step {step_number} committed {how}; waiting to be stopped for an eviction", file=sys.stderr,
          flush=True)
    deadline = time.monotonic() + EVICTION_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.1)


def load_latest(map_location: str = "cpu") -> Any:
    """The newest state to resume from, or None: after a failure, the in-memory snapshot Phalanx names when every
    rank has its own (collective then: every rank calls it, after init_process_group), else the newest complete
    durable checkpoint."""
    checkpointer = _checkpoint()
    ctx = init()
    if ctx.active and ctx.agent_socket:
        from trainlib._snapshot import restore
        loaded = restore(ctx, checkpointer, _agent(), map_location, _agreement(), _tell)
        if loaded is not None:
            return loaded
    return checkpointer.load_latest(map_location=map_location)


def snapshot(state: dict | Callable[[], dict], step_number: int) -> bool:
    """Keep `state` (or what the function `state` returns, called only when a snapshot is due) as of
    `step_number` in host memory that outlives this process, replicated to another node,
    when a snapshot is due (every step while that costs at most 3% of a step; see trainlib._snapshot). Blocks only
    for the copy into host memory. True if one was taken; always False outside Phalanx or without an agent that
    keeps snapshots. Call it on every rank after trainlib.step(step_number), with the state a restart would need.

    At the step a checkpoint before an eviction names, it answers the request instead (see _commit_in_memory):
    every rank writes that step's snapshot and waits for its replica, then for the other ranks (a collective), and
    then for the eviction, as trainlib.save() would. checkpoint_requested() is then False, unless some rank's
    snapshot could not be kept: then every rank saves durably."""
    global _snapshotter
    ctx = _ctx
    if ctx is None or not ctx.active or not ctx.agent_socket or _stale:
        return False
    if _snapshotter is None and (directory := os.environ.get("PHALANX_SNAPSHOT_DIR", "")):
        from pathlib import Path

        from trainlib._snapshot import Snapshotter
        every = os.environ.get("PHALANX_SNAPSHOT_EVERY", "")
        _snapshotter = Snapshotter(Path(directory), ctx.job, ctx.generation, ctx.rank,
                                   lambda request: _agent().SnapshotTaken(request, timeout=RPC_TIMEOUT_S),
                                   int(every) if every.strip().isdigit() else None)
    # every rank that calls snapshot() takes part, one that keeps no snapshots too (it votes no): the vote is a
    # collective, which a rank left out of would leave the others waiting in
    if _pause_after and checkpoint_requested() and _eviction_in_memory():
        return _commit_in_memory(_snapshotter, state, step_number)
    if _snapshotter is None:
        return False
    return _snapshotter.offer(state, step_number, _ring_step_s[(_head - 1) % RING] if _head else 0.0)


REPLICA_WAIT_S = 10.0  # the longest the agent waits for a replica (agent.snapshots.REPLICA_WAIT_S)
COMMIT_WAIT_S = 1.0  # the commit's wait for a replica the agent confirmed a moment ago (only a restart lost it)
AGENT_ANSWER_S = 5.0  # what the agent's answer on an in-memory commit may take beyond its wait for the replica
IN_MEMORY_SHARE = 0.5  # of the time left to commit an eviction's checkpoint, what the in-memory attempt may take: if
# it fails, every rank's durable save has the rest
EVICTION_CHECKPOINT = ("memory", "durable")  # PHALANX_EVICTION_CHECKPOINT: how a rank commits before an eviction
_eviction_said = False


def _eviction_in_memory() -> bool:
    """Whether an eviction's checkpoint is answered by the in-memory snapshot (PHALANX_EVICTION_CHECKPOINT=memory,
    the default) or by the script's durable save ("durable": where the checkpoint storage takes the state faster
    than a write into tmpfs and one copy to another node do)."""
    global _eviction_said
    how = os.environ.get("PHALANX_EVICTION_CHECKPOINT", "").strip().lower() or "memory"
    if how not in EVICTION_CHECKPOINT:
        if not _eviction_said:
            _eviction_said = True
            print(f"trainlib: PHALANX_EVICTION_CHECKPOINT={how!r} is not one of {', '.join(EVICTION_CHECKPOINT)}; "
                  "using memory", file=sys.stderr, flush=True)
        how = "memory"
    return how == "memory"


def _commit_in_memory(snapshotter: Any, state: dict | Callable[[], dict], step_number: int) -> bool:
    """Answer an eviction's checkpoint request with the in-memory snapshot of `step_number` instead of a durable
    save: it costs a write into the agent's tmpfs and a replica on the job's peer node, not a write of the whole
    state to shared storage. Each rank writes its snapshot and asks its agent whether the replica is kept; the
    ranks then agree (a collective) that every one of them has both, and only then does each commit, so that the
    eviction loses nothing if the node then dies. If any rank's cannot be kept, none commits in memory: the
    request stays, and every rank's save() answers it durably (a save waits for every rank). The ranks wait for
    their replicas only until IN_MEMORY_SHARE of the time left to commit has passed, so that a durable save has
    the rest. True if a snapshot was taken."""
    global _requested
    request_id, ctx = _request_id, _ctx
    assert ctx is not None
    from phalanx.v1 import local_pb2
    start = time.monotonic()
    until = start + (_deadline - start) * IN_MEMORY_SHARE if _deadline else math.inf

    def done(check_only: bool, wait_s: float = 0.0) -> str:
        try:
            return _agent().CheckpointDone(local_pb2.CheckpointDoneRequest(
                job=ctx.job, generation=ctx.generation, rank=ctx.rank, request_id=request_id, step=step_number,
                in_memory=True, check_only=check_only, wait_s=wait_s), timeout=wait_s + AGENT_ANSWER_S).error
        except Exception as e:  # the agent restarting: the durable path still answers
            return f"the agent did not confirm it: {e}"

    taken = False
    if snapshotter is None:
        why = "this node keeps no snapshots"
    elif _no_in_memory:  # no write that could not be kept (a job on one node has no peer for the replica)
        why = _no_in_memory
    elif until <= start:
        why = "the checkpoint's deadline has passed"
    elif not (taken := snapshotter.commit(state, step_number)):
        why = snapshotter.disabled or "it was not kept"
    elif (wait_s := min(REPLICA_WAIT_S, until - time.monotonic())) <= 0:
        why = (f"the snapshot took {time.monotonic() - start:.1f}s to write, with the checkpoint due "
               f"{_deadline - start:.1f}s after the step: no time left to wait for its replica")
    else:
        why = done(True, wait_s)
    agree = _agreement()
    if agree is None or not agree(not why):
        print(f"trainlib: rank {ctx.rank}: checkpoint request {request_id} is not answered in memory ("
              f"{why or 'another rank could not keep its snapshot of step ' + str(step_number)}); every rank saves "
              "durably", file=sys.stderr, flush=True)
        return taken
    why = done(False, COMMIT_WAIT_S)
    if why:  # its replica was kept a moment ago: only an agent restarted meanwhile says otherwise
        print(f"trainlib: rank {ctx.rank}: the agent did not take the in-memory checkpoint of step {step_number} it "
              f"had confirmed: {why}", file=sys.stderr, flush=True)
    _requested = False
    if request_id:
        _handled.add(request_id)
    if step_number == _at_step:
        _wait_for_eviction(step_number, "in host memory, replicated")
    return True


def _agreement() -> Callable[[bool], bool] | None:
    """How the ranks agree on a yes/no: a collective over the process group; None when they cannot."""
    ctx = init()
    try:
        import torch.distributed as dist
    except ImportError:
        dist = None
    if dist is not None and dist.is_available() and dist.is_initialized():
        def agree(ok: bool) -> bool:
            votes: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(votes, ok)
            return all(votes)
        return agree
    return (lambda ok: ok) if ctx.save_world_size == 1 else None


def _tell(kind: str, message: str) -> None:
    """Put `message` in the controller's event log (through the agent); best effort."""
    from phalanx.v1 import local_pb2
    ctx = init()
    try:
        _agent().Tell(local_pb2.TellRequest(job=ctx.job, generation=ctx.generation, rank=ctx.rank, kind=kind,
                                            message=message), timeout=RPC_TIMEOUT_S)
    except Exception as e:
        print(f"trainlib: could not tell the agent ({kind}): {e}", file=sys.stderr, flush=True)


# -- talking to the agent --------------------------------------------------------------------

_stub = None


def _agent():
    global _stub
    with _stub_lock:  # the reporter and the watcher share one channel
        if _stub is None:
            import grpc

            from phalanx.v1 import local_pb2_grpc
            _stub = local_pb2_grpc.LocalServiceStub(grpc.insecure_channel(f"unix://{_ctx.agent_socket}"))
        return _stub


def _flush(at_exit: bool = False) -> None:
    with _flush_lock:
        _flush_locked(at_exit)


def _flush_locked(at_exit: bool) -> None:
    global _tail
    from phalanx.v1 import local_pb2
    ctx = _ctx
    if ctx is None:  # between two generations of a rank run by trainlib.run: nobody to report for
        return
    head = _head
    start = max(_tail, head - RING)  # more than a ring behind: the oldest are overwritten, send the rest
    batch = []
    for i in range(start, head):
        slot = i % RING
        batch.append(local_pb2.StepSample(step=_ring_step[slot], step_s=_ring_step_s[slot],
                                          compute_s=_ring_compute_s[slot], end_unix_ns=_ring_end_ns[slot]))
    _tail = head
    reply = _agent().Report(local_pb2.ReportRequest(job=ctx.job, generation=ctx.generation, rank=ctx.rank,
                                                    steps=batch, pid=os.getpid(), saving=_saving,
                                                    finished=_finished_head == head),
                            timeout=RPC_TIMEOUT_S)
    if not at_exit:
        _heed(reply, ctx)


def _heed(reply: Any, ctx: Context) -> None:
    """Act on what the agent says the controller wants of this rank (a ReportReply, reported or pushed) in `ctx`'s
    generation. A reply about a generation this process has since left (trainlib.run) is news no longer."""
    global _slow
    if ctx is not _ctx:
        return
    if reply.stale:
        _end_stale(ctx)
    _slow = reply.slow_factor
    request = reply.checkpoint
    if request.id:  # what is left of the deadline: an older agent says only how long it was when it came
        left = (request.due_unix_ns - time.time_ns()) / 1e9 if request.due_unix_ns else request.deadline_s
        _heed_request(request.id, request.at_step, request.pause, left, request.no_in_memory)


def _watch_loop(ctx: Context) -> None:
    """Hold the agent's Watch stream open for `ctx`'s generation: requests arrive the moment the agent has them.
    Ends when this process has moved on to another generation (trainlib.run)."""
    from phalanx.v1 import local_pb2
    while _ctx is ctx:
        try:
            for reply in _agent().Watch(local_pb2.WatchRequest(job=ctx.job, generation=ctx.generation, rank=ctx.rank)):
                if _ctx is not ctx or _parked:
                    return
                _heed(reply, ctx)
        except Exception:  # the agent restarting, or an older one without Watch: reports carry the same news
            pass
        time.sleep(WATCH_RETRY_S)


def _end_stale(ctx: Context) -> None:
    """A newer generation of the job runs than `ctx`'s: stop this process now, before it trains or commits anything
    more, unless it has left that generation (trainlib.run: parked, or rejoined the next one)."""
    global _stale
    with _generation_lock:  # held to the end of the process: it cannot park or move on between the check and the exit
        if _parked or ctx is not _ctx:
            return
        _stale = True
        print(f"trainlib: generation {ctx.generation} of {ctx.job} is no longer current (a newer generation runs); "
              f"rank {ctx.rank} (pid {os.getpid()}) stops now without another step or checkpoint "
              f"(exit code {STALE_EXIT_CODE})", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(STALE_EXIT_CODE)


def _flush_at_exit() -> None:
    global _finished_head
    if not _parked and not _crashed:  # the interpreter is exiting: no step will come (a parked rank said how it
        _finished_head = _head  # ended already; an uncaught exception is a crash, not the end of training)
    try:
        _say_finished()
    except Exception:  # the agent may be gone already; the last half second of timings is all we lose
        pass


def finish() -> None:
    """Tell Phalanx that training has ended in this rank: no step will follow (what is left is a final save, the
    teardown, the exit). From then on the job is not judged hung or slow, and its ranks have the controller's
    recovery.exit_grace_s to exit. trainlib says so by itself when the script destroys its default process group
    (torch.distributed.destroy_process_group) and when the interpreter exits; call this only where a long end (a
    final save of a large model by one rank while the others wait) comes before either. A step after it undoes it."""
    global _finished_head
    ctx = _ctx
    reports = _rdzv is not None or (ctx is not None and ctx.active and bool(ctx.agent_socket))
    if _finished_head == _head or ctx is None or not reports or _ending or _parked:
        return
    _finished_head = _head
    try:  # at once, not at the next report: the teardown (an NCCL communicator's takes seconds) is no hang
        _say_finished()
    except Exception:  # the next report says it
        pass


def _say_finished() -> None:
    """Report now, to the agent or (a torchrun worker) to the controller's rendezvous, and wait until it has gone."""
    if _rdzv is not None:
        _rdzv.report_now()
    else:
        _flush(at_exit=True)


def _hook_excepthook() -> None:
    """Remember that an exception reached the top of the main thread (sys.excepthook runs before the atexit
    handlers), so that the exit after it is not reported as the end of training."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        global _crashed
        _crashed = True
        previous(kind, value, tb)

    sys.excepthook = excepthook


def _hook_destroy() -> None:
    """Have torch.distributed.destroy_process_group() of the default group say that training has ended (before it
    tears down: that can take seconds). Only if the script has imported torch.distributed (trainlib does not import
    torch for it); a script that destroys the group between generations under trainlib.run is not ending (_park)."""
    dist = sys.modules.get("torch.distributed")
    original = getattr(dist, "destroy_process_group", None) if dist is not None else None
    if original is None or getattr(original, "_trainlib_hook", False):
        return

    def destroy_process_group(group: Any = None) -> Any:
        whole = group is None or group is getattr(getattr(dist, "GroupMember", None), "WORLD", None)
        if whole and sys.exc_info()[0] is None:  # not on the way out of an exception (a `finally:` after a
            finish()  # collective failed): that is a crash, not the end of training
        return original(group)

    destroy_process_group.__doc__ = original.__doc__
    destroy_process_group.__wrapped__ = original  # type: ignore[attr-defined]
    destroy_process_group._trainlib_hook = True  # type: ignore[attr-defined]
    dist.destroy_process_group = destroy_process_group


def _report_loop() -> None:
    warned = False
    while True:
        time.sleep(REPORT_INTERVAL_S)
        _hook_destroy()  # a script that imported torch.distributed only after init()
        try:
            _flush()
            warned = False
        except Exception as e:  # the agent restarting, say: keep training, try again
            if not warned:
                print(f"trainlib: cannot reach the Phalanx agent at {_ctx.agent_socket}: {e}", file=sys.stderr)
                warned = True


def _send_done(request_id: int, step_number: int) -> None:
    if _rdzv is not None:
        _rdzv.done(request_id, step_number)
        return
    if not (_ctx and _ctx.active and _ctx.agent_socket):
        return
    from phalanx.v1 import local_pb2
    try:
        _agent().CheckpointDone(local_pb2.CheckpointDoneRequest(job=_ctx.job, generation=_ctx.generation,
                                                                rank=_ctx.rank, request_id=request_id,
                                                                step=step_number), timeout=RPC_TIMEOUT_S)
    except Exception as e:
        print(f"trainlib: could not tell the agent that step {step_number} is checkpointed: {e}", file=sys.stderr)


# -- trainlib.run: a rank that outlives its generation ---------------------------------------------------------------

def run(train_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run `train_fn(*args, **kwargs)` as this rank's training, and again for each later generation of the job that
    runs this rank on this node, in this same process. Returns what it returns when it returns (the job is done).

    `train_fn` does what a script's main does: init_process_group, build or load the model, `load_latest()`,
    train. When its generation ends — Phalanx stops it (GenerationEnded is raised in it), or it raises (a
    collective whose peer died) — run() destroys the process group, and the rank waits for the next generation;
    if it is launched here with this rank in it, the environment (RANK, MASTER_PORT, PHALANX_GENERATION, ...) is
    the new generation's and `train_fn` is called again; if not, the process exits (0 if stopped, 1 if it
    raised). Outside Phalanx it is just `train_fn(*args, **kwargs)`."""
    global _ending
    ctx = init()
    if not (ctx.active and ctx.agent_socket) or threading.current_thread() is not threading.main_thread():
        return train_fn(*args, **kwargs)
    signal.signal(signal.SIGTERM, _on_sigterm)
    while True:
        try:
            return train_fn(*args, **kwargs)
        except GenerationEnded:
            code, reason = 0, "stopped"
        except Exception as e:  # what an uncaught exception would have printed, before this rank waits
            traceback.print_exc()
            code, reason = 1, f"{type(e).__name__}: {e}"
        env = _park(code, reason)
        if env is None:
            raise SystemExit(code)
        _next_generation(env)
        _ending = False


def _on_sigterm(signum: int, frame: object) -> None:
    global _ending
    if _parked:  # stopped while waiting to rejoin: this process is done
        os._exit(128 + signum)
    if _ending:
        return
    _ending = True
    raise GenerationEnded(f"generation {_ctx.generation if _ctx else '?'} stopped by Phalanx")


def _park(code: int, reason: str) -> dict[str, str] | None:
    """End this generation here (process group, snapshot writer, reports) and wait for the agent's word: the next
    generation's environment for this rank, or None (exit)."""
    global _parked
    ctx = _ctx
    assert ctx is not None
    with _generation_lock:
        _parked = True
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:
        print(f"trainlib: could not tear the process group down: {e}", file=sys.stderr, flush=True)
    if _snapshotter is not None:
        with contextlib.suppress(Exception):
            _snapshotter.wait()  # the snapshot being written may be the one the next generation restores
    with contextlib.suppress(Exception):
        _flush(at_exit=True)
    print(f"trainlib: generation {ctx.generation} of {ctx.job} ended for rank {ctx.rank} ({reason}); waiting to "
          "rejoin the next one in this process", file=sys.stderr, flush=True)
    from phalanx.v1 import local_pb2
    try:
        reply = _agent().Park(local_pb2.ParkRequest(job=ctx.job, generation=ctx.generation, rank=ctx.rank,
                                                    pid=os.getpid(), exit_code=code, reason=reason),
                              timeout=PARK_WAIT_S)
    except Exception as e:
        print(f"trainlib: the agent did not take this rank back ({e}); exiting", file=sys.stderr, flush=True)
        return None
    if not reply.rejoin:
        print(f"trainlib: no next generation for this process ({reply.why}); exiting", file=sys.stderr, flush=True)
        return None
    return dict(reply.env)


def _next_generation(env: dict[str, str]) -> None:
    """Take the next generation's environment and start trainlib afresh for it."""
    global _ctx, _head, _tail, _steps_seen, _requested, _request_id, _pause_after, _at_step, _last_step, _handled
    global _checkpointer, _saving, _stale, _shared_checked, _snapshotter, _slow, _last_end, _compute_mark, _parked
    global _finished_head
    os.environ.clear()
    os.environ.update(env)
    with _generation_lock:
        _ctx, _checkpointer, _snapshotter = None, None, None
    _tail = _head  # the old generation's samples are not the new one's
    _steps_seen, _requested, _request_id, _pause_after, _at_step, _last_step = 0, False, 0, False, 0, -1
    _handled, _saving, _stale, _shared_checked, _slow = set(), False, False, False, 0.0
    _finished_head = -1
    _last_end = _compute_mark = time.perf_counter()
    _parked = False
    ctx = init()
    print(f"trainlib: rank {ctx.rank} rejoins {ctx.job} in generation {ctx.generation} (same process)",
          file=sys.stderr, flush=True)
