"""Warm starts: rank processes started and imported before they are needed (`agent/warmstart.py`).

A restart spends most of its time on the node starting Python and importing torch. So the agent
keeps standbys: for each job that runs here (as many as it has ranks here) and each job this node
is a spare of (as many as the controller asks for), processes of the job's interpreter, with its
flags, environment and working directory, that have imported torch and wait. A launch that finds
one with the same recipe hands it the rank (its full environment, log, exit file, CPUs); otherwise
it starts the rank cold, as always. A job's standbys are held while its ranks run here and for
HOLD_S after its last launch, and as long as the controller renews a spare's request.

Only a command of the form `python [FLAGS] script.py ARGS` (or `-m MODULE`, `-c CODE`) has a recipe;
anything else (a shell script, `torchrun`) starts cold. So does a job whose environment sets
PHALANX_WARM_START=0, and every job on an agent with `warm_start = false`.

A standby that dies before it is assigned is replaced; after COLD_AFTER such deaths in a row (its
interpreter cannot start, say) its recipe turns cold: the agent says so once, with the end of the
last standby's output, and does not try again. One death is not enough: an import can crash once
on a loaded machine (torch 2.13 on this 2-CPU machine did, with SIGSEGV, once in some hundred).

Standbys start one at a time, not while a launch on this node is younger than warm_quiet_s, and (where the
agent may lift it again: as root) under SCHED_IDLE, so that their imports take only CPU time nobody
else wants: a rank whose data loader or Python loop shared its cores with an import would look like a
straggler. A standby is back at the normal policy before it forks its rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from phalanx import log
from phalanx.clock import Clock

logger = log.get("warm")

WARMSTART = str(Path(__file__).with_name("warmstart.py").resolve())
HOLD_S = 120.0  # a job's standbys outlive its last launch (or spare request) here by this long
QUIET_S = 3.0  # the default of the agent's warm_quiet_s: no standby starts within this long of a launch here
COLD_AFTER = 3  # standbys of a recipe that died in a row before their rank came, and the recipe turns cold
# torch._dynamo too: torch.optim.Optimizer imports it the first time one is made (its _disable_dynamo), 1.2-1.6 s
# of every restart's first step on this machine, and ~70 MB more per standby. It starts no thread on import.
DEFAULT_IMPORTS = "torch,torch.distributed,torch._dynamo,trainlib"
# Set per launch and per rank (by the controller or this agent): they differ between generations, so they do not
# take part in a recipe. A standby gets them, with everything else, when it is assigned.
PER_LAUNCH = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_WORLD_SIZE", "ROLE_RANK", "RANK", "LOCAL_RANK",
                        "CUDA_VISIBLE_DEVICES", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE",
                        "TORCHFT_QUORUM_RETRIES"})
PER_LAUNCH_PREFIXES = ("PHALANX_", "TORCHELASTIC_")
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?$")
_FLAGS = re.compile(r"-[bBdEIOPqRsSuv]+$")  # interpreter flags without an argument; -X/-W take one


@dataclass(frozen=True)
class Recipe:
    """What makes a standby fit a launch: the same job, interpreter, program, environment and directory."""
    job: str
    interpreter: tuple[str, ...]  # the interpreter and its flags
    program: tuple[str, ...]  # script.py ARGS | -m MODULE ARGS | -c CODE ARGS
    env: tuple[tuple[str, str], ...]  # sorted, without the PER_LAUNCH keys
    workdir: str
    imports: str


def split_command(command: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """`python -u train.py --lr 3` -> (("python", "-u"), ("train.py", "--lr", "3")); None if not a Python
    program a standby can run."""
    argv = list(command)
    if not argv or not _PYTHON.match(os.path.basename(argv[0])):
        return None
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-m", "-c"):
        flag = argv[i]
        if flag in ("-X", "-W"):
            i += 2
        elif _FLAGS.match(flag) or flag.startswith(("-X", "-W")):
            i += 1
        else:
            return None  # -i, -h, -V, `-` (stdin), --: not a program to run ahead
    program = argv[i:]
    if i > len(argv) or not program or (program[0] in ("-m", "-c") and len(program) < 2):
        return None
    return tuple(argv[:i]), tuple(program)


def cold_command(command: Iterable[str]) -> list[str]:
    """The command of a rank started cold: a Python program through `warmstart.py --run`, which runs it as `python
    PROGRAM` would and ends it as a warm-started rank ends (no interpreter teardown, where torch can abort a script
    that has ended); any other command as it is."""
    split = split_command(command)
    return list(command) if split is None else [*split[0], WARMSTART, "--run", "--", *split[1]]


def recipe(job: str, command: Iterable[str], env: Mapping[str, str], workdir: str) -> Recipe | None:
    """The recipe of a launch (or of a spare's request); None if its ranks must start cold."""
    split = split_command(command)
    if split is None or env.get("PHALANX_WARM_START", "1") == "0":
        return None
    steady = tuple(sorted((k, v) for k, v in env.items()
                          if k not in PER_LAUNCH and not k.startswith(PER_LAUNCH_PREFIXES)))
    return Recipe(job, split[0], split[1], steady, workdir, env.get("PHALANX_WARM_IMPORTS", DEFAULT_IMPORTS))


@dataclass
class Standby:
    recipe: Recipe
    proc: subprocess.Popen
    ready_file: Path
    log: Path

    @property
    def ready(self) -> bool:
        return self.ready_file.exists()


@dataclass
class _Want:
    count: int
    until: float  # the clock's monotonic time


@dataclass
class WarmPool:
    """The node's standbys. Called on the agent's event loop (and its heartbeat); each call is short."""
    state_dir: Path
    clock: Clock
    enabled: bool = True
    on_cold: Callable[[str, str], None] = lambda job, why: None  # a recipe turned cold: (job, why), once
    quiet_s: float = QUIET_S  # the agent's warm_quiet_s
    _wants: dict[Recipe, _Want] = field(default_factory=dict)
    _standbys: dict[Recipe, list[Standby]] = field(default_factory=dict)
    _cold: set[Recipe] = field(default_factory=set)
    _deaths: dict[Recipe, int] = field(default_factory=dict)  # standbys that died in a row, by recipe
    _last_launch: float = float("-inf")
    _serial: int = 0
    _idle: bool = field(default_factory=lambda: os.geteuid() == 0)  # may set standbys back from SCHED_IDLE

    def __post_init__(self) -> None:
        self._dir = self.state_dir / "warm"
        self._dir.mkdir(parents=True, exist_ok=True)
        for stale in self._dir.iterdir():  # a previous agent's: its standbys ended with its pipes
            stale.unlink(missing_ok=True)

    def want(self, recipe: Recipe | None, count: int, hold_s: float = HOLD_S) -> None:
        """Keep `count` standbys of `recipe` for `hold_s` from now (a later call renews; count 0 lets go)."""
        if recipe is None or not self.enabled:
            return
        if count <= 0:
            self._wants.pop(recipe, None)
            self._let_go(recipe)
            return
        want = self._wants.get(recipe)
        until = self.clock.monotonic() + hold_s
        if want is None:
            self._wants[recipe] = _Want(count, until)
        else:
            want.count, want.until = count, max(want.until, until)

    def release(self, job: str) -> int:
        """The job is over: stop holding its standbys and end them now, rather than HOLD_S after its last launch.
        How many there were."""
        recipes = {r for r in (*self._wants, *self._standbys) if r.job == job}
        ended = sum(len(self._standbys.get(r, [])) for r in recipes)
        for r in recipes:
            self._wants.pop(r, None)
            self._let_go(r)
        return ended

    def launching(self) -> None:
        """A launch on this node: standbys wait warm_quiet_s before starting."""
        self._last_launch = self.clock.monotonic()

    def take(self, recipe: Recipe | None) -> Standby | None:
        """A live standby of `recipe`, now the caller's to assign (or None: start cold)."""
        if recipe is None:
            return None
        standbys = self._standbys.get(recipe, [])
        ready = sorted(standbys, key=lambda s: not s.ready)  # one that finished its imports first
        for standby in ready:
            if standby.proc.poll() is None:
                standbys.remove(standby)
                return standby
        return None

    def assign(self, standby: Standby, spec: dict) -> None:
        """Hand the standby its rank. OSError if it died meanwhile (start the rank cold)."""
        assert standby.proc.stdin is not None
        try:
            if self._idle:  # the rank it forks inherits the policy of its main thread
                os.sched_setscheduler(standby.proc.pid, os.SCHED_OTHER, os.sched_param(0))
            standby.proc.stdin.write((json.dumps(spec) + "\n").encode())
            standby.proc.stdin.close()
        except (OSError, ValueError) as e:  # ProcessLookupError, BrokenPipeError: it died meanwhile
            standby.proc.kill()
            raise OSError(f"the standby (pid {standby.proc.pid}) could not take the rank: {e}") from e
        standby.ready_file.unlink(missing_ok=True)
        standby.log.unlink(missing_ok=True)  # its output goes to the rank's log from now on

    def tend(self, running_jobs: set[str]) -> None:
        """Once a heartbeat: hold the wants of jobs that run here, let go of the rest, reap the dead, start the
        next standby a want lacks."""
        now = self.clock.monotonic()
        for recipe, want in list(self._wants.items()):
            if recipe.job in running_jobs:
                want.until = max(want.until, now + HOLD_S)
            elif want.until < now:
                del self._wants[recipe]
        for recipe in list(self._standbys):
            if recipe not in self._wants:
                self._let_go(recipe)
        importing = False
        for standbys in self._standbys.values():
            for standby in list(standbys):
                if standby.proc.poll() is not None:
                    standbys.remove(standby)
                    self._died(standby)
                elif not standby.ready:
                    importing = True
                else:
                    self._deaths.pop(standby.recipe, None)
        if importing or now - self._last_launch < self.quiet_s:
            return
        for recipe, want in self._wants.items():
            if recipe not in self._cold and len(self._standbys.get(recipe, [])) < want.count:
                self._start(recipe)
                return

    def counts(self) -> dict[str, tuple[int, int]]:
        """job -> (standbys ready, standbys in all), for the jobs that have any."""
        out: dict[str, tuple[int, int]] = {}
        for recipe, standbys in self._standbys.items():
            ready, total = out.get(recipe.job, (0, 0))
            out[recipe.job] = (ready + sum(1 for s in standbys if s.ready), total + len(standbys))
        return out

    def close(self) -> None:
        self._wants.clear()
        for recipe in list(self._standbys):
            self._let_go(recipe)

    def _start(self, recipe: Recipe) -> None:
        self._serial += 1
        name = f"{recipe.job}.{self._serial}"
        ready_file, log_path = self._dir / f"{name}.ready", self._dir / f"{name}.log"
        try:
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(
                    [*recipe.interpreter, WARMSTART, str(ready_file), recipe.imports, "--", *recipe.program],
                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=dict(recipe.env),
                    cwd=recipe.workdir, start_new_session=True)
        except OSError as e:
            self._turn_cold(recipe, f"cannot start {recipe.interpreter[0]!r}: {e}")
            return
        if self._idle:
            # Set from here, just after the exec, not by a preexec_fn: Python code between fork and exec runs
            # gRPC's fork handlers in the child of this process, and most such children crashed (SIGSEGV,
            # SIGABRT on a closed epoll fd). The interpreter's start-up runs at the normal policy; the imports,
            # the long part, and any thread they start do not.
            with contextlib.suppress(OSError):  # it died already: tend() finds it
                os.sched_setscheduler(proc.pid, os.SCHED_IDLE, os.sched_param(0))
        self._standbys.setdefault(recipe, []).append(Standby(recipe, proc, ready_file, log_path))
        logger.info("standby starting", job=recipe.job, pid=proc.pid)

    def _died(self, standby: Standby) -> None:
        standby.ready_file.unlink(missing_ok=True)
        try:
            tail = standby.log.read_bytes()[-400:].decode(errors="replace").strip()
        except OSError:
            tail = ""
        standby.log.unlink(missing_ok=True)
        why = f"a standby exited with status {standby.proc.returncode}" + (f": {tail}" if tail else "")
        deaths = self._deaths[standby.recipe] = self._deaths.get(standby.recipe, 0) + 1
        logger.warning("standby died before its rank came", job=standby.recipe.job, pid=standby.proc.pid,
                       deaths=deaths, reason=why)
        if deaths >= COLD_AFTER:
            self._turn_cold(standby.recipe, f"{deaths} standbys in a row died before their rank came; the last: {why}")

    def _turn_cold(self, recipe: Recipe, why: str) -> None:
        if recipe in self._cold:
            return
        self._cold.add(recipe)
        logger.warning("warm starts off for this job's recipe; its ranks start cold", job=recipe.job, reason=why)
        self.on_cold(recipe.job, why)

    def _let_go(self, recipe: Recipe) -> None:
        for standby in self._standbys.pop(recipe, []):
            if standby.proc.stdin is not None:
                standby.proc.stdin.close()
            try:
                standby.proc.kill()
            except ProcessLookupError:
                pass
            standby.proc.wait()
            standby.ready_file.unlink(missing_ok=True)
            standby.log.unlink(missing_ok=True)
