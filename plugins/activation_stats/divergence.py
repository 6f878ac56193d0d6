"""Find where an ortcore run's activation statistics first diverge from a PyTorch run's.

Usage::

    ortcore find-divergence PT_DIR ORT_DIR [--rtol 1e-3] [--atol 1e-6] [--top 20] [--html PATH | --no-html]

The HTML report (summary, ranked table, plots over steps) is written by default to
``divergence_<PT_DIR name>_vs_<ORT_DIR name>.html`` in the current directory.

Two values agree when ``|ort - pt| <= atol + rtol * |pt|`` (the PyTorch run is the reference) for mean, std, min,
max and abs_mean; NaN/Inf counts and shapes must match exactly; an activation on one side only is a divergence.
The first divergence is the earliest step, then the earliest activation in execution order (then the lowest rank).

Exit codes: 0 no divergence, 1 divergence found, 2 bad input (missing directory, malformed record, ...).
"""

from __future__ import annotations

import argparse
import base64
import html
import importlib.util
import io
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ortcore.api import atomic_write, format_table

from .merge_activation_summary import (
    COUNT_STATS,
    FLOAT_STATS,
    RecordError,
    _label,
    _num,
    pair_runs,
    pair_step,
    rel_diff,
    resolve_runs,
)

__all__ = [
    "Mismatch",
    "Divergence",
    "ActivationScore",
    "Series",
    "Report",
    "compare_records",
    "find_divergence",
    "default_html_path",
    "plot_png",
    "write_html_report",
    "run",
    "main",
]

PLOT_STATS = ("mean", "std", "min", "max", "abs_mean")


@dataclass(frozen=True)
class Mismatch:
    """One statistic that differs: ``pt``/``ort`` values (None when the activation is missing on that side)."""

    stat: str
    pt: Any
    ort: Any
    rel: float


@dataclass(frozen=True)
class Divergence:
    step: int
    rank: int
    name: str
    kind: str
    occurrence: int
    order: int
    mismatches: tuple[Mismatch, ...]

    @property
    def label(self) -> str:
        return self.name if self.occurrence == 0 else f"{self.name}#{self.occurrence}"

    def describe(self) -> str:
        lines = [
            f"first divergence: step {self.step}, rank {self.rank}, {self.kind} activation {self.label!r} (order {self.order})"
        ]
        for m in self.mismatches:
            lines.append(f"  {m.stat:<9} pytorch={_fmt(m.pt)}  ort={_fmt(m.ort)}  rel.diff={_fmt_rel(m.rel)}")
        return "\n".join(lines)


@dataclass
class ActivationScore:
    """An activation's worst disagreement over all steps."""

    rank: int
    kind: str
    name: str
    occurrence: int
    max_rel: float
    worst_step: int
    worst_stat: str
    first_divergent_step: int | None
    divergent_steps: int
    steps: int

    @property
    def key(self) -> tuple[int, str, str, int]:
        return (self.rank, self.kind, self.name, self.occurrence)

    @property
    def label(self) -> str:
        return self.name if self.occurrence == 0 else f"{self.name}#{self.occurrence}"


@dataclass
class Series:
    """One activation's statistics over steps for both runs (None where a side has no record)."""

    rank: int
    kind: str
    name: str
    occurrence: int
    steps: list[int] = field(default_factory=list)
    pt: dict[str, list[float | None]] = field(default_factory=dict)
    ort: dict[str, list[float | None]] = field(default_factory=dict)


@dataclass
class Report:
    pt_dir: str
    ort_dir: str
    rtol: float
    atol: float
    top: int
    ranks: list[int]
    steps: list[int]
    compared: int
    first: Divergence | None
    worst: list[ActivationScore]
    series: dict[tuple[int, str, str, int], Series]

    @property
    def diverged(self) -> bool:
        return self.first is not None

    def summary(self) -> str:
        head = (
            f"compared {self.compared} activation record pair(s) over {len(self.steps)} step(s) "
            f"and {len(self.ranks)} rank(s) (rtol={self.rtol:g}, atol={self.atol:g})"
        )
        if self.first is None:
            return head + "\nno divergence"
        return head + "\n" + self.first.describe()

    def table(self) -> str:
        header = ["#", "rank", "kind", "name", "max rel.diff", "at step", "stat", "first div.", "div. steps"]
        rows = []
        for i, s in enumerate(self.worst, 1):
            rows.append(
                [
                    str(i),
                    str(s.rank),
                    s.kind,
                    s.label,
                    _fmt_rel(s.max_rel),
                    str(s.worst_step),
                    s.worst_stat,
                    "-" if s.first_divergent_step is None else str(s.first_divergent_step),
                    f"{s.divergent_steps}/{s.steps}",
                ]
            )
        return format_table(header, rows, indent="")


def _fmt(v: Any) -> str:
    if v is None:
        return "missing"
    if isinstance(v, list):
        return "x".join(map(str, v)) if v else "scalar"
    x = _num(v)
    return str(v) if x is None else f"{x:.6g}"


def _fmt_rel(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:.3e}"


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    """``|ort - pt| <= atol + rtol*|pt|`` with NaN == NaN and same-signed infinities equal; None only equals None."""
    x, y = _num(b), _num(a)  # x: pytorch reference (b in the formula), y: ort
    if x is None or y is None:
        return x is None and y is None
    if math.isnan(x) or math.isnan(y):
        return math.isnan(x) and math.isnan(y)
    if math.isinf(x) or math.isinf(y):
        return x == y
    return abs(y - x) <= atol + rtol * abs(x)


def compare_records(pt: dict[str, Any] | None, ort: dict[str, Any] | None, rtol: float, atol: float) -> list[Mismatch]:
    """The statistics of one activation that differ beyond tolerance (all of them when a side is missing)."""
    if pt is None or ort is None:
        return [Mismatch("present", pt is not None, ort is not None, math.inf)]
    out = []
    if list(pt["shape"]) != list(ort["shape"]):
        out.append(Mismatch("shape", pt["shape"], ort["shape"], math.inf))
    for s in COUNT_STATS:
        if pt[s] != ort[s]:
            out.append(Mismatch(s, pt[s], ort[s], rel_diff(pt[s], ort[s])))
    for s in FLOAT_STATS:
        if not _close(ort[s], pt[s], rtol, atol):
            out.append(Mismatch(s, pt[s], ort[s], rel_diff(pt[s], ort[s])))
    return out


def find_divergence(
    pt_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    ort_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    rtol: float = 1e-3,
    atol: float = 1e-6,
    top: int = 20,
) -> Report:
    """Compare two runs (one or several ranks each, as :func:`merge_activation_summary.resolve_runs` accepts).

    Raises :class:`RecordError` on bad input.
    """
    pairs = pair_runs(resolve_runs(pt_dir), resolve_runs(ort_dir), _label(pt_dir), _label(ort_dir))
    first: Divergence | None = None
    scores: dict[tuple[int, str, str, int], ActivationScore] = {}
    series: dict[tuple[int, str, str, int], Series] = {}
    all_steps: set[int] = set()
    compared = 0
    for rank, pt, ort in pairs:
        steps = sorted(set(pt.steps) | set(ort.steps))
        all_steps.update(steps)
        for step in steps:
            for (kind, name, occ), a, b in pair_step(pt, ort, step):
                key = (rank, kind, name, occ)
                compared += a is not None and b is not None
                mism = compare_records(a, b, rtol, atol)
                cands = [(m.rel, m.stat) for m in mism if m.stat not in FLOAT_STATS]
                if a is not None and b is not None:
                    cands += [(rel_diff(a[s], b[s]), s) for s in FLOAT_STATS]
                worst_rel, worst_stat = max(cands, key=lambda c: c[0])
                sc = scores.get(key)
                if sc is None:
                    sc = scores[key] = ActivationScore(rank, kind, name, occ, -1.0, step, "", None, 0, 0)
                sc.steps += 1
                if worst_rel > sc.max_rel:
                    sc.max_rel, sc.worst_step, sc.worst_stat = worst_rel, step, worst_stat
                if mism:
                    sc.divergent_steps += 1
                    if sc.first_divergent_step is None:
                        sc.first_divergent_step = step
                    rec = a if a is not None else b
                    cand = Divergence(step, rank, name, kind, occ, rec["order"], tuple(mism))
                    if first is None or (cand.step, cand.order, cand.rank) < (first.step, first.order, first.rank):
                        first = cand
                ser = series.get(key)
                if ser is None:
                    ser = series[key] = Series(
                        rank, kind, name, occ, pt={s: [] for s in PLOT_STATS}, ort={s: [] for s in PLOT_STATS}
                    )
                ser.steps.append(step)
                for s in PLOT_STATS:
                    ser.pt[s].append(None if a is None else _num(a[s]))
                    ser.ort[s].append(None if b is None else _num(b[s]))
    diverging = [s for s in scores.values() if s.divergent_steps or s.max_rel > 0]
    diverging.sort(
        key=lambda s: (-s.max_rel, s.first_divergent_step if s.first_divergent_step is not None else math.inf, s.key)
    )
    return Report(
        pt_dir=_label(pt_dir),
        ort_dir=_label(ort_dir),
        rtol=rtol,
        atol=atol,
        top=top,
        ranks=[r for r, _, _ in pairs],
        steps=sorted(all_steps),
        compared=compared,
        first=first,
        worst=diverging[: max(top, 0)],
        series=series,
    )


# ---------------------------------------------------------------------------------------------------- HTML report


def plot_png(ser: Series, rtol: float) -> bytes:
    """A PNG of one activation's statistics over steps, both runs, and their largest relative difference.

    Needs matplotlib (``pip install matplotlib``)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 5.6))
    axes = fig.subplots(2, 3).ravel()
    nan = float("nan")
    for ax, s in zip(axes, PLOT_STATS):
        pt = [nan if v is None else v for v in ser.pt[s]]
        ort = [nan if v is None else v for v in ser.ort[s]]
        ax.plot(ser.steps, pt, "o-", label="pytorch")
        ax.plot(ser.steps, ort, "x--", label="ort")
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
    ax = axes[len(PLOT_STATS)]
    rel = [max(rel_diff(ser.pt[s][i], ser.ort[s][i]) for s in PLOT_STATS) for i in range(len(ser.steps))]
    positive = [r if math.isfinite(r) and r > 0 else nan for r in rel]  # log axis: equal (0) and inf not drawn
    ax.plot(ser.steps, positive, "s-", color="tab:red", label="max rel. diff")
    if rtol > 0:
        ax.axhline(rtol, color="gray", linestyle=":", label=f"rtol {rtol:g}")
    ax.set_title("max rel. diff (0 and inf not drawn)", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlim(axes[0].get_xlim())
    ax.legend(fontsize=7)
    for a in axes:
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"rank {ser.rank} {ser.kind} {ser.name}" + (f"#{ser.occurrence}" if ser.occurrence else ""), fontsize=10
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def write_html_report(report: Report, path: str | os.PathLike[str], plots: int | None = None) -> Path:
    """A self-contained HTML file: summary, first divergence, ranked table and plots (PNG as base64) of the worst
    ``plots`` activations (default: all rows of the ranked table, at most 12); without matplotlib, no plots and a
    note saying so. Written atomically; missing parent directories are created."""
    e = html.escape
    out = Path(path)
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8"><title>ortcore divergence report</title>',
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}th{background:#eee}"
        ".bad{color:#b00}.ok{color:#070}</style></head><body>",
        "<h1>Activation divergence report</h1>",
        "<table>",
        f"<tr><th>PyTorch run</th><td>{e(report.pt_dir)}</td></tr>",
        f"<tr><th>ORT run</th><td>{e(report.ort_dir)}</td></tr>",
        f"<tr><th>tolerance</th><td>|ort - pt| &lt;= {report.atol:g} + {report.rtol:g} * |pt|</td></tr>",
        f"<tr><th>steps</th><td>{e(', '.join(map(str, report.steps)))}</td></tr>",
        f"<tr><th>ranks</th><td>{e(', '.join(map(str, report.ranks)))}</td></tr>",
        f"<tr><th>compared pairs</th><td>{report.compared}</td></tr>",
        "</table>",
    ]
    f = report.first
    if f is None:
        parts.append('<h2 class="ok">No divergence</h2>')
    else:
        parts.append('<h2 class="bad">First divergence</h2>')
        parts.append(
            f"<p>step <b>{f.step}</b>, rank {f.rank}, {e(f.kind)} activation <b>{e(f.label)}</b> (order {f.order})</p>"
        )
        parts.append("<table><tr><th>statistic</th><th>PyTorch</th><th>ORT</th><th>rel. diff</th></tr>")
        for m in f.mismatches:
            parts.append(
                f"<tr><td>{e(m.stat)}</td><td>{e(_fmt(m.pt))}</td><td>{e(_fmt(m.ort))}</td><td>{_fmt_rel(m.rel)}</td></tr>"
            )
        parts.append("</table>")
    parts.append("<h2>Worst activations</h2>")
    if not report.worst:
        parts.append("<p>All statistics are identical.</p>")
    else:
        parts.append(
            "<table><tr><th>#</th><th>rank</th><th>kind</th><th>name</th><th>max rel. diff</th><th>at step</th>"
            "<th>stat</th><th>first divergent step</th><th>divergent steps</th></tr>"
        )
        for i, s in enumerate(report.worst, 1):
            first_step = "-" if s.first_divergent_step is None else str(s.first_divergent_step)
            parts.append(
                f'<tr><td>{i}</td><td>{s.rank}</td><td>{e(s.kind)}</td><td><a href="#act{i}">{e(s.label)}</a></td>'
                f"<td>{_fmt_rel(s.max_rel)}</td><td>{s.worst_step}</td><td>{e(s.worst_stat)}</td>"
                f"<td>{first_step}</td><td>{s.divergent_steps}/{s.steps}</td></tr>"
            )
        parts.append("</table>")
        n = min(len(report.worst), 12) if plots is None else min(len(report.worst), plots)
        if n and importlib.util.find_spec("matplotlib") is None:
            parts.append("<p>Plots over steps need matplotlib: <code>pip install matplotlib</code>.</p>")
            n = 0
        if n:
            parts.append("<h2>Statistics over steps</h2>")
        for i, s in enumerate(report.worst[:n], 1):
            png = base64.b64encode(plot_png(report.series[s.key], report.rtol)).decode("ascii")
            parts.append(f'<h3 id="act{i}">{i}. rank {s.rank} {e(s.kind)} {e(s.label)}</h3>')
            parts.append(f'<img alt="{e(s.label)}" src="data:image/png;base64,{png}">')
    parts.append("</body></html>")
    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(out, "\n".join(parts) + "\n")


# ---------------------------------------------------------------------------------------------------- CLI


def default_html_path(pt_dir: Any, ort_dir: Any) -> Path:
    """Where ``ortcore find-divergence`` writes its HTML report unless told otherwise: the current directory,
    ``divergence_<PT_DIR name>_vs_<ORT_DIR name>.html`` (the first directory's name when several are given)."""

    def name(paths: Any) -> str:
        first = paths if isinstance(paths, str | os.PathLike) else next(iter(paths), "run")
        return re.sub(r"[^A-Za-z0-9._-]", "_", Path(first).resolve().name) or "run"

    return Path.cwd() / f"divergence_{name(pt_dir)}_vs_{name(ort_dir)}.html"


def run(args: argparse.Namespace) -> int:
    """Run ``ortcore find-divergence`` with parsed arguments: 0 no divergence, 1 divergence, 2 bad input."""
    try:
        report = find_divergence(args.pt_dir, args.ort_dir, rtol=args.rtol, atol=args.atol, top=args.top)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    if report.worst:
        print()
        print(f"worst activations (top {args.top}, by max relative difference over steps):")
        print(report.table())
    if not args.no_html:
        path = Path(args.html) if args.html else default_html_path(args.pt_dir, args.ort_dir)
        try:
            write_html_report(report, path)
        except OSError as e:
            print(f"error: cannot write the HTML report {str(path)!r}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"\nHTML report: {path}")
    return 1 if report.diverged else 0


def main(argv: Iterable[str] | None = None) -> int:
    """``ortcore find-divergence`` as a function: exit 0 when no divergence, 1 when found, 2 on bad input."""
    from .arguments import divergence_parser

    return run(divergence_parser().parse_args(None if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
