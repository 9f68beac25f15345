import os

import pytest

from tests.cluster import Cluster


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run only when asked for: `-m slow`, or PHALANX_SLOW=1 alongside everything else."""
    if os.environ.get("PHALANX_SLOW") == "1" or "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow, or PHALANX_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()
