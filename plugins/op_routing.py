"""Per-op routing: an op ONNX Runtime cannot export, differentiate or run becomes one ATen node run by PyTorch.

One op that ORT cannot handle should not send the whole model back to PyTorch. This plugin decides, while the model
is exported, which ops ORT cannot serve on the model's device, and exports each of them as an
``org.pytorch.aten::ATen`` node that the ATen executor (:mod:`ortcore_plugins.services.aten_executor`) runs with PyTorch's
kernel; its gradient is PyTorch's autograd gradient (a VJP node per floating-point input PyTorch differentiates,
:mod:`ortcore_plugins.services.differentiability`). Everything else stays in ORT. Three sources of decisions:

* **ORT gaps** (:data:`ROUTES`): ops whose ONNX form ORT 1.19.2 has no gradient builder for (HardSwish, Einsum,
  CumSum, InstanceNormalization, ReduceMax, Softplus, PRelu, DepthToSpace, GridSample, RNN, ...), no CPU kernel for
  the gradient (ConvTransposeGrad, ResizeGrad),
  a kernel that rejects the case (bidirectional GRU/LSTM, Multinomial of rank > 2) or a kernel known to fail or
  abort the process (negative-step SliceGrad of ``flip``, ``diagonal``). Each entry names the reason and, where only
  some calls are affected, the condition (a transposed convolution, a bidirectional RNN). Every entry is checked
  against ORT in ``tests/plugins/test_op_routing.py``: a test fails when ORT starts handling the op itself.
* **Exporter gaps**: an ``aten::`` op without an ONNX symbolic (``histc``, ``ctc_loss``, ``cummax``, ...) is found by
  the exporter's "not supported" error and exported as an ATen node too (the ``aten_fallback`` plugin's ``auto``
  mode, on by default here).
* Ops the ``aten_fallback`` plugin runs on PyTorch's kernels for speed.

Each routed op is logged once per export at INFO with its reason and recorded in the exported model's metadata
(``ortcore.routed::<op>``), which :func:`ortcore.explain.explain` and ``ortcore explain`` read.

Two ATen-node limits of ORT 1.19.2 are lifted by exporting a *wrapper op* (``ortcore_route::*``, defined once per
signature with ``torch.library``) instead of the op itself: ORT builds an ATen node's gradient only when its first
input needs one, so the wrapper takes first an input that does; and the executor passes tensors one by one, so a
tensor list (``einsum``'s operands, an RNN's weights) becomes separate inputs. The wrapper also copies outputs that
alias an input (``diagonal``'s view), which ORT must own.

On the dynamo route the same decisions are taken in ``torch.export``'s program, before it is translated
(``ortcore_program_passes``): :data:`PROGRAM_ROUTES` names the calls each route applies to as the program holds them
(``torch.export`` keeps CompositeImplicitAutograd ops such as ``gru.input``, ``group_norm`` and
``conv_transpose2d.input`` whole), ops without an onnxscript translation are found from the exporter's registry, and
each such call becomes a wrapper op whose translation (``ortcore_export_translations``) writes one ATen node
(:mod:`ortcore_plugins.services.aten_program`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import onnx
import torch

from ortcore.api import (
    DYNAMO,
    ROUTED_METADATA_PREFIX,
    TORCHSCRIPT,
    Config,
    GraphPass,
    OptionError,
    PassContext,
    UnsupportedModelError,
    aten_kind,
    exporter_name,
    hookimpl,
    operator_of,
    option,
    parse_bool,
)
from ortcore_plugins.services import aten_nodes, aten_program, routed_calls
from ortcore_plugins.services.aten_nodes import (
    ATEN_DOMAIN,
    FLOAT_TYPES,
    aten_node,
    constant_argument,
    define_wrapper,
    is_none,
    is_string_constant,
    op_packet,
    register_vjp_gradient,
    type_aten_outputs,
)
from ortcore_plugins.services.torch_kernels import ROUTABLE_OPS, prepare_runtime

logger = logging.getLogger("ortcore.op_routing")

NAME = "op_routing"
ENV_ENABLED = "ORTCORE_OP_ROUTING"
ENV_NEVER = "ORTCORE_OP_ROUTING_NEVER"
WRAPPER_NAMESPACE = aten_nodes.WRAPPER_NAMESPACE
REASONS_PASS = "op_routing.reasons"
TYPES_PASS = "op_routing.typed_outputs"
DISTINCT_PASS = "op_routing.distinct_inputs"
METADATA_PREFIX = ROUTED_METADATA_PREFIX
EXPORTER_GAP = "the TorchScript exporter has no ONNX symbolic for it"
EXPORTER_GAP_DYNAMO = "the dynamo exporter has no onnxscript translation for it"
PROGRAM_PASS = "op_routing.program"
FASTER_IN_TORCH = "PyTorch's kernel is faster on CPU (aten_fallback torch_kernels)"


# -- what ORT cannot do --------------------------------------------------------------------------------------------


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


@attrs.frozen
class Route:
    """An aten op ORT cannot serve, why, and (if only some calls are affected) which ones."""

    op: str  # aten op name
    onnx_op: str  # what the exporter would give ORT
    reason: str
    when: Callable[[tuple, Any], bool] | None = None  # (traced args, schema) -> route this call?
    devices: frozenset[str] = frozenset({"cpu", "cuda"})  # where ORT lacks it
    # ORT lacks only the gradient: a call on integers or booleans (a mask's cumsum) stays in ORT.
    gradient_only: bool = True
    # Route only a call a gradient may reach from a trained value (read from the traced graph, see _may_need_grad):
    # for ops common on values nothing trains (position buckets' floor and sign), which ORT computes right.
    traced_gradient: bool = False


# Unary ops whose ONNX form ORT 1.19.2 cannot differentiate (checked on both routes): op -> what ORT gets.
_UNARY_WITHOUT_GRADIENT = {
    "mish": "Mish/Softplus",
    "celu": "Celu",
    "selu": "Selu",
    "elu": "Elu",
    "asin": "Asin",
    "acos": "Acos",
    "tan": "Tan",
    "asinh": "Asinh",
    "acosh": "Acosh",
    "atanh": "Atanh",
    "sinh": "Sinh",
    "cosh": "Cosh",
    "frac": "Sign/Floor",
    "exp2": "Pow with a constant base",
    "softshrink": "Sign",
}


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


_NO_GRAD = "ORT has no gradient builder for {}"
_NO_GRAD_KERNEL = "ORT has no CPU kernel for {}"
_SCATTER_GRAD = "ORT's gradient of a scatter with reduction drops the gradient of self at the scattered positions"

ROUTES: tuple[Route, ...] = (
    Route("hardswish", "HardSwish", _NO_GRAD.format("HardSwish")),
    Route("hardsigmoid", "HardSigmoid", _NO_GRAD.format("HardSigmoid")),
    Route("einsum", "Einsum", _NO_GRAD.format("Einsum")),
    Route("cumsum", "CumSum", _NO_GRAD.format("CumSum")),
    Route("instance_norm", "InstanceNormalization", _NO_GRAD.format("InstanceNormalization")),
    Route("group_norm", "InstanceNormalization", _NO_GRAD.format("InstanceNormalization (GroupNorm's export)")),
    Route("amax", "ReduceMax", _NO_GRAD.format("ReduceMax")),
    Route("amin", "ReduceMin", _NO_GRAD.format("ReduceMin")),
    Route("max", "ReduceMax", _NO_GRAD.format("ReduceMax"), _is_reduction),
    Route("min", "ReduceMin", _NO_GRAD.format("ReduceMin"), _is_reduction),
    Route("gru", "GRU", "ORT's GRU training kernels support only the forward direction", _is_bidirectional),
    Route("lstm", "LSTM", "ORT's LSTM training kernels support only the forward direction", _is_bidirectional),
    Route("rnn_tanh", "RNN", _NO_GRAD.format("RNN")),
    Route("rnn_relu", "RNN", _NO_GRAD.format("RNN")),
    Route("softplus", "Softplus", _NO_GRAD.format("Softplus")),
    Route("prelu", "PRelu", _NO_GRAD.format("PRelu")),
    Route("pixel_shuffle", "DepthToSpace", _NO_GRAD.format("DepthToSpace (pixel_shuffle)")),
    Route("grid_sampler", "GridSample", _NO_GRAD.format("GridSample")),
    Route(
        "_convolution",
        "ConvTranspose",
        _NO_GRAD_KERNEL.format("ConvTransposeGrad"),
        _is_transposed,
        devices=frozenset({"cpu"}),
    ),
    *(
        Route(op, "Resize", _NO_GRAD_KERNEL.format("ResizeGrad"), devices=frozenset({"cpu"}))
        for op in (
            "upsample_nearest1d",
            "upsample_nearest2d",
            "upsample_nearest3d",
            "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d",
            "_upsample_nearest_exact3d",
            "upsample_linear1d",
            "upsample_bilinear2d",
            "upsample_bicubic2d",
            "upsample_trilinear3d",
            "_upsample_bilinear2d_aa",
            "_upsample_bicubic2d_aa",
        )
    ),
    Route("flip", "Slice", "ORT's SliceGrad fails on the negative steps of flip (narrowing_error)"),
    Route(
        "scaled_dot_product_attention",
        "(no export)",
        "the TorchScript exporter cannot export grouped-query attention (enable_gqa=True)",
        _is_grouped_query,
        gradient_only=False,
    ),
    Route("multinomial", "Multinomial", "ORT's Multinomial kernel takes only 2-D probabilities", gradient_only=False),
    Route(
        "diagonal",
        "Slice/Gather",
        "ORT aborts the process on some diagonal graphs (a bounds assertion)",
        gradient_only=False,
    ),
    # Wrong numbers, nothing raised: the exporter's form differs from torch on some inputs.
    Route(
        "index_add",
        "ScatterElements",
        "the exporter writes index_add as a scatter that keeps one of repeated indices instead of adding them "
        "(or refuses alpha, or a source longer than self), and " + _SCATTER_GRAD,
        gradient_only=False,
    ),
    Route(
        "index_put",
        "ScatterND",
        "the exporter writes index_put(accumulate=True) as a scatter that keeps one of repeated indices instead "
        "of adding them",
        _accumulates,
        gradient_only=False,
    ),
    Route("scatter_add", "ScatterElements", _SCATTER_GRAD, traced_gradient=True),
    Route(
        "scatter_reduce",
        "ScatterElements",
        "the exporter refuses mean and include_self=False, writes the others with an If (which ORT cannot train), "
        "and " + _SCATTER_GRAD,
        gradient_only=False,
    ),
    Route(
        "topk",
        "TopK",
        "ORT's TopK orders tied values by index where torch does not, so values, indices and gradients go to other "
        "elements",
        gradient_only=False,
    ),
    Route(
        "repeat_interleave",
        "Loop",
        "the exporter writes repeat_interleave with a tensor of repeats as a Loop, which ORT cannot train",
        _repeats_tensor,
        gradient_only=False,
    ),
    Route(
        "floor_divide",
        "Div/Where",
        "the exporter's integer floor division rounds some negative quotients the wrong way",
        _on_integers,
        gradient_only=False,
    ),
    Route(
        "div", "Floor/Sign", _NO_GRAD.format("Floor and Sign (div with rounding_mode)"), _rounds, traced_gradient=True
    ),
    *(
        Route(
            op,
            onnx_op,
            f"ORT takes {onnx_op} as not differentiable: a value reached only through it is refused, where torch "
            "gives it a zero gradient",
            traced_gradient=True,
        )
        for op, onnx_op in (
            ("round", "Round"),
            ("floor", "Floor"),
            ("ceil", "Ceil"),
            ("trunc", "Floor/Ceil"),
            ("sign", "Sign"),
        )
    ),
    Route(
        "logsumexp",
        "ReduceLogSumExp",
        "ORT's ReduceLogSumExp gradient builder writes an invalid Unsqueeze when the reduced dimensions are dropped",
        lambda args, schema: not _const(args, schema, "keepdim"),
        traced_gradient=True,
    ),
    Route(
        "embedding_bag",
        "Loop",
        "the exporter writes embedding_bag as a Loop, which ORT cannot train",
        gradient_only=False,
    ),
    *(Route(op, onnx_op, _NO_GRAD.format(onnx_op)) for op, onnx_op in _UNARY_WITHOUT_GRADIENT.items()),
    Route(
        "pad",
        "Pad",
        "ORT's Pad gradient builder takes only constant padding (reflect, replicate, circular fail the build)",
        _pads_by_mode,
    ),
    Route(
        "linalg_vector_norm",
        "ReduceL1/ReduceL2/ReduceMax",
        "ORT has no gradient builder for ReduceL1 and ReduceMax, and its ReduceL2 gradient writes an invalid Unsqueeze "
        "when the reduced dimensions are dropped",
        _norm_ort_cannot_differentiate,
    ),
    Route("atan2", "Atan", _NO_GRAD.format("Atan (atan2)")),
    Route("atan", "Atan", _NO_GRAD.format("Atan")),
    Route("fmod", "Mod", _NO_GRAD.format("Mod (fmod)"), traced_gradient=True),
    Route("remainder", "Mod/Floor", _NO_GRAD.format("Mod and Floor (remainder)"), traced_gradient=True),
)

# Ops written differently rather than routed (as_strided in storage order, embedding's max_norm renormalization):
# ``never`` takes their names too.
REWRITES: frozenset[str] = frozenset({"as_strided", "embedding_renorm"})
ROUTE_OPS: frozenset[str] = frozenset(r.op for r in ROUTES) | REWRITES


# -- options --------------------------------------------------------------------------------------------------------


def parse_never(value: object, source: str) -> tuple[str, ...]:
    """Op names of :data:`ROUTES` that stay in ORT, as a list or a comma-separated string."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise OptionError(f"{source}={value!r} must be a list of op names (or a comma-separated string)")
    names = []
    for item in items:
        name = item.rpartition("::")[2]
        if name not in ROUTE_OPS:
            import difflib

            close = difflib.get_close_matches(name, sorted(ROUTE_OPS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise OptionError(
                f"{source}={value!r}: {item!r} is not an op this plugin routes; allowed: "
                f"{', '.join(sorted(ROUTE_OPS))}.{hint}"
            )
        names.append(name)
    return tuple(dict.fromkeys(names))


@attrs.frozen
class OpRoutingOptions:
    """Options of the ``op_routing`` plugin (``[plugins.op_routing]`` in ortcore.toml)."""

    enabled: bool = option(
        True, parse_bool, "route ops ORT cannot export, differentiate or run to PyTorch's kernels", env=ENV_ENABLED
    )
    never: tuple[str, ...] = option(
        (), parse_never, "ops of the routing table that stay in ORT even where ORT lacks them", env=ENV_NEVER
    )


def _options(config: Config) -> OpRoutingOptions:
    return config.plugin_options(NAME) or OpRoutingOptions()


# -- the routing symbolic ------------------------------------------------------------------------------------------


def _kind_fits(argument: Any, value: Any) -> bool:
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
    return not routed_calls.is_list(value) or t.kind() == "ListType"


def match_overload(op: str, args: tuple, node: Any = None) -> Any:
    """The schema of the ``aten::<op>`` overload a traced call used: the one the traced ``node`` names, else the
    first whose argument count, tensor lists and strings fit (``gru.input`` and ``gru.data`` both take nine
    arguments; ``repeat_interleave.self_int`` and ``.self_Tensor`` are told apart only by the node)."""
    packet = getattr(torch.ops.aten, op)
    named = _node_overload(node)
    if named is not None and named in packet.overloads():
        schema = getattr(packet, named)._schema
        # The exporter's copy of the node may name an out= overload of the same arity (max.out for max.dim).
        if (
            not schema.is_mutable
            and len(schema.arguments) == len(args)
            and all(_kind_fits(a, v) for a, v in zip(schema.arguments, args, strict=True))
        ):
            return schema
    for name in sorted(packet.overloads(), key=lambda n: n != "default"):
        schema = getattr(packet, name)._schema
        if (
            not schema.is_mutable
            and len(schema.arguments) == len(args)
            and all(_kind_fits(a, v) for a, v in zip(schema.arguments, args, strict=True))
        ):
            return schema
    return None


def _node_overload(node: Any) -> str | None:
    """The overload name of a traced ``aten::`` node's schema (None if the node has none)."""
    if node is None:
        return None
    try:
        text = node.schema()
    except (AttributeError, RuntimeError):
        return None
    name = text.partition("(")[0]
    if not name.startswith("aten::"):
        return None
    return name.partition(".")[2] or "default"


def _base_symbolic(op: str, opset: int) -> Callable[..., Any] | None:
    """The exporter's own symbolic of ``aten::<op>`` at ``opset`` (not a custom one registered over it)."""
    from ortcore.api import core_symbolic

    own = core_symbolic(f"::{op}")
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
    condition holds and the op is not in ``never``), else the exporter's own symbolic exports it."""
    op = route.op

    def symbolic(g: Any, *args: Any, **kwargs: Any) -> Any:
        schema = match_overload(op, args, g.original_node)
        if (
            schema is None
            or (route.when is not None and not route.when(args, schema))
            or not _on(route, args)
            or (route.gradient_only and not _gradient_flows(args))
            or (route.traced_gradient and not _gradient_reaches(args))
        ):
            base = _base_symbolic(op, g.opset)
            if base is None:
                raise UnsupportedModelError(f"the exporter has no symbolic for aten::{op}")
            return base(g, *args, **kwargs)
        return _emit(g, op, schema, args, route.reason)

    symbolic.__name__ = f"op_routing_{op}"
    symbolic.__qualname__ = f"route_symbolic.{op}"
    return symbolic


# Ops the current export routed because the exporter failed on a call (for the reasons in the graph's metadata).
_failed_ops: set[str] = set()


def _emit(g: Any, op: str, schema: Any, args: tuple, reason: str) -> Any:
    """Export one call of ``aten::<op>`` as an ATen node run by PyTorch, with its VJP gradient."""
    if reason == EXPORTER_FAILED:
        _failed_ops.add(op)
    results = routed_calls.emit_call(g, op, schema, args, prepare_runtime)
    _note_routed(op, reason)
    return results


_logged: set[tuple[str, str]] = set()


def _note_routed(op: str, reason: str, kind: str = "runs on PyTorch's kernel inside the ORT graph") -> None:
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        name = op if "::" in op else f"aten::{op}"
        logger.info("%s %s: %s", name, kind, reason)


def symbolics(config: Config) -> dict[str, Callable[..., Any]]:
    """``{"::<op>": symbolic}`` of every route not in ``never``, and of :func:`renorm_op`."""
    options = _options(config)
    if not options.enabled:
        return {}
    table = {f"::{r.op}": route_symbolic(r) for r in ROUTES if r.op not in options.never}
    table[f"{aten_nodes.HELPER_NAMESPACE}::{RENORM_OP}"] = _renorm_symbolic
    return table


# -- the dynamo route: calls of the exported program -----------------------------------------------------------------
#
# torch.export keeps CompositeImplicitAutograd ops whole (gru.input, group_norm, instance_norm, einsum,
# conv_transpose2d.input, upsample_bilinear2d.vec, ...): the dynamo route finds a route's calls at that level, in the
# exported program's FX graph, before torch.onnx decomposes anything, and turns each into a wrapper op that its
# translation writes as one ATen node (ortcore_plugins.services.aten_program).


def _flag(name: str) -> Callable[[dict[str, Any], Any], bool]:
    return lambda arguments, target: bool(arguments.get(name))


def _is_program_reduction(arguments: dict[str, Any], target: Any) -> bool:
    """``max``/``min`` over the whole tensor or a dim (ReduceMax/ReduceMin), not the binary ``max.other``."""
    return target._overloadname in ("default", "dim")


def _given_state(arguments: dict[str, Any], target: Any) -> bool:
    """An RNN call whose initial state is not the zeros torch makes when the model passes none."""
    states = arguments.get("hx")
    states = states if isinstance(states, list | tuple) else [states]
    zeros = (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default)
    return any(not (isinstance(h, torch.fx.Node) and h.target in zeros) for h in states if h is not None)


@attrs.frozen
class ProgramRoute:
    """Which calls of the exported program a :class:`Route` applies to on the dynamo route."""

    route: Route
    ops: tuple[str, ...]  # aten op names as the program calls them
    when: Callable[[dict[str, Any], Any], bool] | None = None  # (arguments by name, OpOverload) -> route this call?


_BY_OP = {r.op: r for r in ROUTES}

PROGRAM_ROUTES: tuple[ProgramRoute, ...] = (
    *(
        ProgramRoute(_BY_OP[op], (op,))
        for op in ("hardswish", "hardsigmoid", "einsum", "cumsum", "instance_norm", "group_norm", "amax", "amin")
    ),
    ProgramRoute(_BY_OP["max"], ("max",), _is_program_reduction),
    ProgramRoute(_BY_OP["min"], ("min",), _is_program_reduction),
    *(ProgramRoute(_BY_OP[op], (op,), _flag("bidirectional")) for op in ("gru", "lstm")),
    *(
        ProgramRoute(
            Route(
                op,
                onnx_op,
                f"the dynamo exporter's {onnx_op} translation fails on an initial state the model passes (its batch "
                "size becomes a symbolic attribute)",
                gradient_only=False,
            ),
            (op,),
            _given_state,
        )
        for op, onnx_op in (("gru", "GRU"), ("lstm", "LSTM"))
    ),
    *(
        ProgramRoute(_BY_OP[op], (op,))
        for op in ("rnn_tanh", "rnn_relu", "softplus", "prelu", "pixel_shuffle", "grid_sampler")
    ),
    ProgramRoute(_BY_OP["grid_sampler"], ("grid_sampler_2d", "grid_sampler_3d")),
    ProgramRoute(_BY_OP["_convolution"], ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")),
    ProgramRoute(_BY_OP["_convolution"], ("convolution", "_convolution"), _flag("transposed")),
    *(ProgramRoute(r, (r.op,)) for r in ROUTES if r.onnx_op == "Resize"),
    ProgramRoute(_BY_OP["flip"], ("flip",)),
    ProgramRoute(_BY_OP["multinomial"], ("multinomial",)),
    ProgramRoute(_BY_OP["diagonal"], ("diagonal",)),
    *(
        ProgramRoute(_BY_OP[op], (op,))
        for op in (
            "index_add",
            "scatter_add",
            "scatter_reduce",
            "topk",
            "fmod",
            "remainder",
            "round",
            "floor",
            "ceil",
            "trunc",
            "sign",
        )
    ),
    ProgramRoute(_BY_OP["index_put"], ("index_put",), _flag("accumulate")),
    ProgramRoute(
        _BY_OP["repeat_interleave"],
        ("repeat_interleave",),
        lambda arguments, target: target._overloadname in ("Tensor", "self_Tensor"),
    ),
    ProgramRoute(
        _BY_OP["div"],
        ("div",),
        lambda arguments, target: arguments.get("rounding_mode") is not None,
    ),
    *(ProgramRoute(_BY_OP[op], (op,)) for op in ("atan2", "atan", *_UNARY_WITHOUT_GRADIENT)),
    ProgramRoute(_BY_OP["pad"], ("pad",), lambda arguments, target: arguments.get("mode") not in (None, "constant")),
    ProgramRoute(
        Route(
            "linalg_vector_norm",
            "ReduceL1/ReduceMax",
            "ORT has no gradient builder for ReduceL1 and ReduceMax, the dynamo exporter's other norms than 2 mix "
            "integer and float types, and ORT's gradient of a norm over every dimension is an invalid graph",
        ),
        ("linalg_vector_norm",),
        lambda arguments, target: float(arguments.get("ord", 2)) != 2 or not arguments.get("dim"),
    ),
    ProgramRoute(_BY_OP["embedding_bag"], ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")),
    ProgramRoute(
        Route(
            "argsort",
            "(no translation)",
            "the dynamo exporter decomposes argsort(stable=True) into sort.stable, which it cannot translate",
            gradient_only=False,
        ),
        ("argsort",),
        lambda arguments, target: bool(arguments.get("stable")),
    ),
    ProgramRoute(
        Route(
            "hypot",
            "(no translation)",
            "the dynamo exporter decomposes hypot into prims.hypot, which it cannot translate",
            gradient_only=False,
        ),
        ("hypot",),
    ),
    ProgramRoute(
        Route(
            "cumprod",
            "(no translation)",
            "the dynamo exporter decomposes cumprod into prims.prod, which it cannot translate",
            gradient_only=False,
        ),
        ("cumprod",),
    ),
    # The dynamo exporter writes grouped-query attention (an Unsqueeze and Expand of the key and value heads), but
    # ORT's gradient of that Unsqueeze fails at run time (a Squeeze given a scalar axes tensor).
    ProgramRoute(
        Route(
            "scaled_dot_product_attention",
            "Unsqueeze/Expand",
            "ORT's Unsqueeze gradient fails on the dynamo exporter's grouped-query attention (enable_gqa=True)",
        ),
        ("scaled_dot_product_attention",),
        _flag("enable_gqa"),
    ),
)


def _program_reason(
    node: torch.fx.Node,
    routes: dict[str, list[ProgramRoute]],
    reach: aten_program.GradientReach,
    gaps: bool,
    translated: frozenset = frozenset(),
) -> str | None:
    """Why ``node`` runs on PyTorch's kernel (None: it stays in ORT): the first of its op's routes that applies."""
    target = node.target
    candidates = routes.get(target._schema.name.rpartition("::")[2], []) if target.namespace == "aten" else []
    for program_route in candidates:
        route = program_route.route
        if program_route.when is not None:
            try:
                arguments = dict(zip([a.name for a in target._schema.arguments], aten_program.bind(node), strict=True))
            except aten_program.Unroutable:
                continue
            if not program_route.when(arguments, target):
                continue
        device = aten_program.device_of(node)
        if device is not None and device not in route.devices:
            continue
        if route.gradient_only and not aten_program.may_need_gradient(node, reach):
            continue
        return route.reason
    if not candidates and gaps and not aten_program.has_translation(target, translated, node):
        return EXPORTER_GAP_DYNAMO
    return None


def _route_program(program: torch.export.ExportedProgram, context: PassContext) -> int:
    """The dynamo route's routing: calls the routes apply to and ops the exporter cannot translate become wrapper ops
    exported as ATen nodes."""
    options = _options(context.config)
    by_op: dict[str, list[ProgramRoute]] = {}
    for r in PROGRAM_ROUTES:
        if r.route.op not in options.never:
            for op in r.ops:
                by_op.setdefault(op, []).append(r)

    def decide(node: torch.fx.Node, reach: aten_program.GradientReach) -> str | None:
        return _program_reason(node, by_op, reach, gaps=True, translated=context.translated)

    if "as_strided" not in options.never:
        as_strided_program(program)
    renormed = set(renorm_program(program)) if "embedding_renorm" not in options.never else set()

    def decide_all(node: torch.fx.Node, reach: aten_program.GradientReach) -> str | None:
        return RENORM_REASON if node in renormed else decide(node, reach)

    routed = aten_program.route_calls(program, context.module, decide_all, prepare_runtime)
    _decided.clear()
    for name, reason in routed:
        _note_routed(name.removeprefix("aten::"), reason)
        _decided.setdefault(name.rpartition("::")[2], reason)
    return len(routed)


# The reasons the last program pass routed each op for (an op has several routes: gru's direction, its given state),
# which the metadata pass of the same export records.
_decided: dict[str, str] = {}


# -- the exporter: exporter gaps, and the reasons of what was routed --------------------------------------------------


# -- as_strided: read from the storage, not from the logical tensor ---------------------------------------------------
#
# ``t.as_strided(size, stride, offset)`` indexes t's *storage*: element j of the result is storage[offset +
# sum(j_k * stride_k)], offset defaulting to t.storage_offset(). An exported graph has no storage: t is a logical
# tensor there, which both exporters gather from as if it were contiguous at offset 0. That is right only when t is
# contiguous and the default offset is used (or t starts its storage); a transposed, sliced or expanded t gives other
# numbers, silently. The exact form reads the memory t views from the tensor that owns it (t._base, in the graph as
# well): that tensor's values put in storage order (its stride-0 and size-1 dimensions dropped, its dimensions sorted
# by stride) are storage[start:start + n], from which as_strided reads with the offset made relative to ``start``.
# Every op of that form is a plain view or gather, which ORT differentiates.

AS_STRIDED_REASON = "as_strided indexes its input's storage, which the exported graph does not have"


@attrs.frozen
class StorageOrder:
    """How to put a tensor's values in storage order: the dimensions to drop (stride 0 or size 1, each taken at
    index 0, highest first), then the permutation of the others by decreasing stride."""

    drop: tuple[int, ...]
    permutation: tuple[int, ...]
    start: int  # the storage position of the first element in storage order
    numel: int  # how many storage positions the values cover, all of them


def storage_order(shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> StorageOrder | None:
    """The :class:`StorageOrder` of a tensor of ``shape``, ``strides`` and storage ``offset`` whose memory has no
    gaps (its values, repeats aside, fill storage[offset:offset + n]); None if it has gaps."""
    drop = tuple(d for d in reversed(range(len(shape))) if strides[d] == 0 or shape[d] == 1)
    keep = [d for d in range(len(shape)) if d not in drop]
    order = sorted(keep, key=lambda d: -strides[d])
    expected = 1
    for d in reversed(order):
        if strides[d] != expected:
            return None
        expected *= shape[d]
    permutation = tuple(sorted(range(len(keep)), key=lambda k: -strides[keep[k]]))
    return StorageOrder(drop, permutation, offset, expected if keep else 1)


def _number(value: Any) -> int:
    """An int, a SymInt (its value for the traced example) or an FX node computing one, as an int."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.SymInt):
        hint = getattr(value.node, "hint", None)
        return int(hint) if hint is not None else int(value)
    return int(value)


def _reads(size: Any, stride: Any, offset: int) -> tuple[int, int]:
    """The first and last storage positions ``as_strided(size, stride, offset)`` reads."""
    pairs = [(_number(n), _number(s)) for n, s in zip(size, stride, strict=True)]
    return offset, offset + sum((n - 1) * s for n, s in pairs if n > 0)


def _gap_error(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"as_strided reads storage positions {what}: the exported graph holds no such values (as_strided indexes its "
        "input's storage, which the graph does not have), so ORT cannot compute torch's result"
    )


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


# -- embedding(max_norm=...): the renormalized rows, with the gradient torch gives ---------------------------------------
#
# F.embedding(ids, weight, max_norm=m) first renormalizes the rows ``ids`` picks *in place* under no_grad
# (embedding_renorm_ on weight.detach()), then looks them up in ``weight``: the lookup reads renormalized rows, and
# the weight's gradient is the lookup's alone (the renormalization is not differentiated). Both exporters lose the
# alias: the TorchScript graph looks up the rows as they were, the dynamo route differentiates the renormalization.
# Here the lookup reads the result of RENORM_OP, which renormalizes like torch (in place as well, so a parameter is
# renormalized as in eager) and passes the gradient through unchanged; it runs on PyTorch's kernel as an ATen node.

RENORM_OP = "embedding_renorm"
RENORM_REASON = (
    "embedding(max_norm=...) renormalizes the weight in place, which neither exporter writes (the lookup would read "
    "the rows as they were, or differentiate the renormalization)"
)
_renorm_lock = threading.Lock()
_renorm_packet: Any = None


def renorm_op() -> Any:
    """``ortcore_aten::embedding_renorm(weight, indices, max_norm, norm_type)``, defined on first use."""
    global _renorm_packet
    with _renorm_lock:
        if _renorm_packet is None:
            library = aten_nodes.helper_library()
            library.define(f"{RENORM_OP}(Tensor weight, Tensor indices, float max_norm, float norm_type) -> Tensor")

            def through(weight: torch.Tensor, indices: torch.Tensor, max_norm: float, norm_type: float) -> torch.Tensor:
                with torch.no_grad():
                    torch.embedding_renorm_(weight.detach(), indices.contiguous(), max_norm, norm_type)
                return weight.clone()  # the renormalized values; the gradient passes through unchanged

            # CompositeImplicitAutograd: autograd sees only the clone, so the renormalization is not differentiated.
            library.impl(RENORM_OP, through, "CompositeImplicitAutograd")
            _renorm_packet = getattr(getattr(torch.ops, aten_nodes.HELPER_NAMESPACE), RENORM_OP)
        return _renorm_packet


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


def renorm_program(program: torch.export.ExportedProgram, reach: Any = None) -> list[torch.fx.Node]:
    """The dynamo route's :func:`embedding_exact`: an ``embedding_renorm_`` of (a detached alias of) a weight makes
    the later lookups of that weight read :func:`renorm_op`'s result instead; returns the nodes made."""
    graph = program.graph_module.graph
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    made = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding_renorm_.default:
            continue
        alias, indices, max_norm, norm_type = node.args[:4]
        weight = alias
        while isinstance(weight, torch.fx.Node) and weight.target in (aten.detach.default, aten.alias.default):
            weight = weight.args[0]
        lookups = [
            user
            for user in weight.users
            if user.target is aten.embedding.default and user.args[0] is weight and order[user] > order[node]
        ]
        with graph.inserting_before(node):
            renormed = graph.call_function(renorm_op().default, (weight, indices, float(max_norm), float(norm_type)))
        renormed.meta["val"] = weight.meta.get("val")
        for user in lookups:
            user.replace_input_with(weight, renormed)
        graph.erase_node(node)
        if isinstance(alias, torch.fx.Node) and alias is not weight and not alias.users:
            graph.erase_node(alias)
        made.append(renormed)
    if made:
        program.graph_module.recompile()
    return made


def _view_root(node: torch.fx.Node) -> torch.fx.Node:
    while (
        node.op == "call_function"
        and getattr(node.target, "is_view", False)
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
    ):
        node = node.args[0]
    return node


def as_strided_program(program: torch.export.ExportedProgram) -> int:
    """The dynamo route's :func:`as_strided_exact`: each ``aten.as_strided`` call of ``program`` whose input is not
    contiguous from its storage's start reads from the tensor owning the memory, in storage order (from the fake
    tensors' strides and offsets)."""
    graph = program.graph_module.graph
    aten = torch.ops.aten
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.as_strided.default:
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        size, stride = node.args[1], node.args[2]
        given = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        start = _number(value.storage_offset())
        if value.is_contiguous() and (given is None or start == 0):
            continue
        root = _view_root(source)
        owner = root.meta.get("val")
        if not isinstance(owner, torch.Tensor):
            continue
        order = storage_order(
            tuple(_number(n) for n in owner.shape),
            tuple(_number(s) for s in owner.stride()),
            _number(owner.storage_offset()),
        )
        if order is None:
            raise _gap_error("of a tensor whose memory has gaps (a strided slice)")
        offset = start if given is None else _number(given)
        first, last = _reads(size, stride, offset)
        if first < order.start or last >= order.start + order.numel:
            raise _gap_error(f"{first}..{last}, outside the {order.numel} its owner covers from {order.start}")
        with graph.inserting_before(node):
            flat = root
            for d in order.drop:
                flat = graph.call_function(aten.select.int, (flat, d, 0))
            if order.permutation != tuple(range(len(order.permutation))):
                flat = graph.call_function(aten.permute.default, (flat, list(order.permutation)))
            flat = graph.call_function(aten.reshape.default, (flat, [-1]))
            replacement = graph.call_function(aten.as_strided.default, (flat, size, stride, offset - order.start))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        changed += 1
    if changed:
        _note_routed("as_strided", AS_STRIDED_REASON, kind="written in storage order")
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return changed


def symbolics_for_failure(error: UnsupportedModelError, symbolics: dict[str, Any]) -> dict[str, Any] | None:
    """The TorchScript route (``ortcore_export_failed``): when the exporter failed on a call of an ``aten::`` op
    (its symbolic refuses these arguments, or there is none), that op's calls the exporter fails on as ATen nodes
    run by PyTorch (:func:`routed_on_failure`); None when the failure names no such op, or the op was routed on
    failure already (the core then raises)."""
    op = failed_op(error)
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


@contextlib.contextmanager
def exact_tracing(never: frozenset[str]) -> Iterator[None]:
    """Around a TorchScript export (``ortcore_export_context``): ``as_strided`` and ``F.embedding`` with
    ``max_norm`` traced exactly (:class:`_ExactTracing`), and the ops routed on failure counted afresh."""
    _failed_ops.clear()
    with _ExactTracing(never):
        yield


# Python operators traced under their dunder names, and the ops they are (same overloads and arguments).
_NAMED = {
    "__and__": "bitwise_and",
    "__or__": "bitwise_or",
    "__xor__": "bitwise_xor",
    "__lshift__": "bitwise_left_shift",
    "__rshift__": "bitwise_right_shift",
}
EXPORTER_FAILED = "the TorchScript exporter fails on this call (its symbolic refuses the arguments)"


def failed_op(error: BaseException) -> str | None:
    """The ``aten::`` op whose symbolic raised ``error`` (or its cause): read from the exporter's own frame that
    was converting the node (``_run_symbolic_function``), since the messages do not always name the op."""
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
    return None


def _registered_symbolic(op: str) -> Callable[..., Any] | None:
    from torch.onnx._internal.torchscript_exporter import registration

    group = registration.registry.get_function_group(f"aten::{op}")
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


def routed_on_failure(op: str, previous: Callable[..., Any] | None) -> Callable[..., Any]:
    """The symbolic of ``aten::<op>`` after the exporter failed on it: ``previous`` (the symbolic that failed) where
    it succeeds, else one ATen node run by PyTorch (calls the exporter writes stay in ORT). Without a ``previous``
    (the exporter has no symbolic for the op) every call is routed, for that reason."""

    def symbolic(g: Any, *args: Any, **kwargs: Any) -> Any:
        if previous is not None:
            try:
                return previous(g, *args, **kwargs)
            except Exception:  # noqa: BLE001 (any failure of the exporter's symbolic: the call is routed)
                pass
        schema = match_overload(op, args, g.original_node)
        if schema is None:
            schema, args = _functional_call(op, args)
        if schema is None:
            raise UnsupportedModelError(f"the op_routing plugin cannot run aten::{op}: no overload fits the call")
        return _emit(g, op, schema, args, EXPORTER_FAILED if previous is not None else EXPORTER_GAP)

    symbolic.__name__ = f"op_routing_failed_{op}"
    symbolic.routes_failures = True  # symbolics_for_failure: this op is routed on failure already
    return symbolic


_REASONS = {r.op: r.reason for r in ROUTES}
_PROGRAM_REASONS: dict[str, str] = {}
for _route in PROGRAM_ROUTES:
    for _op in _route.ops:
        _PROGRAM_REASONS.setdefault(_op, _route.route.reason)


_CORE_OPS = {
    "detach_copy": "a detach() inside a gradient path: a stop-gradient, which ORT has no op for",
    RENORM_OP: RENORM_REASON,
}


def add_reasons(model: onnx.ModelProto, dynamo: bool = False) -> None:
    """Record ``ortcore.routed::<op>`` = reason for every ATen node of the exported ``model`` (exported by the
    TorchScript exporter, or by the dynamo exporter: the ops and reasons differ)."""
    routes, gap = (_PROGRAM_REASONS, EXPORTER_GAP_DYNAMO) if dynamo else (_REASONS, EXPORTER_GAP)
    reasons: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "ATen" or node.domain != ATEN_DOMAIN:
            continue
        # Keyed as explain() reads it: the op kind the node serves (a wrapper's or helper's op, layer_norm for
        # native_layer_norm, linear for addmm).
        op = aten_kind(operator_of(node))
        speed = FASTER_IN_TORCH if op in ROUTABLE_OPS else None
        failed = None if dynamo or op not in _failed_ops else EXPORTER_FAILED
        decided = _decided.get(op) if dynamo else None
        reasons.setdefault(op, decided or failed or routes.get(op) or _CORE_OPS.get(op) or speed or gap)
    known = {p.key for p in model.metadata_props}
    for op, reason in sorted(reasons.items()):
        if METADATA_PREFIX + op not in known:
            model.metadata_props.add(key=METADATA_PREFIX + op, value=reason)


def _reasons_pass(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """After the other passes (tanh-GELU adds ATen nodes): every ATen node's op has a recorded reason."""
    before = len(model.metadata_props)
    add_reasons(model, dynamo=context is not None and exporter_name(context.config) == DYNAMO)
    return len(model.metadata_props) - before


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return OpRoutingOptions


@hookimpl
def ortcore_configure(config: Config) -> None:
    if _options(config).enabled:
        prepare_runtime()


@hookimpl
def ortcore_export_symbolics(config: Config) -> dict[str, Any]:
    return symbolics(config)


@hookimpl
def ortcore_export_failed(config: Config, error: Any, symbolics: dict[str, Any]) -> dict[str, Any] | None:
    if not _options(config).enabled or exporter_name(config) != TORCHSCRIPT:
        return None  # routing by symbolics is the TorchScript route's
    return symbolics_for_failure(error, symbolics)


@hookimpl
def ortcore_export_context(config: Config, module: Any) -> Any:
    if not _options(config).enabled or exporter_name(config) != TORCHSCRIPT:
        return None
    return exact_tracing(frozenset(_options(config).never))


@hookimpl
def ortcore_program_passes(config: Config) -> list[GraphPass]:
    """The dynamo route: routed calls and ops the exporter cannot translate become wrapper ops (ATen nodes)."""
    if not _options(config).enabled:
        return []
    return [GraphPass(PROGRAM_PASS, run=_route_program)]


@hookimpl
def ortcore_export_translations(config: Config) -> dict[Any, Any]:
    """The translations of the wrapper ops the program passes made (one ATen node each)."""
    if not _options(config).enabled:
        return {}
    return aten_program.translations()


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    if not _options(config).enabled:
        return []
    # type_aten_outputs is idempotent: aten_fallback may run it too.
    return [
        GraphPass(TYPES_PASS, run=type_aten_outputs),
        GraphPass(REASONS_PASS, run=_reasons_pass),
        GraphPass(DISTINCT_PASS, run=_distinct_inputs),
    ]


def _distinct_inputs(model: onnx.ModelProto, context: PassContext) -> int:
    """No value read by two ATen nodes (ORT would define a gradient of it twice), and on the dynamo route, whose
    optimizer merges equal values, no value twice among an ATen node's inputs (idempotent: aten_fallback may run it
    too)."""
    separated = aten_program.separate_shared_aten_inputs(model)
    if exporter_name(context.config) != DYNAMO:
        return separated
    return separated + aten_program.distinct_aten_inputs(model)


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    options = _options(config)
    return {
        "op_routing": {"enabled": options.enabled, "never": sorted(options.never)},
        "op_routing.never_rewritten": sorted(frozenset(options.never) & REWRITES),
    }


@hookimpl
def ortcore_session_plan(config: Config, graph: Any, plan: Any) -> None:
    """Executor failures in a graph with ATen nodes are raised from the run, and the gradients a routed op's helper
    nodes share are cleared around it (the ATen node service's guard, as ``aten_fallback`` installs it), also when
    that plugin is disabled."""
    if _options(config).enabled:
        aten_nodes.guard_runs(graph, plan)
