"""The CLI with operators' habits: hostlists in and out, global flags anywhere, -o formats, --watch, completion."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx import hostlist

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

NODES = [f"gpu{i:03d}" for i in (1, 2, 3, 4)]


# -- hostlists, both ways ---------------------------------------------------------------------------------

@pytest.mark.parametrize("names, expr", [
    (["gpu001", "gpu002", "gpu003", "gpu007"], "gpu[001-003,007]"),
    (["node01", "node09", "node10", "node11"], "node[01,09-11]"),  # node10 keeps the width node01 has
    (["n9", "n10", "n11"], "n[9-11]"),
    (["login", "gpu1", "gpu2"], "login,gpu[1-2]"),
    (["rack1-node01", "rack1-node02", "rack2-node01"], "rack1-node[01-02],rack2-node01"),
    (["b3", "b1", "b2", "b1"], "b[1-3]"),
    ([], ""),
])
def test_hostlists_compress_as_scontrol_show_hostlist_does(names, expr):
    assert hostlist.compress(names) == expr
    assert sorted(hostlist.expand(expr) if expr else []) == sorted(set(names))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["gpu", "node-", "r1n", "x"]), st.integers(0, 1200),
                          st.sampled_from([0, 2, 3, 4])), max_size=40))
def test_every_set_of_names_comes_back_from_its_hostlist(parts):
    names = [f"{prefix}{n:0{width}d}" if width else f"{prefix}{n}" for prefix, n, width in parts]
    expr = hostlist.compress(names)
    assert sorted(set(hostlist.expand(expr) if expr else [])) == sorted(set(names)), expr


# -- against a real controller and agents ------------------------------------------------------------------

@pytest.fixture
def four(cluster):
    cluster.start_controller()
    for name in NODES:
        cluster.start_agent(name, gpus=2)
    cluster.wait_states(dict.fromkeys(NODES, "UP"))
    return cluster


def flags(cluster):
    return ["--controller", cluster.address, "--insecure"]


def bare(*args, env=None, timeout=60):
    """`phalanx ARGS` with nothing from the environment: every flag on the command line."""
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("PHALANX_")}
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_global_flags_go_before_or_after_the_command(four):
    for args in (["nodes", *flags(four)], [*flags(four), "nodes"], ["--insecure", "nodes", "--controller",
                                                                    four.address]):
        out = bare(*args, "-o", "name")
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout.split() == NODES
    # given twice, the one after the command wins
    out = bare("--controller", "127.0.0.1:1", "nodes", *flags(four), "-o", "hostlist")
    assert out.returncode == 0 and out.stdout.strip() == "gpu[001-004]", out.stderr


def test_nodes_are_named_by_hostlists_in_and_shown_as_hostlists_out(four):
    drained = four.cli("drain", "gpu[002-003]", "--reason", "swap the PSU")
    assert drained.returncode == 0, drained.stderr
    assert drained.stdout.splitlines() == ["gpu002: DRAINED (drain reason: swap the PSU)",
                                           "gpu003: DRAINED (drain reason: swap the PSU)"]
    assert four.cli("nodes", "--state", "DRAINED", "-o", "hostlist").stdout.strip() == "gpu[002-003]"
    assert four.cli("nodes", "gpu[001-002]", "-o", "name").stdout.split() == ["gpu001", "gpu002"]
    wide = four.cli("nodes", "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NODE", "STATE", "HEALTH", "GPUS", "CPU", "LOAD", "LAST-HB", "PEER", "GPU-MODEL",
                               "RANKS", "LABELS", "INCARNATION", "IN-STATE", "DRAIN-REASON"]
    # some nodes unknown: the others are done, each failure said, and the command fails naming them
    partly = four.cli("undrain", "gpu[002-003],gpu[098-099]")
    assert partly.returncode == 1
    assert partly.stdout.splitlines() == ["gpu002: UP", "gpu003: UP"]
    assert partly.stderr.strip().splitlines()[-1] == "phalanx: error: failed for 2 of 4 nodes: gpu[098-099]"
    assert four.states() == dict.fromkeys(NODES, "UP")
    bad = four.cli("drain", "gpu[001-", "--reason", "x")
    assert bad.returncode == 2 and "'[' without ']'" in bad.stderr
    health = four.cli("health", "gpu[003-004]").stdout.splitlines()
    assert [line.split()[0] for line in health[1:]] == ["gpu003", "gpu004"]
    partly = four.cli("health", "gpu[003-006]")
    assert partly.returncode == 1 and [line.split()[0] for line in partly.stdout.splitlines()[1:]] == ["gpu003",
                                                                                                        "gpu004"]
    assert partly.stderr.strip().splitlines()[-1] == "phalanx: error: failed for 2 of 4 nodes: gpu[005-006]"
    injected = four.cli("inject", "gpu[001-002]", "--gpu", "1", "thermal")
    assert injected.stdout.splitlines() == ["gpu001: injected GPU 1: thermal", "gpu002: injected GPU 1: thermal"]


def test_jobs_show_their_nodes_as_a_hostlist_and_watch_follows_a_job_to_its_end(four, tmp_path):
    gate = tmp_path / "end"  # the job runs until the test has seen the watch show it running
    job_id = four.cli("submit", "--nodes", "2", "--", sys.executable, "-c",
                      f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)").stdout.strip()
    four.wait_for(lambda: json.loads(four.cli("job", job_id, "-o", "json").stdout)["state"] == "RUNNING",
                  "the job running")
    table = four.cli("jobs").stdout.splitlines()
    assert table[1].split()[5] == "gpu[001-002]", table
    assert four.cli("jobs", "-o", "name").stdout.split() == [job_id]
    assert "USER" in four.cli("jobs", "-o", "wide").stdout.splitlines()[0].split()
    # --watch with -o json: one document a line, until the job ends (then the command ends by itself)
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *flags(four), "job", job_id, "--watch", "0.2",
                             "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        gate.touch()
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    states = [json.loads(line)["state"] for line in [first, *rest.splitlines()]]
    assert len(states) >= 2 and states[0] == "RUNNING" and states[-1] == "SUCCEEDED", states


def test_watch_redraws_until_interrupted(four):
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *flags(four), "nodes", "--watch", "0.2",
                             "-o", "hostlist"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = [proc.stdout.readline() for _ in range(8)]  # two refreshes: header, blank line, the nodes, blank
    finally:
        proc.send_signal(2)
        assert proc.wait(timeout=30) == 0  # Ctrl-C ends a watch normally
    assert sum(line.startswith("Every 0.2s: phalanx nodes") for line in seen) == 2, seen
    assert seen.count("gpu[001-004]\n") == 2, seen


def test_certificates_for_a_hostlist_of_nodes(tmp_path):
    assert bare("certs", "init", "--dir", str(tmp_path)).returncode == 0
    out = bare("certs", "issue", "gpu[001-003]", "--dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.glob("gpu*.crt")) == ["gpu001.crt", "gpu002.crt", "gpu003.crt"]


# -- shell completion --------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_bash_completion_offers_commands_options_and_the_controllers_nodes(four, tmp_path):
    script = bare("completion", "bash")
    assert script.returncode == 0 and "complete -o default -F _phalanx phalanx" in script.stdout
    (tmp_path / "phalanx.bash").write_text(script.stdout)
    shim = tmp_path / "bin" / "phalanx"  # `phalanx` on PATH, as the package's /usr/bin/phalanx would be
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m cli.main \"$@\"\n")
    shim.chmod(0o755)

    def complete(line: str) -> list[str]:
        code = (f"source {tmp_path / 'phalanx.bash'}; COMP_WORDS=({line}); "
                + ("COMP_WORDS+=(''); " if line.endswith(" ") else "")
                + "COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _phalanx; printf '%s\\n' \"${COMPREPLY[@]}\"")
        env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "PHALANX_CONTROLLER": four.address,
               "PHALANX_INSECURE": "1"}
        out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        return [w for w in out.stdout.split("\n") if w]

    assert complete("phalanx dr") == ["drain"]
    assert complete("phalanx drain gpu00") == NODES
    assert complete("phalanx nodes -o ") == ["hostlist", "json", "name", "table", "wide"]
    assert complete("phalanx --controller x:1 cert") == ["certs"]
    assert complete("phalanx certs ") == ["enrol", "init", "issue", "revoke", "token"]
    assert "--watch" in complete("phalanx jobs --")
    zsh = bare("completion", "zsh").stdout
    assert zsh.startswith("#compdef phalanx\n") and "bashcompinit" in zsh
