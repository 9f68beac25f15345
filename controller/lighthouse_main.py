"""torchft's lighthouse for one replica-group job, as a child process of the controller (controller/lighthouse.py).

`python -m controller.lighthouse_main --bind HOST:PORT --heartbeat-timeout-ms N --join-timeout-ms N
--quorum-tick-ms N` serves torchft's quorum until its standard input closes (the controller exits or stops it) or it
gets SIGTERM. It prints `ready http://HOST:PORT` once it listens, or `error: WHY` and exits 1.

torchft's lighthouse is native code (`torchft._torchft`). Importing the `torchft` package imports torch, which neither
the controller nor this process may: the extension is loaded from its file, by the path of torchft's package found
without running it.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType


def extension() -> Path | None:
    """torchft's native extension, if torchft is installed (found, not imported)."""
    try:
        spec = importlib.util.find_spec("torchft")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        found = sorted(Path(where).glob("_torchft*.so"))
        if found:
            return found[0]
    return None


def load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
    spec = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lighthouse_main")
    p.add_argument("--bind", required=True)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    p.add_argument("--join-timeout-ms", type=int, default=1000)
    p.add_argument("--quorum-tick-ms", type=int, default=100)
    args = p.parse_args(argv)
    path = extension()
    if path is None:
        print("error: torchft is not installed (pip install 'phalanx[ft]')", flush=True)
        return 1
    try:
        server = load(path).LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                             join_timeout_ms=args.join_timeout_ms,
                                             quorum_tick_ms=args.quorum_tick_ms,
                                             heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except Exception as e:  # a port taken, a bad address: said to the controller, which decides
        print(f"error: {e}", flush=True)
        return 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    print(f"ready {server.address()}", flush=True)
    done.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
