#!/usr/bin/env python3
"""Record what NVML answers on this host, for tests that replay it through the fake NVML.

Run on a GPU host:  python tools/record_nvml_fixture.py -o tests/fixtures/nvml_<model>.json

It asks every GPU each query that NvmlBackend asks (the same query tables, so the two cannot drift)
and writes, per query, {"value": ...} or {"error": "<pynvml error class>"}. NVLink is probed over
every possible link, as the backend's first sweep does. UUIDs and serials are replaced by
placeholders unless --keep-ids is given, so a fixture can be committed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.collectors.nvml import IDENTITY_QUERIES, NVLINK_COUNTERS, sample_queries  # noqa: E402

FORMAT = "phalanx.nvml-fixture/1"
EXTRA_QUERIES = {  # asked by the XID thread rather than the sweep
    "supported_event_types": lambda n, h: int(n.nvmlDeviceGetSupportedEventTypes(h)),
}


def _answer(nvml: Any, call: Callable[[], Any]) -> dict[str, Any]:
    """One query's answer as JSON: the value, or the NVML error class name (never raises for NVML errors)."""
    try:
        return {"value": call()}
    except (nvml.NVMLError, AttributeError) as e:  # AttributeError: bindings older than the query
        return {"error": type(e).__name__}


def _nvlink(nvml: Any, handle: Any) -> dict[str, Any]:
    links: dict[str, Any] = {}
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
        state = _answer(nvml, lambda link=link: int(nvml.nvmlDeviceGetNvLinkState(handle, link)))
        entry: dict[str, Any] = {"state": state}
        if "value" in state:
            entry["counters"] = {
                c: _answer(nvml, lambda link=link, c=c: int(nvml.nvmlDeviceGetNvLinkErrorCounter(
                    handle, link, getattr(nvml, f"NVML_NVLINK_ERROR_{c}"))))
                for c in NVLINK_COUNTERS if hasattr(nvml, f"NVML_NVLINK_ERROR_{c}")
            }
        links[str(link)] = entry
    return links


def record(nvml: Any, keep_ids: bool = False) -> dict[str, Any]:
    """Everything NvmlBackend would read from `nvml` (already initialised), as a JSON-able fixture."""
    queries = {**IDENTITY_QUERIES, **sample_queries(nvml), **EXTRA_QUERIES}
    gpus = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle_answer = _answer(nvml, lambda index=index: nvml.nvmlDeviceGetHandleByIndex(index))
        gpu: dict[str, Any] = {"index": index, "handle": {"value": None} if "value" in handle_answer else handle_answer,
                               "queries": {}, "nvlink": {}}
        if "value" in handle_answer:
            handle = handle_answer["value"]
            gpu["queries"] = {name: _answer(nvml, lambda q=q, h=handle: q(nvml, h)) for name, q in queries.items()}
            gpu["nvlink"] = _nvlink(nvml, handle)
            if not keep_ids:
                _anonymise(gpu["queries"], index)
        gpus.append(gpu)
    try:
        bindings = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        bindings = "unknown"
    return {
        "format": FORMAT,
        "nvidia_ml_py": bindings,
        "driver_version": _answer(nvml, lambda: _str(nvml.nvmlSystemGetDriverVersion())),
        "gpus": gpus,
    }


def _str(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _anonymise(queries: dict[str, Any], index: int) -> None:
    if "value" in queries.get("uuid", {}):
        queries["uuid"] = {"value": f"GPU-00000000-0000-0000-0000-{index:012d}"}
    if "value" in queries.get("serial", {}):
        queries["serial"] = {"value": f"{index:013d}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--out", help="write the fixture here (default: stdout)")
    parser.add_argument("--keep-ids", action="store_true", help="keep the real GPU UUIDs and serial numbers")
    args = parser.parse_args(argv)
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        print(f"record_nvml_fixture: NVML cannot start here ({e})", file=sys.stderr)
        return 1
    try:
        fixture = record(pynvml, keep_ids=args.keep_ids)
    finally:
        pynvml.nvmlShutdown()
    text = json.dumps(fixture, indent=1, sort_keys=True) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"record_nvml_fixture: {len(fixture['gpus'])} GPUs -> {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
