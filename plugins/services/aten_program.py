"""The ATen node service on the dynamo route: calls of ``torch.export``'s program become ATen nodes run by PyTorch.

The dynamo route's counterpart of the TorchScript symbolics that ``op_routing`` and ``aten_fallback`` write with
:mod:`ortcore_plugins.services.aten_nodes`. A program pass (``ortcore_program_passes``) picks calls in the exported
program's FX graph and hands each to :func:`route_call`, which

* binds the call's arguments to its op's schema and defines, once per call signature, the wrapper op that takes them
  (:func:`~ortcore_plugins.services.aten_nodes.define_wrapper`): an input that may need a gradient first (ORT builds
  an ATen node's gradient only then), tensor lists spread over separate inputs, a tensor passed twice given once;
* makes the FX node call the wrapper instead (the same node: its name, value metadata and users stay);
* registers the wrapper's VJP gradient definition (:func:`~ortcore_plugins.services.aten_nodes.register_vjp_gradient`)
  for the floating-point inputs PyTorch differentiates (:mod:`ortcore_plugins.services.differentiability`);
* and keeps the onnxscript translation that writes the wrapper as one ``org.pytorch.aten::ATen`` node, which
  :func:`translations` hands to ``ortcore_export_translations`` (an op in that table is not decomposed).

:class:`GradientReach` says whether a value may carry a gradient: computed in floating point from a trained parameter
(certainly) or from one of the model's inputs (possibly: whether an input requires grad is not in the program).
:func:`has_translation` says whether the exporter can write an op itself (a torchlib function, or a decomposition).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from ortcore.api import ATEN_DOMAIN

from .aten_nodes import (
    WRAPPER_NAMESPACE,
    define_wrapper,
    gradient_inputs,
    gradient_key,
    op_packet,
    prepare,
    register_vjp_gradient,
)
from .differentiability import differentiates

logger = logging.getLogger("ortcore.aten")

FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})

# c10::ScalarType numbers: a dtype argument travels as an int (aten ops take an int for a ScalarType).
_SCALAR_TYPES = {
    torch.uint8: 0,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float16: 5,
    torch.float32: 6,
    torch.float64: 7,
    torch.complex64: 9,
    torch.complex128: 10,
    torch.bool: 11,
    torch.bfloat16: 15,
}


class Unroutable(Exception):
    """A call the ATen executor cannot run (an argument it cannot pass, a result that is not a tensor)."""


# -- which values may carry a gradient --------------------------------------------------------------------------------

NONE, POSSIBLE, CERTAIN = 0, 1, 2


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _carries_float(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype in FLOAT_DTYPES
    if isinstance(value, tuple | list):
        return any(_carries_float(v) for v in value)
    return False


# Ops whose floating-point result carries no gradient back to their inputs: made from an input's shape or dtype only,
# or cut from the graph's gradients.
_NO_GRADIENT = frozenset(
    {
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "detach",
        "bernoulli",
    }
)


def _name_of(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    return schema.name.rpartition("::")[2] if schema is not None else ""


class GradientReach:
    """Whether each value of an exported program may carry a gradient back to a graph input.

    The program's user inputs are the model's inputs, then its parameters and buffers (the dynamo exporter's
    layout). A value computed in floating point from a parameter that requires grad certainly does
    (:data:`CERTAIN`); from a floating-point model input possibly (:data:`POSSIBLE`: the input may require grad);
    an integer or boolean value, a constant, or a value computed only from those or from frozen tensors does not.

    :meth:`can_carry` answers for every build of the graph instead: freezing a parameter or an input's
    ``requires_grad`` does not export again, so only a constant, or a value computed from constants and sizes, never
    carries one.
    """

    def __init__(self, program: torch.export.ExportedProgram, module: torch.nn.Module | None):
        graph = program.graph_module.graph
        user = list(program.graph_signature.user_inputs)
        state: dict[str, torch.Tensor] = {}
        if module is not None:
            state = dict(module.named_parameters())
            state.update(module.named_buffers())
        names = list(state)
        n_inputs = len(user) - len(state) if len(user) >= len(state) else len(user)
        placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        self.levels: dict[torch.fx.Node, int] = {}
        self.carriers: set[torch.fx.Node] = set()
        for k, name in enumerate(user):
            node = placeholders.get(name)
            if node is None or not _carries_float(_val(node)):
                continue
            self.carriers.add(node)
            if k < n_inputs:
                self.levels[node] = POSSIBLE
            else:
                self.levels[node] = CERTAIN if state[names[k - n_inputs]].requires_grad else NONE
        for node in graph.nodes:
            if node.op != "call_function" or not _carries_float(_val(node)):
                continue
            if _name_of(node.target) in _NO_GRADIENT:
                continue  # its values do not depend on its inputs' (zeros_like(h)): ORT gives it no gradient
            self.levels[node] = max((self.levels.get(i, NONE) for i in node.all_input_nodes), default=NONE)
            if any(i in self.carriers for i in node.all_input_nodes):
                self.carriers.add(node)

    def of(self, node: Any) -> int:
        return self.levels.get(node, NONE) if isinstance(node, torch.fx.Node) else NONE

    def can_carry(self, node: Any) -> bool:
        """May the value carry a gradient in some build of this graph: is it computed in floating point from a graph
        input (a model input, a parameter or a buffer, whatever its ``requires_grad``)?"""
        return node in self.carriers


# -- can the exporter write an op ----------------------------------------------------------------------------------


@functools.cache
def _translated() -> frozenset[str]:
    """Qualified names (``aten::add.Tensor``, ``aten::linear`` for a default overload) of the ops torch.onnx's
    registry has a real-valued function for: onnxscript's torchlib and torch's own additions. Read from their
    registries' names (building torch.onnx's ``ONNXRegistry`` itself takes about a second)."""
    names: set[str] = set()
    try:
        from onnxscript.function_libs.torch_lib import ops  # noqa: F401 (registers the functions)
        from onnxscript.function_libs.torch_lib.registration import default_registry

        names.update(name for name in default_registry if default_registry[name].overloads)
        from torch.onnx._internal.exporter._torchlib import _torchlib_registry

        for meta in _torchlib_registry.get_torchlib_ops():
            if isinstance(meta.fx_target, torch._ops.OpOverload) and not meta.is_complex:
                names.add(_qualified(meta.fx_target))
    except (ImportError, AttributeError):  # another layout: ask the registry torch.onnx builds
        from torch.onnx._internal.exporter import _registration

        registry = _registration.ONNXRegistry.from_torchlib()
        names.update(name for name in registry.functions if isinstance(name, str))
    return frozenset(names)


def _qualified(target: Any) -> str:
    overload = target._overloadname
    return target._schema.name if overload == "default" else f"{target._schema.name}.{overload}"


@functools.cache
def _decomposed() -> frozenset[Any]:
    table = dict(torch.export.default_decompositions().items())
    table.update(torch._decomp.decomposition_table)
    return frozenset(op for op in table if isinstance(op, torch._ops.OpOverload))


# Ops the exporter removes or writes itself without a translation: assertions, ops of the onnx namespace.
_HANDLED_NAMESPACES = ("onnx",)
_HANDLED_PREFIXES = ("_assert", "sym_constrain_range")


def has_translation(
    target: Any, translated: frozenset = frozenset(), node: torch.fx.Node | None = None, depth: int = 0
) -> bool:
    """Can the dynamo exporter write ``target`` (an ``OpOverload``) in ONNX: has it a torchlib function, or a
    decomposition (torch.export's default ones, PyTorch's table, a CompositeImplicitAutograd kernel), or a plugin's
    translation (``translated``: a pass's ``PassContext.translated``)?

    Given the call (``node``, with its values' metadata), a decomposition counts only when every op it produces for
    these arguments can be written in turn (:func:`_decomposition_ops`, followed :data:`_DECOMPOSITION_DEPTH`
    levels deep; ``depth`` is this call's level): ``cdist`` decomposes into
    ``_cdist_forward`` for small inputs, ``rrelu`` into ``rrelu_with_noise``, ``matrix_exp`` into
    ``linalg_matrix_exp``, none of which the exporter has.

    Ops of ortcore's own ``ortcore*`` namespaces count as written: the plugin that puts them in the program
    translates them.
    """
    if not isinstance(target, torch._ops.OpOverload) or target in translated:
        return True
    if target._schema.is_mutable:
        # torch.onnx translates an in-place or out= call as its functional form (``copy_`` as ``copy``), and a call
        # that writes another argument as the op functionalization gives it (``rrelu_with_noise_functional``)
        functional = _functional_op(target) or _functionalized_op(target)
        return functional is None or has_translation(functional, translated)
    namespace = target.namespace
    name = target._schema.name.rpartition("::")[2]
    if namespace.startswith("ortcore") or namespace in _HANDLED_NAMESPACES or name.startswith(_HANDLED_PREFIXES):
        return True
    if _qualified(target) in _translated():
        return True
    try:
        decomposes = target in _decomposed() or torch._C._dispatch_has_kernel_for_dispatch_key(
            target.name(), "CompositeImplicitAutograd"
        )
    except RuntimeError:  # an op the dispatcher does not know by name (aten.size.default): the exporter's own
        return True
    if not decomposes or node is None:
        return decomposes
    produced = _decomposition_ops(node) if depth < _DECOMPOSITION_DEPTH else None
    if produced is None:  # the decomposition could not be traced here: trust it, as the exporter will try it
        return True
    return all(has_translation(op, translated, inner, depth + 1) for op, inner in produced)


_DECOMPOSITION_DEPTH = 4  # decompositions of decompositions followed at most this deep


def _decomposition_ops(node: torch.fx.Node) -> list[tuple[Any, torch.fx.Node]] | None:
    """The aten calls that ``node``'s op decomposes into for the call's own arguments (its inputs' fake values), each
    with its node in the traced decomposition; None when the call cannot be traced on its metadata."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx.experimental.proxy_tensor import make_fx

        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), _val)
        values = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if not values or not all(isinstance(v, FakeTensor) for v in values):
            return None
        fake_mode = values[0].fake_mode
        target = node.target
        table = (
            {target: torch._decomp.decomposition_table[target]} if target in torch._decomp.decomposition_table else {}
        )

        def call(*flat: Any) -> Any:
            a, k = torch.utils._pytree.tree_unflatten(list(flat), spec)
            return target(*a, **k)

        flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
        with fake_mode:
            traced = make_fx(call, decomposition_table=table, tracing_mode="real")(*flat)
    except Exception:  # noqa: BLE001 (symbolic sizes, ops without a fake kernel: nothing to learn here)
        return None
    calls = [(n.target, n) for n in traced.graph.nodes if n.op == "call_function"]
    if any(target is node.target for target, _ in calls):
        return None  # not decomposed at all
    return [(t, n) for t, n in calls if isinstance(t, torch._ops.OpOverload)]


# -- routing one call -------------------------------------------------------------------------------------------------


def bind(node: torch.fx.Node) -> list[Any]:
    """The call's value of each argument of its op's schema (defaults filled in)."""
    schema = node.target._schema
    values = []
    for k, a in enumerate(schema.arguments):
        if k < len(node.args) and not a.kwarg_only:
            values.append(node.args[k])
        elif a.name in node.kwargs:
            values.append(node.kwargs[a.name])
        elif a.has_default_value():
            values.append(a.default_value)
        else:
            raise Unroutable(f"argument {a.name!r} is missing")
    return values


def _is_tensor_list(t: Any) -> bool:
    if t.kind() != "ListType":
        return False
    element = t.getElementType()
    element = element.getElementType() if element.kind() == "OptionalType" else element
    return element.kind() == "TensorType"


_SIMPLE = {
    "IntType": "int",
    "SymIntType": "SymInt",
    "FloatType": "float",
    "BoolType": "bool",
    "NumberType": "Scalar",
    "StringType": "str",
    "ScalarTypeType": "int",
}
_LISTS = {"IntType": "int[]", "SymIntType": "SymInt[]", "FloatType": "float[]", "BoolType": "bool[]"}


def _kind(t: Any, name: str) -> str:
    """The wrapper's schema type for a present (not None) non-tensor-list argument of type ``t``."""
    kind = t.kind()
    if kind == "TensorType":
        return "Tensor"
    if kind == "ListType" and t.getElementType().kind() in _LISTS:
        return _LISTS[t.getElementType().kind()]
    if kind in _SIMPLE:
        return _SIMPLE[kind]
    raise Unroutable(f"argument {name!r} has type {t}, which the ATen executor cannot pass")


def _used_outputs(node: torch.fx.Node, n_outputs: int) -> set[int]:
    """Which outputs of a call something reads (ORT gives no gradient for an output nothing reads)."""
    if n_outputs == 1:
        return {0} if node.users else set()
    used: set[int] = set()
    for user in node.users:
        if user.target is operator.getitem and isinstance(user.args[1], int):
            if user.users:
                used.add(user.args[1])
        else:
            return set(range(n_outputs))
    return used


def route_call(node: torch.fx.Node, reach: GradientReach, prepare_runtime: Callable[[], None] = prepare) -> str:
    """Make ``node`` (a call of an ``OpOverload``) call a wrapper op exported as one ATen node; returns the wrapper's
    operator name. Raises :class:`Unroutable` (naming the argument or result) when the executor cannot run it."""
    target = node.target
    schema = target._schema
    if schema.is_mutable:
        raise Unroutable("it updates its inputs in place")
    val = _val(node)
    # A tensor list (split, unbind, meshgrid, broadcast_tensors): one ATen output per item, as many as the program's
    # call returns (the wrapper returns them as a tuple, which the program's getitem calls read as they read the list).
    list_results = len(val) if _is_tensor_list(schema.returns[0].type) and len(schema.returns) == 1 else None
    if list_results is None and any(r.type.kind() != "TensorType" for r in schema.returns):
        raise Unroutable(f"it returns {', '.join(str(r.type) for r in schema.returns)}")
    n_results = list_results if list_results is not None else len(schema.returns)
    values = bind(node)
    # The ATen node's inputs: (kind, value, places), places being the (argument, list item) pairs the input fills.
    inputs: list[tuple[str, Any, list[tuple[int, int | None]]]] = []
    tensor_input: dict[torch.fx.Node, int] = {}
    lengths: dict[int, int] = {}

    def add_tensor(value: Any, place: tuple[int, int | None], name: str) -> None:
        if not isinstance(value, torch.fx.Node) or not isinstance(_val(value), torch.Tensor):
            raise Unroutable(f"argument {name!r} is not a tensor computed in the graph")
        if value in tensor_input:  # one value twice among an ATen node's inputs breaks ORT's gradient build
            inputs[tensor_input[value]][2].append(place)
            return
        tensor_input[value] = len(inputs)
        inputs.append(("Tensor", value, [place]))

    for k, (a, value) in enumerate(zip(schema.arguments, values, strict=True)):
        if value is None:
            continue  # an optional argument left at None: the wrapper passes None
        t = a.real_type.getElementType() if a.real_type.kind() == "OptionalType" else a.real_type
        if _is_tensor_list(t):
            lengths[k] = len(value)
            for i, item in enumerate(value):
                if item is not None:  # a None item of a Tensor?[] (index_put's x[:, i]): the wrapper puts None there
                    add_tensor(item, (k, i), a.name)
        elif t.kind() == "TensorType":
            add_tensor(value, (k, None), a.name)
        else:
            kind = _kind(t, a.name)
            if isinstance(value, torch.dtype):
                if value not in _SCALAR_TYPES:
                    raise Unroutable(f"argument {a.name!r} is {value}, which the ATen executor cannot pass")
                value = _SCALAR_TYPES[value]
            elif not isinstance(value, bool | int | float | str | list | tuple | torch.fx.Node):
                raise Unroutable(f"argument {a.name!r} is {value!r}, which the ATen executor cannot pass")
            inputs.append((kind, value, [(k, None)]))
    # Floating-point inputs PyTorch differentiates (fractional_max_pool2d's float random_samples it refuses to); a
    # tensor passed as several arguments counts if one of them does.
    floats = {
        v
        for kind, v, places in inputs
        if kind == "Tensor" and _val(v).dtype in FLOAT_DTYPES and any(differentiates(schema, k) for k, _ in places)
    }
    levels = [reach.of(v) if kind == "Tensor" and v in floats else NONE for kind, v, _ in inputs]
    if max(levels, default=NONE) > NONE:
        # ORT builds an ATen node's gradient only when its first input needs one: the surest such input goes first.
        inputs.insert(0, inputs.pop(levels.index(max(levels))))
    # ORT writes the gradient of every input a definition names (<input>_grad), needed or not: a constant gets none.
    float_inputs = tuple(
        j for j, (kind, v, _) in enumerate(inputs) if kind == "Tensor" and v in floats and reach.can_carry(v)
    )
    results = list(val) if isinstance(val, tuple | list) else [val]
    used = _used_outputs(node, n_results)
    differentiable = tuple(
        j for j, r in enumerate(results) if isinstance(r, torch.Tensor) and r.dtype in FLOAT_DTYPES and j in used
    )
    kinds = [kind for kind, _, _ in inputs]
    placement = [tuple(places) for _, _, places in inputs]
    signature = f"{target.name()}|{list(zip(kinds, placement, strict=True))}|{differentiable}|{float_inputs}"
    if any(lengths[k] != sum(1 for places in placement for a, _ in places if a == k) for k in lengths):
        signature += f"|{lengths}"  # None items: the list is longer than its inputs
    if list_results is not None:
        signature += f"|list:{list_results}"
    name = define_wrapper(schema.name, target._overloadname, schema, kinds, placement, signature, lengths, list_results)
    wrapper = op_packet(name).default
    register_vjp_gradient(name, "", wrapper._schema, differentiable, float_inputs, prepare_runtime)
    with _lock:
        if wrapper not in _translations:
            _translations[wrapper] = _translation(name, kinds, n_results)
    node.target = wrapper
    node.args = tuple(v for _, v, _ in inputs)
    node.kwargs = {}
    if list_results == 1:  # the wrapper returns the one tensor itself: its readers read the node
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(node)
                user.graph.erase_node(user)
        node.meta["val"] = val[0]
    return name


def may_need_gradient(node: torch.fx.Node, reach: GradientReach) -> bool:
    """May a gradient flow through the call: does one of its floating-point tensor inputs (or list items) carry one?"""
    return any(reach.of(i) > NONE for i in node.all_input_nodes if isinstance(_val(i), torch.Tensor))


def device_of(node: torch.fx.Node) -> str | None:
    """The device type of the call's first tensor input (None if unknown)."""
    for i in node.all_input_nodes:
        value = _val(i)
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


def _functional_op(target: Any) -> Any:
    """The out-of-place overload of an aten op that updates its first argument in place (``hardswish_.default`` ->
    ``hardswish.default``), else None."""
    schema = target._schema
    name = schema.name.rpartition("::")[2]
    first = schema.arguments[0] if schema.arguments else None
    if target.namespace != "aten" or not name.endswith("_") or first is None or first.alias_info is None:
        return None
    if not first.alias_info.is_write:
        return None
    return getattr(getattr(torch.ops.aten, name[:-1], None), target._overloadname, None)


def _functionalized_op(target: Any) -> Any:
    """``aten.<name>_functional``, the op functionalization replaces a call of ``target`` with when ``target`` writes
    an argument other than its first (``rrelu_with_noise`` writes its noise), else None."""
    if target.namespace != "aten":
        return None
    name = target._schema.name.rpartition("::")[2]
    return getattr(getattr(torch.ops.aten, f"{name}_functional", None), target._overloadname, None)


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def functional_variant(node: torch.fx.Node, position: dict[torch.fx.Node, int] | None = None) -> Any:
    """The out-of-place op of an in-place call (``hardswish_`` -> ``hardswish``, as ``nn.Hardswish(inplace=True)``
    calls it) when the call can be read as it, else None.

    ``torch.export`` keeps in-place calls and makes later reads of the updated tensor read the call's result, so the
    out-of-place op computes the same values, unless the tensor's memory is read again after the call some other
    way: under its old name, through another view of the same memory, or as a graph input.
    """
    functional = _functional_op(node.target)
    updated = node.args[0] if node.args else None
    if functional is None or not isinstance(updated, torch.fx.Node):
        return None
    root = updated
    while _is_view(root) and isinstance(root.args[0], torch.fx.Node):
        root = root.args[0]
    if root.op != "call_function":
        return None  # a graph input (or a constant): its update is part of the program's signature
    order = position if position is not None else {n: i for i, n in enumerate(node.graph.nodes)}
    aliases, stack = {root}, [root]
    while stack:
        for user in stack.pop().users:
            if _is_view(user) and user not in aliases:
                aliases.add(user)
                stack.append(user)
    if any(order[user] > order[node] for alias in aliases for user in alias.users if user is not node):
        return None
    return functional


def route_calls(
    program: torch.export.ExportedProgram,
    module: torch.nn.Module | None,
    decide: Callable[[torch.fx.Node, GradientReach], str | None],
    prepare_runtime: Callable[[], None] = prepare,
) -> list[tuple[str, str]]:
    """Route every call of ``program`` that ``decide(node, reach)`` gives a reason for (:func:`route_call`); returns
    ``(op, reason)`` of each routed call. A call the executor cannot run stays as it is (logged at WARNING)."""
    reach = GradientReach(program, module)
    routed = []
    nodes = list(program.graph_module.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target.namespace == WRAPPER_NAMESPACE:
            continue
        original = node.target
        node.target = (
            functional_variant(node, position) or original
        )  # decided (and routed) as the op it updates in place
        reason = decide(node, reach)
        if reason is None:
            node.target = original
            continue
        name = node.target._schema.name
        try:
            route_call(node, reach, prepare_runtime)
        except Unroutable as e:
            node.target = original
            logger.warning("%s stays as the exporter writes it: the ATen executor cannot run it (%s)", name, e)
            continue
        routed.append((name, reason))
    if routed:
        program.graph_module.recompile()
    return routed


def distinct_aten_inputs(model: Any, context: Any = None) -> int:
    """Give each repeated input of an ATen node its own ``Identity``; returns how many (an ONNX graph pass).

    The exporter's optimizer merges equal values (an LSTM's two zero initial states become one), and one value twice
    among an ATen node's inputs breaks ORT's gradient build (two gradients of one name).
    """
    import onnx

    graph = model.graph
    taken = {name for node in graph.node for name in (*node.input, *node.output)}
    taken.update(v.name for v in graph.input)
    nodes = []
    added = 0
    for node in graph.node:
        if node.op_type == "ATen" and node.domain == ATEN_DOMAIN:
            seen: set[str] = set()
            for k, name in enumerate(node.input):
                if name and name in seen:
                    copy = f"{name}_ortcore_distinct"
                    n = 1
                    while copy in taken:
                        copy, n = f"{name}_ortcore_distinct{n}", n + 1
                    taken.add(copy)
                    nodes.append(onnx.helper.make_node("Identity", [name], [copy], name=f"{copy}_Identity"))
                    node.input[k] = copy
                    added += 1
                seen.add(name)
        nodes.append(node)
    if added:
        del graph.node[:]
        graph.node.extend(nodes)
    return added


# ONNX element types ORT differentiates (float, float16, double, bfloat16).
_GRADIENT_ELEMENT_TYPES = frozenset({1, 10, 11, 16})
# ONNX-domain ops ORT's common-subexpression elimination never merges.
_NONDETERMINISTIC = frozenset({"RandomUniform", "RandomNormal", "RandomUniformLike", "RandomNormalLike", "Multinomial"})
_IDENTITY = ("ai.onnx", "Identity", ())


class _ValueNumbers:
    """A number per value of a graph such that two values ORT's pre-gradient optimizers may merge into one (common
    subexpressions, equal constants) get the same number: graph inputs are distinct; nodes of the ONNX or Microsoft
    domain with the same op, attributes and numbered inputs (in any order) compute the same values; a node of another
    domain (an ATen node) computes values of its own. Merges more than ORT does, never less."""

    def __init__(self, graph: Any):
        from onnx import numpy_helper

        self._numbers: dict[Any, int] = {}
        self.of: dict[str, int] = {"": -1}
        for value in graph.input:
            self.of[value.name] = self._number(("input", value.name))
        for tensor in graph.initializer:
            array = numpy_helper.to_array(tensor)
            digest = hashlib.sha256(array.tobytes()).hexdigest()
            self.of.setdefault(tensor.name, self._number(("constant", str(array.dtype), array.shape, digest)))
        for position, node in enumerate(graph.node):
            inputs = [self.of.setdefault(name, self._number(("unknown", name))) for name in node.input]
            while inputs and inputs[-1] == -1:
                inputs.pop()  # missing optional inputs at the end
            if node.domain in ("", "ai.onnx", "com.microsoft") and node.op_type not in _NONDETERMINISTIC:
                attributes = tuple(sorted((a.name, a.SerializeToString()) for a in node.attribute))
                operation: tuple = (node.domain or "ai.onnx", node.op_type, attributes, tuple(sorted(inputs)))
            else:
                operation = ("node", position)
            for k, name in enumerate(node.output):
                if name:
                    self.of[name] = self._number((*operation, k))

    def _number(self, key: Any) -> int:
        return self._numbers.setdefault(key, len(self._numbers))

    def identity(self, number: int) -> int:
        """The number of an ``Identity`` of a value numbered ``number``."""
        return self._number((*_IDENTITY, (number,), 0))


def _gradient_slots(node: Any, element_types: dict[str, int]) -> list[int]:
    """The inputs of an ATen node whose gradient its definition writes (``<input>_grad``, needed or not): those its
    VJP definition names, or for another definition every input not known to be of a type ORT gives no gradient."""
    attributes = {a.name: a.s.decode() for a in node.attribute if a.name in ("operator", "overload_name")}
    slots = gradient_inputs(gradient_key(attributes.get("operator", ""), attributes.get("overload_name", "")))
    if slots is not None:
        return [k for k in sorted(slots) if k < len(node.input) and node.input[k]]
    return [
        k
        for k, name in enumerate(node.input)
        if name and element_types.get(name, 1) in _GRADIENT_ELEMENT_TYPES  # unknown: maybe
    ]


def separate_shared_aten_inputs(model: Any, context: Any = None) -> int:
    """Give every ATen node input whose gradient the node's definition writes a value no other such input has, also
    after ORT's optimizers merge equal values; returns how many ``Identity`` nodes it added (an ONNX graph pass, for
    both exporters; running it again adds none).

    ORT writes an ATen node's input gradients under the inputs' names (``<value>_grad``), also for a value that needs
    no gradient in this build (a buffer, an input without ``requires_grad``, a frozen parameter), and sums only the
    gradients of values it differentiates: two ATen nodes reading one such value define its gradient twice ("Duplicate
    definition of name"). Which values need gradients is decided per build (freezing a parameter does not export
    again), so every shared value is separated: an ``Identity``'s gradient passes a needed gradient on unchanged, and
    ORT sums the gradients of a value it differentiates. ORT merges common subexpressions before it builds gradients
    (two ``Identity`` nodes of one value, two ``ConstantOfShape`` of one shape), so values are compared as it may merge
    them (:class:`_ValueNumbers`), and an input whose value an earlier one has reads a chain of ``Identity`` nodes that
    no merge makes a value another such input reads.
    """
    import onnx

    graph = model.graph
    taken = {name for node in graph.node for name in (*node.input, *node.output)}
    taken.update(v.name for v in graph.input)
    element_types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*graph.input, *graph.value_info, *graph.output)
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
    }
    element_types.update((t.name, t.data_type) for t in graph.initializer)
    numbers = _ValueNumbers(graph)
    read: set[int] = set()  # the value numbers such inputs read so far
    copies: dict[str, str] = {}  # the Identity nodes added: input -> output
    nodes = []
    for node in graph.node:
        if node.op_type == "ATen" and node.domain == ATEN_DOMAIN:
            for k in _gradient_slots(node, element_types):
                value, number = node.input[k], numbers.of[node.input[k]]
                while number in read:
                    number = numbers.identity(number)
                    if value not in copies:
                        copy = f"{node.input[k]}_ortcore_shared"
                        n = 1
                        while copy in taken:
                            copy, n = f"{node.input[k]}_ortcore_shared{n}", n + 1
                        taken.add(copy)
                        nodes.append(onnx.helper.make_node("Identity", [value], [copy], name=f"{copy}_Identity"))
                        copies[value] = copy
                    value = copies[value]
                read.add(number)
                node.input[k] = value
        nodes.append(node)
    if copies:
        del graph.node[:]
        graph.node.extend(nodes)
    return len(copies)


# -- translations -----------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_translations: dict[Any, Callable[..., Any]] = {}


def translations() -> dict[Any, Callable[..., Any]]:
    """``{wrapper overload: onnxscript translation}`` of every wrapper routed so far (``ortcore_export_translations``);
    the same function objects each time, so two plugins may offer them."""
    with _lock:
        return dict(_translations)


_ATEN_TYPES = [
    "tensor(float)",
    "tensor(double)",
    "tensor(float16)",
    "tensor(bfloat16)",
    "tensor(int64)",
    "tensor(int32)",
    "tensor(int16)",
    "tensor(int8)",
    "tensor(uint8)",
    "tensor(bool)",
    "tensor(string)",
]


@functools.cache
def aten_op(n_outputs: int) -> Any:
    """The onnxscript op writing an ``org.pytorch.aten::ATen`` node with ``n_outputs`` outputs (onnxscript knows
    ATen's schema only from us; the recorder gives a node as many outputs as its schema lists)."""
    import onnxscript
    from onnx.defs import OpSchema

    variadic = OpSchema.FormalParameterOption.Variadic
    return onnxscript.values.Op(
        onnxscript.values.Opset(ATEN_DOMAIN, 1),
        "ATen",
        OpSchema(
            "ATen",
            ATEN_DOMAIN,
            1,
            inputs=[OpSchema.FormalParameter("inputs", "T", param_option=variadic, is_homogeneous=False)],
            outputs=[OpSchema.FormalParameter(f"output_{j}", f"T{j}") for j in range(n_outputs)],
            type_constraints=[("T", _ATEN_TYPES, ""), *((f"T{j}", _ATEN_TYPES, "") for j in range(n_outputs))],
            attributes=[
                OpSchema.Attribute("operator", OpSchema.AttrType.STRING, ""),
                OpSchema.Attribute("overload_name", OpSchema.AttrType.STRING, ""),
            ],
        ),
    )


def onnx_input(kind: str, value: Any) -> Any:
    """One input of the ATen node: a tensor (or a value the graph computes, such as a size) as it is, a constant
    argument as the small tensor the executor converts back (strings as UTF-8 bytes, floats in double)."""
    import numpy as np
    from onnxscript import ir
    from onnxscript import opset18 as op

    def constant(array: Any) -> Any:
        return op.Constant(value=ir.tensor(array))

    if isinstance(value, ir.Value):
        return value
    if kind.endswith("[]"):
        dtype = {"int[]": np.int64, "SymInt[]": np.int64, "float[]": np.float64, "bool[]": np.bool_}[kind]
        if any(isinstance(v, ir.Value) for v in value):  # symbolic sizes among the items
            one = constant(np.array([1], dtype=np.int64))
            parts = [
                op.Reshape(v, one) if isinstance(v, ir.Value) else constant(np.array([v], dtype=dtype)) for v in value
            ]
            return op.Concat(*parts, axis=0)
        return constant(np.array(list(value), dtype=dtype))
    if kind == "str":
        return constant(np.frombuffer(value.encode("utf-8"), dtype=np.uint8).copy())
    if isinstance(value, bool):
        return constant(np.array(value, dtype=np.bool_))
    if isinstance(value, int) and kind != "float":
        return constant(np.array(value, dtype=np.int64))
    return constant(np.array(float(value), dtype=np.float64))


def _translation(operator_name: str, kinds: list[str], n_outputs: int) -> Callable[..., Any]:
    aten = aten_op(n_outputs)

    def translate(*args: Any) -> Any:
        inputs = [onnx_input(kind, value) for kind, value in zip(kinds, args, strict=True)]
        return aten(*inputs, operator=operator_name, overload_name="")

    translate.__name__ = f"aten_{operator_name.rpartition('::')[2]}"
    return translate
