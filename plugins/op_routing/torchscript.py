"""The TorchScript route of op routing: symbolics that export a routed call as one ATen node (the routes' conditions
read from the traced call, :data:`TRACED_CALLS`), the symbolics that take over an op the exporter failed on, and the
tracing mode that writes ``as_strided`` and ``embedding(max_norm=...)`` exactly.

Everything the TorchScript exporter alone needs is here: without that exporter, this module goes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import onnx
import torch

from ortcore.api import UnsupportedModelError
from ortcore_plugins.services import aten_nodes, routed_calls
from ortcore_plugins.services.aten_nodes import (
    FLOAT_TYPES,
    aten_node,
    constant_argument,
    define_wrapper,
    is_none,
    is_string_constant,
    op_packet,
    register_vjp_gradient,
)
from ortcore_plugins.services.torch_kernels import prepare_runtime

from . import shared
from .shared import (
    AS_STRIDED_REASON,
    PACKED_REASON,
    PACKED_RNN_OPS,
    RENORM_OP,
    RENORM_REASON,
    ROUTE_REASONS,
    ROUTES,
    Route,
    _gap_error,
    _note_routed,
    _reads,
    logger,
    renorm_op,
    storage_order,
)

EXPORTER_GAP = "the TorchScript exporter has no ONNX symbolic for it"


# -- which calls a route applies to --------------------------------------------------------------------------------


def _const(args: tuple, schema: Any, name: str) -> Any:
    """The constant value of argument ``name`` of a traced call (None if it is not a constant)."""
    from torch.onnx import symbolic_helper as sh

    names = [a.name for a in schema.arguments]
    if name not in names:
        return None
    value = args[names.index(name)]
    if is_none(value) or not sh._is_constant(value):
        return None
    result = sh._maybe_get_const(value, "t")
    return result.item() if isinstance(result, torch.Tensor) and result.numel() == 1 else result


def _is_bidirectional(args: tuple, schema: Any) -> bool:
    return bool(_const(args, schema, "bidirectional"))


def _is_packed(args: tuple, schema: Any) -> bool:
    """An RNN over a packed sequence (the ``data`` overload: data and batch sizes)."""
    return schema.overload_name == "data"


def _rnn_routed(args: tuple, schema: Any) -> bool:
    return _is_packed(args, schema) or _is_bidirectional(args, schema)


def _is_transposed(args: tuple, schema: Any) -> bool:
    return bool(_const(args, schema, "transposed"))


def _is_reduction(args: tuple, schema: Any) -> bool:
    """``max``/``min`` over the whole tensor or a dim (ReduceMax/ReduceMin), not the binary ``max.other``."""
    return schema.overload_name != "other"


def _is_grouped_query(args: tuple, schema: Any) -> bool:
    return bool(_const(args, schema, "enable_gqa"))


def _accumulates(args: tuple, schema: Any) -> bool:
    """``index_put(..., accumulate=True)``: repeated indices must add up (an unknown flag is taken as set)."""
    value = _const(args, schema, "accumulate")
    return value is None or bool(value)


def _repeats_tensor(args: tuple, schema: Any) -> bool:
    """``repeat_interleave`` with a tensor of repeats (a Loop in the export), not an int."""
    return schema.overload_name in ("Tensor", "self_Tensor")


def _on_integers(args: tuple, schema: Any) -> bool:
    """The call's first tensor is an integer tensor."""
    for value in args:
        if value is None or is_none(value) or routed_calls.is_list(value):
            continue
        try:
            t = value.type()
            if t.kind() == "TensorType" and t.scalarType() is not None:
                return t.scalarType() not in FLOAT_TYPES
        except (AttributeError, RuntimeError):
            continue
    return False


def _rounds(args: tuple, schema: Any) -> bool:
    """``div(..., rounding_mode=...)`` (Floor or Sign in the export, which ORT cannot differentiate)."""
    return schema.overload_name in ("Tensor_mode", "Scalar_mode") and _const(args, schema, "rounding_mode") is not None


def _string(args: tuple, schema: Any, name: str) -> str | None:
    """The constant string argument ``name`` of a traced call (None if absent or not a constant)."""
    from torch.onnx import symbolic_helper as sh

    names = [a.name for a in schema.arguments]
    if name not in names:
        return None
    value = args[names.index(name)]
    if is_none(value) or not is_string_constant(value):
        return None
    return sh._get_const(value, "s", name)


def _pads_by_mode(args: tuple, schema: Any) -> bool:
    """``F.pad`` with a mode other than constant (reflect, replicate, circular)."""
    return _string(args, schema, "mode") not in (None, "constant")


def _norm_ort_cannot_differentiate(args: tuple, schema: Any) -> bool:
    """A vector norm ORT cannot differentiate: ord 1, 0 or ±inf (ReduceL1, ReduceMax), or ord 2 without keepdim."""
    order = _const(args, schema, "ord")
    order = 2 if order is None else float(order)
    return order in (0.0, 1.0, float("inf"), float("-inf")) or (order == 2 and not _const(args, schema, "keepdim"))


# Which calls of a route's op the route applies to, read from the traced call (arguments, matched schema); a route
# not named here applies to every call of its op.
TRACED_CALLS: dict[str, Callable[[tuple, Any], bool]] = {
    "max": _is_reduction,
    "min": _is_reduction,
    "gru": _rnn_routed,
    "lstm": _rnn_routed,
    "_convolution": _is_transposed,
    "scaled_dot_product_attention": _is_grouped_query,
    "index_put": _accumulates,
    "repeat_interleave": _repeats_tensor,
    "floor_divide": _on_integers,
    "div": _rounds,
    "logsumexp": lambda args, schema: not _const(args, schema, "keepdim"),
    "pad": _pads_by_mode,
    "linalg_vector_norm": _norm_ort_cannot_differentiate,
}


# -- the routing symbolic ------------------------------------------------------------------------------------------


def _kind_fits(argument: Any, value: Any, strict: bool = False) -> bool:
    t = argument.type
    if t.kind() == "OptionalType":
        if is_none(value):
            return True
        t = t.getElementType()
    elif is_none(value):
        return argument.has_default_value()
    if t.kind() == "ListType" and t.getElementType().kind() == "TensorType":
        return routed_calls.is_list(value)
    if t.kind() == "StringType":
        return is_string_constant(value)
    rank = _constant_rank(value)
    if t.kind() in ("IntType", "SymIntType", "FloatType", "BoolType") and rank is not None and (rank > 0 or strict):
        # A list of numbers is no number (tensor_split's indices [2, 5] or [1] are not its sections): a constant
        # list is 1-D, a number 0-D; a one-element list fits a number only when no overload takes a list.
        if rank > 1 or strict or _constant_numel(value) != 1:
            return rank == 0
    return not routed_calls.is_list(value) or t.kind() == "ListType"


def _constant_tensor(value: Any) -> torch.Tensor | None:
    try:
        node = value.node()
        if node.kind() not in ("onnx::Constant", "prim::Constant") or node.kindOf("value") != "t":
            return None
        return node.t("value")
    except (AttributeError, RuntimeError):
        return None


def _constant_rank(value: Any) -> int | None:
    """The rank of a constant traced tensor (None if the value is not one)."""
    tensor = _constant_tensor(value)
    return None if tensor is None else tensor.dim()


def _constant_numel(value: Any) -> int | None:
    tensor = _constant_tensor(value)
    return None if tensor is None else tensor.numel()


def match_overload(op: str, args: tuple, node: Any = None) -> Any:
    """The schema of the ``aten::<op>`` overload a traced call used: the one the traced ``node`` names, else the
    first whose argument count, tensor lists and strings fit (``gru.input`` and ``gru.data`` both take nine
    arguments; ``repeat_interleave.self_int`` and ``.self_Tensor`` are told apart only by the node). ``op`` may be
    another library's ``<namespace>::<op>``."""
    packet = op_packet(op)

    def fits(schema: Any, strict: bool = False) -> bool:
        return (
            not schema.is_mutable
            and len(schema.arguments) == len(args)
            and all(_kind_fits(a, v, strict) for a, v in zip(schema.arguments, args, strict=True))
        )

    named = _node_overload(node)
    # The exporter's copy of the node may name an out= overload of the same arity (max.out for max.dim): checked too.
    if named is not None and named in packet.overloads() and fits(getattr(packet, named)._schema):
        return getattr(packet, named)._schema
    names = sorted(packet.overloads(), key=lambda n: n != "default")
    # First an overload whose numbers are 0-D constants, then any that takes the arguments.
    for strict in (True, False):
        for name in names:
            if fits(getattr(packet, name)._schema, strict):
                return getattr(packet, name)._schema
    return None


def _node_overload(node: Any) -> str | None:
    """The overload name of a traced node's schema (None if the node has none)."""
    if node is None:
        return None
    try:
        text = node.schema()
    except (AttributeError, RuntimeError):
        return None
    name = text.partition("(")[0]
    if "::" not in name or name.startswith(("prim::", "onnx::")):
        return None
    return name.partition(".")[2] or "default"


def _base_symbolic(op: str, opset: int) -> Callable[..., Any] | None:
    """The exporter's own symbolic of ``aten::<op>`` at ``opset`` (not a custom one registered over it)."""
    from ortcore_plugins.services.torchscript_symbolics import exporter_symbolic

    own = exporter_symbolic(f"::{op}")
    if own is not None:
        return own
    from torch.onnx._internal.torchscript_exporter import registration

    group = registration.registry.get_function_group(f"aten::{op}")
    if group is None:
        return None
    base = group._functions._base
    usable = [v for v in base if v <= opset]
    return base[max(usable)] if usable else None


def _on(route: Route, args: tuple) -> bool:
    """Does the route apply on the device of the call's first tensor (unknown: it applies)?"""
    for value in args:
        if value is None or is_none(value) or routed_calls.is_list(value):
            continue
        try:
            device = value.type().device()
        except (AttributeError, RuntimeError):
            continue
        if device is not None:
            return device.type in route.devices
    return True


def _gradient_flows(args: tuple) -> bool:
    """May a gradient flow through the call: has it a floating-point tensor input (or list item)?

    Only element types are known while exporting (a traced value's requires_grad is not), so a float op is routed
    even where nothing trains; integer and boolean calls (Hugging Face's mask cumsum) stay in ORT.
    """
    from torch.onnx import symbolic_helper as sh

    values = []
    for value in args:
        if value is None or is_none(value):
            continue
        values.extend(sh._unpack_list(value) if routed_calls.is_list(value) else [value])
    for value in values:
        try:
            t = value.type()
            if t.kind() != "TensorType":
                continue
            scalar = t.scalarType()
        except (AttributeError, RuntimeError):
            continue
        if scalar is None or scalar in FLOAT_TYPES:
            return True
    return False


def _gradient_reaches(args: tuple) -> bool:
    """May ORT be asked for a gradient through the call: may one of its floating-point tensor inputs need one?"""
    from torch.onnx import symbolic_helper as sh

    values = []
    for value in args:
        if value is None or is_none(value):
            continue
        values.extend(sh._unpack_list(value) if routed_calls.is_list(value) else [value])
    return any(routed_calls.may_need_grad(v) for v in values if not is_none(v))


def route_symbolic(route: Route) -> Callable[..., Any]:
    """The TorchScript symbolic of ``aten::<route.op>``: the call becomes an ATen node when the route applies (its
    condition in :data:`TRACED_CALLS` holds), else the exporter's own symbolic exports it."""
    op = route.op
    when = TRACED_CALLS.get(op)

    def symbolic(g: Any, *args: Any, **kwargs: Any) -> Any:
        schema = match_overload(op, args, g.original_node)
        if (
            schema is None
            or (when is not None and not when(args, schema))
            or not _on(route, args)
            or (route.gradient_only and not _gradient_flows(args))
            or (route.traced_gradient and not _gradient_reaches(args))
        ):
            base = _base_symbolic(op, g.opset)
            if base is None:
                raise UnsupportedModelError(f"the exporter has no symbolic for aten::{op}")
            return base(g, *args, **kwargs)
        packed = op in PACKED_RNN_OPS and _is_packed(args, schema)
        return _emit(g, op, schema, args, PACKED_REASON if packed else route.reason)

    symbolic.__name__ = f"op_routing_{op}"
    symbolic.__qualname__ = f"route_symbolic.{op}"
    return symbolic


# Ops the current export routed because the exporter failed on a call (for the reasons in the graph's metadata).
_failed_ops: set[str] = set()
# Ops the current export routed for a reason other than their route's (an RNN over a packed sequence).
_other_reasons: dict[str, str] = {}


def _emit(g: Any, op: str, schema: Any, args: tuple, reason: str) -> Any:
    """Export one call of ``aten::<op>`` as an ATen node run by PyTorch, with its VJP gradient."""
    if reason == EXPORTER_FAILED:
        _failed_ops.add(op)
    elif reason == PACKED_REASON:
        _other_reasons[op] = reason
    results = routed_calls.emit_call(g, op, schema, args, prepare_runtime)
    _note_routed(op, reason)
    return results


def symbolics(never: Collection[str] = ()) -> dict[str, Callable[..., Any]]:
    """``{"::<op>": symbolic}`` of every route not in ``never``, and of :func:`.shared.renorm_op`."""
    table = {f"::{r.op}": route_symbolic(r) for r in ROUTES if r.op not in never}
    table[f"{aten_nodes.HELPER_NAMESPACE}::{RENORM_OP}"] = _renorm_symbolic
    return table


# -- as_strided and embedding(max_norm=...) as torch computes them (see .shared) ------------------------------------


def as_strided_exact(t: torch.Tensor, size: Any, stride: Any, storage_offset: Any = None) -> torch.Tensor:
    """``t.as_strided(size, stride, storage_offset)`` written with ops whose export reads what torch reads (see the
    comment above); called while the TorchScript exporter traces the model."""
    start = t.storage_offset()
    if t.is_contiguous() and (storage_offset is None or start == 0):
        return torch.as_strided(t, size, stride, storage_offset)  # the exporter's gather is torch's
    offset = start if storage_offset is None else int(storage_offset)
    owner = t._base if t._base is not None else t
    order = storage_order(tuple(owner.shape), tuple(owner.stride()), owner.storage_offset())
    if order is None:
        raise _gap_error("of a tensor whose memory has gaps (a strided slice)")
    first, last = _reads(size, stride, offset)
    if first < order.start or last >= order.start + order.numel:
        raise _gap_error(f"{first}..{last}, outside the {order.numel} its owner covers from {order.start}")
    flat = owner
    for d in order.drop:
        flat = flat.select(d, 0)
    flat = flat.permute(order.permutation).reshape(-1)
    if flat.storage_offset() != 0:
        flat = flat.clone()  # so that torch, while tracing, reads relative offsets as the graph does
    _note_routed("as_strided", AS_STRIDED_REASON, kind="written in storage order")
    return torch.as_strided(flat, size, stride, offset - order.start)


def _renorm_symbolic(g: Any, weight: Any, indices: Any, max_norm: Any, norm_type: Any) -> Any:
    """The TorchScript symbolic of :func:`renorm_op`: one ATen node, its gradient the identity (a VJP)."""
    schema = renorm_op().default._schema
    kinds = ["Tensor", "Tensor", "float", "float"]
    # A wrapper op, as routed calls are: its gradient helper's name tells explain() which op it serves.
    operator = define_wrapper(
        aten_nodes.helper_op(RENORM_OP), "", schema, kinds, [((k, None),) for k in range(4)], RENORM_OP
    )
    inputs = [
        weight,
        indices,
        constant_argument(g, max_norm, "float", RENORM_OP, "max_norm"),
        constant_argument(g, norm_type, "float", RENORM_OP, "norm_type"),
    ]
    register_vjp_gradient(operator, "", op_packet(operator).default._schema, (0,), (0,), prepare_runtime)
    _note_routed("embedding", RENORM_REASON)
    return aten_node(g, operator, "", inputs, list(g.original_node.outputs()))


def embedding_exact(
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """``F.embedding`` whose ``max_norm`` renormalization the TorchScript exporter writes (see above)."""
    if max_norm is not None:
        weight = renorm_op()(weight, input, float(max_norm), float(norm_type))
    return torch.nn.functional.embedding(input, weight, padding_idx, None, norm_type, scale_grad_by_freq, sparse)


class _ExactTracing(torch.overrides.TorchFunctionMode):
    """While the TorchScript exporter traces: every ``as_strided`` call becomes :func:`as_strided_exact`, every
    ``F.embedding`` with ``max_norm`` :func:`embedding_exact` (each unless ``never`` names it)."""

    def __init__(self, never: frozenset[str] = frozenset()):
        super().__init__()
        self.as_strided = "as_strided" not in never
        self.embedding = "embedding_renorm" not in never

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.jit.is_tracing():
            if self.as_strided and func in (torch.Tensor.as_strided, torch.as_strided):
                return as_strided_exact(*args, **kwargs)
            if self.embedding and func is torch.nn.functional.embedding:
                return embedding_exact(*args, **kwargs)
        return func(*args, **kwargs)


# -- ops the exporter failed on ----------------------------------------------------------------------------------------


def symbolics_for_failure(error: UnsupportedModelError, symbolics: dict[str, Any]) -> dict[str, Any] | None:
    """The TorchScript route (``ortcore_export_failed``): when the exporter failed on a call of an ``aten::`` op
    (its symbolic refuses these arguments, or there is none), that op's calls the exporter fails on as ATen nodes
    run by PyTorch (:func:`routed_on_failure`); None when the failure names no such op, or the op was routed on
    failure already (the core then raises)."""
    op = failed_op(error)
    if op in PRIM_AS_ATEN:  # a prim node the tracer wrote for an aten call (chunk): routed as that call
        if getattr(symbolics.get(op), "routes_failures", False):
            return None
        logger.info(
            "the TorchScript exporter failed on %s (%s): exporting it as aten::%s on PyTorch's kernel",
            op,
            str(error.__cause__ or error).strip().splitlines()[0][:200],
            PRIM_AS_ATEN[op],
        )
        previous = symbolics.get(op) or _registered_symbolic(op)
        return {op: routed_on_failure(PRIM_AS_ATEN[op], previous, constants=True)}
    if op is not None and "::" in op:  # another library's op (a torch.library custom op): no symbolic anywhere
        if not _is_torch_op(op) or getattr(symbolics.get(op), "routes_failures", False):
            return None
        logger.info(
            "the TorchScript exporter has no symbolic for %s: exporting its calls as ATen nodes run by PyTorch", op
        )
        return {op: routed_on_failure(op, None)}
    # The exporter looks an op ending in "_" up without it (an in-place op, and __and__ as __and_).
    name = f"::{op[:-1]}" if op is not None and op.endswith("_") else f"::{op}"
    if op is not None and op.endswith("_") and not op.startswith("__"):
        op = op[:-1]  # an in-place call is routed as its functional op
    op = _NAMED.get(op, op)  # a ^ b is routed as bitwise_xor: the graph's metadata names the op
    if op is None or not hasattr(torch.ops.aten, op) or getattr(symbolics.get(name), "routes_failures", False):
        return None
    logger.info(
        "the TorchScript exporter failed on aten::%s (%s): exporting the calls it fails on as ATen nodes run by PyTorch",
        op,
        str(error.__cause__ or error).strip().splitlines()[0][:200],
    )
    previous = symbolics.get(name) or _registered_symbolic(name.removeprefix("::"))
    return {name: routed_on_failure(op, previous)}


def _is_torch_op(qualified: str) -> bool:
    """Is ``namespace::name`` an op registered with PyTorch (so an ATen node can run it)?"""
    try:
        return bool(op_packet(qualified).overloads())
    except (AttributeError, RuntimeError):
        return False


@contextlib.contextmanager
def exact_tracing(never: frozenset[str]) -> Iterator[None]:
    """Around a TorchScript export (``ortcore_export_context``): ``as_strided`` and ``F.embedding`` with
    ``max_norm`` traced exactly (:class:`_ExactTracing`), an aten op whose symbolic writes control flow routed
    (:func:`_no_control_flow`), and the ops routed on failure counted afresh."""
    _failed_ops.clear()
    _other_reasons.clear()
    _control_flow_ops.clear()
    with _ExactTracing(never), _no_control_flow():
        yield


# -- aten ops the exporter writes as control flow ----------------------------------------------------------------------
#
# Some symbolics write an ONNX Loop or If for an aten call (tensor_split by indices, unfold or squeeze of a dimension
# whose size is unknown, tile, hstack, ...). ORT aborts the process building a training graph with one, so the core
# refuses such a graph. While a TorchScript export runs, a symbolic of an aten call that adds a Loop or If fails
# instead: the call is then routed like any call the exporter fails on (one ATen node, the rest in ORT). The model's
# own control flow (prim::Loop, prim::If of scripted code) is not an aten call and is left alone.

_CONTROL_FLOW = frozenset({"Loop", "If", "Scan"})
CONTROL_FLOW_REASON = "the TorchScript exporter writes it as an ONNX {}, which ORT cannot train"
# Ops of the current export whose symbolic wrote control flow: op -> the ONNX op it wrote.
_control_flow_ops: dict[str, str] = {}


@contextlib.contextmanager
def _no_control_flow() -> Iterator[None]:
    from torch.onnx._internal.torchscript_exporter import jit_utils

    original = jit_utils.add_op_with_blocks

    def add_op_with_blocks(graph_context: Any, opname: str, *args: Any, **kwargs: Any) -> Any:
        node = getattr(graph_context, "original_node", None)
        try:
            kind = node.kind() if node is not None else ""
        except RuntimeError:
            kind = ""
        if opname in _CONTROL_FLOW and kind.startswith("aten::"):
            op = kind.removeprefix("aten::")
            _control_flow_ops[op] = opname
            raise UnsupportedModelError(f"the TorchScript exporter writes aten::{op} as an ONNX {opname}")
        return original(graph_context, opname, *args, **kwargs)

    jit_utils.add_op_with_blocks = add_op_with_blocks
    try:
        yield
    finally:
        jit_utils.add_op_with_blocks = original


# Python operators traced under their dunder names, and the ops they are (same overloads and arguments).
_NAMED = {
    "__and__": "bitwise_and",
    "__or__": "bitwise_or",
    "__xor__": "bitwise_xor",
    "__lshift__": "bitwise_left_shift",
    "__rshift__": "bitwise_right_shift",
}
EXPORTER_FAILED = "the TorchScript exporter fails on this call (its symbolic refuses the arguments)"
# Nodes the tracer writes for an aten call, whose symbolic takes the call's int arguments as Python ints: the aten op
# each is routed as when its symbolic fails (torch.chunk traces as prim::ConstantChunk).
PRIM_AS_ATEN = {"prim::ConstantChunk": "chunk"}


def failed_op(error: BaseException) -> str | None:
    """The ``aten::`` op whose symbolic raised ``error`` (or its cause), as its name; an op of another namespace (a
    ``torch.library`` custom op, ``transformers::grouped_mm_fallback``) as ``namespace::name``. Read from the
    exporter's own frame that was converting the node (``_run_symbolic_function``), since the messages do not always
    name the op."""
    for e in (error, error.__cause__):
        tb = e.__traceback__ if e is not None else None
        kind = None
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "_run_symbolic_function":
                node = tb.tb_frame.f_locals.get("node")
                try:
                    kind = node.kind() if node is not None else kind
                except (AttributeError, RuntimeError):
                    pass
            tb = tb.tb_next
        if kind is not None and kind.startswith("aten::"):
            return kind.removeprefix("aten::")
        if kind in PRIM_AS_ATEN:
            return kind
        if kind is not None and "::" in kind and not kind.startswith(("prim::", "onnx::")):
            return kind
    return None


def _registered_symbolic(op: str) -> Callable[..., Any] | None:
    """The exporter's registered symbolic of ``aten::<op>`` (of ``op`` itself when it names a namespace)."""
    from torch.onnx._internal.torchscript_exporter import registration

    group = registration.registry.get_function_group(op if "::" in op else f"aten::{op}")
    return None if group is None else lambda g, *args, **kwargs: group.get(g.opset)(g, *args, **kwargs)


def _functional_call(op: str, args: tuple) -> tuple[Any, tuple]:
    """An ``out=`` call (``F.normalize(x, out=buf)`` traces ``div.out``) as its functional overload: the schema and
    the arguments without the ``out`` ones (the traced node's result is the value later reads of ``buf`` see)."""
    packet = getattr(torch.ops.aten, op)
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        if len(schema.arguments) != len(args):
            continue
        outs = [k for k, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if not outs or not all(schema.arguments[k].kwarg_only for k in outs):
            continue
        rest = [a.name for k, a in enumerate(schema.arguments) if k not in outs]
        kept = tuple(v for k, v in enumerate(args) if k not in outs)
        for other in packet.overloads():
            functional = getattr(packet, other)._schema
            if not functional.is_mutable and [a.name for a in functional.arguments] == rest:
                if all(_kind_fits(a, v) for a, v in zip(functional.arguments, kept, strict=True)):
                    return functional, kept
    return None, args


def routed_on_failure(op: str, previous: Callable[..., Any] | None, constants: bool = False) -> Callable[..., Any]:
    """The symbolic of ``aten::<op>`` after the exporter failed on it: ``previous`` (the symbolic that failed) where
    it succeeds, else one ATen node run by PyTorch (calls the exporter writes stay in ORT). Without a ``previous``
    (the exporter has no symbolic for the op) every call is routed, for that reason. With ``constants``, the symbolic
    serves a prim node whose int arguments come as Python ints (:data:`PRIM_AS_ATEN`): they become constants."""

    def symbolic(g: Any, *args: Any, **kwargs: Any) -> Any:
        if previous is not None:
            try:
                return previous(g, *args, **kwargs)
            except Exception:  # noqa: BLE001 (any failure of the exporter's symbolic: the call is routed)
                pass
        if constants:  # a prim node's attributes come as keywords, named as the aten op's arguments
            names = [a.name for a in getattr(torch.ops.aten, op).default._schema.arguments]
            args = (*args, *(kwargs[n] for n in names[len(args) :] if n in kwargs))
            args = tuple(
                a if isinstance(a, torch._C.Value) else g.op("Constant", value_t=torch.tensor(a)) for a in args
            )
        schema = match_overload(op, args, None if constants else g.original_node)
        if schema is None:
            schema, args = _functional_call(op, args)
        if schema is None:
            raise UnsupportedModelError(f"the op_routing plugin cannot run aten::{op}: no overload fits the call")
        return _emit(g, op, schema, args, EXPORTER_FAILED if previous is not None else EXPORTER_GAP)

    symbolic.__name__ = f"op_routing_failed_{op}"
    symbolic.routes_failures = True  # symbolics_for_failure: this op is routed on failure already
    return symbolic


def add_reasons(model: onnx.ModelProto) -> None:
    """The reasons of a TorchScript export's ATen nodes (:func:`.shared.add_reasons`)."""
    decided = {
        **_other_reasons,
        **dict.fromkeys(sorted(_failed_ops), EXPORTER_FAILED),
        **{op: CONTROL_FLOW_REASON.format(onnx_op) for op, onnx_op in _control_flow_ops.items()},
    }
    shared.add_reasons(model, ROUTE_REASONS, EXPORTER_GAP, decided)
