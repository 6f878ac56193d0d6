"""Read a NormSubscriber CSV and plot the L2 norm of chosen activations over steps.

Usage::

    python -m ortcore_activation_norms plot norms.csv -o norms.png [--name 'encoder.*' ...] [--kind forward]

Exit codes: 0 the plot was written, 2 bad input or bad arguments (the message names the value and what is allowed).
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ortcore.api import atomic_writer

from .subscriber import COLUMNS, KINDS

KIND_CHOICES = (*KINDS, "all")
YSCALES = ("log", "linear")


class NormsFileError(ValueError):
    """A CSV that is not a NormSubscriber's, or a choice that selects nothing; the message says what is expected."""


@dataclass(frozen=True)
class Row:
    step: int
    order: int
    kind: str
    name: str
    numel: int
    l2: float
    rms: float
    max_abs: float


def _int(text: str, column: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise NormsFileError(f"{where}: {column}={text!r} is not allowed; allowed: an integer >= 0")
    return value


def _float(text: str, column: str, where: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise NormsFileError(f"{where}: {column}={text!r} is not allowed; allowed: a number (or nan, inf)") from None


def read_norms(path: str | os.PathLike) -> list[Row]:
    """The rows of a CSV a :class:`NormSubscriber` wrote, validated; raises :class:`NormsFileError` naming the
    file, the line, the value and what is allowed."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise NormsFileError(f"{path}: no such file; expected the CSV a NormSubscriber wrote")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise NormsFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected a CSV file") from None
    if text and not text.endswith("\n"):
        # The subscriber ends every write with a line break: this row's writer was cut off (a machine crash).
        raise NormsFileError(
            f"{path} line {text.count(chr(10)) + 1}: incomplete last row (no line break after it); expected whole "
            "rows: delete that line to read the others"
        )
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None:
            raise NormsFileError(f"{path}: the file is empty; expected the header {', '.join(COLUMNS)}")
        if tuple(header) != COLUMNS:
            raise NormsFileError(f"{path}: the columns are {', '.join(header)}; expected {', '.join(COLUMNS)}")
        rows = []
        for fields in reader:
            where = f"{path} line {reader.line_num}"
            if len(fields) != len(COLUMNS):
                raise NormsFileError(f"{where}: {len(fields)} fields; expected {len(COLUMNS)} ({', '.join(COLUMNS)})")
            step, order, kind, name, numel, l2, rms, max_abs = fields
            if kind not in KINDS:
                raise NormsFileError(f"{where}: kind={kind!r} is not allowed; allowed: {', '.join(KINDS)}")
            rows.append(
                Row(
                    _int(step, "step", where),
                    _int(order, "order", where),
                    kind,
                    name,
                    _int(numel, "numel", where),
                    _float(l2, "l2", where),
                    _float(rms, "rms", where),
                    _float(max_abs, "max_abs", where),
                )
            )
    except csv.Error as e:
        raise NormsFileError(f"{path} line {reader.line_num}: {e}; expected a CSV file") from None
    return rows


def label(kind: str, name: str, call: int, with_kind: bool) -> str:
    """``name`` (its n-th call in a step as ``name#n``), followed by `` (forward)``/`` (backward)`` if asked."""
    text = name if call == 0 else f"{name}#{call}"
    return f"{text} ({kind})" if with_kind else text


def l2_series(
    rows: Iterable[Row], names: Sequence[str] = (), kind: str = "forward"
) -> dict[tuple[str, str, int], list[tuple[int, float]]]:
    """``(kind, name, call) -> [(step, l2), ...]`` for the activations matching any of ``names`` (shell-style
    patterns; all activations if empty). ``call`` numbers the calls of one name within a step (a module run twice)."""
    if kind not in KIND_CHOICES:
        raise NormsFileError(f"kind={kind!r} is not allowed; allowed: {', '.join(KIND_CHOICES)}")
    rows = list(rows)
    if not rows:
        raise NormsFileError("the CSV has a header but no rows; expected at least one recorded step")
    kinds = KINDS if kind == "all" else (kind,)
    series: dict[tuple[str, str, int], list[tuple[int, float]]] = {}
    calls: dict[tuple[int, str, str], int] = {}
    for row in sorted(rows, key=lambda r: (r.step, r.order)):
        if row.kind not in kinds or (names and not any(fnmatch.fnmatchcase(row.name, p) for p in names)):
            continue
        call = calls.get((row.step, row.kind, row.name), 0)
        calls[(row.step, row.kind, row.name)] = call + 1
        series.setdefault((row.kind, row.name, call), []).append((row.step, row.l2))
    if not series:
        available = sorted({r.name for r in rows if r.kind in kinds})
        shown = ", ".join(available[:20]) + (f", ... ({len(available)} in all)" if len(available) > 20 else "")
        raise NormsFileError(
            f"--name {' '.join(names)!r} with --kind {kind} selects no activation; allowed: names (or shell-style "
            f"patterns) among {shown or 'none: the CSV has no ' + kind + ' rows'}"
        )
    return series


def plot_l2(
    rows: Iterable[Row],
    output: str | os.PathLike,
    names: Sequence[str] = (),
    kind: str = "forward",
    yscale: str = "log",
    title: str | None = None,
) -> Path:
    """Plot the L2 norm over steps of the chosen activations into ``output`` (format from its suffix), written
    atomically (``ortcore.files.atomic_writer``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise NormsFileError(
            "plot needs matplotlib; allowed: pip install 'ortcore-activation-norms[plot]' (or matplotlib)"
        ) from None
    if yscale not in YSCALES:
        raise NormsFileError(f"yscale={yscale!r} is not allowed; allowed: {', '.join(YSCALES)}")
    output = Path(output)
    figure = Figure(figsize=(10, 6), layout="constrained")
    formats = figure.canvas.get_supported_filetypes()
    suffix = output.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise NormsFileError(
            f"-o {str(output)!r}: format {suffix!r} is not allowed; allowed: {', '.join(sorted(formats))}"
        )
    if not output.parent.is_dir():
        raise NormsFileError(f"-o {str(output)!r}: the directory {str(output.parent)!r} does not exist")
    series = l2_series(rows, names, kind)
    axes = figure.add_subplot()
    for (row_kind, name, call), points in series.items():
        steps = [s for s, _ in points]
        values = [v if math.isfinite(v) else math.nan for _, v in points]
        axes.plot(
            steps,
            values,
            linestyle="--" if row_kind == "backward" else "-",
            marker="." if len(points) < 50 else None,
            label=label(row_kind, name, call, with_kind=kind == "all"),
        )
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_xlabel("step")
    axes.set_ylabel("L2 norm")
    axes.set_yscale(yscale)
    axes.set_title(title or f"L2 norm of {kind if kind != 'all' else 'forward and backward'} activations")
    axes.grid(True, alpha=0.3)
    if len(series) <= 30:
        axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    with atomic_writer(output, "wb") as f:
        figure.savefig(f, format=suffix)
    return output


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m ortcore_activation_norms``: exit 0 when the plot is written, 2 on bad input or arguments."""
    parser = argparse.ArgumentParser(prog="python -m ortcore_activation_norms", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plot = commands.add_parser("plot", help="plot the L2 norm of chosen activations over steps")
    plot.add_argument("csv", help="the CSV a NormSubscriber wrote")
    plot.add_argument("-o", "--output", required=True, help="the image to write (png, pdf, svg, ...)")
    plot.add_argument(
        "-n",
        "--name",
        action="append",
        default=[],
        help="activation name or shell-style pattern (repeatable; default: all)",
    )
    plot.add_argument("--kind", choices=KIND_CHOICES, default="forward", help="forward outputs, gradients, or both")
    plot.add_argument("--yscale", choices=YSCALES, default="log")
    plot.add_argument("--title")
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        written = plot_l2(read_norms(args.csv), args.output, args.name, args.kind, args.yscale, args.title)
    except NormsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0
