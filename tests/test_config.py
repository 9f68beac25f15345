"""Configuration: documented defaults, exact one-line errors naming the key, exit code 2."""

import subprocess
import sys

import pytest

from agent import config as agent_config
from controller import config as controller_config
from phalanx.config import default_toml
from phalanx.errors import ConfigError

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_a_retired_table_is_said_and_skipped_not_refused(tmp_path, capsys):
    """An earlier release's [rendezvous] (torchrun rounds follow [recovery] now): the controller still starts."""
    cfg = controller_config.load(str(write(tmp_path, "[rendezvous]\nhang_min_s = 30.0\n[recovery]\nhang_min_s = 4.0")))
    assert cfg.recovery.hang_min_s == 4.0
    said = capsys.readouterr().err
    assert "config key 'rendezvous' is no longer read: torchrun rounds are judged by [recovery]" in said


def test_defaults_without_a_file():
    cfg = controller_config.load(None)
    assert (cfg.liveness.heartbeat_interval_s, cfg.liveness.down_after_s) == (1.0, 3.0)
    assert agent_config.load(None).gpu.backend == "auto"


@pytest.mark.parametrize("text,message", [
    ('lisen = "x:1"', "unknown key 'lisen' (known keys: listen, state_db, max_events, log_level, log_format, "
                      "metrics_listen, metrics, session_listen, liveness, health, jobs, recovery, security, "
                      "store, replicas)"),
    ("[health]\nremap_pending = \"IGNORE\"", "health.remap_pending ('IGNORE') must be one of: FAILING, DEGRADED"),
    ("[liveness]\ndown_after = 5", "unknown key 'liveness.down_after' (known keys: liveness.heartbeat_interval_s, "
                                   "liveness.suspect_after_s, liveness.down_after_s, liveness.tick_s)"),
    ("[liveness]\ndown_after_s = 1.5", "liveness.down_after_s (1.5) must be larger than liveness.suspect_after_s "
                                       "(2.0)"),
    ("[liveness]\nheartbeat_interval_s = 5", "liveness.suspect_after_s (2.0) must be larger than "
                                             "liveness.heartbeat_interval_s (5.0)"),
    ('[liveness]\ntick_s = "fast"', "liveness.tick_s must be a number, not str 'fast'"),
    ("[liveness]\ntick_s = -1", "liveness.tick_s (-1.0) must be larger than 0"),
    ("liveness = 3", "liveness must be a table ([liveness]), not int 3"),
    ('log_level = "loud"', "log_level ('loud') must be one of: debug, info, warning, error"),
    ('listen = "7370"', "listen ('7370') must be host:port, e.g. 0.0.0.0:7370"),
    ("max_events = true", "max_events must be an integer, not bool True"),
    ("[recovery]\nhang_min_s = 1.0", "recovery.silent_s (2.0) must not be larger than recovery.hang_min_s (1.0): a "
                                     "hang would be judged before its culprit could be named"),
    ("[recovery]\nstraggler_gain = 1.0", "recovery.straggler_gain (1.0) must be in [0, 1)"),
    ("[recovery]\nstraggler_cost = 0", "recovery.straggler_cost (0.0) must be in (0, 1)"),
    ("[recovery]\nstraggler_window = 5\nstraggler_min_samples = 5",
     "recovery.straggler_window (5) must be at least 6: straggler_cost splits it in thirds and leaves out each "
     "third's slowest step"),
    ("[store]\nlease_ttl_s = 90", "store.lease_ttl_s (90) must be from 2 (etcd refuses shorter leases) to 60 (a "
                                  "deposed leader must learn it well within the minute after which agents take older "
                                  "epochs for a reset)"),
])
def test_controller_config_errors(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        controller_config.load(str(path))
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize("text,message", [
    ('[gpu]\nbackend = "cuda"', "gpu.backend ('cuda') must be one of: auto, nvml, sim"),
    ("[gpu]\nsim_count = 100", "gpu.sim_count (100) must be between 0 and 64"),
    ('node_name = "bad name"', "node_name ('bad name') must be 1-63 letters, digits, '.', '_' or '-', "
                               "starting with a letter or digit"),
    ('controller = "nohost"', "controller ('nohost') must be host:port, e.g. 10.0.0.1:7370"),
    ("[labels]\nrack = 3", "labels.rack must be a string, not int 3"),
    ("[reconnect]\nmax_backoff_s = 0.1", "reconnect.max_backoff_s (0.1) must not be smaller than "
                                         "reconnect.initial_backoff_s (0.2)"),
    ("snapshot_bulk_port = 70000", "snapshot_bulk_port (70000) must be a port (1-65535), 0 for a free one or -1 "
                                   "for none"),
])
def test_agent_config_errors(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        agent_config.load(str(path))
    assert str(info.value) == f"{path}: {message}"


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        controller_config.load(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=r"not valid TOML: Invalid value \(at line 1, column 10\)"):
        controller_config.load(str(write(tmp_path, "listen = \n")))
    with pytest.raises(ConfigError, match="is a directory"):
        controller_config.load(str(tmp_path))


def test_default_config_documents_every_key_and_loads_back(tmp_path):
    for cls, loader in ((controller_config.ControllerConfig, controller_config.load),
                        (agent_config.AgentConfig, agent_config.load)):
        text = default_toml(cls)
        assert loader(str(write(tmp_path, text))) == cls()
        for line in text.splitlines():
            assert line.startswith(("#", "[")) or not line or "=" in line


@pytest.mark.parametrize("module", ["controller.main", "agent.main"])
def test_daemon_bad_config_is_one_line_and_exit_2(tmp_path, module):
    path = write(tmp_path, "[liveness\nbroken")
    result = subprocess.run([sys.executable, "-m", module, "--config", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"phalanx-{module.split('.')[0]}: config error: {path}: not valid TOML")


def test_the_configuration_page_documents_every_key_with_its_default():
    import json
    from pathlib import Path

    from phalanx.config import describe

    readme = (Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md").read_text()
    for cls in (controller_config.ControllerConfig, agent_config.AgentConfig):
        for key, default, doc in describe(cls):
            shown = json.dumps(default) if not isinstance(default, bool) else str(default).lower()
            assert f"| `{key}` | `{shown}` | {doc} |" in readme, key
