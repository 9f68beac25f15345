"""Slurm hostlist expressions, both ways: `gpu[001-512]` <-> gpu001, gpu002, ..., gpu512.

`expand` reads what Slurm's `scontrol show hostnames` reads: comma lists at the top level, bracketed
ranges and lists (`tux[0-3,12]`), zero padding kept (`node[01-18]`), several brackets in one name
(`rack[1-2]-node[01-04]`, the first varying slowest). `compress` writes what `scontrol show hostlist`
writes: names that differ only in their last number folded into one bracket, padded numbers with their
width.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_NAMES = 1 << 20  # names one expression may expand to
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TAIL = re.compile(r"^(.*?)(\d+)$")


class HostlistError(ValueError):
    """A malformed hostlist expression; the message says what is wrong."""


def expand(expr: str) -> list[str]:
    """The names of a hostlist expression, in its order (a name given twice comes twice). Raises HostlistError
    saying what is malformed."""
    names: list[str] = []
    for part in _split_top_level(expr.strip()):
        if not part:
            raise HostlistError("empty name")
        out = [""]
        i = 0
        while i < len(part):
            opening, closing = part.find("[", i), part.find("]", i)
            if closing != -1 and (opening == -1 or closing < opening):
                raise HostlistError("']' without '['")
            if opening == -1:
                out = [o + part[i:] for o in out]
                break
            closing = part.find("]", opening)
            if closing == -1:
                raise HostlistError("'[' without ']'")
            values = _range_values(part[opening + 1:closing])
            if len(out) * len(values) + len(names) > MAX_NAMES:
                raise HostlistError(f"expands to more than {MAX_NAMES} names")
            out = [o + part[i:opening] + v for o in out for v in values]
            i = closing + 1
        names.extend(out)
    return names


def _split_top_level(expr: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError("nested '['")
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    parts.append(expr[start:])
    return parts


def _range_values(inner: str) -> list[str]:
    values: list[str] = []
    for item in inner.split(","):
        m = _RANGE.fullmatch(item)
        if not m:
            raise HostlistError(f"{item!r} in brackets is not a number or a range like 01-18")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise HostlistError(f"range {item} goes down")
        if hi - lo + len(values) >= MAX_NAMES:
            raise HostlistError(f"expands to more than {MAX_NAMES} names")
        values.extend(str(v).zfill(len(m[1])) for v in range(lo, hi + 1))
    return values


def compress(names: Iterable[str]) -> str:
    """One expression for `names`: those that differ only in their trailing number share a bracket (groups in
    the order they first appear, numbers sorted within each). `expand(compress(names))` gives every name back."""
    unique = list(dict.fromkeys(names))
    tails = {name: _TAIL.match(name) for name in unique}
    padded: dict[str, set[int]] = {}  # prefix -> widths of its zero-padded numbers (node007: 3)
    for m in tails.values():
        if m is not None and len(m[2]) > 1 and m[2].startswith("0"):
            padded.setdefault(m[1], set()).add(len(m[2]))
    groups: dict[tuple[str, int], set[int]] = {}
    order: list[tuple[str, int] | str] = []
    for name in unique:
        m = tails[name]
        if m is None:
            order.append(name)
            continue
        digits = m[2]
        # node010 is padded to 3; so is node100 beside it (node[010-100]); node7 alone is not padded (width 0)
        width = len(digits) if len(digits) in padded.get(m[1], ()) else 0
        key = (m[1], width)
        if key not in groups:
            groups[key] = set()
            order.append(key)
        groups[key].add(int(digits))
    out = []
    for item in order:
        if isinstance(item, str):
            out.append(item)
            continue
        prefix, width = item
        numbers = sorted(groups[item])
        if width == 0:
            # an unpadded number may not start with 0 in the name; padded ones keep their width
            fmt = str
        else:
            def fmt(v: int, w: int = width) -> str:
                return str(v).zfill(w)
        if len(numbers) == 1:
            out.append(f"{prefix}{fmt(numbers[0])}")
            continue
        runs, start, prev = [], numbers[0], numbers[0]
        for v in [*numbers[1:], None]:
            if v is not None and v == prev + 1:
                prev = v
                continue
            runs.append(fmt(start) if start == prev else f"{fmt(start)}-{fmt(prev)}")
            if v is not None:
                start = prev = v
        out.append(f"{prefix}[{','.join(runs)}]")
    return ",".join(out)
