"""The repairs this plugin offers (``ortcore_repairs``): an op the exporter or ONNX Runtime failed on becomes an ATen
node.

Op routing catches ops without any ONNX symbolic. An op *with* a symbolic can still fail for some inputs (a size the
symbolic needs static, a dtype it does not take, an attribute it cannot express): the exporter's error names the op,
and listing it in ``fallback_ops`` exports it as one ATen node run by PyTorch (forward, and backward through
``torch.autograd``), the smallest change that lets the rest of the model stay in ORT.

An op can also export cleanly in an element type ONNX Runtime's CPU provider has no kernel for, which the
``kernel_types`` plugin cannot compute in a lossless wider type (an int64 ``ArgMax``, a double ``ReduceProd``):
session creation then fails naming the ONNX node ("Could not find an implementation for ArgMax(13) node with name
'/module/ArgMax'", or a type error naming the operator). The node's ONNX op type says which ``aten::`` ops the
exporters write it for (:data:`EXPORTED_AS`); each becomes a candidate, tried in that order.
"""

from __future__ import annotations

import re

import torch

from ortcore.api import Config, Failure, Repair

from .options import NAME, fallback_ops

# ONNX op types whose kernel ORT may lack for a type, and the aten:: ops the exporters write as that op, most likely
# first (a failure names the ONNX node only). Only ops fallback_symbolic can run: not eye (a Device argument) nor
# einsum (a tensor list).
EXPORTED_AS: dict[str, tuple[str, ...]] = {
    "ArgMax": ("argmax", "max"),
    "ArgMin": ("argmin", "min"),
    "CumSum": ("cumsum",),
    "Max": ("maximum", "max"),
    "Min": ("minimum", "min"),
    "NonZero": ("nonzero",),
    "Pow": ("pow",),
    "ReduceMax": ("amax", "max"),
    "ReduceMin": ("amin", "min"),
    "ReduceProd": ("prod",),
    "Relu": ("relu",),
    "TopK": ("topk", "sort", "argsort"),
    "Trilu": ("tril", "triu"),
    "Unique": ("_unique2", "unique_dim"),
    "Where": ("where", "masked_fill"),
}

# ONNX Runtime's messages naming a node it has no kernel for: (op type, node name).
_NO_KERNEL = (
    re.compile(r"Could not find an implementation for (\w+)\(\d+\) node with name '([^']*)'"),
    re.compile(r"Failed to find kernel for (?:[\w.]+\.)?(\w+)\(\d+\) \(node:'([^']*)'"),
    re.compile(r"Type Error: Type '[^']*' of input parameter \([^)]*\) of operator \((\w+)\) in node \(([^)]*)\)"),
)


def unrunnable_nodes(message: str) -> list[tuple[str, str]]:
    """``(ONNX op type, node name)`` of each node ONNX Runtime says it has no kernel for, in ``message``.

    >>> unrunnable_nodes("Could not find an implementation for EyeLike(9) node with name '/module/EyeLike'")
    [('EyeLike', '/module/EyeLike')]
    """
    found = [m.groups() for pattern in _NO_KERNEL for m in pattern.finditer(message)]
    return list(dict.fromkeys(found))


def _route(op: str, listed: list[str]) -> Repair:
    return Repair(f"op {op} runs in PyTorch", plugin=NAME, options={"fallback_ops": [*listed, op]}, kind="op", op=op)


def repairs_for(config: Config, failure: Failure) -> list[Repair]:
    """Export failures: one repair per ``aten::`` op the failure names that PyTorch has and ``fallback_ops`` does not
    list. A build failure on a node ORT has no kernel (or no gradient) for: one repair per ``aten::`` op exported as
    that node's op type (:data:`EXPORTED_AS`), and per op the failing nodes were exported from (the dynamo route
    records it on each node); a first run that fails in a node of the gradient graph, per op its forward node was
    exported from."""
    listed = list(fallback_ops(config))
    if failure.stage == "export":
        candidates = list(failure.ops)
    elif failure.stage in ("build", "run"):
        types = [op_type for op_type, _node in unrunnable_nodes(failure.message)]
        candidates = [f"aten::{name}" for op_type in types for name in EXPORTED_AS.get(op_type, ())]
        candidates += failure.ops  # the ops the failing nodes were exported from, where the graph records them
    else:
        return []
    repairs = []
    for op in dict.fromkeys(candidates):
        if op in listed or not hasattr(torch.ops.aten, op.rpartition("::")[2]):
            continue
        repairs.append(_route(op, listed))
    return repairs
