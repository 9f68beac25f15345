"""Rewrite the configuration tables in docs/reference/configuration.md from the config classes (every key, its
default, its doc).

    python tools/config_tables.py          # rewrite the page
    python tools/config_tables.py --check  # exit 1 if the page is out of date
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from agent.config import AgentConfig
from controller.config import ControllerConfig
from phalanx.config import describe

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
TABLES = {"controller-config": ControllerConfig, "agent-config": AgentConfig}


def table(cls: type) -> str:
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in describe(cls):
        shown = json.dumps(default) if not isinstance(default, bool) else str(default).lower()
        rows.append(f"| `{key}` | `{shown}` | {doc} |")
    return "\n".join(rows)


def render(text: str) -> str:
    for name, cls in TABLES.items():
        pattern = re.compile(rf"(<!-- {name} -->\n).*?(\n<!-- /{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{PAGE} has no <!-- {name} --> ... <!-- /{name} --> markers")
        text = pattern.sub(lambda m, cls=cls: m.group(1) + table(cls) + m.group(2), text)
    return text


def main() -> int:
    text = PAGE.read_text()
    fresh = render(text)
    if "--check" in sys.argv:
        if fresh != text:
            print(f"{PAGE}'s configuration tables are stale; run `python tools/config_tables.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
