"""Pooling rewritten for ONNX Runtime's training kernels, shared by both exporters.

ORT's CPU ``AveragePoolGrad`` and ``MaxPoolGrad`` take their output shapes from the graph's static shapes, which
ortcore leaves symbolic, and both exporters fix adaptive pooling's windows for the exporting call's size. The
builders here write the same pooling from ops whose gradients read shapes at run time. They are written once against
:class:`OnnxBuilder`, so that the TorchScript route's symbolics (``torchscript_symbolics``, over
:class:`TorchScriptBuilder`) and the dynamo route's onnxscript translations (``dynamo_exporter``) write one graph.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import onnx
import torch

from ortcore.api import UnsupportedModelError


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
