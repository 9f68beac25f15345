"""Atomic, durable, generation-fenced checkpoints for multi-rank training.

Layout under `root`::

    GENERATION                     highest generation that has started (claim_generation)
    .ranks/g000000003/rank-00000.json  each rank's marker at trainlib.init() (trainlib/shared_dir.py)
    step-000000042/
        rank-00000.pt              this rank's shard (torch.save), or dcp/ for save_sharded
        rank-00000.done            durable marker: generation, and size + CRC-32 of the rank's files
        MANIFEST.json              the commit record; written by rank 0 once every marker exists

The commit protocol keeps two promises from the design: a checkpoint is visible to `load_latest`
only once every rank's shard is durable (shards and markers are fsync'd and renamed into place
before rank 0 writes the manifest, and readers only trust manifests), and a rank from an old
generation never commits (every write is checked against GENERATION, the manifest write under a
shared lock that `claim_generation` takes exclusively, so no claim can slip between check and commit).

Only the standard library and torch: this runs inside user training processes.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainlib._atomic import (
    CHECKSUMS,
    Digest,
    file_digest,
    fsync_dir,
    is_temp,
    locked,
    make_dirs_durable,
    read_json,
    write_atomic,
    write_json_atomic,
)

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
GENERATION = "GENERATION"
_LOCK = ".GENERATION.lock"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_FORMATS = ("torch", "dcp")
_POLL_FIRST_S, _POLL_MAX_S = 0.005, 0.1


class CheckpointError(Exception):
    """Base of every trainlib checkpoint error."""


class StaleGenerationError(CheckpointError):
    """Terminal for this process: a newer generation of the job has started; this one must stop."""


class CommitTimeout(CheckpointError):
    """Recoverable: not every rank's shard became durable in time; the step stays invisible."""


@dataclass(frozen=True)
class CommitResult:
    step: int
    committed: bool  # whether this call wrote the manifest (rank 0 only)
    bytes_written: int  # this rank's shard bytes
    seconds: float  # from the call to this rank's marker (ranks > 0) or to the commit (rank 0)
    generation: int


@dataclass(frozen=True)
class Loaded:
    step: int
    state: dict[str, Any]
    generation: int  # the generation that committed the step


_crc_lock = threading.Lock()
_crc_off_saves = 0
_crc_before = True


def _torch_save(state: dict[str, Any], writer: Any) -> None:
    """torch.save without its per-record CRC32: the shard's own checksum, checked on load, already covers
    every byte, and torch's CRC costs about a third of the write throughput. (The setting is process-wide while a
    save runs; a torch.save elsewhere at that moment only goes without its CRC, which loads the same.)"""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch before 2.6
        config = None
    if config is None or not hasattr(getattr(config, "save", None), "compute_crc32"):
        torch.save(state, writer)
        return
    global _crc_off_saves, _crc_before
    with _crc_lock:  # saves may overlap (async and sync): the first in turns the CRC off, the last out restores it
        if _crc_off_saves == 0:
            _crc_before = config.save.compute_crc32
            config.save.compute_crc32 = False
        _crc_off_saves += 1
    try:
        torch.save(state, writer)
    finally:
        with _crc_lock:
            _crc_off_saves -= 1
            if _crc_off_saves == 0:
                config.save.compute_crc32 = _crc_before


class Checkpointer:
    """One rank's view of a checkpoint directory shared by all ranks of a job.

        ck = Checkpointer(root, rank=rank, world_size=world, generation=gen, barrier=dist.barrier)
        ck.claim_generation()                 # at startup; fences off every older generation
        loaded = ck.load_latest()             # Loaded(step, state, generation) or None
        ck.save(state, step)                  # or save_async(state, step) / save_sharded(state_dict, step)

    `barrier` (every rank calls it after its marker is durable) lets rank 0 skip polling; without
    it rank 0 polls the markers for up to `commit_timeout_s`.
    """

    def __init__(self, root: str | Path, *, rank: int, world_size: int, generation: int, keep: int = 3,
                 barrier: Callable[[], None] | None = None, commit_timeout_s: float = 600) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
        if generation < 0:
            raise ValueError(f"generation ({generation}) must not be negative")
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be at least 1: the newest committed step is never deleted")
        if commit_timeout_s <= 0:
            raise ValueError(f"commit_timeout_s ({commit_timeout_s:g}) must be positive")
        self.root = Path(root)
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.keep, self.barrier, self.commit_timeout_s = keep, barrier, commit_timeout_s
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: Future[CommitResult] | None = None

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:09d}"

    # ---- fencing -------------------------------------------------------------------------------

    def current_generation(self) -> int | None:
        """The generation recorded in GENERATION, or None before any claim."""
        path = self.root / GENERATION
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            return None
        if not text.isdigit():
            raise CheckpointError(f"{path} holds {text!r}, not a generation number")
        return int(text)

    def claim_generation(self) -> None:
        """Record our generation as the newest one; call once at startup of a new generation. Idempotent.

        Raises StaleGenerationError if a newer generation already claimed the directory.
        """
        make_dirs_durable(self.root)
        with locked(self.root / _LOCK, exclusive=True):
            current = self.current_generation()
            self._refuse_if_stale(current, "claim the checkpoint directory", None)
            if current != self.generation:
                write_atomic(self.root / GENERATION, lambda w: w.write(f"{self.generation}\n".encode()))
                log.info("checkpoint generation claimed generation=%d previous=%s", self.generation, current)

    def _refuse_if_stale(self, current: int | None, doing: str, step: int | None) -> None:
        if current is not None and current > self.generation:
            what = doing if step is None else f"{doing} step {step}"
            raise StaleGenerationError(f"generation {self.generation} is stale: {self.root / GENERATION} holds "
                                       f"generation {current}; refusing to {what}")

    # ---- saving --------------------------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int) -> CommitResult:
        """Write this rank's shard durably, then commit the step (rank 0) once every rank's shard is durable.

        Waits for an async save in flight first, and raises its error if it failed.
        """
        self._surface_async()
        return self._save_now(state, step)

    def save_async(self, state: dict[str, Any], step: int) -> Future[CommitResult]:
        """Snapshot `state` to CPU memory now, write and commit it in a background thread.

        Training may mutate `state` as soon as this returns. One save is in flight at a time: a call
        waits for the previous one, and raises its error if it failed (errors also land on the Future).
        The writer thread is not a daemon, so a save in flight still completes when the interpreter exits.
        """
        self._surface_async()
        snapshot = snapshot_to_cpu(state)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainlib-ckpt")
        future = self._executor.submit(self._save_now, snapshot, step)
        self._inflight = future
        return future

    def wait(self) -> CommitResult | None:
        """Wait for the in-flight async save; its result, None if there was none; raises its error."""
        return self._surface_async()

    def save_sharded(self, state_dict: dict[str, Any], step: int) -> CommitResult:
        """Save through torch.distributed.checkpoint into step-N/dcp/, then the same marker/manifest commit.

        Collective when a process group is initialized (every rank calls it); with world_size 1 it
        also works without one.
        """
        import torch.distributed.checkpoint as dcp

        self._surface_async()
        started = time.monotonic()
        no_dist = self._no_dist()
        directory = self._begin_step(step) / "dcp"
        make_dirs_durable(directory)
        for leftover in directory.glob(f"__{self.rank}_*.distcp"):  # from a torn earlier attempt
            leftover.unlink()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(torch\.distributed is disabled|existing checkpoint)")
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(directory, sync_files=True),
                     no_dist=no_dist)
        fsync_dir(directory)  # DCP renames .metadata into place without syncing the directory
        mine = sorted(directory.glob(f"__{self.rank}_*.distcp"))
        if self.rank == 0:
            mine.append(directory / ".metadata")
        return self._commit(step, "dcp", {f"dcp/{p.name}": file_digest(p) for p in mine}, started)

    def _save_now(self, state: dict[str, Any], step: int) -> CommitResult:
        started = time.monotonic()
        name = f"rank-{self.rank:05d}.pt"
        digest = write_atomic(self._begin_step(step) / name, lambda w: _torch_save(state, w))
        return self._commit(step, "torch", {name: digest}, started)

    def _begin_step(self, step: int) -> Path:
        """Check we may write `step`, create its directory durably, and drop a manifest an older generation left."""
        if step < 0:
            raise ValueError(f"step ({step}) must not be negative")
        self._refuse_if_stale(self.current_generation(), "write", step)
        directory = self.step_dir(step)
        make_dirs_durable(directory)
        manifest = read_json(directory / MANIFEST)
        if manifest is not None:
            # Saving a committed step again (a restart that fell back past it): hide the old commit
            # first, or its manifest would vouch for a mix of old and new shards. Every rank does
            # this, so a rank that comes late still hides a commit made from its old shard.
            self._refuse_if_stale(manifest.get("generation", -1), "overwrite the manifest of", step)
            with contextlib.suppress(FileNotFoundError):
                (directory / MANIFEST).unlink()
            fsync_dir(directory)
            log.warning("checkpoint step recommitting step=%d generation=%d previous_generation=%s",
                        step, self.generation, manifest.get("generation"))
        with contextlib.suppress(FileNotFoundError):  # our marker from an earlier attempt no longer vouches
            (directory / f"rank-{self.rank:05d}.done").unlink()
        return directory

    def _commit(self, step: int, fmt: str, files: dict[str, Digest], started: float) -> CommitResult:
        directory = self.step_dir(step)
        size = sum(d.size for d in files.values())
        marker = {"rank": self.rank, "step": step, "generation": self.generation, "world_size": self.world_size,
                  "format": fmt, "size": size,
                  "files": {rel: d.marker() for rel, d in files.items()}}
        self._refuse_if_stale(self.current_generation(), "mark", step)
        write_json_atomic(directory / f"rank-{self.rank:05d}.done", marker)
        if self.barrier is not None:
            self.barrier()
        if self.rank != 0:
            return CommitResult(step, False, size, time.monotonic() - started, self.generation)
        ranks = self._await_markers(step, fmt)
        fsync_dir(self.root)  # the step directory's own entry must be durable before anything vouches for it
        manifest = {"version": 1, "step": step, "generation": self.generation, "world_size": self.world_size,
                    "format": fmt, "time": time.time(), "ranks": ranks}
        with locked(self.root / _LOCK, exclusive=False):  # no claim can land between this check and the rename
            self._refuse_if_stale(self.current_generation(), "commit", step)
            existing = read_json(directory / MANIFEST)
            if existing is not None:
                self._refuse_if_stale(existing.get("generation", -1), "overwrite the manifest of", step)
            write_json_atomic(directory / MANIFEST, manifest)
        seconds = time.monotonic() - started
        log.info("checkpoint committed step=%d generation=%d ranks=%d format=%s bytes=%d seconds=%.3f",
                 step, self.generation, self.world_size, fmt, sum(r["size"] for r in ranks.values()), seconds)
        try:
            self._prune(step)
        except OSError as e:  # the step is committed; a failed cleanup must not make the save look failed
            log.warning("checkpoint prune failed step=%d error=%r", step, e)
        return CommitResult(step, True, size, seconds, self.generation)

    def _await_markers(self, step: int, fmt: str) -> dict[str, Any]:
        """Rank 0: every rank's marker for this step and generation, with its files at the recorded sizes."""
        directory = self.step_dir(step)
        deadline = time.monotonic() + self.commit_timeout_s
        found: dict[str, Any] = {}
        pause = _POLL_FIRST_S
        while True:
            waiting: list[str] = []
            for r in range(self.world_size):
                if str(r) in found:
                    continue
                marker = read_json(directory / f"rank-{r:05d}.done")
                why = self._marker_problem(marker, step, fmt)
                if why:
                    waiting.append(f"{r} ({why})")
                else:
                    assert marker is not None
                    found[str(r)] = {"size": marker["size"], "files": marker["files"]}
            if not waiting:
                return found
            self._refuse_if_stale(self.current_generation(), "commit", step)
            if time.monotonic() >= deadline:
                raise CommitTimeout(f"step {step} not committed: waited {self.commit_timeout_s:g}s in {directory} "
                                    f"for every rank's marker (rank-NNNNN.done, written once its shard is "
                                    f"durable); none vouches for this step and generation from rank(s) "
                                    f"{', '.join(waiting)} of {self.world_size}")
            time.sleep(pause)
            pause = min(pause * 1.5, _POLL_MAX_S)

    def _marker_problem(self, marker: dict[str, Any] | None, step: int, fmt: str) -> str:
        """Why a marker does not (yet) vouch for a durable shard of this step and generation; '' if it does."""
        if marker is None:
            return "no marker"
        if marker.get("generation", -1) > self.generation:
            self._refuse_if_stale(marker["generation"], "commit", step)
        if marker.get("generation") != self.generation or marker.get("step") != step:
            return f"marker from generation {marker.get('generation')}"
        if marker.get("world_size") != self.world_size or marker.get("format") != fmt:
            raise CheckpointError(f"step {step}: rank {marker.get('rank')} saved {marker.get('format')} with "
                                  f"world_size {marker.get('world_size')}; this rank saves {fmt} with "
                                  f"world_size {self.world_size}")
        for rel, info in marker["files"].items():
            if _size(self.step_dir(step) / rel) != info["size"]:
                return f"{rel} does not match its marker"
        return ""

    def _prune(self, newest: int) -> None:
        """Rank 0 after committing `newest`: keep the last `keep` committed steps, drop older and torn ones.

        Steps above `newest` may be in flight on other ranks and are left alone.
        """
        steps = [n for n in self._steps_desc() if n <= newest]
        committed = [n for n in steps if (self.step_dir(n) / MANIFEST).exists()]
        kept = set(committed[: self.keep]) | {newest}
        for n in steps:
            directory = self.step_dir(n)
            if n not in kept:
                with contextlib.suppress(FileNotFoundError):
                    (directory / MANIFEST).unlink()  # invisible first, so a crash mid-delete leaves no lie
                shutil.rmtree(directory, ignore_errors=True)
                continue
            for sub in (directory, directory / "dcp"):
                for entry in sub.glob(".*"):
                    if is_temp(entry.name):
                        with contextlib.suppress(FileNotFoundError):
                            entry.unlink()

    def _surface_async(self) -> CommitResult | None:
        future, self._inflight = self._inflight, None
        return None if future is None else future.result()

    # ---- loading -------------------------------------------------------------------------------

    def latest_step(self) -> int | None:
        """The newest committed step (any format) whose shards are all present at their recorded sizes."""
        return next((n for n in self._steps_desc() if self._validate(n, None, verify=False)[0] is not None), None)

    def load_latest(self, map_location: Any = "cpu", *, weights_only: bool = True) -> Loaded | None:
        """This rank's state from the newest complete, valid step saved with `save`; None if there is none.

        Steps without a manifest (partial, torn) are skipped; so is a step whose shard fails its checksum: the
        previous complete step is used instead. With a process group (call it after init_process_group, as
        every rank does) the ranks agree on the step, one collective per step tried, so that one rank's corrupt
        shard makes every rank fall back together: no rank resumes from another step than its peers.
        """
        agree = self._agreement()
        for n in self._steps_desc():
            manifest, why = self._validate(n, "torch", verify=True)
            if agree is not None:
                if not agree(manifest is not None):
                    continue
            elif manifest is None:
                if "does not match" in why:  # this rank's own shard is corrupt: its peers may load this step
                    print(f"trainlib: rank {self.rank} skips step {n} ({why}); with no process group to agree "
                          "through, the other ranks may resume from it: call load_latest after init_process_group",
                          file=sys.stderr, flush=True)
                continue
            assert manifest is not None
            if manifest["world_size"] != self.world_size:
                raise CheckpointError(f"step {n} was saved by {manifest['world_size']} ranks, this job has "
                                      f"{self.world_size}; use save_sharded/load_sharded to reshard")
            path = self.step_dir(n) / f"rank-{self.rank:05d}.pt"
            try:
                state = torch.load(path, map_location=map_location, weights_only=weights_only)
            except Exception as e:
                raise CheckpointError(f"step {n}: {path} passed its checksum but does not load: {e}") from e
            return Loaded(n, state, manifest["generation"])
        return None

    def load_sharded(self, state_dict: dict[str, Any], step: int | None = None) -> Loaded | None:
        """Load a `save_sharded` step into `state_dict` in place (DCP may reshard to this world size).

        Collective with a process group: the ranks agree on the step, so one rank's bad shard makes
        all of them fall back together rather than hang in mismatched loads.
        """
        import torch.distributed.checkpoint as dcp

        for n in [step] if step is not None else self._steps_desc():
            manifest, why = self._validate(n, "dcp", verify=True)
            if not self._all_ranks_agree(manifest is not None):
                if step is not None:
                    raise CheckpointError(f"step {step} cannot be loaded: {why or 'another rank rejected it'}")
                continue
            assert manifest is not None
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled")
                dcp.load(state_dict, storage_reader=dcp.FileSystemReader(self.step_dir(n) / "dcp"),
                         no_dist=self._no_dist())
            return Loaded(n, state_dict, manifest["generation"])
        return None

    def _validate(self, step: int, fmt: str | None, verify: bool) -> tuple[dict[str, Any] | None, str]:
        """(manifest, '') when `step` is committed and its files check out; (None, why) otherwise.

        Every rank's files must exist at the recorded size; with `verify`, this rank's files must
        also match their checksum. For DCP, which may read any rank's files when it reshards, the
        ranks split the hashing (saved rank m is checked by rank m % world_size) and agree afterwards.
        """
        directory = self.step_dir(step)
        manifest = read_json(directory / MANIFEST)
        if manifest is None:
            return None, "not committed"
        try:
            if manifest["step"] != step or manifest["format"] not in _FORMATS:
                return None, "manifest does not describe this step"
            if fmt is not None and manifest["format"] != fmt:
                return None, f"saved as {manifest['format']}"
            ranks = manifest["ranks"]
            if set(ranks) != {str(r) for r in range(manifest["world_size"])}:
                return None, "manifest does not list every rank"
            mine: dict[str, Any] = {}
            for r, entry in ranks.items():
                for rel, info in entry["files"].items():
                    if _size(directory / rel) != info["size"]:
                        why = f"{rel} is missing or not {info['size']} bytes"
                        log.warning("checkpoint step skipped step=%d reason=%r", step, why)
                        return None, why
                    if int(r) % self.world_size == self.rank or rel == "dcp/.metadata":
                        mine[rel] = info
            for rel, info in mine.items() if verify else ():
                algorithm = next((a for a in CHECKSUMS if a in info), None)
                if algorithm is None:
                    return None, f"{rel} has no checksum this version knows ({', '.join(CHECKSUMS)})"
                if file_digest(directory / rel, algorithm).value != info[algorithm]:
                    why = f"{rel} does not match its {algorithm}"
                    log.warning("checkpoint step skipped step=%d reason=%r", step, why)
                    return None, why
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            return None, f"malformed manifest ({e!r})"
        return manifest, ""

    def _steps_desc(self) -> list[int]:
        try:
            names = [entry.name for entry in self.root.iterdir()]
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for m in map(_STEP_DIR.match, names) if m), reverse=True)

    def _no_dist(self) -> bool:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise CheckpointError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                                      f"checkpointer is rank {self.rank} of {self.world_size}")
            return False
        if self.world_size > 1:
            raise CheckpointError(f"sharded checkpoints with world_size {self.world_size} need an initialized "
                                  "torch.distributed process group")
        return True

    def _agreement(self) -> Callable[[bool], bool] | None:
        """How the ranks agree on a yes/no: all of them through the process group, or this one alone when it is
        the only rank; None when there are several and no process group."""
        try:
            alone = self._no_dist()
        except CheckpointError:
            return None
        return (lambda ok: ok) if alone else self._all_ranks_agree

    def _all_ranks_agree(self, ok: bool) -> bool:
        if self._no_dist():
            return ok
        import torch.distributed as dist

        votes: list[Any] = [None] * self.world_size
        dist.all_gather_object(votes, ok)
        return all(votes)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def snapshot_to_cpu(obj: Any, _memo: dict[Any, Any] | None = None, staging: Staging | None = None) -> Any:
    """A CPU copy of a state tree that training may mutate freely afterwards.

    Tensors are copied per storage, not per tensor, and a tensor that appears twice is copied once:
    views and tied weights keep sharing memory in the copy exactly as in `obj`, so `torch.save` of
    the copy writes the same bytes as a synchronous save of `obj` (and no more of them).

    `staging`: host buffers kept from one copy to the next (see Staging); the copy lies in them, so it
    lasts only until the staging's next use, and a GPU tensor's copy is only queued: `staging.ready()`
    waits for it. Without one, fresh memory, and a GPU tensor's copy is complete on return.
    """
    memo: dict[Any, Any] = {} if _memo is None else _memo
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return memo[id(obj)]
        t = obj.detach()
        if t.layout != torch.strided or type(t) is not torch.Tensor:
            copied = t.cpu().clone()
        else:
            storage = t.untyped_storage()
            key = ("storage", storage.data_ptr(), str(storage.device))
            if key not in memo:
                if staging is not None:
                    memo[key] = staging.take(storage)
                else:
                    memo[key] = storage.clone() if storage.device.type == "cpu" else storage.cpu()
            copied = torch.empty(0, dtype=t.dtype).set_(memo[key], t.storage_offset(), t.size(), t.stride())
        memo[id(obj)] = copied  # `obj` lives in the caller's tree for the whole call, so its id is stable
        return copied
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the type and attributes (a state_dict's _metadata)
        for k, v in obj.items():
            out[k] = snapshot_to_cpu(v, memo, staging)
        return out
    if isinstance(obj, list):
        out = copy.copy(obj)
        out[:] = [snapshot_to_cpu(v, memo, staging) for v in obj]
        return out
    if isinstance(obj, tuple):
        items = [snapshot_to_cpu(v, memo, staging) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _timing_event(device: int) -> Any:
    """A CUDA event recorded now on `device`'s current stream; `synchronize()` sleeps rather than spins."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(enable_timing=True, blocking=True)
        event.record()
    return event


class Staging:
    """Host memory one snapshot at a time is copied into, kept for the next: a state of the same shape (a
    training loop's, step after step) reuses it, so a copy costs the copy alone, not also fresh pages to fault
    in. A GPU storage goes into page-locked (pinned) memory with an asynchronous device-to-host copy, queued
    on the device's current stream: the training thread only queues it, and kernels queued after it (the next
    optimizer step) run after it, so the copy sees this step's values. `ready()` waits until the copy has
    landed (the snapshot writer calls it, not the training thread).

    Buffers are matched to storages by their order in the tree; one whose size no longer matches is replaced.
    Not thread-safe: the caller gives a staging to one copy at a time (trainlib._snapshot keeps two, so one
    can be written out while the next step's copy goes into the other)."""

    def __init__(self) -> None:
        self._buffers: list[torch.UntypedStorage] = []
        self._used = 0
        self._starts: dict[int, Any] = {}  # per GPU copied from since begin(): a timing event before its copies
        self._events: list[tuple[Any, Any]] = []  # per GPU: (before, after) its copies
        self._sources: list[torch.UntypedStorage] = []  # GPU storages being copied: kept alive until ready()

    def begin(self) -> None:
        self._used, self._starts, self._events, self._sources = 0, {}, [], []

    def take(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A host copy of `storage` in this staging's next buffer (queued, for a GPU storage)."""
        device = storage.device.type == "cuda"
        i, self._used = self._used, self._used + 1
        buffer = self._buffers[i] if i < len(self._buffers) else None
        if buffer is None or buffer.nbytes() != storage.nbytes() or buffer.is_pinned() != device:
            buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device).untyped_storage()
            if i < len(self._buffers):
                self._buffers[i] = buffer
            else:
                self._buffers.append(buffer)
        if device:
            index = storage.device.index if storage.device.index is not None else torch.cuda.current_device()
            if index not in self._starts:
                self._starts[index] = _timing_event(index)
            self._sources.append(storage)  # a temporary's memory must not be reused before the copy has read it
        buffer.copy_(storage, non_blocking=device)
        return buffer

    def end(self) -> None:
        """After the tree's last storage: drop buffers a smaller state no longer uses, mark the queued copies."""
        del self._buffers[self._used:]
        self._events = [(start, _timing_event(index)) for index, start in sorted(self._starts.items())]

    def ready(self) -> float:
        """Wait for the copies queued from a GPU to land in host memory (at once for host storages); the
        seconds the slowest GPU's copies took on the device (0.0 for none), which the training thread did not
        wait for but the steps queued behind them did."""
        device_s = 0.0
        for start, end in self._events:
            end.synchronize()
            device_s = max(device_s, start.elapsed_time(end) / 1e3)
        self._sources = []
        return device_s

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self._buffers)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.nbytes() for b in self._buffers if b.is_pinned())
