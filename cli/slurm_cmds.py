"""`phalanx run` (a job in the Slurm allocation it is started in) and `phalanx slurm-healthcheck` (Slurm's
HealthCheckProgram, reading the local agent's verdict)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time

import grpc

from cli import render
from cli.main import (
    DEFAULT_TIMEOUT_S,
    FAILED,
    OK,
    TERMINAL,
    USAGE,
    WAIT_POLL_S,
    CliError,
    call,
    directory,
    every_job,
    job_exit_code,
)
from phalanx import slurm
from phalanx.v1 import common_pb2, control_pb2

# Slurm's warning signals (`sbatch --signal=B:USR1@300`): checkpoint now, the job goes on. SIGTERM (scancel,
# the time limit, preemption) and SIGINT: checkpoint, then stop the job.
WARN_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
FIND_JOB_S = 120.0  # how long another task of `srun phalanx run` waits for task 0's job to appear
DEFAULT_AGENT_CONFIG = "/etc/phalanx/agent.toml"  # where the Debian package and the systemd unit keep it


def _say(text: str) -> None:
    print(f"phalanx: {text}", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise CliError("no command: put the program after --, e.g. phalanx run --spares 1 -- python train.py", USAGE)
    try:
        allocation = slurm.Allocation()
    except slurm.SlurmError as e:
        raise CliError(str(e), USAGE) from None
    nodes = len(allocation.nodes) - args.spares
    if nodes < 1:
        raise CliError(f"the allocation has {len(allocation.nodes)} nodes ({allocation.nodelist}); --spares "
                       f"{args.spares} leaves none to run on", USAGE)
    if os.environ.get("SLURM_PROCID", "0") != "0":  # `srun phalanx run`: task 0 runs the job, the others follow it
        return _follow_task(args, allocation.job_name)
    spec = common_pb2.JobSpec(
        name=allocation.job_name, command=command, nodes=nodes, ranks_per_node=args.ranks_per_node,
        spares=args.spares, checkpoint_dir=args.checkpoint_dir or "", workdir=os.getcwd(), env=dict(args.env or []),
        within=allocation.nodes, slurm_job_id=allocation.job_id)
    pending: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: pending.append(signum))
                for sig in (*WARN_SIGNALS, *STOP_SIGNALS)}
    try:
        job = call(args, lambda s: s.SubmitJob(control_pb2.SubmitJobRequest(spec=spec), timeout=DEFAULT_TIMEOUT_S))
        _say(f"{job.id} runs Slurm job {allocation.job_id} on {nodes} of {allocation.nodelist}"
             + (f", {args.spares} kept as spares" if args.spares else "") + f": {' '.join(command)}")
        return _follow(args, job.id, allocation, pending)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _follow(args: argparse.Namespace, job_id: str, allocation: slurm.Allocation, pending: list[int]) -> int:
    """Report the job's changes until it ends; Slurm's signals become a checkpoint (and a stop). Its exit code.
    A controller out of reach (a failover, a restart) is waited for: ending here would end the Slurm job and free
    its nodes while the ranks still run on them."""
    shown = None
    while True:
        while pending:
            signum = pending.pop(0)
            name = signal.Signals(signum).name
            _say(f"Slurm sent {name}: asking every rank of {job_id} to checkpoint" +
                 (", then stopping it" if signum in STOP_SIGNALS else ""))
            _checkpoint(args, job_id)
            if signum in STOP_SIGNALS:
                # the stop is the controller's now (its ranks get SIGTERM, then SIGKILL): exiting at once keeps
                # within Slurm's KillWait, which would otherwise SIGKILL this process and lose the exit code
                job = _steady(args, lambda s: s.CancelJob(control_pb2.CancelJobRequest(id=job_id),
                                                          timeout=DEFAULT_TIMEOUT_S))
                _say(f"{job_id}: {render.job_state(job.state)}")
                return OK if job.state == common_pb2.JOB_STATE_SUCCEEDED else 128 + signum
        job = _steady(args, lambda s: s.GetJob(control_pb2.GetJobRequest(id=job_id), timeout=DEFAULT_TIMEOUT_S))
        state = render.job_state(job.state)
        if (state, job.reason) != shown:
            _say(f"{job.id}: {state}: {job.reason}")
            shown = (state, job.reason)
        if job.state in TERMINAL:
            if job.state == common_pb2.JOB_STATE_FAILED and job.reason.startswith(slurm.EXHAUSTED) and args.requeue:
                _requeue(args, allocation)
            return job_exit_code(job)
        time.sleep(WAIT_POLL_S)


def _steady(args: argparse.Namespace, fn):
    """call(), waiting out a controller that cannot be reached (saying so once) instead of failing."""
    said = False
    while True:
        try:
            return call(args, fn)
        except CliError as e:
            if not e.transient:
                raise
            if not said:
                _say(f"{e}; waiting for the controller (the job's ranks run on meanwhile)")
                said = True
            time.sleep(1.0)


def _follow_task(args: argparse.Namespace, name: str) -> int:
    """Another task of `srun ... phalanx run`: wait for task 0's job to end (Slurm's signals are task 0's to
    handle); its exit code. The name has the Slurm job's restart count, so a requeued run never finds the job of
    the run before it."""
    for sig in (*WARN_SIGNALS, *STOP_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)  # task 0 turns them into a checkpoint; this one just waits
    deadline = time.monotonic() + FIND_JOB_S
    while True:
        jobs = every_job(lambda rpc: _steady(args, rpc))
        job = max((j for j in jobs if j.spec.name == name), key=lambda j: j.submitted_unix_ns, default=None)
        if job is not None and job.state in TERMINAL:
            return job_exit_code(job)
        if job is None and time.monotonic() > deadline:
            raise CliError(f"task 0 of this step submitted no job {name} within {FIND_JOB_S:g}s")
        time.sleep(WAIT_POLL_S * 4)


def _checkpoint(args: argparse.Namespace, job_id: str) -> None:
    request = control_pb2.CheckpointJobRequest(id=job_id, deadline_s=args.grace)
    try:
        reply = call(args, lambda s: s.CheckpointJob(request, timeout=args.grace + DEFAULT_TIMEOUT_S))
    except CliError as e:
        _say(f"{job_id} could not checkpoint: {e}")
        return
    _say(f"{job_id}: every rank committed step {reply.step} ({reply.seconds:.2f}s)")


def _requeue(args: argparse.Namespace, allocation: slurm.Allocation) -> None:
    try:
        slurm.run([*shlex.split(args.scontrol), "requeue", allocation.job_id])
    except slurm.SlurmError as e:
        _say(f"could not requeue Slurm job {allocation.job_id}: {e}")
        return
    _say(f"requeued Slurm job {allocation.job_id}: it starts again on a new allocation, from its last checkpoint")


# -- Slurm's HealthCheckProgram ----------------------------------------------------------------------

def cmd_slurm_healthcheck(args: argparse.Namespace) -> int:
    """Drain this node in Slurm when its agent says FAILING or FAILED; resume it when it is healthy again, if (and
    only if) this check drained it. One line says what it found and did."""
    from agent import config as agent_config
    from phalanx.errors import ConfigError
    from phalanx.nvhcd import nvhcd_pb2, nvhcd_pb2_grpc

    path = DEFAULT_AGENT_CONFIG if args.agent_config is None else args.agent_config
    if args.agent_config is not None and not os.path.isfile(path):  # only the default may be absent (then defaults)
        raise CliError(f"--agent-config {path!r}: no such file", USAGE)
    try:
        cfg = agent_config.load(path if os.path.exists(path) else None)
    except ConfigError as e:  # it names the file
        raise CliError(str(e), USAGE) from None
    node = args.node or cfg.name
    sock = args.socket or cfg.nvrx_socket
    if not sock:
        raise CliError(f"{path} turns the agent's health socket off (nvrx_socket is empty); give "
                       "--socket", USAGE)
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            reply = nvhcd_pb2_grpc.HealthCheckServiceStub(channel).RunHealthCheck(nvhcd_pb2.HealthCheckRequest(),
                                                                                  timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{node}: the Phalanx agent does not answer on {sock} ({e.code().name}); Slurm state left as it is",
              flush=True)
        return FAILED
    verdict = json.loads(reply.output or "{}")
    health = verdict.get("health", "UNKNOWN")
    try:
        record = slurm.node_record(args.scontrol, node)
    except slurm.SlurmError as e:
        print(f"{node}: {health}; cannot read the node in Slurm: {e}", flush=True)
        return FAILED
    states = set(record.get("State", "").split("+"))
    drained = bool(states & {"DRAIN", "DRAINED", "DRAINING"})
    reason = record.get("Reason", "")
    ours = reason.startswith(slurm.UNHEALTHY)
    try:
        if not reply.success:
            why = "; ".join(verdict.get("reasons", [])[:3]) or reply.error or health
            if drained:
                print(f"{node}: {health} ({why}); already drained in Slurm ({reason or 'no reason'})", flush=True)
                return OK
            if not args.dry_run:
                slurm.run(slurm.drain_argv(args.scontrol, node, f"{slurm.UNHEALTHY} {health}: {why}"))
            print(f"{node}: {health} ({why}); drained in Slurm" + (" (dry run)" if args.dry_run else ""), flush=True)
            return OK
        if drained and ours and (health != "HEALTHY" or not verdict.get("controller_connected")):
            print(f"{node}: {health}; left drained in Slurm until the controller says HEALTHY ({reason})", flush=True)
            return OK
        if drained and ours:
            if not args.dry_run:
                slurm.run(slurm.resume_argv(args.scontrol, node))
            print(f"{node}: {health}; resumed in Slurm (this check had drained it: {reason})"
                  + (" (dry run)" if args.dry_run else ""), flush=True)
            return OK
    except slurm.SlurmError as e:
        print(f"{node}: {health}; {e}", flush=True)
        return FAILED
    note = f"; drained in Slurm by someone else ({reason}), left so" if drained else ""
    print(f"{node}: {health}{note}", flush=True)
    return OK


def add_parsers(sub, count, positive, env_pair) -> None:
    p = sub.add_parser("run", help="inside a Slurm allocation: run a job on its nodes, protected (checkpoint "
                       "before eviction, restart on a spare of the allocation); exits with the job's code",
                       usage="%(prog)s [--spares S] [--ranks-per-node R] [--checkpoint-dir DIR] [--env K=V] "
                             "[--grace SECONDS] [--requeue] -- COMMAND ...")
    p.add_argument("--spares", type=count, default=0, help="nodes of the allocation kept as hot spares (default 0)")
    gpus = os.environ.get("SLURM_GPUS_ON_NODE", "")
    p.add_argument("--ranks-per-node", type=positive, default=int(gpus) if gpus.isdigit() and int(gpus) > 0 else 1,
                   help="ranks (GPUs) per node (default: SLURM_GPUS_ON_NODE, else 1)")
    p.add_argument("--checkpoint-dir", type=directory, metavar="DIR",
                   help="where ranks checkpoint, shared by the job's nodes; a relative DIR is taken from the current "
                   "directory (default: each agent's checkpoint_dir/JOB)")
    p.add_argument("--env", action="append", type=env_pair, metavar="K=V", help="environment for every rank")
    p.add_argument("--grace", type=float, default=20.0, metavar="SECONDS",
                   help="how long the ranks have to checkpoint when Slurm signals (scancel, the time limit, "
                   "preemption); keep it under Slurm's KillWait (default 20)")
    p.add_argument("--requeue", action="store_true", help="when no healthy node is left in the allocation, requeue "
                   "the Slurm job (`scontrol requeue`): it runs again on a new allocation, from its last checkpoint")
    p.add_argument("--scontrol", default="scontrol", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the program and its arguments")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("slurm-healthcheck", help="Slurm's HealthCheckProgram: drain this node in Slurm when its "
                       "agent says FAILING or FAILED, resume it when healthy if this check drained it")
    p.add_argument("--agent-config", metavar="FILE",
                   help=f"the agent's config, for its node name and health socket (default {DEFAULT_AGENT_CONFIG}, "
                   "or the agent's defaults where there is none)")
    p.add_argument("--node", help="the node's name in Slurm (default: the agent's node_name)")
    p.add_argument("--socket", help="the agent's health socket (default: the config's nvrx_socket)")
    p.add_argument("--scontrol", default="scontrol", help="the scontrol command (default scontrol)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the agent (default 5)")
    p.add_argument("--dry-run", action="store_true", help="say what it would do, change nothing in Slurm")
    p.set_defaults(func=cmd_slurm_healthcheck)

