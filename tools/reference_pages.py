"""Rewrite the parts of the reference pages that are generated from the code (the job and rank state
machines, as Mermaid diagrams, from controller/recovery/table.py), as tools/config_tables.py does for the
configuration tables.

    python tools/reference_pages.py          # rewrite them
    python tools/reference_pages.py --check  # exit 1 if a page is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from controller.recovery import table

DOCS = Path(__file__).resolve().parent.parent / "docs"


def state_diagram(transitions: dict[int, frozenset[int]], name, first: int) -> str:
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {name(first)}"]
    for source in sorted(transitions):
        for target in sorted(transitions[source]):
            lines.append(f"    {name(source)} --> {name(target)}")
        if not transitions[source]:
            lines.append(f"    {name(source)} --> [*]")
    return "\n".join([*lines, "```"])


BLOCKS = {  # (page, marker) -> the generated text
    ("reference/job-states.md", "job-state-machine"): lambda: state_diagram(table.TRANSITIONS, table.state_name,
                                                                            table.PENDING),
    ("reference/job-states.md", "rank-state-machine"): lambda: state_diagram(table.RANK_TRANSITIONS,
                                                                             table.rank_state_name,
                                                                             table.RANK_UNKNOWN),
}


def render() -> dict[Path, str]:
    """Every page with a generated block, as it should read."""
    pages: dict[Path, str] = {}
    for (page, marker), make in BLOCKS.items():
        path = DOCS / page
        text = pages.get(path) or path.read_text()
        pattern = re.compile(rf"(<!-- {marker} -->\n).*?(\n<!-- /{marker} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{path} has no <!-- {marker} --> ... <!-- /{marker} --> markers")
        made = make().replace("\\", "\\\\")  # a replacement string: no group references in it
        pages[path] = pattern.sub(rf"\g<1>{made}\g<2>", text)
    return pages


def main(argv: list[str]) -> int:
    stale = [path for path, text in render().items() if path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} is out of date; run `python tools/reference_pages.py`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in render().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
