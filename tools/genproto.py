"""Generate the Python stubs in phalanx/v1/ from proto/phalanx/v1/*.proto.

    python tools/genproto.py           # regenerate in place
    python tools/genproto.py --check   # exit 1 if the committed stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = Path("phalanx") / "v1"
# ours, and wire-compatible copies of NVRx's node health check and of torchft's lighthouse service
PACKAGES = (PACKAGE, Path("phalanx") / "nvhcd", Path("phalanx") / "torchft")


def generate(out: Path) -> list[Path]:
    """Compile every .proto of PACKAGES into `out`; return the generated files."""
    sources = sorted(s for package in PACKAGES for s in (PROTO_ROOT / package).glob("*.proto"))
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *[str(s.relative_to(PROTO_ROOT)) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for package in PACKAGES for p in (out / package).iterdir()
                  if p.suffix in (".py", ".pyi") and p.name != "__init__.py")


def stale(committed_root: Path) -> list[str]:
    """Paths (relative to the root) of generated files that differ from, or are missing under, `committed_root`."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp): p for p in generate(Path(tmp))}
        problems = [str(rel) for rel, p in fresh.items() if not (committed_root / rel).exists()
                    or not filecmp.cmp(p, committed_root / rel, shallow=False)]
        for package in PACKAGES:
            problems += [str(p.relative_to(committed_root)) for p in (committed_root / package).glob("*_pb2*.py*")
                         if p.relative_to(committed_root) not in fresh]
        return sorted(problems)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    if args.check:
        problems = stale(ROOT)
        if problems:
            print(f"generated stubs are stale: {', '.join(problems)}; run `make proto`", file=sys.stderr)
            return 1
        print("generated stubs are up to date")
        return 0
    for path in generate(ROOT):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
