"""trainlib.checkpoint: atomic durable shards, the all-ranks commit, generation fencing, recovery after kill -9."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from tests.ckpt_victim import DCP_SHAPE, DCP_STEP, make_state
from trainlib.checkpoint import (
    Checkpointer,
    CheckpointError,
    CommitTimeout,
    StaleGenerationError,
    snapshot_to_cpu,
)

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

VICTIM = Path(__file__).with_name("ckpt_victim.py")
REPO = Path(__file__).resolve().parent.parent


def assert_same(a: object, b: object) -> None:
    """Equal trees; tensors equal in dtype, shape and every element."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def ck(root: Path, rank: int = 0, world_size: int = 1, generation: int = 1, **kw) -> Checkpointer:
    return Checkpointer(root, rank=rank, world_size=world_size, generation=generation, **kw)


def shard(root: Path, step: int, rank: int = 0) -> Path:
    return root / f"step-{step:09d}" / f"rank-{rank:05d}.pt"


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


# ---- saving and loading -----------------------------------------------------------------------------


def test_round_trip(tmp_path):
    state = {"model": OrderedDict(w=torch.randn(3, 4), b=torch.arange(5, dtype=torch.int32)),
             "half": torch.ones(7, dtype=torch.bfloat16), "step": 12, "name": "run-a", "lrs": [0.1, 0.01]}
    c = ck(tmp_path, generation=4)
    c.claim_generation()
    result = c.save(state, 12)
    assert (result.step, result.committed, result.generation) == (12, True, 4)
    assert result.bytes_written == shard(tmp_path, 12).stat().st_size
    loaded = c.load_latest()
    assert (loaded.step, loaded.generation) == (12, 4)
    assert_same(loaded.state, state)
    assert c.latest_step() == 12
    manifest = json.loads((tmp_path / "step-000000012" / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 1 and manifest["generation"] == 4
    assert manifest["ranks"]["0"]["files"]["rank-00000.pt"]["size"] == result.bytes_written


def test_nothing_saved_yet(tmp_path):
    c = ck(tmp_path / "absent")
    assert c.load_latest() is None
    assert c.latest_step() is None


def test_keep_last_n_prunes_older_and_torn_steps_only(tmp_path):
    c = ck(tmp_path, keep=2)
    for step in (1, 2, 3):
        c.save({"s": step}, step)
    torn = tmp_path / "step-000000004"
    torn.mkdir()
    (torn / ".rank-00000.pt.tmp.999.abcd").write_bytes(b"half a shard")
    ahead = tmp_path / "step-000000009"  # a step beyond the one committing may be in flight elsewhere
    ahead.mkdir()
    (ahead / "rank-00000.pt").write_bytes(b"in flight")
    leftover = tmp_path / "step-000000005" / ".rank-00000.pt.tmp.998.beef"
    leftover.parent.mkdir()
    leftover.write_bytes(b"from a killed writer")
    c.save({"s": 5}, 5)
    assert step_dirs(tmp_path) == ["step-000000003", "step-000000005", "step-000000009"]
    assert not leftover.exists()
    assert c.load_latest().state == {"s": 5}


def test_keep_one_keeps_the_newest(tmp_path):
    c = ck(tmp_path, keep=1)
    for step in (1, 2):
        c.save({"s": step}, step)
    assert step_dirs(tmp_path) == ["step-000000002"]
    assert c.load_latest().step == 2


def test_partial_steps_are_ignored(tmp_path):
    rank0, rank1 = ck(tmp_path, 0, 2), ck(tmp_path, 1, 2)
    rank1.save({"r": 1, "s": 1}, 1)
    rank0.save({"r": 0, "s": 1}, 1)
    rank1.save({"r": 1, "s": 2}, 2)  # rank 0 never saves step 2: no manifest
    (tmp_path / "step-000000002" / ".rank-00000.pt.tmp.1.dead").write_bytes(b"torn")
    (tmp_path / "step-000000003").mkdir()
    (tmp_path / "step-000000003" / ".MANIFEST.json.tmp.1.dead").write_bytes(b'{"step": 3')
    for c, rank in ((rank0, 0), (rank1, 1)):
        loaded = c.load_latest()
        assert (loaded.step, loaded.state) == (1, {"r": rank, "s": 1})
        assert c.latest_step() == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_shard_falls_back_to_previous_step(tmp_path, damage):
    c = ck(tmp_path)
    c.save(make_state(1), 1)
    c.save(make_state(2), 2)
    path = shard(tmp_path, 2)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        middle = len(data) // 2
        data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    else:
        del data[-100:]
    path.write_bytes(bytes(data))
    loaded = c.load_latest()
    assert loaded.step == 1
    assert_same(loaded.state, make_state(1))


def test_one_ranks_corrupt_shard_makes_every_rank_resume_from_the_same_earlier_step(tmp_path):
    """Issue 39's finding: rank 1's shard of step 2 is corrupt; rank 1 fell back to step 1 while rank 0 loaded step
    2, and the job trained on from two different states. With a process group the ranks agree on the step."""
    ranks = [ck(tmp_path, rank=rank, world_size=2) for rank in (0, 1)]
    for step in (1, 2):
        for rank in (1, 0):  # rank 0 commits the step once rank 1's shard is there
            ranks[rank].save({"rank": rank, "step": step}, step)
    assert ranks[0].latest_step() == 2
    path = shard(tmp_path, 2, rank=1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    script = f"""
import sys, torch.distributed as dist
from trainlib.checkpoint import Checkpointer
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=rank, world_size=2)
print(Checkpointer({str(tmp_path)!r}, rank=rank, world_size=2, generation=2).load_latest().state["step"])
dist.destroy_process_group()
"""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=REPO) for r in range(2)]
    try:
        steps = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            steps.append(int(out.split()[-1]))
    finally:
        for p in procs:
            p.kill()
    assert steps == [1, 1]


def _remark_with_sha256(step_dir: Path, wrong: bool = False) -> None:
    """Rewrite a step's markers and manifest the way trainlib before CRC-32 wrote them (sha256 per file)."""
    import hashlib

    def fix(node):
        if isinstance(node, dict):
            if "crc32" in node:
                del node["crc32"]
                return True
            for key, value in list(node.items()):
                if fix(value) and key != "ranks":
                    digest = hashlib.sha256((step_dir / key).read_bytes()).hexdigest()
                    value["sha256"] = "0" * 64 if wrong else digest
        return False

    for path in [*step_dir.glob("rank-*.done"), step_dir / "MANIFEST.json"]:
        obj = json.loads(path.read_text())
        fix(obj)
        assert "crc32" not in json.dumps(obj)
        path.write_text(json.dumps(obj))


def test_checkpoints_marked_with_sha256_by_earlier_versions_still_verify(tmp_path):
    c = ck(tmp_path)
    c.save(make_state(1), 1)
    c.save(make_state(2), 2)
    assert '"crc32"' in (tmp_path / "step-000000002" / "MANIFEST.json").read_text()
    _remark_with_sha256(tmp_path / "step-000000002")
    loaded = c.load_latest()
    assert loaded.step == 2
    assert_same(loaded.state, make_state(2))
    _remark_with_sha256(tmp_path / "step-000000001", wrong=True)
    shard(tmp_path, 2).write_bytes(b"garbage")  # step 2 now fails its size check; step 1 its sha256
    assert c.load_latest() is None


def test_saving_a_committed_step_again_replaces_it(tmp_path):
    c = ck(tmp_path, generation=2)  # e.g. a standalone run restarted after falling back past step 3
    c.save({"a": 1}, 3)
    c.save({"a": 2}, 3)
    assert c.load_latest().state == {"a": 2}


def test_newer_generation_rewrites_a_step_an_older_one_committed(tmp_path):
    ck(tmp_path, generation=1).save({"g": 1}, 3)
    newer = ck(tmp_path, generation=2)
    newer.claim_generation()
    newer.save({"g": 2}, 3)
    loaded = newer.load_latest()
    assert (loaded.step, loaded.generation, loaded.state) == (3, 2, {"g": 2})


def test_load_refuses_a_different_world_size(tmp_path):
    ck(tmp_path, 1, 2).save({"r": 1}, 1)
    ck(tmp_path, 0, 2).save({"r": 0}, 1)
    with pytest.raises(CheckpointError) as e:
        ck(tmp_path, 0, 1).load_latest()
    assert str(e.value) == "step 1 was saved by 2 ranks, this job has 1; use save_sharded/load_sharded to reshard"


@pytest.mark.parametrize("bad, message", [
    (dict(world_size=0), "world_size (0) must be at least 1"),
    (dict(rank=2, world_size=2), "rank (2) must be in [0, world_size=2)"),
    (dict(keep=0), "keep (0) must be at least 1: the newest committed step is never deleted"),
    (dict(commit_timeout_s=0), "commit_timeout_s (0) must be positive"),
])
def test_bad_config_is_refused(tmp_path, bad, message):
    kw = dict(rank=0, world_size=1, generation=1) | bad
    with pytest.raises(ValueError) as e:
        Checkpointer(tmp_path, **kw)
    assert str(e.value) == message


# ---- the all-ranks commit ---------------------------------------------------------------------------


def test_manifest_waits_for_every_rank(tmp_path):
    rank0, rank1 = ck(tmp_path, 0, 2), ck(tmp_path, 1, 2)
    results = []
    t = threading.Thread(target=lambda: results.append(rank0.save({"r": 0}, 1)))
    t.start()
    marker = tmp_path / "step-000000001" / "rank-00000.done"
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert marker.exists()
    assert t.is_alive() and not (tmp_path / "step-000000001" / "MANIFEST.json").exists()
    assert rank0.load_latest() is None
    assert rank1.save({"r": 1}, 1).committed is False
    t.join(30)
    assert results[0].committed
    assert rank0.load_latest().state == {"r": 0}
    assert rank1.load_latest().state == {"r": 1}


def test_commit_times_out_when_a_rank_never_writes(tmp_path):
    rank0 = ck(tmp_path, 0, 2, commit_timeout_s=0.2)
    with pytest.raises(CommitTimeout) as e:
        rank0.save({"r": 0}, 1)
    assert str(e.value) == (f"step 1 not committed: waited 0.2s in {tmp_path / 'step-000000001'} for every rank's "
                            "marker (rank-NNNNN.done, written once its shard is durable); none vouches for this "
                            "step and generation from rank(s) 1 (no marker) of 2")
    assert rank0.latest_step() is None


def test_barrier_replaces_polling(tmp_path):
    calls = []
    rank1 = ck(tmp_path, 1, 2)

    def barrier():  # stands in for torch.distributed.barrier: rank 1 reaches it too
        calls.append("barrier")
        rank1.save({"r": 1}, 1)

    assert ck(tmp_path, 0, 2, barrier=barrier).save({"r": 0}, 1).committed
    assert calls == ["barrier"]


# ---- generation fencing -----------------------------------------------------------------------------


def test_stale_generation_cannot_write(tmp_path):
    ck(tmp_path, generation=2).claim_generation()
    with pytest.raises(StaleGenerationError) as e:
        ck(tmp_path, generation=1).save({"a": 1}, 5)
    assert str(e.value) == (f"generation 1 is stale: {tmp_path}/GENERATION holds generation 2; "
                            "refusing to write step 5")
    assert not (tmp_path / "step-000000005").exists()


def test_stale_generation_cannot_commit_after_a_claim_mid_save(tmp_path):
    old1 = ck(tmp_path, 1, 2, generation=1)

    def barrier():  # both old ranks have durable shards; then the new generation starts
        old1.save({"r": 1}, 1)
        ck(tmp_path, 0, 2, generation=2).claim_generation()

    with pytest.raises(StaleGenerationError) as e:
        ck(tmp_path, 0, 2, generation=1, barrier=barrier).save({"r": 0}, 1)
    assert str(e.value) == (f"generation 1 is stale: {tmp_path}/GENERATION holds generation 2; "
                            "refusing to commit step 1")
    assert not (tmp_path / "step-000000001" / "MANIFEST.json").exists()
    assert ck(tmp_path, 0, 2, generation=2).load_latest() is None


def test_older_generation_never_overwrites_a_manifest(tmp_path):
    ck(tmp_path, generation=3).save({"g": 3}, 4)  # no claim: only the manifest says generation 3
    with pytest.raises(StaleGenerationError) as e:
        ck(tmp_path, generation=2).save({"g": 2}, 4)
    assert str(e.value) == (f"generation 2 is stale: {tmp_path}/GENERATION holds generation 3; "
                            "refusing to overwrite the manifest of step 4")
    assert ck(tmp_path).load_latest().state == {"g": 3}


def test_claim_generation_is_idempotent_and_monotonic(tmp_path):
    c = ck(tmp_path, generation=5)
    c.claim_generation()
    c.claim_generation()
    assert c.current_generation() == 5
    ck(tmp_path, generation=7).claim_generation()
    with pytest.raises(StaleGenerationError) as e:
        c.claim_generation()
    assert str(e.value) == (f"generation 5 is stale: {tmp_path}/GENERATION holds generation 7; "
                            "refusing to claim the checkpoint directory")
    assert c.current_generation() == 7


# ---- async ------------------------------------------------------------------------------------------


def test_async_writes_the_same_bytes_as_sync(tmp_path):
    base = torch.randn(64, 64)
    state = {"emb": base, "head": base, "rows": base[2:5], "int": torch.arange(10), "meta": {"step": 1}}
    ck(tmp_path / "sync").save(state, 1)
    expected = (tmp_path / "sync" / "step-000000001" / "rank-00000.pt").read_bytes()
    c = ck(tmp_path / "async")
    future = c.save_async(state, 1)
    base.add_(1.0)  # training goes on: the snapshot must not see this
    state["meta"]["step"] = 2
    assert future.result().committed
    assert c.wait().step == 1
    assert c.wait() is None
    assert (tmp_path / "async" / "step-000000001" / "rank-00000.pt").read_bytes() == expected
    loaded = c.load_latest().state
    assert loaded["head"].untyped_storage().data_ptr() == loaded["emb"].untyped_storage().data_ptr()


def test_async_error_surfaces_on_the_future_and_the_next_call(tmp_path):
    ck(tmp_path, generation=2).claim_generation()
    c = ck(tmp_path, generation=1)
    future = c.save_async({"a": 1}, 1)
    with pytest.raises(StaleGenerationError):
        future.result()
    with pytest.raises(StaleGenerationError):
        c.wait()
    assert c.wait() is None  # reported once


def test_async_saves_run_one_at_a_time(tmp_path):
    c = ck(tmp_path, keep=5)
    futures = [c.save_async({"s": torch.full((1000,), float(s))}, s) for s in (1, 2, 3)]
    assert all(f.done() for f in futures[:2])  # each call waited for the one before
    assert c.wait().step == 3
    assert c.latest_step() == 3


def test_snapshot_copies_to_private_memory():
    t = torch.randn(10)
    snap = snapshot_to_cpu({"a": t, "b": [t[1:3], (t,)], "n": 4})
    t.zero_()
    assert snap["a"].abs().sum() > 0
    assert snap["b"][1][0].untyped_storage().data_ptr() == snap["a"].untyped_storage().data_ptr()
    assert torch.equal(snap["b"][0], snap["a"][1:3])


# ---- kill -9 ----------------------------------------------------------------------------------------


class Lines:
    """The victim's stdout, line by line, with a timeout (a reader thread never blocks the test)."""

    def __init__(self, stream) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.q.put(line.rstrip("\n")) for line in stream], daemon=True).start()

    def until(self, prefix: str, timeout: float = 30.0) -> tuple[str, list[str]]:
        seen = []
        deadline = time.monotonic() + timeout
        while True:
            line = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line, seen
            seen.append(line)


def test_kill_9_at_random_moments_leaves_the_last_committed_step(tmp_path):
    """At least 50 SIGKILLs land mid-save; after each, load_latest returns exactly a step the victim saved."""
    root = tmp_path / "ckpt"
    rng = random.Random(20240917)
    with open(tmp_path / "victim.err", "w") as err:
        proc = subprocess.Popen([sys.executable, str(VICTIM), "serve", str(root)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, start_new_session=True)
    lines = Lines(proc.stdout)
    reader = ck(root, generation=0)
    last_end, mid_save, trials, torn, after_commit = 0, 0, 0, 0, 0
    try:
        while mid_save < 60 and trials < 200:
            trials += 1
            proc.stdin.write("go\n")
            proc.stdin.flush()
            child, _ = lines.until("child ", timeout=60)
            pid = int(child.split()[1])
            time.sleep(rng.uniform(0.01, 0.12))
            os.kill(pid, signal.SIGKILL)
            dead, seen = lines.until(f"dead {pid} ")
            status = int(dead.split()[2])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (seen, status)
            ended = [int(x.split()[1]) for x in seen if x.startswith("end ")]
            last_end = max([last_end, *ended])
            in_save = bool(seen) and seen[-1].startswith("begin ")
            mid_save += in_save
            if in_save:
                torn += any(".tmp." in p.name for p in (root / f"step-{int(seen[-1].split()[1]):09d}").glob(".*"))
            loaded = reader.load_latest()
            if last_end == 0 and loaded is None:  # nothing committed yet
                continue
            # the step last seen ended, or the one being saved if the kill came between its commit and its `end`
            # line (it is then the step the next child resumes after, `end` line or not: last_end follows it)
            allowed = {last_end, int(seen[-1].split()[1])} if in_save else {last_end}
            assert loaded is not None and loaded.step in allowed, (loaded and loaded.step, allowed, seen[-3:])
            after_commit += loaded.step != last_end
            last_end = loaded.step
            assert_same(loaded.state, make_state(loaded.step))
    finally:
        proc.kill()
        proc.wait(10)
    print(f"kill -9: {trials} kills, {mid_save} mid-save ({torn} with a torn temp file in the step being saved, "
          f"{after_commit} after the commit), last step {last_end}")
    assert mid_save >= 50, f"only {mid_save} of {trials} kills landed mid-save"


# ---- sharded (DCP) ----------------------------------------------------------------------------------


def test_sharded_single_rank_without_a_process_group(tmp_path):
    c = ck(tmp_path)
    state = {"w": torch.randn(8, 4), "inner": {"b": torch.arange(3)}, "epoch": 2}
    result = c.save_sharded(state, 5)
    assert result.committed and result.bytes_written > 0
    target = {"w": torch.zeros(8, 4), "inner": {"b": torch.zeros(3, dtype=torch.int64)}, "epoch": 0}
    loaded = c.load_sharded(target)
    assert loaded.step == 5 and loaded.state is target
    assert_same(target, state)
    assert c.latest_step() == 5
    assert c.load_latest() is None  # a torch.save-format load does not read DCP steps


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharded_two_ranks_over_gloo_then_reshard_to_one(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(VICTIM), "dcp", str(tmp_path), str(r), "2", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    assert [(o["committed"], o["step"], o["equal"], o["epoch"], o["local_rows"]) for o in outs] == [
        (True, DCP_STEP, True, 3, DCP_SHAPE[0] // 2), (False, DCP_STEP, True, 3, DCP_SHAPE[0] // 2)]
    manifest = json.loads((tmp_path / f"step-{DCP_STEP:09d}" / "MANIFEST.json").read_text())
    assert manifest["format"] == "dcp" and sorted(manifest["ranks"]) == ["0", "1"]
    assert all(entry["files"] for entry in manifest["ranks"].values())

    alone = ck(tmp_path, generation=2)  # a restart on one rank: DCP reshards the two shards into one tensor
    target = {"w": torch.zeros(DCP_SHAPE), "epoch": 0}
    assert alone.load_sharded(target).step == DCP_STEP
    assert torch.equal(target["w"], torch.arange(DCP_SHAPE[0] * DCP_SHAPE[1], dtype=torch.float32).reshape(DCP_SHAPE))

    other = tmp_path / f"step-{DCP_STEP:09d}" / next(iter(manifest["ranks"]["1"]["files"]))
    data = bytearray(other.read_bytes())
    data[len(data) // 2] ^= 0xFF
    other.write_bytes(bytes(data))
    assert alone.load_sharded({"w": torch.zeros(DCP_SHAPE)}) is None  # rank 1's shard is read, so it is checked
    with pytest.raises(CheckpointError) as e:
        alone.load_sharded({"w": torch.zeros(DCP_SHAPE)}, step=DCP_STEP)
    relative = other.relative_to(other.parents[1])
    assert str(e.value) == f"step {DCP_STEP} cannot be loaded: {relative} does not match its crc32"
