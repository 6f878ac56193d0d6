"""Run zoo models each in its own process, so a crash or a hang is that model's failure, not the end of the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .catalogs import DEFAULT_CATALOG, check_catalog, models

REPO = Path(__file__).resolve().parents[2]
# Per model; the largest (convnext_tiny, 28M parameters) takes under a minute on 2 busy cores.
DEFAULT_TIMEOUT_S = float(os.environ.get("ORTCORE_ZOO_TIMEOUT", "300"))
# The exporters the zoo runs on ("routes"); the first is ortcore's default.
EXPORTERS = ("torchscript", "dynamo")


def check_exporter(exporter: str) -> str:
    """``exporter`` if the zoo knows it, else a ValueError naming the allowed ones."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter {exporter!r} is not a zoo route; allowed: {', '.join(EXPORTERS)}")
    return exporter


def child_env(exporter: str = EXPORTERS[0]) -> dict[str, str]:
    """The caller's environment without ortcore settings, with fallback to PyTorch disabled and ``exporter`` chosen."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    env["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    env["ORTCORE_EXPORTER"] = check_exporter(exporter)
    env.setdefault("GOMP_SPINCOUNT", "10000")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def source_commit() -> str:
    """This checkout's HEAD (short), marked when ortcore/ or plugins/ have uncommitted changes: what a model's run
    tested (asked per model: each child imports ortcore afresh, so a commit during a run shows in its later rows)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "ortcore", "plugins"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown commit"
    if out.returncode != 0:
        return "unknown commit (not a git checkout)"
    return out.stdout.strip() + (" (with uncommitted changes in ortcore/ or plugins/)" if dirty else "")


def _describe_returncode(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (return code {code})"
        except ValueError:
            return f"killed by signal {-code} (return code {code})"
    return f"exited with return code {code} without writing a result"


def run_model(
    name: str,
    out_dir: Path,
    timeout: float = DEFAULT_TIMEOUT_S,
    exporter: str = EXPORTERS[0],
    catalog: str = DEFAULT_CATALOG,
    autocast: str | None = None,
) -> dict[str, Any]:
    """Run the model ``name`` of the zoo ``catalog`` on ``exporter``'s route in a child process; return its result,
    or a crash/timeout result made here. With ``autocast`` (``bf16``, ``fp16``) the child runs one step under
    ``torch.autocast`` instead (``tests.zoo.autocast``).

    The child writes ``out_dir/<name>.json``; a child that dies or hangs is recorded with its return code (or the
    timeout) and the end of its stderr, and that record is written to the same file.
    """
    known = models(check_catalog(catalog))
    if name not in known:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(known)}")
    check_exporter(exporter)
    out = Path(out_dir) / f"{name}.json"
    out.unlink(missing_ok=True)
    # faulthandler: a child killed by a signal leaves its Python stack in stderr, which the crash result keeps.
    cmd = [sys.executable, "-X", "faulthandler", "-m", "tests.zoo.run_model", name, "--json", str(out)]
    cmd += ["--catalog", catalog]
    if autocast:
        cmd += ["--autocast", autocast]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=child_env(exporter), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        result = _failure(name, "timeout", f"no result after {timeout:.0f} s (killed)", stderr, catalog)
        result["exporter"] = exporter
        if autocast:
            result["autocast"] = autocast
    else:
        if out.is_file():
            result = json.loads(out.read_text())
            result["returncode"] = done.returncode
            result["stdout"] = done.stdout[-4000:]
        else:
            result = _failure(name, "crash", _describe_returncode(done.returncode), done.stderr, catalog)
            result["returncode"] = done.returncode
            result["exporter"] = exporter
            if autocast:
                result["autocast"] = autocast
    result["wall_s"] = time.perf_counter() - t0
    result["commit"] = source_commit()
    from .run_model import write_json

    write_json(result, out)
    return result


def _failure(name: str, status: str, what: str, stderr: str, catalog: str = DEFAULT_CATALOG) -> dict[str, Any]:
    from .run_model import failing_op

    spec = models(catalog)[name]
    tail = stderr.strip().splitlines()[-30:]
    last = next((line for line in reversed(tail) if line.strip()), "")
    return {
        "model": name,
        "catalog": catalog,
        "family": spec.family,
        "description": spec.description,
        "status": status,
        "phase": "unknown (no result written)",
        "error": {
            "type": status,
            "first_line": f"{what}; last stderr line: {last[:300]}" if last else what,
            "op": failing_op("\n".join(tail)),
            "message": "\n".join(tail)[-3000:],
        },
    }


def pytorch_reason(shares: dict[str, Any], repairs: list[str]) -> str:
    """Why a model with PyTorch's gradients counts as run mostly in PyTorch."""
    params, nodes = shares.get("param_share"), shares.get("share")
    held = ", ".join(shares.get("params_in_python_ops", [])[:3])
    text = f"PyTorch's gradients, but regions hold {1 - params:.0%} of the parameters" if params is not None else ""
    if held:
        text += f" ({held})"
    if nodes is not None:
        text += f"; {nodes:.0%} of the graph's nodes on ORT"
    if repairs:
        text += f"; repairs: {'; '.join(r.split(', because')[0] for r in repairs)}"
    return text or "PyTorch's gradients, but mostly run in PyTorch"


def describe_failure(result: dict[str, Any]) -> str:
    """One line saying why a model did not pass (for assertion messages and the report)."""
    status = result["status"]
    if status == "pass":
        return "pass"
    if status == "pytorch":
        return pytorch_reason(result.get("ort_op_share") or {}, result.get("repairs") or [])
    if status == "mismatch":
        checks = result.get("checks", {})
        parts = [f"mismatch in {', '.join(result.get('failed_checks', []))}"]
        loss = checks.get("loss", {})
        if not loss.get("ok", True):
            parts.append(f"loss {result['loss']['ortcore']:.7g} vs eager {result['loss']['eager']:.7g}")
        for w in result.get("worst_grads", [])[:3]:
            part = f"grad {w['name']} max abs {w.get('max_abs', float('nan')):.3g} (rel {w.get('max_rel', 0):.3g})"
            if w.get("judged_by") == "float64":
                part += f", from float64: ortcore {w['ortcore_vs_f64']:.3g} vs eager {w['eager_vs_f64']:.3g}"
            parts.append(part)
        curves = result.get("curves", {})
        for i, c in enumerate(checks.get("curve", [])):
            if not c.get("ok", True):
                f64 = f", float64 {curves['float64'][i]:.7g}" if "float64" in curves else ""
                parts.append(
                    f"loss after AdamW update {i}: ortcore {curves['ortcore'][i]:.7g}, eager {curves['eager'][i]:.7g}"
                    f"{f64} ({c.get('tol_ratio', float('nan')):.2f}x the float32 tolerance)"
                )
        return "; ".join(parts)
    err = result.get("error", {})
    op = f" [op: {err['op']}]" if err.get("op") else ""
    return f"{status} in {result.get('phase')}: {err.get('type')}: {err.get('first_line')}{op}"
