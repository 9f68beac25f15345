"""What the CLI prints is partly other people's text (job names, reasons, event messages, rank logs): a control
sequence in it must not reach an admin's terminal as one (retitle it, move the cursor, rewrite what was printed,
answer back). Every character below 0x20 but newline, tab and carriage return, DEL and the C1 controls is shown
escaped (ESC as \\x1b); JSON output is escaped by json.dumps already."""

from __future__ import annotations

import re
from typing import TextIO

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\xc2[\x80-\x9f]")  # C1 as UTF-8 encodes them


def escape(text: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def escape_bytes(data: bytes) -> bytes:
    """The same for a rank log's raw bytes (UTF-8 or not: only whole control characters are touched)."""
    return _CONTROL_BYTES.sub(lambda m: b"".join(b"\\x%02x" % b for b in m.group()), data)


class Escaped:
    """A text stream that escapes control characters on their way to `inner`."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        self._inner.write(escape(text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)
