"""The TorchScript route's own symbolics: the ops ``torch.onnx.export(dynamo=False)`` writes in a way ORT's
training engine cannot build, differentiate or run as PyTorch computes them.

:data:`SYMBOLICS` is what the ``torchscript_exporter`` plugin's exporter starts from (plugins' symbolics are added
over it). Plugins that replace one of these symbolics for some calls fall back to it for the others through
:func:`exporter_symbolic` (``aten_fallback``'s layer norm, ``op_routing``'s ops it leaves on ORT).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import torch

from ortcore.api import STOP_GRADIENT, STOP_GRADIENT_DOMAIN, UnsupportedModelError

from .pooling import TorchScriptBuilder, _spatial, adaptive_average_pool, adaptive_max_pool, average_pool


def layer_norm(g, input, normalized_shape, weight, bias, eps, cudnn_enable=None):
    """``LayerNormalization`` with all three outputs: ORT's gradient builder reads the saved mean and inverse std.

    Plugins that route some layer norms elsewhere reuse this symbolic for the others.
    """
    from torch.onnx import symbolic_helper as sh

    shape = sh._get_const(normalized_shape, "is", "normalized_shape")
    dtype = input.type().dtype() or torch.float32  # missing affine parameters take the input's dtype
    if sh._is_none(weight):
        weight = g.op("Constant", value_t=torch.ones(shape, dtype=dtype))
    if sh._is_none(bias):
        bias = g.op("Constant", value_t=torch.zeros(shape, dtype=dtype))
    out, _mean, _inv_std = g.op(
        "LayerNormalization",
        input,
        weight,
        bias,
        epsilon_f=sh._get_const(eps, "f", "eps"),
        axis_i=-len(shape),
        outputs=3,
    )
    return out


def _diff(g, input, n, dim, prepend, append):
    # Hugging Face's mask code calls torch.diff, which the TorchScript exporter lacks.
    from torch.onnx import symbolic_helper as sh

    n = sh._get_const(n, "i", "n")
    dim = sh._get_const(dim, "i", "dim")
    parts = [p for p in (prepend, input, append) if not sh._is_none(p)]
    x = g.op("Concat", *parts, axis_i=dim) if len(parts) > 1 else input

    def const(v):
        return g.op("Constant", value_t=torch.tensor([v], dtype=torch.int64))

    for _ in range(n):
        head = g.op("Slice", x, const(1), const(2**62), const(dim))
        tail = g.op("Slice", x, const(0), const(-1), const(dim))
        x = g.op("Sub", head, tail)
    return x


def _max_pool(rank: int, with_indices: bool = False):
    """Max pooling as MaxPool's indices plus a Gather from the flattened input.

    ORT's CPU MaxPoolGrad reads static output shapes and crashes on dynamic axes; Gather's gradient has no such
    limit, and gathering at the argmax indices gives exactly torch's values and gradient. ``with_indices``
    (``return_indices=True``, ``max_pool<n>d_with_indices``) also returns torch's indices: MaxPool's flat index
    modulo the size of one (batch, channel) plane. Without it torch's own symbolic would write MaxPool + MaxPoolGrad,
    and the process dies.
    """

    def symbolic(g, input, kernel_size, stride, padding, dilation, ceil_mode):
        from torch.onnx import symbolic_helper as sh

        kernel = sh._get_const(kernel_size, "is", "kernel_size")
        stride = sh._get_const(stride, "is", "stride") or kernel
        padding = sh._get_const(padding, "is", "padding")
        dilation = sh._get_const(dilation, "is", "dilation")

        def expand(v):
            return list(v) * rank if len(v) == 1 else list(v)

        _values, indices = g.op(
            "MaxPool",
            input,
            kernel_shape_i=expand(kernel),
            strides_i=expand(stride),
            pads_i=expand(padding) * 2,
            dilations_i=expand(dilation),
            ceil_mode_i=int(sh._get_const(ceil_mode, "i", "ceil_mode")),
            outputs=2,
        )
        flat = g.op("Reshape", input, g.op("Constant", value_t=torch.tensor([-1], dtype=torch.int64)))
        values = g.op("Gather", flat, indices, axis_i=0)
        if not with_indices:
            return values
        spatial = g.op(
            "Slice",
            g.op("Shape", input),
            g.op("Constant", value_t=torch.tensor([2], dtype=torch.int64)),
            g.op("Constant", value_t=torch.tensor([2**62], dtype=torch.int64)),
        )
        return values, g.op("Mod", indices, g.op("ReduceProd", spatial, keepdims_i=1))

    return symbolic


def _adaptive_avg_pool(g, input, output_size):
    """The ``adaptive_avg_pool{1,2,3}d`` symbolic: :func:`adaptive_average_pool`."""
    from torch.onnx import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import _type_utils

    sizes = sh._get_const(output_size, "is", "output_size")
    dtype = _type_utils.JitScalarType.from_value(input, _type_utils.JitScalarType.FLOAT).onnx_type()
    rank = sh._get_tensor_rank(input)
    return adaptive_average_pool(TorchScriptBuilder(g), input, list(sizes), int(dtype), rank)


def _adaptive_max_pool(g, input, output_size):
    """The ``adaptive_max_pool{1,2,3}d`` symbolic: :func:`adaptive_max_pool` and its indices.

    torch's symbolic exports a ``MaxPool`` whose kernel is fixed for the exporting call's size (another size gets
    the wrong windows), or ``GlobalMaxPool``, which ORT cannot differentiate.
    """
    from torch.onnx import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import _type_utils

    sizes = sh._get_const(output_size, "is", "output_size")
    dtype = _type_utils.JitScalarType.from_value(input, _type_utils.JitScalarType.FLOAT).onnx_type()
    return adaptive_max_pool(TorchScriptBuilder(g), input, list(sizes), int(dtype))


def _avg_pool(rank: int):
    """The ``avg_pool{rank}d`` symbolic: :func:`average_pool` for float32 inputs, ONNX's ``AveragePool`` (as torch
    exports it) for other types, which ``Conv`` does not take on CPU."""

    def symbolic(g, input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override=None):
        from torch.onnx import symbolic_helper as sh

        kernel = sh._get_const(kernel_size, "is", "kernel_size")
        strides = sh._get_const(stride, "is", "stride")
        pads = sh._get_const(padding, "is", "padding")
        ceil = bool(sh._get_const(ceil_mode, "i", "ceil_mode"))
        include_pad = bool(sh._get_const(count_include_pad, "i", "count_include_pad"))
        divisor = None
        if divisor_override is not None and not sh._is_none(divisor_override):
            divisor = sh._get_const(divisor_override, "i", "divisor_override")
        b = TorchScriptBuilder(g)
        if input.type().scalarType() in (None, "Float"):
            return average_pool(b, input, rank, kernel, strides, pads, ceil, include_pad, divisor)
        if divisor:
            raise UnsupportedModelError(
                f"avg_pool{rank}d with divisor_override on {input.type().scalarType()} inputs: ONNX's AveragePool "
                "has no divisor (only float32 pooling is rewritten)"
            )
        kernel_shape = _spatial(kernel, rank, "kernel_size")
        return g.op(
            "AveragePool",
            input,
            kernel_shape_i=kernel_shape,
            strides_i=_spatial(strides, rank, "stride") if strides else kernel_shape,
            pads_i=_spatial(pads, rank, "padding") * 2,
            ceil_mode_i=int(ceil),
            count_include_pad_i=int(include_pad),
        )

    return symbolic


def _batch_norm(g, input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """Eval-mode batch norm as arithmetic on the running statistics.

    ORT's gradient builder turns an eval-mode BatchNormalization into a training-mode one, which would normalize
    with batch statistics when an eval-mode model is differentiated (fine-tuning with frozen statistics).
    """
    from torch.onnx import symbolic_helper as sh
    from torch.onnx import symbolic_opset14

    rank = sh._get_tensor_rank(input)
    if sh._get_const(training, "i", "training") or rank is None or sh._is_none(running_mean):
        return symbolic_opset14.batch_norm(
            g, input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
        )
    channel_shape = g.op("Constant", value_t=torch.tensor([-1] + [1] * (rank - 2), dtype=torch.int64))

    def per_channel(value):
        return g.op("Reshape", value, channel_shape)

    epsilon = g.op("Constant", value_t=torch.tensor(sh._get_const(eps, "f", "eps"), dtype=torch.float32))
    epsilon = g.op("CastLike", epsilon, running_var)
    scale = g.op("Reciprocal", g.op("Sqrt", g.op("Add", running_var, epsilon)))
    if not sh._is_none(weight):
        scale = g.op("Mul", scale, weight)
    out = g.op("Mul", g.op("Sub", input, per_channel(running_mean)), per_channel(scale))
    return out if sh._is_none(bias) else g.op("Add", out, per_channel(bias))


def _detach(g, input):
    # The exporter erases detach (ONNX is inference-only); keep it as a marker that ortcore resolves before the
    # gradient build: a detached output becomes non-differentiable, a detach inside a gradient path is refused.
    return g.op(f"{STOP_GRADIENT_DOMAIN}::{STOP_GRADIENT}", input)


def _copy(g, self, src, non_blocking=None):
    # ``buf.copy_(src)`` on a graph input (a buffer the forward writes): the exporter removes the mutation and leaves
    # aten::copy, which it has no symbolic for. The value is src in self's type, broadcast to self's shape.
    # (Cast, not CastLike: ORT has no gradient for CastLike, and src may carry one.)
    from torch.onnx._internal.torchscript_exporter import _type_utils

    target = _type_utils.JitScalarType.from_value(self, _type_utils.JitScalarType.UNDEFINED)
    if target != _type_utils.JitScalarType.UNDEFINED and target != _type_utils.JitScalarType.from_value(
        src, _type_utils.JitScalarType.UNDEFINED
    ):
        src = g.op("Cast", src, to_i=target.onnx_type())
    return g.op("Expand", src, g.op("Shape", self))


def _cumsum(g, input, dim, dtype=None):
    # torch sums booleans as int64 (Hugging Face's mask code does); ONNX CumSum has no bool type.
    from torch.onnx import symbolic_opset11

    if input.type().scalarType() == "Bool":
        input = g.op("Cast", input, to_i=onnx.TensorProto.INT64)
    return symbolic_opset11.cumsum(g, input, dim, dtype)


def _diagonal(g, *args):
    # ORT 1.19.2 aborts the whole process (a std::vector bounds assertion) building or running diagonal's export:
    # refuse it before ORT sees it. The op_routing plugin replaces this symbolic and runs the op on PyTorch.
    raise UnsupportedModelError(
        "aten::diagonal: ONNX Runtime aborts the process on its exported graph; the 'op_routing' plugin runs it on "
        "PyTorch's kernel inside the ORT graph (enable it, and do not list diagonal in its 'never' option)"
    )


def _squeeze(g, self, dim=None):
    """``squeeze(dim)`` as one Squeeze when the size there is unknown.

    Every input dimension is exported dynamic, so torch's symbolic guards such a dimension with an If (squeeze only if
    it is 1), and ORT cannot build a training graph holding an If. The call being traced has size 1 there unless its
    squeeze is a no-op, which torch's symbolic cannot tell either; a call whose size is not 1 there fails in ORT's
    Squeeze, naming the dimension, instead of running other code silently. Known sizes keep torch's symbolic.
    """
    from torch.onnx import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import symbolic_opset11

    if dim is None or not sh._is_constant(dim):
        return symbolic_opset11.squeeze(g, self, dim)
    axis = sh._get_const(dim, "i", "dim")
    rank = sh._get_tensor_rank(self)
    if rank is None or sh._get_tensor_dim_size(self, axis + rank if axis < 0 else axis) is not None:
        return symbolic_opset11.squeeze(g, self, dim)
    return sh._squeeze_helper(g, self, [axis])


def _constant_chunk(g, self, chunks, dim):
    """``chunk`` as one Split. torch's symbolic exports one Slice per chunk, whose gradients are SliceGrads summed;
    Split's gradient is one SplitGrad (a concatenation). Chunk sizes are torch's: ``ceil(n / chunks)``, the last
    takes the rest."""
    if chunks == 1:
        return self

    def const(value: int):
        return g.op("Constant", value_t=torch.tensor([value], dtype=torch.int64))

    size = g.op("Gather", g.op("Shape", self), const(dim), axis_i=0)
    chunk = g.op("Div", g.op("Add", size, const(chunks - 1)), const(chunks))
    last = g.op("Sub", size, g.op("Mul", chunk, const(chunks - 1)))
    sizes = g.op("Concat", g.op("Expand", chunk, const(chunks - 1)), last, axis_i=0)
    return g.op("Split", self, sizes, axis_i=dim, outputs=chunks)


def _cross_entropy_loss(g, self, target, weight, reduction, ignore_index, label_smoothing):
    """Cross-entropy whose ``ignore_index`` is computed in the graph (``CrossEntropyLoss(ignore_index=x.size(1))``) as
    ORT's SoftmaxCrossEntropyLossInternal, which takes it as an input; ONNX's SoftmaxCrossEntropyLoss needs a
    constant, so torch's symbolic refuses it. A constant ``ignore_index`` keeps torch's symbolic."""
    from torch.onnx import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import symbolic_opset12

    if sh._is_constant(ignore_index) or sh._maybe_get_const(label_smoothing, "f") != 0.0:
        return symbolic_opset12.cross_entropy_loss(g, self, target, weight, reduction, ignore_index, label_smoothing)
    reduction_name = ("none", "mean", "sum")[sh._maybe_get_const(reduction, "i")]
    ignore_index = g.op("Cast", ignore_index, to_i=onnx.TensorProto.INT64)
    loss, _log_prob = g.op(
        "com.microsoft::SoftmaxCrossEntropyLossInternal",
        self,
        target,
        weight,
        ignore_index,
        reduction_s=reduction_name,
        outputs=2,
    )
    return loss


def _scaled_dot_product_attention(
    g, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Attention for bfloat16 and float16 queries in the query's type; the exporter's own for other types.

    The exporter's symbolic writes its constants in float32: a boolean or causal mask becomes a float32 additive
    mask, and adding it promotes the scores, the softmax and the attention's output to float32, so the rest of a
    bfloat16 model computed in float32 where PyTorch computes bfloat16 (GPT-2's residual then reached a bfloat16
    layer norm as float32). An explicit ``scale`` it casts itself, writing PyTorch's number of the type (bfloat16: 15)
    as an ONNX one (15 is complex128: "ScalarType ComplexDouble is an unexpected tensor scalar type"). Here every
    constant and mask is of the query's type; a fully masked row gives zeros, as the exporter's symbolic does."""
    from torch.onnx import symbolic_helper as sh
    from torch.onnx import symbolic_opset14

    dtype = query.type().dtype() if query.type().scalarType() is not None else None
    if dtype not in (torch.bfloat16, torch.float16) or sh._maybe_get_const(enable_gqa, "b") is True:
        return symbolic_opset14.scaled_dot_product_attention(
            g, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
    onnx_type = onnx.TensorProto.BFLOAT16 if dtype == torch.bfloat16 else onnx.TensorProto.FLOAT16

    def constant(v: float) -> Any:
        return g.op("Constant", value_t=torch.tensor([v], dtype=dtype))

    if scale is None or sh._is_none(scale):
        scale = symbolic_opset14._attention_scale(g, query)  # a Cast to the query's ONNX type: correct
    else:
        given = sh._maybe_get_const(scale, "f")
        scale = constant(float(given)) if isinstance(given, float) else g.op("Cast", scale, to_i=onnx_type)
    rank = sh._get_tensor_rank(key)
    perm = list(range(rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    root = g.op("Sqrt", scale)
    scores = g.op("MatMul", g.op("Mul", query, root), g.op("Mul", g.op("Transpose", key, perm_i=perm), root))
    causal = sh._maybe_get_const(is_causal, "b")
    boolean = False
    if causal is True:
        attn_mask = g.op("Cast", symbolic_opset14._causal_attention_mask(g, query, key), to_i=onnx_type)
    elif attn_mask is not None and not sh._is_none(attn_mask):
        if attn_mask.type().scalarType() == "Bool":
            boolean = True
            attn_mask = g.op("Where", attn_mask, constant(0.0), constant(-float("inf")))
        elif attn_mask.type().dtype() != dtype:
            attn_mask = g.op("Cast", attn_mask, to_i=onnx_type)
    else:
        attn_mask = None
    if attn_mask is not None:
        scores = g.op("Add", scores, attn_mask)
    weights = g.op("Softmax", scores, axis_i=-1)
    if boolean:  # a row masked everywhere: zeros, not NaN
        weights = g.op("Where", g.op("IsNaN", weights), constant(0.0), weights)
    p = sh._maybe_get_const(dropout_p, "f")
    if not (isinstance(p, float) and p == 0.0):
        weights = g.op("Dropout", weights, g.op("Constant", value_t=torch.tensor(p, dtype=torch.float)))
    return g.op("MatMul", weights, value)


# Binary ops and the positions of their tensor operands (``where``'s condition is not promoted).
_PROMOTED_OPERANDS = {
    **{
        op: (0, 1)
        for op in (
            "add",
            "sub",
            "rsub",
            "mul",
            "div",
            "true_divide",
            "pow",
            "minimum",
            "maximum",
            "remainder",
            "fmod",
            "atan2",
            "floor_divide",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
            "ge",
        )
    },
    "where": (1, 2),
}


def _bfloat16_promotion(op: str) -> Callable[..., Any]:
    """The exporter's symbolic of a binary ``aten::<op>``, with operands of different floating types cast to
    PyTorch's result type first when one of them is bfloat16.

    The exporter's implicit casts (its scalar type analysis) know every type but bfloat16: a bfloat16 tensor times a
    float32 0-dim tensor (CLIP's ``logit_scale.exp() * logits`` under autocast, any bfloat16 model with a float32
    scalar parameter) was left with mixed inputs and stopped the export ("output_scalar_type == input_tensor_type
    INTERNAL ASSERT FAILED"). PyTorch's promotion decides the type (a 0-dim operand does not widen a dimensioned
    one); other operands are left to the exporter, which casts them as PyTorch does."""
    from torch.onnx import symbolic_helper as sh
    from torch.onnx._internal.torchscript_exporter import _type_utils, registration

    positions = _PROMOTED_OPERANDS[op]

    def base(opset: int) -> Callable[..., Any]:
        versions = registration.registry.get_function_group(f"aten::{op}")._functions._base
        return versions[max(v for v in versions if v <= opset)]

    def operand(value: Any) -> torch.Tensor | None:
        """An empty tensor of the operand's type and rank class (0-dim or not), or None if either is unknown."""
        try:
            dtype = value.type().dtype()
        except (AttributeError, RuntimeError):
            return None
        rank = sh._get_tensor_rank(value)
        return None if rank is None else torch.empty((1,) * min(rank, 1), dtype=dtype)

    def symbolic(g, *args):
        samples = [operand(args[i]) if i < len(args) else None for i in positions]
        if all(s is not None for s in samples) and any(s.dtype == torch.bfloat16 for s in samples):
            dtypes = {s.dtype for s in samples}
            if len(dtypes) > 1 and all(d.is_floating_point for d in dtypes):
                target = torch.result_type(*samples)
                onnx_type = _type_utils.JitScalarType.from_dtype(target).onnx_type()
                args = list(args)
                for i, sample in zip(positions, samples, strict=True):
                    if sample.dtype != target:
                        args[i] = g.op("Cast", args[i], to_i=onnx_type)
        return base(g.opset)(g, *args)

    return symbolic


SYMBOLICS = {
    **{f"::{op}": _bfloat16_promotion(op) for op in _PROMOTED_OPERANDS},
    "::scaled_dot_product_attention": _scaled_dot_product_attention,
    "::batch_norm": _batch_norm,
    "::detach": _detach,
    "::cumsum": _cumsum,
    "::copy": _copy,
    "::layer_norm": layer_norm,
    "::diff": _diff,
    "::diagonal": _diagonal,
    "::squeeze": _squeeze,
    "prim::ConstantChunk": _constant_chunk,
    "::cross_entropy_loss": _cross_entropy_loss,
    "::max_pool1d": _max_pool(1),
    "::max_pool2d": _max_pool(2),
    "::max_pool3d": _max_pool(3),
    "::max_pool1d_with_indices": _max_pool(1, with_indices=True),
    "::max_pool2d_with_indices": _max_pool(2, with_indices=True),
    "::max_pool3d_with_indices": _max_pool(3, with_indices=True),
    "::avg_pool1d": _avg_pool(1),
    "::avg_pool2d": _avg_pool(2),
    "::avg_pool3d": _avg_pool(3),
    "::adaptive_avg_pool1d": _adaptive_avg_pool,
    "::adaptive_avg_pool2d": _adaptive_avg_pool,
    "::adaptive_avg_pool3d": _adaptive_avg_pool,
    "::adaptive_max_pool1d": _adaptive_max_pool,
    "::adaptive_max_pool2d": _adaptive_max_pool,
    "::adaptive_max_pool3d": _adaptive_max_pool,
}


def exporter_symbolic(name: str) -> Callable[..., Any] | None:
    """The TorchScript exporter's own symbolic for ``name`` (``"::layer_norm"`` for ``aten::layer_norm``,
    ``"prim::ConstantChunk"``), or None: what a plugin's own symbolic falls back to for the cases it leaves alone."""
    return SYMBOLICS.get(name)
