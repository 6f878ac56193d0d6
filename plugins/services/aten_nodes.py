"""The ATen node service: export a PyTorch op as one ``org.pytorch.aten::ATen`` node, with a gradient ORT can build.

Used from TorchScript symbolics (``aten_fallback``'s unexportable-op fallback, ``op_routing``'s routes):

* :func:`aten_node` emits the node, its outputs typed as traced; :func:`constant_argument` turns a non-tensor
  argument into the graph value the executor (:mod:`ortcore_plugins.services.aten_executor`) converts back;
* :func:`register_vjp_gradient` gives the op a gradient definition: one helper op per floating-point tensor input
  that can carry a gradient, ``ortcore_aten::fallback_grad__<op>__<overload>__<i>``, that re-runs the op under
  ``torch.autograd`` on the forward inputs and returns the vector-Jacobian product for input i (ORT keeps one output
  per gradient node). Integer outputs take no gradient; integer tensor inputs and constants get none either
  (:func:`gradient_inputs` says which inputs a definition writes a gradient of);
* :func:`define_wrapper`: the ``ortcore_route::`` wrapper op a routed call is exported as (an input that needs a
  gradient first, tensor lists spread, views copied), shared by both exporters' routes (the dynamo route's side is
  :mod:`ortcore_plugins.services.aten_program`);
* :func:`guard_runs`, from a plugin's ``ortcore_session_plan``: the executor's run guard, and the VJP results shared
  between a node's helpers cleared at every run boundary.

Gradient definitions are lists of :data:`NodeSpec` (:func:`gradient_node`), registered with ORT under
:func:`gradient_key` (ORT keeps the first registration of a key in a process). Helper ops live in one
``torch.library`` namespace, :data:`HELPER_NAMESPACE` (:func:`helper_library`).

Call :func:`prepare` (or a plugin's own preparation that includes it) before ORT builds a graph with such nodes, and
run :func:`type_aten_outputs` over the exported graph: ORT cannot infer an ATen node's output types.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ortcore.api import ATEN_DOMAIN, graph_autocast

from . import aten_executor

if TYPE_CHECKING:
    import onnx

    from ortcore.api import PassContext

# The torch.library namespace of the helper ops gradient definitions use.
HELPER_NAMESPACE = "ortcore_aten"
# TorchScript scalar types that carry a gradient.
FLOAT_TYPES = ("Float", "Double", "Half", "BFloat16")


# -- gradient definitions -------------------------------------------------------------------------------------------
#
# Each definition is a list of nodes (op_type or (op_type, domain), inputs, outputs, attributes). Inputs name
# GO(i) (gradient of forward output i), I(i) and O(i) (forward input/output i); outputs name GI(i) (gradient of
# forward input i). Definitions are keyed by "org.pytorch.aten::ATen::<operator>::<overload>" and the first
# registration of a key in a process wins.

NodeSpec = tuple[Any, list[str], list[str], dict[str, dict[str, Any]]]


def gradient_node(operator: str, inputs: list[str], output: str) -> NodeSpec:
    """One ATen node of a gradient definition running ``operator``, e.g.
    ``gradient_node("gelu_backward", ["GO(0)", "I(0)", "I(1)"], "GI(0)")``."""
    return (("ATen", ATEN_DOMAIN), inputs, [output], {"operator": {"value": operator, "dtype": "string"}})


def helper_op(name: str) -> str:
    """The operator name of helper op ``name`` of :data:`HELPER_NAMESPACE`, as ATen nodes name it."""
    return f"{HELPER_NAMESPACE}::{name}"


def gradient_key(operator: str, overload: str = "") -> str:
    """The key ORT registers the gradient definition of an ATen node running ``operator.overload`` under."""
    return f"{ATEN_DOMAIN}::ATen::{operator}::{overload}"


def to_gradient_definition(nodes: list[NodeSpec]) -> list[Any]:
    """``nodes`` as the ``GradientNodeDefinition`` list ``register_gradient_definition`` takes."""
    from onnxruntime.capi import _pybind_state as C

    definition = []
    for op_type, inputs, outputs, attributes in nodes:
        node = C.GradientNodeDefinition()
        node.op_type, node.domain = (op_type, "") if isinstance(op_type, str) else op_type
        node.inputs, node.outputs = inputs, outputs
        attrs_ = []
        for name, spec in attributes.items():
            attribute = C.GradientNodeAttributeDefinition()
            attribute.name = name
            attribute.value_json = json.dumps(spec["value"])
            attribute.dtype = spec["dtype"]
            attribute.is_tensor = spec.get("is_tensor", False)
            attrs_.append(attribute)
        node.attributes = attrs_
        definition.append(node)
    return definition


_library: torch.library.Library | None = None
_library_lock = threading.Lock()


def helper_library() -> torch.library.Library:
    """The one ``torch.library`` fragment of :data:`HELPER_NAMESPACE` (created on first use): plugins define their
    helper ops in it, and the executor resolves them by schema, as aten ops."""
    global _library
    with _library_lock:
        if _library is None:
            _library = torch.library.Library(HELPER_NAMESPACE, "FRAGMENT")
        return _library


def prepare() -> None:
    """What a graph with ATen nodes needs before ORT builds it: the helper library and the ATen executor."""
    helper_library()
    aten_executor.install()


# -- TorchScript values ---------------------------------------------------------------------------------------------


def constant(g: Any, value: Any, dtype: torch.dtype) -> Any:
    """A ``Constant`` node holding ``value`` as a tensor of ``dtype``."""
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def string_constant(g: Any, text: str) -> Any:
    """``text`` as a graph value: the executor decodes uint8 tensors into the str arguments of the op's schema."""
    return constant(g, list(text.encode("utf-8")), torch.uint8)


def is_none(value: Any) -> bool:
    """Whether a traced argument is missing (None, or the exporter's none value)."""
    from torch.onnx import symbolic_helper as sh

    return value is None or sh._is_none(value)


def is_string_constant(value: Any) -> bool:
    """Whether a traced value is a string constant."""
    node = value.node()
    return (
        node.kind() in ("prim::Constant", "onnx::Constant")
        and node.hasAttribute("value")
        and (node.kindOf("value") == "s")
    )


def requires_grad(value: Any) -> bool | None:
    """Whether the traced value requires grad (None if the exporter does not know)."""
    from torch.onnx import symbolic_helper as sh

    if value is None or sh._is_none(value):
        return False
    try:
        return value.type().requires_grad()
    except (AttributeError, RuntimeError):
        return None


def schema_type(t: Any, op: str, name: str) -> str:
    """A schema argument type as text for a helper op's schema (the executor converts each from a tensor); a
    ``TypeError`` names the op and argument the executor cannot pass."""
    kind = t.kind()
    if kind == "OptionalType":
        return f"{schema_type(t.getElementType(), op, name)}?"
    if kind == "ListType":
        element = schema_type(t.getElementType(), op, name)
        if element not in ("int", "float", "bool"):
            raise TypeError(f"{op}: argument {name!r} is a list of {element}, which the ATen executor cannot pass")
        return f"{element}[]"
    simple = {
        "TensorType": "Tensor",
        "IntType": "int",
        "SymIntType": "int",
        "FloatType": "float",
        "BoolType": "bool",
        "NumberType": "Scalar",
        "StringType": "str",
        "ScalarTypeType": "int",
        "LayoutType": "int",
        "MemoryFormatType": "int",
    }.get(kind)
    if simple is None:
        raise TypeError(f"{op}: argument {name!r} has type {t}, which the ATen executor cannot pass")
    return simple


def op_packet(operator: str) -> Any:
    """``torch.ops.<namespace>.<name>`` of ``operator`` (``name`` alone is an aten op)."""
    namespace, _, name = operator.rpartition("::")
    return getattr(getattr(torch.ops, namespace or "aten"), name)


def constant_argument(g: Any, value: Any, kind: str, op: str, name: str) -> Any:
    """A non-tensor argument of the op as a graph value: a Constant when it is known at export, else the value."""
    from torch.onnx import symbolic_helper as sh

    if sh._is_none(value):
        return value  # a missing optional input: the executor passes None (or the schema default)
    base = kind.rstrip("?")
    if not sh._is_constant(value):
        return value  # computed in the graph (a size, say): the executor reads it from the tensor
    if base == "str":
        return string_constant(g, sh._get_const(value, "s", name))
    if base in ("int[]", "float[]", "bool[]"):
        items = sh._get_const(value, "is" if base == "int[]" else "fs" if base == "float[]" else "is", name)
        dtype = {"int[]": torch.int64, "float[]": torch.float64, "bool[]": torch.bool}[base]
        return constant(g, list(items), dtype)
    number = sh._maybe_get_const(value, "t")
    if isinstance(number, torch.Tensor):
        number = number.item()
    if base == "bool":
        return constant(g, bool(number), torch.bool)
    if base == "float" or (base == "Scalar" and isinstance(number, float)):
        return constant(g, float(number), torch.float64)
    if isinstance(number, bool):
        return constant(g, number, torch.bool)
    return constant(g, int(number), torch.int64)


def aten_node(g: Any, operator: str, overload: str, inputs: list[Any], outputs_traced: list[Any]) -> Any:
    """One ATen node running ``operator``, its outputs typed as traced: element type and rank, every dimension
    unknown (the op decides its output shape; ORT cannot infer an ATen node's types)."""
    results = g.op(
        f"{ATEN_DOMAIN}::ATen", *inputs, operator_s=operator, overload_name_s=overload, outputs=len(outputs_traced)
    )
    results = list(results) if len(outputs_traced) > 1 else [results]
    for result, traced in zip(results, outputs_traced, strict=True):
        t = traced.type()
        sizes = t.varyingSizes()
        result.setType(
            t.with_sizes([None] * len(sizes)) if sizes is not None else torch._C.TensorType.get().with_dtype(t.dtype())
        )
    return results[0] if len(results) == 1 else tuple(results)


# -- VJP gradients ----------------------------------------------------------------------------------------------------


def _grad_helper_name(operator: str, overload: str, index: int) -> str:
    return f"fallback_grad__{operator.replace('::', '__')}__{overload or 'default'}__{index}"


# Gradients of one backward run, computed once for every input of a node (see make_vjp); cleared around each run.
# Each entry also holds the node's arguments: while it exists their buffers cannot be reused, so a key (buffer
# addresses) that matches is the same tensors.
_vjp_results: dict[tuple, tuple[list[Any], dict[int, torch.Tensor]]] = {}


def clear_vjp_results() -> None:
    """Forget gradients computed for other helper nodes: called before each ORT run (buffers are then reused)."""
    _vjp_results.clear()


def _tensor_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("t", value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, list):
        return tuple(_tensor_key(v) for v in value)
    return value


def shared_gradient(
    owner: Any, values: list[Any], index: int, compute: Callable[[], dict[int, torch.Tensor]]
) -> torch.Tensor:
    """The gradient ``index`` of an op whose gradients ORT asks for one helper node at a time.

    The first helper node to run calls ``compute()`` once for all of the op's gradients (``{input index: tensor}``)
    and leaves the others for their nodes, keyed by ``owner`` and the arguments' buffers (``values``, held by the
    entry so the key stays theirs); they are cleared around every run (:func:`clear_vjp_results`).
    """
    key = (owner, _tensor_key(list(values)))
    entry = _vjp_results.get(key)
    if entry is not None and index in entry[1]:
        result = entry[1].pop(index)
        if not entry[1]:
            _vjp_results.pop(key, None)  # another thread's run boundary may have cleared it already
        return result
    gradients = compute()
    mine = gradients.pop(index)
    if gradients:
        _vjp_results[key] = (list(values), gradients)
    return mine


def make_vjp(
    overload_packet: Any,
    schema: Any,
    n_grads: int,
    differentiable: tuple[int, ...],
    index: int,
    float_inputs: tuple[int, ...] = (),
) -> Callable[..., torch.Tensor]:
    """The helper's implementation: d(op outputs)/d(input ``index``), applied to the output gradients.

    ORT keeps one output per gradient node, so an op with several floating-point inputs has one helper node per
    input. The first of them to run differentiates the op once with respect to all of them and leaves the other
    gradients for their nodes (keyed by the arguments' buffers): one recomputed forward and one backward per op and
    step, not one per input (a 2-layer bidirectional GRU has 18).
    """
    names = [a.name for a in schema.arguments]
    kwarg_only = {a.name for a in schema.arguments if a.kwarg_only}
    targets = tuple(float_inputs) if index in float_inputs and len(float_inputs) > 1 else (index,)

    def vjp(*values: Any) -> torch.Tensor:
        grads, args = values[:n_grads], list(values[n_grads:])

        def compute() -> dict[int, torch.Tensor]:
            present = [i for i in targets if isinstance(args[i], torch.Tensor)]
            with torch.enable_grad():
                leaves = {}
                for i in present:
                    leaves[i] = args[i].detach().requires_grad_(True)
                    args[i] = leaves[i]
                positional = [v for n, v in zip(names, args, strict=True) if n not in kwarg_only]
                keywords = {n: v for n, v in zip(names, args, strict=True) if n in kwarg_only}
                result = overload_packet(*positional, **keywords)
                results = result if isinstance(result, tuple | list) else (result,)
                outputs = [results[i] for i in differentiable]
                pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None]
                computed: tuple[torch.Tensor | None, ...] = (None,) * len(present)
                if pairs:
                    computed = torch.autograd.grad(
                        [o for o, _ in pairs],
                        [leaves[i] for i in present],
                        [g.expand_as(o) for o, g in pairs],
                        allow_unused=True,
                    )
            return {i: torch.zeros_like(leaves[i]) if g is None else g for i, g in zip(present, computed, strict=True)}

        if len(targets) == 1:
            return compute()[index]
        return shared_gradient(id(overload_packet), list(values), index, compute)

    return vjp


_vjp_lock = threading.Lock()
_vjp_gradients: set[tuple[str, str]] = set()
# Which inputs each registered VJP gradient definition writes a gradient of, by gradient key.
_gradient_inputs: dict[str, frozenset[int]] = {}


def gradient_inputs(key: str) -> frozenset[int] | None:
    """The inputs whose gradient (``<input>_grad``) the VJP gradient definition registered under ``key`` writes, or
    None for a key :func:`register_vjp_gradient` did not register (another definition, or none)."""
    with _vjp_lock:
        return _gradient_inputs.get(key)


def register_vjp_gradient(
    operator: str,
    overload: str,
    schema: Any,
    differentiable: tuple[int, ...],
    float_inputs: tuple[int, ...],
    prepare_runtime: Callable[[], None] = prepare,
) -> None:
    """Define the VJP helper ops of ``<operator>.<overload>`` and register its gradient definition (once a process).

    ``differentiable`` are the outputs that get a gradient, ``float_inputs`` the inputs that do; the other tensor
    inputs become stop-gradient edges. ``prepare_runtime`` runs first (under this function's lock): :func:`prepare`,
    or a plugin's preparation that includes it.
    """
    from onnxruntime.capi import _pybind_state as C

    with _vjp_lock:
        if (operator, overload) in _vjp_gradients:
            return
        prepare_runtime()
        library = helper_library()
        packet = getattr(op_packet(operator), overload or "default")
        grad_args = [f"Tensor? grad_{j}" for j in range(len(differentiable))]
        arguments = [f"{schema_type(a.type, operator, a.name)} {a.name}" for a in schema.arguments]
        nodes: list[NodeSpec] = []
        for i in float_inputs:
            name = _grad_helper_name(operator, overload, i)
            # CompositeImplicitAutograd: the kernel is called above autograd, so it can record and differentiate.
            library.define(f"{name}({', '.join([*grad_args, *arguments])}) -> Tensor")
            library.impl(
                name,
                make_vjp(packet, schema, len(differentiable), differentiable, i, float_inputs),
                "CompositeImplicitAutograd",
            )
            inputs = [f"GO({j})" for j in differentiable] + [f"I({k})" for k in range(len(schema.arguments))]
            nodes.append(gradient_node(helper_op(name), inputs, f"GI({i})"))
        key = gradient_key(operator, overload)
        if nodes:
            C.register_gradient_definition(key, to_gradient_definition(nodes))
        _gradient_inputs[key] = frozenset(float_inputs)
        tensor_inputs = {
            k for k, a in enumerate(schema.arguments) if schema_type(a.type, operator, a.name) in ("Tensor", "Tensor?")
        }
        stopped = tensor_inputs - set(float_inputs)
        if stopped:
            C.register_custom_stop_gradient_edges(key, stopped)
        _vjp_gradients.add((operator, overload))


# -- wrapper ops ------------------------------------------------------------------------------------------------------
#
# ORT 1.19.2 builds an ATen node's gradient only when its first input needs one, and its executor passes tensors one
# by one. A call is therefore exported as a *wrapper op* of WRAPPER_NAMESPACE, defined once per call signature: its
# inputs are the call's arguments in the order the node needs (an input that needs a gradient first), a tensor list
# (einsum's operands, an RNN's weights) spread over separate inputs, one tensor given once however many arguments it
# fills; it calls the op and copies any output that is a view of an input (ORT owns what the executor hands back).

WRAPPER_NAMESPACE = "ortcore_route"

_wrapper_lock = threading.Lock()
_wrapper_library: torch.library.Library | None = None
_wrappers: dict[str, str] = {}  # wrapper name -> its schema text


def define_wrapper(
    op: str,
    overload: str,
    schema: Any,
    kinds: list[str],
    placement: list[tuple[tuple[int, int | None], ...]],
    signature: str,
    list_lengths: dict[int, int] | None = None,
    list_results: int | None = None,
) -> str:
    """Define (once) and name the wrapper op of one call signature of ``op`` (``gru``, ``aten::gru``,
    ``transformers::grouped_mm_fallback``) at ``overload``, whose ``schema`` is ``schema``.

    Wrapper input ``k`` has schema type ``kinds[k]`` and fills ``placement[k]``: ``(argument, item)`` pairs, the index
    of a schema argument and, for a tensor list, the index in the list (None for a plain argument). Arguments no
    input fills are left at None, and so are the items of a tensor list (argument ``k``, ``list_lengths[k]`` items
    long) no input fills (None indices of ``index_put``). An op returning a tensor list (``Tensor[]``: ``split``,
    ``unbind``, ``broadcast_tensors``) returns ``list_results`` tensors, as a tuple (an ATen node has a fixed number
    of outputs; the traced call says how many). ``signature`` (text) tells call signatures apart: the
    wrapper is named ``<op>__<overload>__<hash of signature>``, so its gradient definition (one per name and process)
    fits the call.
    """
    global _wrapper_library
    short = op.rpartition("::")[2]
    name = f"{short}__{overload or 'default'}__{hashlib.sha1(signature.encode()).hexdigest()[:10]}"
    with _wrapper_lock:
        if name in _wrappers:
            return f"{WRAPPER_NAMESPACE}::{name}"
        if _wrapper_library is None:
            _wrapper_library = torch.library.Library(WRAPPER_NAMESPACE, "FRAGMENT")
        arguments = [f"{kind} a{position}" for position, kind in enumerate(kinds)]
        returns = [str(r.type) for r in schema.returns]
        if list_results is not None:
            returns = ["Tensor"] * list_results
        returns_text = returns[0] if len(returns) == 1 else f"({', '.join(returns)})"
        text = f"({', '.join(arguments)}) -> {returns_text}"
        packet = getattr(op_packet(op), overload or "default")
        n_args = len(schema.arguments)
        kwarg_only = [a.kwarg_only for a in schema.arguments]
        targets = [tuple(p) for p in placement]
        lengths = dict(list_lengths or {})

        def call(*values: Any) -> Any:
            args: list[Any] = [None] * n_args
            lists: dict[int, dict[int, Any]] = {}
            for places, value in zip(targets, values, strict=True):
                for argument, item in places:
                    if item is None:
                        args[argument] = value
                    else:
                        lists.setdefault(argument, {})[item] = value
            for argument, items in lists.items():
                args[argument] = [items.get(i) for i in range(max(lengths.get(argument, 0), max(items) + 1))]
            positional = [v for v, kw in zip(args, kwarg_only, strict=True) if not kw]
            keywords = {a.name: v for a, v, kw in zip(schema.arguments, args, kwarg_only, strict=True) if kw}
            # Under the autocast state the graph was traced under (none: nothing entered): a call traced whole under
            # autocast (aten::lstm, whose bf16 kernel autocast chose inside the op) returns the types it was traced
            # with, and its gradient (the VJP calls this wrapper again) is autocast's.
            with graph_autocast():
                result = packet(*positional, **keywords)
            if list_results is not None and len(result) != list_results:
                raise RuntimeError(
                    f"{op} returned {len(result)} tensors where the graph was exported with {list_results} (the "
                    "length of its list result changed with the inputs' sizes)"
                )
            if list_results == 1:
                result = result[0]
            # ORT owns what the executor hands back: an output sharing an input's memory (a view) is copied.
            if isinstance(result, tuple | list):
                return tuple(r.clone() if r._is_view() else r for r in result)
            return result.clone() if result._is_view() else result

        _wrapper_library.define(f"{name}{text}")
        # CompositeImplicitAutograd: the call decomposes into the op, so autograd differentiates it.
        _wrapper_library.impl(name, call, "CompositeImplicitAutograd")
        _wrappers[name] = text
    return f"{WRAPPER_NAMESPACE}::{name}"


# -- runs -----------------------------------------------------------------------------------------------------------


def guard_runs(graph: Any, plan: Any) -> None:
    """From a plugin's ``ortcore_session_plan``: executor failures in a graph with ATen nodes are raised from the run
    that hit them, naming the op (:func:`aten_executor.guard_runs`), and VJP results never outlive a run."""
    aten_executor.on_run_boundary(clear_vjp_results)
    aten_executor.guard_runs(graph, plan)


# -- the exported graph -----------------------------------------------------------------------------------------------


def _invented(dim: onnx.TensorShapeProto.Dimension) -> bool:
    # The exporter names an ATen output's dynamic dimensions "ATen<output>_dim_<i>"; ONNX inference copies them on.
    return dim.HasField("dim_param") and dim.dim_param.startswith("ATen")


def type_aten_outputs(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Make the types around ATen nodes usable by ORT; returns how many graph output types were recorded.

    * Dynamic dimensions of ATen outputs lose the names the exporter invented for them: two differently named
      dimensions are two different sizes to ORT's gradient builder, which then plans broadcasting gradients that do
      not exist (or fails to). Unknown dimensions make it use its dynamic (shape-reading) path.
    * Graph output types are also recorded as value_info. ORT turns graph outputs into inputs of its YieldOp and drops
      their types; it cannot infer an ATen output's type, so a graph output made by an ATen node (a loss; logits once
      ORT removed a no-op Cast) would fail the session without it.
    """
    graph = model.graph
    aten_outputs = {name for n in graph.node if n.op_type == "ATen" and n.domain == ATEN_DOMAIN for name in n.output}
    for value in (*graph.value_info, *graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if _invented(dim) or (value.name in aten_outputs and dim.HasField("dim_param")):
                dim.ClearField("dim_param")
    known = {v.name for v in graph.value_info}
    recorded = 0
    for output in graph.output:
        if output.name not in known and output.type.HasField("tensor_type"):
            graph.value_info.add().CopyFrom(output)
            recorded += 1
    return recorded
