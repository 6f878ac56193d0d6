"""kernel_types: an op exported in an element type ONNX Runtime has no CPU kernel for runs in a wider type.

PyTorch computes masks and indices in bool and small integer types that ORT 1.19.2's CPU provider has no kernel for,
and ORT then refuses the whole session ("Could not find an implementation for EyeLike(9) node with name
'/module/EyeLike'"): ``torch.eye(n, dtype=torch.bool)`` is a bool ``EyeLike`` (ORT has int32, int64, float, double),
``torch.where``/``masked_fill`` on bool or int8 data a bool ``Where``, ``torch.maximum`` of uint8 images a uint8
``Max``, ``tril`` of an int32 tensor an int32 ``Trilu``, a comparison of int16 values an int16 ``Less``. Some the
exporters write in types ONNX itself does not allow for the op (``Max`` of bools, ``CumSum`` of uint8), which ORT
refuses with a type error.

The pass :func:`widen_kernel_types` (``kernel_types.widen``) runs on the exported forward graph before the gradient
build. Each node of an op in :data:`WIDENABLE` whose types ORT cannot run is computed in the narrowest wider type ORT
can run (:data:`WIDER`: bool -> uint8 -> int32 -> int64, int8/uint8/int16/uint16 -> int32 -> int64, int32/uint32 ->
int64), its inputs of that type cast up and its outputs of that type cast back to the type the exporter gave them.
For the ops of :data:`WIDENABLE` that is exactly the narrow type's result: every value of the narrow type is one of
the wider type, selections and comparisons do not depend on the type, integer ``+ - *`` (sums and products
included) wrap the same way after the cast back, and integer division and remainder of narrow values are the same
in the wider type. ``NonZero`` of a type with no wider one (double), and ``Not``, which
the TorchScript exporter writes on integers for ``torch.all``, read their input as bool: ``Not(Equal(x, 0))``, NaN
included (not ``Cast(x, bool)``: ORT drops the first Cast of ``Cast(to int) -> Cast(to bool)``, so ``x.int().all()``
would read 0.3 as true).

Which types ORT runs is asked of ORT itself (:func:`~ortcore_plugins.services.ort_kernels.ort_runs`): a one-node session of the node's op, attributes and
input types, created once per process and signature (about a millisecond), so a newer ORT with the kernel keeps the
graph as exported. Bool and integer values carry no gradient: the gradient graph is ORT's as before.

A node with no lossless wider type ORT runs (an int64 ``ArgMax``, a double ``ReduceProd``) is left as exported; ORT's
error then names it and the ``aten_fallback`` plugin's repair runs its op on PyTorch (``ortcore_repairs``).

The same pass also rewrites what ORT would run in the wrong types (:func:`read_cast_chains_as_bool`): ORT removes the
first Cast of ``Cast(to int32) -> Cast(to bool)`` even with every optimization off, so ``x.to(torch.int32).bool()``,
and ``all`` of integers as the dynamo route writes it, read 0.3 as true; the second Cast becomes
``Not(Equal(x, 0))``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import onnx
from onnx import TensorProto

from ortcore.api import Config, GraphPass, PassContext, ValueNames, hookimpl, splice
from ortcore_plugins.services.ort_kernels import ort_runs, type_name, value_types

logger = logging.getLogger("ortcore.kernel_types")

NAME = "kernel_types"
PASS_NAME = "kernel_types.widen"
# Bumped whenever the pass's output changes, so export caches do not serve graphs made by an older pass.
PASS_VERSION = 1

# Lossless wider types of each narrow type, narrowest first: every value of the type is a value of each of them.
WIDER: dict[int, tuple[int, ...]] = {
    TensorProto.BOOL: (TensorProto.UINT8, TensorProto.INT32, TensorProto.INT64),
    TensorProto.UINT8: (TensorProto.INT32, TensorProto.INT64),
    TensorProto.INT8: (TensorProto.INT32, TensorProto.INT64),
    TensorProto.INT16: (TensorProto.INT32, TensorProto.INT64),
    TensorProto.UINT16: (TensorProto.INT32, TensorProto.INT64),
    TensorProto.INT32: (TensorProto.INT64,),
    TensorProto.UINT32: (TensorProto.INT64,),
}

# Ops whose result computed in a wider type and cast back is the narrow type's result, and the type parameters (of
# their ONNX schema) computed wider. EyeLike's T2 is its output type, set by its ``dtype`` attribute.
WIDENABLE: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "Abs",
            "Add",
            "ArgMax",
            "ArgMin",
            "Clip",
            "CumSum",
            "Div",
            "Einsum",
            "Equal",
            "Greater",
            "GreaterOrEqual",
            "Less",
            "LessOrEqual",
            "MatMul",
            "Max",
            "Min",
            "Mod",
            "Mul",
            "Neg",
            "NonZero",
            "Not",
            "Pad",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceSum",
            "Relu",
            "Sign",
            "Sub",
            "Sum",
            "TopK",
            "Trilu",
            "Unique",
            "Where",
        ),
        ("T",),
    ),
    "EyeLike": ("T1", "T2"),
}
# Ops that read their input only as zero / not zero: any type may be read as bool (x != 0).
AS_BOOL = frozenset({"NonZero", "Not"})
# Types ORT's CPU Equal takes, to read a value as bool with. Not a Cast to bool: ORT removes the first Cast of a chain
# Cast(to int) -> Cast(to bool), so float 0.3 -> int 0 -> False would become 0.3 -> True (onnxruntime#11994).
_EQUAL_TYPES = (TensorProto.INT32, TensorProto.INT64, TensorProto.FLOAT, TensorProto.DOUBLE)

def _comparable(elem_type: int) -> int | None:
    """The type to compare a value of ``elem_type`` with zero in: itself, or its narrowest lossless wider type among
    the ones ORT's Equal takes; None if there is none."""
    if elem_type in _EQUAL_TYPES:
        return elem_type
    return next((t for t in WIDER.get(elem_type, ()) if t in _EQUAL_TYPES), None)


# -- the pass ---------------------------------------------------------------------------------------------------------


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _formals(params: Sequence[Any], count: int) -> list[str]:
    """The type parameter of each of ``count`` actual inputs (or outputs) of a schema's ``params`` (the last may be
    variadic)."""
    found = []
    for k in range(count):
        formal = params[min(k, len(params) - 1)] if params else None
        if formal is None or (k >= len(params) and formal.option != formal.option.Variadic):
            found.append("")
        else:
            found.append(formal.type_str)
    return found


def _attribute(node: onnx.NodeProto, name: str) -> onnx.AttributeProto | None:
    return next((a for a in node.attribute if a.name == name), None)


class _Node:
    """One node's view for the pass: the type parameter of each input and output and the types bound to them."""

    def __init__(self, node: onnx.NodeProto, schema: Any, types: dict[str, int]):
        self.node = node
        self.inputs = _formals(schema.inputs, len(node.input))
        self.outputs = _formals(schema.outputs, len(node.output))
        self.input_types = [types.get(name) if name else None for name in node.input]
        self.recorded = [types.get(name) for name in node.output]
        self.bound: dict[str, int] = {}
        for param, elem_type in zip(self.inputs, self.input_types, strict=True):
            if param and elem_type is not None:
                self.bound.setdefault(param, elem_type)
        if node.op_type == "EyeLike" and "T1" in self.bound:
            dtype = _attribute(node, "dtype")
            self.bound["T2"] = dtype.i if dtype is not None else self.bound["T1"]

    def choices(self, param: str) -> list[int]:
        """The types ``param`` may be computed in: its own, then each wider type (the exporter's type of an output
        first, when it is one of them)."""
        own = self.bound[param]
        wider = WIDER.get(own, ())
        if self.node.op_type in AS_BOOL and _comparable(own) is not None:
            wider = (*wider, TensorProto.BOOL)
        recorded = [t for p, t in zip(self.outputs, self.recorded, strict=True) if p == param and t in wider]
        return list(dict.fromkeys([own, *recorded, *wider]))

    def trial(self, choice: dict[str, int]) -> tuple[onnx.NodeProto, list[int | None]]:
        """The node and its input types with each type parameter in ``choice`` computed in its chosen type."""
        node = onnx.NodeProto()
        node.CopyFrom(self.node)
        if node.op_type == "EyeLike" and "T2" in self.bound:  # explicit: without it, T2 would follow T1
            kept = [a for a in node.attribute if a.name != "dtype"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("dtype", choice.get("T2", self.bound["T2"]))])
        types = [choice.get(p, t) if p else t for p, t in zip(self.inputs, self.input_types, strict=True)]
        return node, types


def _chosen_types(view: _Node, opset: int, ir_version: int) -> dict[str, int] | None:
    """The types to compute the node's widenable type parameters in, the fewest and narrowest changes first; None
    when ORT runs the node as it is, or no choice is known to run."""
    params = [p for p in WIDENABLE[view.node.op_type] if p in view.bound]
    if not params or ort_runs(*view.trial({}), opset, ir_version) is not False:
        return None
    options = [view.choices(p) for p in params]
    ranks = [[o.index(t) for o, t in zip(options, c, strict=True)] for c in itertools.product(*options)]
    ranked = sorted(ranks, key=lambda r: (sum(1 for i in r if i), sum(r)))
    for rank in ranked:
        choice = {p: options[k][i] for k, (p, i) in enumerate(zip(params, rank, strict=True)) if i}
        if choice and ort_runs(*view.trial(choice), opset, ir_version):
            return choice
    return None


_told: set[tuple[str, str, str]] = set()


def _read_as_bool(
    added: list[onnx.NodeProto], names: ValueNames, scope: str, name: str, elem_type: int, output: str = ""
) -> str:
    """``Not(Equal(x, 0))`` of value ``name``, in a type Equal takes (nodes appended to ``added``), written to
    ``output`` (a new name if empty); returns the result's name."""
    compared = _comparable(elem_type)
    assert compared is not None  # callers check _comparable first
    value = name
    if compared != elem_type:
        value = names.fresh(f"{scope}/{name}_as_{type_name(compared)}")
        added.append(onnx.helper.make_node("Cast", [name], [value], name=value, to=compared))
    zero = names.fresh(f"{scope}/zero_{type_name(compared)}")
    equal = names.fresh(f"{scope}/{name}_is_zero")
    nonzero = output or names.fresh(f"{scope}/{name}_as_bool")
    tensor = onnx.helper.make_tensor("zero", compared, [], [0])
    added += [
        onnx.helper.make_node("Constant", [], [zero], name=zero, value=tensor),
        onnx.helper.make_node("Equal", [value, zero], [equal], name=equal),
        onnx.helper.make_node("Not", [equal], [nonzero], name=f"{scope}/Not_{nonzero}"),
    ]
    return nonzero


_FLOAT_RANK = {TensorProto.FLOAT16: 1, TensorProto.BFLOAT16: 1, TensorProto.FLOAT: 2, TensorProto.DOUBLE: 3}
_INT_BITS = {
    TensorProto.INT8: 8,
    TensorProto.UINT8: 8,
    TensorProto.INT16: 16,
    TensorProto.UINT16: 16,
    TensorProto.INT32: 32,
    TensorProto.UINT32: 32,
    TensorProto.INT64: 64,
    TensorProto.UINT64: 64,
}


def _keeps_nonzero(source: int | None, target: int) -> bool:
    """Whether a Cast from ``source`` to ``target`` never turns a non-zero value into zero (float 0.3 -> int 0 does,
    int64 2**32 -> int32 0 does, double 1e-300 -> float 0 does)."""
    if source == TensorProto.BOOL:
        return True
    if source in _INT_BITS:
        return target in _FLOAT_RANK or _INT_BITS.get(target, 0) >= _INT_BITS[source]
    if source in _FLOAT_RANK and target in _FLOAT_RANK:
        return _FLOAT_RANK[target] > _FLOAT_RANK[source] or target == source
    return False


def read_cast_chains_as_bool(model: onnx.ModelProto, types: dict[str, int] | None = None) -> int:
    """Each ``Cast(to bool)`` of a ``Cast`` that may turn a non-zero value into zero becomes ``Not(Equal(x, 0))``:
    ORT removes the first Cast of such a chain even with every optimization off, so ``x.to(torch.int32).bool()``
    would read 0.3 as true (onnxruntime#11994); torch's and onnxscript's ``all`` of integers write such chains.
    Returns how many were rewritten."""
    graph = model.graph
    producers = {out: n for n in graph.node for out in n.output if out}
    chains = []
    for position, node in enumerate(graph.node):
        to = _attribute(node, "to")
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or to is None or to.i != TensorProto.BOOL:
            continue
        first = producers.get(node.input[0])
        if first is None or first.op_type != "Cast" or first.domain not in ("", "ai.onnx"):
            continue
        chains.append((position, node, first))
    if not chains:
        return 0
    types = value_types(model) if types is None else types
    names = ValueNames(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for position, node, first in chains:
        middle = _attribute(first, "to").i
        source = types.get(first.input[0])
        if _keeps_nonzero(source, middle) or middle == TensorProto.BOOL or _comparable(middle) is None:
            continue
        scope = f"{node.name or 'Cast'}/ortcore.kernel_types"
        added: list[onnx.NodeProto] = []
        _read_as_bool(added, names, scope, node.input[0], middle, output=node.output[0])
        replaced[position] = added
        told = ("Cast chain", type_name(source) if source else "?", type_name(middle))
        if told not in _told:
            _told.add(told)
            logger.info(
                "Cast(%s -> %s) -> Cast(to bool) reads the %s value as Not(Equal(x, 0)): ONNX Runtime would drop the "
                "first Cast",
                told[1],
                told[2],
                told[2],
            )
    if replaced:
        splice(graph, replaced)
    return len(replaced)


def widen_kernel_types(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Compute each node ORT has no kernel for in the narrowest lossless wider type it has one for (module
    docstring); returns how many nodes were rewritten."""
    graph = model.graph
    candidates = [n for n in graph.node if n.op_type in WIDENABLE and n.domain in ("", "ai.onnx")]
    if not candidates:
        return 0
    opset = _opset(model)
    types = value_types(model)
    names = ValueNames(graph)
    before: dict[int, list[onnx.NodeProto]] = {}
    after: dict[int, list[onnx.NodeProto]] = {}
    positions = {id(n): k for k, n in enumerate(graph.node)}
    rewritten = 0
    for node in candidates:
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        view = _Node(node, schema, types)
        widenable = [view.bound[p] for p in WIDENABLE[node.op_type] if p in view.bound]
        if not any(t in WIDER or (node.op_type in AS_BOOL and t != TensorProto.BOOL) for t in widenable):
            continue
        choice = _chosen_types(view, opset, model.ir_version or 8)
        if choice is None:
            continue
        position = positions[id(node)]
        scope = f"{node.name or node.op_type}/ortcore.kernel_types"
        for k, (param, name) in enumerate(zip(view.inputs, node.input, strict=True)):
            if not name or param not in choice or view.input_types[k] == choice[param]:
                continue
            added = before.setdefault(position, [])
            if choice[param] == TensorProto.BOOL and node.op_type in AS_BOOL:
                node.input[k] = _read_as_bool(added, names, scope, name, view.input_types[k])
                continue
            cast = names.fresh(f"{scope}/{name}_as_{type_name(choice[param])}")
            added.append(onnx.helper.make_node("Cast", [name], [cast], name=cast, to=choice[param]))
            node.input[k] = cast
        for k, (param, name) in enumerate(zip(view.outputs, node.output, strict=True)):
            target = view.recorded[k] if view.recorded[k] is not None else view.bound.get(param)
            if not name or param not in choice or target == choice[param]:
                continue
            wide = names.fresh(f"{scope}/{name}_{type_name(choice[param])}")
            node.output[k] = wide
            after.setdefault(position, []).append(
                onnx.helper.make_node("Cast", [wide], [name], name=f"{scope}/Cast_{k}", to=target)
            )
        if node.op_type == "EyeLike":
            del node.attribute[:]
            node.attribute.extend(view.trial(choice)[0].attribute)
        rewritten += 1
        for param, elem_type in choice.items():
            told = (node.op_type, type_name(view.bound[param]), type_name(elem_type))
            logger.debug("%s (%s on %s) runs on %s and is cast back", node.name, *told)
            if told not in _told:
                _told.add(told)
                logger.info("%s on %s runs on %s and is cast back: ONNX Runtime's CPU provider cannot run it", *told)
    if rewritten:
        nodes = []
        for position, node in enumerate(graph.node):
            nodes.extend(before.get(position, ()))
            nodes.append(node)
            nodes.extend(after.get(position, ()))
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


# -- hooks ----------------------------------------------------------------------------------------------------------


def _run(model: onnx.ModelProto, context: PassContext) -> None:
    widen_kernel_types(model, context)
    read_cast_chains_as_bool(model)


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(PASS_NAME, run=_run, plugin=NAME)]


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    return {PASS_NAME: PASS_VERSION}
