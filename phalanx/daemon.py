"""What both daemons do at start-up, in one place: read the config (a bad one is one line and exit 2),
set up logging, run the main coroutine on uvloop where it is installed, and turn known failures into
one line and exit 1 instead of a traceback."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from phalanx import log
from phalanx.errors import ConfigError

C = TypeVar("C")


def run(prog: str, load: Callable[[str | None], C], path: str | None,
        serve: Callable[[C], Coroutine[Any, Any, int | None]],
        failures: tuple[type[BaseException], ...] = (OSError,)) -> int:
    """Load the config at `path`, configure logging from it, and run `serve(cfg)` to the end. Exit codes:
    what `serve` returns (0 if nothing); 2 a config error (also one found while serving, e.g. an
    unreadable certificate); 1 a failure of the kinds in `failures`."""
    try:
        cfg = load(path)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    log.configure(cfg.log_level, cfg.log_format)
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:  # uvloop is Linux/macOS only; asyncio works, just slower
        runner = asyncio.run
    try:
        code = runner(serve(cfg))
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        return 2
    except failures as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return code or 0
