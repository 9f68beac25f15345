"""`python -I .../agent/rankwrap.py EXIT_FILE [--as UID:GID:G1,G2 ENV] -- COMMAND...`: run a rank, record its end.

The agent starts every rank through this wrapper, in a session of its own. The wrapper runs the
command in the same process group, passes SIGTERM/SIGINT on, writes the rank's pid to
`pid_path(EXIT_FILE)` as soon as it has started it, and writes the exit status to EXIT_FILE
(atomically) when the rank ends. An agent that restarted meanwhile — and so is no longer the
rank's parent and cannot wait() for it — still learns the rank's pid and how it ended. With
`--as UID:GID:GROUPS ENV_FILE`, the rank runs with that uid, gid and supplementary groups and the
environment in ENV_FILE (read, then removed), while the wrapper keeps the agent's rights and a
minimal environment of the agent's making. With `--cgroup DIR` (once per hierarchy) the wrapper
moves into the rank's cgroup before starting it; with `--nofile N` the rank may open N files; with
`--cpus 0,1,...` the rank runs on those CPUs; with `--cwd DIR` it starts in DIR, entered after the uid and
gid changed when `--as` is given (a job's working directory is its account's to reach: root never enters it).

The wrapper, not the agent, pins, moves and limits itself: the agent starts it without a `preexec_fn`.
Python code between fork and exec in the agent, a process with gRPC's threads, runs gRPC's fork handlers
in the child, and on this machine 43 of 60 such children died of SIGSEGV before their exec.

The agent runs this file by its path in isolated mode (`-I`): nothing in the job's working
directory or PYTHONPATH (a user's `agent.py`, say) can stand in for it. So it imports the standard
library only.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys


def pid_path(exit_file: str) -> str:
    """Where the wrapper of `exit_file` writes its rank's pid."""
    return f"{os.path.splitext(exit_file)[0]}.pid"


def write_status(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


USAGE = "usage: python -I rankwrap.py EXIT_FILE [--as UID:GID:GROUPS ENV_FILE] [--cgroup DIR]... " \
        "[--nofile N] [--cpus LIST] [--cwd DIR] -- COMMAND..."


def main(argv: list[str]) -> int:
    identity: dict = {}
    cgroups: list[str] = []
    nofile = 0
    cpus: list[int] = []
    cwd = ""
    rest = argv[1:]
    try:
        while rest and rest[0] != "--":
            option, rest = rest[0], rest[1:]
            if option == "--as":
                # the rank's environment comes in a file the agent wrote (root's, 0600), not in ours: the wrapper
                # keeps the agent's rights and must not run with what a job put in its environment (LD_PRELOAD)
                uid, gid, groups = rest[0].split(":")
                with open(rest[1]) as f:
                    env = json.load(f)
                os.unlink(rest[1])
                identity = {"user": int(uid), "group": int(gid),
                            "extra_groups": [int(g) for g in groups.split(",") if g], "env": env}
                rest = rest[2:]
            elif option == "--cgroup":
                cgroups.append(rest[0])
                rest = rest[1:]
            elif option == "--nofile":
                nofile = int(rest[0])
                rest = rest[1:]
            elif option == "--cpus":
                cpus = [int(c) for c in rest[0].split(",")]
                rest = rest[1:]
            elif option == "--cwd":
                cwd = rest[0]
                rest = rest[1:]
            else:
                raise ValueError(option)
    except (IndexError, ValueError):
        print(USAGE, file=sys.stderr)
        return 2
    if not argv or len(rest) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    argv = [argv[0], *rest]
    exit_file, command = argv[0], argv[2:]
    child: subprocess.Popen | None = None
    early: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # A signal to the whole group reaches the child too; one sent to us alone is passed on. One that
        # comes while the child is being started waits for it: dying of it then would leave the rank running,
        # out of the agent's sight (a stop right after a launch).
        if child is None:
            early.append(signum)
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    try:
        # into the rank's cgroup before the rank starts, so it and all it starts are there from the first fork
        for d in cgroups:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))  # inherited by the rank
        if cpus:
            try:
                os.sched_setaffinity(0, cpus)  # inherited by the rank
            except OSError as e:  # CPUs outside this container's cpuset, say: the rank runs, unpinned, and says so
                print(f"phalanx: rank not pinned to CPUs {','.join(map(str, cpus))} (its GPU's NUMA-local ones): {e}",
                      file=sys.stderr, flush=True)
        where: dict = {}
        if cwd and identity:  # Popen's cwd is entered before the uid changes; preexec_fn runs after (one thread here)
            where = {"preexec_fn": lambda: os.chdir(cwd)}
        elif cwd:
            where = {"cwd": cwd}
        child = subprocess.Popen(command, **identity, **where)  # exec resets the handlers: the rank gets the defaults
    except subprocess.SubprocessError:  # the chdir as the account failed (preexec_fn): say what it was
        print(f"phalanx: cannot start {command[0]!r}: the job's account cannot enter its working directory {cwd}",
              file=sys.stderr, flush=True)
        write_status(exit_file, 127)
        return 127
    except (OSError, ValueError) as e:  # ValueError: an open-files limit above what this host allows (nr_open)
        print(f"phalanx: cannot start {command[0]!r}: {e}", file=sys.stderr, flush=True)
        write_status(exit_file, 127)
        return 127
    write_status(pid_path(exit_file), child.pid)
    for signum in early:
        child.send_signal(signum)
    code = child.wait()
    write_status(exit_file, code)  # negative: killed by that signal, as Popen reports it
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
