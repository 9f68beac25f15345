import os

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
