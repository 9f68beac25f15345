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
