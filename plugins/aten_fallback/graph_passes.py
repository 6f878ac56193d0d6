"""Graph passes over exported graphs: the written-out tanh-GELU becomes one ATen gelu node (:func:`replace_tanh_gelu`).
The pass that gives ATen outputs types ORT can use runs here too (``TYPE_OUTPUTS_PASS``), but is the ATen node
service's (:func:`ortcore_plugins.services.aten_nodes.type_aten_outputs`), which ``op_routing`` runs as well."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
import onnx

from ortcore.api import PassContext
from ortcore_plugins.services.aten_nodes import ATEN_DOMAIN

logger = logging.getLogger("ortcore.aten_fallback")

TANH_GELU_PASS = "aten_fallback.tanh_gelu"
TYPE_OUTPUTS_PASS = "aten_fallback.typed_outputs"


# -- the tanh-GELU formula ------------------------------------------------------------------------------------------
#
# Hugging Face's "gelu_new" (GPT-2) writes GELU out: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))). It
# exports as Pow/Mul/Add/Tanh nodes, which ORT fuses into FastGelu (whose gradient is its slowest kernel). This pass
# finds the formula in the exported graph and replaces it with one ATen gelu(approximate="tanh") node.


class _GraphIndex:
    """Producers, consumers and constant values of an ONNX graph."""

    def __init__(self, graph: onnx.GraphProto):
        # One list of node objects, held for the index's life, so that id() identifies a node throughout a pass.
        self.nodes: list[onnx.NodeProto] = list(graph.node)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.output:
                self.producer[name] = node
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}

    def _tensor(self, name: str) -> onnx.TensorProto | None:
        tensor = self.initializers.get(name)
        node = self.producer.get(name)
        if tensor is None and node is not None and node.op_type == "Constant":
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
        return tensor

    def constant(self, name: str) -> float | None:
        """The value of a scalar constant (a Constant node or an initializer), else None."""
        tensor = self._tensor(name)
        if tensor is None:
            return None
        array = onnx.numpy_helper.to_array(tensor)
        return float(array.reshape(-1)[0]) if array.size == 1 else None

    def tolerance(self, name: str) -> float:
        """How close a constant of ``name``'s type can be to a formula's value: a bfloat16 or float16 constant
        (a formula written under autocast, or in a bf16 model) holds it rounded to 8 or 11 bits."""
        tensor = self._tensor(name)
        data_type = tensor.data_type if tensor is not None else onnx.TensorProto.FLOAT
        return {onnx.TensorProto.BFLOAT16: 2.0**-8, onnx.TensorProto.FLOAT16: 2.0**-11}.get(data_type, 1e-5)

    def node(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def split_constant(self, node: onnx.NodeProto, value: float) -> str | None:
        """For a binary node with one constant operand close to ``value``, the other operand."""
        for i in (0, 1):
            c = self.constant(node.input[i])
            if c is not None and math.isclose(c, value, rel_tol=self.tolerance(node.input[i])):
                return node.input[1 - i]
        return None


def _is_cube_of(index: _GraphIndex, name: str, x: str) -> list[onnx.NodeProto] | None:
    """The nodes computing x**3 as ``name`` (Pow(x, 3) or x * (x * x) in any order), else None."""
    pow_ = index.node(name, "Pow")
    if pow_ is not None:
        return [pow_] if pow_.input[0] == x and index.constant(pow_.input[1]) == 3.0 else None
    mul = index.node(name, "Mul")
    if mul is None:
        return None
    for i in (0, 1):
        square = index.node(mul.input[1 - i], "Mul")
        if mul.input[i] == x and square is not None and list(square.input) == [x, x]:
            return [mul, square]
    return None


def _match_tanh_gelu(index: _GraphIndex, tanh: onnx.NodeProto) -> tuple[str, str, list[onnx.NodeProto]] | None:
    """Match 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) around ``tanh``: (x, output, nodes)."""
    inner = index.node(tanh.input[0], "Mul")
    scaled = index.split_constant(inner, math.sqrt(2 / math.pi)) if inner is not None else None
    add = index.node(scaled, "Add") if scaled is not None else None
    if add is None:
        return None
    for i in (0, 1):
        x, cubic_term = add.input[i], add.input[1 - i]
        kappa_mul = index.node(cubic_term, "Mul")
        cube_name = index.split_constant(kappa_mul, 0.044715) if kappa_mul is not None else None
        cube = _is_cube_of(index, cube_name, x) if cube_name is not None else None
        if cube is not None:
            break
    else:
        return None
    users = index.consumers.get(tanh.output[0], [])
    one_plus = users[0] if len(users) == 1 and users[0].op_type == "Add" else None
    if one_plus is None or index.split_constant(one_plus, 1.0) != tanh.output[0]:
        return None
    users = index.consumers.get(one_plus.output[0], [])
    final = users[0] if len(users) == 1 and users[0].op_type == "Mul" else None
    if final is None:
        return None
    # The other factor is 0.5 * x (or x * 0.5); torch's own tanh GELU symbolic nests it as 0.5 * (x * (1 + tanh)).
    other = final.input[0] if final.input[1] == one_plus.output[0] else final.input[1]
    half = index.node(other, "Mul")
    nodes = [inner, add, kappa_mul, *cube, tanh, one_plus, final]
    output = final.output[0]
    if half is not None and index.split_constant(half, 0.5) == x:
        nodes.append(half)
    elif other == x:
        users = index.consumers.get(final.output[0], [])
        outer = users[0] if len(users) == 1 and users[0].op_type == "Mul" else None
        if outer is None or index.split_constant(outer, 0.5) != final.output[0]:
            return None
        nodes.append(outer)
        output = outer.output[0]
    else:
        return None
    # Every intermediate must be used only inside the formula, or removing the nodes would break other users.
    inside = {id(n) for n in nodes}
    for n in nodes:
        for name in n.output:
            if name == output:
                continue
            if name in index.graph_outputs or any(id(u) not in inside for u in index.consumers.get(name, [])):
                return None
    return x, output, nodes


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every value ONNX can type: declared ones, then what shape inference adds."""
    graph = model.graph
    declared = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info
    except Exception:  # inference is a convenience here: a value it cannot type falls back below
        inferred = []
    return {**{v.name: v.type.tensor_type.elem_type for v in inferred}, **{k: t for k, t in declared.items() if t}}


def replace_tanh_gelu(
    model: onnx.ModelProto,
    context: PassContext | None = None,
    route: Callable[[int], bool] | None = None,
) -> int:
    """Replace each written-out tanh-GELU in ``model`` with an ATen gelu node; returns how many were replaced.

    ``route(k)``, if given, decides for the formula around the graph's ``k``-th Tanh node (``torch_kernels = auto``).
    """
    graph = model.graph
    index = _GraphIndex(graph)
    removed: set[int] = set()
    replacements: dict[int, list[onnx.NodeProto]] = {}
    typed: list[tuple[str, str, onnx.NodeProto]] = []
    ordinal = -1
    for node in index.nodes:
        if node.op_type != "Tanh":
            continue
        ordinal += 1
        if id(node) in removed:
            continue
        match = _match_tanh_gelu(index, node)
        if match is None:
            continue
        x, output, nodes = match
        if any(id(n) in removed for n in nodes):
            continue
        if route is not None and not route(ordinal):
            continue
        name = f"{node.name or output}/ortcore_gelu_tanh"
        approximate = onnx.helper.make_node(
            "Constant",
            [],
            [f"{name}/approximate"],
            name=f"{name}/approximate",
            value=onnx.numpy_helper.from_array(np.frombuffer(b"tanh", dtype=np.uint8).copy()),
        )
        gelu = onnx.helper.make_node(
            "ATen",
            [x, approximate.output[0]],
            [output],
            name=name,
            domain=ATEN_DOMAIN,
            operator="gelu",
            overload_name="",
        )
        # Insert where the formula's last node was: every consumer of the output still follows its producer.
        last = next(n for n in nodes if output in n.output)
        replacements[id(last)] = [approximate, gelu]
        removed.update(id(n) for n in nodes)
        typed.append((x, output, nodes[0]))
    if not typed:
        return 0
    # The formula's Constant nodes (0.5, 3, 0.044715, ...) go too once nothing else reads them: ORT would warn about
    # each unused one in every session it builds.
    still_read = {name for n in index.nodes if id(n) not in removed for name in n.input} | index.graph_outputs
    for node in index.nodes:
        if node.op_type == "Constant" and not any(name in still_read for name in node.output):
            if any(id(u) in removed for name in node.output for u in index.consumers.get(name, [])):
                removed.add(id(node))
    kept: list[onnx.NodeProto] = []
    for node in index.nodes:
        if id(node) in replacements:
            kept.extend(replacements[id(node)])
        elif id(node) not in removed:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            kept.append(copy)
    del graph.node[:]
    graph.node.extend(kept)
    # ORT cannot infer an ATen output's type: record it (GELU keeps its input's element type).
    types = _elem_types(model)
    known = {v.name for v in graph.value_info}
    for x, output, _node in typed:
        if output not in known:
            elem_type = types.get(x) or onnx.TensorProto.FLOAT
            graph.value_info.append(onnx.helper.make_tensor_value_info(output, elem_type, None))
    if not any(o.domain == ATEN_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ATEN_DOMAIN, 1))
    logger.debug("replaced %d tanh-GELU formula(s) with ATen gelu", len(typed))
    return len(typed)
