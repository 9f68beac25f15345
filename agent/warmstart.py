"""`python [FLAGS] .../agent/warmstart.py READY_FILE IMPORTS -- PROGRAM...`: a rank started before it is needed.

The agent keeps a few of these per job (`agent.warm`): the job's own interpreter, with the job's
interpreter flags, environment and working directory, that has already imported the heavy modules
(IMPORTS, comma-separated: torch, torch.distributed, torch._dynamo and trainlib by default) and waits on its stdin.
When the agent assigns it a rank it writes one JSON line (the rank's full environment, log file,
exit file and CPUs) and the process becomes that rank's wrapper: it forks, the child runs PROGRAM
(`script.py ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`) as `python PROGRAM` would, and the parent does
what `agent/rankwrap.py` does for a cold start (passes SIGTERM/SIGINT/SIGHUP on, writes the rank's
pid and, when it ends, its exit status). A rank so started skips the interpreter's start and the
imports: most of a restart's time on a spare.

Forking after `import torch` is safe as long as nothing initialised CUDA or started a thread pool:
importing torch does neither, and IMPORTS must name only modules that do not either.

Run by path; imports the standard library only (and rankwrap, by its path). Without a line on stdin
(the agent let go of it, or died) it exits 0.
"""

from __future__ import annotations

import _io
import atexit
import gc
import importlib
import importlib.util
import io
import json
import os
import runpy
import signal
import sys
import threading
import types

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _rankwrap():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rankwrap.py")
    spec = importlib.util.spec_from_file_location("_phalanx_rankwrap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def search_dir(program: list[str]) -> str:
    """What `python PROGRAM` puts first on sys.path: the script's directory, or the working directory."""
    if program[0] == "-c":
        return ""
    if program[0] == "-m":
        return os.getcwd()
    return os.path.dirname(os.path.realpath(program[0]))


def run_program(program: list[str]) -> None:
    """Run PROGRAM as the interpreter would have as its main program (in the forked child)."""
    if program[0] == "-m":
        sys.argv = [program[1], *program[2:]]  # runpy puts the module's path in argv[0]
        runpy.run_module(program[1], run_name="__main__", alter_sys=True)
    elif program[0] == "-c":
        sys.argv = ["-c", *program[2:]]
        _exec_as_main(program[1], "<string>")
    else:
        sys.argv = list(program)
        path = os.path.abspath(program[0])  # (sys.argv[0] as given, __file__ absolute: as python has them)
        if not os.path.exists(path):
            name = getattr(sys, "orig_argv", [sys.executable])[0]  # (the interpreter as it was called)
            print(f"{name}: can't open file {path!r}: [Errno 2] No such file or directory", file=sys.stderr)
            raise SystemExit(2)
        if os.path.isdir(path) or not path.endswith((".py", ".pyw")):
            runpy.run_path(path, run_name="__main__")  # a directory or zip file with a __main__.py
            return
        with io.open_code(path) as f:
            source = f.read()
        _exec_as_main(source, path, __file__=path, __cached__=None)


def _exec_as_main(source: str | bytes, filename: str, **attrs: object) -> None:
    """Run `source` as a new module __main__ (this file's module stays whole for the code after)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(attrs)
    sys.modules["__main__"] = main
    exec(compile(source, filename, "exec"), main.__dict__)


def run_as_main(program: list[str]) -> int:
    """Run PROGRAM and end as `python PROGRAM` would — the same exit status (SystemExit's code, or its message on
    stderr and 1; an uncaught exception's traceback and 1), non-daemon threads joined, atexit handlers run, files
    left open flushed — and return the status for os._exit, without the interpreter's teardown: a forked child would
    otherwise dereference every object the standby imported (torch's, page by page out of memory it shares with
    the standby) and run torch's static destructors, which can abort ("terminate called without an active
    exception"). A KeyboardInterrupt ends the process by SIGINT, as the interpreter does."""
    try:
        run_program(program)
        code = 0
    except SystemExit as e:
        code = exit_status(e.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:  # what the interpreter does first: its threading hooks (a ThreadPoolExecutor's workers
        shutdown()  # are told to finish there), then it joins the non-daemon threads
    else:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    finish_open_files()
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


# The interpreter's own file types (what `open` and the io module make): flushed at the end. Any other file object
# (written in Python: gzip, bz2, lzma, a library's own) is closed, as its finaliser would in the teardown.
BUILTIN_FILES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom, io.BufferedReader, io.BufferedRWPair,
                 io.FileIO, io.BytesIO, io.StringIO)


def finish_open_files() -> None:
    """What the interpreter's teardown does for the files the program left open, which os._exit (next) would lose:
    text files flushed into their buffers, file objects written in Python closed (a gzip file's close writes its
    trailer), binary buffers flushed; then stdout and stderr, those the program set and the interpreter's own. A
    standby froze what its imports made (gc.freeze) before it forked: only the objects made since are gone through,
    each by its type alone (reading an object's __class__ can run code that warns or raises)."""
    def quietly(call) -> None:
        try:
            call()
        except Exception:  # closed, detached or broken: nothing to be written there
            pass

    try:
        stdio = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
        texts, own, buffers = [], [], []
        for o in gc.get_objects():
            kind = type(o)
            if not issubclass(kind, _io._IOBase) or id(o) in stdio:
                continue
            (texts if issubclass(kind, io.TextIOWrapper) else buffers if kind in BUILTIN_FILES else own).append(o)
        for f in texts:
            quietly(f.flush)
        for f in own:
            quietly(f.close)
        for f in buffers:
            quietly(f.flush)
    except Exception:  # the program's own objects: whatever they do, the rank ends with its own status
        pass
    for stream in dict.fromkeys((sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)):
        if stream is not None:
            quietly(stream.flush)


def exit_status(code: object) -> int:
    """The exit status of `sys.exit(code)`, as the interpreter makes it (printing a message that is not a number)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def assigned(spec: dict, program: list[str], rankwrap) -> int:
    """Become the rank's wrapper: the child runs PROGRAM; this process reports how it ended."""
    fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    exit_file = spec["exit_file"]
    child = 0
    early: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not child:
            early.append(signum)
            return
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    pid = os.fork()
    if pid == 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(spec["env"])
        os.chdir(spec["cwd"])
        os._exit(run_as_main(program))
    child = pid
    rankwrap.write_status(rankwrap.pid_path(exit_file), pid)
    for signum in early:
        os.kill(pid, signum)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)  # negative: killed by that signal, as rankwrap reports it
    rankwrap.write_status(exit_file, code)
    return code if code >= 0 else 128 - code


def run(program: list[str]) -> None:
    """`warmstart.py --run -- PROGRAM`: a cold-started rank, run here as `python PROGRAM` would run it and ended as a
    warm one ends (run_as_main): the interpreter's teardown, where torch's static destructors can abort a rank whose
    script has ended (SIGABRT in place of its exit status), is left out."""
    if not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
        sys.path[0] = search_dir(program)  # not this file's directory: as `python PROGRAM` would have it
    os._exit(run_as_main(program))


def main(argv: list[str]) -> int:
    if len(argv) > 2 and argv[:2] == ["--run", "--"]:
        run(argv[2:])
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python [FLAGS] warmstart.py READY_FILE IMPORTS -- PROGRAM...", file=sys.stderr)
        return 2
    ready_file, imports, program = argv[0], [m for m in argv[1].split(",") if m], argv[3:]
    rankwrap = _rankwrap()
    if not (sys.flags.isolated or getattr(sys.flags, "safe_path", False)):
        sys.path[0] = search_dir(program)  # not this file's directory: as `python PROGRAM` would have it
    for name in imports:
        try:
            importlib.import_module(name)
        except Exception as e:  # the rank imports what it needs itself; this one only saves time
            print(f"phalanx warm start: {name} not imported ahead: {e}", file=sys.stderr, flush=True)
    # What the imports made leaves the collector's care: a rank forked from here neither copies those pages by the
    # collector's writes to them nor goes through them at its end (finish_open_files).
    gc.freeze()
    with open(ready_file, "w"):
        pass
    line = sys.stdin.readline()
    if not line:
        return 0
    code = assigned(json.loads(line), program, rankwrap)
    sys.stdout.flush()
    os._exit(code)  # the wrapper half: no interpreter teardown of what the imports set up


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
