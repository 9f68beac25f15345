"""`phalanx`: the operator and user CLI.

Exit codes: 0 ok; 1 failed or denied (controller unreachable, unknown node, refused); 2 usage
(bad arguments here, or a request the controller calls INVALID_ARGUMENT).
"""

from __future__ import annotations

import argparse
import collections
import getpass
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from cli import local, render, terminal
from phalanx import __version__, faults, hostlist, leader, pki, tls
from phalanx.errors import ConfigError, PhalanxError
from phalanx.rpc import (
    CLIENT_OPTIONS,
    DEFAULT_CHECKPOINT_DEADLINE_S,
    DEFAULT_TIMEOUT_S,
    MAX_CHECKPOINT_DEADLINE_S,
    MAX_EVENTS_PAGE,
)
from phalanx.tls import ClientSecurity
from phalanx.v1 import common_pb2, control_pb2, control_pb2_grpc

PROG = "phalanx"
WAIT_POLL_S = 0.5
MAX_LOCAL_HA = 7  # controllers `phalanx local up --ha N` starts at most
MAX_SIM_GPUS = 64  # the agent's gpu.sim_count at most
OK, FAILED, USAGE = 0, 1, 2


class CliError(PhalanxError):
    def __init__(self, message: str, code: int = FAILED, transient: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.transient = transient  # the controller could not be reached: trying again later may do


def controller_address(args: argparse.Namespace) -> str:
    text = args.controller or os.environ.get("PHALANX_CONTROLLER") or local.controller_address() or "?"
    try:
        return ",".join(leader.parse_controllers(text))
    except ValueError:
        return text


def _target(args: argparse.Namespace) -> tuple[list[str], ClientSecurity]:
    """The controllers' addresses and how to reach them: the flags, then the environment, then the local cluster
    (which is plaintext on loopback)."""
    text = args.controller or os.environ.get("PHALANX_CONTROLLER")
    if text:
        security = ClientSecurity.from_env(insecure=args.insecure or None, ca_file=args.ca, cert_file=args.cert,
                                           key_file=args.key)
    elif text := local.controller_address():
        security = ClientSecurity(insecure=True)
    else:
        raise CliError("no controller: pass --controller HOST:PORT, set PHALANX_CONTROLLER, or start a local "
                       "cluster with `phalanx local up --nodes N`")
    try:
        return leader.parse_controllers(text), security
    except ValueError as e:
        raise CliError(str(e), USAGE) from None


def controllers(args: argparse.Namespace) -> leader.Follower:
    """The controllers this command talks to, following the leader; made once per command, closed by main()."""
    if getattr(args, "follower", None) is None:
        addresses, security = _target(args)
        args.security = security  # for the errors (rpc_error)
        args.follower = leader.Follower(addresses, lambda address: security.channel(address, CLIENT_OPTIONS))
    return args.follower


def call(args: argparse.Namespace, fn: Callable[[control_pb2_grpc.ControlServiceStub], object]):
    """Run one control call on the leader; turn gRPC failures into one-line errors with the right exit code."""
    try:
        return controllers(args).call(lambda channel: fn(control_pb2_grpc.ControlServiceStub(channel)))
    except grpc.RpcError as e:
        raise rpc_error(e, args) from None


def rpc_error(e: grpc.RpcError, args: argparse.Namespace) -> CliError:
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE and leader.from_standby(e):
        return CliError(f"cannot reach a leading controller at {controller_address(args)}: {e.details()}",
                        transient=True)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        security = getattr(args, "security", None)
        anonymous = security is not None and not security.insecure and not security.cert_file and not security.token
        # reached, then cut off (not a refused or unresolved address): what mutual TLS does to a caller without one
        anonymous = anonymous and any(w in (e.details() or "") for w in ("Socket closed", "andshake", "SSL", "reset"))
        name = tls.controller_name_problem(e.details(), security.server_name if security is not None else "")
        return CliError(f"cannot reach the controller at {controller_address(args)}: {e.details()}" + (
            " (no client certificate or token was given, and a controller on mutual TLS closes such connections: "
            "pass --cert and --key, or set PHALANX_TOKEN)" if anonymous else "") + (f" ({name})" if name else ""),
            transient=True)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(f"the controller at {controller_address(args)} does not know you: {e.details()}")
    exit_code = USAGE if code == grpc.StatusCode.INVALID_ARGUMENT else FAILED
    return CliError(f"{e.details()} ({code.name})", exit_code)


# -- what operators type: hostlists, output formats, --watch ------------------------------------

def node_names(expr: str) -> list[str]:
    """The nodes a hostlist expression names (`gpu[001-512]`, `a,b`), each once. Raises CliError (usage)."""
    try:
        names = hostlist.expand(expr)
    except hostlist.HostlistError as e:
        raise CliError(f"{expr!r} is not a node name or a hostlist such as gpu[001-512]: {e}", USAGE) from None
    return list(dict.fromkeys(names))


def for_each_node(names: list[str], fn: Callable[[str], None]) -> int:
    """fn(name) for every node. One node: its error is the command's. Several: each error is said and the rest
    go on, then the command fails naming the nodes it failed for; a controller out of reach stops it at once."""
    if len(names) == 1:
        fn(names[0])
        return OK
    failed: list[tuple[str, CliError]] = []
    for name in names:
        try:
            fn(name)
        except CliError as e:
            if e.transient:
                raise
            failed.append((name, e))
            print(f"{PROG}: {name}: {e}", file=sys.stderr, flush=True)
    if failed:
        raise CliError(f"failed for {len(failed)} of {len(names)} nodes: {hostlist.compress(n for n, _ in failed)}",
                       max(e.code for _, e in failed))
    return OK


def add_output(p: argparse.ArgumentParser, *choices: str) -> None:
    """-o/--output CHOICE (the first is the default), and --json for -o json."""
    what = {"table": "a table", "text": "for people", "wide": "a table with more columns", "json": "JSON",
            "name": "one name a line (for scripts: xargs)", "hostlist": "one hostlist expression, gpu[001-004]"}
    p.add_argument("-o", "--output", choices=choices, default=choices[0],
                   help="; ".join(f"{c}: {what[c]}" for c in choices) + f" (default {choices[0]})")
    p.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")


def _checkpoint_deadline(text: str) -> float:
    """checkpoint --deadline: seconds the ranks have to commit (a unit, 2m, is taken too), an hour at most."""
    value = _duration(text, "a number of seconds, e.g. 120")
    if value > MAX_CHECKPOINT_DEADLINE_S:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than the controller allows "
                                         f"({MAX_CHECKPOINT_DEADLINE_S:g} s)")
    return value


def directory(text: str) -> str:
    """--checkpoint-dir: a directory, made whole against the current one (and ~ expanded); an empty one (an unset
    variable in a batch script) is refused rather than taken for the current directory or the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a directory, or leave the option out for each "
                                         "agent's checkpoint_dir/JOB")
    return os.path.abspath(os.path.expanduser(text))


def _interval(text: str) -> float:
    """--watch's SECONDS: a number of seconds (a unit, 30s or 1m, is taken too)."""
    return _duration(text, "a number of seconds, e.g. 2 or 0.5")


def add_watch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", "-w", nargs="?", type=_interval, const=2.0, metavar="SECONDS",
                   help="show it again every SECONDS (default 2) until interrupted, as watch(1) would")


def watched(args: argparse.Namespace, show: Callable[[], tuple[str, bool]]) -> int:
    """Print show()'s text once, or with --watch again every args.watch seconds until it says it is done (or
    Ctrl-C). A controller out of reach while watching is said and tried again; with -o json every refresh is
    one line."""
    if not args.watch:
        print(show()[0])
        return OK
    # Ctrl-C ends the watch, but never inside a refresh: a KeyboardInterrupt could land inside gRPC's own code (a
    # call under way) and leave it holding a lock that the exit then waits for. During a refresh it is noted, and
    # the watch ends once the refresh is over; anywhere else it ends it at once.
    state = _WatchState()
    previous = signal.signal(signal.SIGINT, state.interrupt)
    try:
        return _watch(args, show, state)
    except _Interrupted:
        return OK
    finally:
        signal.signal(signal.SIGINT, previous)


class _Interrupted(Exception):
    pass


class _WatchState:
    def __init__(self) -> None:
        self.interrupted = False
        self.refreshing = False

    def interrupt(self, *_) -> None:
        self.interrupted = True
        if not self.refreshing:
            raise _Interrupted


def _watch(args: argparse.Namespace, show: Callable[[], tuple[str, bool]], state: _WatchState) -> int:
    tty = sys.stdout.isatty()
    while True:
        state.refreshing = True
        if state.interrupted:
            return OK
        try:
            text, done = show()
        except CliError as e:
            if not e.transient:
                raise
            text, done = f"{PROG}: {e} (trying again in {args.watch:g}s)", False
        state.refreshing = False
        if state.interrupted:
            return OK
        if args.output == "json":
            print(json.dumps(json.loads(text)) if text.startswith(("[", "{")) else text, flush=True)
        else:
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")  # home, clear: the screen shows the latest only
            print(f"Every {args.watch:g}s: {PROG} {args.command}    {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            print(text + ("" if tty else "\n"), flush=True)
        if done:
            return OK
        time.sleep(args.watch)


# -- commands ------------------------------------------------------------------------------------

def cmd_certs_init(args: argparse.Namespace) -> int:
    issued = pki.init_ca(args.dir, args.cluster, args.days)
    print(f"cluster CA: {issued.cert} (key {issued.key}, mode 0600), valid until {issued.not_after:%Y-%m-%d}")
    print(f"next: phalanx certs issue controller --role controller --san HOST --dir {args.dir}")
    return OK


def cmd_certs_issue(args: argparse.Namespace) -> int:
    names = node_names(args.name)
    if len(names) > 1:
        return for_each_node(names, lambda name: _issue(argparse.Namespace(**{**vars(args), "name": name})))
    return _issue(args)


def _issue(args: argparse.Namespace) -> int:
    if args.san and args.role not in ("controller", "etcd"):
        raise CliError("--san is only for --role controller or etcd (node and client certificates carry their name)",
                       USAGE)
    if not pki.NAME.fullmatch(args.name):  # a bad argument (2), not a failure of the CA (1)
        raise CliError(f"bad certificate name {args.name!r}: {pki.RULE} (a node's name, or a user's)", USAGE)
    issued = pki.issue(args.dir, args.name, args.role, tuple(args.san), args.days)
    print(f"{args.role} certificate: {issued.cert} (key {issued.key}, mode 0600), valid until "
          f"{issued.not_after:%Y-%m-%d}")
    return OK


def cmd_certs_token(args: argparse.Namespace) -> int:
    reply = call(args, lambda s: s.CreateEnrolToken(control_pb2.CreateEnrolTokenRequest(
        ttl_s=args.ttl, uses=args.uses, description=args.description or ""), timeout=DEFAULT_TIMEOUT_S))
    if args.output == "json":
        print(render.dumps({"token": reply.token, "expires": render.iso(reply.expires_unix_ns),
                            "ca_hash": reply.ca_hash}))
        return OK
    print(f"token:   {reply.token}")
    print(f"expires: {render.iso(reply.expires_unix_ns)}" + (f" (or after {args.uses} node(s))" if args.uses else ""))
    print(f"CA hash: {reply.ca_hash}")
    print(f"on each new node: phalanx certs enrol --controller CONTROLLER:TOKEN_PORT --token {reply.token} "
          f"--ca-hash {reply.ca_hash}")
    return OK


def cmd_certs_enrol(args: argparse.Namespace) -> int:
    from cli import enrol
    address = args.controller or os.environ.get("PHALANX_CONTROLLER", "")
    if not address:
        raise CliError("no controller: pass --controller HOST:PORT, the controller's token port (token_listen)", USAGE)
    token = args.token or os.environ.get("PHALANX_ENROL_TOKEN", "")
    if not token:
        raise CliError("no token: pass --token ID.SECRET (`phalanx certs token create` makes one) or set "
                       "PHALANX_ENROL_TOKEN", USAGE)
    name = args.name or default_node_name()
    unreached: list[str] = []
    for one in [a.strip() for a in address.split(",") if a.strip()]:  # a control plane's token ports: any leader's
        try:
            issued = enrol.enrol(one, token, args.ca_hash, name, args.dir)
            break
        except enrol.EnrolError as e:
            if not e.unreached:
                raise CliError(str(e), USAGE if e.usage else FAILED) from None
            unreached.append(str(e))  # down, or a standby (only the leader enrols): the next one
    else:
        raise CliError("; ".join(unreached) or "no controller address given", FAILED)
    print(f"node {name} enrolled: {issued.cert} (key {issued.key}, made here, mode 0600), valid until "
          f"{issued.not_after:%Y-%m-%d}; the CA is {Path(args.dir) / 'ca.crt'}")
    return OK


def cmd_certs_revoke(args: argparse.Namespace) -> int:
    if bool(args.name) == bool(args.serial):
        raise CliError("give NAME or --serial HEX (one of them)", USAGE)
    reply = call(args, lambda s: s.RevokeCertificate(control_pb2.RevokeCertificateRequest(
        name=args.name or "", role=args.role, serial=args.serial or "", reason=args.reason or ""),
        timeout=DEFAULT_TIMEOUT_S))
    print(reply.message + ("; its agent's session was cut" if reply.sessions_cut else ""))
    return OK


def default_node_name() -> str:
    from agent.config import default_node_name as name
    return name()


def cmd_local_up(args: argparse.Namespace) -> int:
    local.up(args.nodes, args.gpus_per_node, args.gpu_backend, ha=args.ha, session_port=args.session_port)
    return OK


def cmd_local_stop(args: argparse.Namespace) -> int:
    print(local.stop_member(args.member, kill=args.kill))
    return OK


def cmd_local_start(args: argparse.Namespace) -> int:
    print(local.start_member(args.member))
    return OK


def cmd_local_status(args: argparse.Namespace) -> int:
    procs = local.status()
    if args.output == "json":
        print(render.dumps(procs))
    else:
        rows = [(p["role"], p["name"], p["pid"], "running" if p["running"] else "exited", p["address"],
                 p["metrics"], p["log"]) for p in procs]
        print(render.table(("ROLE", "NAME", "PID", "STATUS", "ADDRESS", "METRICS", "LOG"), rows))
    return OK if all(p["running"] for p in procs) else FAILED


def cmd_local_down(args: argparse.Namespace) -> int:
    local.down()
    return OK


def cmd_controllers(args: argparse.Namespace) -> int:
    # Leader and standbys alike answer ListControllers: the first controller that answers will do.
    reply = call(args, lambda s: s.ListControllers(control_pb2.ListControllersRequest(), timeout=DEFAULT_TIMEOUT_S))
    print(render.dumps(render.controllers_dict(reply)) if args.output == "json" else render.controllers_text(reply))
    return OK if reply.leader and not reply.problem else FAILED


def cmd_nodes(args: argparse.Namespace) -> int:
    states = [common_pb2.NodeState.Value(f"NODE_STATE_{s}") for s in args.state or []]
    only = set(node_names(args.nodes)) if args.nodes else None

    def show() -> tuple[str, bool]:
        reply = call(args, lambda s: s.ListNodes(control_pb2.ListNodesRequest(states=states),
                                                 timeout=DEFAULT_TIMEOUT_S))
        nodes = [n for n in reply.nodes if only is None or n.name in only]
        if args.output == "json":
            return render.dumps([render.node_dict(n) for n in nodes]), False
        if args.output == "name":
            return "\n".join(n.name for n in nodes), False
        if args.output == "hostlist":
            return hostlist.compress(n.name for n in nodes), False
        return render.nodes_table(nodes, wide=args.output == "wide"), False

    return watched(args, show)


def cmd_drain(args: argparse.Namespace) -> int:
    def drain(name: str) -> None:
        node = call(args, lambda s: s.DrainNode(control_pb2.DrainNodeRequest(name=name, reason=args.reason),
                                                timeout=DEFAULT_TIMEOUT_S))
        print(f"{node.name}: {render.state_name(node.state)} (drain reason: {node.drain_reason})", flush=True)

    return for_each_node(node_names(args.node), drain)


def cmd_undrain(args: argparse.Namespace) -> int:
    def undrain(name: str) -> None:
        node = call(args, lambda s: s.UndrainNode(control_pb2.UndrainNodeRequest(name=name),
                                                  timeout=DEFAULT_TIMEOUT_S))
        # drained again at once: a fault still there (README: undrain means "fixed"); say which
        again = f" (drained again: {node.drain_reason})" if node.drain_reason else ""
        print(f"{node.name}: {render.state_name(node.state)}{again}", flush=True)

    return for_each_node(node_names(args.node), undrain)


def cmd_health(args: argparse.Namespace) -> int:
    names = node_names(args.node) if args.node else []
    one = names[0] if len(names) == 1 else ""
    reply = call(args, lambda s: s.GetHealth(control_pb2.GetHealthRequest(node=one), timeout=DEFAULT_TIMEOUT_S))
    nodes, missing = list(reply.nodes), []
    if len(names) > 1:
        known, wanted = {n.node for n in nodes}, set(names)
        missing = [n for n in names if n not in known]
        nodes = [n for n in nodes if n.node in wanted]
    if args.output == "json":
        print(render.dumps([render.health_dict(n) for n in nodes]))
    elif nodes or not missing:
        print(render.health_text(nodes, detail=bool(one)), flush=True)
    if missing:  # as a command over several nodes does: the rest are shown, the failures said, then exit 1
        for name in missing:
            print(f"{PROG}: {name}: no node named {name!r}", file=sys.stderr)
        raise CliError(f"failed for {len(missing)} of {len(names)} nodes: {hostlist.compress(missing)}")
    return OK


def cmd_topo(args: argparse.Namespace) -> int:
    from cli.topo import render_topology, topology_dict
    topology = call(args, lambda s: s.GetTopology(control_pb2.GetTopologyRequest(node=args.node),
                                                  timeout=DEFAULT_TIMEOUT_S))
    print(render.dumps(topology_dict(topology)) if args.output == "json" else render_topology(topology))
    return OK


def cmd_inject(args: argparse.Namespace) -> int:
    try:
        fault = faults.parse(args.fault)
    except ValueError as e:
        raise CliError(str(e), USAGE) from None
    def inject(name: str) -> None:
        reply = call(args, lambda s: s.InjectFault(control_pb2.InjectFaultRequest(
            node=name, gpu_index=args.gpu, fault=str(fault)), timeout=DEFAULT_TIMEOUT_S))
        print(reply.message, flush=True)

    return for_each_node(node_names(args.node), inject)


def cmd_submit(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise CliError("no command: put the program after --, e.g. phalanx submit --nodes 2 -- python train.py",
                       USAGE)
    spec = common_pb2.JobSpec(name=args.name or "", command=command, nodes=args.nodes,
                              ranks_per_node=args.ranks_per_node, spares=args.spares,
                              checkpoint_dir=args.checkpoint_dir or "", priority=args.priority,
                              workdir=os.getcwd(), segment=args.segment, env=dict(args.env or []),
                              run_as=args.run_as or "", replicas=args.replicas,
                              limits=common_pb2.ResourceLimits(memory_bytes=args.memory, tasks=args.tasks,
                                                               open_files=args.open_files))
    job = call(args, lambda s: s.SubmitJob(control_pb2.SubmitJobRequest(spec=spec, user=getpass.getuser()),
                                           timeout=DEFAULT_TIMEOUT_S))
    print(job.id)
    return OK


def every_job(call_: Callable[[Callable], control_pb2.ListJobsResponse]) -> list[common_pb2.Job]:
    """Every job the controller has, page by page (ListJobs answers about 8 MiB at a time); `call_(rpc)` makes
    one call of `rpc(stub)` the way its command calls."""
    jobs: list[common_pb2.Job] = []
    after = ""
    while True:
        request = control_pb2.ListJobsRequest(after_id=after)
        reply = call_(lambda s, r=request: s.ListJobs(r, timeout=DEFAULT_TIMEOUT_S))
        jobs.extend(reply.jobs)
        if not reply.next_after_id or not reply.jobs:
            return jobs
        after = reply.next_after_id


def cmd_jobs(args: argparse.Namespace) -> int:
    def show() -> tuple[str, bool]:
        jobs = every_job(lambda rpc: call(args, rpc))
        if args.output == "json":
            return render.dumps([render.job_dict(j) for j in jobs]), False
        if args.output == "name":
            return "\n".join(j.id for j in jobs), False
        return render.jobs_table(jobs, wide=args.output == "wide"), False

    return watched(args, show)


def cmd_job(args: argparse.Namespace) -> int:
    def show() -> tuple[str, bool]:  # --watch ends with the job
        job = call(args, lambda s: s.GetJob(control_pb2.GetJobRequest(id=args.job), timeout=DEFAULT_TIMEOUT_S))
        text = render.dumps(render.job_dict(job)) if args.output == "json" else render.job_text(job)
        return text, job.state in TERMINAL

    return watched(args, show)


TERMINAL = render.FINISHED


def job_exit_code(job: common_pb2.Job) -> int:
    """`phalanx wait`'s exit code: 0 if the job succeeded, else its failing rank's code (1 if none)."""
    if job.state == common_pb2.JOB_STATE_SUCCEEDED:
        return OK
    return job.exit_code if 0 < job.exit_code < 256 else FAILED


def _polled(args: argparse.Namespace, fn: Callable[[control_pb2_grpc.ControlServiceStub], object], reached: list):
    """call() for a command that polls until the job ends (`wait`, `logs -f`): once a controller has answered, losing
    it (a restart, a takeover, a leader's host gone) is said on stderr and waited out, as `events --follow` does;
    before that (a wrong address) it is an error. `reached`: [False] at first."""
    lost = False
    while True:
        try:
            result = call(args, fn)
        except CliError as e:
            if not (e.transient and reached[0]):
                raise
            if not lost:  # once per outage
                print(f"{PROG}: lost the controller ({e}); retrying until it is back (Ctrl-C to stop)",
                      file=sys.stderr, flush=True)
            lost = True
            time.sleep(1.0)
            continue
        if lost:
            print(f"{PROG}: the controller is back", file=sys.stderr, flush=True)
        reached[0] = True
        return result


def cmd_wait(args: argparse.Namespace) -> int:
    shown = None
    reached = [False]
    while True:
        job = _polled(args, lambda s: s.GetJob(control_pb2.GetJobRequest(id=args.job), timeout=DEFAULT_TIMEOUT_S),
                      reached)
        state = render.job_state(job.state)
        if (state, job.reason) != shown and not args.quiet:
            print(f"{job.id}: {state}: {job.reason}", file=sys.stderr, flush=True)
            shown = (state, job.reason)
        if job.state in TERMINAL:
            return job_exit_code(job)
        time.sleep(WAIT_POLL_S)


def cmd_logs(args: argparse.Namespace) -> int:
    offset = 0
    out = sys.stdout.buffer
    to_terminal = out.isatty()  # a log is anyone's text: escaped on a terminal, raw into a file or a pipe
    reached = [False]
    while True:
        request = control_pb2.ReadLogsRequest(job=args.job, rank=args.rank, offset=offset)
        read = lambda s, request=request: s.ReadLogs(request, timeout=DEFAULT_TIMEOUT_S)  # noqa: E731
        chunk = _polled(args, read, reached) if args.follow else call(args, read)
        if chunk.size < offset:  # the agent cut the log (rank_log_max_mb): it starts again from its beginning
            offset = 0
            continue
        out.write(terminal.escape_bytes(chunk.data) if to_terminal else chunk.data)
        out.flush()
        offset = chunk.next_offset
        if offset < chunk.size:
            continue  # more already there
        if not args.follow:
            return OK
        job = _polled(args, lambda s: s.GetJob(control_pb2.GetJobRequest(id=args.job), timeout=DEFAULT_TIMEOUT_S),
                      reached)
        if job.state in TERMINAL:
            return OK
        time.sleep(WAIT_POLL_S)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    # The call lasts as long as the ranks take to commit: its deadline is theirs plus a margin.
    request = control_pb2.CheckpointJobRequest(id=args.job, deadline_s=args.deadline)
    reply = call(args, lambda s: s.CheckpointJob(request, timeout=args.deadline + DEFAULT_TIMEOUT_S))
    print(f"{args.job}: every rank committed step {reply.step} ({reply.seconds:.2f}s)")
    return OK


def cmd_cancel(args: argparse.Namespace) -> int:
    job = call(args, lambda s: s.CancelJob(control_pb2.CancelJobRequest(id=args.job), timeout=DEFAULT_TIMEOUT_S))
    print(f"{job.id}: {render.job_state(job.state)}")
    return OK


def _print_event(event: common_pb2.Event, as_json: bool) -> None:
    if as_json:
        import json
        print(json.dumps(render.event_dict(event)), flush=True)
    else:
        print(render.event_line(event), flush=True)


def _list_events(args: argparse.Namespace) -> list:
    """The events asked for: as `tail`, the newest --limit, unless --after asks for the first ones after a seq. A
    limit past one page is read in pages from --after on (the newest: keeping the last ones)."""
    def page(after: int, limit: int, newest: bool) -> list:
        return list(call(args, lambda s: s.ListEvents(control_pb2.ListEventsRequest(
            after_seq=after, limit=limit, node=args.node or "", job=args.job or "", by=args.by or "", newest=newest),
            timeout=DEFAULT_TIMEOUT_S)).events)
    newest = args.after is None
    if args.limit <= MAX_EVENTS_PAGE:
        return page(args.after or 0, args.limit, newest)
    kept: collections.deque = collections.deque(maxlen=args.limit if newest else None)
    after = args.after or 0
    while (newest or len(kept) < args.limit) and (events := page(after, MAX_EVENTS_PAGE, False)):
        kept.extend(events)
        after = events[-1].seq
    return list(kept)[:args.limit]


def cmd_events(args: argparse.Namespace) -> int:
    if not args.follow:
        events = _list_events(args)
        if args.output == "json":
            print(render.dumps([render.event_dict(e) for e in events]))
        else:
            for event in events:
                _print_event(event, False)
        return OK
    # --follow: one JSON object per line; survives controller restarts and a change of leader by resuming
    # after the last seq. A control plane out of reach when it starts is an error, as for any other command
    # (a mistyped address must not look like a follow waiting for events): one call finds the leader first.
    call(args, lambda s: s.ListEvents(control_pb2.ListEventsRequest(limit=1, newest=True), timeout=DEFAULT_TIMEOUT_S))
    follower = controllers(args)
    last = args.after or 0
    while True:
        stub = control_pb2_grpc.ControlServiceStub(follower.channel())
        try:
            # No deadline: a follow runs until the user stops it.
            for event in stub.WatchEvents(control_pb2.WatchEventsRequest(after_seq=last, node=args.node or "",
                                                                          job=args.job or "", by=args.by or "")):
                _print_event(event, args.output == "json")
                last = event.seq
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise rpc_error(e, args) from None
            if follower.moved(e):  # a standby named the leader: go there (a short pause: hints can be stale)
                time.sleep(leader.FIRST_PAUSE_S)
                continue
            print(f"{PROG}: lost the controller ({e.details()}); retrying", file=sys.stderr, flush=True)
            time.sleep(1.0)


def cmd_simulate(args: argparse.Namespace) -> int:
    """The controller's policies on a simulated fleet (controller.sim): no controller is needed."""
    from controller.sim import engine, replay, report
    from controller.sim import scenario as sc
    try:
        data = sc.read(args.scenario)
        if args.replay:
            data = sc.with_overrides(data, {"replay.events": str(Path(args.replay).expanduser().absolute())})
        runs: list[tuple[str, dict]] = []
        plans: list[tuple[str, dict]] = []
        if args.baseline:
            plans.append(("baseline", sc.BASELINE))
        if args.sweep:
            key, values = report.sweep_values(args.sweep)
            if not values:
                raise CliError(f"--sweep {args.sweep!r} names no values", USAGE)
            plans += [(f"{key}={report_value(v)}", {key: v}) for v in values]
        else:
            plans.append(("phalanx" if args.baseline else "result", {}))
        # an error names where the value came from: the file, or the file with a --sweep value (or that alone)
        scenarios = [(name, sc.build(sc.with_overrides(data, over), " with ".join(
            ([args.scenario] if args.scenario else []) + ([f"--sweep {name}"] if over and args.sweep else []))))
            for name, over in plans]
        traces = {s.replay.events: replay.load(s.replay.events) for _, s in scenarios if s.replay.events}
        for _, s in scenarios:  # a topology.conf's faults, and a fleet too small for it, before any run
            if s.fleet.topology_conf:
                s.check_fit(len(engine.topology_of(s.fleet).nodes))
    except ValueError as e:
        raise CliError(str(e), USAGE) from None
    except ConfigError as e:
        raise CliError(str(e), USAGE) from None
    for name, scenario in scenarios:
        if args.output != "json":
            fleet = scenario.fleet.topology_conf or f"{scenario.fleet.nodes * scenario.fleet.gpus_per_node:,} GPUs"
            print(f"{PROG}: simulating {name}: {fleet} for {scenario.run.days:g} days ...", file=sys.stderr,
                  flush=True)
        def progress(done: float, name: str = name) -> None:
            if args.output != "json":
                print(f"{PROG}: {name}: {done * 100:.0f} % simulated", file=sys.stderr, flush=True)

        try:
            runs.append((name, report.simulate(scenario, progress, traces.get(scenario.replay.events))))
        except ConfigError as e:
            raise CliError(str(e), USAGE) from None
    if args.plot:
        from controller.sim import plot
        try:
            for path in plot.write(runs, args.plot):
                print(f"{PROG}: wrote {path}", file=sys.stderr)
        except ConfigError as e:
            raise CliError(str(e)) from None
    if args.output == "json":
        out = {"runs": [{"name": name, **r} for name, r in runs]}
        print(json.dumps(out if len(runs) > 1 else out["runs"][0], indent=2))
    else:
        print(report.table_text(runs))
    return OK


def cmd_completion(args: argparse.Namespace) -> int:
    from cli import completion
    print(getattr(completion, args.shell)(build_parser(), PROG), end="")
    return OK


def report_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# -- parser --------------------------------------------------------------------------------------

GLOBAL_DEFAULTS = {"controller": None, "ca": None, "cert": None, "key": None, "insecure": False}


def _global_options() -> argparse.ArgumentParser:
    """The options every command takes, before or after its name (`phalanx nodes --controller X` as well as
    `phalanx --controller X nodes`). Their defaults are suppressed so that a subcommand's parser, which knows
    them too, never overwrites what was given before its name; main() fills in what was given nowhere."""
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    group = common.add_argument_group("global options (before or after the command)")
    group.add_argument("--controller", metavar="HOST:PORT[,...]",
                       help="controller address, or every controller of a highly available control plane, "
                       "comma-separated: calls go to the leader (default: $PHALANX_CONTROLLER, then the local "
                       "cluster)")
    group.add_argument("--ca", metavar="FILE", help="the cluster CA (default: $PHALANX_CA, then "
                       f"{tls.DEFAULT_PKI_DIR}/ca.crt)")
    group.add_argument("--cert", metavar="FILE", help="client certificate (default: $PHALANX_CERT); a token in "
                       "$PHALANX_TOKEN or $PHALANX_TOKEN_FILE may stand in for it on the controller's token port")
    group.add_argument("--key", metavar="FILE", help="the client certificate's key (default: $PHALANX_KEY)")
    group.add_argument("--insecure", action="store_true", help="plaintext, no TLS (a controller with "
                       "insecure = true; default: $PHALANX_INSECURE)")
    return common


class _StrictParser(argparse.ArgumentParser):
    """A command's parser: what it does not know is an error said with its own usage, not the top level's."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


class _Commands:
    """The commands (or actions) of `parser`, each of whose parsers also takes the global options."""

    def __init__(self, parser: argparse.ArgumentParser, dest: str, metavar: str,
                 common: argparse.ArgumentParser) -> None:
        self.action = parser.add_subparsers(dest=dest, metavar=metavar, required=True, parser_class=_StrictParser)
        self.common = common
        self.choices = self.action.choices

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.action.add_parser(name, parents=[self.common], **kwargs)


def build_parser() -> argparse.ArgumentParser:
    common = _global_options()
    parser = argparse.ArgumentParser(prog=PROG, description="Phalanx: keep multi-node GPU training alive.",
                                     parents=[common])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = _Commands(parser, "command", "COMMAND", common)

    p_certs = sub.add_parser("certs", help="the cluster CA and certificates for mutual TLS")
    certs_sub = _Commands(p_certs, "certs_command", "ACTION", common)
    p = certs_sub.add_parser("init", help="create the cluster CA (ca.crt, ca.key) in DIR")
    p.add_argument("--dir", default=os.environ.get("PHALANX_PKI", tls.DEFAULT_PKI_DIR),
                   help="where certificates live (default: $PHALANX_PKI, then %(default)s)")
    p.add_argument("--cluster", default="phalanx", help="the cluster's name, in every certificate (default phalanx)")
    p.add_argument("--days", type=_positive, default=pki.CA_DAYS, help="validity (default %(default)s)")
    p.set_defaults(func=cmd_certs_init)
    p = certs_sub.add_parser("issue", help="issue NAME.crt and NAME.key signed by the cluster CA",
                             description="Roles: node (an agent; NAME must be the node's name), client (the CLI "
                             "and tools), controller (the server; give every address agents dial with --san).")
    p.add_argument("name", help="node name, user or tool name, or the controller's name; a hostlist "
                   "(gpu[001-512]) issues one certificate for each")
    p.add_argument("--role", choices=pki.ROLES, default="node", help="what the certificate is for (default node)")
    p.add_argument("--san", action="append", default=[], metavar="HOST",
                   help="controller only: a DNS name or IP address agents and users dial (repeatable)")
    p.add_argument("--dir", default=os.environ.get("PHALANX_PKI", tls.DEFAULT_PKI_DIR),
                   help="where the CA is and the files go (default: $PHALANX_PKI, then %(default)s)")
    p.add_argument("--days", type=_positive, default=pki.LEAF_DAYS, help="validity (default %(default)s)")
    p.set_defaults(func=cmd_certs_issue)
    p = certs_sub.add_parser("token", help="bootstrap tokens for nodes to enrol themselves")
    token_sub = _Commands(p, "token_command", "ACTION", common)
    p = token_sub.add_parser("create", help="make a bootstrap token; prints it with the CA's hash")
    p.add_argument("--ttl", type=_duration, default=3_600.0, metavar="DURATION",
                   help="how long it is good for: 30m, 24h, 7d or seconds (default 1h, at most 7d)")
    p.add_argument("--uses", type=_count, default=1,
                   help="nodes it may enrol (default 1: a token per node; 0: any number until it expires)")
    p.add_argument("--description", help="kept with it, in the event log")
    add_output(p, "text", "json")
    p.set_defaults(func=cmd_certs_token)
    p = certs_sub.add_parser("enrol", help="on a new node: make its key and get it a certificate with a token",
                             description="Dial the controller's token port, check its CA against --ca-hash, then "
                             "send a request for this node's certificate with the token; the key is made here and "
                             "never leaves the node.")
    p.add_argument("--token", help="ID.SECRET from `phalanx certs token create` (default: $PHALANX_ENROL_TOKEN)")
    p.add_argument("--ca-hash", required=True, metavar="sha256:HEX", help="the cluster CA's hash, as printed with "
                   "the token")
    p.add_argument("--name", help="this node's name (default: the short host name, as the agent's)")
    p.add_argument("--dir", default=os.environ.get("PHALANX_PKI", tls.DEFAULT_PKI_DIR),
                   help="where node.key, node.crt and ca.crt go (default: $PHALANX_PKI, then %(default)s)")
    p.set_defaults(func=cmd_certs_enrol)
    p = certs_sub.add_parser("revoke", help="refuse a certificate from now on and cut its sessions",
                             description="NAME: every certificate of that role and name issued until now (a new "
                             "one issued later is accepted); --serial: one certificate. Kept with the controller's "
                             "state; the node's agent is cut off at once.")
    p.add_argument("name", nargs="?", help="the certificate's name (a node's, a user's, a tool's)")
    p.add_argument("--role", choices=("node", "client", "controller"), default="node",
                   help="the certificate's role (default node)")
    p.add_argument("--serial", metavar="HEX", help="one certificate, by serial (`openssl x509 -serial -noout -in F`)")
    p.add_argument("--reason", help="why (kept, and in the event log)")
    p.set_defaults(func=cmd_certs_revoke)

    p_local = sub.add_parser("local", help="a whole cluster on loopback")
    local_sub = _Commands(p_local, "local_command", "ACTION", common)
    p = local_sub.add_parser("up", help="start a controller and N agents on this machine")
    p.add_argument("--nodes", type=_positive, required=True, help="number of agents (nodes)")
    p.add_argument("--gpus-per-node", type=_sim_gpus, default=8, help="simulated GPUs per node (1 to 64; default 8)")
    p.add_argument("--gpu-backend", choices=("auto", "sim", "nvml"), default="auto",
                   help="auto: real GPUs for a one-node cluster on a GPU host, simulated otherwise")
    p.add_argument("--ha", type=_ha_size, default=0, metavar="N",
                   help="N controllers on a local etcd, one leading (3 or 5 recommended; default 0: one controller "
                   "on SQLite)")
    p.add_argument("--session-port", action="store_true",
                   help="agents' sessions on the controllers' session port (session_listen / session_port) rather "
                   "than gRPC; with --ha each controller gets a loopback address of its own (127.0.0.N)")
    p.set_defaults(func=cmd_local_up)
    p = local_sub.add_parser("status", help="list the local cluster's processes")
    add_output(p, "table", "json")
    p.set_defaults(func=cmd_local_status)
    p = local_sub.add_parser("stop", help="stop one process of the local cluster (to try a failure)")
    p.add_argument("member", metavar="MEMBER", help="its name as `phalanx local status` shows it (controller-1, "
                   "etcd-0, node-2)")
    p.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGTERM")
    p.set_defaults(func=cmd_local_stop)
    p = local_sub.add_parser("start", help="start again one process of the local cluster that was stopped")
    p.add_argument("member", metavar="MEMBER", help="its name as `phalanx local status` shows it")
    p.set_defaults(func=cmd_local_start)
    p = local_sub.add_parser("down", help="stop the local cluster")
    p.set_defaults(func=cmd_local_down)

    p = sub.add_parser("controllers", help="the controllers: which leads, which stand by, the store")
    add_output(p, "table", "json")
    p.set_defaults(func=cmd_controllers)

    p = sub.add_parser("nodes", help="list nodes")
    p.add_argument("nodes", nargs="?", metavar="NODES", help="only these: a name or a hostlist, gpu[001-016]")
    add_output(p, "table", "wide", "json", "name", "hostlist")
    add_watch(p)
    p.add_argument("--state", action="append", type=str.upper, choices=[s for s in ("UP", "SUSPECT", "DOWN",
                   "DRAINING", "DRAINED")], help="only nodes in this state (repeatable)")
    p.set_defaults(func=cmd_nodes)

    p = sub.add_parser("drain", help="take nodes out of service, with a reason")
    p.add_argument("node", metavar="NODES", help="a node, or a hostlist: gpu[001-512], a,b")
    p.add_argument("--reason", required=True, help="why (kept, and shown in `phalanx nodes`)")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("undrain", help="return drained nodes to service")
    p.add_argument("node", metavar="NODES", help="a node, or a hostlist: gpu[001-512], a,b")
    p.set_defaults(func=cmd_undrain)

    p = sub.add_parser("health", help="GPU and node health verdicts, with reasons")
    p.add_argument("node", nargs="?", metavar="NODES", help="one node, GPU by GPU; a hostlist, a line each "
                   "(default: every node, a line each)")
    add_output(p, "table", "json")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("topo", help="a node's NUMA and PCIe topology, as `nvidia-smi topo -m` shows it")
    p.add_argument("node")
    add_output(p, "table", "json")
    p.set_defaults(func=cmd_topo)

    fault_help = "; ".join(f"{faults.usage(name, kind)}: {doc}"
                           for name, (kind, doc) in {**faults.GPU_FAULTS, **faults.RANK_FAULTS}.items())
    p = sub.add_parser("inject", help="inject a fault into a simulated GPU (refused on real ones)",
                       description=f"Faults: {fault_help}.")
    p.add_argument("node", metavar="NODES", help="a node, or a hostlist: gpu[001-004]")
    p.add_argument("--gpu", type=_count, required=True, help="GPU index on the node")
    p.add_argument("fault", help="e.g. xid=79, ecc-dbe, ecc-sbe-rate=5, remap-pending, thermal, slow=0.3, hang")
    p.set_defaults(func=cmd_inject)

    p = sub.add_parser("submit", help="submit a gang job; prints its id",
                       usage="%(prog)s [--nodes N] [--ranks-per-node R] [--spares S] [--checkpoint-dir DIR] "
                             "[--replicas R] [--name NAME] [--priority P] [--segment N] [--env K=V] [--as ACCOUNT] "
                             "[--memory SIZE] "
                             "[--tasks N] [--open-files N] -- COMMAND ...")
    p.add_argument("--nodes", type=_positive, default=1, help="nodes in the gang (default 1)")
    p.add_argument("--ranks-per-node", type=_positive, default=1, help="ranks (GPUs) per node (default 1)")
    p.add_argument("--spares", type=_count, default=0, help="hot spare nodes reserved in the job's topology domain")
    p.add_argument("--replicas", type=_count, default=0, metavar="R", help="data-parallel replica groups: the nodes "
                   "in R equal groups, each its own process group (RANK, WORLD_SIZE and MASTER_ADDR are the group's; "
                   "REPLICA_GROUP_ID and NUM_REPLICA_GROUPS say which, as torchft expects); a fault restarts only its "
                   "group while the others train on (default 0: a fault restarts the whole job)")
    p.add_argument("--checkpoint-dir", type=directory, metavar="DIR",
                   help="where ranks checkpoint, shared by the job's nodes; a relative DIR is taken from the current "
                   "directory (default: each agent's checkpoint_dir/JOB)")
    p.add_argument("--name", help="a name to know the job by")
    p.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    p.add_argument("--segment", type=_count, default=0, help="block topologies: nodes per segment")
    p.add_argument("--as", dest="run_as", metavar="ACCOUNT", help="the local account the ranks run as, among those "
                   "the controller's access file allows you (default: the first of them)")
    p.add_argument("--env", action="append", type=_env_pair, metavar="K=V", help="environment for every rank")
    p.add_argument("--memory", type=_size, default=0, metavar="SIZE", help="each rank's memory, with all it starts, "
                   "e.g. 64G (in a cgroup of the rank's own; the OOM killer ends a rank beyond it; default none)")
    p.add_argument("--tasks", type=_count, default=0, metavar="N", help="each rank's processes and threads "
                   "together (cgroup pids.max; default none)")
    p.add_argument("--open-files", type=_count, default=0, metavar="N", help="each rank's open files "
                   "(RLIMIT_NOFILE; default the agent's)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the program and its arguments")
    p.set_defaults(func=cmd_submit)

    from cli import slurm_cmds  # here, not at the top: it imports this module's helpers
    slurm_cmds.add_parsers(sub, _count, _positive, _env_pair)

    p = sub.add_parser("jobs", help="list jobs")
    add_output(p, "table", "wide", "json", "name")
    add_watch(p)
    p.set_defaults(func=cmd_jobs)

    p = sub.add_parser("job", help="one job: state, reason, placement, ranks")
    p.add_argument("job")
    add_output(p, "text", "json")
    add_watch(p)
    p.set_defaults(func=cmd_job)

    p = sub.add_parser("wait", help="wait for a job to end; the exit code is the job's result")
    p.add_argument("job")
    p.add_argument("--quiet", "-q", action="store_true", help="do not print state changes")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("logs", help="a rank's output")
    p.add_argument("job")
    p.add_argument("--rank", type=_count, default=0, help="which rank (default 0)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("checkpoint", help="ask every rank of a running job to checkpoint now (trainlib)")
    p.add_argument("job")
    p.add_argument("--deadline", type=_checkpoint_deadline, default=DEFAULT_CHECKPOINT_DEADLINE_S, metavar="S",
                   help=f"seconds the ranks have, up to {MAX_CHECKPOINT_DEADLINE_S:g} (default %(default)g)")
    p.set_defaults(func=cmd_checkpoint)

    p = sub.add_parser("cancel", help="stop every rank of a job")
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("events", help="the controller's event log")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    add_output(p, "table", "json")
    p.add_argument("--node", help="only events of this node")
    p.add_argument("--job", help="only events of this job")
    p.add_argument("--by", metavar="IDENTITY", help="only what this person (certificate or token name) did: drains, "
                   "submissions, cancels, checkpoints, injections, certificates")
    p.add_argument("--after", type=_count, metavar="SEQ", help="only events after this sequence number (then the "
                   "first --limit of them; without it, the newest)")
    p.add_argument("--limit", type=_positive, default=1000, help="at most this many, the newest unless --after is "
                   "given (default 1000)")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("simulate", help="the controller's own policies on a simulated fleet: ETTR, goodput, losses",
                       description="Run the controller's decision code (lifecycle, placement, health policy) on a "
                       "simulated fleet in virtual time. Every scenario key has a default (README: The fleet "
                       "simulator).")
    p.add_argument("scenario", nargs="?", metavar="SCENARIO.toml", help="the scenario (default: every default, "
                   "Llama 3's regime at 16,384 GPUs)")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", help="run once per value of one key, side by side (e.g. "
                   "job.spares=0,1,2,4)")
    p.add_argument("--baseline", action="store_true", help="add a column for the baseline: periodic checkpoints "
                   "only, no spares, no prediction, no snapshots")
    p.add_argument("--plot", metavar="DIR", help="also write PNG plots there: ETTR over time, losses by cause, and "
                   "with several runs their ETTR side by side (needs matplotlib)")
    p.add_argument("--replay", metavar="EVENTS.json", help="a real controller's event log (`phalanx events --json "
                   "--limit N > EVENTS.json`) as the failure trace: its XIDs, verdicts, lost nodes, crashes, hangs and "
                   "stragglers at their times, instead of drawn faults (replay.events)")
    add_output(p, "table", "json")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("completion", help="a bash or zsh completion script: source <(phalanx completion bash)")
    p.add_argument("shell", choices=("bash", "zsh"))
    p.set_defaults(func=cmd_completion)
    return parser


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _duration(text: str, what: str = "a duration such as 30m, 24h or 7d") -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        value = float(number) * units[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
    return value


def _size(text: str) -> int:
    """`512M`, `64G`, `1T` or bytes: binary units (K = 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    number, unit = (text[:-1], text[-1].lower()) if text[-1:].lower() in units else (text, "")
    try:
        value = float(number) * units.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or a number with K, M, G or T, "
                                         "e.g. 64G") from None
    if value < 0 or value >= 1 << 63:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range")
    return int(value)


def _positive(text: str) -> int:
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _ha_size(text: str) -> int:
    value = _count(text)
    if value > MAX_LOCAL_HA:
        raise argparse.ArgumentTypeError(f"{text!r} must be from 0 (one controller) to {MAX_LOCAL_HA}")
    return value


def _sim_gpus(text: str) -> int:
    value = _whole(text)
    if not 1 <= value <= MAX_SIM_GPUS:  # as the agent's gpu.sim_count allows, but a node with none runs no job
        raise argparse.ArgumentTypeError(f"{text!r} must be from 1 to {MAX_SIM_GPUS} (GPUs per simulated node)")
    return value


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _count(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for key, value in GLOBAL_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    streams = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, terminal.Escaped):  # names, reasons and messages are other people's text
        sys.stdout, sys.stderr = terminal.Escaped(sys.stdout), terminal.Escaped(sys.stderr)
    try:
        return args.func(args)
    except CliError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code
    except PhalanxError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        return OK if getattr(args, "follow", False) or getattr(args, "watch", None) else FAILED
    except BrokenPipeError:
        return OK
    finally:
        sys.stdout, sys.stderr = streams
        if getattr(args, "follower", None) is not None:
            args.follower.close()


if __name__ == "__main__":
    from cli.main import main as _main  # one copy of this module, the one cli.slurm_cmds imports
    sys.exit(_main())
