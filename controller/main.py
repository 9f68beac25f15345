"""`phalanx-controller --config FILE`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import signal
import socket
import sys

import grpc

from controller import config as controller_config
from controller import ha_role
from controller.api.session_port import SessionPort
from controller.errors import StoreError
from controller.ha import Elector, Standby, Term, advertise_address
from controller.jobs.topology import TopologyError
from controller.obs import metrics
from controller.server import Controller, bind, interceptors, load_security, serve_metrics
from controller.store.etcd import Etcd, EtcdStore, EtcdTls, Fence, NodeCache
from controller.store.sqlite import SqliteStore
from controller.switchboard import Methods, Switchboard
from phalanx import __version__, daemon, log, sdnotify, tls
from phalanx.clock import first_of
from phalanx.config import default_toml
from phalanx.errors import ConfigError
from phalanx.rpc import SERVER_OPTIONS

PROG = "phalanx-controller"
logger = log.get("controller")

NODE_CACHE_REFRESH_S = 5.0  # a standby reads the node records changed this often (controller/store/etcd.py)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="The Phalanx controller: node registry, liveness, "
                                     "event log and control API over gRPC.")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (default: every key at its default)")
    parser.add_argument("--print-default-config", action="store_true", help="print the default configuration")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser.parse_args(argv)


async def serve(cfg: controller_config.ControllerConfig, path: str | None = None) -> None:
    if cfg.store.backend == "etcd":
        await serve_ha(cfg, path)
        return
    controller = Controller(cfg, SqliteStore(cfg.state_db, max_events=cfg.max_events))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: reload(controller, path))
    try:
        await controller.start()
    except BaseException:
        await controller.store.close()
        raise
    # Thousands of long-lived node records: keep them out of the garbage collector's full passes,
    # whose pauses would otherwise stall every heartbeat at once.
    gc.freeze()
    sdnotify.notify(f"READY=1\nSTATUS=serving on {cfg.listen}")
    watchdog = asyncio.create_task(sdnotify.watchdog()) if sdnotify.watchdog_interval_s() else None
    await stop.wait()
    sdnotify.notify("STOPPING=1")
    if watchdog is not None:
        watchdog.cancel()
    await controller.stop()



def etcd_of(cfg: controller_config.ControllerConfig) -> Etcd:
    tls_files = None
    if cfg.store.etcd_tls:
        store, sec = cfg.store, cfg.security
        if store.etcd_ca_file:
            ident = tls.load_identity(store.etcd_ca_file, store.etcd_cert_file, store.etcd_key_file,
                                      "the controller's for etcd (store.etcd_*)", logger)
        else:
            logger.warning("etcd trusts the cluster CA: every node's and user's certificate can read and write the "
                           "store; give etcd a CA of its own (store.etcd_ca_file, etcd_cert_file, etcd_key_file)")
            ident = tls.load_identity(sec.ca_file, sec.cert_file, sec.key_file, "the controller's (for etcd)", logger)
        tls_files = EtcdTls(ident.ca, ident.cert, ident.key)
    return Etcd(controller_config.endpoints(cfg.store.etcd_endpoints), tls_files, cfg.store.etcd_timeout_s)


async def keep_warm(cache: NodeCache) -> None:
    """While standing by: read the node records as they change, so that a takeover reads only the latest."""
    while True:
        try:
            await cache.refresh()
        except StoreError as e:  # etcd away a while: the takeover reads what it must then
            logger.debug("node records not refreshed", error=str(e))
        await asyncio.sleep(NODE_CACHE_REFRESH_S)


async def serve_ha(cfg: controller_config.ControllerConfig, path: str | None) -> None:
    """One member of a highly available control plane: stand by, campaign, lead while the lease holds,
    stand by again when it lapses (controller/ha.py), through the role table of controller/ha_role.py."""
    store_cfg = cfg.store
    etcd = etcd_of(cfg)
    name = store_cfg.name or socket.gethostname()
    elector = Elector(etcd, store_cfg.etcd_prefix, name, advertise_address(cfg.listen, store_cfg.advertise),
                      store_cfg.lease_ttl_s, probe=store_cfg.probe_leader)
    identity, credentials, tokens = load_security(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    member = HaMember(cfg, name, etcd, elector, identity, credentials, tokens, stop)
    loop.add_signal_handler(signal.SIGHUP, lambda: member.controller and reload(member.controller, path))
    keeping = asyncio.create_task(elector.keep_member(stop), name="member")
    watchdog = asyncio.create_task(sdnotify.watchdog()) if sdnotify.watchdog_interval_s() else None
    if cfg.metrics_listen:
        await serve_metrics(member.plane_metrics, cfg)
    try:
        await ha_role.run(member)
    finally:
        await member.close()
        sdnotify.notify("STOPPING=1")
        if watchdog is not None:
            watchdog.cancel()
        keeping.cancel()
        await asyncio.gather(keeping, return_exceptions=True)
        await etcd.close()


class HaMember:
    """What each role of controller/ha_role.py waits for and does, on the real server, store and lease. One server
    from standing by through leading (controller/switchboard.py): the agents' sessions parked here while it stands
    by are taken up, not dropped, if it wins the election."""

    def __init__(self, cfg: controller_config.ControllerConfig, name: str, etcd: Etcd, elector: Elector,
                 identity, credentials, tokens, stop: asyncio.Event) -> None:
        self.cfg, self.name, self.etcd, self.elector = cfg, name, etcd, elector
        self.identity, self.credentials, self.tokens, self.stop = identity, credentials, tokens, stop
        self.board = Switchboard()
        self.server: grpc.aio.Server | None = None
        self.sessions: SessionPort | None = None
        self.nodes = NodeCache(etcd, cfg.store.etcd_prefix)
        self.standby: Standby | None = None
        self.port = 0
        self.ready = False
        self.term: Term | None = None
        self.controller: Controller | None = None  # the term's, while it leads (SIGHUP reloads it)
        self._starting: Controller | None = None  # the term's while it loads
        self.holding: asyncio.Task | None = None
        # One /metrics for the process, standing by as well as leading: every member can be scraped, and "no
        # member leads" is a query (monitoring/phalanx.rules.yml PhalanxNoLeader).
        self.plane = metrics.ControlPlaneCollector(
            elector, lambda: self.standby.parked.waiting if self.standby is not None else 0)
        self.plane_metrics = metrics.serving(self.plane)

    # -- what each role waits for ------------------------------------------------------------------

    async def campaign(self) -> ha_role.Happened:
        cfg = self.cfg
        self.standby = Standby(self.elector)
        self.board.route(Methods.of(self.standby.handler()), interceptors(cfg, self.tokens))
        if self.server is None:
            self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[self.board.interceptor])
            self.server.add_generic_rpc_handlers((self.board,))
            self.port = self.board.port = bind(self.server, cfg.listen, self.credentials)
            if cfg.security.token_listen:
                self.board.token_port = bind(self.server, cfg.security.token_listen,
                                             tls.reloading_server_credentials(self.identity, client_auth=False))
            await self.server.start()
            if cfg.session_listen and self.sessions is None:  # sessions parked here in frames are taken up too
                self.sessions = SessionPort(self.board.resolve, self.identity)
                await self.sessions.start(cfg.session_listen)
        logger.info("standing by", name=self.name, listen=cfg.listen, port=self.port, advertise=self.elector.address,
                    etcd=cfg.store.etcd_endpoints)
        if not self.ready:
            sdnotify.notify(f"READY=1\nSTATUS=standing by on {cfg.listen}")
            self.ready = True
        warming = asyncio.create_task(keep_warm(self.nodes), name="node cache")
        try:
            await first_of(self.elector.campaign(), self.stop.wait())
        finally:
            warming.cancel()
        self.term = self.elector.term
        return ha_role.Happened.STOP if self.stop.is_set() or self.term is None else ha_role.Happened.ELECTED

    async def take_over(self) -> ha_role.Happened:
        store_cfg = self.cfg.store
        assert self.term is not None
        store = EtcdStore(self.etcd, store_cfg.etcd_prefix, self.cfg.max_events,
                          Fence(self.elector.leader_key, self.term.epoch), store_cfg.etcd_max_txn_ops,
                          own_client=False, node_cache=self.nodes, on_not_leader=self.elector.depose)
        self._starting = Controller(self.cfg, store, elector=self.elector, board=self.board)
        self.holding = asyncio.create_task(self.elector.hold(), name="lease")
        try:
            await self._starting.start(grace_s=store_cfg.takeover_grace_s)
        except StoreError as e:
            logger.error("could not take over: the store failed while loading; standing by again", error=str(e))
            return ha_role.Happened.LOAD_FAILED
        return ha_role.Happened.LOADED

    async def lead(self) -> ha_role.Happened:
        assert self.holding is not None
        await first_of(self.holding, self.stop.wait())
        if self.stop.is_set():
            return ha_role.Happened.STOP
        logger.warning("no longer the leader; standing by", reason=self.holding.result(),
                       epoch=self.term.epoch if self.term else None)
        return ha_role.Happened.LEASE_LOST

    # -- the actions -------------------------------------------------------------------------------

    async def act(self, action: ha_role.Action) -> None:
        A = ha_role.Action
        controller = self.controller or self._starting
        if action is A.RELEASE_PARKED:
            if self.standby is not None:
                self.standby.parked.release()
        elif action is A.TAKE_UP_PARKED:
            self.controller, self._starting = self._starting, None
            assert self.controller is not None and self.standby is not None
            # The registry just loaded and the sessions parked here: out of the full collections, as a lone
            # controller's after its start (unfrozen when deposed, so that the term's objects may go).
            gc.freeze()
            # The sessions first, the health of their nodes after: judged from an interval after the last parked
            # session's turn (its first heartbeat is on its way until then).
            registry = self.controller.registry
            registry.defer_judging()
            self.standby.parked.take(self.controller.serve_parked,
                                     done=functools.partial(registry.judge_deferred,
                                                            registry.policy.heartbeat_interval_s),
                                     unheard=registry.unheard)
            logger.info("taking up the sessions parked here", sessions=self.standby.parked.waiting)
            self.plane.term = self.controller.collector
        elif action in (A.CLOSE_SERVER_NOW, A.CLOSE_SERVER_GRACEFULLY):
            await self._stop_sessions()
            if self.server is not None:
                # now: every call of the term ends, none reaches the stopping controller; gracefully: the calls
                # under way may finish, as a lone controller's do
                await self.server.stop(0 if action is A.CLOSE_SERVER_NOW else 2.0)
                self.server = None
        elif action in (A.END_TERM_NOW, A.END_TERM_GRACEFULLY):
            self.plane.term = None
            if controller is not None:  # while the lease is still kept: its last writes are the term's
                await (controller.stop(0) if action is A.END_TERM_NOW else controller.stop())
            if self.holding is not None:
                self.holding.cancel()
                await asyncio.gather(self.holding, return_exceptions=True)
                self.holding = None
            self.controller = self._starting = None
            if action is A.END_TERM_NOW and gc.get_freeze_count():
                gc.unfreeze()
                gc.collect()  # the term's objects, while standing by (the next takeover would freeze them again)
        elif action is A.RESIGN and self.term is not None:
            await self.elector.resign(self.term)

    def became(self, role: ha_role.Role, happened: ha_role.Happened) -> None:
        if role is ha_role.Role.LEADING and self.term is not None:
            sdnotify.notify(f"STATUS=leader (epoch {self.term.epoch}) on {self.cfg.listen}")
        logger.debug("role", role=role.value, after=happened.value)

    async def _stop_sessions(self) -> None:
        if self.sessions is not None:
            await self.sessions.stop()
            self.sessions = None

    async def close(self) -> None:
        await self._stop_sessions()
        if self.server is not None:
            await self.server.stop(0)
        await self.plane_metrics.close()


def reload(controller: Controller, path: str | None) -> None:
    """SIGHUP: read the config file again and apply what can change while serving; say what cannot. A
    bad file changes nothing (the error is logged) and the controller goes on as it was."""
    try:
        cfg = controller_config.load(path)
        applied, needs_restart = controller.reload(cfg)
    except ConfigError as e:
        logger.error("config reload refused", error=str(e), path=path)
        return
    log.configure(cfg.log_level, cfg.log_format)
    logger.info("config reloaded", path=path, applied=",".join(applied) or "nothing changed",
                needs_restart=",".join(needs_restart) or None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_default_config:
        sys.stdout.write(default_toml(controller_config.ControllerConfig))
        return 0
    gc.set_threshold(50_000, 20, 100)  # fewer, not longer, collections: the heartbeat path allocates steadily
    return daemon.run(PROG, controller_config.load, args.config, lambda cfg: serve(cfg, args.config),
                      (StoreError, TopologyError, OSError))


if __name__ == "__main__":
    sys.exit(main())
