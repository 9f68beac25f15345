import os
import sys
import threading
import time

import pytest

from tests.cluster import Cluster


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run only when asked for: `-m slow` (or any -m naming it), or PHALANX_SLOW=1."""
    if os.environ.get("PHALANX_SLOW") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


EXIT_HANG_S = 60.0


def pytest_sessionfinish(session, exitstatus):
    """A gRPC aio server or channel a failed test left behind can hang the interpreter's exit for good (seen on
    CI: the suite's summary printed, then nothing until the job's time ran out). Past EXIT_HANG_S the process
    says so and exits with the suite's own status, so a hang costs a minute, not the CI run."""
    status = int(exitstatus)

    def watchdog() -> None:
        time.sleep(EXIT_HANG_S)
        sys.stderr.write(f"conftest: the test process did not exit within {EXIT_HANG_S:.0f} s of the suite's end "
                         f"(something a test left running); exiting with the suite's status {status}\n")
        sys.stderr.flush()
        os._exit(status)

    threading.Thread(target=watchdog, name="exit-watchdog", daemon=True).start()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """One real etcd member on loopback for the whole session (tests keep apart by key prefix)."""
    from phalanx import etcdlocal
    try:
        etcdlocal.etcd_binary()
    except etcdlocal.EtcdMissing as e:
        pytest.skip(f"{e}")
    members = etcdlocal.plan(tmp_path_factory.mktemp("etcd"), 1)
    etcdlocal.start(members[0], members)
    try:
        etcdlocal.wait_healthy(members)
        yield members[0]
    finally:
        etcdlocal.stop(members[0])
