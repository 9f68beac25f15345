"""Flight-recorder dumps for tests: synthetic ones in torch's layout, and real ones from gloo ranks.

The synthetic layout copies what torch 2.13's FlightRecorder writes for an NCCL process group (the
keys and value types of a real dump, with `pg_config` keyed by PG name as ProcessGroupNCCL does);
tests also feed these to torch's own reader, so the layout is checked against torch, not only
against our parser.

Run as `python -m tests.fr_dumps RANK PORT OUT_DIR`: one of two gloo ranks on loopback. Both run
four collectives, dump to `OUT_DIR/healthy.<rank>.{pkl,json}`, then rank 0 enters an all_reduce
rank 1 never joins and both dump again to `$TORCH_FR_DUMP_TEMP_FILE<rank>` (gloo has no dump-on-
timeout, so the rank writes the bytes itself, as torch's DebugInfoWriter does: in place).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

BASE_NS = 1_700_000_000 * 10**9
STEP_NS = 10**6


def entry(
    seq: int,
    state: str = "completed",
    *,
    op: str = "nccl:all_reduce",
    pg: tuple[str, str] = ("0", "default_pg"),
    pg_id: int = 0,
    record_id: int | None = None,
    created_ns: int | None = None,
    retired: bool | None = None,
) -> dict[str, Any]:
    """One entry as torch records it for an NCCL collective with TORCH_NCCL_ENABLE_TIMING=1."""
    created = BASE_NS + seq * STEP_NS if created_ns is None else created_ns
    return {
        "record_id": seq - 1 if record_id is None else record_id,
        "pg_id": pg_id,
        "process_group": pg,
        "thread_name": "pt_main_thread",
        "thread_id": "140000000000000",
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": op,
        "time_created_ns": created,
        "duration_ms": 0.5 if state == "completed" else None,
        "input_sizes": [[1024]],
        "input_dtypes": ["Float"],
        "output_sizes": [[1024]],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": created + 1000 if state != "scheduled" else None,
        "time_discovered_completed_ns": created + 2000 if state == "completed" else None,
        "retired": state == "completed" if retired is None else retired,
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 3245}],
    }


def dump(entries: list[dict[str, Any]], *, world: int = 2) -> dict[str, Any]:
    """A whole dump around `entries`, with pg_status counters consistent with them."""
    status: dict[str, dict[str, int]] = {}
    config: dict[str, dict[str, str]] = {}
    for e in entries:
        name, desc = e["process_group"]
        config[name] = {"name": name, "desc": desc, "ranks": str(list(range(world)))}
        s = status.setdefault(
            str(e["pg_id"]),
            {"last_enqueued_collective": -1, "last_started_collective": -1, "last_completed_collective": -1},
        )
        seq = e["collective_seq_id"]
        s["last_enqueued_collective"] = max(s["last_enqueued_collective"], seq)
        if e["state"] != "scheduled":
            s["last_started_collective"] = max(s["last_started_collective"], seq)
        if e["state"] == "completed":
            s["last_completed_collective"] = max(s["last_completed_collective"], seq)
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5",
        "pg_config": config,
        "pg_status": status,
        "entries": entries,
        "nccl_comm_state": {},
    }


def healthy(n: int = 4) -> dict[str, Any]:
    return dump([entry(seq) for seq in range(1, n + 1)])


def hung(rank: int, stuck_seq: int = 5, laggard: int = 1) -> dict[str, Any]:
    """Every rank but `laggard` started `stuck_seq` and waits in it; `laggard` stopped before it."""
    done = [entry(seq) for seq in range(1, stuck_seq)]
    return dump(done if rank == laggard else [*done, entry(stuck_seq, "started")])


def write(prefix: Path, rank: int, data: dict[str, Any] | bytes) -> Path:
    """Write a dump the way torch does: `<prefix><rank>`, pickle protocol 2 (torch's C++ pickler)."""
    path = Path(f"{prefix}{rank}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else pickle.dumps(data, protocol=2))
    return path


def _rank_main(rank: int, port: int, out: Path) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    (out / f"healthy.{rank}.pkl").write_bytes(_dump_fr_trace())
    (out / f"healthy.{rank}.json").write_bytes(_dump_fr_trace_json())
    if rank == 0:
        dist.all_reduce(t, async_op=True)  # rank 1 never joins: the hang a dump must explain
    hung_path = write(Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"]), rank, _dump_fr_trace())
    if rank == 1:  # stay until rank 0 has dumped, so its pending collective is still pending in the dump
        rank0 = hung_path.with_name(hung_path.name[:-1] + "0")
        deadline = time.monotonic() + 30
        while not rank0.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)  # skip destroy_process_group: rank 0 has a collective that will never finish


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
