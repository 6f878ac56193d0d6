"""mixed_precision: bfloat16 and float16 graphs (``torch.autocast``, a model cast to low precision) train in ORT.

A graph exported under ``torch.autocast`` holds autocast's casts and computes its matrix products (and whatever else
autocast's policy puts in low precision) in bfloat16 or float16; so does the graph of a model cast to bfloat16.
ONNX Runtime's CPU provider has almost no kernels for those types (no bfloat16 ``MatMul``, ``Gemm``, ``Add``,
``Softmax``, no gradient kernel of any), so the session would be refused node by node. This plugin decides where each
such node runs, once per graph, before the session is built:

* **ORT runs it as it is** when it only moves elements (:data:`NATIVE_LOW_PRECISION_OPS`: ``Cast``, ``Transpose``,
  ``Reshape``, ``Gather``, ...) and ORT's provider has the kernel, asked of ORT itself
  (:func:`~ortcore_plugins.services.ort_kernels.ort_runs`, a one-node session per signature);
* **matrix products** (``MatMul``, ``Gemm`` of the linear form) run on PyTorch's kernel as ATen nodes, in the low
  type, when this CPU has units for it (AMX, AVX512-BF16, AVX512-FP16): oneDNN's kernels there are faster than any
  float32 GEMM, and they are the kernels eager autocast runs. Their gradients are matrix products of the same kind
  (:mod:`ortcore_plugins.services.torch_kernels`). ``matmul = "ort"`` (or a CPU without such units) computes them on
  ORT's float32 GEMM instead, with the casts below;
* **every other node** ORT has no kernel for is computed in float32 and its result rounded to its own type: inputs
  cast up, outputs cast back. That is how PyTorch computes a bfloat16 or float16 op on the CPU (in float, rounded
  once), so the values are the same, and the gradient graph ORT builds for such a node is float32 with a rounding
  ``Cast`` where the forward had one.

The same placement runs again over the gradient graph (``mixed_precision.gradients``): the gradient builder makes
low-precision nodes of its own (gradient sums, ``*Grad`` kernels of nodes ORT ran in the low type). Types there are
the exporter's, ONNX shape inference's, and, for Microsoft-domain gradient ops, the type of the forward value a
gradient belongs to.

On the CUDA provider, which has float16 and bfloat16 kernels, nothing is moved. Nodes no placement can serve are
left as they are, and the repair loop (op routing) takes over as for any op ORT cannot run.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import attrs
import onnx
import onnx.numpy_helper
from onnx import TensorProto, helper

from ortcore.api import (
    ATEN_DOMAIN,
    ROUTED_METADATA_PREFIX,
    Config,
    GraphPass,
    OptionError,
    PassContext,
    ValueNames,
    hookimpl,
    option,
    parse_bool,
    value_dependencies,
)
from ortcore_plugins.services import machine, torch_kernels
from ortcore_plugins.services.aten_nodes import helper_op
from ortcore_plugins.services.ort_kernels import MS_DOMAIN, ort_runs, type_name, value_types

logger = logging.getLogger("ortcore.mixed_precision")

NAME = "mixed_precision"
PASS_NAME = "mixed_precision.place"
GRADIENT_PASS_NAME = "mixed_precision.gradients"
# Bumped whenever the passes' output changes, so export caches do not serve graphs made by an older pass.
PASS_VERSION = 1

LOW = {TensorProto.BFLOAT16: "bfloat16", TensorProto.FLOAT16: "float16"}
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, *LOW)
MATMUL_PLACEMENTS = ("auto", "torch", "ort")
# Nodes that are not computations to place: the forward/backward boundary of a training graph (its values are the
# model's outputs and their gradients, in the types the user sees), PyTorch code (PythonOp), constants.
_NEVER_PLACED = frozenset({"YieldOp", "PythonOp", "PythonOpGrad", "Constant"})
# Outputs of Microsoft-domain ops whose type is fixed (ONNX's Python package has no schema for them).
_FIXED_OUTPUT_TYPES: dict[str, dict[int, int]] = {"ConcatTraining": {1: TensorProto.INT64}}
# Ops ORT's CPU provider runs in bfloat16 and float16 by moving elements, not computing with them: these alone stay in
# the low type (when a probe session accepts them too). Every other low-precision node is placed, even where ORT
# accepts it: some CPU kernels are registered for every type and fail only when they run (SplitTraining: "Split
# operator does not support BFloat16 yet"), and float16 nodes are accepted through ORT's own Cast insertion, which
# fails at run time in training graphs (ReduceMax: "Tensor type mismatch"). tests/plugins/test_mixed_precision.py
# runs each of these ops in both types against torch.
NATIVE_LOW_PRECISION_OPS = frozenset(
    {
        "Cast",
        "Reshape",
        "Transpose",
        "Identity",
        "Squeeze",
        "Unsqueeze",
        "Flatten",
        "Slice",
        "Gather",
        "Concat",
        "Shape",
        "Split",
    }
)


def _parse_placement(value: object, name: str) -> str:
    text = str(value).strip().lower()
    if text not in MATMUL_PLACEMENTS:
        raise OptionError(f"{name}: {value!r} is not a placement; allowed: {', '.join(MATMUL_PLACEMENTS)}")
    return text


@attrs.frozen
class MixedPrecisionOptions:
    """Options of the ``mixed_precision`` plugin."""

    enable: bool = option(
        True,
        parse_bool,
        "place bfloat16/float16 nodes ORT's provider has no kernel for (PyTorch's kernel, or float32 and cast back)",
        "ORTCORE_MIXED_PRECISION",
    )
    matmul: str = option(
        "auto",
        _parse_placement,
        "where low-precision matrix products run: torch (PyTorch's kernel as an ATen node, in the low type), "
        "ort (ORT's float32 GEMM, cast back), auto (torch where the CPU has units for the type, else ort)",
        "ORTCORE_AMP_MATMUL",
    )
    exact_rounding: bool = option(
        True,
        parse_bool,
        "keep every rounding autocast makes, also between two float32 computations (0: skip those, fewer casts, "
        "values no longer autocast's)",
        "ORTCORE_AMP_EXACT_ROUNDING",
    )
    torch_casts: bool = option(
        True,
        parse_bool,
        "casts between float32 and bfloat16/float16 of large tensors run on PyTorch's kernel (faster on CPU)",
        "ORTCORE_AMP_TORCH_CASTS",
    )


@hookimpl
def ortcore_options_class() -> type:
    return MixedPrecisionOptions


def matmul_placement(option_value: str, elem_type: int) -> str:
    """``torch`` or ``ort`` for a matrix product of ``elem_type`` under the ``matmul`` option."""
    if option_value != "auto":
        return option_value
    return "torch" if machine.low_precision_units().get(LOW.get(elem_type, ""), None) else "ort"


# -- types ------------------------------------------------------------------------------------------------------------


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)


def _attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _output_types(node: onnx.NodeProto, input_types: list[int | None], opset: int, known: dict[str, int]) -> list:
    """The element type of each output of ``node``: what is known, else what its schema's type parameters bind it
    to, else (a Microsoft-domain gradient op) the type of the forward value ``X`` of an output ``X_grad``, or of its
    first floating-point input."""
    found: list[int | None] = [known.get(o) if o else None for o in node.output]
    if all(t is not None for o, t in zip(node.output, found) if o):
        return found
    schema = None
    if node.domain in ("", "ai.onnx"):
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            schema = None
    if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
        return [_attribute(node, "to")]
    if schema is not None:
        bound: dict[str, int] = {}
        for k, t in enumerate(input_types):
            if t is None or not node.input[k]:
                continue
            formal = schema.inputs[min(k, len(schema.inputs) - 1)] if schema.inputs else None
            if formal is not None:
                bound.setdefault(formal.type_str, t)
        for k, name in enumerate(node.output):
            if not name or found[k] is not None or not schema.outputs:
                continue
            formal = schema.outputs[min(k, len(schema.outputs) - 1)]
            if formal.type_str in bound:
                found[k] = bound[formal.type_str]
            else:
                allowed = list(formal.types)
                if len(allowed) == 1:  # a fixed type (Shape's int64)
                    found[k] = _type_of(allowed[0])
        return found
    # A Microsoft-domain op: its first output (a forward op's result, a gradient op's first gradient) and every
    # output of a gradient op take the type of its first floating-point input; other outputs (ConcatTraining's
    # lengths, the saved statistics of a fused kernel) stay unknown and are never cast.
    for k, t in _FIXED_OUTPUT_TYPES.get(node.op_type, {}).items() if node.domain == MS_DOMAIN else ():
        if k < len(found) and found[k] is None:
            found[k] = t
    floats = [t for t in input_types if t in FLOAT_TYPES]
    guess = node.domain == MS_DOMAIN
    gradient_op = node.op_type.endswith("Grad") or "Grad_" in node.op_type
    for k, name in enumerate(node.output):
        if not name or found[k] is not None:
            continue
        if name.endswith("_grad") and name[: -len("_grad")] in known:
            found[k] = known[name[: -len("_grad")]]
        elif guess and floats and (k == 0 or gradient_op):
            found[k] = floats[0]
    return found


_TYPE_STRINGS = {
    f"tensor({name})": value
    for name, value in (
        ("float", TensorProto.FLOAT),
        ("double", TensorProto.DOUBLE),
        ("float16", TensorProto.FLOAT16),
        ("bfloat16", TensorProto.BFLOAT16),
        ("int64", TensorProto.INT64),
        ("int32", TensorProto.INT32),
        ("bool", TensorProto.BOOL),
    )
}


def _type_of(type_string: str) -> int | None:
    return _TYPE_STRINGS.get(type_string)


# -- the placement --------------------------------------------------------------------------------------------------


@attrs.define
class Placement:
    """What one pass decided: node counts by (op type, type, where it runs)."""

    counts: Counter = attrs.Factory(Counter)

    def add(self, op_type: str, elem_type: int, where: str) -> None:
        self.counts[(op_type, type_name(elem_type), where)] += 1

    def summary(self) -> str:
        return ", ".join(
            f"{n} {op} ({t}) {where if where == 'bypassed' else 'on ' + where}"
            for (op, t, where), n in sorted(self.counts.items())
        )


class _Placer:
    def __init__(
        self, model: onnx.ModelProto, gradient: bool, matmul: str, trainable: set[str], keep_rounding: bool = False
    ):
        self.model = model
        self.keep_rounding = keep_rounding
        self.graph = model.graph
        self.gradient = gradient
        self.matmul = matmul
        self.opset = _opset(model)
        self.ir_version = model.ir_version or 8
        self.types = value_types(model)
        self.ranks = _value_ranks(model)
        self.names = ValueNames(self.graph)
        self.producer = {o: n for n in self.graph.node for o in n.output if o}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.graph_outputs = {o.name for o in self.graph.output}
        self.removed: set[int] = set()  # nodes a placement absorbed (a bias Add into a linear), by id
        self.orphans: set[str] = set()  # values a replaced node read (a dropout's ratio): their constants may go
        self.trainable = trainable
        self.placement = Placement()
        self.value_info: list[onnx.ValueInfoProto] = []
        self._reach: dict[str, set[str]] | None = None

    # which operand of a product carries a gradient (ORT builds an ATen node's gradient only through its first input)
    def _on_gradient_path(self, value: str) -> bool:
        if not self.trainable:
            return False
        return bool(value_dependencies(self.model, [value], self.trainable)[value])

    def run(self) -> Placement:
        replaced: dict[int, list[onnx.NodeProto]] = {}
        for position, node in enumerate(list(self.graph.node)):
            if id(node) in self.removed:
                replaced[position] = []
                continue
            input_types = [self.types.get(i) if i else None for i in node.input]
            output_types = _output_types(node, input_types, self.opset, self.types)
            for name, t in zip(node.output, output_types):
                if name and t is not None:
                    self.types.setdefault(name, t)
            if node.domain not in ("", "ai.onnx", MS_DOMAIN) or node.op_type in _NEVER_PLACED:
                continue  # ATen nodes run PyTorch, in whatever type they are given
            low = [t for t in (*input_types, *output_types) if t in LOW]
            if not low:
                continue
            elem_type = low[0]
            if node.op_type == "Dropout" and self._inactive_dropout(node):
                # no element dropped: the input itself, in its own type (eager's dropout at p=0 scales by 1)
                replaced[position] = [helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)]
                self.orphans.update(name for name in node.input[1:] if name)
                self.placement.add("Dropout", elem_type, "Identity (p=0)")
                continue
            nodes = None
            if not self.gradient and node.domain in ("", "ai.onnx") and node.op_type in ("MatMul", "Gemm"):
                if matmul_placement(self.matmul, elem_type) == "torch":
                    nodes = self._on_torch(node, input_types, output_types, elem_type)
            if nodes is None:
                if self._runs_natively(node, input_types):
                    continue
                nodes = self._widened(node, input_types, output_types)
                if nodes is None:
                    logger.debug(
                        "%s (%s) has no kernel in %s or float32: left as it is",
                        node.name,
                        node.op_type,
                        type_name(elem_type),
                    )
                    continue
                self.placement.add(node.op_type, elem_type, "ORT in float32")
            replaced[position] = nodes
        if replaced:
            nodes: list[onnx.NodeProto] = []
            for position, node in enumerate(self.graph.node):
                if id(node) in self.removed:  # absorbed by a placement, before or after it in the graph
                    continue
                nodes.extend(replaced.get(position, [node]))
            readers = {i for n in nodes for i in n.input}
            nodes = [
                n
                for n in nodes
                if not (n.op_type == "Constant" and n.output[0] in self.orphans and n.output[0] not in readers)
            ]
            del self.graph.node[:]
            self.graph.node.extend(nodes)
            self.graph.value_info.extend(self.value_info)
        rounds = drop_round_trips(self.model, keep_rounding=self.keep_rounding)
        if rounds:
            self.placement.counts[("Cast pair", "round trip", "bypassed")] += rounds
        return self.placement

    def _constant_value(self, name: str) -> Any:
        """The value of a constant input (a Constant node or an initializer), or None."""
        if not name:
            return None
        producer = self.producer.get(name)
        tensor = None
        if producer is not None and producer.op_type == "Constant":
            tensor = _attribute(producer, "value")
        else:
            tensor = next((t for t in self.graph.initializer if t.name == name), None)
        if tensor is None:
            return None
        return onnx.numpy_helper.to_array(tensor)

    def _inactive_dropout(self, node: onnx.NodeProto) -> bool:
        """A Dropout that drops nothing: a ratio of constant 0 (the exporter writes p=0 in training mode), or not
        training, and its mask unused."""
        if len(node.output) > 1 and node.output[1] and self.consumers.get(node.output[1]):
            return False
        ratio = self._constant_value(node.input[1]) if len(node.input) > 1 else None
        training = self._constant_value(node.input[2]) if len(node.input) > 2 else False
        return (ratio is not None and float(ratio) == 0.0) or (training is not None and not bool(training))

    def _runs_natively(self, node: onnx.NodeProto, input_types: list) -> bool:
        if node.domain not in ("", "ai.onnx") or node.op_type not in NATIVE_LOW_PRECISION_OPS:
            return False
        return ort_runs(node, input_types, self.opset, self.ir_version) is not False

    def _widened(self, node: onnx.NodeProto, input_types: list, output_types: list) -> list[onnx.NodeProto] | None:
        """``node`` computed in float32, its low-precision inputs cast up and outputs cast back; None if ORT has
        no float32 kernel for it either."""
        trial_types = [TensorProto.FLOAT if t in LOW else t for t in input_types]
        # Unknown (None): an input of unknown type, or a probe that could not be made; widened all the same (ORT's
        # float32 kernels are the complete set), and a session that refuses it names the node for the repair loop.
        if ort_runs(node, trial_types, self.opset, self.ir_version) is False:
            return None
        scope = f"{node.name or node.op_type}/ortcore.mixed_precision"
        before, after = [], []
        for k, (name, t) in enumerate(zip(node.input, input_types)):
            if name and t in LOW:
                wide = self.names.fresh(f"{scope}/{name}_float")
                before.append(helper.make_node("Cast", [name], [wide], name=wide, to=TensorProto.FLOAT))
                node.input[k] = wide
        for k, (name, t) in enumerate(zip(node.output, output_types)):
            if name and t in LOW:
                wide = self.names.fresh(f"{scope}/{name}_float")
                node.output[k] = wide
                after.append(helper.make_node("Cast", [wide], [name], name=f"{scope}/Cast_{k}", to=t))
        return [*before, node, *after]

    def _aten(self, operator: str, inputs: list[str], output: str, elem_type: int, scope: str) -> onnx.NodeProto:
        self.value_info.append(helper.make_tensor_value_info(output, elem_type, None))
        return helper.make_node(
            "ATen",
            inputs,
            [output],
            name=f"{scope}/ATen_{operator.split('::')[-1]}",
            domain=ATEN_DOMAIN,
            operator=operator,
            overload_name="",
        )

    def _on_torch(
        self, node: onnx.NodeProto, input_types: list, output_types: list, elem_type: int
    ) -> list[onnx.NodeProto] | None:
        """A matrix product as an ATen node on PyTorch's kernel in its own type; None if it is not of a form
        handled here (the caller then places it as any other node)."""
        if any(t != elem_type for n, t in zip(node.input, input_types) if n) or output_types[0] != elem_type:
            return None
        scope = f"{node.name or node.op_type}/ortcore.mixed_precision"
        out = node.output[0]
        nodes: list[onnx.NodeProto] = []
        if node.op_type == "MatMul":
            a, b = node.input[0], node.input[1]
            fused = self._as_linear(node, a, b, elem_type, scope)
            if fused is not None:
                return fused
        else:  # Gemm: A @ op(B) + C, the linear form only
            if _attribute(node, "transA", 0) or _attribute(node, "alpha", 1.0) != 1.0:
                return None
            a, b = node.input[0], node.input[1]
            c = node.input[2] if len(node.input) > 2 else ""
            if c and _attribute(node, "beta", 1.0) != 1.0:
                return None
            trans_b = _attribute(node, "transB", 0)
            if c and not trans_b and self.ranks.get(c) in (1, 2) and self._on_gradient_path(c):
                # addmm(C, A, B) as it is (GPT-2's Conv1D: the weight is [in, out]), no transposed copy of B; ORT
                # builds its gradient through C, the bias, which must carry one
                one = self.names.fresh(f"{scope}/one")
                one_tensor = helper.make_tensor("one", TensorProto.DOUBLE, [], [1.0])
                nodes.append(helper.make_node("Constant", [], [one], name=one, value=one_tensor))
                nodes.append(self._aten("addmm", [c, a, b, one, one], out, elem_type, scope))
                self.placement.add("Gemm", elem_type, "PyTorch (addmm)")
                torch_kernels.prepare_runtime()
                return nodes
            if c:
                # linear(input, weight [out, in], bias): the weight is B when transB, else B transposed
                weight = b
                if not trans_b:
                    weight = self.names.fresh(f"{scope}/{b}_t")
                    nodes.append(helper.make_node("Transpose", [b], [weight], name=weight, perm=[1, 0]))
                if self._on_gradient_path(a) or not self._on_gradient_path(weight):
                    nodes.append(self._aten("linear", [a, weight, c], out, elem_type, scope))
                else:
                    nodes.append(self._aten(helper_op("linear_weight_first"), [weight, a, c], out, elem_type, scope))
                self.placement.add("Gemm", elem_type, "PyTorch")
                torch_kernels.prepare_runtime()
                return nodes
            if trans_b:
                transposed = self.names.fresh(f"{scope}/{b}_t")
                nodes.append(helper.make_node("Transpose", [b], [transposed], name=transposed, perm=[1, 0]))
                b = transposed
        if self._on_gradient_path(a) or not self._on_gradient_path(b):
            nodes.append(self._aten(helper_op("matmul"), [a, b], out, elem_type, scope))
        else:
            nodes.append(self._aten(helper_op("matmul_rhs_first"), [b, a], out, elem_type, scope))
        self.placement.add(node.op_type, elem_type, "PyTorch")
        torch_kernels.prepare_runtime()
        return nodes

    def _single_consumer(self, value: str) -> onnx.NodeProto | None:
        users = self.consumers.get(value, [])
        return users[0] if len(users) == 1 and value not in self.graph_outputs else None

    def _as_linear(
        self, node: onnx.NodeProto, a: str, b: str, elem_type: int, scope: str
    ) -> list[onnx.NodeProto] | None:
        """``MatMul(x, Transpose(W))`` (+ a 1-D bias ``Add``), the exporter's form of ``F.linear`` on a batch of
        rows, as one ``linear(x, W, bias)``: no transposed copy of the weight, the bias added in the GEMM, and its
        gradient one column sum, where the pieces would be three nodes and their casts."""
        transpose = self.producer.get(b)
        if transpose is None or transpose.op_type != "Transpose" or list(_attribute(transpose, "perm", [])) != [1, 0]:
            return None
        weight = transpose.input[0]
        if self.types.get(weight) != elem_type or self.ranks.get(a, 0) < 2:
            return None
        out, bias, absorbed = node.output[0], "", None
        add = self._single_consumer(out)
        if add is not None and add.op_type == "Add" and add.domain in ("", "ai.onnx"):
            other = add.input[1] if add.input[0] == out else add.input[0]
            if (
                self.types.get(other) == elem_type
                and self.ranks.get(other) == 1
                and self.types.get(add.output[0])
                in (
                    elem_type,
                    None,
                )
            ):
                bias, absorbed, out = other, add, add.output[0]
        if bias:
            if self._on_gradient_path(a) or not self._on_gradient_path(weight):
                aten = self._aten("linear", [a, weight, bias], out, elem_type, scope)
            else:
                aten = self._aten(helper_op("linear_weight_first"), [weight, a, bias], out, elem_type, scope)
        elif self._on_gradient_path(a) or not self._on_gradient_path(weight):
            aten = self._aten(helper_op("linear_no_bias"), [a, weight], out, elem_type, scope)
        else:
            return None  # the weight alone carries a gradient: matmul_rhs_first of the transposed weight serves it
        if absorbed is not None:
            self.removed.add(id(absorbed))
        if self._single_consumer(b) is node:  # the transposed copy of the weight served this product only
            self.removed.add(id(transpose))
        self.placement.add("MatMul" + ("+Add" if bias else ""), elem_type, "PyTorch (linear)")
        torch_kernels.prepare_runtime()
        return [aten]


def drop_round_trips(model: onnx.ModelProto, keep_rounding: bool = False) -> int:
    """Cast pairs that give back (about) what they were given:

    * ``Cast(to bfloat16)`` of ``Cast(to float)`` of a bfloat16 value (float16 likewise) is that value exactly: every
      low value is a float32 value, and rounding it back gives it unchanged;
    * ``Cast(to float)`` of ``Cast(to bfloat16)`` of a float32 value is that value rounded to bfloat16. Between two
      nodes computed in float32 (placed nodes, autocast's float32 ops) the rounding is autocast's, and it costs two
      casts of the whole tensor. Unless ``keep_rounding`` (the default option keeps it), the float32 value is read
      as it is: fewer casts, but the values are no longer autocast's. Leaving a rounding out is not always closer to
      float64: in the zoo under bf16, T5 ended further from float64 than twice eager autocast's error without it,
      EfficientNet-B0 with it.

    The second Cast's readers read the first's input; a Cast left without readers is dropped. Returns how many pairs
    were bypassed."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    types = value_types(model)
    outputs = {o.name for o in graph.output}
    renamed: dict[str, str] = {}
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
            continue
        first = producer.get(node.input[0])
        if first is None or first.op_type != "Cast" or first.domain not in ("", "ai.onnx"):
            continue
        source, middle, target = types.get(first.input[0]), _attribute(first, "to"), _attribute(node, "to")
        exact = source in LOW and target == source and middle in (TensorProto.FLOAT, TensorProto.DOUBLE)
        rounding = source == TensorProto.FLOAT and target == source and middle in LOW and not keep_rounding
        if exact or rounding:
            renamed[node.output[0]] = first.input[0]
            dropped.add(id(node))
    if not renamed:
        return 0
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
    readers = {i for n in graph.node if id(n) not in dropped for i in n.input}
    kept = []
    for node in graph.node:
        if id(node) in dropped:
            continue
        if node.op_type == "Cast" and node.output[0] not in readers and node.output[0] not in outputs:
            continue  # a first Cast only the dropped ones read
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return len(renamed)


def _value_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of every value whose shape ONNX shape inference (or the exporter) knows."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:  # an op ONNX cannot infer: the exporter's value_info only
        inferred = model
    ranks = {}
    for graph in (model.graph, inferred.graph):
        for value in (*graph.input, *graph.value_info, *graph.output):
            tensor = value.type.tensor_type
            if value.type.HasField("tensor_type") and tensor.HasField("shape"):
                ranks.setdefault(value.name, len(tensor.shape.dim))
        for t in graph.initializer:
            ranks.setdefault(t.name, len(t.dims))
    return ranks


def place_low_precision(
    model: onnx.ModelProto,
    *,
    gradient: bool = False,
    matmul: str = "auto",
    trainable: set[str] | None = None,
    keep_rounding: bool = False,
) -> Placement:
    """Place every bfloat16/float16 node of ``model`` (module docstring), in place; returns what was decided.
    ``keep_rounding`` keeps autocast's roundings between two float32 computations (:func:`drop_round_trips`)."""
    types = value_types(model)
    if not any(t in LOW for t in types.values()) and not any(
        _attribute(n, "to") in LOW for n in model.graph.node if n.op_type == "Cast"
    ):
        return Placement()
    return _Placer(model, gradient, matmul, trainable or set(), keep_rounding).run()


_CAST_HELPERS = {
    TensorProto.BFLOAT16: "to_bfloat16",
    TensorProto.FLOAT16: "to_float16",
    TensorProto.FLOAT: "to_float32",
}
#: A cast of fewer elements than this stays ORT's: calling PyTorch costs more than ORT's slower loop saves.
TORCH_CAST_MIN_ELEMENTS = 16384


def _element_counts(model: onnx.ModelProto) -> dict[str, int]:
    """The element count of every value whose shape is fully known."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False)
    except Exception:
        inferred = model
    counts = {}
    for value in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        tensor = value.type.tensor_type
        if value.type.HasField("tensor_type") and tensor.HasField("shape"):
            dims = tensor.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                n = 1
                for d in dims:
                    n *= d.dim_value
                counts.setdefault(value.name, n)
    return counts


def casts_on_torch(model: onnx.ModelProto, min_elements: int = TORCH_CAST_MIN_ELEMENTS) -> int:
    """Each ``Cast`` between float32 and bfloat16/float16 of at least ``min_elements`` elements (or of unknown size)
    runs on PyTorch's kernel as an ATen node: the same values (a cast rounds to nearest even on both), 2-9x faster
    on the CPU. For the built training graph, whose gradients exist already. Returns how many were moved."""
    types = value_types(model)
    counts = _element_counts(model)
    moved = 0
    value_info = []
    for k, node in enumerate(model.graph.node):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
            continue
        source, target = types.get(node.input[0]), _attribute(node, "to")
        if {source, target} not in (
            {TensorProto.FLOAT, TensorProto.BFLOAT16},
            {TensorProto.FLOAT, TensorProto.FLOAT16},
        ):
            continue
        if counts.get(node.input[0], min_elements) < min_elements:
            continue
        aten = helper.make_node(
            "ATen",
            [node.input[0]],
            [node.output[0]],
            name=f"{node.name or 'Cast'}/ortcore.mixed_precision",
            domain=ATEN_DOMAIN,
            operator=helper_op(_CAST_HELPERS[target]),
            overload_name="",
        )
        model.graph.node[k].CopyFrom(aten)
        value_info.append(helper.make_tensor_value_info(node.output[0], target, None))
        moved += 1
    if moved:
        known = {v.name for v in model.graph.value_info}
        model.graph.value_info.extend(v for v in value_info if v.name not in known)
        torch_kernels.prepare_runtime()
    return moved


def _trainable_inputs(model: onnx.ModelProto, module: Any) -> set[str]:
    """The graph inputs that are parameters requiring a gradient (their names are the parameters')."""
    names = {i.name for i in model.graph.input}
    found = set()
    for name, p in module.named_parameters() if module is not None else ():
        if p.requires_grad and name in names:
            found.add(name)
    return found


def _record_reasons(model: onnx.ModelProto, placement: Placement, options: MixedPrecisionOptions) -> None:
    """Why the kinds this plugin puts on PyTorch's kernels run there, for ``model.explain()`` (the casts are placed
    in the gradient graph, whose kinds explain reads from the exported graph too)."""
    types = sorted({t for (_op, t, _where) in placement.counts if t in LOW.values()})
    units = machine.low_precision_units()
    found = ", ".join(f"{t}: {units.get(t) or 'no unit'}" for t in types)
    reasons = {
        "matmul": f"{'/'.join(types)} matrix product: ORT's CPU provider has no kernel in this type; PyTorch's "
        f"oneDNN kernel (mixed_precision, matmul = {options.matmul}; {found})",
        "linear": f"{'/'.join(types)} linear: ORT's CPU provider has no kernel in this type; PyTorch's oneDNN kernel "
        f"(mixed_precision, matmul = {options.matmul}; {found})",
    }
    if options.torch_casts:
        reasons["cast"] = (
            "large casts between float32 and bfloat16/float16: PyTorch's kernel is 2-9x faster than ORT's (mixed_precision)"
        )
    props = {p.key: p for p in model.metadata_props}
    for op, reason in reasons.items():
        key = ROUTED_METADATA_PREFIX + op
        if key in props:
            continue  # another plugin's reason for this kind (aten_fallback's measured linear) stands
        model.metadata_props.add(key=key, value=reason)


def _device_type(module: Any) -> str:
    """Where the module's parameters live (``cpu`` for a module without any)."""
    try:
        return next(module.parameters()).device.type
    except (StopIteration, AttributeError, TypeError):
        return "cpu"


_told: set[str] = set()


def _log(placement: Placement, what: str) -> None:
    if not placement.counts:
        return
    summary = placement.summary()
    logger.debug("%s: %s", what, summary)
    if summary not in _told:
        _told.add(summary)
        logger.info("mixed precision, %s: %s", what, summary)


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    options = config.plugin_options(NAME)
    if options is None or not options.enable:
        return []

    def run(model: onnx.ModelProto, context: PassContext) -> None:
        if _device_type(context.module) != "cpu":  # the CUDA provider has float16 and bfloat16 kernels
            return
        trainable = _trainable_inputs(model, context.module) if context.training else set()
        placement = place_low_precision(
            model, matmul=options.matmul, trainable=trainable, keep_rounding=options.exact_rounding
        )
        _log(placement, "forward graph")
        if placement.counts:
            _record_reasons(model, placement, options)

    return [GraphPass(PASS_NAME, run=run, plugin=NAME)]


@hookimpl
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass]:
    options = config.plugin_options(NAME)
    if options is None or not options.enable:
        return []

    def run(model: onnx.ModelProto, graph: Any) -> None:
        if graph.request.device.type != "cpu":  # the CUDA provider has float16 and bfloat16 kernels
            return
        placement = place_low_precision(
            model, gradient=True, matmul=options.matmul, keep_rounding=options.exact_rounding
        )
        moved = casts_on_torch(model) if options.torch_casts else 0
        if placement.counts or moved:
            graph.notes[NAME] = {"gradient graph": placement.summary(), "casts on PyTorch": moved}
        _log(placement, "gradient graph")

    return [GraphPass(GRADIENT_PASS_NAME, run=run, plugin=NAME)]


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    options = config.plugin_options(NAME)
    if options is None or not options.enable:
        return {PASS_NAME: "off"}
    # "auto" resolves by this CPU's units: a graph exported on another machine may place its products elsewhere.
    placements = {name: matmul_placement(options.matmul, t) for t, name in LOW.items()}
    return {
        PASS_NAME: PASS_VERSION,
        f"{PASS_NAME}.matmul": placements,
        f"{PASS_NAME}.exact_rounding": options.exact_rounding,
    }
