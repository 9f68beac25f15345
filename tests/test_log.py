"""Log lines: constant event names with context bound around them, and syslog priorities for journald."""

from __future__ import annotations

import io
import json
import os

import pytest
import structlog

from phalanx import log

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)


@pytest.fixture(autouse=True)
def _reset():
    yield
    structlog.reset_defaults()


def capture(journald: bool) -> io.StringIO:
    out = io.StringIO()
    log.configure("debug", "json", journald=journald)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=out))
    return out


def test_bound_context_is_on_every_line_inside_and_gone_after():
    out = capture(journald=False)
    logger = log.get("test")
    with log.bound(job="job-3", generation=2, node=""):
        logger.info("incident", detail="rank 1 exited with code 3")
    logger.info("idle")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert (first["event"], first["job"], first["generation"], first["component"]) == ("incident", "job-3", 2, "test")
    assert "node" not in first  # empty fields are left out
    assert "job" not in second


def test_journald_lines_start_with_their_syslog_priority():
    out = capture(journald=True)
    logger = log.get("test")
    logger.error("store failed")
    logger.warning("slow")
    logger.info("ok")
    logger.debug("detail")
    assert [line[:3] for line in out.getvalue().splitlines()] == ["<3>", "<4>", "<6>", "<7>"]
    assert json.loads(out.getvalue().splitlines()[0][3:])["event"] == "store failed"


def test_journald_is_recognised_by_the_stream_systemd_names(tmp_path, monkeypatch):
    with open(tmp_path / "journal", "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert log.to_journald(stream)
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert not log.to_journald(stream)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not log.to_journald(stream)
