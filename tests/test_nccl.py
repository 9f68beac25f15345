"""Flight-recorder dumps: placement, parsing (of hostile input too), the watcher and the culprit.

Synthetic dumps (tests/fr_dumps.py) are also fed to torch's own reader and analyzer, and where
torch is installed two real gloo ranks on loopback produce real dumps.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from agent.collectors import nccl
from agent.collectors.nccl import DumpParseError, FlightRecorderWatcher, culprit, parse_dump, rank_env
from phalanx.v1 import common_pb2
from tests import fr_dumps

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[1]
T0 = fr_dumps.BASE_NS + 10**9  # file mtimes in watcher tests: virtual time, set with os.utime
SETTLED = T0 + 2 * nccl.SETTLE_NS


def _pickle(d: dict[str, Any]) -> bytes:
    return pickle.dumps(d, protocol=2)


def _json(d: dict[str, Any]) -> bytes:
    """The JSON variant as torch's `_dump_fr_trace_json` writes it: tuples as lists, missing times as 0."""
    entries = [{k: (0 if v is None and k.startswith("time_") else v) for k, v in e.items()} for e in d["entries"]]
    return json.dumps({**d, "entries": entries}).encode()


def _place(state_dir: Path, job: str, rank: int, data: dict[str, Any] | bytes, mtime_ns: int = T0) -> Path:
    path = fr_dumps.write(nccl.dump_prefix(state_dir, job), rank, data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def _state(rank: int, started: int, *, job: str = "j", pg: str = "0", op: str = "nccl:all_reduce") -> Any:
    return common_pb2.NcclRankState(job=job, rank=rank, process_group=pg, last_started_seq=started, last_op=op)


# --- where dumps go ---------------------------------------------------------------------------


def test_rank_env_points_every_torch_name_at_the_job_directory(tmp_path: Path) -> None:
    env = rank_env(tmp_path, "train-7")
    prefix = str(tmp_path / "nccl" / "train-7" / "nccl_trace_rank_")
    assert env == {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix,
    }
    assert (tmp_path / "nccl" / "train-7").is_dir()


@pytest.mark.parametrize("job", ["", ".", "..", "a/b"])
def test_job_names_cannot_escape_the_state_directory(tmp_path: Path, job: str) -> None:
    with pytest.raises(ValueError, match="must be a single path component"):
        rank_env(tmp_path, job)


# --- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("encode", [_pickle, _json], ids=["pickle", "json"])
def test_healthy_dump_summarises_the_default_group(encode: Any) -> None:
    summary = parse_dump(encode(fr_dumps.healthy(4)))
    g = summary.default_group()
    assert summary.version == "2.10"
    assert g is not None
    assert (g.name, g.desc, g.entries) == ("0", "default_pg", 4)
    assert (g.last_started_seq, g.last_completed_seq) == (4, 4)
    assert (g.last_op, g.last_state) == ("nccl:all_reduce", "completed")


@pytest.mark.parametrize("encode", [_pickle, _json], ids=["pickle", "json"])
def test_hung_dump_shows_which_collective_each_rank_reached(encode: Any) -> None:
    waiting = parse_dump(encode(fr_dumps.hung(rank=0))).default_group()
    missing = parse_dump(encode(fr_dumps.hung(rank=1))).default_group()
    assert waiting is not None and missing is not None
    assert (waiting.last_started_seq, waiting.last_completed_seq, waiting.last_state) == (5, 4, "started")
    assert (missing.last_started_seq, missing.last_completed_seq, missing.last_state) == (4, 4, "completed")


def test_without_start_tracking_reaching_a_collective_counts_as_starting_it() -> None:
    # No TORCH_NCCL_ENABLE_TIMING (and gloo): entries go scheduled -> completed, never "started".
    entries = [fr_dumps.entry(s) for s in (1, 2)] + [fr_dumps.entry(3, "scheduled")]
    for e in entries:
        e["time_discovered_started_ns"] = None
    d = fr_dumps.dump(entries)
    d["pg_status"]["0"]["last_started_collective"] = -1
    g = parse_dump(_pickle(d)).default_group()
    assert g is not None
    assert (g.last_started_seq, g.last_completed_seq, g.last_state) == (3, 2, "scheduled")


def test_a_group_other_than_the_default_is_summarised_separately() -> None:
    d = fr_dumps.dump([*fr_dumps.healthy(2)["entries"], fr_dumps.entry(1, "started", pg=("1", "tp"), pg_id=1)])
    summary = parse_dump(_pickle(d))
    assert set(summary.groups) == {"0", "1"}
    assert summary.groups["1"].last_started_seq == 1
    assert summary.default_group() == summary.groups["0"]


def test_a_dump_without_entries_reports_the_default_group_at_zero() -> None:
    state = nccl.to_state(parse_dump(_pickle(fr_dumps.dump([]))), job="j", rank=3, path=Path("p"), dump_time_ns=1)
    assert (state.process_group, state.last_started_seq, state.last_op) == ("0", 0, "")


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch exploited",))


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_a_pickle_that_calls_code_is_refused_before_running_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, protocol: int
) -> None:
    monkeypatch.chdir(tmp_path)
    data = pickle.dumps({"version": "2.10", "entries": [], "x": _Exploit()}, protocol=protocol)
    with pytest.raises(DumpParseError, match=r"refused global (posix|os)\.system"):
        parse_dump(data)
    assert not (tmp_path / "exploited").exists()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a flight-recorder dump"),
        (b"\x00garbage\xff" * 50, "not a flight-recorder dump"),
        (_pickle(fr_dumps.healthy())[:-40], "not a flight-recorder dump"),
        (b'{"version": "2.10", "entries": [', "not a flight-recorder dump (JSONDecodeError"),
        (_pickle([1, 2, 3]), "top level is list, not dict"),
        (_pickle({"entries": []}), "dump has no 'version'"),
        (_pickle({"version": "2.10", "entries": {}}), "dump: 'entries' is dict"),
        (_pickle({"version": "2.10", "entries": [7]}), "entry 0 is int, not dict"),
    ],
    ids=["empty", "garbage", "truncated", "truncated-json", "list", "no-version", "entries-dict", "entry-int"],
)
def test_unreadable_input_is_a_one_line_parse_error(data: bytes, message: str) -> None:
    with pytest.raises(DumpParseError) as info:
        parse_dump(data)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("collective_seq_id", "5", "entry 2: 'collective_seq_id' is str"),
        ("collective_seq_id", True, "entry 2: 'collective_seq_id' is bool"),
        ("collective_seq_id", 2**64, "entry 2: 'collective_seq_id' is out of range"),
        ("time_created_ns", -1, "entry 2: 'time_created_ns' is out of range"),
        ("state", "exploded", "entry 2: unknown state 'exploded'"),
        ("process_group", ("0",), "entry 2: 'process_group' is not a (name, desc) pair"),
    ],
)
def test_a_malformed_entry_names_the_entry_and_field(field: str, value: Any, message: str) -> None:
    d = fr_dumps.healthy(3)
    d["entries"][2][field] = value
    with pytest.raises(DumpParseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_dump(_pickle(d))


def test_odd_optional_fields_do_not_break_the_summary() -> None:
    d = fr_dumps.healthy(3)
    d["entries"][1]["record_id"] = "x"
    d["entries"][2]["is_p2p"] = None
    d["pg_status"] = {"0": {"last_completed_collective": 2**70, "last_started_collective": "7"}, "bad": 3}
    g = parse_dump(_pickle(d)).default_group()
    assert g is not None
    assert (g.last_started_seq, g.last_completed_seq) == (3, 3)


def test_oversized_dumps_are_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl, "MAX_DUMP_BYTES", 1000)
    path = fr_dumps.write(tmp_path / "nccl_trace_rank_", 0, b"\x80" * 1001)
    with pytest.raises(DumpParseError, match="1001 bytes is over the 1000-byte limit"):
        nccl.read_dump(path)
    with pytest.raises(DumpParseError, match="1001 bytes is over the 1000-byte limit"):
        parse_dump(b"\x80" * 1001)


_VALID = _pickle(fr_dumps.hung(rank=0))


@settings(max_examples=300, deadline=None)
@given(cut=st.integers(0, len(_VALID)), flip=st.integers(0, len(_VALID) - 1), byte=st.integers(0, 255))
def test_damaged_dumps_never_raise_anything_but_a_parse_error(cut: int, flip: int, byte: int) -> None:
    damaged = bytearray(_VALID)
    damaged[flip] = byte
    for data in (_VALID[:cut], bytes(damaged)):
        try:
            parse_dump(data)
        except DumpParseError as e:
            assert "\n" not in str(e)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_raise_anything_but_a_parse_error(data: bytes) -> None:
    try:
        parse_dump(data)
    except DumpParseError:
        pass


# --- the format against torch's own reader -----------------------------------------------------


def test_synthetic_dumps_are_read_by_torch_and_torch_blames_the_same_rank(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.flight_recorder.components.builder")
    from torch.distributed.flight_recorder.components.builder import build_db
    from torch.distributed.flight_recorder.components.config_manager import JobConfig
    from torch.distributed.flight_recorder.components.loader import read_dir, read_dump

    paths = [_place(tmp_path, "hung", r, fr_dumps.hung(rank=r)) for r in (0, 1)]
    for r, path in enumerate(paths):
        assert read_dump("nccl_trace_rank_", str(path))["rank"] == r
    args = JobConfig().parse_args([str(paths[0].parent)])
    details, version = read_dir(args)
    db = build_db(details, args, version)
    torch_missing = [c.missing_ranks for c in db.collectives if c.missing_ranks]

    states = FlightRecorderWatcher(tmp_path).scan(SETTLED)
    found = culprit(states)
    assert found is not None
    assert torch_missing == [{found[0]}] == [{1}]


# --- the watcher ------------------------------------------------------------------------------


def test_watcher_reports_one_state_per_rank_from_the_files(tmp_path: Path) -> None:
    p0 = _place(tmp_path, "jobA", 0, fr_dumps.hung(rank=0), mtime_ns=T0)
    _place(tmp_path, "jobA", 1, fr_dumps.hung(rank=1), mtime_ns=T0)
    s0, s1 = FlightRecorderWatcher(tmp_path).scan(SETTLED)
    assert (s0.job, s0.rank, s0.process_group, s0.dump_path, s0.dump_time_unix_ns) == ("jobA", 0, "0", str(p0), T0)
    assert (s0.last_started_seq, s0.last_completed_seq, s0.last_op, s0.last_state) == (
        5,
        4,
        "nccl:all_reduce",
        "started",
    )
    created = fr_dumps.BASE_NS + 5 * fr_dumps.STEP_NS
    assert s0.last_age_s == pytest.approx((T0 - created) / 1e9)
    assert (s1.rank, s1.last_started_seq, s1.last_state) == (1, 4, "completed")


def test_watcher_parses_only_files_whose_mtime_or_size_changed(tmp_path: Path) -> None:
    _place(tmp_path, "j", 0, fr_dumps.healthy(4))
    p1 = _place(tmp_path, "j", 1, fr_dumps.healthy(4))
    w = FlightRecorderWatcher(tmp_path)
    w.scan(SETTLED)
    w.scan(SETTLED + 10**9)
    assert w.parses == 2
    _place(tmp_path, "j", 1, fr_dumps.healthy(6), mtime_ns=T0 + 5 * 10**9)
    states = w.scan(T0 + 10 * 10**9)
    assert w.parses == 3
    assert [s.last_started_seq for s in states] == [4, 6]
    p1.unlink()
    assert [s.rank for s in w.scan(T0 + 11 * 10**9)] == [0]


def test_watcher_waits_for_a_fresh_file_to_settle(tmp_path: Path) -> None:
    _place(tmp_path, "j", 0, fr_dumps.healthy(), mtime_ns=T0)
    w = FlightRecorderWatcher(tmp_path)
    assert w.scan(T0 + 1) == []  # torch may still be writing it
    assert [s.rank for s in w.scan(SETTLED)] == [0]


def test_watcher_ignores_pipes_temp_files_and_other_names(tmp_path: Path) -> None:
    rank_env(tmp_path, "j")
    job_dir = tmp_path / "nccl" / "j"
    os.mkfifo(job_dir / "nccl_trace_rank_0.pipe")  # opening it would block the scan
    for name in ("nccl_trace_rank_0.tmp", "nccl_trace_rank_", "other_3", ".nccl_trace_rank_1"):
        (job_dir / name).write_bytes(_pickle(fr_dumps.healthy()))
        os.utime(job_dir / name, ns=(T0, T0))
    w = FlightRecorderWatcher(tmp_path)
    assert w.scan(SETTLED) == []
    assert w.parses == 0
    assert FlightRecorderWatcher(tmp_path / "absent").scan(SETTLED) == []


def test_a_bad_file_is_reported_once_and_the_last_good_state_kept(tmp_path: Path) -> None:
    _place(tmp_path, "j", 0, fr_dumps.healthy(4), mtime_ns=T0)
    w = FlightRecorderWatcher(tmp_path)
    assert [s.last_started_seq for s in w.scan(SETTLED)] == [4]
    _place(tmp_path, "j", 0, b"\x80\x02}(garbage", mtime_ns=T0 + 10**9)
    with capture_logs() as logs:
        for i in range(3):
            states = w.scan(SETTLED + (2 + i) * 10**9)
    bad = [e for e in logs if e["event"] == "nccl_dump_unreadable"]
    assert len(bad) == 1
    assert (bad[0]["job"], bad[0]["rank"], bad[0]["log_level"]) == ("j", 0, "warning")
    assert [s.last_started_seq for s in states] == [4]


def test_returned_states_are_copies(tmp_path: Path) -> None:
    _place(tmp_path, "j", 0, fr_dumps.healthy(4))
    w = FlightRecorderWatcher(tmp_path)
    w.scan(SETTLED)[0].last_started_seq = 99
    assert w.scan(SETTLED)[0].last_started_seq == 4


# --- the culprit ------------------------------------------------------------------------------


def test_no_culprit_when_the_ranks_agree() -> None:
    assert culprit([_state(0, 7), _state(1, 7), _state(2, 7)]) is None
    assert culprit([_state(0, 7)]) is None
    assert culprit([]) is None


def test_the_rank_furthest_behind_is_the_culprit() -> None:
    found = culprit([_state(0, 9), _state(1, 9), _state(2, 8), _state(3, 7)])
    assert found == (
        3,
        "rank 3 is behind in process group '0' of job 'j': its last started collective is #7, "
        "while rank(s) 0, 1 started #9 (nccl:all_reduce) and wait for it",
    )


def test_a_rank_that_never_started_anything_is_the_culprit_and_ties_are_named() -> None:
    found = culprit([_state(0, 3), _state(1, 0), _state(2, 0)])
    assert found is not None
    assert found[0] == 1
    assert "last started collective is #0" in found[1]
    assert found[1].endswith("(rank(s) 2 are as far behind)")


def test_ranks_are_compared_only_within_one_job_and_group() -> None:
    assert culprit([_state(0, 5, job="a"), _state(1, 2, job="b")]) is None
    assert culprit([_state(0, 5, pg="0"), _state(0, 2, pg="1")]) is None


# --- real torch -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_gloo_ranks_dumps_are_read_and_the_hung_rank_found(tmp_path: Path) -> None:
    torch_c10d = pytest.importorskip("torch._C._distributed_c10d")
    if not hasattr(torch_c10d, "_dump_fr_trace"):
        pytest.skip("this torch has no flight recorder for gloo")
    from torch.distributed.flight_recorder.components.loader import read_dump

    state_dir, out = tmp_path / "state", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, **rank_env(state_dir, "hung"), "TORCH_FR_BUFFER_SIZE": "64", "PYTHONWARNINGS": "ignore"}
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.fr_dumps", str(r), str(port), str(out)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=60)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs

    # Healthy: 3 all_reduce and a barrier on both ranks, pickle and JSON alike.
    healthy = []
    for r in (0, 1):
        for suffix in ("pkl", "json"):
            g = parse_dump((out / f"healthy.{r}.{suffix}").read_bytes()).default_group()
            assert g is not None
            assert (g.name, g.last_started_seq, g.last_op) == ("0", 4, "gloo:barrier")
        healthy.append(_state(r, g.last_started_seq))
    assert culprit(healthy) is None

    # Hung: rank 0 entered all_reduce #5, rank 1 never did.
    states = FlightRecorderWatcher(state_dir).scan(os.stat(out).st_mtime_ns + 10 * nccl.SETTLE_NS)
    assert [(s.job, s.rank, s.last_started_seq) for s in states] == [("hung", 0, 5), ("hung", 1, 4)]
    assert states[0].last_op == "gloo:all_reduce"
    for s in states:
        assert s.dump_time_unix_ns == os.stat(s.dump_path).st_mtime_ns
        assert 0 <= s.last_age_s < 60
        assert read_dump("nccl_trace_rank_", s.dump_path)["rank"] == s.rank  # torch reads the same file
    found = culprit(states)
    assert found is not None and found[0] == 1, found
