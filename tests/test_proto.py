"""The wire protocol: generated stubs are fresh, enums start at _UNSPECIFIED = 0, and no top-level `proto`."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.v1 import common_pb2, control_pb2, node_pb2

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import genproto  # noqa: E402

pytestmark = pytest.mark.procs  # the tier (tests/conftest.py)


def test_committed_stubs_are_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "genproto.py"), "--check"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_a_stale_stub_is_caught(tmp_path):
    shutil.copytree(ROOT / "phalanx", tmp_path / "phalanx")
    copy = tmp_path / "phalanx" / "v1"
    (copy / "node_pb2.py").write_text((copy / "node_pb2.py").read_text() + "\n# edited by hand\n")
    (copy / "common_pb2.pyi").unlink()
    (copy / "old_pb2.py").write_text("# a stub whose .proto is gone\n")
    assert genproto.stale(tmp_path) == ["phalanx/v1/common_pb2.pyi", "phalanx/v1/node_pb2.py", "phalanx/v1/old_pb2.py"]


def test_every_enum_starts_with_unspecified_zero():
    enums = []
    for module in (common_pb2, control_pb2, node_pb2):
        enums += list(module.DESCRIPTOR.enum_types_by_name.values())
        for message in module.DESCRIPTOR.message_types_by_name.values():
            enums += list(message.enum_types)
    assert enums, "expected enums in the protocol"
    for enum in enums:
        first = enum.values[0]
        assert first.number == 0, enum.full_name
        assert first.name.endswith("_UNSPECIFIED"), f"{enum.full_name}: {first.name}"


def test_package_is_versioned_and_not_a_top_level_proto_module():
    assert node_pb2.DESCRIPTOR.package == "phalanx.v1"
    spec = importlib.util.find_spec("proto")
    assert spec is None or "phalanx" not in str(spec.origin or "")
