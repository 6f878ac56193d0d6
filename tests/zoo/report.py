"""Write ``docs/models.md`` from the model zoo: status, ops run by PyTorch and why, step time against eager.

python -m tests.zoo.report                      # run every model (one process each), then write docs/models.md
python -m tests.zoo.report --results DIR        # use the JSON results of an earlier run (e.g. the pytest zoo)
python -m tests.zoo.report --models bert,gpt2   # run only these (the page then lists only these)
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `tests.zoo` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.zoo.catalog import MODELS  # noqa: E402
from tests.zoo.deps import ensure_torchvision  # noqa: E402
from tests.zoo.harness import REPO, describe_failure, run_model  # noqa: E402
from tests.zoo.run_model import ATOL, F64_FACTOR, LR, RTOL, TIMED_STEPS, TRAIN_STEPS  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "models.md"


def run_all(names: list[str], out_dir: Path, log: bool = True) -> tuple[list[dict[str, Any]], float]:
    """Run ``names`` one process each into ``out_dir``; return the results and the total wall time in seconds."""
    if any(MODELS[n].family == "torchvision" for n in names):
        ensure_torchvision()
    results = []
    t0 = time.perf_counter()
    for name in names:
        result = run_model(name, out_dir)
        results.append(result)
        if log:
            print(
                f"{name:22s} {result['status']:9s} {result.get('wall_s', 0):6.1f} s  {describe_failure(result)[:150]}",
                file=sys.stderr,
                flush=True,
            )
    return results, time.perf_counter() - t0


def read_results(directory: Path, names: list[str]) -> list[dict[str, Any]]:
    """The results found in ``directory`` for ``names``; a model without a result file is listed as not run."""
    results = []
    for name in names:
        path = directory / f"{name}.json"
        if path.is_file():
            results.append(json.loads(path.read_text()))
        else:
            spec = MODELS[name]
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


def _step(result: dict[str, Any]) -> str:
    st = result.get("step_s")
    if not st:
        return "-"
    return f"{st['eager'] * 1e3:.1f} / {st['ortcore'] * 1e3:.1f} ms (×{result['step_ratio']:.2f})"


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "ortcore", "plugins"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if out.returncode != 0:
            return "unknown commit (not a git checkout)"
        return out.stdout.strip() + (" (with uncommitted changes in ortcore/ or plugins/)" if dirty else "")
    except OSError:
        return "unknown commit"


def _versions() -> str:
    import onnxruntime
    import torch
    import transformers

    return f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, transformers {transformers.__version__}"


def render(results: list[dict[str, Any]], wall_s: float, how: str, commit: str | None = None) -> str:
    """The markdown page for ``results``."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    passed = counts.get("pass", 0)
    ratios = sorted(r["step_ratio"] for r in results if isinstance(r.get("step_ratio"), int | float))
    load = [r["load_average"] for r in results if isinstance(r.get("load_average"), int | float)]
    lines = [
        "# Model zoo",
        "",
        "<!-- Generated by `python -m tests.zoo.report`; do not edit by hand. -->",
        "",
        f"{len(results)} models trained under ortcore with `ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE` (a failure "
        "raises instead of running PyTorch), each in its own process, against eager PyTorch on a deep copy with the "
        "same random initial weights. Tiny configs (hidden 32-64, 2 layers, vocabulary 128, batch 4, sequence "
        "8-16; torchvision models at their real size with 96×96 images), every dropout off, no downloads.",
        "",
        f"**{passed}/{len(results)} pass** ("
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()) if s != "pass")
        + (")" if len(counts) > 1 or not passed else "none failing)"),
        "",
        "## What is checked",
        "",
        "- One step: the loss and every parameter's gradient, elementwise "
        f"`|ortcore - eager| <= {ATOL:g} + {RTOL:g}·|eager|` (float32). A tensor failing that passes only if "
        f"ortcore is within {F64_FACTOR:g}× as far (max abs) from a float64 eager run as float32 eager is "
        "(float32 itself is ill-conditioned there; e.g. batch norm over few values per channel).",
        f"- {TRAIN_STEPS} AdamW steps (lr {LR:g} unless a model's description names its own): the loss before and "
        "after each update, judged the same way.",
        "- The step ran in ONNX Runtime (one export, no fallback).",
        "- *worst diff / tol.*: the largest `|ortcore - eager| / (atol + rtol·|eager|)` over the loss, every "
        "gradient and the curve; at most 1 passes in float32, `(f64)` marks a value then judged against float64.",
        "- *ops on PyTorch*: ops that run as PyTorch kernels inside ortcore's graph (ATen / PythonOp nodes, or "
        "`ORTModule.explain()` when available) and why.",
        f"- *step*: median of {TIMED_STEPS} interleaved steady training steps (forward, loss, backward, AdamW), "
        "eager / ortcore, and the ratio ortcore ÷ eager (below 1: ortcore faster). Tiny models measure fixed "
        "per-step costs more than kernels; the machine is shared, so treat ratios as rough.",
        "",
        "## Results",
        "",
        "| model | family | status | worst diff / tol. | ops on PyTorch (why) | step eager / ortcore | first step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        status = "✅ pass" if r["status"] == "pass" else f"❌ {r['status']}"
        first = f"{r['ortcore_first_step_s']:.2f} s" if isinstance(r.get("ortcore_first_step_s"), float) else "-"
        lines.append(
            f"| {r['model']} | {r['family']} | {status} | {_margin(r)} | {_cell(_routed(r))} | {_step(r)} | {first} |"
        )
    failing = [r for r in results if r["status"] != "pass"]
    if failing:
        lines += ["", "## Why each failing model fails", ""]
        for r in failing:
            lines.append(f"- **{r['model']}** ({_cell(r.get('description', ''))}): {_cell(describe_failure(r))}")
    lines += [
        "",
        "## Run",
        "",
        f"- {how}; total wall time {wall_s / 60:.1f} min for {len(results)} models"
        + (f"; load average during the runs {min(load):.1f}-{max(load):.1f}" if load else "")
        + ".",
        f"- Step-time ratio ortcore ÷ eager: median {ratios[len(ratios) // 2]:.2f}, range "
        f"{ratios[0]:.2f}-{ratios[-1]:.2f} over the {len(ratios)} models that ran."
        if ratios
        else "- No model ran to the timing phase.",
        f"- ortcore at {commit or _git_commit()}; {_versions()}; {platform.machine()}, {os.cpu_count()} cores.",
        f"- Generated {datetime.date.today().isoformat()} by `python -m tests.zoo.report`. One model by hand: "
        "`python -m tests.zoo.run_model <name>`. As tests: `python -m pytest tests/zoo -m slow` "
        "(`ORTCORE_ZOO_RESULTS=DIR` keeps the JSON results for `--results DIR`).",
        "",
    ]
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help="read results from this directory instead of running")
    parser.add_argument("--keep", type=Path, help="directory for the JSON results of this run (default: temporary)")
    parser.add_argument("--models", help=f"comma-separated subset of: {', '.join(MODELS)}")
    parser.add_argument("--commit", help="the ortcore commit the results are from (default: this checkout's HEAD)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    names = list(MODELS)
    if args.models:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in names if n not in MODELS]
        if unknown:
            parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    if args.results:
        if not args.results.is_dir():
            parser.error(f"--results {args.results}: not a directory")
        results = read_results(args.results, names)
        wall = sum(r.get("wall_s", 0.0) for r in results)
        how = f"results read from `{args.results.name}/` (sum of per-model wall times)"
    else:
        with tempfile.TemporaryDirectory(prefix="ortcore-zoo-") as tmp:
            out_dir = args.keep or Path(tmp)
            out_dir.mkdir(parents=True, exist_ok=True)
            results, wall = run_all(names, out_dir)
        how = "models run one after another, one process each"
    write_atomic(args.out, render(results, wall, how, args.commit))
    print(
        f"wrote {args.out}: {sum(r['status'] == 'pass' for r in results)}/{len(results)} pass, {wall / 60:.1f} min",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
