"""Run one zoo model under ortcore and against eager PyTorch; print a summary and optionally write a JSON result.

    python -m tests.zoo.run_model bert                 # readable summary
    python -m tests.zoo.run_model bert --json out.json # the same, and the result for the test and the report
    python -m tests.zoo.run_model swin --catalog wide  # a model of the wide zoo (tests.zoo.catalog_wide)
    python -m tests.zoo.run_model bert --autocast bf16 # one step under torch.autocast, judged as tests.zoo.autocast says

The step runs with ``ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`` (any failure raises instead of running PyTorch).
Checked after one step: the loss and every parameter's gradient against eager PyTorch on a deep copy with the same
initial weights, each ``|ortcore - eager| <= ATOL + RTOL * |eager|`` elementwise. Where float32 itself is
ill-conditioned that check can fail for eager float32 too, so a tensor that fails it passes if ortcore is within
``F64_FACTOR`` times as far from a float64 eager run (max abs) as float32 eager is. Then three AdamW steps (lr ``LR``,
or the model's own ``lr`` in the catalog): the four losses (before and after each update) are compared the same way.

A model with batch norm in training mode is also run a second time in float32 eager on the same batch with its rows
in reverse order and every input value moved by one unit in the last place (other summation orders in the batch
statistics and the weight gradients, other roundings: what float32 itself could have computed). Batch
norm over few values per channel amplifies float32 rounding, and AdamW's first update moves each element by about
``lr`` whatever its gradient's size, so such a curve leaves eager's after a few steps from rounding alone. A point of
its curve that fails the tolerance passes if ortcore is within ``F64_FACTOR`` times as far from eager as that perturbed
eager run is. Its first step is judged as above, with one addition: a ReLU input within rounding of zero lands on
either side of the kink depending on the float32 run, and batch norm's backward spreads that one element's gradient
over its whole channel, so on such a batch float32 eager itself is near float64 on one run and percent away on the
next (densenet121 at 96x96 moves between 0 and 278 of its 364 gradients out of tolerance when the input moves by one
ulp; at the zoo's batch both float32 eager runs stay near float64 while ortcore's float32 lands on the other side of
a few such kinks: flipping the one ReLU element of ``denselayer10.relu1`` within 6.2e-7 of zero in a float64 run moves
that layer's ``norm1.bias`` gradient from 5.1e-4 to 2.1e-5 of ortcore's). There a gradient that fails both checks
passes if ortcore is within ``F64_FACTOR`` times as far from float64 as the farthest of ``PERTURBED_RUNS`` float32
eager runs on batches perturbed as above (other random signs), or if ``ortcore_plugins.gradient_audit.kinks`` explains it:
float64 taking every ReLU element near zero on the side ortcore's forward took (read from a copy of the model run
under ORTModule with its ReLU outputs recorded), or else with a few ReLU elements within rounding of zero taken on
the other side of the kink, comes within ``F64_FACTOR`` times eager's own distance of ortcore's gradients (``kinks``
in the result lists the flips).

Also recorded, for every model that ran: the share of the training graph's nodes that run on ORT's kernels
(``ort_op_share``: nodes other than ``org.pytorch.aten::ATen``, ``com.microsoft::PythonOp`` and ``PythonOpGrad``,
over all nodes but ``YieldOp``; and ``param_share``, the share of parameter elements no PythonOp takes: a region
routed to PyTorch is one node however much of the model it holds), and, from the op_profiler plugin, the share of kernel time spent in ORT's kernels
(``ort_time_share``).
"""

from __future__ import annotations

import os

# Set before torch is imported (see ENGINE-NOTES): torch's OpenMP workers otherwise spin after each parallel region
# and steal a core from ORT's kernels. Eager is unaffected.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from ortcore_plugins.gradient_audit.kinks import (  # noqa: E402
    KinkExplanation,
    KinksAsTaken,
    ReluKinks,
    explain_by_kinks,
    max_distances,
)
from tests.zoo.catalog import ZooModel  # noqa: E402
from tests.zoo.catalogs import CATALOGS, DEFAULT_CATALOG, get  # noqa: E402
from tests.zoo.relu_signs import ortcore_relu_signs  # noqa: E402

RTOL = 1e-3
ATOL = 1e-5
F64_FACTOR = 10.0
LR = 1e-3
TRAIN_STEPS = 3
TIMED_STEPS = 5
SEED = 0
BATCH_SEED = 1234
PERTURB_SEED = 99
PERTURBED_RUNS = 3  # float32 eager runs on perturbed batches that measure a batch-norm model's first-step spread

# Ops routed to PyTorch for speed by aten_fallback's default torch_kernels (forward and gradient ATen nodes).
_SPEED_ROUTED = ("embedding", "gelu", "layer_norm", "cross_entropy")
# Nodes that run PyTorch's code inside the ORT graph: ATen nodes (forward and gradient) and autograd Functions.
_PYTORCH_NODES = {("org.pytorch.aten", "ATen"), ("com.microsoft", "PythonOp"), ("com.microsoft", "PythonOpGrad")}
_STRUCTURAL_NODES = {"YieldOp"}  # ORT's split between forward and backward: neither side's work


# -- comparisons ---------------------------------------------------------------------------------------------------


def compare(
    actual: torch.Tensor | None,
    expected: torch.Tensor | None,
    exact: torch.Tensor | None,
    perturbed: list[torch.Tensor | None] = (),
) -> dict[str, Any]:
    """How far ``actual`` (ortcore) is from ``expected`` (eager float32), judged as the module docstring says.

    ``exact`` is the float64 eager value or None when there is none; ``perturbed`` the perturbed float32 eager run's
    values (batch-norm models' gradients), if any. A missing gradient counts as zeros.
    """
    if actual is None and expected is None:
        return {"ok": True, "max_abs": 0.0, "max_rel": 0.0, "missing": "both"}
    ref = expected if expected is not None else actual
    a = (actual if actual is not None else torch.zeros_like(ref)).detach().double()
    b = (expected if expected is not None else torch.zeros_like(ref)).detach().double()
    if a.shape != b.shape:
        return {"ok": False, "error": f"shape {tuple(a.shape)} != eager {tuple(b.shape)}"}
    diff = (a - b).abs()
    scale = b.abs().max().item() if b.numel() else 0.0
    max_abs = diff.max().item() if diff.numel() else 0.0
    ratio = (diff / (ATOL + RTOL * b.abs())).max().item() if diff.numel() else 0.0
    entry: dict[str, Any] = {
        "max_abs": max_abs,
        "max_rel": max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf),
        "tol_ratio": ratio,  # > 1 fails the float32 tolerance
        "ok": ratio <= 1.0,  # NaN compares False
    }
    if actual is None or expected is None:
        entry["missing"] = "ortcore" if actual is None else "eager"
    if not entry["ok"] and exact is not None and math.isfinite(max_abs):
        c = exact.detach().double()
        ort_err = (a - c).abs().max().item()
        eager_err = (b - c).abs().max().item()
        entry.update(ortcore_vs_f64=ort_err, eager_vs_f64=eager_err, judged_by="float64")
        entry["ok"] = ort_err <= F64_FACTOR * eager_err
        others = [p for p in perturbed if p is not None]
        if not entry["ok"] and others:
            perturbed_err = max((p.detach().double() - c).abs().max().item() for p in others)
            entry["perturbed_vs_f64"] = perturbed_err
            if ort_err <= F64_FACTOR * max(eager_err, perturbed_err):
                entry.update(ok=True, judged_by="float64 and perturbed eager")
    return entry


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return _finite(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


# -- the step ------------------------------------------------------------------------------------------------------


def to_double(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def forward_loss(spec: ZooModel, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    torch.manual_seed(SEED)  # nothing here should be random; if something is, both sides draw the same numbers
    return spec.loss(model(**spec.inputs(batch)), batch)


def train_step(spec: ZooModel, model: torch.nn.Module, batch: dict, opt: torch.optim.Optimizer) -> float:
    opt.zero_grad(set_to_none=True)
    loss = forward_loss(spec, model, batch)
    loss.backward()
    opt.step()
    return loss.item()


def _float64_grads(spec: ZooModel, exact: torch.nn.Module, batch64: dict[str, Any], mode: ReluKinks) -> dict:
    """The float64 model's gradients on ``batch64`` with ``mode`` active; ``exact`` itself is not changed."""
    m = copy.deepcopy(exact)
    m.zero_grad(set_to_none=True)
    with mode:
        loss = forward_loss(spec, m, batch64)
    loss.backward()
    return grads(m)


def _kinks_as_ortcore_took(
    spec: ZooModel,
    initial: torch.nn.Module,
    exact: torch.nn.Module,
    batch: dict[str, Any],
    batch64: dict[str, Any],
    target: dict[str, torch.Tensor],
    allowed: dict[str, float],
) -> KinkExplanation:
    """Float64 taking every ReLU element near zero on the side ortcore's float32 took: a copy of the initial model
    runs its first forward under ORTModule with each ReLU's output recorded (an activation subscriber, the ReLU
    outputs tapped while it exports), then float64 follows those signs (``kinks.KinksAsTaken``). Explained when
    every value in ``target`` comes within ``allowed`` of that float64 run."""
    positive = ortcore_relu_signs(copy.deepcopy(initial), lambda ort: forward_loss(spec, ort, batch))
    mode = KinksAsTaken(positive)
    distances = max_distances(target, _float64_grads(spec, exact, batch64, mode))
    return KinkExplanation(
        explained=bool(positive) and all(distances[n] <= allowed[n] for n in target),
        flips=tuple(mode.taken),
        distances=distances,
        candidates=len(positive),
    )


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def routed_ops(ort: Any) -> list[dict[str, Any]]:
    """Ops that run on PyTorch inside the ortcore graph: ``ORTModule.explain()`` if it exists, else the graph's nodes.

    Without ``explain()``, every ATen node (run by PyTorch's kernels) and PythonOp node (an autograd.Function run by
    PyTorch) of the cached training graphs is counted under its operator.
    """
    if getattr(type(ort), "explain", None) is not None:
        try:
            return [dict(e) for e in ort.explain() if e.get("runs_on") == "PyTorch"]
        except Exception as e:  # a broken explain() must not hide the numbers: read the graphs instead
            logging.getLogger(__name__).warning("ORTModule.explain() failed (%s: %s)", type(e).__name__, e)
    counts: Counter = Counter()
    for graph, session in list(ort.state_machine._sessions.values()):
        model = session.model if session is not None else graph.model
        for node in model.graph.node:
            if node.op_type == "ATen":
                attr = {a.name: a for a in node.attribute}
                op = attr["operator"].s.decode() if "operator" in attr else "?"
                counts[("ATen", op)] += 1
            elif node.op_type == "PythonOp":
                attr = {a.name: a for a in node.attribute}
                op = attr["func_name"].s.decode() if "func_name" in attr else "?"
                counts[("PythonOp", op)] += 1
    result = []
    for (kind, op), count in sorted(counts.items()):
        base = op.split("::")[-1]
        if kind == "PythonOp":
            reason = "autograd.Function run by PyTorch (PythonOp)"
        elif any(base.startswith(s) or f"{s}_backward" in base for s in _SPEED_ROUTED):
            reason = "faster PyTorch kernel (aten_fallback torch_kernels)"
        else:
            reason = "ATen node (exporter or ORT cannot handle it)"
        result.append({"op": op, "runs_on": "PyTorch", "count": count, "reason": reason})
    return result


def repairs(ort: Any) -> list[str]:
    """The repairs in force (``ORTModule.explain().repairs``: what ortcore moved to PyTorch after a failed export,
    build, run or gradient audit, and why), when this ortcore records them."""
    try:
        return [str(r) for r in getattr(ort.explain(), "repairs", ())]
    except Exception as e:  # a description, not a check: it must not hide the step's result
        return [f"(explain() failed: {type(e).__name__}: {e})"]


def ort_op_share(ort: Any) -> dict[str, Any]:
    """The share of the training graph's nodes that ORT runs: nodes other than ATen and PythonOp(Grad), over all
    nodes but ``YieldOp``, in the graph the last call ran (forward and backward), with the PyTorch nodes per op."""
    current = ort.state_machine.current
    if current is None:
        return {"share": None, "why": "no graph ran"}
    graph, session = current
    model = session.model if session is not None else graph.model
    total = 0
    on_pytorch: Counter = Counter()
    # A PythonOp is one node however much it runs (a region can hold the whole model): also count the parameters
    # it takes, by elements. Such a parameter's gradient comes (at least in part) from PyTorch's autograd.
    params = {n: p.numel() for n, p in ort.module.named_parameters()} if hasattr(ort, "module") else {}
    in_python_ops: set[str] = set()
    for node in model.graph.node:
        if node.op_type in _STRUCTURAL_NODES:
            continue
        total += 1
        if node.op_type == "PythonOp":
            in_python_ops.update(i for i in node.input if i in params)
        if (node.domain, node.op_type) in _PYTORCH_NODES:
            attr = {a.name: a for a in node.attribute}
            key = "operator" if node.op_type == "ATen" else "func_name"
            op = attr[key].s.decode() if key in attr else "?"
            on_pytorch[f"{node.op_type}:{op}"] += 1
    pytorch = sum(on_pytorch.values())
    all_params = sum(params.values())
    return {
        "share": (total - pytorch) / total if total else None,
        "nodes": total,
        "ort_nodes": total - pytorch,
        "pytorch_nodes": dict(sorted(on_pytorch.items())),
        "param_share": 1 - sum(params[n] for n in in_python_ops) / all_params if all_params else None,
        "params_in_python_ops": sorted(in_python_ops)[:20],
    }


def ort_time_share(spec: ZooModel, ort: Any, batch: dict, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The share of a training step's kernel time spent in ORT's kernels, from the op_profiler plugin (2 profiled
    steps after 1 warm-up step; ORT's profiler is a session setting, so the session is built again, not exported)."""
    from ortcore_plugins.op_profiler import profile_steps

    profile = profile_steps(ort, lambda: train_step(spec, ort, batch, opt), steps=2, warmup=1)
    by_side: Counter = Counter()
    for row in profile["ops"]:
        by_side[row.get("runs_on", "?")] += row.get("total_ms", 0.0)
    total = sum(by_side.values())
    return {
        "share": by_side.get("ORT", 0.0) / total if total else None,
        "kernel_ms_per_step": dict(by_side),
        "step_ms": profile.get("step_ms"),
    }


def has_batch_norm(model: torch.nn.Module) -> bool:
    """Whether ``model`` normalises by batch statistics in training (a batch-norm module in training mode)."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


def perturb(batch: dict[str, Any], seed: int = PERTURB_SEED) -> dict[str, Any]:
    """``batch`` as float32 rounding could have left it: the rows of every tensor with the batch's leading size in
    reverse order (the same examples, summed in another order) and every floating value moved by one unit in the
    last place, up or down at random (``seed``)."""
    sizes = [v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    n = sizes[0] if sizes else 0
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n:
            v = v.flip(0)
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            sign = torch.randint(0, 2, v.shape, generator=gen).to(v.dtype) * 2 - 1
            v = v * (1 + sign * torch.finfo(v.dtype).eps)
        out[k] = v
    return out


_OP_PATTERNS = (
    r"(aten::[\w.]+)",
    r"(?:has not been registered|[Cc]ould not find an implementation for):? (\w+)",
    r"(?:conversion of|symbolic (?:function )?for|[Ee]xporting the operator) ['\"`]?([\w:.]+)",
    r"(torchvision::\w+)",
    r"[Oo]p(?:erator)? ?\(?['\"]?(\w+)['\"]?\)? (?:is )?not (?:supported|implemented)",
    r"Op \((\w+)\)",
    r"[Nn]ode \(?[\w/.:-]*\)? ?[Oo]p ?\(?(\w+)",
    r"op_type[=: ]+['\"]?(\w+)",
    r"No gradient .*? for (\w+)",
    r"'(\w+)' (?:op|node)",
)


def failing_op(text: str) -> str | None:
    """The op an error message names, if it names one."""
    for pattern in _OP_PATTERNS:
        match = re.search(pattern, text)
        if match:
            return match.group(1)
    return None


def run(name: str, catalog: str = DEFAULT_CATALOG) -> dict[str, Any]:
    """Run the model ``name`` of ``catalog``; the result dict is what ``--json`` writes (see the module docstring)."""
    spec = get(name, catalog)
    result: dict[str, Any] = {
        "model": name,
        "catalog": catalog,
        "family": spec.family,
        "description": spec.description,
        "status": "error",
        "phase": "build model",
        "tolerance": {"rtol": RTOL, "atol": ATOL, "f64_factor": F64_FACTOR},
        "fallback_policy": os.environ.get("ORTMODULE_FALLBACK_POLICY"),
        "exporter": os.environ.get("ORTCORE_EXPORTER", "torchscript"),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        _run(spec, result)
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
        result["status"] = "error"
    return result


def _run(spec: ZooModel, result: dict[str, Any]) -> None:
    result["phase"] = "import ortcore"
    from ortcore import ORTModule

    result["phase"] = "build model"
    torch.manual_seed(SEED)
    model = spec.build().train()
    n_params = sum(p.numel() for p in model.parameters())
    result["parameters"] = n_params
    ref = copy.deepcopy(model)
    ref_initial = copy.deepcopy(model) if has_batch_norm(model) else None
    exact = copy.deepcopy(model).double()
    perturbed = copy.deepcopy(model) if has_batch_norm(model) else None
    batch = spec.batch(torch.Generator().manual_seed(BATCH_SEED))
    batch64 = to_double(batch)
    batch_perturbed = perturb(batch)

    result["phase"] = "eager reference"
    t0 = time.perf_counter()
    loss_ref = forward_loss(spec, ref, batch)
    loss_ref.backward()
    result["eager_first_step_s"] = time.perf_counter() - t0
    try:
        loss_exact = forward_loss(spec, exact, batch64)
        loss_exact.backward()
    except Exception as e:  # some kernels have no float64 version (grouped_mm): judge by float32 alone
        exact = None
        loss_exact = None
        result["float64_reference"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"

    if perturbed is not None:
        loss_perturbed = forward_loss(spec, perturbed, batch_perturbed)
        loss_perturbed.backward()
        result["curve_reference"] = "float32 eager on the batch with rows reversed and values moved by 1 ulp"
    extra_perturbed_grads = []
    for seed in range(PERTURB_SEED + 1, PERTURB_SEED + PERTURBED_RUNS) if perturbed is not None else ():
        other = copy.deepcopy(ref_initial)
        forward_loss(spec, other, perturb(batch, seed)).backward()
        extra_perturbed_grads.append(grads(other))
        del other
    del ref_initial

    result["phase"] = "wrap in ORTModule"
    initial = copy.deepcopy(model) if perturbed is not None else None  # for the kink check
    ort = ORTModule(model)
    result["phase"] = "first ortcore step (export, build, forward)"
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = forward_loss(spec, ort, batch)
        result["phase"] = "first ortcore backward"
        loss.backward()
    result["ortcore_first_step_s"] = time.perf_counter() - t0
    result["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0][:200]}" for w in caught})
    counters = ort.state_machine.counters
    if counters.fallbacks or not counters.exports:
        raise RuntimeError(f"the step did not run in ONNX Runtime: {counters}; {ort.fallback_reason}")

    result["phase"] = "compare step"
    checks: dict[str, Any] = {"loss": compare(loss, loss_ref, loss_exact)}
    g_ort, g_ref = grads(ort.module), grads(ref)
    g_exact = grads(exact) if exact is not None else {}
    g_perturbed = [grads(perturbed)] + extra_perturbed_grads if perturbed is not None else []
    grad_checks = {n: compare(g_ort.get(n), g_ref[n], g_exact.get(n), [g.get(n) for g in g_perturbed]) for n in g_ref}
    failing = {n: c for n, c in grad_checks.items() if not c["ok"] and c.get("judged_by", "").startswith("float64")}
    if failing and perturbed is not None and exact is not None:
        result["phase"] = "kink check"
        target = {n: g_ort[n] for n in failing}
        allowed = {n: F64_FACTOR * c["eager_vs_f64"] for n, c in failing.items()}
        kinks = _kinks_as_ortcore_took(spec, initial, exact, batch, batch64, target, allowed)
        if not kinks.explained:
            kinks = explain_by_kinks(lambda mode: _float64_grads(spec, exact, batch64, mode), target, allowed)
        result["kinks"] = {
            "explained": kinks.explained,
            "flips": [{"relu_call": c, "element": i} for c, i in kinks.flips],
            "ortcore_vs_flipped": kinks.distances,
            "candidates": kinks.candidates,
        }
        if kinks.explained:
            for n, c in failing.items():
                c.update(ok=True, judged_by="float64 with ReLU kinks flipped", ortcore_vs_flipped=kinks.distances[n])
    checks["grads"] = grad_checks
    result["loss"] = {"ortcore": loss.item(), "eager": loss_ref.item()}
    result["routed_ops"] = routed_ops(ort)
    result["repairs"] = repairs(ort)
    try:
        result["ort_op_share"] = ort_op_share(ort)
    except Exception as e:  # a number to report, not a check of the step: it must not hide the step's result
        result["ort_op_share"] = {"share": None, "why": f"{type(e).__name__}: {e}"[:300]}
    if g_exact:
        result["grads_farthest_from_f64"] = _farthest_from_exact(g_ort, g_ref, g_exact)

    result["phase"] = "AdamW steps"
    lr = spec.lr if spec.lr is not None else LR
    result["lr"] = lr
    curves: dict[str, list[float]] = {"ortcore": [loss.item()], "eager": [loss_ref.item()]}
    opts = {"ortcore": torch.optim.AdamW(ort.parameters(), lr=lr), "eager": torch.optim.AdamW(ref.parameters(), lr=lr)}
    models = {"ortcore": ort, "eager": ref}
    if exact is not None:
        curves["float64"] = [loss_exact.item()]
        opts["float64"] = torch.optim.AdamW(exact.parameters(), lr=lr)
        models["float64"] = exact
    batches = {"float64": batch64, "eager_perturbed": batch_perturbed}
    if perturbed is not None:
        curves["eager_perturbed"] = [loss_perturbed.item()]
        opts["eager_perturbed"] = torch.optim.AdamW(perturbed.parameters(), lr=lr)
        models["eager_perturbed"] = perturbed
    for step in range(TRAIN_STEPS):
        for side in models:
            # The first step's gradients are already in .grad: update, then measure the loss at the new weights.
            opts[side].step()
            opts[side].zero_grad(set_to_none=True)
        if step == 0:
            result["params_after_first_update"] = _farthest_params(models)
        for side, m in models.items():
            loss_i = forward_loss(spec, m, batches.get(side, batch))
            loss_i.backward()
            curves[side].append(loss_i.item())
    result["curves"] = curves
    checks["curve"] = [
        compare(
            torch.tensor(curves["ortcore"][i]),
            torch.tensor(curves["eager"][i]),
            torch.tensor(curves["float64"][i], dtype=torch.float64) if "float64" in curves else None,
        )
        for i in range(TRAIN_STEPS + 1)
    ]
    if "eager_perturbed" in curves:
        for i, check in enumerate(checks["curve"]):
            _judge_by_perturbed(check, curves["ortcore"][i], curves["eager"][i], curves["eager_perturbed"][i])
    result["checks"] = checks

    result["phase"] = "timing"
    # Interleaved steps, so load from other processes hits both sides alike; the median is reported, the minimum kept.
    samples: dict[str, list[float]] = {"eager": [], "ortcore": []}
    for side in samples:
        train_step(spec, models[side], batch, opts[side])  # warm-up
    for _ in range(TIMED_STEPS):
        for side in samples:
            t0 = time.perf_counter()
            train_step(spec, models[side], batch, opts[side])
            samples[side].append(time.perf_counter() - t0)
    result["step_s"] = {side: statistics.median(s) for side, s in samples.items()}
    result["step_min_s"] = {side: min(s) for side, s in samples.items()}
    result["step_ratio"] = result["step_s"]["ortcore"] / result["step_s"]["eager"]
    result["load_average"] = os.getloadavg()[0]
    result["state_machine"] = {k: getattr(counters, k) for k in ("exports", "builds", "reuses", "fallbacks")}

    result["phase"] = "kernel time per side (op_profiler)"
    try:
        result["ort_time_share"] = ort_time_share(spec, ort, batch, opts["ortcore"])
    except Exception as e:  # a number to report, not a check of the step
        result["ort_time_share"] = {"share": None, "why": f"{type(e).__name__}: {e}"[:300]}

    result["phase"] = "done"
    failures = []
    if not checks["loss"]["ok"]:
        failures.append("loss")
    bad = sorted((n for n, c in grad_checks.items() if not c["ok"]), key=lambda n: -_badness(grad_checks[n]))
    if bad:
        failures.append(f"{len(bad)}/{len(grad_checks)} gradients")
    if not all(c["ok"] for c in checks["curve"]):
        failures.append("AdamW loss curve")
    result["failed_checks"] = failures
    result["worst_grads"] = [{"name": n, **grad_checks[n]} for n in bad[:5]]
    result["status"] = "mismatch" if failures else "pass"
    if not failures and _mostly_pytorch(result.get("ort_op_share") or {}, bool(result.get("repairs"))):
        # Right, but not ortcore's job done: the repairs moved most of the model into PyTorch.
        result["status"] = "pytorch"
        result["failed_checks"] = ["most of the model runs in PyTorch"]


MIN_ORT_SHARE = 0.5  # of a passing model's training-graph nodes, and of its parameters, on ORT


def _mostly_pytorch(measured: dict[str, Any], repaired: bool) -> bool:
    """PythonOps (regions) taking most parameters (a region is one node however much of the model it holds), or, when
    repairs are in force, less than :data:`MIN_ORT_SHARE` of the graph's nodes on ORT. A model that is one op ORT has
    no kernel for (a ConvTranspose's gradient) runs that op on PyTorch by design and is not judged by its nodes."""
    params, nodes = measured.get("param_share"), measured.get("share")
    low = [params] + ([nodes] if repaired else [])
    return any(isinstance(x, int | float) and x < MIN_ORT_SHARE for x in low)


def _judge_by_perturbed(check: dict[str, Any], ortcore: float, eager: float, perturbed: float) -> None:
    """Let a curve point that failed the float32 tolerance (and float64) pass when ortcore is within ``F64_FACTOR``
    times as far from eager as float32 eager on the perturbed batch is: there float32 rounding alone moves the
    curve that far (batch norm)."""
    spread = abs(perturbed - eager)
    check["eager_perturbed"] = perturbed
    check["perturbed_vs_eager"] = spread
    if not check["ok"] and math.isfinite(ortcore):
        check["ok"] = abs(ortcore - eager) <= F64_FACTOR * spread
        if check["ok"]:
            check["judged_by"] = "perturbed eager"


def _farthest_from_exact(
    g_ort: dict[str, torch.Tensor | None],
    g_ref: dict[str, torch.Tensor | None],
    g_exact: dict[str, torch.Tensor | None],
) -> list[dict[str, Any]]:
    """The 5 gradients where ortcore is farthest from float64 relative to how far float32 eager is (max abs).

    Within tolerance or not, these point at the op whose ortcore gradient is least accurate: AdamW divides by the
    gradient's magnitude, so small errors in small gradients show in the loss curve.
    """
    rows = []
    for name, exact in g_exact.items():
        if exact is None or g_ort.get(name) is None or g_ref.get(name) is None:
            continue
        ort_err = (g_ort[name].double() - exact).abs().max().item()
        eager_err = (g_ref[name].double() - exact).abs().max().item()
        ratio = ort_err / eager_err if eager_err > 0 else (math.inf if ort_err > 0 else 1.0)
        rows.append({"name": name, "ortcore_vs_f64": ort_err, "eager_vs_f64": eager_err, "ratio": ratio})
    return sorted(rows, key=lambda r: -r["ratio"])[:5]


def _farthest_params(models: dict[str, torch.nn.Module]) -> list[dict[str, Any]]:
    """The 5 parameters whose ortcore and eager values differ most (max abs) after the first AdamW update.

    AdamW moves every element by about ``lr`` whatever its gradient's size, so a gradient error that is small in
    absolute terms but flips or scales a tiny element shows here, not in the gradient check.
    """
    exact = dict(models["float64"].named_parameters()) if "float64" in models else {}
    eager = dict(models["eager"].named_parameters())
    rows = []
    for name, p in models["ortcore"].module.named_parameters():
        row = {"name": name, "ortcore_vs_eager": (p.double() - eager[name].double()).abs().max().item()}
        if name in exact:
            row["eager_vs_f64"] = (eager[name].double() - exact[name]).abs().max().item()
        rows.append(row)
    return sorted(rows, key=lambda r: -r["ortcore_vs_eager"])[:5]


def _badness(check: dict[str, Any]) -> float:
    ratio = check.get("tol_ratio", math.inf)
    return math.inf if ratio is None or not math.isfinite(ratio) else ratio


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write ``result`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_jsonable(result), indent=1, allow_nan=False))
    os.replace(tmp, path)


def summary(result: dict[str, Any]) -> str:
    """A few readable lines about one model's result."""
    lines = [f"{result['model']} ({result['description']}): {result['status'].upper()}"]
    if result["status"] in ("error", "crash", "timeout"):
        err = result.get("error", {})
        lines.append(f"  in phase: {result.get('phase')}")
        lines.append(f"  {err.get('type')}: {err.get('first_line')}")
        if err.get("op"):
            lines.append(f"  op: {err['op']}")
        return "\n".join(lines)
    checks = result["checks"]
    loss = checks["loss"]
    lines.append(
        f"  loss ortcore {result['loss']['ortcore']:.6g} eager {result['loss']['eager']:.6g} "
        f"(max abs {loss['max_abs']:.2e}, {'ok' if loss['ok'] else 'FAIL'})"
    )
    g = checks["grads"]
    worst = max(g.values(), key=_badness, default=None)
    n_ok = sum(c["ok"] for c in g.values())
    lines.append(
        f"  gradients: {n_ok}/{len(g)} within tolerance"
        + (f"; worst tol ratio {worst.get('tol_ratio', float('nan')):.3g}" if worst else "")
    )
    for w in result.get("worst_grads", []):
        extra = ""
        if w.get("judged_by") == "float64":
            extra = f", vs float64: ortcore {w['ortcore_vs_f64']:.2e} eager {w['eager_vs_f64']:.2e}"
            if "perturbed_vs_f64" in w:
                extra += f" perturbed eager {w['perturbed_vs_f64']:.2e}"
        lines.append(
            f"    FAIL {w['name']}: max abs {w.get('max_abs', float('nan')):.2e} "
            f"max rel {w.get('max_rel', float('nan')):.2e}{extra}{' ' + w['error'] if 'error' in w else ''}"
        )
    kinks = result.get("kinks")
    if kinks:
        verdict = "explain" if kinks["explained"] else "do not explain"
        lines.append(
            f"  float32 ReLU kinks: {len(kinks['flips'])} element(s) within rounding of zero taken on the other side "
            f"in float64 {verdict} ortcore's distance ({', '.join(f'{n} {d:.2e}' for n, d in kinks['ortcore_vs_flipped'].items())})"
        )
    curve = result["curves"]
    lines.append("  AdamW losses ortcore " + " ".join(f"{x:.6g}" for x in curve["ortcore"]))
    lines.append("  AdamW losses eager   " + " ".join(f"{x:.6g}" for x in curve["eager"]))
    st = result["step_s"]
    lines.append(
        f"  step: eager {st['eager'] * 1e3:.1f} ms, ortcore {st['ortcore'] * 1e3:.1f} ms "
        f"(x{result['step_ratio']:.2f}); first ortcore step {result['ortcore_first_step_s']:.2f} s"
    )
    routed = result.get("routed_ops") or []
    lines.append("  on PyTorch: " + (", ".join(f"{r['op']} x{r['count']} ({r['reason']})" for r in routed) or "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="zoo model name")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--catalog", default=DEFAULT_CATALOG, choices=list(CATALOGS), help="zoo (default: %(default)s)")
    parser.add_argument(
        "--autocast", choices=["bf16", "fp16"], help="run one step under torch.autocast instead (tests.zoo.autocast)"
    )
    args = parser.parse_args(argv)
    try:
        get(args.model, args.catalog)
    except KeyError as e:
        parser.error(str(e.args[0]))
    t0 = time.perf_counter()
    if args.autocast:
        from tests.zoo import autocast

        result = autocast.run(args.model, args.autocast, args.catalog)
        describe = autocast.summary
    else:
        result = run(args.model, args.catalog)
        describe = summary
    result["wall_s"] = time.perf_counter() - t0
    if args.json:
        write_json(result, args.json)
    print(describe(result))
    return 0 if result["status"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
