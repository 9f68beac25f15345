"""Assembles the controller: store, registry, services, health, and the liveness loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from controller import access
from controller.api import auth
from controller.api.control_service import ControlService
from controller.api.enrol_service import EnrolService
from controller.api.node_service import NodeService
from controller.api.rendezvous_service import RendezvousService, job_name
from controller.api.session_port import SessionPort
from controller.config import ControllerConfig
from controller.credentials import Credentials
from controller.ha import Elector
from controller.jobs.manager import JobManager
from controller.jobs.slurm_topology import parse_topology_conf
from controller.jobs.slurm_watch import SlurmWatch
from controller.jobs.topology import ClusterTopology, TopologyError, flat, from_labels, merged
from controller.lighthouse import Lighthouses
from controller.nodes.registry import Registry
from controller.obs import metrics
from controller.obs.events import EventHub
from controller.store.base import EventRecord, Store
from controller.store.etcd import NotLeader
from controller.store.timed import TimedStore
from controller.switchboard import Methods, Switchboard
from phalanx import clock as clocks
from phalanx import log, metrics_http, pki, tls
from phalanx.clock import Clock, RealClock
from phalanx.request_guard import RequestGuard
from phalanx.rpc import SERVER_OPTIONS
from phalanx.v1 import control_pb2, control_pb2_grpc, enrol_pb2_grpc, node_pb2_grpc, rendezvous_pb2_grpc

logger = log.get("controller")

SERVICES = ("phalanx.v1.NodeService", "phalanx.v1.ControlService", "phalanx.v1.RendezvousService")
HEALTH_TICK_S = 1.0  # re-judging non-healthy nodes; new signals are judged as they arrive
RENDEZVOUS_FLUSH_S = 5.0  # at stop, the longest the torchrun runs' records are waited for


def _changed_keys(old: object, new: object, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configs (sections are walked)."""
    out = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(a):
            out += _changed_keys(a, b, f"{prefix}{f.name}.")
        elif a != b:
            out.append(f"{prefix}{f.name}")
    return out


def load_topology_conf(path: str) -> ClusterTopology | None:
    """Read the Slurm topology.conf named in the config. Raises OSError or TopologyConfError with the reason."""
    if not path:
        return None
    with open(path) as f:
        return parse_topology_conf(f.read(), source=path)


async def periodic(name: str, interval_s: float, job: Callable[[], Awaitable[object]], clock: Clock) -> None:
    """Run `job` every `interval_s` of `clock`; a failure is logged with context and the loop goes on."""
    next_at = clock.monotonic()
    while True:
        try:
            await job()
        except asyncio.CancelledError:
            raise
        except NotLeader as e:  # the lease lapsed: the election loop is standing this controller down
            logger.warning("periodic job refused by the store: not the leader", job=name, error=str(e))
        except Exception:
            logger.exception("periodic job failed; will retry", job=name)
        next_at += interval_s
        delay = next_at - clock.monotonic()
        if delay < 0:  # fell behind: skip the missed ticks rather than bunching them up
            next_at = clock.monotonic()
            delay = 0
        await clock.sleep(delay)


def load_security(cfg: ControllerConfig) -> tuple[tls.ReloadingIdentity | None, grpc.ServerCredentials | None,
                                                  dict]:
    """Read certificates and tokens before anything binds: a bad file is a ConfigError naming it."""
    sec = cfg.security
    tokens = auth.load_tokens(sec.tokens_file)
    if sec.insecure:
        logger.warning("security.insecure = true: anyone who can reach the controller can register a node or "
                       "submit a job; use it only on loopback", listen=cfg.listen)
        return None, None, tokens
    identity = tls.ReloadingIdentity(sec.ca_file, sec.cert_file, sec.key_file, "the controller's", logger)
    return identity, tls.reloading_server_credentials(identity), tokens


def interceptors(cfg: ControllerConfig, tokens: dict, revocation=None,
                 policy: access.Policy | None = None) -> list[grpc.aio.ServerInterceptor]:
    # Outermost first: who is calling is settled before a byte of the request is decoded.
    authorizer = [] if cfg.security.insecure else [auth.Authorizer(tokens, revocation, policy)]
    return [*authorizer, RequestGuard()]


def server_methods(node_service: NodeService) -> Methods:
    """What the session port serves: NodeService (of which it takes only Session)."""
    methods = Methods()
    node_pb2_grpc.add_NodeServiceServicer_to_server(node_service, methods)
    return methods


def bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    port = (server.add_insecure_port(address) if credentials is None
            else server.add_secure_port(address, credentials))
    if port == 0:
        raise OSError(f"cannot listen on {address} (address in use, or not an address of this host)")
    return port


class Controller:
    def __init__(self, cfg: ControllerConfig, store: Store, clock: Clock | None = None,
                 elector: Elector | None = None, board: Switchboard | None = None) -> None:
        self.cfg = cfg
        self.store = store = TimedStore(store, cfg.store.backend)
        self.clock = clock or RealClock()
        self.started_ns = self.clock.wall_ns()
        self.hub = EventHub()
        self.elector = elector  # None: the only controller (SQLite); else the elected leader of this term
        self.board = board  # the control plane's server, which outlives a term (controller/switchboard.py); None: own
        self.registry = Registry(store, self.clock, cfg.liveness, self.hub, cfg.health)
        if elector is not None and elector.term is not None:
            self.registry.epoch, self.registry.leading = elector.term.epoch, elector.leading
        self.topology_conf = load_topology_conf(cfg.jobs.topology_conf)
        self.jobs = JobManager(store, self.registry, self.clock, self.hub, cfg.jobs, self.topology, cfg.recovery,
                               Lighthouses(cfg.replicas, _reachable_host(cfg)))
        sec = cfg.security
        self.credentials = Credentials(store, self.clock, sec.ca_file, sec.ca_key_file, sec.enrol_days,
                                       self.hub.publish)
        if sec.cert_file and not sec.insecure:  # no node may enrol under a name the controller answers to
            with contextlib.suppress(OSError, ValueError):
                own = pki.certificate_names(Path(sec.cert_file).read_bytes())
                self.credentials.reserved |= own
                if pki.CONTROLLER_NAME not in own:
                    logger.error(f"this controller's certificate does not carry {pki.CONTROLLER_NAME}, the name "
                                 "agents, the CLI, torchrun's plugin and enrolling nodes check to know a controller "
                                 "from a node: they refuse it. Issue it again (`phalanx certs issue NAME --role "
                                 "controller --san HOST`), or meanwhile set security.server_name and "
                                 "PHALANX_SERVER_NAME on the clients to a host name it carries", cert=sec.cert_file)
        if self.elector is not None:  # and the other controllers' (their names, the hosts they advertise)
            self.credentials.peers = self._controller_names
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._authorizer: auth.Authorizer | None = None
        self._tasks: list[asyncio.Task] = []
        self.port = 0
        self.token_port = 0
        self.session_port: SessionPort | None = None  # a lone controller's own; on a board, main.py's
        self._load_security()
        self.collector = metrics.ControllerCollector(self.registry, self.jobs, self.hub, store, elector)
        self.rendezvous: RendezvousService | None = None  # torchrun's rendezvous, once started
        # a lone controller serves its own /metrics; on a board, main.py serves the collector for the process
        self.metrics = metrics.serving(self.collector) if board is None else None

    async def start(self, grace_s: float = 0.0) -> int:
        """Load state, bind, serve, start the loops. Returns the bound port. `grace_s`: added to every node's
        reconnect window (a takeover)."""
        await self.registry.load(grace_s)
        await self.jobs.load()
        await self.credentials.load()
        if self.elector is not None and self.elector.term is not None:
            await self._log_takeover()
        if self.cfg.metrics_listen and self.metrics is not None:
            await serve_metrics(self.metrics, self.cfg)
        interceptors = self._interceptors()
        server: grpc.aio.Server | Methods = (Methods() if self.board is not None else
                                             grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors))
        self.node_service = NodeService(self.registry, self.jobs, self.credentials)
        node_pb2_grpc.add_NodeServiceServicer_to_server(self.node_service, server)
        rendezvous = RendezvousService(self.clock, self.registry, self._log_rendezvous,
                                       restarted=bool(self.registry.entries()), policy=self.cfg.recovery,
                                       store=self.store)
        await rendezvous.load()
        self.rendezvous = self.collector.rendezvous = rendezvous  # torchrun runs in the metrics, as jobs
        control_pb2_grpc.add_ControlServiceServicer_to_server(
            ControlService(self.registry, self.store, self.hub, self.jobs, self.describe_controllers,
                           self.credentials, self.policy, rendezvous.jobs), server)
        enrol_pb2_grpc.add_EnrolServiceServicer_to_server(EnrolService(self.credentials), server)
        rendezvous_pb2_grpc.add_RendezvousServiceServicer_to_server(rendezvous, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if isinstance(server, Methods):  # the board's server is bound and serving already
            self.board.route(server, interceptors)
            self.port, self.token_port = self.board.port, self.board.token_port
        else:
            self.port = bind(server, self.cfg.listen, self._credentials)
            if self.cfg.security.token_listen:
                self.token_port = bind(server, self.cfg.security.token_listen,
                                       tls.reloading_server_credentials(self._identity, client_auth=False))
            await server.start()
            self._server = server
            if self.cfg.session_listen:
                own = Switchboard()
                own.route(server_methods(self.node_service), interceptors)
                self.session_port = SessionPort(own.resolve, self._identity)
                await self.session_port.start(self.cfg.session_listen)
        for service in ("", *SERVICES):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._tasks.append(asyncio.create_task(
            periodic("liveness", self.cfg.liveness.tick_s, self.registry.tick, self.clock), name="liveness"))
        self._tasks.append(asyncio.create_task(
            periodic("health", HEALTH_TICK_S, self.registry.health_tick, self.clock), name="health"))
        self._tasks.append(asyncio.create_task(self.jobs.run(), name="scheduler"))
        if self.cfg.jobs.slurm_watch_s:
            watch = SlurmWatch(self.jobs, self.cfg.jobs)
            self._tasks.append(asyncio.create_task(
                periodic("slurm-watch", self.cfg.jobs.slurm_watch_s, watch.tick, self.clock), name="slurm-watch"))
        logger.info("controller serving", listen=self.cfg.listen, port=self.port, nodes=len(self.registry.entries()),
                    security="insecure" if self.cfg.security.insecure else "mutual TLS",
                    token_port=self.token_port or None,
                    session_port=self.session_port.port if self.session_port is not None else None)
        return self.port

    async def _log_takeover(self) -> None:
        e, term = self.elector, self.elector.term
        previous = e.previous.name if e.previous is not None else ""
        event = EventRecord("controller.leader", f"controller {e.name} leads (epoch {term.epoch})"
                            + (f", taking over from {previous}" if previous and previous != e.name else ""),
                            self.clock.wall_ns(), fields={"controller": e.name, "epoch": str(term.epoch),
                                                          "previous": previous})
        self.hub.publish((await self.store.commit(events=[event])).events)

    async def _log_rendezvous(self, kind: str, message: str, run_id: str) -> None:
        """A torchrun run's event (a round formed, a node left out, a restart), logged under its job name."""
        event = EventRecord(kind, message, self.clock.wall_ns(), job=job_name(run_id), fields={"rendezvous": run_id})
        try:
            self.hub.publish((await self.store.commit(events=[event])).events)
        except Exception as e:  # the store is unavailable (etcd down): the rendezvous goes on regardless
            logger.warning("could not log a rendezvous event", kind=kind, error=str(e))

    def _load_security(self) -> None:
        self._identity, self._credentials, self._tokens = load_security(self.cfg)
        self.policy = access.load(self.cfg.security.access_file)
        self.jobs.access_policy = self.policy
        if self.policy is None and not self.cfg.security.insecure:
            logger.warning("no security.access_file: every authenticated client is an admin and ranks run as the "
                           "agent's user")

    def _interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        chain = interceptors(self.cfg, self._tokens, self.credentials.revocation, self.policy)
        self._authorizer = next((i for i in chain if isinstance(i, auth.Authorizer)), None)
        return chain

    async def serve_parked(self, context: grpc.aio.ServicerContext, first) -> None:
        """A session parked at this controller while it stood by (ParkedSessions): its caller was identified by
        the standby, which knows no revoked certificates; identified again here before the session is taken up."""
        if self._authorizer is not None:
            try:
                peer = self._authorizer.identify(context, context.invocation_metadata())
            except auth.Revoked as e:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            if peer is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "the session's caller is not identified")
        await self.node_service.serve(context, first)

    async def _controller_names(self) -> set[str]:
        """Every controller's name and advertised host, as etcd's members say: no node may enrol as one."""
        names: set[str] = set()
        for member in (await self.describe_controllers()).members:
            names.add(member.name)
            names.add(member.address.rpartition(":")[0].strip("[]"))
        return names - {""}

    async def describe_controllers(self) -> control_pb2.ListControllersResponse:
        if self.elector is not None:
            return await self.elector.describe()
        return control_pb2.ListControllersResponse(
            members=[control_pb2.ControllerMember(name=socket.gethostname(), address=self.cfg.listen, leader=True,
                                                  started_unix_ns=self.started_ns,
                                                  leader_since_unix_ns=self.started_ns)],
            leader=socket.gethostname(), leader_address=self.cfg.listen, store=self.cfg.store.backend,
            answered_by=socket.gethostname())


    # What SIGHUP may change while serving: policies read afresh at every decision, and the tokens file.
    RELOADABLE = ("log_level", "log_format", "health", "recovery", "jobs.schedule_interval_s", "jobs.launch_timeout_s",
                  "jobs.stop_grace_s", "jobs.missing_reports_lost", "security.tokens_file")

    def reload(self, cfg: ControllerConfig) -> tuple[list[str], list[str]]:
        """Apply a reloaded config; returns the keys applied and the keys that changed but need a restart.
        Raises ConfigError (changing nothing) for a tokens file that does not load."""
        old = self.cfg
        tokens = auth.load_tokens(cfg.security.tokens_file)  # read every time: its contents change, not its path
        changed = _changed_keys(old, cfg)
        applied = [k for k in changed if k.split(".")[0] in self.RELOADABLE or k in self.RELOADABLE]
        needs_restart = [k for k in changed if k not in applied]
        if cfg.security.tokens_file and "security.tokens_file" not in applied:
            applied.append("security.tokens_file")
        self._tokens.clear()  # in place: the authoriser holds this dict
        self._tokens.update(tokens)
        jobs_cfg = old.jobs
        for key in ("schedule_interval_s", "launch_timeout_s", "stop_grace_s", "missing_reports_lost"):
            jobs_cfg = dataclasses.replace(jobs_cfg, **{key: getattr(cfg.jobs, key)})
        self.jobs.cfg, self.jobs.recovery_cfg, self.registry.health_cfg = jobs_cfg, cfg.recovery, cfg.health
        self.cfg = dataclasses.replace(old, log_level=cfg.log_level, log_format=cfg.log_format, health=cfg.health,
                                       recovery=cfg.recovery, jobs=jobs_cfg,
                                       security=dataclasses.replace(old.security, tokens_file=cfg.security.tokens_file))
        self.jobs.wake()
        return applied, needs_restart

    def topology(self) -> ClusterTopology:
        """topology.conf where it names a node; the agents' labels (switch, spine, block) elsewhere.
        Labels that contradict each other are logged and the nodes treated as one domain."""
        labels = {e.record.name: e.labels() for e in self.registry.entries()}
        try:
            return merged(self.topology_conf, labels) if self.topology_conf else from_labels(labels)
        except TopologyError as e:
            logger.warning("agents' topology labels disagree; placing as one domain", error=str(e))
            return flat(labels)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.session_port is not None:
            await self.session_port.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.metrics is not None:
            await self.metrics.close()
        if self.rendezvous is not None:  # the torchrun runs' last records (a run that just ended) before the store
            try:
                await clocks.wait_for(self.clock, self.rendezvous.close(), RENDEZVOUS_FLUSH_S)
            except Exception as e:
                logger.warning("torchrun runs' records not all written at stop", error=str(e))
        if self.jobs.lighthouses is not None:
            await self.jobs.lighthouses.close()
        await self.store.close()
        logger.info("controller stopped")


def _reachable_host(cfg: ControllerConfig) -> str:
    """Where the nodes reach this controller: store.advertise's host, else listen's unless it is every interface
    ("" then: the host's name)."""
    for address in (cfg.store.advertise, cfg.listen):
        host = address.rsplit(":", 1)[0].strip("[]") if address else ""
        if host and host not in ("0.0.0.0", "::"):
            return host
    return ""


async def serve_metrics(server: metrics_http.MetricsServer, cfg: ControllerConfig) -> None:
    """`metrics_listen`, with the certificates' expiry where there are certificates, and [metrics]' access."""
    sec = cfg.security
    if not sec.insecure:
        server.registry.register(metrics_http.CertificateExpiry([sec.ca_file, sec.cert_file]))
    await server.serve(cfg.metrics_listen, lambda: metrics_http.access(cfg.metrics, sec.ca_file, sec.cert_file,
                                                                      sec.key_file))
