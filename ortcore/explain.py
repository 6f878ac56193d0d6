"""Where each op kind of an ORTModule's current graph runs, and why.

``model.explain()`` (and ``ortcore explain``) read the graph the last call ran: the training graph's nodes before
ORT's ``YieldOp`` are the forward, the rest the backward. Nodes ORT runs are listed by their ONNX op type; an
``org.pytorch.aten::ATen`` node runs PyTorch's kernel and is listed by the aten op it runs, with the reason a
plugin recorded when it exported the op (model metadata ``ortcore.routed::<op>``)::

    >>> print(model.explain())
    op                      runs on   forward  backward  why
    Gemm                    ORT             2         0
    hardswish               PyTorch         1         1  ORT has no gradient builder for HardSwish
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

import onnx

from .tables import format_table

ROUTED_METADATA_PREFIX = "ortcore.routed::"
#: Why an op kind stays on ORT's kernels, where a plugin decided it (``ortcore.kept::<ONNX op type>``): the
#: ``aten_fallback`` plugin's measured kernel choice, say.
KEPT_METADATA_PREFIX = "ortcore.kept::"
from .domains import ATEN_DOMAIN, PYTHON_OP_DOMAIN  # noqa: E402 (re-exported)

#: Why a PythonOp's Function runs in PyTorch, by Function class name; others are custom autograd Functions.
FUNCTION_REASONS = {"RegionFunction": "modules run in PyTorch as one node each (region_routing)"}


logger = logging.getLogger("ortcore")


def routed_reasons(model: onnx.ModelProto) -> dict[str, str]:
    """``{op: reason}`` of the ops an exported model runs on PyTorch's kernels."""
    n = len(ROUTED_METADATA_PREFIX)
    return {p.key[n:]: p.value for p in model.metadata_props if p.key.startswith(ROUTED_METADATA_PREFIX)}


def kept_reasons(model: onnx.ModelProto) -> dict[str, str]:
    """``{ONNX op type: reason}`` of the op kinds a plugin decided to leave on ORT's kernels."""
    n = len(KEPT_METADATA_PREFIX)
    return {p.key[n:]: p.value for p in model.metadata_props if p.key.startswith(KEPT_METADATA_PREFIX)}


def aten_kind(operator: str) -> str:
    """The op an ATen node's ``operator`` serves: ``ortcore_route::gru__input__<hash>`` and the gradient helper
    ``ortcore_aten::fallback_grad__ortcore_route__gru__input__<hash>__default__0`` serve ``gru``;
    ``ortcore_aten::layer_norm_backward_input`` serves ``layer_norm``; ``native_layer_norm`` serves ``layer_norm``."""
    name = operator.rpartition("::")[2]
    name = re.sub(r"^fallback_grad__", "", name)
    name = re.sub(r"^ortcore_route__", "", name)
    if operator.startswith("ortcore_route::") or "__" in name:
        name = name.split("__")[0]
    name = re.sub(r"_backward(_\w+)?$", "", name)
    return {
        "native_layer_norm": "layer_norm",
        "linear_no_bias": "linear",
        "linear_weight_first": "linear",
        "addmm": "linear",
        "matmul_rhs_first": "matmul",
        "to_bfloat16": "cast",
        "to_float16": "cast",
        "to_float32": "cast",
    }.get(name, name)


class Explanation(list):
    """One dict per op kind: ``op``, ``runs_on`` ("ORT" or "PyTorch"), ``count``, ``forward``, ``backward``,
    ``reason``. Printing it gives a table, then the repairs in force (``repairs``: one line each)."""

    repairs: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what plugins add (``ortcore_explain_notes``): kernel measurement's decisions and cost

    def routed(self) -> dict[str, str]:
        """``{op: reason}`` of the op kinds that run on PyTorch's kernels."""
        return {row["op"]: row["reason"] for row in self if row["runs_on"] == "PyTorch"}

    def __str__(self) -> str:
        if not self:
            return "no graph yet: call the model once"
        rows = [(r["op"], r["runs_on"], r["forward"], r["backward"], r["reason"]) for r in self]
        table = format_table(("op", "runs on", "forward", "backward", "why"), rows, indent="")
        return "\n".join([table, *(f"runs in PyTorch: {line}" for line in self.repairs), *self.notes])


def operator_of(node: onnx.NodeProto) -> str:
    """The ``operator`` attribute of an ATen node (the op it runs)."""
    return next((a.s.decode() for a in node.attribute if a.name == "operator"), "")


def _function_of(node: onnx.NodeProto) -> str:
    """The autograd Function a PythonOp node calls, by class name (``func_name`` also carries its module)."""
    name = next((a.s.decode() for a in node.attribute if a.name == "func_name"), "PythonOp")
    return name.split(":")[0].rpartition(".")[2] or "PythonOp"


def explain_graph(
    model: onnx.ModelProto, reasons: dict[str, str] | None = None, kept: dict[str, str] | None = None
) -> Explanation:
    """Count ``model``'s nodes per op kind, forward and backward apart, and say where each kind runs."""
    reasons = reasons if reasons is not None else routed_reasons(model)
    kept = kept if kept is not None else kept_reasons(model)
    forward: Counter[tuple[str, str]] = Counter()
    backward: Counter[tuple[str, str]] = Counter()
    side = forward
    python_ops = {(_function_of(n), "PyTorch") for n in model.graph.node if n.op_type in ("PythonOp", "PythonOpGrad")}
    for node in model.graph.node:
        if node.op_type == "YieldOp":
            side = backward
            continue
        if node.op_type == "ATen" and node.domain == ATEN_DOMAIN:
            side[(aten_kind(operator_of(node)), "PyTorch")] += 1
        elif node.op_type in ("PythonOp", "PythonOpGrad") and node.domain == PYTHON_OP_DOMAIN:
            side[(_function_of(node), "PyTorch")] += 1
        else:
            prefix = f"{node.domain}::" if node.domain not in ("", "ai.onnx") else ""
            side[(f"{prefix}{node.op_type}", "ORT")] += 1
    rows = Explanation()
    for op, runs_on in sorted(set(forward) | set(backward), key=lambda k: (k[1] != "PyTorch", k[0])):
        f, b = forward[(op, runs_on)], backward[(op, runs_on)]
        reason = kept.get(op, "")
        if runs_on == "PyTorch":
            default = "a custom autograd Function" if (op, "PyTorch") in python_ops else "routed by a plugin"
            reason = reasons.get(op, FUNCTION_REASONS.get(op, default))
        rows.append({"op": op, "runs_on": runs_on, "count": f + b, "forward": f, "backward": b, "reason": reason})
    return rows


def explain(module: Any) -> Explanation:
    """Where each op kind of ``module``'s (an ORTModule's) current graph runs, and why; empty before the first call
    that ran in ORT."""
    current = module.state_machine.current
    if current is None:
        return Explanation()
    graph, session = current
    rows = explain_graph(session.model, routed_reasons(graph.model), kept_reasons(graph.model))
    rows.repairs = tuple(
        f"{r.description.removesuffix(' runs in PyTorch')}, because {r.reason}" for r in module.repairs
    )
    rows.notes = tuple(_notes(module))
    return rows


def _notes(module: Any) -> list[str]:
    runtime = module._ortcore
    try:
        return runtime.hooks.explain_notes(module, runtime.config)
    except Exception as e:  # a plugin's note is never worth the explanation itself
        logger.warning("explain: a plugin's notes failed (%s: %s); the table is complete without them", type(e).__name__, e)
        return []
