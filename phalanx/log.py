"""structlog set-up shared by the daemons: one structured line per event on stderr (journald keeps them).

Event names are constant words ("rank started"); the details are fields. What a line is about — job,
generation, node, rank — is bound into context (`bound(...)`, structlog's contextvars), so every line
logged inside carries it. When stderr is journald's stream (systemd sets JOURNAL_STREAM), each line
starts with its syslog priority (`<3>` for an error), which journald strips and records, so
`journalctl -p warning` works.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

LEVELS = ("debug", "info", "warning", "error")
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}


def to_journald(stream=None) -> bool:
    """True when `stream` (stderr) is the journal stream systemd gave this process (JOURNAL_STREAM=dev:inode)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    stream = stream or sys.stderr
    try:
        device, inode = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (device, inode)


def _priority_prefix(_logger, method: str, line: str) -> str:
    return f"<{PRIORITY.get(method, 6)}>{line}"


def configure(level: str = "info", fmt: str = "json", journald: bool | None = None) -> None:
    """(Re)configure logging; calling it again (SIGHUP) changes the level of every logger at once."""
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        renderer,
    ]
    if to_journald() if journald is None else journald:
        processors.append(_priority_prefix)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,  # a reload must reach loggers already in use
    )


def get(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(component=name)


@contextmanager
def bound(**fields: object) -> Iterator[None]:
    """Every line logged inside (in this task and the tasks it starts) carries `fields`; empty ones are left out."""
    with structlog.contextvars.bound_contextvars(**{k: v for k, v in fields.items() if v not in (None, "")}):
        yield
