"""agent.rankwrap: the wrapper every rank runs under passes a stop on, even one that comes while it starts the rank."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = str(Path(__file__).resolve().parent.parent)
# The wrapper's own main(), with a Popen that is hit by a SIGTERM as it returns: the agent's stop landing
# while the rank is being started. The rank's pid goes to a file, so the test can look for it.
SCRIPT = """
import os, signal, subprocess, sys
from agent import rankwrap
real = subprocess.Popen
def popen(command):
    child = real(command)
    with open(sys.argv[2], "w") as f:
        f.write(str(child.pid))
    os.kill(os.getpid(), signal.SIGTERM)
    return child
rankwrap.subprocess.Popen = popen
sys.exit(rankwrap.main([sys.argv[1], "--", sys.executable, "-c", "import time; time.sleep(120)"]))
"""


def test_a_stop_that_comes_while_the_rank_starts_still_reaches_the_rank(tmp_path):
    exit_file, pid_file = tmp_path / "exit", tmp_path / "pid"
    wrapper = subprocess.Popen([sys.executable, "-c", SCRIPT, str(exit_file), str(pid_file)], cwd=ROOT,
                               start_new_session=True)
    try:
        assert wrapper.wait(timeout=60) == 128 + signal.SIGTERM
        assert exit_file.read_text().strip() == str(-signal.SIGTERM)  # the rank itself died of it
        rank = int(pid_file.read_text())
        deadline = time.monotonic() + 60
        while psutil.pid_exists(rank) and psutil.Process(rank).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the rank outlived its wrapper"
            time.sleep(0.05)
    finally:
        try:
            os.killpg(wrapper.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
