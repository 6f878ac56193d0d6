"""Write ``docs/models.md`` from the model zoo, a column per exporter ("route"): status, why a model fails, ops run
by PyTorch and why, step time against eager.

Each route's results are kept in ``tests/zoo/records/<exporter>.json`` (one row per model); the page is rendered
from the records of every route, so one route can be rerun while the other's column stays as recorded.

python -m tests.zoo.report                          # run every model on both routes, then write the page
python -m tests.zoo.report --exporter dynamo        # rerun the dynamo route only (the torchscript column is kept)
python -m tests.zoo.report --exporter dynamo --models bert,gpt2   # rerun these models on that route only
python -m tests.zoo.report --exporter torchscript --results DIR   # record an earlier run's JSON (the pytest zoo)
python -m tests.zoo.report --render                 # rewrite the page from the records, running nothing
python -m tests.zoo.report --catalog wide --exporter torchscript   # the wide zoo (records/wide/), its section
python -m tests.zoo.report --catalog third --exporter torchscript  # the third zoo (records/third/), its section
python -m tests.zoo.report --autocast bf16          # the main zoo under torch.autocast (records/autocast-bf16.json)
python -m tests.zoo.report --autocast fp16 --models bert,gpt2     # a few models under float16 autocast

The wide zoo (``catalog_wide``) has its records in ``records/wide/`` and its own section at the end of the page;
the third zoo (``catalog_third``) likewise in ``records/third/``, its section after the wide zoo's.
Under ``--autocast`` each model of the main zoo runs one step with its forward under ``torch.autocast("cpu", ...)``
on the default route, judged against eager autocast and float64 (``tests.zoo.autocast``); each type's record is
``records/autocast-<type>.json`` and has its own section ("Under bf16 autocast") after the wide zoo's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tests.zoo` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.zoo.autocast import DTYPES as AUTOCAST_TYPES  # noqa: E402
from tests.zoo.autocast import EAGER_FACTOR, FLOOR_ROUNDINGS, UNIT_ROUNDOFF  # noqa: E402
from tests.zoo.autocast import check_dtype as check_autocast  # noqa: E402
from tests.zoo.autocast import describe as describe_autocast  # noqa: E402
from tests.zoo.catalog import MODELS  # noqa: E402
from tests.zoo.catalogs import CATALOGS, DEFAULT_CATALOG, models  # noqa: E402
from tests.zoo.deps import ensure_torchvision  # noqa: E402
from tests.zoo.failures import BY_KEY, categorize, failure_op  # noqa: E402
from tests.zoo.harness import EXPORTERS, REPO, check_exporter, describe_failure, run_model, source_commit  # noqa: E402
from tests.zoo.run_model import ATOL, F64_FACTOR, LR, PERTURBED_RUNS, RTOL, TIMED_STEPS, TRAIN_STEPS  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "models.md"
RECORDS = Path(__file__).resolve().parent / "records"
REGENERATE = "python -m tests.zoo.report"
WIDE = "wide"
THIRD = "third"
#: A model that passes with less than this share of its training graph's nodes on ORT's kernels runs mostly in
#: PyTorch: the zoo's test fails it (ortcore would then be a slower PyTorch).
MIN_ORT_OP_SHARE = 0.5


def run_all(
    names: list[str],
    out_dir: Path,
    exporter: str = EXPORTERS[0],
    log: bool = True,
    catalog: str = DEFAULT_CATALOG,
    autocast: str | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Run ``names`` of ``catalog`` on ``exporter``'s route (under ``autocast``, if given), one process each, into
    ``out_dir``; return the results and the total wall time in seconds."""
    if any(models(catalog)[n].family == "torchvision" for n in names):
        ensure_torchvision()
    results = []
    t0 = time.perf_counter()
    for name in names:
        result = run_model(name, out_dir, exporter=exporter, catalog=catalog, autocast=autocast)
        results.append(result)
        if log:
            why = describe_autocast(result) if autocast else describe_failure(result)
            print(
                f"{exporter + ('/' + autocast if autocast else ''):11s} {name:22s} {result['status']:9s} "
                f"{result.get('wall_s', 0):6.1f} s  {why[:150]}",
                file=sys.stderr,
                flush=True,
            )
    return results, time.perf_counter() - t0


def read_results(
    directory: Path,
    names: list[str],
    exporter: str = EXPORTERS[0],
    catalog: str = DEFAULT_CATALOG,
    autocast: str | None = None,
) -> list[dict[str, Any]]:
    """The results found in ``directory`` for ``names``; a model without a result file is listed as not run.

    A result another exporter produced, or one run under another autocast type (or without autocast when
    ``autocast`` is given, or the other way round), is refused (it would land in the wrong record).
    """
    results = []
    for name in names:
        path = directory / f"{name}.json"
        if path.is_file():
            result = json.loads(path.read_text())
            if result.get("exporter", EXPORTERS[0]) != exporter:
                raise ValueError(
                    f"{path} holds a result of the {result.get('exporter')!r} exporter, not {exporter!r}; "
                    f"pass --exporter {result.get('exporter')}"
                )
            if result.get("autocast") != autocast:
                found = result.get("autocast") or "no autocast"
                raise ValueError(f"{path} holds a result run under {found}, not {autocast or 'no autocast'}")
            results.append(result)
        else:
            spec = models(catalog)[name]
            results.append(
                {
                    "model": name,
                    "family": spec.family,
                    "description": spec.description,
                    "status": "not run",
                    "error": {"first_line": f"no {path.name} in {directory}"},
                    **({"autocast": autocast} if autocast else {}),
                }
            )
    return results


def _fmt(x: Any, spec: str = ".1e") -> str:
    return format(x, spec) if isinstance(x, int | float) else str(x)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _margin(result: dict[str, Any]) -> str:
    """The largest ``|diff| / (atol + rtol·|eager|)`` over the loss, gradients and curve (1 is the float32 limit);
    ``f64`` marks that a value over 1 was then judged against float64."""
    checks = result.get("checks")
    if not checks:
        return "-"
    entries = [checks["loss"], *checks["grads"].values(), *checks["curve"]]
    # A gradient both sides leave as None has no ratio; a non-finite one is stored as a string and is the worst.
    entries = [c for c in entries if "tol_ratio" in c]
    if not entries:
        return "-"
    worst = max(entries, key=lambda c: c["tol_ratio"] if isinstance(c["tol_ratio"], int | float) else math.inf)
    text = _fmt(worst.get("tol_ratio"), ".2g")
    return text + (" (f64)" if worst.get("judged_by") == "float64" else "")


def _routed(result: dict[str, Any]) -> str:
    routed = result.get("routed_ops")
    if routed is None:
        return "-"
    if not routed:
        return "none"
    by_reason: dict[str, list[str]] = {}
    for r in routed:
        by_reason.setdefault(r.get("reason", "?"), []).append(f"{r['op']}×{r.get('count', '?')}")
    return "; ".join(f"{', '.join(ops)} ({reason})" for reason, ops in by_reason.items())


def _pytorch_functions(result: dict[str, Any]) -> str:
    """The autograd Functions and routed regions that run as PythonOps (explain() lists them under ORT)."""
    nodes = (result.get("ort_op_share") or {}).get("pytorch_nodes") or {}
    found = [f"{op.split(':', 1)[1].rpartition('.')[2]}×{n}" for op, n in nodes.items() if op.startswith("PythonOp:")]
    return ", ".join(found)


def _share(result: dict[str, Any], key: str) -> float | None:
    share = (result.get(key) or {}).get("share")
    return share if isinstance(share, int | float) else None


def _step(result: dict[str, Any]) -> str:
    st = result.get("step_s")
    if not st:
        return "-"
    return f"{st['eager'] * 1e3:.1f} / {st['ortcore'] * 1e3:.1f} ms (×{result['step_ratio']:.2f})"


def _versions() -> str:
    import onnxruntime
    import torch
    import transformers

    return f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, transformers {transformers.__version__}"


def row(result: dict[str, Any], commit: str) -> dict[str, Any]:
    """What the page shows of one model's result on one route (a record's row)."""
    category = categorize(result)
    err = result.get("error") or {}
    first_error = ""
    if result["status"] not in ("pass", "mismatch"):
        first_error = f"{err.get('type')}: {err.get('first_line')}" if err.get("type") else str(err.get("first_line"))
    return {
        "model": result["model"],
        "family": result["family"],
        "description": result.get("description", ""),
        "status": result["status"],
        "phase": result.get("phase"),
        "category": category.key if category else None,
        "op": failure_op(result) if category else None,
        "first_error": first_error,
        "reason": describe_failure(result),
        "margin": _margin(result),
        "routed": _routed(result),
        "python_ops": _pytorch_functions(result),
        "repairs": [str(r)[:240] for r in result.get("repairs") or []],
        "ort_op_share": _share(result, "ort_op_share"),
        "ort_time_share": _share(result, "ort_time_share"),
        "ort_param_share": (result.get("ort_op_share") or {}).get("param_share"),
        "curve_judged_by_perturbed": any(
            c.get("judged_by") == "perturbed eager" for c in (result.get("checks") or {}).get("curve", [])
        ),
        "kinks_flipped": len((result.get("kinks") or {}).get("flips", []))
        if (result.get("kinks") or {}).get("explained")
        else 0,
        "step": _step(result),
        "step_ratio": result.get("step_ratio"),
        "first_step_s": result.get("ortcore_first_step_s"),
        "load_average": result.get("load_average"),
        "wall_s": result.get("wall_s"),
        "commit": result.get("commit") or commit,
    }


def make_record(
    exporter: str,
    results: list[dict[str, Any]],
    wall_s: float,
    how: str,
    commit: str,
    previous: dict | None = None,
    catalog: str = DEFAULT_CATALOG,
) -> dict[str, Any]:
    """A route's record: ``previous`` (if any) with the rows of ``results`` replaced, and this run's particulars."""
    rows = dict(previous["models"]) if previous else {}
    rows.update({r["model"]: row(r, commit) for r in results})
    # Catalog order; a model no longer in the catalog is dropped.
    rows = {name: rows[name] for name in models(catalog) if name in rows}
    return {
        "exporter": exporter,
        "commit": commit,
        "versions": _versions(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "how": how,
        "wall_s": wall_s,
        "models_run": len(results),
        "models": rows,
    }


def record_path(exporter: str, records: Path = RECORDS, catalog: str = DEFAULT_CATALOG) -> Path:
    """Where a route's record of ``catalog`` is kept: ``records/<route>.json`` for the main zoo,
    ``records/<catalog>/<route>.json`` for another."""
    base = records if catalog == DEFAULT_CATALOG else records / catalog
    return base / f"{check_exporter(exporter)}.json"


def load_records(records: Path = RECORDS, catalog: str = DEFAULT_CATALOG) -> dict[str, dict[str, Any]]:
    """The record of every route that has one for ``catalog``, in ``EXPORTERS`` order."""
    found = {}
    for exporter in EXPORTERS:
        path = record_path(exporter, records, catalog)
        if path.is_file():
            found[exporter] = json.loads(path.read_text())
    return found


def _status_cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    if r["status"] == "pass":
        return "✅ pass"
    category = BY_KEY.get(r.get("category") or "other", BY_KEY["other"])
    op = f" (`{r['op']}`)" if r.get("op") and category.key != "mismatch" else ""
    return f"❌ {r['status']}: {category.label}{op}"


def documented_statuses(text: str) -> dict[str, dict[str, str]]:
    """Per route, per model, the status the page's results table shows (``pass``, ``error``, ``mismatch``, ...).

    The dynamo zoo test compares a fresh run with these, so the page is the record of what each route does.
    """
    lines = text.splitlines()
    try:
        start = lines.index("## Results")
    except ValueError:
        raise ValueError("the page has no '## Results' section; regenerate it with " + REGENERATE) from None
    header = next(line for line in lines[start:] if line.startswith("| model |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    routes = [c for c in columns if c in EXPORTERS]
    statuses: dict[str, dict[str, str]] = {route: {} for route in routes}
    for line in lines[lines.index(header, start) + 2 :]:
        if not line.startswith("|"):
            break
        cells = dict(zip(columns, (c.strip() for c in line.strip("|").split("|"))))
        for route in routes:
            cell = cells[route].removeprefix("✅").removeprefix("❌").strip()
            statuses[route][cells["model"]] = cell.split(":")[0].strip()
    return statuses


def _counts(rows: dict[str, dict[str, Any]]) -> str:
    counts: dict[str, int] = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    passed = counts.pop("pass", 0)
    rest = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return f"{passed}/{len(rows)} pass" + (f" ({rest})" if rest else "")


def _first_error(r: dict[str, Any]) -> str | None:
    """A record row's first error line; None where the model raised nothing (older rows hold the string 'None')."""
    line = r.get("first_error")
    return None if line in (None, "", "None") else line


def _causes(exporter: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """The failures of one route grouped by cause, with each model's first error line and the cause's repro."""
    by_category: dict[str, list[dict[str, Any]]] = {}
    for r in rows.values():
        if r["status"] != "pass":
            by_category.setdefault(r.get("category") or "other", []).append(r)
    if not by_category:
        return []
    lines = [f"### Why models fail on the {exporter} route", ""]
    for key, failed in sorted(by_category.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        category = BY_KEY.get(key, BY_KEY["other"])
        names = ", ".join(r["model"] for r in failed)
        lines += [f"**{category.label}** ({len(failed)}: {names}). {category.cause}", ""]
        for r in failed:
            line = _first_error(r) or r["reason"]
            lines.append(f"- {r['model']}: `{_cell(line[:400]).replace('`', chr(39))}`")
        if category.repro:
            lines += [
                "",
                "<details><summary>minimal repro</summary>",
                "",
                "```python",
                category.repro.rstrip(),
                "```",
                "",
                "</details>",
            ]
        lines.append("")
    return lines


def render(records: dict[str, dict[str, Any]]) -> str:
    """The markdown page for the routes' ``records`` (see ``make_record``)."""
    routes = list(records)
    names = [n for n in MODELS if any(n in rec["models"] for rec in records.values())]
    default = EXPORTERS[0]
    lines = [
        "# Model zoo",
        "",
        f"<!-- Generated by `{REGENERATE}` from tests/zoo/records/; do not edit by hand. -->",
        "",
        f"{len(names)} models trained under ortcore with `ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE` (a failure "
        "raises instead of running PyTorch), each in its own process, against eager PyTorch on a deep copy with the "
        "same random initial weights, on each exporter (route): "
        + ", ".join(f"`{e}`" + (" (the default)" if e == default else "") for e in routes)
        + ". Tiny configs (hidden 32-64, 2 layers, vocabulary 128, batch 4, sequence 8-16; torchvision models at "
        "their real size with 96×96 images), every dropout off, no downloads.",
        "",
        " · ".join(f"**{e}: {_counts(records[e]['models'])}**" for e in routes),
        "",
        "## Results",
        "",
        "| model | family | " + " | ".join(routes) + " |",
        "|---|---|" + "---|" * len(routes),
    ]
    for name in names:
        first = next(rec["models"][name] for rec in records.values() if name in rec["models"])
        cells = [_cell(_status_cell(records[e]["models"].get(name))) for e in routes]
        lines.append(f"| {name} | {first['family']} | " + " | ".join(cells) + " |")
    lines.append("")
    for e in routes:
        lines += _causes(e, records[e]["models"])
    lines += [
        "## Routes and what the tests require",
        "",
        "- *torchscript* (`torch.onnx.export(dynamo=False)`, ortcore's default) and *dynamo* (`torch.export` + "
        "onnxscript, the `dynamo_exporter` plugin), chosen with `ORTModule(model, exporter=...)` or "
        "`ORTCORE_EXPORTER`; the zoo sets `ORTCORE_EXPORTER` in each model's process.",
        "- `python -m pytest tests/zoo -m slow` runs the default route and requires every model to pass.",
        "- `python -m pytest tests/zoo -m slow --exporter dynamo` runs the dynamo route and requires each model's "
        "status to be the one the table above shows for it, pass or not: a model that breaks fails the test, and so "
        "does one that starts to pass (the message names both statuses). An improvement is recorded by rerunning the "
        f"route (`{REGENERATE} --exporter dynamo`) and committing the page with the change that caused it; a "
        "regression is fixed, or recorded the same way if accepted. So the table always says what the route does, "
        "and no model has to pass for the suite to be green. Only the status is compared: the error line may change "
        "while a model keeps failing.",
        "- A fast test (`tests/zoo/test_report.py`, not slow) checks that this page is what the records in "
        "`tests/zoo/records/` render to, so neither is edited alone.",
        "- Each cause's minimal repro runs with `python -m tests.zoo.failures` (and as slow tests in "
        "`tests/zoo/test_report.py`): a repro that stops failing means the exporter fixed that cause.",
        "",
        "## What is checked",
        "",
        "- One step: the loss and every parameter's gradient, elementwise "
        f"`|ortcore - eager| <= {ATOL:g} + {RTOL:g}·|eager|` (float32). A tensor failing that passes only if "
        f"ortcore is within {F64_FACTOR:g}× as far (max abs) from a float64 eager run as float32 eager is "
        "(float32 itself is ill-conditioned there; e.g. batch norm over few values per channel).",
        f"- {TRAIN_STEPS} AdamW steps (lr {LR:g} unless a model's description names its own): the loss before and "
        "after each update, judged the same way.",
        "- A model with batch norm in training mode is also run in float32 eager on its batch with the rows "
        "reversed and every input value moved by one unit in the last place (other summation orders and "
        "roundings); a point of its AdamW curve that fails the above passes "
        f"if ortcore is within {F64_FACTOR:g}× as far from eager as that run is: batch norm over few values per "
        "channel amplifies float32 rounding, and AdamW moves each element by about lr whatever its gradient's size.",
        "- The step ran in ONNX Runtime (one export, no fallback), and a model that passes runs at least "
        f"{MIN_ORT_OP_SHARE:.0%} of its training graph's nodes on ORT's kernels (not ATen or PythonOp nodes) and "
        f"feeds at most {1 - MIN_ORT_OP_SHARE:.0%} of its parameters (by elements) to PythonOps (custom Functions, "
        "regions routed to PyTorch).",
        "- *worst diff / tol.*: the largest `|ortcore - eager| / (atol + rtol·|eager|)` over the loss, every "
        "gradient and the curve; at most 1 passes in float32, `(f64)` marks a value then judged against float64.",
        "- *ops on PyTorch*: ops that run as PyTorch kernels inside ortcore's graph (ATen / PythonOp nodes, or "
        "`ORTModule.explain()` when available) and why.",
        f"- *step*: median of {TIMED_STEPS} interleaved steady training steps (forward, loss, backward, AdamW), "
        "eager / ortcore, and the ratio ortcore ÷ eager (below 1: ortcore faster). Tiny models measure fixed "
        "per-step costs more than kernels; the machine is shared, so treat ratios as rough: with a load average "
        "above the core count, one model's eager step measured 2.9 ms and 42 ms in consecutive runs (see *Runs*).",
        "",
    ]
    for e in routes:
        rows = records[e]["models"]
        lines += [
            f"## Details: {e} route",
            "",
            "| model | status | worst diff / tol. | ops on PyTorch (why) | step eager / ortcore | first step |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows.values():
            status = "✅ pass" if r["status"] == "pass" else f"❌ {r['status']}"
            first = f"{r['first_step_s']:.2f} s" if isinstance(r.get("first_step_s"), float) else "-"
            lines.append(f"| {r['model']} | {status} | {r['margin']} | {_cell(r['routed'])} | {r['step']} | {first} |")
        failing = [r for r in rows.values() if r["status"] != "pass"]
        if failing:
            lines += ["", f"Why each model fails on the {e} route:", ""]
            lines += [f"- **{r['model']}** ({_cell(r['description'])}): {_cell(r['reason'])}" for r in failing]
        lines.append("")
    lines += ["## Runs", ""]
    for e in routes:
        rec = records[e]
        rows = rec["models"]
        ratios = sorted(r["step_ratio"] for r in rows.values() if isinstance(r.get("step_ratio"), int | float))
        load = [r["load_average"] for r in rows.values() if isinstance(r.get("load_average"), int | float)]
        firsts = sorted(r["first_step_s"] for r in rows.values() if isinstance(r.get("first_step_s"), int | float))
        commits = sorted({r["commit"] for r in rows.values()})
        lines.append(
            f"- **{e}**: {rec['how']}; total wall time {rec['wall_s'] / 60:.1f} min for {rec['models_run']} models"
            + (f"; load average during the runs {min(load):.1f}-{max(load):.1f}" if load else "")
            + (
                f"; step-time ratio ortcore ÷ eager median {ratios[len(ratios) // 2]:.2f}, range "
                f"{ratios[0]:.2f}-{ratios[-1]:.2f} over the {len(ratios)} models that ran"
                if ratios
                else "; no model ran to the timing phase"
            )
            + (f"; first step (export, build, run) median {firsts[len(firsts) // 2]:.2f} s" if firsts else "")
            + f". ortcore at {', '.join(commits)}; {rec['versions']}; {rec['machine']}; generated {rec['generated']}."
        )
    lines += [
        "",
        "## Regenerating",
        "",
        f"- Both routes: `{REGENERATE}` (runs every model on each route, one process at a time, writes "
        "`tests/zoo/records/<route>.json` and this page).",
        f"- One route: `{REGENERATE} --exporter dynamo` (the other column is kept as recorded); a few models: "
        "add `--models bert,gpt2`.",
        "- From a test run: `ORTCORE_ZOO_RESULTS=DIR python -m pytest tests/zoo -m slow [--exporter dynamo]`, then "
        f"`{REGENERATE} --exporter <route> --results DIR`. The page alone: `{REGENERATE} --render`.",
        "- One model by hand: `ORTCORE_EXPORTER=dynamo python -m tests.zoo.run_model <name>`.",
        "",
    ]
    return "\n".join(lines)


def _percent(x: Any) -> str:
    return f"{x:.0%}" if isinstance(x, int | float) else "-"


def _cause(r: dict[str, Any]) -> str:
    """Why a wide-zoo model did not pass, in a line: its cause's label and first error line, or the mismatch."""
    if r["status"] == "pass":
        return ""
    category = BY_KEY.get(r.get("category") or "other", BY_KEY["other"])
    text = r["reason"] if r["status"] == "mismatch" else (_first_error(r) or r["reason"])
    label = "" if category.key in ("other", "mismatch") else f"{category.label}: "
    return label + text[:300].replace("`", "'")


def _mostly_pytorch(r: dict[str, Any]) -> bool:
    """Whether a record's row runs mostly in PyTorch: too few nodes on ORT, or PythonOps taking most parameters."""
    shares = [r.get("ort_op_share"), r.get("ort_param_share")]
    return any(isinstance(x, int | float) and x < MIN_ORT_OP_SHARE for x in shares)


def render_wide(records: dict[str, dict[str, Any]]) -> str:
    """The wide zoo's section of the page, from its routes' ``records`` (``records/wide/<route>.json``)."""
    catalog = models(WIDE)
    return "\n".join(_wide_intro(catalog) + _zoo_tables(WIDE, "Wide zoo", records))


def _wide_intro(catalog: dict[str, Any]) -> list[str]:
    return [
        "## Wide zoo",
        "",
        f"A second zoo of {len(catalog)} models, none of them in the table above, chosen for variety of ops "
        "(`tests/zoo/catalog_wide.py`; each entry's description says what it exercises): other Hugging Face "
        "families of text, vision and speech, more torchvision classifiers, and plain-torch patterns. Run and "
        "judged as above, plus two numbers per model: *ORT op share*, the share of the training graph's nodes "
        "(forward and backward, `YieldOp` left out) that run on ORT's kernels, i.e. that are not "
        "`org.pytorch.aten::ATen` or `com.microsoft::PythonOp`/`PythonOpGrad` nodes; *ORT param share*, the share of parameter elements "
        "that no PythonOp takes (a region routed to PyTorch is one node however much of the model it holds); and "
        "*ORT time share*, the "
        "share of a step's kernel time spent in ORT's kernels (op_profiler plugin, 2 profiled steps). A model "
        "with batch norm in training mode is also run in float32 eager on its batch with the rows reversed and "
        "every input value moved by one ulp (other summation orders and roundings); a point of its AdamW curve that fails the tolerance passes if "
        f"ortcore is within {F64_FACTOR:g}× as far from eager as that run is (marked *curve vs perturbed eager*). "
        "A first-step gradient of such a model that fails both checks passes if float64, with a few ReLU inputs "
        "lying within rounding of zero taken on the other side of the kink (`ortcore_plugins.gradient_audit.kinks`), comes within "
        f"{F64_FACTOR:g}× float32 eager's own distance of ortcore's (marked *first step: N ReLU kinks*): batch norm "
        "spreads one such element's gradient over its whole channel, and which side a float32 run takes is chance.",
        "",
        "`python -m pytest tests/zoo -m slow -k wide` runs it: each model's status must be the one recorded here "
        "(as for the dynamo route above), and a model that passes must run at least "
        f"{MIN_ORT_OP_SHARE:.0%} of its graph's nodes on ORT and keep at least {MIN_ORT_OP_SHARE:.0%} of its "
        "parameters out of PythonOps, or its status is `pytorch` (PyTorch's gradients, mostly run in PyTorch). Rerun "
        "and record: "
        f"`{REGENERATE} --catalog wide --exporter torchscript`.",
        "",
    ]


def _zoo_tables(catalog_name: str, title: str, records: dict[str, dict[str, Any]]) -> list[str]:
    """Per route of ``records``, a table of ``catalog_name``'s models (status, what runs on PyTorch, ORT shares,
    cause of failure), the failures grouped by cause, and the run's particulars; headings start with ``title``."""
    catalog = models(catalog_name)
    lines: list[str] = []
    for e, rec in records.items():
        rows = rec["models"]
        mostly = [n for n, r in rows.items() if r["status"] == "pytorch" or (r["status"] == "pass" and _mostly_pytorch(r))]
        lines += [
            f"### {title}, {e} route: {_counts(rows)}"
            + (f"; {len(mostly)} with PyTorch's gradients run mostly in PyTorch ({', '.join(mostly)})" if mostly else ""),
            "",
            "| model | family | exercises | status | on PyTorch inside the graph (why) | ORT op share "
            "| ORT param share | ORT time share | cause of failure |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in catalog:
            r = rows.get(name)
            if r is None:
                continue
            routed = r["routed"]
            # Older explain() listed PythonOps under ORT: name the Functions the routed ops do not.
            missing = [f for f in (r.get("python_ops") or "").split(", ") if f and f.split("×")[0] not in routed]
            if missing:
                routed = ("" if routed in ("none", "-") else routed + "; ") + f"PythonOp {', '.join(missing)}"
            if r.get("repairs"):
                routed += "; repaired: " + "; ".join(r["repairs"])
            status = _status_cell(r).split(":")[0]
            if r.get("curve_judged_by_perturbed"):
                status += " (curve vs perturbed eager)"
            if r.get("kinks_flipped"):
                status += f" (first step: {r['kinks_flipped']} ReLU kinks)"
            if r["status"] == "pass" and _mostly_pytorch(r):
                status += " ⚠️ mostly in PyTorch"
            lines.append(
                f"| {name} | {r['family']} | {_cell(r['description'])} | {status} | {_cell(routed)} "
                f"| {_percent(r.get('ort_op_share'))} | {_percent(r.get('ort_param_share'))} "
                f"| {_percent(r.get('ort_time_share'))} | {_cell(_cause(r))} |"
            )
        lines.append("")
        causes = _causes(e, rows)
        if causes:
            causes[0] = f"#### {title}: why models fail on the {e} route"
            lines += causes
        commits = sorted({r["commit"] for r in rows.values()})
        lines += [
            f"{rec['how']}; total wall time {rec['wall_s'] / 60:.1f} min for {rec['models_run']} models. ortcore at "
            f"{', '.join(commits)}; {rec['versions']}; {rec['machine']}; generated {rec['generated']}.",
            "",
        ]
    return lines


def render_third(records: dict[str, dict[str, Any]]) -> str:
    """The third zoo's section of the page, from its routes' ``records`` (``records/third/<route>.json``)."""
    catalog = models(THIRD)
    families: dict[str, int] = {}
    for spec in catalog.values():
        families[spec.family] = families.get(spec.family, 0) + 1
    lines = [
        "## Third zoo",
        "",
        f"A third zoo of {len(catalog)} models that neither table above has "
        f"({', '.join(f'{n} {f}' for f, n in families.items())}; `tests/zoo/catalog_third.py`, each entry's "
        "description says what it exercises), picked as a user meeting ortcore for the first time would bring them: "
        "Hugging Face families of layout and markup text, protein, long-input and mixture-of-experts seq2seq, "
        "decoders with multipliers, query-key norms, latent attention, state-space and hybrid layers, video, "
        "conformer speech and time-series forecasters (which return their scaling, loc and scale, beside the "
        "loss); an Inception net, a segmentation head and a video net from torchvision; and plain-torch patterns "
        "written by hand: a VAE, a normalizing flow, linear algebra, mixtures of experts, CTC, adaptive softmax, "
        "scans, buffers written in `forward` by the top module (an EMA codebook, running statistics, a step "
        "counter), packed sequences, reentrant and non-reentrant activation checkpointing, list-returning ops, "
        "and a forward that returns the tensors its backward keeps. Randomness a model would draw in `forward` "
        "(reparameterization and Gumbel noise, MAE's patch shuffle) comes with the batch, so both sides compute "
        "the same function. Judged as the wide zoo (same columns, same rules). A model whose float64 copy cannot "
        "run (a kernel without a float64 version) is judged by float32 alone.",
        "",
        "`python -m pytest tests/zoo -m slow -k third` runs it: each model's status must be the one recorded here. "
        f"Rerun and record: `{REGENERATE} --catalog third --exporter torchscript` (and `--exporter dynamo`).",
        "",
    ]
    lines += _zoo_tables(THIRD, "Third zoo", records)
    return "\n".join(lines)


# -- under autocast ------------------------------------------------------------------------------------------------

#: The words each autocast type has on the page.
AUTOCAST_NAMES = {"bf16": ("bfloat16", "bf16"), "fp16": ("float16", "fp16")}


def autocast_record_path(dtype: str, records: Path = RECORDS) -> Path:
    """Where the main zoo's record under ``dtype`` autocast is kept: ``records/autocast-<dtype>.json``."""
    return records / f"autocast-{check_autocast(dtype)}.json"


def load_autocast_records(records: Path = RECORDS) -> dict[str, dict[str, Any]]:
    """The record of every autocast type that has one, in ``tests.zoo.autocast.DTYPES`` order."""
    found = {}
    for dtype in AUTOCAST_TYPES:
        path = autocast_record_path(dtype, records)
        if path.is_file():
            found[dtype] = json.loads(path.read_text())
    return found


def _ops_on_pytorch(result: dict[str, Any]) -> str:
    """The op kinds that run on PyTorch's kernels inside the graph, with their counts (no reasons: under autocast
    the matrix products are there by design)."""
    routed = result.get("routed_ops")
    if routed is None:
        return "-"
    return ", ".join(f"{r['op']}×{r.get('count', '?')}" for r in routed) or "none"


def autocast_row(result: dict[str, Any], commit: str) -> dict[str, Any]:
    """What the page shows of one model's result under autocast (a row of ``records/autocast-<type>.json``)."""
    checks = result.get("checks") or {}
    loss = checks.get("loss") or {}
    err = result.get("error") or {}
    first_error = ""
    if result["status"] not in ("pass", "mismatch", "pytorch"):
        first_error = f"{err.get('type')}: {err.get('first_line')}" if err.get("type") else str(err.get("first_line"))
    grads = checks.get("grads") or {}
    dtypes = result.get("loss_dtype") or {}
    return {
        "model": result["model"],
        "family": result["family"],
        "description": result.get("description", ""),
        "status": result["status"],
        "phase": result.get("phase"),
        "first_error": first_error,
        "reason": describe_autocast(result),
        "worst_ratio": result.get("worst_ratio"),
        "grads_ok": sum(bool(c.get("ok")) for c in grads.values()) if grads else None,
        "grads": len(grads) if grads else None,
        "loss_vs_f64": {k: loss.get(k) for k in ("ortcore_vs_f64", "eager_vs_f64", "allowed")} if loss else None,
        "loss_dtype": dtypes or None,
        "reference": result.get("reference"),
        "in_ort": result.get("in_ort"),
        "clean": result.get("clean"),
        "counters": result.get("counters"),
        "fallback_reason": result.get("fallback_reason"),
        "repairs": [str(r)[:600] for r in result.get("repairs") or []],
        "on_pytorch": _ops_on_pytorch(result),
        "ort_op_share": _share(result, "ort_op_share"),
        "first_step_s": result.get("ortcore_first_step_s"),
        "wall_s": result.get("wall_s"),
        "commit": result.get("commit") or commit,
    }


def make_autocast_record(
    dtype: str,
    exporter: str,
    results: list[dict[str, Any]],
    wall_s: float,
    how: str,
    commit: str,
    previous: dict | None = None,
) -> dict[str, Any]:
    """The record of the main zoo under ``dtype`` autocast: ``previous`` (if any) with the rows of ``results``
    replaced, and this run's particulars."""
    rows = dict(previous["models"]) if previous else {}
    rows.update({r["model"]: autocast_row(r, commit) for r in results})
    rows = {name: rows[name] for name in MODELS if name in rows}
    return {
        "autocast": check_autocast(dtype),
        "exporter": exporter,
        "criterion": {
            "eager_factor": EAGER_FACTOR,
            "floor_roundings": FLOOR_ROUNDINGS,
            "unit_roundoff": UNIT_ROUNDOFF[dtype],
        },
        "commit": commit,
        "versions": _versions(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "how": how,
        "wall_s": wall_s,
        "models_run": len(results),
        "models": rows,
    }


def _autocast_counts(rows: dict[str, dict[str, Any]]) -> str:
    clean = sum(r["status"] == "pass" and bool(r.get("clean")) for r in rows.values())
    passed = sum(r["status"] == "pass" for r in rows.values())
    text = _counts(rows)
    if passed:
        text += f"; {clean} of the {passed} with no repairs"
    return text


def _autocast_status(r: dict[str, Any]) -> str:
    text = "✅ pass" if r["status"] == "pass" else f"❌ {r['status']}"
    if (r.get("reference") or "float64") != "float64":
        text += " (vs float32: no float64 kernel)"
    return text


def _autocast_in_ort(r: dict[str, Any]) -> str:
    if r.get("in_ort") is None:
        return "-"
    if not r["in_ort"]:
        return "no (fallback)"
    return "yes" + (f", {len(r['repairs'])} repair(s)" if r.get("repairs") else ", no repairs")


def _autocast_loss(r: dict[str, Any]) -> str:
    loss = r.get("loss_vs_f64")
    if not loss:
        return "-"
    text = f"{_fmt(loss['ortcore_vs_f64'])} / {_fmt(loss['eager_vs_f64'])}"
    dtypes = r.get("loss_dtype") or {}
    if dtypes.get("ortcore") != dtypes.get("eager"):
        text += f" (dtype {dtypes.get('ortcore')} vs eager {dtypes.get('eager')})"
    return text


def render_autocast(dtype: str, record: dict[str, Any]) -> str:
    """The page's section for the main zoo under ``dtype`` autocast, from its record."""
    long, short = AUTOCAST_NAMES[dtype]
    rows = record["models"]
    u = record["criterion"]["unit_roundoff"]
    factor, roundings = record["criterion"]["eager_factor"], record["criterion"]["floor_roundings"]
    lines = [
        f"## Under {short} autocast",
        "",
        f"The main zoo's {len(rows)} models with their forward (and the loss computed from its outputs) under "
        f'`torch.autocast("cpu", dtype=torch.{long})`, on the {record["exporter"]} route with '
        "`ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`, one training step each: ortcore (`ORTModule`), eager PyTorch "
        f"under the same autocast on a deep copy (*eager autocast*), and a float64 copy without autocast (the exact "
        "value), from the same random initial weights and batch (`tests/zoo/autocast.py`).",
        "",
        "- Judged: the loss and every parameter's gradient, by their distance from float64 (max abs over the tensor's "
        f"elements). One passes when `max|ortcore − float64| ≤ {factor:g}·max|eager autocast − float64| + floor`, "
        f"floor = {roundings:g}·2^{round(math.log2(u))}·`max|float64|`: ortcore may be at most {factor:g}× as far "
        f"from exact as eager autocast itself is, and is never held to less than one rounding of the tensor's "
        f"largest element to {long} (2^{round(math.log2(u))} is {long}'s unit roundoff; where eager's own error is "
        "accidentally tiny, e.g. a gradient autocast leaves in float32 throughout, a rounding more or another "
        "summation order is still autocast's accuracy). A model passes when all of them do, the step ran in ONNX "
        "Runtime (an export, no fallback) and PythonOps take at most half its parameters (with repairs in force, "
        "also at most half its graph's nodes on PyTorch: else its status is `pytorch`, as above). A model with a "
        "kernel that has no float64 version is judged by float32 eager without autocast instead (its own error, "
        "about 2^-24, is far below the floor); one that eager PyTorch itself cannot run under this autocast has the "
        "status `eager error` (nothing to judge ortcore by).",
        f"- A tensor that fails is diagnosed, not judged again: eager autocast also runs on {PERTURBED_RUNS} "
        "batches with the rows "
        "reversed and every value moved by one unit in the last place, and the cause names the farthest of those "
        "runs from float64. Where that reaches ortcore's error, eager's own error on the zoo's batch was the lucky "
        "end of its rounding spread (*rounding luck*); where it does not, ortcore is farther from exact than eager "
        "autocast lands on any of those batches.",
        "- *in ORT*: no fallback (`state_machine.counters`, `fallback_reason`), and whether repairs were needed "
        "(`model.repairs`). *on PyTorch inside the graph*: op kinds run by PyTorch's kernels as ATen or PythonOp "
        "nodes (`explain()`); under autocast the matrix products are there by design (`mixed_precision` plugin: "
        "oneDNN's low-precision GEMMs, the kernels eager autocast runs).",
        "- *worst error / allowed*: the largest `max|ortcore − float64| / allowance` over the loss and the gradients "
        "(at most 1 passes); *loss from float64*: ortcore's and eager autocast's distance.",
        "",
        f"**{short} autocast: {_autocast_counts(rows)}** (train in ORT with autocast-level accuracy)",
        "",
        "| model | family | status | worst error / allowed | gradients passing | loss from float64: ortcore / eager "
        "| in ORT | on PyTorch inside the graph | first step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        grads = f"{r['grads_ok']}/{r['grads']}" if r.get("grads") else "-"
        first = f"{r['first_step_s']:.2f} s" if isinstance(r.get("first_step_s"), int | float) else "-"
        lines.append(
            f"| {r['model']} | {r['family']} | {_autocast_status(r)} | {_fmt(r['worst_ratio'] if r.get('worst_ratio') is not None else '-', '.2g')} "
            f"| {grads} "
            f"| {_cell(_autocast_loss(r))} | {_autocast_in_ort(r)} | {_cell(r['on_pytorch'])} | {first} |"
        )
    failing = [r for r in rows.values() if r["status"] != "pass"]
    if failing:
        lines += ["", f"Why each model fails under {short} autocast:", ""]
        for r in failing:
            if r["status"] in ("mismatch", "pytorch"):
                why = r["reason"]
            else:
                why = (r["first_error"] or r["reason"])[:600]
                if r["status"] == "eager error":
                    why = f"eager PyTorch itself fails under {short} autocast: {why}"
            lines.append(f"- **{r['model']}** ({_cell(r['description'])}): {_cell(why)}")
    repaired = [r for r in rows.values() if r.get("repairs")]
    if repaired:
        lines += ["", f"Repairs under {short} autocast:", ""]
        lines += [f"- **{r['model']}**: {_cell('; '.join(r['repairs']))}" for r in repaired]
    commits = sorted({r["commit"] for r in rows.values()})
    firsts = sorted(r["first_step_s"] for r in rows.values() if isinstance(r.get("first_step_s"), int | float))
    lines += [
        "",
        f"{record['how']}; total wall time {record['wall_s'] / 60:.1f} min for {record['models_run']} models"
        + (f"; first step (export, build, audit, run) median {firsts[len(firsts) // 2]:.2f} s" if firsts else "")
        + f". ortcore at {', '.join(commits)}; {record['versions']}; {record['machine']}; generated "
        f"{record['generated']}. Rerun: `{REGENERATE} --autocast {dtype}` (a few models: add `--models bert,gpt2`); "
        f"one model by hand: `python -m tests.zoo.run_model bert --autocast {dtype}`.",
        "",
    ]
    return "\n".join(lines)


def render_page(records: Path = RECORDS) -> str:
    """The whole page: the main zoo's routes (``render``), then the wide and third zoos' sections if they have
    records, then a section per autocast type that has a record."""
    page = render(load_records(records))
    wide = load_records(records, WIDE)
    page = page + "\n" + render_wide(wide) if wide else page
    third = load_records(records, THIRD)
    page = page + "\n" + render_third(third) if third else page
    for dtype, record in load_autocast_records(records).items():
        page += "\n" + render_autocast(dtype, record)
    return page


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--exporter",
        help=f"comma-separated routes to run (default: {','.join(EXPORTERS)}; under --autocast: {EXPORTERS[0]}); "
        "the others keep their records",
    )
    parser.add_argument(
        "--autocast",
        help=f"comma-separated autocast types ({', '.join(AUTOCAST_TYPES)}): run the main zoo one step under "
        "torch.autocast and judge it against eager autocast and float64 (records/autocast-<type>.json)",
    )
    parser.add_argument("--results", type=Path, help="record the results in this directory instead of running")
    parser.add_argument("--keep", type=Path, help="directory for the JSON results of this run (default: temporary)")
    parser.add_argument("--models", help="comma-separated subset of the catalog's models")
    parser.add_argument(
        "--catalog", default=DEFAULT_CATALOG, choices=list(CATALOGS), help="the zoo to run (default: %(default)s)"
    )
    parser.add_argument("--render", action="store_true", help="only rewrite the page from the records")
    parser.add_argument(
        "--commit",
        help="the ortcore commit of results that do not name theirs (default: this checkout's HEAD)",
    )
    parser.add_argument("--records", type=Path, default=RECORDS, help="records directory (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    autocast_types = [t.strip() for t in (args.autocast or "").split(",") if t.strip()]
    if args.autocast is not None and (not autocast_types or any(t not in AUTOCAST_TYPES for t in autocast_types)):
        parser.error(f"--autocast {args.autocast!r}: allowed types are {', '.join(AUTOCAST_TYPES)}")
    if autocast_types and args.catalog != DEFAULT_CATALOG:
        parser.error("--autocast runs the main zoo only")
    exporter_arg = args.exporter or (EXPORTERS[0] if autocast_types else ",".join(EXPORTERS))
    exporters = [e.strip() for e in exporter_arg.split(",") if e.strip()]
    unknown = [e for e in exporters if e not in EXPORTERS]
    if unknown or not exporters:
        parser.error(f"--exporter {exporter_arg!r}: allowed routes are {', '.join(EXPORTERS)}")
    if autocast_types and exporters != [EXPORTERS[0]]:
        parser.error(f"--autocast runs the {EXPORTERS[0]} route (its records have one route)")
    known = models(args.catalog)
    names = list(known)
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.results and len(exporters) != 1:
        parser.error("--results needs exactly one --exporter: the route those results were run on")
    commit = args.commit or source_commit()
    if autocast_types and not args.render:
        for dtype in autocast_types:
            _record_autocast(parser, args, dtype, exporters[0], names, commit)
    elif not args.render:
        for exporter in exporters:
            path = record_path(exporter, args.records, args.catalog)
            previous = json.loads(path.read_text()) if path.is_file() else None
            if args.results:
                if not args.results.is_dir():
                    parser.error(f"--results {args.results}: not a directory")
                try:
                    results = read_results(args.results, names, exporter, args.catalog)
                except ValueError as e:
                    parser.error(str(e))
                wall = sum(r.get("wall_s", 0.0) for r in results)
                how = "results of an earlier run recorded (sum of per-model wall times)"
            else:
                with tempfile.TemporaryDirectory(prefix=f"ortcore-zoo-{exporter}-") as tmp:
                    out_dir = (args.keep / exporter) if args.keep else Path(tmp)
                    out_dir.mkdir(parents=True, exist_ok=True)
                    results, wall = run_all(names, out_dir, exporter, catalog=args.catalog)
                how = "models run one after another, one process each"
            if args.models:
                how += f" (this run: {len(names)} of the models; the others as recorded before)"
            record = make_record(exporter, results, wall, how, commit, previous, args.catalog)
            write_atomic(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
            print(f"{exporter}: {_counts(record['models'])}, {wall / 60:.1f} min", file=sys.stderr)
    records = load_records(args.records)
    if not records:
        parser.error(f"no records in {args.records}; run {REGENERATE} first")
    write_atomic(args.out, render_page(args.records))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _record_autocast(
    parser: argparse.ArgumentParser, args: argparse.Namespace, dtype: str, exporter: str, names: list[str], commit: str
) -> None:
    """Run (or read, with ``--results``) ``names`` under ``dtype`` autocast and write its record."""
    path = autocast_record_path(dtype, args.records)
    previous = json.loads(path.read_text()) if path.is_file() else None
    if args.results:
        directory = args.results / dtype if (args.results / dtype).is_dir() else args.results
        try:
            results = read_results(directory, names, exporter, autocast=dtype)
        except ValueError as e:
            parser.error(str(e))
        wall = sum(r.get("wall_s", 0.0) for r in results)
        how = "results of an earlier run recorded (sum of per-model wall times)"
    else:
        with tempfile.TemporaryDirectory(prefix=f"ortcore-zoo-autocast-{dtype}-") as tmp:
            out_dir = (args.keep / f"autocast-{dtype}") if args.keep else Path(tmp)
            out_dir.mkdir(parents=True, exist_ok=True)
            results, wall = run_all(names, out_dir, exporter, autocast=dtype)
        how = "models run one after another, one process each"
    if args.models:
        how += f" (this run: {len(names)} of the models; the others as recorded before)"
    record = make_autocast_record(dtype, exporter, results, wall, how, commit, previous)
    write_atomic(path, json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"{dtype} autocast: {_autocast_counts(record['models'])}, {wall / 60:.1f} min", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
