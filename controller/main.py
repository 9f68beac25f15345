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
from controller.api.session_port import SessionPort
from controller.errors import StoreError
from controller.ha import Elector, Standby, advertise_address
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
    stand by again when it lapses (controller/ha.py)."""
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
    current: list[Controller] = []
    loop.add_signal_handler(signal.SIGHUP, lambda: current and reload(current[0], path))
    member = asyncio.create_task(elector.keep_member(stop), name="member")
    watchdog = asyncio.create_task(sdnotify.watchdog()) if sdnotify.watchdog_interval_s() else None
    ready = False
    server: grpc.aio.Server | None = None
    board = Switchboard()
    sessions: SessionPort | None = None
    nodes = NodeCache(etcd, store_cfg.etcd_prefix)
    standby: Standby | None = None
    # One /metrics for the process, standing by as well as leading: every member can be scraped, and "no member
    # leads" is a query (monitoring/phalanx.rules.yml PhalanxNoLeader).
    plane = metrics.ControlPlaneCollector(elector, lambda: standby.parked.waiting if standby is not None else 0)
    plane_metrics = metrics.serving(plane)
    if cfg.metrics_listen:
        await serve_metrics(plane_metrics, cfg)

    async def stop_sessions() -> None:
        nonlocal sessions
        if sessions is not None:
            await sessions.stop()
            sessions = None

    try:
        while not stop.is_set():
            # One server from standing by through leading (controller/switchboard.py): the agents' sessions
            # parked here while it stands by are taken up, not dropped, if it wins the election.
            standby = Standby(elector)
            board.route(Methods.of(standby.handler()), interceptors(cfg, tokens))
            if server is None:
                server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[board.interceptor])
                server.add_generic_rpc_handlers((board,))
                port = board.port = bind(server, cfg.listen, credentials)
                if cfg.security.token_listen:
                    board.token_port = bind(server, cfg.security.token_listen,
                                            tls.reloading_server_credentials(identity, client_auth=False))
                await server.start()
                if cfg.session_listen:  # sessions parked here in frames are taken up too, so it lives as long
                    sessions = SessionPort(board.resolve, identity)
                    await sessions.start(cfg.session_listen)
            logger.info("standing by", name=name, listen=cfg.listen, port=port, advertise=elector.address,
                        etcd=store_cfg.etcd_endpoints)
            if not ready:
                sdnotify.notify(f"READY=1\nSTATUS=standing by on {cfg.listen}")
                ready = True
            warming = asyncio.create_task(keep_warm(nodes), name="node cache")
            try:
                await first_of(elector.campaign(), stop.wait())
            finally:
                warming.cancel()
            term = elector.term
            if stop.is_set() or term is None:
                standby.parked.release()
                break
            store = EtcdStore(etcd, store_cfg.etcd_prefix, cfg.max_events, Fence(elector.leader_key, term.epoch),
                              store_cfg.etcd_max_txn_ops, own_client=False, node_cache=nodes,
                              on_not_leader=elector.depose)
            controller = Controller(cfg, store, elector=elector, board=board)
            holding = asyncio.create_task(elector.hold(), name="lease")
            try:
                await controller.start(grace_s=store_cfg.takeover_grace_s)
            except StoreError as e:
                logger.error("could not take over: the store failed while loading; standing by again", error=str(e))
                standby.parked.release()
                holding.cancel()
                await controller.stop(0)
                await elector.resign(term)
                continue
            # The registry just loaded and the sessions parked here: out of the full collections, as a lone
            # controller's after its start (unfrozen when deposed, so that the term's objects may go).
            gc.freeze()
            # The sessions first, the health of their nodes after: judged from an interval after the last parked
            # session's turn (its first heartbeat is on its way until then).
            registry = controller.registry
            registry.defer_judging()
            standby.parked.take(controller.serve_parked,
                                done=functools.partial(registry.judge_deferred, registry.policy.heartbeat_interval_s),
                                unheard=registry.unheard)
            logger.info("taking up the sessions parked here", sessions=standby.parked.waiting)
            current[:] = [controller]
            plane.term = controller.collector
            sdnotify.notify(f"STATUS=leader (epoch {term.epoch}) on {cfg.listen}")
            await first_of(holding, stop.wait())
            current.clear()
            plane.term = None
            if stop.is_set():
                await stop_sessions()
                await server.stop(2.0)  # the calls under way may finish, as a lone controller's do
                server = None
                await controller.stop()
                await elector.resign(term)
                break
            logger.warning("no longer the leader; standing by", reason=holding.result(), epoch=term.epoch)
            await stop_sessions()
            await server.stop(0)  # first: every call of the term ends, none reaches the stopping controller
            server = None
            await controller.stop(0)
            gc.unfreeze()
            gc.collect()  # the term's objects, while standing by (the next takeover would freeze them again)
    finally:
        await stop_sessions()
        if server is not None:
            await server.stop(0)
        await plane_metrics.close()
        sdnotify.notify("STOPPING=1")
        if watchdog is not None:
            watchdog.cancel()
        member.cancel()
        await asyncio.gather(member, return_exceptions=True)
        await etcd.close()


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
