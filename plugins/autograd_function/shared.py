"""What both routes of the plugin share: the PythonOp node's attributes (:func:`python_op_attributes`, so that both
write the same node), the output dimensions matched to input ones, and the graph passes that read PythonOp nodes
whichever exporter wrote them (output shapes for ORT's gradient builder, inference mode).

Nothing here reads an exporter's graph: each route reads its own (:mod:`.torchscript`, :mod:`.dynamo`), so that
dropping an exporter means deleting its module.
"""

from __future__ import annotations

import json
from typing import Any

import onnx

from ortcore.api import PassContext
from ortcore_plugins.services.python_op import PYTHON_OP, PYTHON_OP_DOMAIN, registry

BOOL = onnx.TensorProto.BOOL


def _dim_sources(shapes: list[list], output_shapes: list[list]) -> list[list]:
    """For each output dimension, the ``[tensor input, dimension]`` with the same size (the same position first, then
    the same position from the end, then any), or None; sizes are ints, symbols (the dynamo route's), or None
    (unknown). The graph pass gives the output that input's (symbolic) dimension, so that ORT's gradient builder sees
    which dimensions agree."""
    sources = []
    for sizes in output_shapes:
        dims = []
        for k, size in enumerate(sizes):
            found = None
            candidates = [(i, k) for i, s in enumerate(shapes) if k < len(s)]
            candidates += [(i, len(s) - len(sizes) + k) for i, s in enumerate(shapes) if 0 <= len(s) - len(sizes) + k]
            candidates += [(i, j) for i, s in enumerate(shapes) for j in range(len(s))]
            for i, j in candidates:
                if size is not None and shapes[i][j] == size:
                    found = [i, j]
                    break
            dims.append(found)
        sources.append(dims)
    return sources


def python_op_attributes(
    key: str,
    convention: str,
    constants: list,
    input_types: list[int],
    input_ranks: list[int],
    output_types: list[int],
    output_ranks: list[int],
    dims: list[list],
) -> dict[str, str | int | list[int]]:
    """The PythonOp node's attributes, the same on both routes: ``constants`` are the non-tensor arguments in order
    (``convention`` has a ``c`` for each): ints, bools and tuples of them by value, any other object (a float: ORT's
    float attributes are float32; None, a string) by reference."""
    values: dict[str, list] = {}

    def add(kind: str, position: int, items: list) -> None:
        values.setdefault(f"input_{kind}_positions", []).append(position)
        if kind.endswith("tuple"):
            values.setdefault(f"input_{kind}_begins", []).append(len(values.get(f"input_{kind}s", [])))
        values.setdefault(f"input_{kind}s", []).extend(items)

    positions = [i for i, kind in enumerate(convention) if kind != "d"]
    for position, arg in zip(positions, constants):
        if isinstance(arg, bool):  # before int: bool is an int
            add("bool_scalar", position, [int(arg)])
        elif isinstance(arg, int):
            add("int_scalar", position, [arg])
        elif isinstance(arg, tuple) and arg and all(isinstance(v, bool) for v in arg):
            add("bool_tuple", position, [int(v) for v in arg])
        elif isinstance(arg, tuple) and arg and all(isinstance(v, int) and not isinstance(v, bool) for v in arg):
            add("int_tuple", position, list(arg))
        else:
            add("pointer_scalar", position, [registry.keep(arg)])
    return {
        "func_name": key,
        "input_convention": convention,
        "input_tensor_types": input_types,
        "input_tensor_ranks": input_ranks,
        # Boolean outputs leave the node as uint8 (ORT's DLPack import has no boolean) and are cast back.
        "output_tensor_types": [onnx.TensorProto.UINT8 if t == BOOL else t for t in output_types],
        "output_tensor_ranks": output_ranks,
        "training_mode": 1,  # inference graphs get 0 (see inference_mode_pass)
        "safe_run_mode": 1,  # the runner keeps a second reference to each context
        "comment": json.dumps({"dims": dims}),
        **values,
    }


def _python_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == PYTHON_OP and n.domain == PYTHON_OP_DOMAIN]


def _comment(node: onnx.NodeProto) -> dict:
    for attribute in node.attribute:
        if attribute.name == "comment":
            try:
                return json.loads(attribute.s.decode())
            except ValueError:
                return {}
    return {}


def relate_output_shapes(model: onnx.ModelProto, _context: PassContext) -> None:
    """Give each PythonOp output the shape its inputs imply: dimension k of an output takes the (symbolic) dimension
    of the input the export matched it to. Without this every output dimension is a fresh symbol, and ORT's gradient
    builder cannot differentiate a broadcast between a PythonOp output and anything else."""
    infos = {v.name: v for v in model.graph.value_info}
    for node in _python_ops(model):  # in graph order: a PythonOp's inputs may come from an earlier one
        sources_of = _comment(node).get("dims")
        if not sources_of:
            continue
        known = {
            v.name: v.type.tensor_type
            for v in (*onnx.shape_inference.infer_shapes(model).graph.value_info, *model.graph.input)
        }
        inputs = list(node.input)
        for output, sources in zip(node.output[1:], sources_of):
            info = infos.get(output)
            if info is None or not info.type.tensor_type.HasField("shape"):
                continue
            for dim, source in zip(info.type.tensor_type.shape.dim, sources):
                if source is None or source[0] >= len(inputs) or inputs[source[0]] not in known:
                    continue
                shape = known[inputs[source[0]]].shape.dim
                if source[1] < len(shape) and (shape[source[1]].dim_param or shape[source[1]].dim_value):
                    dim.CopyFrom(shape[source[1]])


def _has_python_op(model: onnx.ModelProto) -> bool:
    return any(n.op_type == PYTHON_OP and n.domain == PYTHON_OP_DOMAIN for n in model.graph.node)


def inference_mode_pass(model: onnx.ModelProto, graph: Any) -> None:
    """In an inference graph, PythonOps run without autograd and keep no context: ORT runs no PythonOpGrad there."""
    if graph.kind != "inference":
        return
    for node in _python_ops(model):
        for attribute in node.attribute:
            if attribute.name == "training_mode":
                attribute.i = 0
