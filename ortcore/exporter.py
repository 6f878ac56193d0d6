"""The exporter seam: turns a flat module (tensors in, tensors out) into an ``onnx.ModelProto``.

:class:`Exporter` is the whole interface the core relies on. :class:`TorchScriptExporter` is the default; another
exporter (the dynamo one, say) only has to implement ``export`` with the same contract: graph inputs named
``input_names`` followed by the module's parameters and buffers under their ``state_dict`` names, graph outputs
named ``output_names``, every input dimension dynamic.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import onnx
import torch

from .errors import UnsupportedDataError, UnsupportedModelError
from .markers import hookimpl
from .options import LogLevel

logger = logging.getLogger("ortcore")


@attrs.frozen
class ExportRequest:
    """What an exporter is asked to export: ``module`` (flat: tensors in, tensors out) called on ``args``, its graph
    inputs named ``input_names`` (the tensors of ``args``, then whatever the exporter adds, such as parameters),
    ``output_names`` (empty: the exporter's own), ``dynamic_axes`` per input name, in ``training`` mode, at
    ``opset``, logging at ``log_level``."""

    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    training: bool
    opset: int
    log_level: LogLevel


class Exporter(Protocol):
    """Turns a flat module into an ONNX graph (:class:`ExportRequest` in, ``onnx.ModelProto`` out). ``name`` is part
    of every graph key; an exporter with settings that change its graphs also defines ``fingerprint() -> dict``
    (JSON-serialisable) so that caches tell them apart."""

    name: str

    def export(self, request: ExportRequest) -> onnx.ModelProto: ...


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


class OnnxBuilder(Protocol):
    """Writes ONNX nodes for one exporter: ``op`` adds a node (attributes by their ONNX names: ints, lists of ints,
    floats, or a tensor), ``const`` a constant. Rewrites that both exporters share are written against it."""

    def op(self, op_type: str, *inputs: Any, **attributes: Any) -> Any: ...

    def const(self, value: torch.Tensor) -> Any: ...


class TorchScriptBuilder:
    """:class:`OnnxBuilder` over a TorchScript symbolic's graph context ``g``."""

    def __init__(self, g: Any):
        self.g = g

    def op(self, op_type: str, *inputs: Any, **attributes: Any) -> Any:
        typed = {}
        for key, value in attributes.items():
            suffix = "t" if isinstance(value, torch.Tensor) else "f" if isinstance(value, float) else "i"
            typed[f"{key}_{suffix}"] = value
        return self.g.op(op_type, *inputs, **typed)

    def const(self, value: torch.Tensor) -> Any:
        return self.g.op("Constant", value_t=value)


# Bumped whenever the graphs the pooling rewrites write change, so that export caches do not serve older graphs.
POOLING_VERSION = 1


def _ints(b: OnnxBuilder, values: list[int]) -> Any:
    return b.const(torch.tensor(values, dtype=torch.int64))


def _spatial(value: Any, rank: int, name: str) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == 1:
        values *= rank
    if len(values) != rank:
        raise UnsupportedModelError(f"average pooling over {rank} dimensions with {name}={values}")
    return values


def average_pool(
    b: OnnxBuilder,
    x: Any,
    rank: int,
    kernel_size: Any,
    stride: Any,
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Any:
    """torch's ``avg_pool{1,2,3}d`` over the last ``rank`` dimensions of a float32 ``x``, written as a sum by
    ``Conv`` with a kernel of ones divided by torch's divisor.

    ORT's CPU ``AveragePoolGrad`` takes its output shape from the graph's static shapes, which ortcore leaves
    symbolic: it dies of SIGFPE or returns an empty gradient. ``Conv``'s gradient reads shapes at run time. The
    channels are folded into the batch (``[-1, 1, *spatial]``), so one single-channel kernel serves every channel
    without knowing how many there are. ``ceil_mode``, ``count_include_pad`` and ``divisor_override`` follow torch:
    a window may run past the right edge in ceil mode (but never start in the right padding), and without
    ``count_include_pad`` (or in ceil mode) each output is divided by the number of positions its window covers
    (padding included or not), counted by the same convolution over ones.
    """
    kernel = _spatial(kernel_size, rank, "kernel_size")
    strides = _spatial(stride, rank, "stride") if stride else kernel
    pads = _spatial(padding, rank, "padding")
    # Ceil mode: s - 1 more zeros on the right give ceil((L + 2p - k) / s) + 1 windows; torch then drops a last
    # window that would start in the right padding (sliced off below).
    extra = [s - 1 if ceil_mode else 0 for s in strides]
    shape = b.op("Shape", x)
    sizes = b.op("Slice", shape, _ints(b, [-rank]), _ints(b, [2**62]))
    flat = b.op("Reshape", x, b.op("Concat", _ints(b, [-1, 1]), sizes, axis=0))
    ones = b.const(torch.ones([1, 1, *kernel]))

    def window_sums(value: Any, left: list[int], right: list[int]) -> Any:
        summed = b.op("Conv", value, ones, kernel_shape=kernel, strides=strides, pads=left + right)
        if not ceil_mode:
            return summed
        # o = ceil((L + 2p - k) / s) + 1, minus one where the last window starts at or past L + p (torch's rule)
        windows = b.op(
            "Add",
            b.op("Div", b.op("Add", sizes, _ints(b, [2 * p - k + s - 1 for p, k, s in zip(pads, kernel, strides)])),
                 _ints(b, strides)),
            _ints(b, [1] * rank),
        )  # fmt: skip
        last_start = b.op("Mul", b.op("Sub", windows, _ints(b, [1] * rank)), _ints(b, strides))
        past = b.op("GreaterOrEqual", last_start, b.op("Add", sizes, _ints(b, pads)))
        windows = b.op("Sub", windows, b.op("Cast", past, to=onnx.TensorProto.INT64))
        axes = list(range(2, 2 + rank))
        return b.op("Slice", summed, _ints(b, [0] * rank), windows, _ints(b, axes))

    summed = window_sums(flat, pads, [p + e for p, e in zip(pads, extra)])
    if divisor_override:
        divisor = b.const(torch.tensor(float(divisor_override)))
    elif not ceil_mode and (count_include_pad or not any(pads)):
        divisor = b.const(torch.tensor(float(math.prod(kernel))))  # every window is whole
    else:
        ones_shape = b.op("Concat", _ints(b, [1, 1]), sizes, axis=0)
        present = b.op("ConstantOfShape", ones_shape, value=torch.ones(1))
        if count_include_pad:  # padding counts, but not what ceil mode adds past it
            present = b.op("Pad", present, _ints(b, [0, 0, *pads, 0, 0, *pads]), b.const(torch.tensor(1.0)))
            divisor = window_sums(present, [0] * rank, extra)
        else:
            divisor = window_sums(present, pads, [p + e for p, e in zip(pads, extra)])
    pooled = b.op("Div", summed, divisor)
    leading = b.op("Slice", shape, _ints(b, [0]), _ints(b, [-rank]))
    pooled_sizes = b.op("Slice", b.op("Shape", pooled), _ints(b, [2]), _ints(b, [2**62]))
    return b.op("Reshape", pooled, b.op("Concat", leading, pooled_sizes, axis=0))


def adaptive_average_pool(
    b: OnnxBuilder, x: Any, output_size: list[int | None], dtype: int, x_rank: int | None = None
) -> Any:
    """torch's ``adaptive_avg_pool{1,2,3}d`` of ``x`` (ONNX element type ``dtype``) to ``output_size`` over its last
    ``len(output_size)`` dimensions, for any input size.

    Both exporters fix the windows for the exporting call's size (an ``AveragePool`` whose kernel divides it, or a
    decomposition into gathers), so another size gets the wrong windows or shape. Here each dimension is a product
    with a ``[L, o]`` matrix computed from the input's size at run time: window ``i`` covers ``floor(i * L / o)`` to
    ``ceil((i + 1) * L / o)``, as in torch, each weighted by one over its length. ``MatMul``'s gradient reads
    shapes at run time (``AveragePool``'s does not). Pooling a batched ``x`` (``x_rank`` known) to 1 everywhere is
    ``GlobalAveragePool``, whose gradient reads shapes at run time too.
    """
    rank = len(output_size)
    if x_rank == rank + 2 and all(size == 1 for size in output_size):
        return b.op("GlobalAveragePool", x)
    shape = b.op("Shape", x)
    for axis in reversed(range(rank)):  # the last dimension first, by a product on the right
        size = output_size[axis]
        if size is None:  # torch keeps this dimension as it is
            continue
        position = axis - rank  # negative: counted from the end
        length = b.op("Slice", shape, _ints(b, [position]), _ints(b, [position + 1 or 2**62]))
        inside, starts, ends = _window_masks(b, length, size)
        lengths = b.op("Cast", b.op("Sub", ends, starts), to=dtype)
        weights = b.op("Div", b.op("Cast", inside, to=dtype), lengths)
        if position == -1:
            x = b.op("MatMul", x, weights)
        elif position == -2:
            x = b.op("MatMul", b.op("Transpose", weights, perm=[1, 0]), x)
        else:  # [..., L, rest] -> [..., o, rest] -> [..., o, *rest]
            current = b.op("Shape", x)
            lead = b.op("Slice", current, _ints(b, [0]), _ints(b, [position + 1]))
            flat = b.op("Reshape", x, b.op("Concat", lead, _ints(b, [-1]), axis=0))
            pooled = b.op("MatMul", b.op("Transpose", weights, perm=[1, 0]), flat)
            outer = b.op("Slice", current, _ints(b, [0]), _ints(b, [position]))
            rest = b.op("Slice", current, _ints(b, [position + 1]), _ints(b, [2**62]))
            x = b.op("Reshape", pooled, b.op("Concat", outer, _ints(b, [size]), rest, axis=0))
    return x


def _window_masks(b: OnnxBuilder, length: Any, size: int) -> tuple[Any, Any, Any]:
    """``(inside [L, o] bool, starts [o], ends [o])`` of torch's adaptive windows over a dimension of ``length``
    (a 1-element int64 tensor): window ``i`` covers ``floor(i * L / o)`` to ``ceil((i + 1) * L / o)``."""
    scalar_length = b.op("Squeeze", length, _ints(b, [0]))
    at = b.op("Range", b.const(torch.tensor(0)), scalar_length, b.const(torch.tensor(1)))  # [L]
    windows = torch.arange(size)
    starts = b.op("Div", b.op("Mul", b.const(windows), length), _ints(b, [size]))
    ends = b.op("Div", b.op("Add", b.op("Mul", b.const(windows + 1), length), _ints(b, [size - 1])), _ints(b, [size]))
    column = b.op("Unsqueeze", at, _ints(b, [1]))  # [L, 1] against [o]: [L, o]
    inside = b.op("And", b.op("GreaterOrEqual", column, starts), b.op("Less", column, ends))
    return inside, starts, ends


def adaptive_max_pool(b: OnnxBuilder, x: Any, output_size: list[int], dtype: int) -> tuple[Any, Any]:
    """torch's ``adaptive_max_pool{1,2,3}d`` of ``x`` for any input size: ``(values, indices)``, the indices flat
    over the pooled dimensions as torch gives them.

    One dimension at a time (the maximum over a box is the maximum over each of its dimensions in turn): ``ArgMax``
    over each window, with the values outside it masked to -inf, then ``GatherElements`` at those indices, whose
    gradient reads shapes at run time. Ties go to the first index, as in torch, so the gradient lands where torch
    puts it."""
    rank = len(output_size)
    lowest = b.op("Cast", b.const(torch.tensor(float("-inf"))), to=dtype)
    flat: Any = None
    stride: Any = None
    for axis in reversed(range(rank)):
        size = output_size[axis]
        position = axis - rank
        length = b.op("Slice", b.op("Shape", x), _ints(b, [position]), _ints(b, [position + 1 or 2**62]))
        inside, _, _ = _window_masks(b, length, size)
        # x[..., L, 1, *rest] against inside[L, o, 1, ...]: [..., L, o, *rest]
        trailing = -position - 1
        spread = b.op("Unsqueeze", x, _ints(b, [position]))
        mask = b.op("Reshape", inside, _ints(b, [0, 0] + [1] * trailing)) if trailing else inside
        masked = b.op("Where", mask, spread, lowest)
        index = b.op("ArgMax", masked, axis=position - 1, keepdims=0)  # [..., o, *rest]
        x = b.op("GatherElements", x, index, axis=position)
        if flat is None:
            flat, stride = index, length
        else:  # the later dimensions' index of the element chosen, plus this dimension's
            chosen = b.op("GatherElements", flat, index, axis=position)
            flat = b.op("Add", chosen, b.op("Mul", index, stride))
            stride = b.op("Mul", stride, length)
    return x, flat


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


def _cumsum(g, input, dim, dtype=None):
    # torch sums booleans as int64 (Hugging Face's mask code does); ONNX CumSum has no bool type.
    from torch.onnx import symbolic_opset11

    if input.type().scalarType() == "Bool":
        input = g.op("Cast", input, to_i=onnx.TensorProto.INT64)
    return symbolic_opset11.cumsum(g, input, dim, dtype)


def _diagonal(g, *args):
    # ORT 1.19.2 aborts the whole process (a std::vector bounds assertion) building or running diagonal's export:
    # refuse it before ORT sees it. The op_routing plugin replaces this symbolic and runs the op on PyTorch.
    from .errors import UnsupportedModelError

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


STOP_GRADIENT_DOMAIN = "com.ortcore"
STOP_GRADIENT = "StopGradient"

# -- custom autograd Functions ----------------------------------------------------------------------------------------
# A Function with its own ``symbolic`` staticmethod is exported by it (torch calls it before any prim::PythonOp
# symbolic). Every other Function reaches the prim::PythonOp symbolic below, which asks a handler per Function class.

AUTOGRAD_FUNCTION_PLUGIN = "autograd_function"
ATEN_FALLBACK_PLUGIN = "aten_fallback"  # runs ops without an ONNX symbolic (named in the exporter's error)
INLINE = "inline"  # a handler's answer: trace through the Function's forward, as if it were ordinary code
# Reentrant activation checkpointing, the one torch Function a handler decides about (see the autograd_function plugin).
TORCH_CHECKPOINT_FUNCTION = "torch.utils.checkpoint.CheckpointFunction"


def custom_autograd_disabled(env: Mapping[str, str]) -> bool:
    """``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0`` or the older ``ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1``."""
    return env.get("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "").strip().lower() in ("0", "false", "no", "off") or env.get(
        "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", ""
    ).strip().lower() in ("1", "true", "yes", "on")


def function_name(function: type) -> str:
    """The fully qualified name of a Function class, as ``ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS`` lists them."""
    return f"{function.__module__}.{function.__qualname__}"


def inline_autograd_function(g, node) -> list:
    """Export the body the tracer recorded for one Function call (its forward) in place of the call."""
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    blocks = list(node.blocks())
    if not blocks:
        raise UnsupportedModelError(
            f"the exporter recorded no body for autograd Function {node.kind()}; cannot inline it"
        )
    body = blocks[0]
    env = g.env
    for inner, outer in zip(body.inputs(), node.inputs()):
        env[inner] = env[outer]
    env = torch._C._jit_pass_onnx_block(body, g.block, GLOBALS.operator_export_type, env, g.values_in_env, True)
    return [env[output] for output in body.outputs()]


class _TracingContext:
    """The ``ctx`` of a Function traced through: records what forward asks for, which only backward would read."""

    def __init__(self, args: tuple):
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _trace_through(function: type, args: tuple, kwargs: dict) -> Any:
    from torch.autograd.function import _SingleLevelFunction

    if function.setup_context is not _SingleLevelFunction.setup_context:  # forward(*args) + setup_context style
        return function.forward(*args, **kwargs)
    return function.forward(_TracingContext(args), *args, **kwargs)


@contextlib.contextmanager
def function_apply_replaced(replacement: Callable[..., Any]):
    """Inside, ``SomeFunction.apply(*args, **kwargs)`` of every ``torch.autograd.Function`` subclass calls
    ``replacement(cls, apply, args, kwargs)``, where ``apply(cls, *args, **kwargs)`` is torch's own; restored after.
    Exporters use it to see or redirect custom Functions while tracing. Only calls on the thread that entered are
    replaced: another thread's model (an ORTModule's own step is a Function) runs as it would without it."""
    original = torch.autograd.Function.__dict__["apply"]
    tracing_thread = threading.get_ident()

    def apply(cls, *args, **kwargs):
        if threading.get_ident() != tracing_thread:
            return original.__func__(cls, *args, **kwargs)
        return replacement(cls, original.__func__, args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


@contextlib.contextmanager
def _tracing_through(handler_for: Callable[[type], Any] | None):
    """While tracing, call the forward of each Function whose handler answers :data:`INLINE` as ordinary code, so
    that the tracer records its ops (the body torch records for a Function call is wrong for some Functions, e.g.
    with non-differentiable outputs)."""
    if handler_for is None:
        yield
        return

    def apply(cls, original, args, kwargs):
        if torch.jit.is_tracing() and getattr(cls, "symbolic", None) is None:
            handler = _handler(handler_for, cls)
            if handler == INLINE or getattr(handler, "traces_through", lambda _args: False)(args):
                return _trace_through(cls, args, kwargs)
        return original(cls, *args, **kwargs)

    with function_apply_replaced(apply):
        yield


def _handler(handler_for: Callable[[type], Any], function: type) -> Any:
    """The handler of ``function``: :data:`INLINE` or an object with ``export(g, node, args)``; its optional
    ``check()`` may refuse the Function (raising) and its optional ``traces_through(args)`` may ask to trace through
    one call; no handler is an error naming the plugin to enable."""
    handler = handler_for(function)
    if handler is None:
        raise UnsupportedModelError(
            f"the model calls the custom autograd Function {function_name(function)} and no plugin runs it: "
            f"enable the {AUTOGRAD_FUNCTION_PLUGIN!r} plugin (remove it from [plugins] disable or "
            "ORTCORE_DISABLE_PLUGINS), or set ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 to trace through it"
        )
    if handler != INLINE and hasattr(handler, "check"):
        handler.check()
    return handler


def python_op_symbolic(handler_for: Callable[[type], Any]):
    """The ``prim::PythonOp`` symbolic: ``handler_for(function_class)`` answers :data:`INLINE`, None (no plugin runs
    it: an :class:`UnsupportedModelError` naming the plugin to enable) or a handler whose ``export(g, node, args)``
    returns the node's outputs."""

    def python_op(g, *args, **_attributes):
        node = g.original_node
        function = getattr(node.pyobj(), "__self__", None)
        if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
            raise UnsupportedModelError(
                f"cannot export Python call {node.pyname()!r}: it is not a torch.autograd.Function"
            )
        handler = _handler(handler_for, function)
        if handler == INLINE:
            return inline_autograd_function(g, node)
        return handler.export(g, node, args)

    python_op.handler_for = handler_for  # the exporter traces through the Functions it answers INLINE for
    return python_op


_SYMBOLICS = {
    "::batch_norm": _batch_norm,
    "::detach": _detach,
    "::cumsum": _cumsum,
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

_registered: dict[tuple[str, int], Any] = {}


def _drop_if_empty(name: str) -> None:
    """Forget torch's entry for an op left with no symbolic at all (one only a plugin's symbolic exported, such as
    aten_fallback's ``::cummax``): torch's lookup would fail on it with "min() arg is an empty sequence" instead of
    the "operator 'aten::cummax' ... is not supported" error that names the op."""
    try:
        from torch.onnx._internal.torchscript_exporter import registration
    except ImportError:  # another torch layout: its registry then keeps the empty entry (errors name the op less well)
        return
    qualified = f"aten{name}" if name.startswith("::") else name
    group = registration.registry.get_function_group(qualified)
    if group is not None and not list(group._functions):
        registration.registry._registry.pop(qualified, None)


def register_symbolics(symbolics: dict[str, Any], opset: int) -> None:
    """Make exactly ``symbolics`` ortcore's custom symbolics for ``opset``.

    torch's registry is process-wide: symbolics another ORTModule's plugins registered are removed first, so one
    model's plugins never change how another model exports. That includes those registered for other opsets: a
    symbolic registered for opset 14 serves every later opset too.
    """
    for name, registered_opset in list(_registered):
        if registered_opset != opset or name not in symbolics:
            torch.onnx.unregister_custom_op_symbolic(name, registered_opset)
            _drop_if_empty(name)
            del _registered[(name, registered_opset)]
    for name, fn in symbolics.items():
        if _registered.get((name, opset)) is not fn:
            torch.onnx.register_custom_op_symbolic(name, fn, opset)
            _registered[(name, opset)] = fn


_UNSUPPORTED_OP = re.compile(r"operator '?([\w:.]+)'?")


def core_symbolic(name: str) -> Callable[..., Any] | None:
    """The TorchScript symbolic the core registers for ``name`` (``"::layer_norm"`` for ``aten::layer_norm``,
    ``"prim::ConstantChunk"``), or None: what a plugin's own symbolic falls back to for the cases it leaves alone."""
    return _SYMBOLICS.get(name)


def raised_in(error: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``error`` was raised while ``function`` ran (its traceback passes through the function's code).

    An exporter calls this with the traced module's ``forward``: an exception from there is the model's own (a wrong
    argument type, a shape error), which PyTorch would raise too, not a failure to convert the traced graph.
    """
    code = getattr(function, "__code__", None)
    if code is None or isinstance(error, (UnsupportedDataError, UnsupportedModelError)):
        return False
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def quiet_export(log_level: LogLevel, *, loggers: tuple[str, ...] = ()):
    """An exporter's noise kept to ortcore's log level: above INFO its Python warnings are ignored and ``loggers``
    show only errors; VERBOSE adds the exporter's own graph dump.

    Nothing here touches the process's file descriptors or ``sys.stdout``: another thread printing meanwhile would
    lose its output (or keep writing to a deleted file). What the exporter would print is prevented at its source
    instead (see :func:`_no_ir_dump`). Callers hold :data:`EXPORT_LOCK`, as the warning filters and logger levels
    changed here are process-wide."""
    with contextlib.ExitStack() as stack:
        if log_level > LogLevel.INFO:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            for name in loggers:
                stack.enter_context(_logger_level(logging.getLogger(name), logging.ERROR))
        yield


@contextlib.contextmanager
def _no_ir_dump(verbose: bool) -> Iterator[None]:
    """The TorchScript exporter's C++ log (``_jit_onnx_log``: the graph it exported, or "Torch IR graph at
    exception" when an op has no symbolic, written to std::cout) on only when ``verbose``.

    torch's ``setup_onnx_logging`` reads ``_C._jit_is_onnx_log_enabled`` without calling it, so it takes the log as
    already on: every export switches it on for good, and a failed export dumps the whole graph on the terminal.
    Its replacement here leaves the switch alone; the switch is set for this export and restored after. Callers
    hold :data:`EXPORT_LOCK` (the switch and the replaced function are process-wide).
    """
    try:
        from torch.onnx._internal.torchscript_exporter import utils
    except ImportError:  # another torch layout: nothing to replace
        utils = None

    @contextlib.contextmanager
    def setup_onnx_logging(verbose: bool) -> Iterator[None]:
        yield

    was_on = torch._C._jit_is_onnx_log_enabled()
    original = getattr(utils, "setup_onnx_logging", None)
    if original is not None:
        utils.setup_onnx_logging = setup_onnx_logging
    torch._C._jit_set_onnx_log_enabled(verbose)
    try:
        yield
    finally:
        torch._C._jit_set_onnx_log_enabled(was_on)
        if original is not None:
            utils.setup_onnx_logging = original


# Exports run one at a time in the process: the TorchScript exporter keeps its state in process-wide globals (a
# second thread's export fails with "GLOBALS.in_onnx_export must be True"), symbolics are registered process-wide,
# torch.export patches torch while it traces, and quiet_export changes warning filters and logger levels.
EXPORT_LOCK = threading.RLock()


@contextlib.contextmanager
def _logger_level(log: logging.Logger, level: int):
    previous = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(previous)


def refuse_empty_inputs(args: tuple[Any, ...], input_names: list[str]) -> None:
    """Raise :class:`UnsupportedDataError` when a training export's example input is empty (a batch of 0).

    The first step of a new graph runs ORT's backward at once (the gradient audit), and ORT's CPU ``ConvGrad`` dies
    of SIGFPE on empty tensors, taking the process with it; other gradient kernels fail (Gemm, Reshape). The fallback
    policy then applies, naming the input.
    """
    for name, value in zip(input_names, args):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == 0:
            raise UnsupportedDataError(
                f"input {name!r} has a dimension of size 0 (shape {tuple(value.shape)}) in the call a training graph "
                "would be exported for: ONNX Runtime's training kernels cannot run empty tensors (ConvGrad kills the "
                "process). Skip empty batches, or run them without ORTModule"
            )


MAX_EXPORT_RETRIES = 33  # exports of one model: the first, then one per op plugins make exportable


class TorchScriptExporter:
    """The TorchScript exporter (``dynamo=False``) with the symbolics ORT's training engine needs.

    ``symbolics`` adds or replaces symbolics (plugins contribute them through ``ortcore_export_symbolics``; the
    ``autograd_function`` plugin contributes ``prim::PythonOp``). Without a plugin for it, a custom autograd Function
    is traced through when ``inline_autograd_functions`` (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0``) and refused
    otherwise, naming the plugin to enable.
    """

    name = "torchscript"

    def __init__(self, symbolics: dict[str, Any] | None = None, *, inline_autograd_functions: bool = False):
        self.inline_autograd_functions = inline_autograd_functions
        self._on_failure: Callable[[UnsupportedModelError], dict | None] | None = None
        default = python_op_symbolic(self._no_function_handler)
        self.symbolics = {**_SYMBOLICS, "prim::PythonOp": default, **(symbolics or {})}

    def _no_function_handler(self, function: type) -> str | None:
        return INLINE if self.inline_autograd_functions else None

    def use_function_handlers(self, ask: Callable[[type], Any]) -> None:
        """Export every custom autograd Function as ``ask(function_class)`` answers (the
        ``ortcore_autograd_function_handler`` hook); no answer means the default: traced through when
        ``inline_autograd_functions``, refused otherwise."""
        self.symbolics["prim::PythonOp"] = python_op_symbolic(lambda f: ask(f) or self._no_function_handler(f))

    def fingerprint(self) -> dict[str, Any]:
        return {"inline_autograd_functions": self.inline_autograd_functions, "pooling": POOLING_VERSION}

    def use_hooks(self, hooks: Any, config: Any = None) -> None:
        """Ask ``hooks`` (``ortcore_export_failed``) for symbolics when an export stops at an op the exporter cannot
        express (no symbolic, or one that refuses these arguments), then export again: at most
        :data:`MAX_EXPORT_RETRIES` times. The symbolics added stay for the model's later exports."""
        self._on_failure = lambda error: hooks.export_failed(error, self.symbolics, config)

    def export(self, request: ExportRequest) -> onnx.ModelProto:
        for _ in range(MAX_EXPORT_RETRIES):
            try:
                return self._export_once(request)
            except UnsupportedModelError as e:
                added = self._on_failure(e) if self._on_failure is not None else None
                if not added:
                    raise
                self.symbolics.update(added)
        raise UnsupportedModelError(
            f"{type(request.module).__name__} uses more than {MAX_EXPORT_RETRIES} ops the TorchScript exporter cannot "
            "express"
        )

    def _export_once(self, request: ExportRequest) -> onnx.ModelProto:
        module, args, log_level, opset = request.module, request.args, request.log_level, request.opset
        input_names, output_names, dynamic_axes = request.input_names, request.output_names, request.dynamic_axes
        if request.training:
            refuse_empty_inputs(args, input_names)
        buffer = io.BytesIO()
        handler_for = getattr(self.symbolics.get("prim::PythonOp"), "handler_for", None)
        try:
            with (
                EXPORT_LOCK,
                quiet_export(log_level),
                _no_ir_dump(log_level == LogLevel.VERBOSE),
                _tracing_through(handler_for),
            ):
                register_symbolics(self.symbolics, opset)
                torch.onnx.export(
                    module,
                    args,
                    buffer,
                    dynamo=False,
                    opset_version=opset,
                    do_constant_folding=False,
                    # PRESERVE: every submodule keeps its own mode (a frozen batch norm in a training model).
                    training=torch.onnx.TrainingMode.PRESERVE,
                    export_params=False,
                    keep_initializers_as_inputs=True,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,
                    verbose=log_level == LogLevel.VERBOSE,
                )
        except (UnsupportedDataError, UnsupportedModelError):
            raise  # already names what is wrong (a symbolic raised it)
        except Exception as e:  # the exporter raises many types; all mean "this model did not export"
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            match = _UNSUPPORTED_OP.search(str(e))
            what = f"op {match.group(1)}" if match else "the model"
            hint = ""
            if (
                match
                and match.group(1).startswith("aten::")
                and isinstance(e, torch.onnx.errors.UnsupportedOperatorError)
            ):
                hint = (
                    f"; the {ATEN_FALLBACK_PLUGIN!r} plugin can run it in ORT with PyTorch's kernel: list it in "
                    f"[plugins.{ATEN_FALLBACK_PLUGIN}] fallback_ops (or ORTCORE_ATEN_FALLBACK_OPS={match.group(1)}, or auto)"
                )
            raise UnsupportedModelError(
                f"the TorchScript exporter could not export {what} of {type(module).__name__}: {text}{hint}",
                raised_in_forward=e if raised_in(e, type(module).forward) else None,
            ) from e
        return onnx.load_model_from_string(buffer.getvalue())


TORCHSCRIPT = "torchscript"
DYNAMO = "dynamo"
_switch_logged = False


def torchscript_available() -> bool:
    """Does this torch still ship the TorchScript exporter (``torch.onnx.export(dynamo=False)``)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("torch.onnx._internal.torchscript_exporter") is not None
    except (ImportError, ValueError):
        return False


def exporter_name(config) -> str:
    """The exporter ``config`` asks for: its ``exporter`` option, except that ``torchscript`` becomes ``dynamo`` (one
    INFO line per process) on a torch without the TorchScript exporter."""
    global _switch_logged
    name = config.core.exporter
    if name == TORCHSCRIPT and not torchscript_available():
        if not _switch_logged:
            _switch_logged = True
            logger.info(
                "this torch (%s) has no TorchScript exporter (torch.onnx.export(dynamo=False)): exporting with the "
                "dynamo route (torch.export + onnxscript) instead",
                torch.__version__,
            )
        return DYNAMO
    return name


class CoreDefaults:
    """The core's default answers, registered as the plugin ``core``."""

    @hookimpl
    def ortcore_register(self, register) -> None:
        register.exporter(
            TORCHSCRIPT,
            lambda config: TorchScriptExporter(inline_autograd_functions=custom_autograd_disabled(config.env)),
        )
