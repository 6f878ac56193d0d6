"""What both routes of op routing share: the ops ORT cannot serve and why (:data:`ROUTES`), the log line of each
routed op, the reasons recorded in the exported graph for ``explain``, and what both routes need to write
``as_strided`` (in storage order) and ``embedding(max_norm=...)`` (through :func:`renorm_op`) as torch computes them.

Nothing here reads an exporter's graph: each route says which of its calls a route applies to (:mod:`.torchscript`,
:mod:`.dynamo`), so that dropping an exporter means deleting its module.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import attrs
import onnx
import torch

from ortcore.api import ROUTED_METADATA_PREFIX, UnsupportedModelError, aten_kind, operator_of
from ortcore_plugins.services import aten_nodes
from ortcore_plugins.services.aten_nodes import ATEN_DOMAIN
from ortcore_plugins.services.torch_kernels import ROUTABLE_OPS

logger = logging.getLogger("ortcore.op_routing")

WRAPPER_NAMESPACE = aten_nodes.WRAPPER_NAMESPACE
METADATA_PREFIX = ROUTED_METADATA_PREFIX
FASTER_IN_TORCH = "PyTorch's kernel is faster on CPU (aten_fallback torch_kernels)"


# -- what ORT cannot do --------------------------------------------------------------------------------------------


@attrs.frozen
class Route:
    """An aten op ORT cannot serve, and why. Which of its calls the route applies to is each exporter's to say, as its
    graph holds them (:data:`.torchscript.TRACED_CALLS`, :data:`.dynamo.PROGRAM_ROUTES`)."""

    op: str  # aten op name
    onnx_op: str  # what the exporter would give ORT
    reason: str
    devices: frozenset[str] = frozenset({"cpu", "cuda"})  # where ORT lacks it
    # ORT lacks only the gradient: a call on integers or booleans (a mask's cumsum) stays in ORT.
    gradient_only: bool = True
    # Route only a call a gradient may reach from a trained value (read from the traced graph, see may_need_grad):
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


_NO_GRAD = "ORT has no gradient builder for {}"
_NO_GRAD_KERNEL = "ORT has no CPU kernel for {}"
_SCATTER_GRAD = "ORT's gradient of a scatter with reduction drops the gradient of self at the scattered positions"

# A packed sequence: pack_padded_sequence -> an RNN over the PackedSequence -> pad_packed_sequence. ORT's training
# kernels reject the sequence lengths the exporter gives an RNN over a packed input, and the exporter writes pack and
# pad only as a pair around an RNN it exports itself ("must occur in pairs"): the three calls run on PyTorch's kernels,
# a connected region of ATen nodes inside the ORT graph (what lies between them, such as the initial state, and around
# them stays in ORT).
PACKED_REASON = (
    "a packed sequence: pack_padded_sequence, the RNN over it and pad_packed_sequence run on PyTorch as one "
    "connected region (ORT's LSTM/GRU training kernels reject sequence lengths, and the exporter writes pack and pad "
    "only as a pair around an RNN it exports itself)"
)
# The RNN ops whose ``data`` overload takes a packed sequence (data and batch sizes).
PACKED_RNN_OPS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})

ROUTES: tuple[Route, ...] = (
    Route("_pack_padded_sequence", "PackPadded (removed around an exported RNN)", PACKED_REASON, gradient_only=False),
    Route("_pad_packed_sequence", "PadPacked (removed around an exported RNN)", PACKED_REASON, gradient_only=False),
    Route("hardswish", "HardSwish", _NO_GRAD.format("HardSwish")),
    Route("hardsigmoid", "HardSigmoid", _NO_GRAD.format("HardSigmoid")),
    Route("einsum", "Einsum", _NO_GRAD.format("Einsum")),
    Route("cumsum", "CumSum", _NO_GRAD.format("CumSum")),
    Route("instance_norm", "InstanceNormalization", _NO_GRAD.format("InstanceNormalization")),
    Route("group_norm", "InstanceNormalization", _NO_GRAD.format("InstanceNormalization (GroupNorm's export)")),
    Route("amax", "ReduceMax", _NO_GRAD.format("ReduceMax")),
    Route("amin", "ReduceMin", _NO_GRAD.format("ReduceMin")),
    Route("max", "ReduceMax", _NO_GRAD.format("ReduceMax")),
    Route("min", "ReduceMin", _NO_GRAD.format("ReduceMin")),
    Route("gru", "GRU", "ORT's GRU training kernels support only the forward direction"),
    Route("lstm", "LSTM", "ORT's LSTM training kernels support only the forward direction"),
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
        gradient_only=False,
    ),
    Route(
        "floor_divide",
        "Div/Where",
        "the exporter's integer floor division rounds some negative quotients the wrong way",
        gradient_only=False,
    ),
    Route("div", "Floor/Sign", _NO_GRAD.format("Floor and Sign (div with rounding_mode)"), traced_gradient=True),
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
    ),
    Route(
        "linalg_vector_norm",
        "ReduceL1/ReduceL2/ReduceMax",
        "ORT has no gradient builder for ReduceL1 and ReduceMax, and its ReduceL2 gradient writes an invalid Unsqueeze "
        "when the reduced dimensions are dropped",
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

# The reason of each route, by op: what explain() shows for a routed op the exporter's own route table names.
ROUTE_REASONS = {r.op: r.reason for r in ROUTES}


# -- what was routed ------------------------------------------------------------------------------------------------


_logged: set[tuple[str, str]] = set()


def _note_routed(op: str, reason: str, kind: str = "runs on PyTorch's kernel inside the ORT graph") -> None:
    if (op, reason) not in _logged:
        _logged.add((op, reason))
        name = op if "::" in op else f"aten::{op}"
        logger.info("%s %s: %s", name, kind, reason)


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


# -- the reasons explain() reads ------------------------------------------------------------------------------------


_CORE_OPS = {
    "detach_copy": "a detach() inside a gradient path: a stop-gradient, which ORT has no op for",
    RENORM_OP: RENORM_REASON,
}


def add_reasons(model: onnx.ModelProto, routes: Mapping[str, str], gap: str, decided: Mapping[str, str]) -> None:
    """Record ``ortcore.routed::<op>`` = reason for every ATen node of the exported ``model``. The ops and reasons
    differ by exporter, which gives them: ``decided``, the reasons of this export's calls (a route picked among an
    op's several, a symbolic that failed); ``routes``, its route table's; ``gap``, an op it has no form of."""
    reasons: dict[str, str] = {}
    for node in model.graph.node:
        if node.op_type != "ATen" or node.domain != ATEN_DOMAIN:
            continue
        # Keyed as explain() reads it: the op kind the node serves (a wrapper's or helper's op, layer_norm for
        # native_layer_norm, linear for addmm).
        op = aten_kind(operator_of(node))
        speed = FASTER_IN_TORCH if op in ROUTABLE_OPS else None
        reasons.setdefault(op, decided.get(op) or routes.get(op) or _CORE_OPS.get(op) or speed or gap)
    known = {p.key for p in model.metadata_props}
    for op, reason in sorted(reasons.items()):
        if METADATA_PREFIX + op not in known:
            model.metadata_props.add(key=METADATA_PREFIX + op, value=reason)
