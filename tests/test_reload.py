"""SIGHUP makes the controller read its config again: it applies what can change while it serves, says
which changed keys need a restart, refuses a bad file without harm, and never exits (it used to: 129)."""

from __future__ import annotations

import json
import signal

import pytest

from phalanx.v1 import control_pb2

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


def reload_lines(cluster) -> list[dict]:
    lines = []
    for line in (cluster.root / "controller.log").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event", "").startswith("config reload"):
            lines.append(record)
    return lines


def test_sighup_reloads_what_it_can_and_names_what_needs_a_restart(cluster):
    cluster.start_controller('log_level = "info"\n[recovery]\nmax_restarts = 3\n')
    path = cluster.root / "controller.toml"
    text = path.read_text()
    path.write_text(text.replace('log_level = "info"', 'log_level = "debug"').replace("max_restarts = 3",
                                                                                      "max_restarts = 7")
                    .replace('listen = "127.0.0.1:', 'listen = "127.0.0.2:'))
    proc = cluster.procs["controller"]
    proc.send_signal(signal.SIGHUP)
    cluster.wait_for(lambda: reload_lines(cluster), "the reload's log line")
    [line] = reload_lines(cluster)
    assert line["event"] == "config reloaded"
    assert set(line["applied"].split(",")) == {"log_level", "recovery.max_restarts"}
    assert line["needs_restart"] == "listen"
    assert proc.poll() is None
    cluster.control.ListNodes(control_pb2.ListNodesRequest(), timeout=10)  # still serving on the old address

    path.write_text(text + "\n[recovery]\nmax_restarts = -1\n")  # a bad file: nothing changes
    proc.send_signal(signal.SIGHUP)
    cluster.wait_for(lambda: len(reload_lines(cluster)) == 2, "the refusal's log line")
    refused = reload_lines(cluster)[1]
    assert refused["event"] == "config reload refused" and refused["level"] == "error"
    assert "recovery" in refused["error"]
    assert proc.poll() is None
    cluster.control.ListNodes(control_pb2.ListNodesRequest(), timeout=10)


def test_a_reload_reads_the_tokens_file_again_and_a_bad_one_changes_nothing(tmp_path):
    """Operators edit the tokens file in place (add a user, revoke one): the path stays, the contents change."""
    import asyncio
    import hashlib

    import pytest

    from controller.config import ControllerConfig, SecurityConfig
    from controller.server import Controller
    from controller.store.memory import MemoryStore
    from phalanx.errors import ConfigError

    tokens = tmp_path / "tokens"
    tokens.write_text("alice " + "a" * 32 + "\n")
    cfg = ControllerConfig(listen="127.0.0.1:0", security=SecurityConfig(insecure=True, tokens_file=str(tokens)))

    def names(controller):
        return sorted(controller._tokens.values())

    async def go():
        controller = Controller(cfg, MemoryStore())
        held = controller._tokens  # what the authoriser holds
        assert names(controller) == ["alice"]
        tokens.write_text("bob " + "b" * 32 + "\n")
        applied, needs_restart = controller.reload(cfg)
        assert applied == ["security.tokens_file"] and needs_restart == []
        assert names(controller) == ["bob"] and controller._tokens is held
        assert held[hashlib.sha256(b"b" * 32).digest()] == "bob"
        tokens.write_text("carol short\n")
        with pytest.raises(ConfigError, match="at least 16 characters"):
            controller.reload(cfg)
        assert names(controller) == ["bob"]

    asyncio.run(go())
