"""`phalanx-controller --config FILE`."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys

from controller import config as controller_config
from controller.errors import StoreError
from controller.jobs.topology import TopologyError
from controller.server import Controller
from controller.store.sqlite import SqliteStore
from phalanx import __version__, daemon, log, sdnotify
from phalanx.config import default_toml
from phalanx.errors import ConfigError

PROG = "phalanx-controller"
logger = log.get("controller")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="The Phalanx controller: node registry, liveness, "
                                     "event log and control API over gRPC.")
    parser.add_argument("--config", metavar="FILE", help="TOML configuration (default: every key at its default)")
    parser.add_argument("--print-default-config", action="store_true", help="print the default configuration")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser.parse_args(argv)


async def serve(cfg: controller_config.ControllerConfig, path: str | None = None) -> None:
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
