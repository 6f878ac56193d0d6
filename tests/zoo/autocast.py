"""The zoo under mixed precision: each model's forward under ``torch.autocast("cpu", dtype=...)`` on both sides, one
step, judged against eager autocast and float64.

    python -m tests.zoo.run_model bert --autocast bf16            # one model, readable summary
    python -m tests.zoo.report --autocast bf16                     # the main zoo: records/autocast-bf16.json, the page
    python -m tests.zoo.report --autocast fp16 --models bert,gpt2  # a few models; the others as recorded

Three runs of one model from the same random initial weights and batch (``run_model.SEED``, ``BATCH_SEED``):

* **ortcore**: ``ORTModule(model)``, the forward and the loss under ``torch.autocast("cpu", dtype)``, the backward
  outside it (as a training script writes it), with ``ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE``;
* **eager autocast**: the same code on a deep copy in eager PyTorch;
* **float64**: a deep copy cast to float64 on the batch in float64, no autocast: the exact value both are judged by.

For the loss and each parameter's gradient, with ``err(x) = max |x - float64|`` over the tensor's elements::

    pass  <=>  err(ortcore) <= EAGER_FACTOR * err(eager autocast) + floor,   floor = u * max |float64|

``EAGER_FACTOR`` is 2 (ortcore may round in another order, or round once more, than eager does, not worse) and
``u`` the unit roundoff of the autocast type (``2**-8`` for bfloat16, ``2**-11`` for float16): the floor is one
rounding of the tensor's largest element to that type. It matters where eager's own error is accidentally tiny (a
gradient autocast computes in float32 throughout, a bias gradient summed in float32), since a second low-precision
rounding there is still autocast-level accuracy, and two float32-small errors need not be within 2x of each other.
A gradient both sides leave as None passes; one side's missing gradient counts as zeros. A model whose float64 run
fails (a kernel with no float64 version: ``grouped_mm`` in Mixtral's experts) is judged by float32 eager without
autocast instead: its error (about ``2**-24`` relative) is far below either type's floor.

A model eager PyTorch itself cannot run under the type (a kernel with no version for it: oneDNN's LSTM in float16)
has the status ``eager error``: there is nothing to judge ortcore by.

A tensor that fails is diagnosed, not judged again: eager autocast is also run on ``PERTURBED_RUNS`` batches with
their rows reversed and every value moved by one unit in the last place (``run_model.perturb``, the float32 zoo's
measure of rounding spread), and the farthest of those runs from float64 is recorded beside it. Where that spread
reaches ortcore's error, eager autocast's own error on the zoo's batch was the lucky end of its rounding, not a sign
that ortcore computes something else; the page says so in the model's cause, and the model still counts as a
mismatch.

Also recorded: whether the step ran in ORT (``state_machine.counters``: an export, no fallback) and with no repairs
(``model.repairs``), the ops run on PyTorch's kernels inside the graph (``explain()``: under autocast the matrix
products are ATen nodes by design, see ``plugins/mixed_precision.py``), and the loss's dtype on both sides. A model
that does not pass is recorded with its cause: the error's first line, or the gradients that were off and by how
much.
"""

from __future__ import annotations

import copy
import math
import os
import time
import traceback
import warnings
from typing import Any

import torch

from tests.zoo.catalogs import DEFAULT_CATALOG, get
from tests.zoo.run_model import (
    BATCH_SEED,
    PERTURB_SEED,
    PERTURBED_RUNS,
    SEED,
    _mostly_pytorch,
    failing_op,
    forward_loss,
    grads,
    ort_op_share,
    perturb,
    routed_ops,
    to_double,
)

#: The autocast types the zoo runs: the name on the command line -> torch dtype.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Unit roundoff (half the machine epsilon) of each type: one rounding to it moves a value by at most this, relatively.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
#: How many times eager autocast's own error (from float64) ortcore's may be.
EAGER_FACTOR = 2.0
#: The phase of the eager autocast run: an error there is eager PyTorch's own (status ``eager error``: a kernel with
#: no version for the type; nothing to judge ortcore by, and nothing for ortcore to do), not ortcore's.
EAGER_PHASE = "eager autocast reference"
#: The floor, in roundings of the tensor's largest float64 element to the autocast type.
FLOOR_ROUNDINGS = 1.0


def check_dtype(dtype: str) -> str:
    """``dtype`` if the zoo runs it, else a ValueError naming the allowed ones."""
    if dtype not in DTYPES:
        raise ValueError(f"autocast type {dtype!r} is not one the zoo runs; allowed: {', '.join(DTYPES)}")
    return dtype


def autocast(dtype: str) -> torch.autocast:
    return torch.autocast("cpu", dtype=DTYPES[check_dtype(dtype)])


def criterion(dtype: str) -> str:
    """The pass criterion in words, with this type's numbers (the page and the summaries show it)."""
    u = UNIT_ROUNDOFF[check_dtype(dtype)]
    return (
        f"max|ortcore − float64| ≤ {EAGER_FACTOR:g}·max|eager autocast − float64| + "
        f"{FLOOR_ROUNDINGS:g}·2^{round(math.log2(u))}·max|float64|"
    )


def judge(
    actual: torch.Tensor | None, eager: torch.Tensor | None, exact: torch.Tensor | None, dtype: str
) -> dict[str, Any]:
    """How far ``actual`` (ortcore under autocast) is from ``exact`` (float64) next to how far ``eager`` (eager
    autocast) is, and whether that passes (the module docstring's criterion). A missing tensor counts as zeros."""
    if actual is None and eager is None and exact is None:
        return {"ok": True, "missing": "all", "ratio": 0.0}
    ref = next(t for t in (exact, eager, actual) if t is not None)
    a, b, c = ((t if t is not None else torch.zeros_like(ref)).detach().double() for t in (actual, eager, exact))
    if not a.shape == b.shape == c.shape:
        return {
            "ok": False,
            "ratio": math.inf,
            "error": f"shapes: ortcore {tuple(a.shape)}, eager {tuple(b.shape)}, float64 {tuple(c.shape)}",
        }

    def biggest(x: torch.Tensor) -> float:
        return x.abs().max().item() if x.numel() else 0.0

    ort_err, eager_err, scale = biggest(a - c), biggest(b - c), biggest(c)
    floor = FLOOR_ROUNDINGS * UNIT_ROUNDOFF[check_dtype(dtype)] * scale
    allowed = EAGER_FACTOR * eager_err + floor
    entry: dict[str, Any] = {
        "ortcore_vs_f64": ort_err,
        "eager_vs_f64": eager_err,
        "ortcore_vs_eager": biggest(a - b),
        "f64_max": scale,
        "floor": floor,
        "allowed": allowed,
    }
    if not math.isfinite(eager_err) and not math.isfinite(ort_err):
        # Eager autocast overflows too (float16): nothing to judge ortcore by but eager itself.
        entry.update(ok=bool(torch.equal(a.isfinite(), b.isfinite())), ratio=math.inf, note="both non-finite")
    else:
        entry["ok"] = ort_err <= allowed  # NaN compares False
        entry["ratio"] = ort_err / allowed if allowed > 0 else (0.0 if ort_err == 0 else math.inf)
    missing = [side for side, t in (("ortcore", actual), ("eager", eager), ("float64", exact)) if t is None]
    if missing:
        entry["missing"] = ", ".join(missing)
    return entry


def _ratio(entry: dict[str, Any]) -> float:
    r = entry.get("ratio", math.inf)
    return r if isinstance(r, int | float) and not math.isnan(r) else math.inf


def off_by(name: str, entry: dict[str, Any]) -> str:
    """One failing tensor in words: how far ortcore is from float64 (or the float32 stand-in) against what was
    allowed, and how far eager autocast lands on perturbed batches (when measured)."""
    if "error" in entry:
        return f"{name}: {entry['error']}"
    text = (
        f"{name} {entry['ortcore_vs_f64']:.3g} from float64, allowed {entry['allowed']:.3g} "
        f"(eager autocast {entry['eager_vs_f64']:.3g}, floor {entry['floor']:.3g}"
        + (f"; missing in {entry['missing']}" if entry.get("missing") else "")
        + ")"
    )
    spread = entry.get("perturbed_eager_vs_f64")
    if isinstance(spread, int | float):
        within = entry["ortcore_vs_f64"] <= spread
        text += (
            f"; eager autocast on {entry.get('perturbed_runs', PERTURBED_RUNS)} batches moved by 1 ulp: up to "
            f"{spread:.3g} from float64" + (" (as far as ortcore: rounding luck)" if within else "")
        )
    return text


def run(name: str, dtype: str, catalog: str = DEFAULT_CATALOG) -> dict[str, Any]:
    """Run the model ``name`` of ``catalog`` under ``dtype`` autocast; the result is what ``run_model --json`` writes
    (``status`` pass / mismatch / pytorch / error, the checks, the counters, the cause of a failure)."""
    check_dtype(dtype)
    spec = get(name, catalog)
    result: dict[str, Any] = {
        "model": name,
        "catalog": catalog,
        "family": spec.family,
        "description": spec.description,
        "autocast": dtype,
        "status": "error",
        "phase": "build model",
        "criterion": {
            "eager_factor": EAGER_FACTOR,
            "floor_roundings": FLOOR_ROUNDINGS,
            "unit_roundoff": UNIT_ROUNDOFF[dtype],
        },
        "fallback_policy": os.environ.get("ORTMODULE_FALLBACK_POLICY"),
        "exporter": os.environ.get("ORTCORE_EXPORTER", "torchscript"),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        _run(spec, dtype, result)
    except Exception as e:
        text = str(e).strip()
        first = text.splitlines()[0] if text else ""
        result["error"] = {
            "type": type(e).__name__,
            "first_line": first[:500],
            "op": failing_op(text) or failing_op("".join(traceback.format_exception(e))),
            "message": text[:3000],
            "traceback": "".join(traceback.format_exception(e))[-6000:],
        }
        result["status"] = "eager error" if result["phase"] == EAGER_PHASE else "error"
    return result


def _run(spec: Any, dtype: str, result: dict[str, Any]) -> None:
    result["phase"] = "import ortcore"
    from ortcore import ORTModule

    result["phase"] = "build model"
    torch.manual_seed(SEED)
    model = spec.build().train()
    result["parameters"] = sum(p.numel() for p in model.parameters())
    ref = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    batch = spec.batch(torch.Generator().manual_seed(BATCH_SEED))

    result["phase"] = EAGER_PHASE
    t0 = time.perf_counter()
    with autocast(dtype):
        loss_ref = forward_loss(spec, ref, batch)
    loss_ref.backward()
    result["eager_first_step_s"] = time.perf_counter() - t0
    result["phase"] = "float64 reference"
    try:
        loss_exact = forward_loss(spec, exact, to_double(batch))
        loss_exact.backward()
        result["reference"] = "float64"
    except Exception as e:  # some kernels have no float64 version: float32 is exact enough next to bf16/fp16
        exact = copy.deepcopy(model)
        loss_exact = forward_loss(spec, exact, batch)
        loss_exact.backward()
        result["reference"] = (
            f"float32 eager without autocast (float64 failed: {type(e).__name__}: {str(e).splitlines()[0][:200]})"
        )
    initial = copy.deepcopy(model)  # for the perturbed eager runs a failing tensor is diagnosed with

    result["phase"] = "wrap in ORTModule"
    ort = ORTModule(model)
    result["phase"] = "first ortcore step under autocast (export, build, forward)"
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with autocast(dtype):
            loss = forward_loss(spec, ort, batch)
        result["phase"] = "first ortcore backward"
        loss.backward()
    result["ortcore_first_step_s"] = time.perf_counter() - t0
    result["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}" for w in caught})

    result["phase"] = "compare step"
    counters = ort.state_machine.counters
    result["counters"] = {k: getattr(counters, k) for k in ("exports", "builds", "fallbacks", "audits", "repairs")}
    result["fallback_reason"] = ort.fallback_reason
    result["repairs"] = [f"{r.description}, because {r.reason}" for r in ort.repairs]
    result["in_ort"] = bool(counters.exports) and not counters.fallbacks and ort.fallback_reason is None
    result["clean"] = result["in_ort"] and not result["repairs"]
    result["loss"] = {"ortcore": loss.item(), "eager": loss_ref.item(), "float64": loss_exact.item()}
    result["loss_dtype"] = {"ortcore": str(loss.dtype), "eager": str(loss_ref.dtype)}
    result["routed_ops"] = routed_ops(ort)
    try:
        result["ort_op_share"] = ort_op_share(ort)
    except Exception as e:  # a number to report, not a check of the step
        result["ort_op_share"] = {"share": None, "why": f"{type(e).__name__}: {e}"[:300]}
    if not result["in_ort"]:
        raise RuntimeError(f"the step did not run in ONNX Runtime: {counters}; {ort.fallback_reason}")

    g_ort, g_ref, g_exact = grads(ort.module), grads(ref), grads(exact)
    checks = {
        "loss": judge(loss, loss_ref, loss_exact, dtype),
        "grads": {n: judge(g_ort.get(n), g_ref.get(n), g_exact.get(n), dtype) for n in g_exact},
    }
    result["checks"] = checks
    entries = [("loss", checks["loss"]), *checks["grads"].items()]
    result["worst_ratio"] = max((_ratio(c) for _, c in entries), default=0.0)
    bad = sorted((kv for kv in entries if not kv[1]["ok"]), key=lambda kv: -_ratio(kv[1]))
    if bad:
        result["phase"] = "perturbed eager autocast (diagnosis)"
        _perturbed_spread(spec, dtype, initial, batch, loss_exact, g_exact, dict(bad))
    del initial
    result["off"] = [{"name": n, **c} for n, c in bad[:5]]
    n_grads = len(checks["grads"])
    result["failed_checks"] = (["loss"] if not checks["loss"]["ok"] else []) + (
        [f"{sum(n != 'loss' for n, _ in bad)}/{n_grads} gradients"] if any(n != "loss" for n, _ in bad) else []
    )
    result["phase"] = "done"
    if bad:
        result["status"] = "mismatch"
    elif _mostly_pytorch(result.get("ort_op_share") or {}, bool(result["repairs"])):
        result["status"] = "pytorch"
        result["failed_checks"] = ["most of the model runs in PyTorch"]
    else:
        result["status"] = "pass"


def _perturbed_spread(
    spec: Any,
    dtype: str,
    initial: torch.nn.Module,
    batch: dict[str, Any],
    loss_exact: torch.Tensor,
    g_exact: dict[str, torch.Tensor | None],
    failing: dict[str, dict[str, Any]],
) -> None:
    """Record in each of ``failing``'s entries how far eager autocast lands from the reference on
    ``PERTURBED_RUNS`` perturbed batches (the farthest run): the rounding spread ortcore's error is set against."""
    spread = dict.fromkeys(failing, 0.0)
    for seed in range(PERTURB_SEED, PERTURB_SEED + PERTURBED_RUNS):
        other = copy.deepcopy(initial)
        with autocast(dtype):
            loss = forward_loss(spec, other, perturb(batch, seed))
        loss.backward()
        g = grads(other)
        for name in failing:
            value, exact = (loss, loss_exact) if name == "loss" else (g.get(name), g_exact.get(name))
            if value is None or exact is None or value.shape != exact.shape:
                continue
            spread[name] = max(spread[name], (value.detach().double() - exact.double()).abs().max().item())
        del other
    for name, entry in failing.items():
        entry.update(perturbed_eager_vs_f64=spread[name], perturbed_runs=PERTURBED_RUNS)


def describe(result: dict[str, Any]) -> str:
    """One line saying why a model did not pass under autocast (for the page, assertion messages)."""
    status = result["status"]
    if status == "pass":
        return "pass"
    if status == "mismatch":
        off = result.get("off") or []
        return f"{', '.join(result.get('failed_checks', []))} off: " + "; ".join(off_by(w["name"], w) for w in off[:3])
    if status == "pytorch":
        from tests.zoo.harness import pytorch_reason

        return pytorch_reason(result.get("ort_op_share") or {}, result.get("repairs") or [])
    err = result.get("error") or {}
    op = f" [op: {err['op']}]" if err.get("op") else ""
    return f"{status} in {result.get('phase')}: {err.get('type')}: {err.get('first_line')}{op}"


def summary(result: dict[str, Any]) -> str:
    """A few readable lines about one model's autocast result."""
    dtype = result.get("autocast", "?")
    lines = [f"{result['model']} ({result['description']}) under {dtype} autocast: {result['status'].upper()}"]
    if "checks" not in result:
        lines.append(f"  {describe(result)}")
        return "\n".join(lines)
    loss = result["loss"]
    lines.append(
        f"  loss ortcore {loss['ortcore']:.6g} ({result['loss_dtype']['ortcore']}), eager autocast "
        f"{loss['eager']:.6g} ({result['loss_dtype']['eager']}), float64 {loss['float64']:.6g}"
    )
    g = result["checks"]["grads"]
    lines.append(
        f"  gradients: {sum(c['ok'] for c in g.values())}/{len(g)} pass {criterion(dtype)}; "
        f"worst ratio to the allowance {result['worst_ratio']:.3g}"
    )
    lines += [f"    FAIL {off_by(w['name'], w)}" for w in result.get("off", [])]
    lines.append(
        f"  in ORT: {result['in_ort']}, repairs: {'; '.join(result['repairs']) or 'none'}; counters {result['counters']}"
    )
    routed = result.get("routed_ops") or []
    lines.append("  on PyTorch: " + (", ".join(f"{r['op']} x{r['count']}" for r in routed) or "none"))
    lines.append(f"  first ortcore step {result['ortcore_first_step_s']:.2f} s")
    return "\n".join(lines)
