"""The one plain-text table helper: readable in a log file or a terminal, no terminal features needed."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?([eE][-+]?\d+)?|inf|nan)(/\d+)?[x×%]?")


def _is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text) is not None or text in ("-", "n/a")


def format_table(header: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "  ") -> str:
    """A plain-text table, numeric columns right-aligned, text left-aligned."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in cells[1:]) and len(cells) > 1 for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
        lines.append(indent + "  ".join(parts).rstrip())
    return "\n".join(lines)
