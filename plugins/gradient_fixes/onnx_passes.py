"""The ONNX graph passes of gradient_fixes, on the exported forward graph of either route: broadcast inputs of
``Where``/``Pow`` and of ops that trust symbolic names, ``ConvGrad``'s kernel bugs, vector ``MatMul`` and stateless
batch norms (see the package docstring and ``docs/plugins/gradient_fixes.md``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import onnx
from onnx import TensorProto

from ortcore.api import PassContext, ValueNames, splice

logger = logging.getLogger("ortcore.gradient_fixes")

NAME = "gradient_fixes"
PASS_NAME = "gradient_fixes.broadcast"
CONV_PASS_NAME = "gradient_fixes.conv"
MATMUL_PASS_NAME = "gradient_fixes.vector_matmul"
BATCH_NORM_PASS_NAME = "gradient_fixes.stateless_batch_norms"
HIDDEN_PASS_NAME = "gradient_fixes.hidden_broadcasts"  # a program pass of the dynamo route: reports, changes nothing
# Bumped whenever a pass's output changes, so export caches do not serve graphs made by an older pass.
PASS_VERSION = 1
CONV_PASS_VERSION = 1
MATMUL_PASS_VERSION = 1
BATCH_NORM_PASS_VERSION = 1

# Ops whose ORT gradient never reduces a broadcast input (input indices that get a gradient).
NO_REDUCTION: dict[str, tuple[int, ...]] = {"Where": (1, 2), "Pow": (0,)}
# Ops whose ORT gradient reduces, but trusts symbolic dimension names when all shapes are known.
NAME_TRUSTING: dict[str, tuple[int, ...] | None] = {
    "Add": None,
    "Sub": None,
    "Mul": None,
    "Div": None,
    "Min": None,
    "Max": None,
    "Expand": (0,),
}
# Ops whose outputs carry no gradient: a value computed only through them needs no fix.
_NON_DIFFERENTIABLE = frozenset(
    {
        "Shape",
        "Size",
        "Constant",
        "ConstantOfShape",
        "Equal",
        "Less",
        "LessOrEqual",
        "Greater",
        "GreaterOrEqual",
        "Not",
        "And",
        "Or",
        "Xor",
        "IsNaN",
        "IsInf",
        "ArgMax",
        "ArgMin",
        "NonZero",
        "Range",
        "EyeLike",
        "Sign",
        "Floor",
        "Ceil",
        "Round",
        "BitShift",
        "Mod",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
    }
)
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})

Dim = int | str | None  # a static size, a symbolic name, or unknown
Shape = list[Dim] | None  # None: rank unknown


# -- shapes ---------------------------------------------------------------------------------------------------------


def _dims(value: onnx.ValueInfoProto) -> Shape:
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    dims: list[Dim] = []
    for dim in tensor.shape.dim:
        if dim.HasField("dim_value") and dim.dim_value > 0:
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param") and dim.dim_param and not dim.dim_param.startswith("ATen"):
            # "ATen<output>_dim_<i>" names are the exporter's invention for an ATen node's output: the ATen plugins'
            # typing pass erases them, so ORT never sees them (and they prove nothing about sizes).
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return dims


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ONNX shape inference's value_info, or as exported where inference fails."""
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception as e:  # an op ONNX cannot infer (custom domains): keep what the exporter recorded
        logger.debug("shape inference failed (%s); using the exported value_info only", e)
        return model


def infer_shapes(
    model: onnx.ModelProto, inferred: onnx.ModelProto | None = None
) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """Every value's shape: ``(inferred, as_ort_sees)`` (``inferred``: :func:`_inferred`'s model, if already made).

    ``inferred`` is the exporter's value_info completed by ONNX shape inference, whose invented ``unk__`` names are
    consistent (one name, one size) and so prove two dimensions equal. ORT infers shapes without inventing names:
    in ``as_ort_sees`` a name the exported graph does not carry is an unknown dimension.
    """
    inferred = _inferred(model) if inferred is None else inferred
    exported = model.graph
    names = {
        d.dim_param
        for v in (*exported.input, *exported.value_info, *exported.output)
        for d in v.type.tensor_type.shape.dim
        if d.HasField("dim_param")
    }
    graph = inferred.graph
    shapes = {v.name: _dims(v) for v in (*graph.input, *graph.value_info, *graph.output)}
    as_ort_sees = {
        name: None if shape is None else [d if not isinstance(d, str) or d in names else None for d in shape]
        for name, shape in shapes.items()
    }
    return shapes, as_ort_sees


def _aligned(shape: Sequence[Dim], rank: int) -> list[Dim | str]:
    """``shape`` right-aligned to ``rank`` dimensions; missing leading dimensions are ``"absent"``."""
    return ["absent"] * (rank - len(shape)) + list(shape)


def _covers(shape: Shape, others: Iterable[Shape]) -> bool:
    """Whether ``shape`` is provably the broadcast of itself and ``others`` (nothing of it is broadcast)."""
    if shape is None:
        return False
    for other in others:
        if other is None or len(other) > len(shape):
            return False
        for mine, theirs in zip(_aligned(shape, len(shape)), _aligned(other, len(shape))):
            if theirs in ("absent", 1):
                continue
            if mine is None or theirs is None or mine != theirs:
                return False
    return True


def _broadcast(shape: Shape, other: Shape) -> Shape:
    """The static broadcast of two shapes (dimensions unknown where it cannot be told; None if a rank is unknown)."""
    if shape is None or other is None:
        return None
    rank = max(len(shape), len(other))
    result: list[Dim] = []
    for a, b in zip(_aligned(shape, rank), _aligned(other, rank)):
        if a in ("absent", 1):
            result.append(a if b == "absent" else b)
        elif b in ("absent", 1) or a == b:
            result.append(a)
        elif isinstance(a, int) and isinstance(b, int):
            return None  # not broadcastable: leave the error to ORT
        else:
            result.append(a if isinstance(a, int) else b if isinstance(b, int) else None)
    return result


def _trusts_a_name(shape: Shape, others: Iterable[Shape]) -> bool:
    """Whether ORT's static gradient path would assume a symbolic dimension of ``shape`` is not broadcast where it
    might be: it takes that path only when every shape is fully known (static sizes or names)."""
    others = list(others)
    if shape is None or None in shape or any(o is None or None in o for o in others):
        return False  # some dimension unknown to ORT: it builds the dynamic gradient, which is right
    for other in others:
        rank = max(len(shape), len(other))
        for mine, theirs in zip(_aligned(shape, rank), _aligned(other, rank)):
            if isinstance(mine, str) and mine != "absent" and theirs not in ("absent", 1, mine):
                return True
    return False


# -- which values may carry a gradient ------------------------------------------------------------------------------


def _differentiable_values(graph: onnx.GraphProto) -> set[str]:
    """Values computed from a floating-point graph input through ops that pass gradients (an over-approximation
    of what ORT differentiates: which inputs require grad is decided later, per build)."""
    values = {i.name for i in graph.input if i.type.tensor_type.elem_type in _FLOAT_TYPES}
    for node in graph.node:
        if node.op_type not in _NON_DIFFERENTIABLE and any(name in values for name in node.input if name):
            values.update(name for name in node.output if name)
    return values


# -- the pass -------------------------------------------------------------------------------------------------------


class _Editor(ValueNames):
    """Collects the nodes to insert before each node and hands out unique value names."""

    def __init__(self, graph: onnx.GraphProto):
        super().__init__(graph)
        self.graph = graph
        self.inserted: dict[int, list[onnx.NodeProto]] = {}

    def expand(self, position: int, node: onnx.NodeProto, value: str, target: str, why: str) -> str:
        """Insert ``Expand(value, Shape(target))`` before ``node``; return the expanded value's name."""
        scope = f"ortcore.gradient_fixes/{node.name or node.op_type}"
        shape = self.fresh(f"{scope}/Shape_of_{target}")
        expanded = self.fresh(f"{scope}/{value}_{why}")
        self.inserted.setdefault(position, []).extend(
            [
                onnx.helper.make_node("Shape", [target], [shape], name=shape),
                onnx.helper.make_node("Expand", [value, shape], [expanded], name=expanded),
            ]
        )
        return expanded

    def apply(self) -> None:
        if not self.inserted:
            return
        nodes = []
        for position, node in enumerate(self.graph.node):
            nodes.extend(self.inserted.get(position, ()))
            nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)


def fix_broadcast_gradients(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Make ORT's gradients of broadcasting ops match PyTorch's (see the module docstring); returns how many
    inputs were rewritten. Graphs without such ops are left unchanged."""
    graph = model.graph
    targets = [n for n in graph.node if n.op_type in NO_REDUCTION or n.op_type in NAME_TRUSTING]
    if not targets or not any(n.domain in ("", "ai.onnx") for n in targets):
        return 0
    shapes, ort_shapes = infer_shapes(model)
    differentiable = _differentiable_values(graph)
    editor = _Editor(graph)
    fixed = 0
    for position, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in NO_REDUCTION:
            fixed += _fix_no_reduction(editor, position, node, shapes, ort_shapes, differentiable)
        elif node.op_type in NAME_TRUSTING:
            fixed += _fix_name_trusting(editor, position, node, ort_shapes, differentiable)
    editor.apply()
    if fixed:
        logger.debug("gradient_fixes: rewrote %d broadcast inputs", fixed)
    return fixed


def _fix_no_reduction(
    editor: _Editor,
    position: int,
    node: onnx.NodeProto,
    shapes: dict[str, Shape],
    ort_shapes: dict[str, Shape],
    differentiable: set[str],
) -> int:
    fixed = 0
    inputs = list(node.input)
    for i in NO_REDUCTION[node.op_type]:
        if i >= len(inputs) or inputs[i] not in differentiable:
            continue
        others = [name for k, name in enumerate(inputs) if k != i and name]
        value, shape = inputs[i], shapes.get(inputs[i])
        larger = [other for other in others if not _covers(shape, [shapes.get(other)])]
        if larger and _trusts_a_name(ort_shapes.get(value), [ort_shapes.get(other) for other in larger]):
            # The Expand below has ORT's name-trusting gradient too (its target shape may be constant-folded).
            value = editor.expand(position, node, value, value, "shape_hidden")
        for other in larger:
            if _covers(shape, [shapes.get(other)]):
                continue
            # Expand broadcasts both ways: the result has the shape of value and other broadcast together.
            value = editor.expand(position, node, value, other, "broadcast")
            shape = _broadcast(shape, shapes.get(other))
        if value != inputs[i]:
            node.input[i] = value
            fixed += 1
    return fixed


def _fix_name_trusting(
    editor: _Editor, position: int, node: onnx.NodeProto, shapes: dict[str, Shape], differentiable: set[str]
) -> int:
    """``shapes`` as ORT sees them: the op's static gradient path is taken only when it knows every dimension."""
    inputs = list(node.input)
    if node.op_type == "Expand":
        candidates, compared = (0,), {0: [shapes.get(node.output[0])]}
    else:
        candidates = tuple(range(len(inputs)))
        # Min/Max compare each input with the output; the binary ops compare their two inputs with each other.
        compared = {
            i: [shapes.get(node.output[0])]
            if node.op_type in ("Min", "Max")
            else [shapes.get(name) for k, name in enumerate(inputs) if k != i]
            for i in candidates
        }
    fixed = 0
    for i in candidates:
        name = inputs[i]
        if not name or name not in differentiable or not _trusts_a_name(shapes.get(name), compared[i]):
            continue
        node.input[i] = editor.expand(position, node, name, name, "shape_hidden")
        fixed += 1
    return fixed


# -- grouped convolutions ---------------------------------------------------------------------------------------------


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _kernel_rank(node: onnx.NodeProto, attributes: dict[str, Any], shapes: dict[str, Shape]) -> int | None:
    """The number of spatial dimensions of a ``Conv``: from ``kernel_shape``, else the weight's or input's rank."""
    if attributes.get("kernel_shape"):
        return len(attributes["kernel_shape"])
    for name in (node.input[1], node.input[0]):
        shape = shapes.get(name)
        if shape is not None and len(shape) > 2:
            return len(shape) - 2
    return None


class _ConvRewriter(ValueNames):
    """Builds the replacement nodes of grouped ``Conv`` nodes, with unique value names."""

    def as_2d(self, node: onnx.NodeProto, attributes: dict[str, Any]) -> list[onnx.NodeProto]:
        """``Squeeze(Conv2d(Unsqueeze(x, 2), Unsqueeze(w, 2)), 2)``: the same values, ORT's 2-D gradient kernel."""
        scope = f"ortcore.gradient_fixes/{node.name or 'Conv'}"
        axes, constant = self.int64s(f"{scope}/axis_2", [2])
        nodes = [constant]
        inputs = list(node.input)
        for i in (0, 1):
            unsqueezed = self.fresh(f"{scope}/{inputs[i]}_2d")
            nodes.append(onnx.helper.make_node("Unsqueeze", [inputs[i], axes], [unsqueezed], name=unsqueezed))
            inputs[i] = unsqueezed
        out_2d = self.fresh(f"{scope}/{node.output[0]}_2d")
        lifted: dict[str, Any] = {"group": attributes["group"]}
        if "kernel_shape" in attributes:
            lifted["kernel_shape"] = [1, *attributes["kernel_shape"]]
        if "strides" in attributes:
            lifted["strides"] = [1, *attributes["strides"]]
        if "dilations" in attributes:
            lifted["dilations"] = [1, *attributes["dilations"]]
        if "pads" in attributes:
            begin, end = attributes["pads"]
            lifted["pads"] = [0, begin, 0, end]  # ONNX order: every dimension's begin, then every end
        if "auto_pad" in attributes:
            # A size-1 dimension with a size-1 kernel and stride 1 needs no padding under any auto_pad.
            lifted["auto_pad"] = attributes["auto_pad"]
        conv = onnx.helper.make_node("Conv", inputs, [out_2d], name=node.name, **lifted)
        squeeze_name = self.fresh(f"{scope}/Squeeze")
        squeeze = onnx.helper.make_node("Squeeze", [out_2d, axes], [node.output[0]], name=squeeze_name)
        return [*nodes, conv, squeeze]

    def per_group(self, node: onnx.NodeProto, attributes: dict[str, Any], opset: int) -> list[onnx.NodeProto]:
        """``Concat(Conv(x_g, w_g, b_g) for each group g)`` along channels, every ``Conv`` ungrouped."""
        groups = attributes["group"]
        scope = f"ortcore.gradient_fixes/{node.name or 'Conv'}"
        nodes: list[onnx.NodeProto] = []
        parts: list[list[str]] = []
        for i, name in enumerate(node.input):
            if not name:
                continue
            outputs = [self.fresh(f"{scope}/{name}_group{g}") for g in range(groups)]
            # Equal parts of the input's channels (axis 1) or of the weight's and bias's output channels (axis 0).
            # Opset 18 names the number of parts; earlier opsets split equally into as many outputs as there are.
            split = {"num_outputs": groups} if opset >= 18 else {}
            axis = 1 if i == 0 else 0
            nodes.append(onnx.helper.make_node("Split", [name], outputs, name=outputs[0], axis=axis, **split))
            parts.append(outputs)
        plain = {k: v for k, v in attributes.items() if k != "group"}
        results = []
        for g in range(groups):
            result = self.fresh(f"{scope}/{node.output[0]}_group{g}")
            name = node.name if g == 0 else self.fresh(f"{node.name or 'Conv'}_group{g}")
            nodes.append(onnx.helper.make_node("Conv", [part[g] for part in parts], [result], name=name, **plain))
            results.append(result)
        concat = self.fresh(f"{scope}/Concat")
        nodes.append(onnx.helper.make_node("Concat", results, [node.output[0]], name=concat, axis=1))
        return nodes


def _explicit_pads(attributes: dict[str, Any], x_shape: Shape) -> list[int] | None:
    """The ``pads`` equal to a ``SAME_UPPER``/``SAME_LOWER`` ``auto_pad``, or None when they depend on a spatial size
    that is not static (only with a stride above 1)."""
    kernel = attributes["kernel_shape"]
    strides = attributes.get("strides") or [1] * len(kernel)
    dilations = attributes.get("dilations") or [1] * len(kernel)
    begins, ends = [], []
    for axis, (k, stride, dilation) in enumerate(zip(kernel, strides, dilations, strict=True)):
        extent = dilation * (k - 1) + 1
        if stride == 1:
            total = extent - 1  # output size = input size, whatever the input size
        else:
            size = x_shape[2 + axis] if x_shape is not None and len(x_shape) == 2 + len(kernel) else None
            if not isinstance(size, int):
                return None
            total = max((-(-size // stride) - 1) * stride + extent - size, 0)
        small, large = total // 2, total - total // 2
        # SAME_UPPER puts the odd element of padding at the end, SAME_LOWER at the beginning (ONNX Conv).
        begin, end = (small, large) if attributes["auto_pad"] == b"SAME_UPPER" else (large, small)
        begins.append(begin)
        ends.append(end)
    return begins + ends


def _with_attributes(node: onnx.NodeProto, attributes: dict[str, Any]) -> onnx.NodeProto:
    return onnx.helper.make_node(node.op_type, list(node.input), list(node.output), name=node.name, **attributes)


def fix_conv_gradients(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Rewrite ``Conv`` nodes whose gradient ORT's CPU ``ConvGrad`` gets wrong (see the module docstring): ``SAME``
    auto-padding becomes explicit ``pads``, and grouped convolutions whose kernel is not 2-D are rewritten so that
    ``ConvGrad`` never writes past its input gradient. Returns how many ``Conv`` nodes were rewritten; a graph without
    such convolutions is left unchanged."""
    graph = model.graph
    convs = [
        (position, node, _attributes(node))
        for position, node in enumerate(graph.node)
        if node.op_type == "Conv" and node.domain in ("", "ai.onnx")
    ]
    convs = [
        (position, node, attributes)
        for position, node, attributes in convs
        if attributes.get("group", 1) > 1 or attributes.get("auto_pad", b"NOTSET") in (b"SAME_UPPER", b"SAME_LOWER")
    ]
    if not convs:
        return 0
    differentiable = _differentiable_values(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    rewriter = _ConvRewriter(graph)
    shapes: dict[str, Shape] | None = None
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for position, node, attributes in convs:
        if not any(name in differentiable for name in node.input[:2]):
            continue  # no gradient to compute
        if shapes is None and (not attributes.get("kernel_shape") or attributes.get("strides", [1]) != [1]):
            shapes = infer_shapes(model)[0]  # only when kernel_shape or a strided SAME padding needs them
        rank = _kernel_rank(node, attributes, shapes or {})
        rewritten = [node]
        if attributes.get("auto_pad", b"NOTSET") in (b"SAME_UPPER", b"SAME_LOWER"):
            if rank is not None and "kernel_shape" not in attributes:
                weight = (shapes or {}).get(node.input[1])
                if weight is not None and all(isinstance(d, int) for d in weight[2:]):
                    attributes["kernel_shape"] = list(weight[2:])
            x_shape = (shapes or {}).get(node.input[0])
            pads = _explicit_pads(attributes, x_shape) if "kernel_shape" in attributes else None
            if pads is None:
                logger.warning(
                    "gradient_fixes: Conv %r pads itself with auto_pad=%s on a strided dimension of unknown size: "
                    "ORT's ConvGrad ignores auto_pad, so its gradients may be wrong",
                    node.name,
                    attributes["auto_pad"].decode(),
                )
            else:
                # ORT's CPU ConvGrad reads only ``pads``: with SAME auto-padding it differentiates an unpadded Conv.
                del attributes["auto_pad"]
                attributes["pads"] = pads
                rewritten = [_with_attributes(node, attributes)]
        # Only the input gradient is written out of bounds; ORT's 2-D path zeroes only the group's own elements.
        if attributes.get("group", 1) > 1 and node.input[0] in differentiable and rank != 2:
            if rank == 1:
                rewritten = rewriter.as_2d(node, attributes)
            else:
                rewritten = rewriter.per_group(node, attributes, opset)
        if rewritten != [node]:
            replaced[position] = rewritten
    if not replaced:
        return 0
    splice(graph, replaced)
    logger.debug("gradient_fixes: rewrote %d convolutions", len(replaced))
    return len(replaced)


def fix_vector_matmul_gradients(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Give every ``MatMul`` with a 1-D operand that may need a gradient 2-D operands: ``Squeeze(MatMul(Unsqueeze(a),
    Unsqueeze(b)))``, the same values. ORT's ``MatMul`` gradient builder treats both operands as matrices: for
    ``torch.mv``, ``vector @ matrix`` or ``torch.dot``/``vdot`` (spectral norm's power iteration) its ``FusedMatMul``
    fails shape inference (``Incompatible dimensions for matrix multiplication``) or its ``Reshape`` fails at run
    time. Returns how many ``MatMul`` nodes were rewritten; a graph without such nodes is left unchanged."""
    graph = model.graph
    matmuls = [(p, n) for p, n in enumerate(graph.node) if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]
    if not matmuls:
        return 0
    differentiable = _differentiable_values(graph)
    matmuls = [(p, n) for p, n in matmuls if any(name in differentiable for name in n.input)]
    if not matmuls:
        return 0
    shapes = infer_shapes(model)[0]
    names = ValueNames(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for position, node in matmuls:
        a, b = (shapes.get(name) for name in node.input[:2])
        if a is None or b is None or (len(a) != 1 and len(b) != 1):
            continue  # unknown rank, or both matrices: ORT's gradient is right
        scope = f"ortcore.gradient_fixes/{node.name or 'MatMul'}"
        nodes: list[onnx.NodeProto] = []

        def int64s(what: str, values: list[int], scope: str = scope, nodes: list = nodes) -> str:
            name, constant = names.int64s(f"{scope}/{what}", values)
            nodes.append(constant)
            return name

        inputs = list(node.input[:2])
        squeezed: list[int] = []
        if len(a) == 1:  # [K] -> [1, K]; the result's row dimension goes again
            out = names.fresh(f"{scope}/{inputs[0]}_row")
            nodes.append(onnx.helper.make_node("Unsqueeze", [inputs[0], int64s("axis_0", [0])], [out], name=out))
            inputs[0] = out
            squeezed.append(-2)
        if len(b) == 1:  # [K] -> [K, 1]; the result's column dimension goes again
            out = names.fresh(f"{scope}/{inputs[1]}_column")
            nodes.append(onnx.helper.make_node("Unsqueeze", [inputs[1], int64s("axis_1", [1])], [out], name=out))
            inputs[1] = out
            squeezed.append(-1)
        product = names.fresh(f"{scope}/{node.output[0]}_2d")
        nodes.append(onnx.helper.make_node("MatMul", inputs, [product], name=node.name))
        axes = int64s("squeezed", sorted(squeezed))
        squeeze = names.fresh(f"{scope}/Squeeze")
        nodes.append(onnx.helper.make_node("Squeeze", [product, axes], [node.output[0]], name=squeeze))
        replaced[position] = nodes
    if not replaced:
        return 0
    splice(graph, replaced)
    logger.debug("gradient_fixes: gave %d MatMul nodes 2-D operands", len(replaced))
    return len(replaced)



def _elem_types(inferred: onnx.ModelProto) -> dict[str, int]:
    """Each value's element type in a model :func:`_inferred` made (values it cannot type are missing)."""
    graph = inferred.graph
    return {
        v.name: v.type.tensor_type.elem_type
        for v in (*graph.input, *graph.value_info, *graph.output)
        if v.type.tensor_type.elem_type
    }


class _NodeWriter:
    """Nodes written under one scope, each output a fresh name of the graph."""

    def __init__(self, names: ValueNames, scope: str):
        self.names, self.scope, self.nodes = names, scope, []

    def add(self, op: str, inputs: list[str], what: str, **attributes: Any) -> str:
        out = self.names.fresh(f"{self.scope}/{what}")
        self.nodes.append(onnx.helper.make_node(op, inputs, [out], name=out, **attributes))
        return out

    def int64s(self, what: str, values: list[int]) -> str:
        name, node = self.names.int64s(f"{self.scope}/{what}", values)
        self.nodes.append(node)
        return name

    def mean_over(self, value: str, axes: list[int], opset: int, what: str) -> str:
        if opset >= 18:  # axes an input from opset 18
            return self.add("ReduceMean", [value, self.int64s("axes", axes)], what, keepdims=1)
        return self.add("ReduceMean", [value], what, axes=axes, keepdims=1)

    def batch_norm(self, node: onnx.NodeProto, rank: int, elem_type: int, opset: int) -> list[onnx.NodeProto]:
        """``node`` (a ``BatchNormalization`` over ``rank`` dimensions of ``elem_type``) as arithmetic writing its
        first output."""
        x, scale, bias, mean, var = node.input[:5]
        channel_shape = self.int64s("channel_shape", [1, -1] + [1] * (rank - 2))
        if any(a.name == "training_mode" and a.i == 1 for a in node.attribute):
            axes = [0, *range(2, rank)]
            centred = self.add("Sub", [x, self.mean_over(x, axes, opset, "mean")], "centred")
            variance = self.mean_over(self.add("Mul", [centred, centred], "squared"), axes, opset, "var")
        else:
            centred = self.add("Sub", [x, self.add("Reshape", [mean, channel_shape], "mean")], "centred")
            variance = self.add("Reshape", [var, channel_shape], "var")
        epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        eps = self.add("Constant", [], "eps", value=onnx.helper.make_tensor("eps", elem_type, [], [epsilon]))
        std = self.add("Sqrt", [self.add("Add", [variance, eps], "var_eps")], "std")
        normalized = self.add("Div", [centred, std], "normalized")
        scaled = self.add("Mul", [normalized, self.add("Reshape", [scale, channel_shape], "scale")], "scaled")
        shifted = self.names.fresh(f"{self.scope}/shifted")
        bias_c = self.add("Reshape", [bias, channel_shape], "bias")
        self.nodes.append(onnx.helper.make_node("Add", [scaled, bias_c], [node.output[0]], name=shifted))
        return self.nodes


def stateless_batch_norms_as_arithmetic(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Write out each ``BatchNormalization`` that keeps no running statistics and has no affine parameters (constant
    scale and bias: ``batch_norm(w, None, None, training=True)``, BiT's weight standardisation) as the arithmetic it
    computes: ``(x - mean) / sqrt(var + eps) * scale + bias``, the statistics over every axis but 1 in training mode,
    the node's mean and var inputs otherwise.

    ORT's ``BatchNormalization`` gradient names ``<scale>_grad`` and ``<bias>_grad`` whether or not anything needs
    them, and its optimizer merges equal constants: two such batch norms over the same number of channels then
    define one gradient twice (``Duplicate definition of name (val_95_grad)``) and the build fails, on either route.
    The arithmetic is differentiated op by op. A batch norm whose statistics are graph inputs (a module's buffers,
    which ortcore updates) or whose extra outputs are read is left alone, as is one of unknown rank. Returns how many
    nodes were written out."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    candidates = [
        (p, n)
        for p, n in enumerate(graph.node)
        if n.op_type == "BatchNormalization"
        and n.domain in ("", "ai.onnx")
        and len(n.input) >= 5
        and not {n.input[1], n.input[2], n.input[3], n.input[4]} & inputs
    ]
    if not candidates:
        return 0
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    candidates = [(p, n) for p, n in candidates if not set(n.output[1:]) & read]
    if not candidates:
        return 0
    inferred = _inferred(model)  # once, for both shapes and element types
    shapes, types = infer_shapes(model, inferred)[0], _elem_types(inferred)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    names = ValueNames(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for position, node in candidates:
        shape = shapes.get(node.input[0])
        if shape is not None and len(shape) >= 2:
            replaced[position] = _NodeWriter(
                names, f"ortcore.gradient_fixes/{node.name or 'BatchNormalization'}"
            ).batch_norm(node, len(shape), types.get(node.input[0], onnx.TensorProto.FLOAT), opset)
    if replaced:
        splice(graph, replaced)
    return len(replaced)


