"""bias_gemv: a bias gradient as one matrix-vector product instead of ORT's ``ReduceSum``.

ORT's gradient of a bias ``Add`` (``y = x @ W.T + b`` exported as ``MatMul`` + ``Add``) sums the output's gradient over
every leading dimension: ``ReduceSum(dY, axes=[0, 1], keepdims=0)`` for a ``[B, S, N]`` activation. PyTorch folds
that sum into ``addmm``'s backward; ORT runs it as a separate reduction kernel, which on the CPU is slower than the
same sum written as a GEMV on ORT's own GEMM code (MLAS): ``ones[B*S] @ dY.reshape(B*S, N)``. This plugin's
gradient-graph pass rewrites each such ``ReduceSum`` into ``Reshape`` (free: ORT reuses the buffer) + ``MatMul`` with
a constant vector of ones, and a final ``Reshape`` where the reduced shape is not already the product's.

It rewrites a ``ReduceSum`` only when its result is the same whichever way it is computed up to float rounding:

- the axes are constant (an initializer, or the attribute of older opsets) and are the leading ``k`` axes;
- the input's shape is fully known in the graph (static sizes, the default ``dynamic_shapes = "auto"``);
- at least ``min_rows`` rows are summed (below that both kernels take a few microseconds);
- the element type is float, float16 or bfloat16.

The sum's order differs (a dot product against ones instead of a tree reduction), so results differ from ORT's
``ReduceSum`` by float rounding only; the gradient audit compares them with ``torch.autograd`` like every gradient.

Measured (``python benchmarks/bias_reduction_bench.py``, AMD EPYC Zen 4, 2 cores; minimum ms of ReduceSum vs the
GEMV): ``[8,128,256]`` 0.073 vs 0.044, ``[8,128,1024]`` 0.161 vs 0.082, ``[4,256,768]`` 0.141 vs 0.084,
``[4,256,3072]`` 0.384 vs 0.126. See ``docs/plugins/bias_gemv.md``.

Options (``[plugins.bias_gemv]`` in ortcore.toml, or the environment; the environment wins)::

    [plugins.bias_gemv]
    enable = true    # env ORTCORE_BIAS_GEMV=1/0
    min_rows = 64    # env ORTCORE_BIAS_GEMV_MIN_ROWS
"""

from __future__ import annotations

import logging
import math
from typing import Any

import attrs
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortcore.api import Config, GraphPass, hookimpl, int_at_least, option, parse_bool

NAME = "bias_gemv"
PASS_NAME = "bias_gradients_as_gemv"

logger = logging.getLogger("ortcore.plugins.bias_gemv")

_FLOAT_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
    TensorProto.BFLOAT16: None,  # written as raw bytes below: numpy has no bfloat16
}


@attrs.frozen
class BiasGemvOptions:
    """Options of the ``bias_gemv`` plugin."""

    enable: bool = option(
        True, parse_bool, "sum bias gradients with a GEMV on ORT's GEMM instead of ReduceSum", "ORTCORE_BIAS_GEMV"
    )
    min_rows: int = option(
        64,
        int_at_least(1),
        "rewrite a ReduceSum only when it sums at least this many rows",
        "ORTCORE_BIAS_GEMV_MIN_ROWS",
    )


@hookimpl
def ortcore_options_class() -> type:
    return BiasGemvOptions


@hookimpl
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass]:
    options = config.plugin_options(NAME)
    if options is None or not options.enable:
        return []

    def run(model: onnx.ModelProto, graph: Any) -> None:
        rewritten = reductions_as_gemv(model, min_rows=options.min_rows)
        if rewritten:
            graph.notes[NAME] = {"rewritten": rewritten}
            logger.info("bias_gemv: %d ReduceSum node(s) run as a GEMV: %s", len(rewritten), ", ".join(rewritten))

    return [GraphPass(PASS_NAME, run=run)]


def _known_shapes(graph: onnx.GraphProto) -> dict[str, tuple[list[int], int]]:
    """Value name -> (shape, element type) for every value whose shape is fully static."""
    known: dict[str, tuple[list[int], int]] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            known[value.name] = ([d.dim_value for d in dims], tensor.elem_type)
    return known


def _constant_axes(node: onnx.NodeProto, initializers: dict[str, onnx.TensorProto]) -> list[int] | None:
    attributes = {a.name: a for a in node.attribute}
    if "axes" in attributes:
        return list(attributes["axes"].ints)
    if len(node.input) > 1 and node.input[1]:
        tensor = initializers.get(node.input[1])
        return None if tensor is None else [int(a) for a in numpy_helper.to_array(tensor).reshape(-1)]
    return None  # no axes: a sum over every axis, or a no-op; not a bias gradient


def _ones(name: str, rows: int, elem_type: int) -> onnx.TensorProto:
    dtype = _FLOAT_TYPES[elem_type]
    if dtype is not None:
        return numpy_helper.from_array(np.ones(rows, dtype=dtype), name)
    # bfloat16 1.0 is 0x3F80
    return helper.make_tensor(name, TensorProto.BFLOAT16, [rows], np.full(rows, 0x3F80, np.uint16).tobytes(), raw=True)


def reductions_as_gemv(model: onnx.ModelProto, *, min_rows: int = 64) -> list[str]:
    """Rewrite each ``ReduceSum`` over the leading axes of a static-shaped float tensor into ``Reshape`` +
    ``MatMul(ones, ...)``; returns the rewritten nodes' outputs. Edits ``model`` in place."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    known = _known_shapes(graph)
    taken = {t.name for t in graph.initializer} | {n for node in graph.node for n in (*node.input, *node.output)}
    added: dict[str, onnx.TensorProto] = {}
    rewritten: list[str] = []
    nodes: list[onnx.NodeProto] = []
    dropped_axes: set[str] = set()

    def constant(name: str, make: Any) -> str:
        if name not in added:
            unique = name
            while unique in taken:
                unique += "_"
            added[name] = make(unique)
        return added[name].name

    for node in graph.node:
        replacement = None
        if node.op_type == "ReduceSum" and node.domain in ("", "ai.onnx") and node.input and node.input[0] in known:
            shape, elem_type = known[node.input[0]]
            axes = _constant_axes(node, initializers)
            keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
            if axes and elem_type in _FLOAT_TYPES and len(axes) < len(shape):
                axes = sorted(a % len(shape) for a in axes)
                lead = len(axes)
                rows = math.prod(shape[:lead])
                if axes == list(range(lead)) and rows >= min_rows:
                    cols = math.prod(shape[lead:])
                    out_shape = ([1] * lead if keepdims else []) + shape[lead:]
                    replacement = _gemv_nodes(node, rows, cols, out_shape, elem_type, constant)
        if replacement is None:
            nodes.append(node)
        else:
            nodes.extend(replacement)
            rewritten.append(node.output[0])
            if len(node.input) > 1 and node.input[1] in initializers:
                dropped_axes.add(node.input[1])
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
        graph.initializer.extend(added.values())
        _drop_unread_axes(graph, dropped_axes)
    return rewritten


def _drop_unread_axes(graph: onnx.GraphProto, names: set[str]) -> None:
    """The rewritten nodes' axes initializers that nothing reads any more (ORT would warn about each)."""
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    unread = names - read
    if unread:
        kept = [t for t in graph.initializer if t.name not in unread]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        kept_inputs = [i for i in graph.input if i.name not in unread]
        if len(kept_inputs) != len(graph.input):
            del graph.input[:]
            graph.input.extend(kept_inputs)


def _gemv_nodes(
    node: onnx.NodeProto, rows: int, cols: int, out_shape: list[int], elem_type: int, constant: Any
) -> list[onnx.NodeProto]:
    base = f"{node.output[0]}_gemv"
    type_name = TensorProto.DataType.Name(elem_type).lower()
    ones = constant(f"bias_gemv_ones_{rows}_{type_name}", lambda n: _ones(n, rows, elem_type))
    matrix_shape = constant(
        f"bias_gemv_shape_{rows}x{cols}", lambda n: numpy_helper.from_array(np.array([rows, cols], np.int64), n)
    )
    new = [
        helper.make_node("Reshape", [node.input[0], matrix_shape], [f"{base}_matrix"], name=f"{base}_reshape"),
    ]
    if out_shape == [cols]:
        new.append(helper.make_node("MatMul", [ones, f"{base}_matrix"], [node.output[0]], name=f"{base}_matmul"))
        return new
    final_shape = constant(
        "bias_gemv_shape_" + "x".join(map(str, out_shape)),
        lambda n: numpy_helper.from_array(np.array(out_shape, np.int64), n),
    )
    new += [
        helper.make_node("MatMul", [ones, f"{base}_matrix"], [f"{base}_sum"], name=f"{base}_matmul"),
        helper.make_node("Reshape", [f"{base}_sum", final_shape], [node.output[0]], name=f"{base}_shape"),
    ]
    return new
