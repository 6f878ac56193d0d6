"""Side-by-side per-step summaries of two activation-statistics runs (PyTorch and ortcore).

A run directory is what ``StatisticsSubscriber`` writes; its format is defined once, in
:mod:`ortcore_plugins.activation_stats.subscriber` (``FORMAT``, ``META_FILE``, ``RECORDS_FILE``, ``RECORD_FIELDS``)::

    <run>/meta.json                      {"format": 1, "source": "torch"|"ortcore", "rank", "world_size", "model"}
    <run>/step_<step>/records.jsonl                   one record a line, or
    <run>/step_<step>/<order:05d>_<kind>_<safe name>.json   one record a file

Several ranks: pass one run directory per rank (``--pt_dir pt_out_0 pt_out_1``), a parent directory holding
``rank_<r>/`` run directories, or the common prefix (``--pt_dir pt_out`` when ``pt_out_0``, ``pt_out_1`` exist).

Usage::

    ortcore merge-activation-summary --pt_dir pt_out --ort_dir ort_out --output_dir /tmp/output

writes ``<output_dir>/step_<N>.txt`` (one rank) or ``<output_dir>/rank_<r>/step_<N>.txt`` (several ranks). Only the
files it writes are replaced in an existing output directory, each atomically.

The loading and pairing helpers here are shared with :mod:`ortcore_plugins.activation_stats.divergence`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ortcore.api import atomic_write, format_table

from .records import FORMAT, KINDS, META_FILE, RECORD_FIELDS, RECORDS_FILE, STEP_DIR_PREFIX

FLOAT_STATS = ("mean", "std", "min", "max", "abs_mean")
COUNT_STATS = ("nans", "infs")
_STEP_DIR = re.compile(rf"^{STEP_DIR_PREFIX}(-?\d+)$")
_RANK_DIR = re.compile(r"^rank_(\d+)$")

__all__ = [
    "FORMAT",
    "RecordError",
    "Run",
    "ActivationKey",
    "load_run",
    "resolve_runs",
    "pair_runs",
    "pair_step",
    "rel_diff",
    "format_step",
    "merge",
    "run",
    "main",
]


class RecordError(ValueError):
    """Bad statistics input: the message names the path and what was expected."""

    def __init__(self, path: str | os.PathLike[str], problem: str, expected: str | None = None) -> None:
        self.path = Path(path)
        self.problem = problem
        self.expected = expected
        message = f"{path}: {problem}"
        if expected:
            message += f"; expected {expected}"
        super().__init__(message)


# An activation is identified within a step by (kind, name, occurrence): the same module called twice in a step
# gives two records with the same name, told apart by how many came before it in execution order.
ActivationKey = tuple[str, str, int]


@dataclass
class Run:
    """One rank's statistics records: ``steps[step]`` is the list of records in execution order."""

    path: Path
    meta: dict[str, Any]
    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.meta.get("rank", 0))

    @property
    def source(self) -> str:
        return str(self.meta.get("source", "?"))

    def keyed(self, step: int) -> dict[ActivationKey, dict[str, Any]]:
        """The records of ``step`` keyed by (kind, name, occurrence), in execution order."""
        seen: dict[tuple[str, str], int] = {}
        out: dict[ActivationKey, dict[str, Any]] = {}
        for rec in self.steps.get(step, []):
            base = (rec["kind"], rec["name"])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out[(rec["kind"], rec["name"], n)] = rec
        return out


def _read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecordError(path, "file not found", what) from None
    except OSError as e:
        raise RecordError(path, f"cannot read ({e.strerror or e})", what) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(path, f"malformed JSON ({e.msg} at line {e.lineno} column {e.colno})", what) from None


def _read_json_lines(path: Path) -> list[Any]:
    """The records of a ``records.jsonl`` file, one JSON object a line."""
    what = "activation statistics records, one JSON object a line"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RecordError(path, f"cannot read ({e.strerror or e})", what) from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RecordError(path, f"malformed JSON at line {number} ({e.msg})", what) from None
    return out


def _check_format(path: Path, data: Any, what: str) -> None:
    if not isinstance(data, dict):
        raise RecordError(path, f"not a JSON object (got {type(data).__name__})", what)
    if data.get("format") != FORMAT:
        raise RecordError(
            path, f"record format {data.get('format')!r} is not supported", f'{what} with "format": {FORMAT}'
        )


def _check_record(path: Path, rec: Any, step: int) -> dict[str, Any]:
    what = "an activation statistics record"
    _check_format(path, rec, what)
    missing = [k for k in RECORD_FIELDS if k not in rec]
    if missing:
        raise RecordError(
            path, f"missing field(s) {', '.join(missing)}", f"{what} with fields {', '.join(RECORD_FIELDS)}"
        )
    if rec["kind"] not in KINDS:
        raise RecordError(path, f"unknown kind {rec['kind']!r}", "kind 'forward' or 'backward'")
    if not isinstance(rec["order"], int) or isinstance(rec["order"], bool):
        raise RecordError(path, f"order {rec['order']!r} is not an integer", "an integer execution order")
    if rec["step"] != step:
        raise RecordError(path, f"record says step {rec['step']!r} but lies in step_{step}/", f"step {step}")
    return rec


def load_run(path: str | os.PathLike[str]) -> Run:
    """Read one rank's run directory (``meta.json`` + ``step_<N>/`` folders), validating every record."""
    root = Path(path)
    if not root.exists():
        raise RecordError(root, "directory not found", "a statistics run directory (meta.json and step_<N>/ folders)")
    if not root.is_dir():
        raise RecordError(root, "not a directory", "a statistics run directory (meta.json and step_<N>/ folders)")
    meta_path = root / META_FILE
    meta = _read_json(meta_path, "the run's meta.json")
    _check_format(meta_path, meta, "a run meta.json")
    run = Run(path=root, meta=meta)
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if not m or not child.is_dir():
            continue
        step = int(m.group(1))
        records = []
        for f in sorted(child.glob("*.json")):
            records.append(_check_record(f, _read_json(f, "an activation statistics record"), step))
        lines = child / RECORDS_FILE
        if lines.is_file():
            records.extend(_check_record(lines, rec, step) for rec in _read_json_lines(lines))
        records.sort(key=lambda r: r["order"])
        run.steps[step] = records
    if not run.steps:
        raise RecordError(root, "no step_<N>/ folders", "at least one step_<N>/ folder of activation records")
    return run


def _is_run_dir(p: Path) -> bool:
    return (p / META_FILE).is_file()


def resolve_runs(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> dict[int, Run]:
    """Load every rank given by ``paths``: run directories, parents of ``rank_<r>/`` run directories, or a prefix
    ``X`` of sibling run directories ``X_0``, ``X_1``, ... The rank is taken from each run's meta.json."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    dirs: list[Path] = []
    for given in paths:
        p = Path(given)
        if p.is_dir() and _is_run_dir(p):
            dirs.append(p)
            continue
        if p.is_dir():
            ranks = sorted((int(m.group(1)), c) for c in p.iterdir() if c.is_dir() and (m := _RANK_DIR.match(c.name)))
            if ranks:
                dirs.extend(c for _, c in ranks)
                continue
            if any(_STEP_DIR.match(c.name) for c in p.iterdir()):
                dirs.append(p)  # step folders without meta.json: load_run names the missing file
                continue
            raise RecordError(
                p,
                "neither a run directory nor a parent of rank_<r>/ run directories",
                "meta.json and step_<N>/ folders",
            )
        siblings = []
        if p.parent.is_dir():
            pat = re.compile(re.escape(p.name) + r"_(\d+)$")
            siblings = sorted(
                (int(m.group(1)), c) for c in p.parent.iterdir() if c.is_dir() and (m := pat.match(c.name))
            )
        if siblings:
            dirs.extend(c for _, c in siblings)
            continue
        raise RecordError(p, "directory not found", "a statistics run directory (meta.json and step_<N>/ folders)")
    runs: dict[int, Run] = {}
    for d in dirs:
        run = load_run(d)
        if run.rank in runs:
            raise RecordError(d, f"rank {run.rank} also given by {runs[run.rank].path}", "one run directory per rank")
        runs[run.rank] = run
    return runs


def pair_runs(pt: dict[int, Run], ort: dict[int, Run], pt_label: str, ort_label: str) -> list[tuple[int, Run, Run]]:
    if sorted(pt) != sorted(ort):
        raise RecordError(
            ort_label,
            f"ranks {sorted(ort)} do not match the PyTorch ranks {sorted(pt)} in {pt_label}",
            "the same ranks on both sides",
        )
    return [(r, pt[r], ort[r]) for r in sorted(pt)]


def pair_step(pt: Run, ort: Run, step: int) -> list[tuple[ActivationKey, dict[str, Any] | None, dict[str, Any] | None]]:
    """The activations of ``step`` on both sides, in execution order (the PyTorch order first, then ORT-only ones
    where they ran); a side is None when the activation is missing there."""
    a, b = pt.keyed(step), ort.keyed(step)
    keys = list(dict.fromkeys([*a, *b]))

    def order(k: ActivationKey) -> tuple[int, int]:
        if k in a:
            return (a[k]["order"], 0)
        return (b[k]["order"], 1)

    keys.sort(key=order)
    return [(k, a.get(k), b.get(k)) for k in keys]


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def rel_diff(pt_value: Any, ort_value: Any) -> float:
    """``|ort - pt| / |pt|``: 0 when equal (NaN == NaN here), inf when pt is 0 or exactly one side is NaN/None."""
    a, b = _num(pt_value), _num(ort_value)
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    if math.isinf(a) or math.isinf(b) or a == 0.0:
        return math.inf
    return abs(b - a) / abs(a)


def _fmt(v: Any) -> str:
    x = _num(v)
    if x is None:
        return "-"
    return f"{x:.6g}"


def _shape(rec: dict[str, Any]) -> str:
    return "x".join(str(d) for d in rec["shape"]) if rec.get("shape") else "scalar"


def format_step(step: int, rank: int, pt: Run, ort: Run) -> str:
    """The side-by-side text of one step."""
    stats = ("mean", "std", "min", "max")
    rows = [
        f"# step {step}  rank {rank}",
        f"# pytorch: {pt.path} (source {pt.source})",
        f"# ort:     {ort.path} (source {ort.source})",
        "# rdiff = |ort - pt| / |pt| (inf: pt is 0 or one side NaN); nan/inf = counts of NaN/Inf elements",
    ]
    header = (
        ["order", "kind", "name", "shape"]
        + [f"pt.{s}" for s in stats]
        + ["pt.nan/inf"]
        + [f"ort.{s}" for s in stats]
        + ["ort.nan/inf"]
        + [f"rdiff.{s}" for s in stats]
    )
    table = []
    one_sided = []
    for (kind, name, occ), a, b in pair_step(pt, ort, step):
        label = name if occ == 0 else f"{name}#{occ}"
        if a is None or b is None:
            rec = a if a is not None else b
            side = "pytorch" if a is not None else "ort"
            one_sided.append(f"{rec['order']:>5}  {kind:<8}  {label}  ({_shape(rec)})  only in {side}")
            row = [str(rec["order"]), kind, label, _shape(rec)]
            filler = ["-"] * (len(stats) + 1)
            vals = [_fmt(rec[s]) for s in stats] + [f"{rec['nans']}/{rec['infs']}"]
            row += (vals + filler) if a is not None else (filler + vals)
            row += [f"only-{side}"] + [""] * (len(stats) - 1)
            table.append(row)
            continue
        shape = _shape(a) if a["shape"] == b["shape"] else f"{_shape(a)}|{_shape(b)}"
        row = [str(a["order"]), kind, label, shape]
        row += [_fmt(a[s]) for s in stats] + [f"{a['nans']}/{a['infs']}"]
        row += [_fmt(b[s]) for s in stats] + [f"{b['nans']}/{b['infs']}"]
        row += [f"{rel_diff(a[s], b[s]):.3e}" for s in stats]
        table.append(row)
    rows.append(format_table(header, table, indent=""))
    if one_sided:
        rows.append("")
        rows.append(f"# {len(one_sided)} activation(s) present on one side only:")
        rows.extend("# " + line for line in one_sided)
    return "\n".join(rows) + "\n"


def merge(
    pt_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    ort_dir: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
) -> list[Path]:
    """Write ``<output_dir>[/rank_<r>]/step_<N>.txt`` for every step of either run; returns the written paths.

    The ``rank_<r>/`` level appears only when there is more than one rank. Raises :class:`RecordError` on bad input
    before writing anything.
    """
    pt_runs, ort_runs = resolve_runs(pt_dir), resolve_runs(ort_dir)
    pairs = pair_runs(pt_runs, ort_runs, _label(pt_dir), _label(ort_dir))
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise RecordError(out, "exists and is not a directory", "an output directory")
    texts: list[tuple[Path, str]] = []
    for rank, pt, ort in pairs:
        base = out / f"rank_{rank}" if len(pairs) > 1 else out
        for step in sorted(set(pt.steps) | set(ort.steps)):
            texts.append((base / f"step_{step}.txt", format_step(step, rank, pt, ort)))
    for path, text in texts:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)
    return [p for p, _ in texts]


def _label(paths: Any) -> str:
    if isinstance(paths, str | os.PathLike):
        return str(paths)
    return ", ".join(str(p) for p in paths)


def run(args: argparse.Namespace) -> int:
    """Run ``ortcore merge-activation-summary`` with parsed arguments; 0 on success, 2 on bad input."""
    try:
        written = merge(args.pt_dir, args.ort_dir, args.output_dir)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} summary file(s) to {args.output_dir}")
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    """``ortcore merge-activation-summary`` as a function: 0 on success, 2 on bad input."""
    from .arguments import merge_parser

    return run(merge_parser().parse_args(None if argv is None else list(argv)))


if __name__ == "__main__":
    sys.exit(main())
