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

The wide zoo (``catalog_wide``) has its records in ``records/wide/`` and its own section at the end of the page.
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

from tests.zoo.catalog import MODELS  # noqa: E402
from tests.zoo.catalogs import CATALOGS, DEFAULT_CATALOG, models  # noqa: E402
from tests.zoo.deps import ensure_torchvision  # noqa: E402
from tests.zoo.failures import BY_KEY, categorize, failure_op  # noqa: E402
from tests.zoo.harness import EXPORTERS, REPO, check_exporter, describe_failure, run_model, source_commit  # noqa: E402
from tests.zoo.run_model import ATOL, F64_FACTOR, LR, RTOL, TIMED_STEPS, TRAIN_STEPS  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "models.md"
RECORDS = Path(__file__).resolve().parent / "records"
REGENERATE = "python -m tests.zoo.report"
WIDE = "wide"
#: A model that passes with less than this share of its training graph's nodes on ORT's kernels runs mostly in
#: PyTorch: the zoo's test fails it (ortcore would then be a slower PyTorch).
MIN_ORT_OP_SHARE = 0.5


def run_all(
    names: list[str],
    out_dir: Path,
    exporter: str = EXPORTERS[0],
    log: bool = True,
    catalog: str = DEFAULT_CATALOG,
) -> tuple[list[dict[str, Any]], float]:
    """Run ``names`` of ``catalog`` on ``exporter``'s route, one process each, into ``out_dir``; return the results
    and the total wall time in seconds."""
    if any(models(catalog)[n].family == "torchvision" for n in names):
        ensure_torchvision()
    results = []
    t0 = time.perf_counter()
    for name in names:
        result = run_model(name, out_dir, exporter=exporter, catalog=catalog)
        results.append(result)
        if log:
            print(
                f"{exporter:11s} {name:22s} {result['status']:9s} {result.get('wall_s', 0):6.1f} s  "
                f"{describe_failure(result)[:150]}",
                file=sys.stderr,
                flush=True,
            )
    return results, time.perf_counter() - t0


def read_results(
    directory: Path, names: list[str], exporter: str = EXPORTERS[0], catalog: str = DEFAULT_CATALOG
) -> list[dict[str, Any]]:
    """The results found in ``directory`` for ``names``; a model without a result file is listed as not run.

    A result another exporter produced is refused (it would land in the wrong column).
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
            line = r["first_error"] or r["reason"]
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
    text = r["reason"] if r["status"] == "mismatch" else (r["first_error"] or r["reason"])
    label = "" if category.key in ("other", "mismatch") else f"{category.label}: "
    return label + text[:300].replace("`", "'")


def _mostly_pytorch(r: dict[str, Any]) -> bool:
    """Whether a record's row runs mostly in PyTorch: too few nodes on ORT, or PythonOps taking most parameters."""
    shares = [r.get("ort_op_share"), r.get("ort_param_share")]
    return any(isinstance(x, int | float) and x < MIN_ORT_OP_SHARE for x in shares)


def render_wide(records: dict[str, dict[str, Any]]) -> str:
    """The wide zoo's section of the page, from its routes' ``records`` (``records/wide/<route>.json``)."""
    catalog = models(WIDE)
    lines = [
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
    for e, rec in records.items():
        rows = rec["models"]
        mostly = [n for n, r in rows.items() if r["status"] == "pytorch" or (r["status"] == "pass" and _mostly_pytorch(r))]
        lines += [
            f"### Wide zoo, {e} route: {_counts(rows)}"
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
            causes[0] = f"#### Wide zoo: why models fail on the {e} route"
            lines += causes
        commits = sorted({r["commit"] for r in rows.values()})
        lines += [
            f"{rec['how']}; total wall time {rec['wall_s'] / 60:.1f} min for {rec['models_run']} models. ortcore at "
            f"{', '.join(commits)}; {rec['versions']}; {rec['machine']}; generated {rec['generated']}.",
            "",
        ]
    return "\n".join(lines)


def render_page(records: Path = RECORDS) -> str:
    """The whole page: the main zoo's routes (``render``), then the wide zoo's section if it has records."""
    page = render(load_records(records))
    wide = load_records(records, WIDE)
    return page + "\n" + render_wide(wide) if wide else page


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--exporter",
        default=",".join(EXPORTERS),
        help="comma-separated routes to run (default: %(default)s); the others keep their records",
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
    exporters = [e.strip() for e in args.exporter.split(",") if e.strip()]
    unknown = [e for e in exporters if e not in EXPORTERS]
    if unknown or not exporters:
        parser.error(f"--exporter {args.exporter!r}: allowed routes are {', '.join(EXPORTERS)}")
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
    if not args.render:
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


if __name__ == "__main__":
    sys.exit(main())
