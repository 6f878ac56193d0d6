"""The plain-text table helpers: :func:`format_table`, readable in a log file or a terminal, no terminal features
needed; and the layout of tables that fit the terminal, never breaking a name (:func:`fit_widths`, :func:`stacked`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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


# -- tables that fit the terminal (ortcore plugins / config) ---------------------------------------------------------
# Cells hold names (of plugins, options, environment variables, flags such as FALLBACK_DISABLE) that must be copied
# whole, and prose. A name column breaks only at a space or after a '|' (between the flags of A|B), never inside a
# name; prose breaks between words. A table that cannot give every name column its longest name is printed as one
# block per row (:func:`stacked`) instead.
_NAME_CHUNK = re.compile(r"[^\s|]*\|*\s*")  # a name, the '|' after it, the spaces after that: a line may end after it
_WORD = re.compile(r"\S*\s*")
PROSE_MIN = 24  # a prose column narrower than this (or than its longest word) is not worth a table


@dataclass(frozen=True)
class Column:
    """A column of :func:`fit_widths` and :func:`stacked`. ``prose`` columns wrap between words; the others hold
    names. ``label``: the stacked layout shows ``header: cell`` (else the cell alone, on a line of its own);
    ``own_line``: there, the cell starts a line and nothing joins it. A '\\n' in a cell separates items: one per line
    in a table, side by side in the stacked layout."""

    header: str
    prose: bool = False
    label: bool = True
    own_line: bool = False


def terminal_width(default: int = 80) -> int:
    """``COLUMNS`` if set, else the width of the terminal on stdout, stderr or stdin (so that ``ortcore config | less``
    fits the terminal it shows in), else ``default``."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    for fd in (1, 2, 0):
        try:
            width = os.get_terminal_size(fd).columns
        except (OSError, ValueError):
            continue
        if width > 0:
            return width
    return default


def _chunks(text: str, prose: bool) -> list[str]:
    return [c for c in (_WORD if prose else _NAME_CHUNK).findall(text) if c]


def wrap(text: str, width: int, prose: bool = False) -> list[str]:
    """``text`` in lines of at most ``width``: prose between words, names only at a space or after a '|'; '\\n' always
    breaks. Only a word or name longer than ``width`` itself is cut (no line can hold it whole)."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for chunk in _chunks(paragraph, prose):
            if line and len((line + chunk).rstrip()) > width:
                lines.append(line.rstrip())
                line = ""
            line += chunk
        lines.append(line.rstrip())
    width = max(width, 1)
    return [line[i : i + width] for line in lines for i in range(0, max(len(line), 1), width)]


def fit_widths(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int | None) -> list[int] | None:
    """The content width of each column of a boxed table (one space of padding each side, a rule between columns and
    at the edges) at most ``width`` wide, or None if it cannot hold every name column's longest name and each prose
    column's longest word (and :data:`PROSE_MIN`). ``width`` None: every column as wide as its widest line. Width left
    over goes to the columns that wrap, those that need least first."""
    least, ideal = [], []
    for i, column in enumerate(columns):
        cells = [column.header, *(row[i] for row in rows)]
        widest = max(len(line) for cell in cells for line in cell.split("\n"))
        longest = max((len(c.rstrip()) for cell in cells for c in _chunks(cell, column.prose)), default=0)
        least.append(max(longest, min(widest, PROSE_MIN)) if column.prose else longest)
        ideal.append(widest)
    if width is None:
        return ideal
    extra = width - (3 * len(columns) + 1) - sum(least)
    if extra < 0:
        return None
    widths = list(least)
    order = sorted(range(len(columns)), key=lambda i: ideal[i] - least[i])
    for left, i in enumerate(order):
        give = min(ideal[i] - least[i], extra // (len(order) - left))
        widths[i] += give
        extra -= give
    return widths


def _items(items: list[str], width: int, prose: bool) -> list[str]:
    """Items side by side, two spaces apart, in lines of at most ``width``; an item is split only if no line holds
    it whole."""
    lines: list[str] = []
    for item in items:
        pieces = wrap(item, width, prose)
        if len(pieces) == 1 and lines and len(lines[-1]) + 2 + len(pieces[0]) <= width:
            lines[-1] += "  " + pieces[0]
        else:
            lines.extend(pieces)
    return lines


def stacked(columns: Sequence[Column], rows: Iterable[Sequence[str]], width: int, indent: int = 4) -> list[str]:
    """One block per row, for a terminal too narrow for the table: the first cell, then ``header: cell`` for each other
    non-empty cell, side by side while they fit on a line (unless ``own_line``), else on lines of their own (indented,
    wrapped under the cell's start). No line is wider than ``width``; names are broken as by :func:`wrap`."""
    lines: list[str] = []
    for row in rows:
        lines.extend(wrap(row[0], width, columns[0].prose))
        joinable = True  # may the next cell go on the last line
        for column, cell in zip(columns[1:], row[1:]):
            if not cell:
                continue
            label = f"{column.header}: " if column.label else ""
            items = cell.split("\n")
            one = label + "  ".join(items)
            if joinable and column.label and not column.own_line and len(lines[-1]) + 2 + len(one) <= width:
                lines[-1] += "  " + one
                continue
            if not label or indent + len(label) <= width // 2:  # wrapped under the cell's start
                hang = indent + len(label)
                body = _items(items, max(width - hang, 1), column.prose)
                lines.append(" " * indent + label + body[0])
                lines.extend(" " * hang + line for line in body[1:])
            else:  # a long label in a narrow terminal: the cell on the lines below it
                lines.extend(wrap(" " * indent + label.rstrip(), width))
                body = _items(items, max(width - indent, 1), column.prose)
                lines.extend(" " * indent + line for line in body)
            joinable = len(body) == 1 and column.label and not column.own_line
    return lines
