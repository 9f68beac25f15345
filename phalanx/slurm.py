"""Slurm, through its own commands (`scontrol`), for the controller, `phalanx run` and the health check.

Phalanx never edits Slurm's state behind its back: a node it takes out of service is drained with
`scontrol update NodeName=N State=DRAIN Reason="phalanx: ..."`, as NHC drains with "NHC: ...", and the
reason's prefix says who drained it, so that the health check resumes only the nodes it drained itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import subprocess
import time

from phalanx import hostlist

EVICTED = "phalanx:"  # the controller drained it: evicted from a job (an operator resumes it once repaired)
UNHEALTHY = "phalanx-health:"  # the health check drained it: it resumes it when the node is healthy again
EXHAUSTED = "no healthy node left"  # how the reason of a job whose allocation ran out of nodes begins
REASON_MAX = 256  # Slurm keeps reasons short; ours say enough within this


class SlurmError(Exception):
    """A Slurm command failed; the message has its output."""


def drain_argv(scontrol: str, node: str, reason: str) -> list[str]:
    """One argument each (no shell): a reason from an incident's text cannot add arguments; control characters
    (a newline would break `scontrol show node -o`) become spaces."""
    clean = "".join(c if c.isprintable() else " " for c in reason)[:REASON_MAX]
    return [*shlex.split(scontrol), "update", f"NodeName={node}", "State=DRAIN", f"Reason={clean}"]


def resume_argv(scontrol: str, node: str) -> list[str]:
    return [*shlex.split(scontrol), "update", f"NodeName={node}", "State=RESUME"]


async def adrain(scontrol: str, node: str, reason: str, timeout_s: float = 15.0, tries: int = 3) -> str:
    """Drain `node` in Slurm (on the event loop); '' on success, else why not."""
    try:
        await arun(drain_argv(scontrol, node, reason), timeout_s, tries)
    except SlurmError as e:
        return str(e)
    return ""


# A Slurm job in one of these states still holds its allocation (scontrol's JobState names); any other state
# (COMPLETING, COMPLETED, CANCELLED, FAILED, TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, PENDING after a
# requeue, ...) means the allocation is gone or going.
HOLDS_ALLOCATION = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "RESIZING", "SIGNALING"})
GONE = "no longer known to Slurm"  # a Slurm job id scontrol does not know (it ended past MinJobAge)


async def ajob_record(scontrol: str, job_id: int | str, timeout_s: float = 15.0) -> dict[str, str]:
    """`scontrol -o show job ID` as a dict (JobState, Restarts, StartTime, ...), or {} when scontrol says the id is
    invalid (a job that ended longer than MinJobAge ago). Raises SlurmError when Slurm cannot be asked (no config,
    slurmctld down): that says nothing about the job."""
    try:
        out = await arun([*shlex.split(scontrol), "-o", "show", "job", str(job_id)], timeout_s)
    except SlurmError as e:
        if "invalid job id" in str(e).lower():
            return {}
        raise
    lines = out.strip().splitlines()
    record = parse_record(lines[0]) if lines else {}
    if not record.get("JobState"):
        raise SlurmError(f"scontrol show job {job_id} gave no JobState: {out.strip()[:200]!r}")
    return record


async def arun(argv: list[str], timeout_s: float = 15.0, tries: int = 3) -> str:
    """Run a Slurm command on the event loop; its output. A try that dies of a signal (Debian's scontrol 22.05
    has been seen to crash now and then) or times out is tried again, up to `tries`. Raises SlurmError."""
    why = ""
    for attempt in range(tries):
        if attempt:
            await asyncio.sleep(0.5 * attempt)
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except OSError as e:
            raise SlurmError(f"cannot run {argv[0]!r}: {e}") from None
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            why = f"{argv[0]} did not answer within {timeout_s:g}s"
            continue
        text = out.decode(errors="replace")
        if proc.returncode == 0:
            return text
        why = f"{' '.join(argv[:3])} failed ({proc.returncode}): {text.strip()[:500]}"
        if proc.returncode > 0:  # Slurm said no (unknown node, not allowed): asking again will not help
            break
    raise SlurmError(why)


def run(argv: list[str], timeout_s: float = 30.0, tries: int = 3) -> str:
    """Run a Slurm command; its stdout. One that dies of a signal is tried again, up to `tries`. Raises
    SlurmError."""
    for attempt in range(tries):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(f"cannot run {' '.join(argv[:2])}: {e}") from None
        if done.returncode >= 0:
            break
        time.sleep(0.5 * (attempt + 1))
    if done.returncode:
        raise SlurmError(f"{' '.join(argv[:3])} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done.stdout


def parse_record(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` line: KEY=VALUE pairs; a value may hold spaces (Reason=...) up to the next KEY=."""
    out: dict[str, str] = {}
    key = None
    for word in line.strip().split(" "):
        name, sep, value = word.partition("=")
        # a KEY= already seen is text of the value it is in (Reason="NHC: ib port State=Down" keeps State)
        if sep and name.isascii() and name.replace("_", "").isalnum() and name[0].isupper() and name not in out:
            key = name
            out[key] = value
        elif key is not None:
            out[key] += " " + word
    return out


def node_record(scontrol: str, node: str) -> dict[str, str]:
    """`scontrol show node NODE -o` as a dict (State, Reason, ...). Raises SlurmError."""
    lines = run([*shlex.split(scontrol), "show", "node", node, "-o"]).strip().splitlines()
    if not lines:
        raise SlurmError(f"scontrol show node {node} said nothing")
    return parse_record(lines[0])


class Allocation:
    """The Slurm allocation `phalanx run` runs in, from the environment Slurm gives a batch script or step."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        self.job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
        if not nodelist or not self.job_id:
            raise SlurmError("phalanx run runs inside a Slurm allocation (an sbatch script, salloc or srun): "
                             "SLURM_JOB_NODELIST and SLURM_JOB_ID are not set here; outside Slurm, use "
                             "`phalanx submit`")
        try:
            self.nodes = hostlist.expand(nodelist)
        except ValueError as e:
            raise SlurmError(f"SLURM_JOB_NODELIST ({nodelist!r}) is not a hostlist: {e}") from None
        self.nodelist = nodelist
        restarts = env.get("SLURM_RESTART_COUNT", "0")
        # the Phalanx job's name: slurm-JOBID, and .N for the Nth requeue of it (the same Slurm job id)
        self.job_name = f"slurm-{self.job_id}" + (f".{restarts}" if restarts.isdigit() and int(restarts) else "")
