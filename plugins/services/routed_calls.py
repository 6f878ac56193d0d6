"""A traced TorchScript call of an aten op as one ATen node run by PyTorch: the inputs flattened (tensor lists
spread), an input that may need a gradient first (ORT builds an ATen node's gradient only then), a tensor passed twice
given once, through a wrapper op (:func:`~ortcore_plugins.services.aten_nodes.define_wrapper`) with its VJP gradient.
A tuple result is one output per tensor; a tensor-list result (``split``, ``unbind``, ``meshgrid``,
``broadcast_tensors``) too, as many as the traced call unpacked (:func:`list_items`).

:func:`emit_call` is the symbolic's body; ``op_routing`` writes its routes with it, and ``aten_fallback`` the listed
ops whose first input needs no gradient (``scatter_reduce``'s ``src``, ``logaddexp(x, fc(x))``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from ortcore.api import UnsupportedModelError

from .aten_nodes import (
    FLOAT_TYPES,
    aten_node,
    constant_argument,
    define_wrapper,
    is_none,
    op_packet,
    register_vjp_gradient,
    requires_grad,
    schema_type,
)
from .differentiability import differentiates


def is_list(value: Any) -> bool:
    """Is the traced value a list built in the graph (``prim::ListConstruct``)?"""
    return value is not None and not is_none(value) and value.node().kind() == "prim::ListConstruct"


ABSENT = "absent"  # an optional argument the executor cannot pass, left at None: not an input of the node


@attrs.frozen
class FlatInput:
    """One input of the ATen node: a schema argument, or one tensor of a tensor-list argument."""

    argument: int  # index into the op's schema arguments
    item: int | None  # index into the list, for a tensor-list argument
    kind: str  # schema type of this input ("Tensor", "int[]", ...)
    value: Any  # the traced value


def flatten_call(op: str, schema: Any, args: tuple) -> list[FlatInput]:
    from torch.onnx import symbolic_helper as sh

    flat = []
    for k, (a, value) in enumerate(zip(schema.arguments, args, strict=True)):
        t = a.type.getElementType() if a.type.kind() == "OptionalType" else a.type
        element = t.getElementType() if t.kind() == "ListType" else None
        optional = element is not None and element.kind() == "OptionalType"
        if element is not None and (element.getElementType() if optional else element).kind() == "TensorType":
            if not is_list(value):
                raise UnsupportedModelError(
                    f"cannot run aten::{op} on PyTorch's kernel: its tensor list {a.name!r} is not built in the graph"
                )
            # A None item of a Tensor?[] (index_put's indices, x[:, i]) is no input: the wrapper puts None there.
            flat.extend(
                FlatInput(k, i, ABSENT if optional and is_none(v) else "Tensor", None if is_none(v) else v)
                for i, v in enumerate(sh._unpack_list(value))
            )
        else:
            try:
                kind = schema_type(a.type, op, a.name)
            except TypeError as e:
                if a.type.kind() == "OptionalType" and is_none(value):
                    flat.append(FlatInput(k, None, ABSENT, None))  # a generator left at None, say: the wrapper omits it
                    continue
                raise UnsupportedModelError(f"cannot run aten::{op} on PyTorch's kernel: {e}") from e
            flat.append(FlatInput(k, None, kind, value))
    return flat


def call_wrapper(
    op: str,
    schema: Any,
    flat: list[FlatInput],
    order: list[int],
    differentiable: tuple[int, ...],
    float_inputs: tuple[int, ...],
    list_results: int | None = None,
) -> str:
    """Define (once) the ``ortcore_route::`` op taking ``flat`` inputs in ``order`` and calling ``aten::<op>`` (whose
    tensor-list result, if it returns one, is ``list_results`` tensors long)."""
    overload = schema.overload_name
    signature = (
        f"{op}.{overload}|{[(f.argument, f.item, f.kind) for f in flat]}|{order}|{differentiable}|{float_inputs}"
    )
    if list_results is not None:
        signature += f"|list:{list_results}"
    kinds = [flat[i].kind for i in order]
    placement = [((flat[i].argument, flat[i].item),) for i in order]
    lengths: dict[int, int] = {}
    for f in flat:
        if f.item is not None:
            lengths[f.argument] = max(lengths.get(f.argument, 0), f.item + 1)
    return define_wrapper(op, overload, schema, kinds, placement, signature, lengths, list_results)


def returns_tensor_list(schema: Any) -> bool:
    """Does the op return one tensor list (``Tensor[]``: ``split``, ``unbind``, ``meshgrid``, ``broadcast_tensors``)?"""
    if len(schema.returns) != 1 or schema.returns[0].type.kind() != "ListType":
        return False
    return schema.returns[0].type.getElementType().kind() == "TensorType"


def list_items(op: str, value: Any) -> list[Any]:
    """The traced items of a call's tensor-list result: the outputs of the ``prim::ListUnpack`` that reads it (the
    tracer unpacks a list the model's Python code receives). A list read otherwise has no length in the trace."""
    unpacks = [u.user for u in value.uses() if u.user.kind() == "prim::ListUnpack"]
    others = [u.user.kind() for u in value.uses() if u.user.kind() != "prim::ListUnpack"]
    if len(unpacks) != 1 or others:
        read = ", ".join(others) if others else f"{len(unpacks)} prim::ListUnpack"
        raise UnsupportedModelError(
            f"cannot run aten::{op} on PyTorch's kernel: how many tensors its list result holds is not in the "
            f"traced graph (the list is read by {read}, not unpacked once)"
        )
    return list(unpacks[0].outputs())


def may_need_grad(value: Any, any_build: bool = False) -> bool:
    """May ORT be asked for this input's gradient: does a floating-point path lead to it from a graph input traced
    with ``requires_grad`` (a trained parameter, an input that requires grad)?

    Read from the graph being exported (values earlier symbolics made carry no requires_grad flag of their own): a
    constant, a user's input traced without requires_grad, or a value computed only from those or through integers
    (an RNN's zero initial state, built from the input's shape) needs none. With ``any_build``, in any build of this
    export (which inputs and parameters require grad is decided per build): only a constant, or a value computed from
    constants and sizes, never does.
    """
    seen: set[str] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v.debugName() in seen:
            continue
        seen.add(v.debugName())
        try:
            t = v.type()
            scalar = t.scalarType() if t.kind() == "TensorType" else None
        except (AttributeError, RuntimeError):
            scalar = None
        if scalar is not None and scalar not in FLOAT_TYPES:
            continue  # an integer or boolean value carries no gradient (a shape, indices, a mask)
        node = v.node()
        kind = node.kind()
        if kind in ("onnx::Constant", "prim::Constant"):
            continue
        if kind == "prim::Param":
            if any_build or requires_grad(v) is not False:
                return True
            continue
        stack.extend(node.inputs())
    return False


def emit_call(g: Any, op: str, schema: Any, args: tuple, prepare_runtime: Callable[[], None]) -> Any:
    """Export one traced call of ``aten::<op>`` (``schema`` its overload, ``args`` its traced arguments) as an ATen
    node running a wrapper op, with its VJP gradient; ``prepare_runtime`` makes the ATen executor ready (called
    first, and by the gradient's registration)."""
    prepare_runtime()
    node = g.original_node
    outputs_traced = list(node.outputs())
    list_results = None
    fused = False
    if returns_tensor_list(schema):
        # A tensor list (split, unbind, meshgrid, broadcast_tensors): the ATen node has one output per item, as many
        # as the traced call returned; the symbolic hands the exporter the list it unpacks. The exporter fuses some
        # calls with their unpacking already (split, unbind: a node with one output per item), which get the items.
        fused = len(outputs_traced) > 1 or outputs_traced[0].type().kind() != "ListType"
        if not fused:
            outputs_traced = list_items(op, outputs_traced[0])
        list_results = len(outputs_traced)
    elif any(r.type.kind() != "TensorType" for r in schema.returns):
        raise UnsupportedModelError(
            f"cannot run aten::{op} on PyTorch's kernel: it returns {', '.join(str(r.type) for r in schema.returns)}"
            " (the ATen executor hands back tensors, tuples of tensors and tensor lists only)"
        )
    flat = flatten_call(op, schema, args)
    tensors = [i for i, f in enumerate(flat) if f.kind in ("Tensor", "Tensor?")]
    # Floating-point inputs PyTorch differentiates (fractional_max_pool2d's float random_samples it refuses to).
    floats = [
        i
        for i in tensors
        if not is_none(flat[i].value)
        and flat[i].value.type().scalarType() in FLOAT_TYPES
        and differentiates(schema, flat[i].argument)
    ]
    needs = [i for i in floats if may_need_grad(flat[i].value)]
    order = [i for i, f in enumerate(flat) if f.kind != ABSENT]
    if needs and order[0] not in needs:
        # ORT builds an ATen node's gradient only when its first input needs one: that input goes first.
        order.remove(needs[0])
        order.insert(0, needs[0])
    seen: set[str] = set()
    for k, f in enumerate(flat):
        if f.kind in ("Tensor", "Tensor?") and not is_none(f.value):
            # One value twice among an ATen node's inputs breaks ORT's gradient build (two gradients of one name).
            if f.value.debugName() in seen:
                flat[k] = attrs.evolve(f, value=g.op("Identity", f.value))
            seen.add(f.value.debugName())
    for f in flat:
        if f.kind == "Tensor" and is_none(f.value):
            raise UnsupportedModelError(f"cannot run aten::{op} on PyTorch's kernel: a tensor argument is None")
    ordered = [flat[i] for i in order]
    # ORT writes the gradient of every input a definition names (<input>_grad), needed or not: a constant gets none.
    float_inputs = tuple(
        k for k, i in enumerate(order) if i in floats and may_need_grad(flat[i].value, any_build=True)
    )
    # An output nothing reads gets no gradient from ORT: the gradient definition must not ask for it (an RNN's h_n).
    differentiable = tuple(j for j, v in enumerate(outputs_traced) if v.type().scalarType() in FLOAT_TYPES and v.uses())
    # Always a wrapper op: its name carries this call's signature, so its gradient definition (registered once per
    # name, process-wide) fits this call's inputs and outputs.
    operator, overload = call_wrapper(op, schema, flat, order, differentiable, float_inputs, list_results), ""
    packet_schema = op_packet(operator).default._schema
    inputs = [
        f.value if f.kind in ("Tensor", "Tensor?") else constant_argument(g, f.value, f.kind, op, f"a{k}")
        for k, f in enumerate(ordered)
    ]
    register_vjp_gradient(operator, overload, packet_schema, differentiable, float_inputs, prepare_runtime)
    results = aten_node(g, operator, overload, inputs, outputs_traced)
    if list_results is not None and not fused:
        return g.op("prim::ListConstruct", *(results if isinstance(results, tuple) else (results,)))
    return results
