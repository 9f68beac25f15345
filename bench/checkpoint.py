"""Checkpoint write throughput against the disk's own: is trainlib's durability protocol nearly free?

A state of 256 MiB (quick: 64 MiB) of float32 tensors is saved with `Checkpointer.save` (temp file,
torch.save with a CRC-32 of the bytes on the side, fsync, rename, directory fsync, marker, manifest), and the same
number of bytes is written with `dd if=/dev/zero of=FILE bs=1M count=N conv=fsync` (a Python
write + fsync when dd is missing) and with plain `torch.save` + fsync (what the serializer alone
costs, without temp/rename/hash/markers), in the same directory, alternating, a few times each after one
discarded warm-up of each. Reported: median MB/s of both (MB = 10^6 bytes) and their ratio, goal
>= 90 %, the same for the best run of each (less sensitive to other load on the machine, which is
reported too), and how long `save_async` blocks the training loop (the CPU snapshot).

Both writers share the disk; the checkpoint also spends CPU on its checksum (CRC-32, about 4 GB/s on
one core, computed on a second thread from the page cache while serializing; sha256, which earlier
versions used, manages 1.4 GB/s and held the ratio near 65 % here). trainlib turns off torch.save's
per-record CRC32 (its own checksum covers every byte); the plain torch.save reference keeps torch's
default, CRC32 on.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.common import log, temp_root
from trainlib.checkpoint import Checkpointer

GOAL_RATIO = 0.90
TENSORS = 16


def _settle() -> None:
    """Flush everything (untimed) so no run pays for another's leftovers: with ext4's `discard` mount
    option, deleting a file makes the *next* fsync wait for the TRIM of its blocks."""
    os.sync()


def _raw_write(path: Path, mib: int) -> float:
    """Seconds to write `mib` MiB to `path` and fsync it, the way the disk would do it without us."""
    _settle()
    started = time.perf_counter()
    if shutil.which("dd"):
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fsync", "status=none"],
                       check=True)
    else:
        block = bytes(1 << 20)
        with open(path, "wb", buffering=0) as f:
            for _ in range(mib):
                f.write(block)
            os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def _torch_save(path: Path, state: dict) -> float:
    """Seconds for plain `torch.save` + fsync: the serializer's own cost, without our protocol."""
    _settle()
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return seconds


def run(quick: bool = False) -> dict:
    """Alternate raw and checkpoint writes; a plain JSON-able dict of the figures."""
    mib = 64 if quick else 256
    reps = 3 if quick else 5
    state = {f"layer{i}.weight": torch.randn(mib * (1 << 20) // TENSORS // 4) for i in range(TENSORS)}
    state["step"] = 0
    raw_s: list[float] = []
    plain_s: list[float] = []
    ckpt_s: list[float] = []
    ckpt_bytes = 0
    async_block_ms: list[float] = []
    with temp_root("phalanx-bench-ckpt-") as tmp:
        root = Path(tmp)
        log(f"checkpoint: {mib} MiB state ({TENSORS} tensors) in {root}; {reps} runs each after a warm-up, "
            f"raw writer {'dd conv=fsync' if shutil.which('dd') else 'python write+fsync'}")
        # Every writer deletes its file after its run, untimed, so all three write into the same kind of
        # free space (on a thin-provisioned virtual disk, fresh blocks can be several times slower than
        # reused ones); so the Checkpointer never prunes (large `keep`) and its steps go the same way.
        ck = Checkpointer(root / "ckpt", rank=0, world_size=1, generation=1, keep=1000)
        ck.claim_generation()
        step = 0
        for rep in range(reps + 1):
            raw = _raw_write(root / "raw.bin", mib)
            plain = _torch_save(root / "plain.pt", state)
            step += 1
            _settle()
            started = time.perf_counter()
            result = ck.save(state, step)
            seconds = time.perf_counter() - started
            shutil.rmtree(ck.step_dir(step))
            if rep == 0:
                continue  # warm-up: first touch of the files and the page cache
            raw_s.append(raw)
            plain_s.append(plain)
            ckpt_s.append(seconds)
            ckpt_bytes = result.bytes_written
            log(f"checkpoint: run {rep}: dd {mib * 2**20 / raw / 1e6:,.0f} MB/s, torch.save+fsync "
                f"{result.bytes_written / plain / 1e6:,.0f} MB/s, Checkpointer.save "
                f"{result.bytes_written / seconds / 1e6:,.0f} MB/s")
        for _ in range(2 if quick else 3):
            step += 1
            _settle()
            started = time.perf_counter()
            future = ck.save_async(state, step)
            async_block_ms.append((time.perf_counter() - started) * 1000)
            future.result()
            shutil.rmtree(ck.step_dir(step))
    size = mib * 2**20
    raw_mbps, raw_best = size / statistics.median(raw_s) / 1e6, size / min(raw_s) / 1e6
    ckpt_mbps, ckpt_best = ckpt_bytes / statistics.median(ckpt_s) / 1e6, ckpt_bytes / min(ckpt_s) / 1e6
    ratio, best_ratio = ckpt_mbps / raw_mbps, ckpt_best / raw_best
    plain_mbps = ckpt_bytes / statistics.median(plain_s) / 1e6
    load = os.getloadavg()[0]
    log(f"checkpoint: median dd {raw_mbps:,.0f} MB/s, save {ckpt_mbps:,.0f} MB/s, ratio {ratio:.0%} "
        f"(best runs: {raw_best:,.0f} vs {ckpt_best:,.0f} MB/s, {best_ratio:.0%}; goal >= {GOAL_RATIO:.0%}) "
        f"{'ok' if ratio >= GOAL_RATIO else 'MISSED'}; plain torch.save+fsync {plain_mbps:,.0f} MB/s "
        f"({plain_mbps / raw_mbps:.0%} of dd); save_async blocks {statistics.median(async_block_ms):.0f} ms; "
        f"load average {load:.1f} on {os.cpu_count()} CPUs")
    return {
        "quick": quick, "state_mib": mib, "runs": reps, "goal_ratio": GOAL_RATIO, "ok": ratio >= GOAL_RATIO,
        "raw_mbps": round(raw_mbps, 1), "checkpoint_mbps": round(ckpt_mbps, 1), "ratio": round(ratio, 3),
        "raw_best_mbps": round(raw_best, 1), "checkpoint_best_mbps": round(ckpt_best, 1),
        "best_ratio": round(best_ratio, 3), "torch_save_fsync_mbps": round(plain_mbps, 1),
        "save_async_block_ms": round(statistics.median(async_block_ms), 1), "load_average": round(load, 2),
        "raw_runs_s": [round(s, 4) for s in raw_s], "torch_save_runs_s": [round(s, 4) for s in plain_s],
        "checkpoint_runs_s": [round(s, 4) for s in ckpt_s],
    }

if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=1))
