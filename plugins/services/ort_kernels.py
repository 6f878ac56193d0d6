"""What ONNX Runtime's execution provider runs, asked of ORT itself, and the element types of a graph's values.

Shared by the plugins that place nodes by the kernels ORT has (``kernel_types`` for bool and small integer types,
``mixed_precision`` for bfloat16 and float16):

* :func:`ort_runs`: whether the provider runs a node (its op, domain and attributes) on inputs of given element
  types, from a one-node session created once per process and signature (about a millisecond);
* :func:`value_types`: the element type of every value of a graph that ONNX shape inference or the exporter knows;
* :func:`type_name`: ``bfloat16`` for ``TensorProto.BFLOAT16``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import onnx
from onnx import TensorProto

from ortcore.api import probe_session

logger = logging.getLogger("ortcore.ort_kernels")

_TYPE_NAMES = {v: k.lower() for k, v in TensorProto.DataType.items()}
# Opset of the Microsoft domain (gradient and fused ops) a probe of such a node imports.
MS_DOMAIN = "com.microsoft"
_DOMAIN_OPSETS = {MS_DOMAIN: 1}


def type_name(elem_type: int) -> str:
    return _TYPE_NAMES.get(elem_type, str(elem_type))


_lock = threading.Lock()
_answers: dict[tuple, bool | None] = {}


def _probe_model(
    node: onnx.NodeProto, input_types: Sequence[int | None], opset: int, ir_version: int
) -> onnx.ModelProto:
    inputs, names = [], []
    for k, (name, elem_type) in enumerate(zip(node.input, input_types, strict=True)):
        if not name:
            names.append("")
            continue
        names.append(f"i{k}")
        inputs.append(onnx.helper.make_tensor_value_info(f"i{k}", elem_type, None))
    outputs = [f"o{k}" if name else "" for k, name in enumerate(node.output)]
    probe = onnx.helper.make_node(node.op_type, names, outputs, domain=node.domain)
    probe.attribute.extend(node.attribute)
    graph = onnx.helper.make_graph(
        [probe], "probe", inputs, [onnx.ValueInfoProto(name=name) for name in outputs if name]
    )
    opsets = [onnx.helper.make_opsetid("", opset)]
    if node.domain not in ("", "ai.onnx"):
        opsets.append(onnx.helper.make_opsetid(node.domain, _DOMAIN_OPSETS.get(node.domain, 1)))
    model = onnx.helper.make_model(graph, opset_imports=opsets)
    model.ir_version = ir_version
    return model


def ort_runs(node: onnx.NodeProto, input_types: Sequence[int | None], opset: int, ir_version: int = 8) -> bool | None:
    """Whether ORT's CPU provider runs ``node`` (its op, domain and attributes) on inputs of ``input_types``: True,
    False (no kernel for these types, or types the op's schema does not allow), or None (the probe failed otherwise,
    or an input's type is unknown: callers leave such a node alone). Asked of ORT once per process and signature."""
    if any(t is None for name, t in zip(node.input, input_types, strict=True) if name):
        return None
    attributes = tuple(a.SerializeToString() for a in node.attribute)
    key = (node.domain, node.op_type, opset, tuple(input_types), attributes, len(node.output))
    with _lock:
        if key in _answers:
            return _answers[key]
    try:
        # A refused probe is an answer, not an error to print; the graph is asked about as it is.
        probe_session(_probe_model(node, input_types, opset, ir_version), "ort_kernels", optimize=False, quiet=True)
        answer: bool | None = True
    except Exception as e:  # ORT raises its own exception classes; the message says why
        text = str(e)
        refused = "Could not find an implementation" in text or "Type Error" in text
        answer = False if refused else None
        if answer is None:
            logger.debug("probe of %s on %s failed: %s", node.op_type, [type_name(t) for t in input_types], text)
    with _lock:
        _answers[key] = answer
    return answer


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every value ONNX shape inference (or the exporter) knows."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception as e:  # an op ONNX cannot infer: keep what the exporter recorded
        logger.debug("shape inference failed (%s); using the exported value_info only", e)
        inferred = model
    types = {}
    for graph in (model.graph, inferred.graph):
        for value in (*graph.input, *graph.value_info, *graph.output):
            elem_type = value.type.tensor_type.elem_type
            if value.type.HasField("tensor_type") and elem_type:
                types.setdefault(value.name, elem_type)
        for tensor in graph.initializer:
            types.setdefault(tensor.name, tensor.data_type)
    return types
