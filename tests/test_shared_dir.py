"""A checkpoint directory the job's nodes do not share is found at rank 0's first save, said plainly, and
reported to Phalanx as fatal (no restart can mend it). Two "nodes" here are two directories."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fake_agent import serving
from trainlib import shared_dir
from trainlib._runtime import FATAL_EXIT_CODE

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


class VirtualTime:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def two_nodes(tmp_path: Path, generation: int = 4) -> tuple[Path, Path]:
    """Ranks 0, 1 on node-a and 2, 3 on node-b, each node with a checkpoint directory of its own."""
    a, b = tmp_path / "node-a" / "ckpt", tmp_path / "node-b" / "ckpt"
    for rank in range(4):
        shared_dir.announce(a if rank < 2 else b, generation, rank, "node-a" if rank < 2 else "node-b")
    return a, b


def unshared(root: Path, waited: str = "30") -> str:
    return (f"checkpoint directory {root} is not shared between the job's nodes: rank 0 on node-a sees no marker "
            f"from ranks 2, 3 (the job's node 2 of 2) after {waited}s (it sees ranks 0, 1 on node-a); those ranks "
            "write their checkpoints into a directory rank 0 cannot see, so no checkpoint can ever be committed. "
            "Give the job a directory every node mounts: phalanx submit --checkpoint-dir DIR")


def test_rank_0_finds_ranks_whose_markers_it_cannot_see(tmp_path):
    a, _ = two_nodes(tmp_path)
    time = VirtualTime()
    problem = shared_dir.check(a, 4, world_size=4, local_world_size=2, node="node-a", wait_s=30,
                               monotonic=time.monotonic, sleep=time.sleep)
    assert problem == unshared(a)
    assert time.now >= 30  # it waited the whole while: a shared filesystem may show another node's file late


def test_a_shared_directory_passes_and_forgets_older_generations(tmp_path):
    root = tmp_path / "shared"
    shared_dir.announce(root, 3, 0, "node-a")  # a previous generation's
    for rank in range(4):
        shared_dir.announce(root, 4, rank, "node-a" if rank < 2 else "node-b")
    time = VirtualTime()
    assert shared_dir.check(root, 4, world_size=4, local_world_size=2, node="node-a", wait_s=30,
                            monotonic=time.monotonic, sleep=time.sleep) == ""
    assert time.now == 0
    assert [p.name for p in (root / shared_dir.RANKS_DIR).iterdir()] == ["g000000004"]


def test_a_marker_that_shows_up_late_is_waited_for(tmp_path):
    root = tmp_path / "shared"
    shared_dir.announce(root, 1, 0, "node-a")
    time = VirtualTime()

    def sleep(seconds: float) -> None:
        time.sleep(seconds)
        if time.now > 5:
            shared_dir.announce(root, 1, 1, "node-b")

    assert shared_dir.check(root, 1, world_size=2, local_world_size=1, node="node-a", wait_s=30,
                            monotonic=time.monotonic, sleep=sleep) == ""


@pytest.fixture
def agent():
    with serving() as fake:
        yield fake


def test_rank_0_stops_at_its_first_save_and_tells_phalanx_why(agent, tmp_path):
    a, _ = two_nodes(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCH_NCCL_", "TORCH_FR_"))}
    env.update(PHALANX_JOB="job-2", PHALANX_GENERATION="4", PHALANX_NODE="node-a", RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", PHALANX_CHECKPOINT_DIR=str(a),
               PHALANX_AGENT_SOCKET=str(agent.socket), PHALANX_CHECKPOINT_SHARED_WAIT_S="0.5")
    code = """
        import trainlib
        trainlib.init()
        trainlib.step(0)
        trainlib.save({"w": 1}, 0)
        print("saved")
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.returncode == FATAL_EXIT_CODE, result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"trainlib: fatal: {unshared(a, '0.5')}"]
    assert [r.fatal for r in agent.reports if r.fatal] == [unshared(a, "0.5")]
    assert not list(a.glob("step-*"))  # no shard written where it could never be committed
