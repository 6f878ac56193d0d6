"""dynamo_exporter: the ``dynamo`` exporter, ``torch.export`` + onnxscript (``torch.onnx.export(dynamo=True)``)
behind the core's exporter seam.

Chosen by name: ``exporter = "dynamo"`` in ortcore.toml, ``ORTCORE_EXPORTER=dynamo``, or
``ORTModule(model, exporter="dynamo")``; ortcore also takes it by itself on a torch without the TorchScript exporter.

The seam's contract (``ortcore.api.Exporter``) holds as on the TorchScript route:

* **Parameters and buffers are graph inputs** under their ``state_dict`` names. ``torch.export`` would lift them
  into initializers; instead the module is called through ``torch.func.functional_call`` with them as arguments, so
  the graph takes them as inputs (tied parameters once, under their first name, as ``named_parameters`` gives them).
* **Input dimensions are dynamic where the model allows it** (``torch.export.Dim.AUTO``): batch and sequence
  changes reuse the graph; a dimension the model fixes (a feature size a weight multiplies) stays static, and so
  does one of size 1 in the exporting call (it may broadcast). The graph records the sizes it serves
  (:func:`input_ranges`); the core gives a call of other sizes a graph of its own.
* **ORT's gradient builders' expectations**: ``LayerNormalization`` gets its mean and inverse-std outputs and
  ``SoftmaxCrossEntropyLoss`` its log-probability output when the exporter left them out (their gradients read
  them).

The graph is then rewritten into the one the TorchScript route gives ORT's training engine (each rewrite's reason
is on its function; ``docs/plugins/dynamo_exporter.md`` has the table):

* **Batch norm**: ``momentum=None`` (a cumulative average, ``1 / num_batches_tracked``, which ``torch.export``
  cannot trace) is traced with a float momentum, since ortcore updates running statistics itself
  (``ortcore.graph.update_batch_norm``); training-mode nodes get ``training_mode=1`` and their outputs, eval-mode
  ones become arithmetic on the running statistics (:func:`set_batch_norm_modes`).
* **Max pooling** is its indices plus a ``Gather`` (:func:`gather_max_pools`): ORT's ``MaxPoolGrad`` crashes on
  dynamic axes.
* **Non-persistent buffers** (not in ``state_dict``, such as BERT's ``position_ids``) become initializers, and
  **parameters the traced call does not read** are not graph inputs (ORT refuses a trainable input without a
  consumer).
* **Graph outputs that nodes also read** get their own ``Identity`` (:func:`separate_read_outputs`), and **GELU**
  is written in the product order ORT fuses (:func:`reorder_gelus`).
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.metadata
import inspect
import json
import logging
import pathlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import onnx
import onnx.numpy_helper
import torch

from ortcore.api import (
    AUTOGRAD_FUNCTION_PLUGIN,
    CORE_REPAIR,
    DYNAMO,
    EXPORT_LOCK,
    INLINE,
    INPUT_RANGES_METADATA,
    TORCHSCRIPT,
    BufferWriteError,
    ExportRequest,
    Failure,
    LogLevel,
    PassContext,
    Repair,
    UnsupportedModelError,
    buffer_owners,
    custom_autograd_disabled,
    exporter_name,
    hookimpl,
    option,
    parse_bool,
    quiet_export,
    raised_in,
    refuse_empty_inputs,
    torchscript_available,
)
from ortcore_plugins.services.autograd_functions import (
    TORCH_CHECKPOINT_FUNCTION,
    function_apply_replaced,
    function_name,
)
from ortcore_plugins.services.pooling import POOLING_VERSION, adaptive_average_pool, adaptive_max_pool, average_pool

NAME = "dynamo_exporter"
ENV_VALUE_BRANCHES = "ORTCORE_DYNAMO_VALUE_BRANCHES"
ENV_TORCHSCRIPT_REPAIR = "ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR"
# How export() words a capture or translation failure of this route, as opposed to a refusal both routes share.
_CAPTURE_FAILED = "the dynamo exporter could not export"


@attrs.frozen
class DynamoExporterOptions:
    value_branches: bool = option(
        True,
        parse_bool,
        "Python branches on tensor values (which torch.export refuses) are captured as the first batch takes them, "
        "as TorchScript traces them, with a WARNING naming each; 0 refuses the model instead",
        ENV_VALUE_BRANCHES,
    )
    torchscript_repair: bool = option(
        True,
        parse_bool,
        "a model this route cannot serve (capture, build, first run or gradient audit fails and no op repair helps) "
        "is exported with the TorchScript exporter instead, everything still in ORT, with a WARNING; 0 goes on to "
        "region repairs and then refuses",
        ENV_TORCHSCRIPT_REPAIR,
    )


def _options(config: Any) -> DynamoExporterOptions:
    return config.plugin_options(NAME) or DynamoExporterOptions()


logger = logging.getLogger("ortcore")

# Loggers of torch.export and torch.onnx, kept to errors below ortcore's INFO level (quiet_export).
_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")
# Outputs ORT's gradient builders read, by op type: (outputs the op must have, names of the ones added).
_REQUIRED_OUTPUTS = {"LayerNormalization": 3, "SoftmaxCrossEntropyLoss": 2}


class _ParametersAsInputs(torch.nn.Module):
    """``module`` called with its parameters and buffers taken from the trailing arguments."""

    def __init__(self, module: torch.nn.Module, n_inputs: int, state_names: list[str]):
        super().__init__()
        object.__setattr__(self, "target", module)  # not a submodule: its tensors must not be lifted as constants
        self.n_inputs = n_inputs
        self.state_names = state_names

    def forward(self, *args: torch.Tensor) -> Any:
        inputs, state = args[: self.n_inputs], args[self.n_inputs :]
        versions = [_version(t) for t in state]
        result = torch.func.functional_call(self.target, dict(zip(self.state_names, state)), inputs)
        # What the forward wrote in place (torch.export's training IR keeps in-place ops in the graph and does not
        # list them in the signature; the traced tensors' version counters tell).
        self.written = [n for n, t, v in zip(self.state_names, state, versions) if v is not None and _version(t) != v]
        return result


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _missing_package() -> str | None:
    for package in ("onnxscript",):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return package
    return None


@contextlib.contextmanager
def _float_batch_norm_momentum(module: torch.nn.Module) -> Iterator[int]:
    """Trace cumulative-average batch norms (``momentum=None``) with a float momentum; yields how many changed.

    ``momentum=None`` makes the forward compute ``1.0 / float(num_batches_tracked)``, which ``torch.export`` refuses
    (GuardOnDataDependentSymNode). The value never matters: ortcore updates running statistics itself.
    """
    changed = [
        m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is None
    ]
    for m in changed:
        m.momentum = 0.1
    try:
        yield len(changed)
    finally:
        for m in changed:
            m.momentum = None


def _drop_unread_inputs(model: onnx.ModelProto, names: set[str]) -> int:
    """Remove the graph inputs among ``names`` that no node reads and no output is; returns how many."""
    read = {name for node in model.graph.node for name in node.input}
    read.update(_subgraph_inputs(model.graph))
    read.update(o.name for o in model.graph.output)
    unread = [i for i in model.graph.input if i.name in names and i.name not in read]
    for value in unread:
        model.graph.input.remove(value)
    return len(unread)


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names read inside the control-flow subgraphs of ``graph``'s nodes (If, Loop, Scan bodies)."""
    found: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            for sub in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                found.update(name for n in sub.node for name in n.input)
                found.update(_subgraph_inputs(sub))
    return found


def _inputs_to_initializers(model: onnx.ModelProto, values: dict[str, torch.Tensor]) -> int:
    """Turn the graph inputs named in ``values`` into initializers holding those values; returns how many."""
    moved = [i for i in model.graph.input if i.name in values]
    for value in moved:
        model.graph.input.remove(value)
        tensor = values[value.name].detach().cpu().contiguous()
        initializer = onnx.TensorProto(name=value.name, data_type=value.type.tensor_type.elem_type)
        initializer.dims.extend(tensor.shape)
        initializer.raw_data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()  # bfloat16 has no numpy dtype
        model.graph.initializer.append(initializer)
    return len(moved)


def _batch_norm_nodes(
    model: onnx.ModelProto, module: torch.nn.Module
) -> Iterator[tuple[int, onnx.NodeProto, torch.nn.modules.batchnorm._BatchNorm]]:
    """Each ``BatchNormalization`` reading a batch-norm module's running statistics, with its index and module."""
    modules = dict(module.named_modules())
    for index, node in enumerate(model.graph.node):
        if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx") or len(node.input) < 5:
            continue
        owner = modules.get(node.input[3].rpartition(".")[0])  # "module.bn.running_mean" -> "module.bn"
        if isinstance(owner, torch.nn.modules.batchnorm._BatchNorm):
            yield index, node, owner


def set_batch_norm_modes(model: onnx.ModelProto, module: torch.nn.Module) -> int:
    """Write each batch norm as the TorchScript route does; returns how many nodes changed.

    ``torch.export`` gives a training-mode batch norm as an inference ``BatchNormalization`` (its running-statistics
    update is a separate computation, dropped as unused): it becomes ``training_mode=1`` with its three outputs, which
    is what ortcore looks for to update running statistics itself. An eval-mode batch norm becomes arithmetic on
    the running statistics: ORT's gradient builder would turn a ``BatchNormalization`` into a training-mode one and
    normalize with batch statistics when an eval-mode model is differentiated.
    """
    changed = 0
    replacements: list[tuple[int, list[onnx.NodeProto]]] = []
    for index, node, owner in _batch_norm_nodes(model, module):
        if owner.training:
            attributes = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend([*attributes, onnx.helper.make_attribute("training_mode", 1)])
            for k in range(len(node.output), 3):
                node.output.append(f"ortcore.dynamo::BatchNormalization_{index}_out{k}")
            changed += 1
        else:
            replacements.append((index, _batch_norm_arithmetic(node, index)))
    for index, nodes in reversed(replacements):
        del model.graph.node[index]
        for offset, new in enumerate(nodes):
            model.graph.node.insert(index + offset, new)
    return changed + len(replacements)


def _batch_norm_arithmetic(node: onnx.NodeProto, index: int) -> list[onnx.NodeProto]:
    """``(x - mean) * weight / sqrt(var + eps) + bias`` with the statistics reshaped to ``[C, 1, ...]`` for any rank."""
    x, weight, bias, mean, var = node.input[:5]
    epsilon = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
    prefix = f"ortcore.dynamo::BatchNormalization_{index}_"
    make = onnx.helper.make_node
    nodes = [
        make(
            "Constant",
            [],
            [prefix + "eps"],
            value=onnx.helper.make_tensor("eps", onnx.TensorProto.FLOAT, [], [epsilon]),
        ),
        make("CastLike", [prefix + "eps", var], [prefix + "eps_cast"]),
        make("Add", [var, prefix + "eps_cast"], [prefix + "var_eps"]),
        make("Sqrt", [prefix + "var_eps"], [prefix + "std"]),
        make("Div", [weight, prefix + "std"], [prefix + "scale"]),
        make("Mul", [mean, prefix + "scale"], [prefix + "mean_scaled"]),
        make("Sub", [bias, prefix + "mean_scaled"], [prefix + "shift"]),
        # [C, 1, ..., 1]: -1 followed by rank(x) - 2 ones
        make("Shape", [x], [prefix + "shape"]),
        make("Size", [prefix + "shape"], [prefix + "rank"]),
        make("Constant", [], [prefix + "two"], value=onnx.helper.make_tensor("two", onnx.TensorProto.INT64, [1], [2])),
        make("Sub", [prefix + "rank", prefix + "two"], [prefix + "n_ones"]),
        make(
            "ConstantOfShape",
            [prefix + "n_ones"],
            [prefix + "ones"],
            value=onnx.helper.make_tensor("one", onnx.TensorProto.INT64, [1], [1]),
        ),
        make(
            "Constant",
            [],
            [prefix + "minus_one"],
            value=onnx.helper.make_tensor("m", onnx.TensorProto.INT64, [1], [-1]),
        ),
        make("Concat", [prefix + "minus_one", prefix + "ones"], [prefix + "channel_shape"], axis=0),
        make("Reshape", [prefix + "scale", prefix + "channel_shape"], [prefix + "scale_c"]),
        make("Reshape", [prefix + "shift", prefix + "channel_shape"], [prefix + "shift_c"]),
        make("Mul", [x, prefix + "scale_c"], [prefix + "scaled"]),
        make("Add", [prefix + "scaled", prefix + "shift_c"], [node.output[0]]),
    ]
    return nodes


def gather_max_pools(model: onnx.ModelProto) -> int:
    """Write each ``MaxPool`` as its indices plus a ``Gather`` from the flattened input; returns how many.

    ORT's CPU ``MaxPoolGrad`` reads static output shapes and crashes the process on dynamic axes; ``Gather``'s
    gradient has no such limit, and gathering at the argmax indices gives exactly torch's values and gradient (the
    TorchScript route writes max pooling the same way).
    """
    replacements = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx"):
            continue
        prefix = f"ortcore.dynamo::MaxPool_{index}_"
        values = node.output[0]
        node.output[0] = prefix + "values"
        if len(node.output) < 2 or not node.output[1]:
            del node.output[1:]
            node.output.append(prefix + "indices")
        shape = onnx.helper.make_tensor("flat", onnx.TensorProto.INT64, [1], [-1])
        replacements.append(
            (
                index,
                [
                    onnx.helper.make_node("Constant", [], [prefix + "flat_shape"], value=shape),
                    onnx.helper.make_node("Reshape", [node.input[0], prefix + "flat_shape"], [prefix + "flat"]),
                    onnx.helper.make_node("Gather", [prefix + "flat", node.output[1]], [values], axis=0),
                ],
            )
        )
    for index, nodes in reversed(replacements):
        for offset, new in enumerate(nodes, start=1):
            model.graph.node.insert(index + offset, new)
    return len(replacements)


class OnnxScriptBuilder:
    """:class:`ortcore_plugins.services.pooling.OnnxBuilder` over onnxscript's opset 18, inside a ``trace_only`` translation."""

    def op(self, op_type: str, *inputs: Any, **attributes: Any) -> Any:
        from onnxscript import ir, opset18

        values = {k: ir.tensor(v.numpy()) if isinstance(v, torch.Tensor) else v for k, v in attributes.items()}
        return getattr(opset18, op_type)(*inputs, **values)

    def const(self, value: torch.Tensor) -> Any:
        from onnxscript import ir, opset18

        return opset18.Constant(value=ir.tensor(value.numpy()))


def _is_float32(value: Any) -> bool:
    from onnxscript import ir

    return value.dtype in (None, ir.DataType.FLOAT)


def _translate_avg_pool(rank: int) -> Callable[..., Any]:
    """The translation of ``aten.avg_pool{rank}d``: :func:`ortcore_plugins.services.pooling.average_pool` for float32 inputs (ORT's
    ``AveragePoolGrad`` crashes on dynamic axes, and torchlib's translation drops ``divisor_override``)."""

    def translate(
        self: Any,
        kernel_size: Any,
        stride: Any = (),
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> Any:
        if not _is_float32(self):
            from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

            if divisor_override:
                raise UnsupportedModelError(
                    f"avg_pool{rank}d with divisor_override on {self.dtype} inputs: ONNX's AveragePool has no divisor "
                    "(only float32 pooling is rewritten)"
                )
            standard = getattr(torchlib_nn, f"aten_avg_pool{rank}d")
            return standard(self, kernel_size, stride, padding, ceil_mode, count_include_pad)
        return average_pool(
            OnnxScriptBuilder(),
            self,
            rank,
            kernel_size,
            stride,
            padding,
            ceil_mode,
            count_include_pad,
            divisor_override,
        )

    return translate


def _translate_adaptive_avg_pool(self: Any, output_size: Any) -> Any:
    """The translation of ``aten.adaptive_avg_pool{1,2,3}d``: :func:`ortcore_plugins.services.pooling.adaptive_average_pool`. The
    decomposition it replaces fixes the windows for the exporting call's size, so another size got the wrong shape."""
    from onnxscript import ir

    dtype = self.dtype if self.dtype is not None else ir.DataType.FLOAT
    rank = len(self.shape) if self.shape is not None else None
    return adaptive_average_pool(OnnxScriptBuilder(), self, [int(v) for v in output_size], int(dtype), rank)


def _translate_adaptive_max_pool(self: Any, output_size: Any) -> Any:
    """The translation of ``aten.adaptive_max_pool{1,2,3}d``: :func:`ortcore_plugins.services.pooling.adaptive_max_pool`, whose
    windows follow the input's size (the decomposition it replaces gave another size the exporting call's windows
    and shape)."""
    from onnxscript import ir

    dtype = self.dtype if self.dtype is not None else ir.DataType.FLOAT
    return adaptive_max_pool(OnnxScriptBuilder(), self, [int(v) for v in output_size], int(dtype))


def _translate_nll_loss_forward(self: Any, target: Any, weight: Any, reduction: int, ignore_index: int) -> Any:
    """The translation of ``aten.nll_loss_forward``: the loss as onnxscript's, and its second output, the total weight
    (the count of targets not ignored, or their weights' sum), computed. onnxscript returns the loss's element count
    there ("FIXME: Fake a total_weight"), which ``nll_loss_backward`` divides by: graphs that pass it on (AOTAutograd's
    forward graph to its backward) got gradients 4x too large on a batch of 4."""
    from onnxscript.function_libs.torch_lib.ops.nn import aten_nll_loss
    from onnxscript.onnx_opset import opset18 as op

    output = aten_nll_loss(self, target, weight, reduction, ignore_index)
    targets = op.Reshape(target, op.Constant(value_ints=[-1]))
    kept = op.Not(op.Equal(targets, op.Constant(value_int=int(ignore_index))))
    if weight is None:
        counted = op.CastLike(kept, self)
    else:
        safe = op.Where(kept, targets, op.Constant(value_int=0))
        counted = op.Mul(op.Gather(weight, safe), op.CastLike(kept, weight))
    total = op.ReduceSum(counted, keepdims=0)
    if int(reduction) == 0:  # "none": torch leaves the total weight at zero
        total = op.Mul(total, op.CastLike(op.Constant(value_float=0.0), total))
    return output, total


def pooling_translations() -> dict[Any, Callable[..., Any]]:
    """The dynamo route's own translations: pooling ops whose ORT gradients need static shapes, and
    ``nll_loss_forward``'s total weight."""
    aten = torch.ops.aten
    return {
        aten.nll_loss_forward.default: _translate_nll_loss_forward,
        aten.avg_pool1d.default: _translate_avg_pool(1),
        aten.avg_pool2d.default: _translate_avg_pool(2),
        aten.avg_pool3d.default: _translate_avg_pool(3),
        aten.adaptive_avg_pool1d.default: _translate_adaptive_avg_pool,
        aten.adaptive_avg_pool2d.default: _translate_adaptive_avg_pool,
        aten._adaptive_avg_pool2d.default: _translate_adaptive_avg_pool,
        aten.adaptive_avg_pool3d.default: _translate_adaptive_avg_pool,
        aten._adaptive_avg_pool3d.default: _translate_adaptive_avg_pool,
        aten.adaptive_max_pool1d.default: _translate_adaptive_max_pool,
        aten.adaptive_max_pool2d.default: _translate_adaptive_max_pool,
        aten.adaptive_max_pool3d.default: _translate_adaptive_max_pool,
    }


def _finite(bound: Any) -> int | None:
    """A range bound as an int; None for an infinite one (sympy's and torch's infinities)."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def input_ranges(program: torch.export.ExportedProgram, names: list[str]) -> dict[str, list[list[Any]]]:
    """The sizes each of the first ``len(names)`` user inputs may take in ``program``: ``{name: [[dim, low, high or
    None], ...]}`` for the dimensions narrower than any size, read from torch.export's range constraints. A model
    that branches on a size (``if ids.shape[1] > 8``) gets a graph valid for those sizes only (``low`` 9 here), and
    a dimension the model fixes gets ``low == high``, and so does one whose other sizes break a condition the trace
    assumed that is not a range (``3 * (W // 3) >= W``, a ceil-mode pooling's output size). The core gives a call
    outside these ranges a graph of its own (``ortcore.graph.INPUT_RANGES_METADATA``) instead of running this one on
    sizes it was not traced for."""
    import sympy

    specs = [
        s for s in program.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
    ]
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    asserts = _runtime_asserts(program)
    ranges: dict[str, list[list[Any]]] = {}
    for name, spec in zip(names, specs):
        node = nodes.get(getattr(spec.arg, "name", None))
        value = node.meta.get("val") if node is not None else None
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if isinstance(size, int):
                low, high = size, size
            else:
                expr = size.node.expr
                bounds = program.range_constraints.get(expr) if isinstance(expr, sympy.Symbol) else None
                if bounds is None:
                    continue
                low, high = _finite(bounds.lower) or 0, _finite(bounds.upper)
                traced = _hint(size)
                if traced is not None:  # a call outside gets a graph of its own
                    low, high = _narrowed(expr, traced, low, high, asserts)
            if low > 0 or high is not None:
                ranges.setdefault(name, []).append([dim, low, high])
    return ranges


# Bumped whenever the sizes a graph records as served change (cached graphs would keep the older ones).
SIZE_CONDITIONS_VERSION = 1
# Sizes tried against each guard on a size: from the range's lower bound (2 at least: size 1 is exported as 1, size 0
# is refused) to this many more, which covers divisibility by any stride or kernel up to it.
GUARD_PROBE_SIZES = 48


def _hint(size: Any) -> int | None:
    """The size a symbolic dimension had in the traced call."""
    try:
        return int(size.node.hint)
    except (AttributeError, TypeError, ValueError):
        return None


def _runtime_asserts(program: torch.export.ExportedProgram) -> list[Any]:
    """The conditions on sizes torch.export assumed while tracing and left to be checked at run time (``3 * (W //
    3) >= W``: a ceil-mode pooling's output size for a ``W`` divisible by 3), as sympy expressions. The ONNX graph
    does not check them."""
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" else None
        for size in getattr(value, "shape", ()):
            if not isinstance(size, int):
                env = size.node.shape_env
                return [a.expr for group in getattr(env, "deferred_runtime_asserts", {}).values() for a in group]
    return []


def _narrowed(symbol: Any, traced: int, low: int, high: int | None, asserts: list[Any]) -> tuple[int, int | None]:
    """``(low, high)`` narrowed to the sizes of ``symbol`` that meet the conditions on it alone that the graph was
    traced under; torch's range constraints do not record them, so the graph would run other sizes with shapes
    computed for the traced one. Sizes are tried from ``low`` (2 at least) over :data:`GUARD_PROBE_SIZES` sizes
    and past the traced one: a condition met by a run of sizes becomes a range (``s <= 16``: a position table's
    length), one met by scattered sizes (``W`` divisible by 3) pins the traced size."""
    import sympy

    # Conditions on this size alone: one relating two sizes (Eq(s0, s1): two inputs share a batch size) holds when
    # both change together.
    relevant = [a for a in asserts if getattr(a, "free_symbols", set()) == {symbol}]
    if not relevant:
        return low, high
    first = max(low, 2)
    last = max(first + GUARD_PROBE_SIZES, traced + GUARD_PROBE_SIZES // 2)
    if high is not None:
        last = min(last, high)
    met = []
    for size in range(first, last + 1):
        try:
            holds = all(guard.xreplace({symbol: sympy.Integer(size)}) is not sympy.false for guard in relevant)
        except Exception:  # a form sympy cannot evaluate: leave it to torch's own checks
            return low, high
        if holds:
            met.append(size)
    if len(met) == last - first + 1:
        return low, high
    if traced in met and met == list(range(met[0], met[-1] + 1)):
        return max(low, met[0]), (met[-1] if met[-1] < last else high)
    logger.debug("dynamo export: a size of %s other than %d breaks %s: graph pinned", symbol, traced, relevant)
    return traced, traced


def separate_read_outputs(model: onnx.ModelProto) -> int:
    """Give each graph output that nodes also read its own ``Identity``; returns how many.

    ORT's compute optimizer (``UpStreamReshape``) moves a ``Reshape`` above the op that produced it, changing that
    op's output; when that output is also a graph output (GPT-2's logits, which its loss flattens), the user would
    get the reshaped tensor. The TorchScript route has a ``Cast`` there that the dynamo route's optimizer removes.
    """
    read = {name for node in model.graph.node for name in node.input}
    produced = {name for node in model.graph.node for name in node.output}
    separated = 0
    for output in model.graph.output:
        if output.name not in read or output.name not in produced:  # an input passed through stays as it is
            continue
        inner = f"ortcore.dynamo::{output.name}_inner"
        # The inner value keeps the output's type: ORT cannot infer the types of some producers (an ATen node's).
        typed = onnx.ValueInfoProto()
        typed.CopyFrom(output)
        typed.name = inner
        model.graph.value_info.append(typed)
        for node in model.graph.node:
            for k, name in enumerate(node.output):
                if name == output.name:
                    node.output[k] = inner
            for k, name in enumerate(node.input):
                if name == output.name:
                    node.input[k] = inner
        model.graph.node.append(onnx.helper.make_node("Identity", [inner], [output.name]))
        separated += 1
    return separated


def _scalar_values(model: onnx.ModelProto) -> dict[str, float]:
    """The graph's one-element float constants (initializers and ``Constant`` nodes), by value name."""
    found = {}
    tensors = [(t.name, t) for t in model.graph.initializer]
    tensors += [
        (n.output[0], a.t)
        for n in model.graph.node
        if n.op_type == "Constant"
        for a in n.attribute
        if a.name == "value"
    ]
    for name, tensor in tensors:
        if tensor.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16):
            array = onnx.numpy_helper.to_array(tensor)
            if array.size == 1:
                found[name] = float(array.reshape(()))
    return found


def reorder_gelus(model: onnx.ModelProto) -> int:
    """Write ``x * (0.5 * (1 + f(x)))`` as ``(x * (1 + f(x))) * 0.5`` for both GELUs; returns how many.

    ``f(x)`` is ``erf(x / sqrt(2))`` or ``tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))``. The two products are the
    same; ORT fuses the second into its ``Gelu`` / ``FastGelu`` kernels (with their gradients) and the
    ``aten_fallback`` plugin's tanh-GELU pass recognises it, as on the TorchScript route, whose graphs have that
    order; the dynamo route writes the first.
    """
    scalars = _scalar_values(model)
    producer = {name: node for node in model.graph.node for name in node.output}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1

    def made_by(name: str, op_type: str) -> onnx.NodeProto | None:
        node = producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def is_gelu_term(name: str, x: str) -> bool:
        """``name`` is ``erf(x / sqrt(2))`` or ``tanh(c * (x + ...))``."""
        erf = made_by(name, "Erf")
        if erf is not None:
            div = made_by(erf.input[0], "Div")
            return div is not None and div.input[0] == x and abs(scalars.get(div.input[1], 0.0) - 2**0.5) < 1e-6
        tanh = made_by(name, "Tanh")
        scaled = made_by(tanh.input[0], "Mul") if tanh is not None else None
        if scaled is None:
            return False
        return any((add := made_by(n, "Add")) is not None and x in add.input for n in scaled.input)

    reordered = 0
    for outer in model.graph.node:
        if outer.op_type != "Mul" or outer.domain not in ("", "ai.onnx") or len(outer.input) != 2:
            continue
        for k in (0, 1):
            x, half_of = outer.input[k], outer.input[1 - k]
            inner = made_by(half_of, "Mul")
            if inner is None or readers.get(half_of) != 1:
                continue
            halves = [i for i, name in enumerate(inner.input) if abs(scalars.get(name, 0.0) - 0.5) < 1e-7]
            if not halves:
                continue
            half, one_plus = inner.input[halves[0]], inner.input[1 - halves[0]]
            add = made_by(one_plus, "Add")
            if add is None or not any(is_gelu_term(n, x) for n in add.input):
                continue
            inner.input[0], inner.input[1] = x, one_plus
            outer.input[0], outer.input[1] = half_of, half
            reordered += 1
            break
    return reordered


def add_required_outputs(model: onnx.ModelProto) -> int:
    """Give ``LayerNormalization`` and ``SoftmaxCrossEntropyLoss`` nodes the outputs ORT's gradients read; returns
    how many outputs were added."""
    added = 0
    for index, node in enumerate(model.graph.node):
        wanted = _REQUIRED_OUTPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if wanted is None:
            continue
        for k in range(len(node.output), wanted):
            node.output.append(f"ortcore.dynamo::{node.op_type}_{index}_out{k}")
            added += 1
        for k in range(wanted):
            if node.output[k] == "":
                node.output[k] = f"ortcore.dynamo::{node.op_type}_{index}_out{k}"
                added += 1
    return added


def _written_buffers(written: list[str], module: torch.nn.Module) -> list[str]:
    """Of the state ``written`` in place while tracing, the buffers, less batch norm's running statistics (ortcore
    updates those itself); without the wrapper's ``module.`` prefix."""
    buffers = dict(module.named_buffers())
    modules = dict(module.named_modules())
    return [
        n.removeprefix("module.")
        for n in written
        if n in buffers and not isinstance(modules.get(n.rpartition(".")[0]), torch.nn.modules.batchnorm._BatchNorm)
    ]


class DynamoExporter:
    """``torch.onnx.export(dynamo=True)`` with parameters as inputs; see the module docstring."""

    name = DYNAMO

    def __init__(self, optimize: bool = True, *, inline_autograd_functions: bool = False, value_branches: bool = True):
        self.optimize = optimize
        # Branches on tensor values captured as the first batch takes them (torch.export.draft_export), else refused.
        self.value_branches = value_branches
        # ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0: the user accepts custom Functions traced through (as on the TorchScript
        # route); otherwise a model calling one is refused (see _custom_functions).
        self.inline_autograd_functions = inline_autograd_functions
        # What plugins add to this route (use_hooks): onnxscript translations of ops, passes over the exported
        # program before it is translated, and who runs each custom autograd Function.
        self.translations: dict[Any, Callable[..., Any]] = {}
        self.hooks: Any = None
        self.config: Any = None

    def use_hooks(self, hooks: Any, config: Any = None) -> None:
        """Take the plugins' contributions to this route, asked for at each export: ``ortcore_program_passes``
        (edits of the exported program's FX graph before translation), then ``ortcore_export_translations``
        (onnxscript translations of ops, torch.onnx's ``custom_translation_table``; asked after the passes, which
        may define the ops they translate) and ``ortcore_autograd_function_handler`` (who runs each custom autograd
        Function: its handler's ``dynamo_apply``)."""
        self.hooks = hooks
        self.config = config  # the ORTModule's (its own options, such as exporter=), which passes read

    def _translations(self) -> dict[Any, Callable[..., Any]]:
        # Plugins' translations come after the route's own (a plugin may route pooling elsewhere), the exporter's last.
        plugins = self.hooks.export_translations() if self.hooks is not None else {}
        return {**pooling_translations(), **plugins, **self.translations}

    def _function_handler(self, function: type) -> Any:
        return self.hooks.autograd_function_handler(function) if self.hooks is not None else None

    def fingerprint(self) -> dict[str, Any]:
        versions = {}
        for package in ("onnxscript", "onnx-ir"):
            try:
                versions[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                versions[package] = None
        return {
            "optimize": self.optimize,
            "inline_autograd_functions": self.inline_autograd_functions,
            "value_branches": self.value_branches,
            "pooling": POOLING_VERSION,
            "nll_loss_total_weight": 1,  # the route's own nll_loss_forward (a graph before it had onnxscript's)
            "size_conditions": SIZE_CONDITIONS_VERSION,
            **versions,
        }

    def _custom_functions(self, refused: list[type]) -> contextlib.AbstractContextManager:
        """While tracing, each custom ``torch.autograd.Function`` call goes where its handler says
        (``ortcore_autograd_function_handler``): traced through (:data:`ortcore.api.INLINE`, or the handler's
        ``traces_through(args)``), or the handler's ``dynamo_apply(cls, apply, args, kwargs)``, which records the call
        in the exported program (a custom op its translation turns into a node). A Function nobody answers for is
        traced through and appended to ``refused`` (the export is refused after tracing, naming them all), unless
        ``inline_autograd_functions``. torch's own Functions are traced through, except reentrant
        ``torch.utils.checkpoint``, which is the handler's to decide as on the TorchScript route."""

        def apply(cls, original, args, kwargs):
            name = function_name(cls)
            if name.startswith("torch.") and name != TORCH_CHECKPOINT_FUNCTION:
                return original(cls, *args, **kwargs)
            handler = self._function_handler(cls)
            if handler is None:
                if not self.inline_autograd_functions and name != TORCH_CHECKPOINT_FUNCTION:
                    refused.append(cls)
                return original(cls, *args, **kwargs)
            if handler != INLINE and hasattr(handler, "check"):
                handler.check()
            if handler == INLINE or getattr(handler, "traces_through", lambda _args: False)(args):
                return original(cls, *args, **kwargs)
            dynamo_apply = getattr(handler, "dynamo_apply", None)
            if dynamo_apply is None:
                raise UnsupportedModelError(
                    f"the custom autograd Function {name} is handled by {type(handler).__name__}, which cannot run "
                    'it on the dynamo route (it has no dynamo_apply): use exporter = "torchscript", or set '
                    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 to trace through it"
                )
            return dynamo_apply(cls, original, args, kwargs)

        return function_apply_replaced(apply)

    def export(self, request: ExportRequest) -> onnx.ModelProto:
        module, args, training, opset, log_level = (
            request.module,
            request.args,
            request.training,
            request.opset,
            request.log_level,
        )
        input_names, output_names, dynamic_axes = request.input_names, request.output_names, request.dynamic_axes
        if training:
            refuse_empty_inputs(args, input_names)
        missing = _missing_package()
        if missing is not None:
            raise UnsupportedModelError(
                f"the dynamo exporter needs the package {missing!r}, which is not installed: pip install {missing} "
                '(or ortcore[all]), or choose exporter = "torchscript"'
            )
        state: dict[str, torch.Tensor] = dict(module.named_parameters())
        state.update(module.named_buffers())
        names = list(state)
        persistent = set(module.state_dict(keep_vars=True))
        constants = {n: t for n, t in state.items() if n not in persistent}
        wrapper = _ParametersAsInputs(module, len(args), names)
        wrapper.training = training
        values = tuple(state[n].detach() for n in names)
        # A dimension of size 1 is exported as 1: torch.export's size-oblivious capture would give it the symbol of
        # a dimension it broadcasts against (x[B, N] + y[1, N]) and the graph would claim equal shapes (ORT's
        # gradient then keeps y's gradient [B, N]). The graph records it (input_ranges), so a call of another size
        # there gets a graph of its own, with that dimension dynamic.
        dims = tuple(
            {d: torch.export.Dim.AUTO for d in dynamic_axes[name] if t.shape[d] != 1} if name in dynamic_axes else None
            for name, t in zip(input_names, args)
        )
        start = time.perf_counter()
        refused: list[type] = []
        # One export at a time in the process (ortcore.api.EXPORT_LOCK): torch.export patches torch while it
        # traces, and plugins' passes and translations register ops.
        with EXPORT_LOCK:
            try:
                with (
                    quiet_export(log_level, loggers=_LOGGERS),
                    _float_batch_norm_momentum(module),
                    self._custom_functions(refused),
                ):
                    program = _capture(
                        wrapper, tuple(args) + values, (dims + (None,) * len(values),), self.value_branches
                    )
                captured = time.perf_counter()
                # The buffers the flat module returns (the core writes their new values back) are not refused.
                returned = {f"module.{n}" for n in getattr(module, "written", ())}
                written = _written_buffers([n for n in getattr(wrapper, "written", []) if n not in returned], module)
                if written:
                    owners = buffer_owners(written)
                    raise BufferWriteError(written, [o.removeprefix("module.") for o in owners], DYNAMO)
                ranges = input_ranges(program, list(input_names))
                if self.hooks is not None:
                    context = PassContext(
                        module=module,
                        training=training,
                        config=self.config or self.hooks.config,
                        translated=frozenset(self._translations()),  # what plugins translate before the passes run
                    )
                    for program_pass in self.hooks.program_passes():
                        program_pass.run(program, context)
                with quiet_export(log_level, loggers=_LOGGERS):
                    onnx_program = _translate(
                        program,
                        self._translations(),
                        input_names=list(input_names) + names,
                        output_names=list(output_names) or None,
                        opset=max(opset, 18),
                        optimize=self.optimize,
                        verbose=log_level == LogLevel.VERBOSE,
                    )
            except UnsupportedModelError:
                raise
            except Exception as e:  # torch.export and onnxscript raise many types; all mean "this model did not export"
                text = _first_line(e)
                raise UnsupportedModelError(
                    f"{_CAPTURE_FAILED} {type(module).__name__}: {text}",
                    raised_in_forward=e if raised_in(e, type(module).forward) else None,
                ) from e
        if refused:
            raise UnsupportedModelError(
                f"the model calls the custom autograd Function(s) "
                f"{', '.join(sorted({function_name(f) for f in refused}))}: torch.export traces through their "
                "forward, so ONNX Runtime would differentiate the forward instead of running their backward (a wrong "
                f"gradient wherever the two differ), and no plugin runs them on this route. Enable the "
                f"{AUTOGRAD_FUNCTION_PLUGIN!r} plugin, which runs each as a PythonOp calling its own backward, or set "
                "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 to accept tracing through them"
            )
        model = onnx_program.model_proto
        if ranges:
            model.metadata_props.add(key=INPUT_RANGES_METADATA, value=json.dumps(ranges))
        set_batch_norm_modes(model, module)
        gather_max_pools(model)
        separate_read_outputs(model)
        reorder_gelus(model)
        # A non-persistent buffer the forward writes stays an input: the core feeds it the value it writes back.
        _inputs_to_initializers(model, {n: t for n, t in constants.items() if n not in returned})
        _drop_unread_inputs(model, persistent)
        added = add_required_outputs(model)
        logger.log(
            15, "dynamo export: %.2f s (torch.export %.2f s), %d nodes, %d outputs added for ORT's gradients",
            time.perf_counter() - start, captured - start, len(model.graph.node), added,
        )  # fmt: skip
        return model


def _first_line(error: BaseException) -> str:
    """The line of a torch.export / onnxscript error that says what failed (their messages open with advice), and
    where in the model: the ``File ..., line N`` and code line torch.export names for data-dependent control flow,
    with what to do (graph breaks are impossible inside one exported graph)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    what = next((line for line in lines if line.startswith("<class ") or "Error" in line.split(":")[0]), None)
    if what is None:
        cause = error.__cause__
        what = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else None
    what = what or (lines[0] if lines else type(error).__name__)
    if "raised this error:" in str(error):
        after = lines[next(i for i, line in enumerate(lines) if "raised this error:" in line) + 1 :]
        where = [line for line in after[:2] if line]
        if where and where[0].startswith("File "):
            what += f" at {where[0]}" + (f": {where[1]}" if len(where) > 1 else "")
    if "data-dependent" in what and " at File " not in what:
        where = _user_frame(error)
        if where is not None:
            what += f" at {where}"
    if "data-dependent" in what:
        what += (
            " (Python control flow on a tensor's value: torch.export cannot break the graph there; use torch.cond, "
            'compute the condition outside the model, or use exporter = "torchscript", which traces the branch taken)'
        )
    return what


def _error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then each error it was raised from (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _user_frame(error: BaseException) -> str | None:
    """``File "...", line N, in f: code`` of the innermost frame outside torch, ortcore and the standard library in
    the traceback of ``error`` or the errors it was raised from: the model's line torch.export stopped at."""
    skipped = tuple(
        str(pathlib.Path(module.__file__).resolve().parent)
        for module in (torch, contextlib, sys.modules["ortcore"], sys.modules[__name__.rpartition(".")[0] or __name__])
    )
    found = None
    for chained in _error_chain(error):
        for frame in traceback.extract_tb(chained.__traceback__):
            if not str(pathlib.Path(frame.filename).resolve()).startswith(skipped):
                found = frame
    if found is None:
        return None
    return f'File "{found.filename}", line {found.lineno}, in {found.name}' + (f": {found.line}" if found.line else "")


_base_registries: dict[int, Any] = {}
_registry_lock = threading.Lock()


def _registry(opset: int, translations: dict[Any, Callable[..., Any]]) -> Any:
    """torch.onnx's table of op translations for ``opset`` with ``translations`` added (to a copy). The table of
    torch's and onnxscript's own translations is built once per process: building it takes 0.4-0.9 s, which every
    export after the first (an inference graph, a new input signature, another model) would pay again."""
    from torch.onnx._internal.exporter import _registration

    with _registry_lock:
        base = _base_registries.get(opset)
        if base is None:
            base = _base_registries[opset] = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    registry = copy.copy(base)
    registry.functions = {op: list(entries) for op, entries in base.functions.items()}
    for op, function in translations.items():
        registry.register_op(op, function, is_complex=False)
    return registry


def _translate(
    program: torch.export.ExportedProgram,
    translations: dict[Any, Callable[..., Any]],
    *,
    input_names: list[str],
    output_names: list[str] | None,
    opset: int,
    optimize: bool,
    verbose: bool,
) -> Any:
    """``torch.onnx.export(program, dynamo=True, custom_translation_table=translations)`` on the per-process
    translation table (:func:`_registry`); through the public call on a torch whose exporter is laid out otherwise."""
    try:
        from torch.onnx._internal.exporter import _core
    except ImportError:
        _core = None
    if _core is None or "registry" not in inspect.signature(_core.export).parameters:
        return torch.onnx.export(
            program,
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            opset_version=opset,
            optimize=optimize,
            custom_translation_table=translations or None,
            verbose=verbose,
            report=False,
        )
    return _core.export(
        program,
        registry=_registry(opset, translations),
        input_names=input_names,
        output_names=output_names,
        opset_version=opset,
        optimize=optimize,
        verbose=verbose,
        report=False,
    )


def _capture(
    module: torch.nn.Module, args: tuple, dynamic_shapes: tuple, value_branches: bool = False
) -> torch.export.ExportedProgram:
    """``torch.export`` as ``torch.onnx.export(dynamo=True)`` captures a module (non-strict first, then strict);
    the first strategy's error is raised when none succeeds. With ``value_branches``, a capture stopped by a branch
    on a tensor's value is repeated taking the branch these inputs take (:func:`_capture_branch_taken`)."""
    try:
        from torch.onnx._internal.exporter import _capture_strategies
    except ImportError:  # another torch layout: plain non-strict export
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    failures = []
    for strategy_class in _capture_strategies.CAPTURE_STRATEGIES:
        strategy = strategy_class(verbose=False, dump=False, artifacts_dir=".", timestamp="")
        result = strategy(module, args, None, dynamic_shapes=dynamic_shapes)
        if result.exported_program is not None:
            return result.exported_program
        failures.append(result.exception)
        if value_branches and _data_dependent(result.exception):
            program = _capture_branch_taken(module, args, dynamic_shapes)
            if program is not None:
                return program
    raise failures[0]


def _data_dependent(error: BaseException | None) -> bool:
    """Did torch.export stop at Python control flow on a tensor's value (a guard on a data-dependent size)?"""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return any(
        isinstance(e, GuardOnDataDependentSymNode) or "data-dependent expression" in str(e) for e in _error_chain(error)
    )


def _capture_branch_taken(
    module: torch.nn.Module, args: tuple, dynamic_shapes: tuple
) -> torch.export.ExportedProgram | None:
    """The capture a data-dependent branch stopped, repeated with the example inputs' values at hand
    (``torch.export.draft_export``: fake tensors carry the real ones): each such decision is taken as these inputs
    take it and kept in the program as a runtime assertion, as the TorchScript route traces the branch taken.
    Logged at WARNING with where each decision was made; None if that capture fails too."""
    try:
        draft = torch.export.draft_export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # noqa: BLE001 (the first error is the one to report)
        logger.debug("draft_export failed too: %s", e, exc_info=True)
        return None
    report = getattr(draft, "_report", None)
    # The draft program's fake tensors still carry the real values, and what later traces it (the passes,
    # torch.onnx's decompositions) would run every kernel on them and check custom ops' schemas against what they
    # did. Its graph has no branch left on a value: exported again, it gives a program like any other.
    try:
        # dynamic_shapes is given for a forward(*args), the draft's module takes the arguments one by one
        flat = dynamic_shapes[0] if len(dynamic_shapes) == 1 and len(args) != 1 else dynamic_shapes
        program = torch.export.export(draft.module(), args, dynamic_shapes=flat, strict=False)
    except Exception as e:  # noqa: BLE001 (the draft program serves, traced with real values)
        logger.debug("exporting the draft program again failed: %s", e, exc_info=True)
        program = draft
    decisions = [
        failure for failure in getattr(report, "failures", ()) if "DATA_DEPENDENT" in str(failure.failure_type)
    ]
    name = type(getattr(getattr(module, "target", module), "module", module)).__name__
    sites = "; ".join(sorted({_decision_site(f, _file_numbers(report)) for f in decisions})) or "sites not reported"
    with _warned_lock:
        first = (name, sites) not in _warned_decisions  # once per model and decisions, not per repair's export
        _warned_decisions.add((name, sites))
    logger.log(
        logging.WARNING if first else logging.INFO,
        "torch.export cannot capture %s whole: %d decision(s) on tensor values (%s). The graph takes them as the "
        "first batch does; a batch that decides otherwise is not detected (as on the TorchScript route)",
        name,
        len(decisions),
        sites,
    )
    return program


_warned_decisions: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _file_numbers(report: Any) -> dict[int, str]:
    """File names by the numbers torch's structured log gives them (the report holds only those first seen while
    it captured; torch's table holds the rest)."""
    files = dict(getattr(report, "str_to_filename", {}) or {})
    try:
        from torch._logging.structured import INTERN_TABLE

        files.update({number: name for name, number in INTERN_TABLE.items()})
    except ImportError:
        pass
    return files


def _decision_site(failure: Any, files: dict[int, str]) -> str:
    """``expr at file:line: code`` for one data-dependent decision of a ``draft_export`` report (its user stack holds
    file numbers, named by ``files``: :func:`_file_numbers`)."""
    data = getattr(failure, "data", {}) or {}
    expr = data.get("expr", "?")
    try:
        stack = data.get("user_stack") or []
        stack = ast.literal_eval(stack) if isinstance(stack, str) else stack
        frame = stack[-1]
        where = frame["filename"]
        where = files.get(where, files.get(str(where), "?")) if not isinstance(where, str) else where
        return f"{expr} at {where}:{frame['line']}: {frame['loc']}"
    except (ValueError, SyntaxError, IndexError, KeyError, TypeError):
        return str(expr)


@hookimpl
def ortcore_register(register: Any) -> None:
    register.exporter(
        DYNAMO,
        lambda config: DynamoExporter(
            inline_autograd_functions=custom_autograd_disabled(config.env),
            value_branches=_options(config).value_branches,
        ),
    )


@hookimpl
def ortcore_options_class() -> type:
    return DynamoExporterOptions


@hookimpl
def ortcore_repairs(config: Any, failure: Failure) -> list[Repair] | None:
    """When a stage fails on a graph of this route, the TorchScript exporter for the whole model. A failure of
    torch.export or onnxscript (data-dependent shapes in loss code, an op onnxscript cannot translate for these
    inputs: limits TorchScript, which traces what this call does, does not share), and a gradient the audit finds
    wrong (this route's graphs differ from the TorchScript route's, whose graph fixes have seen more models), get it
    after the op repairs (which keep this route) and before regions (which move work to PyTorch); a build or run
    failure (an op ORT cannot build or run, whichever exporter wrote it) and a refusal both routes make (a buffer
    write) only once no region helped."""
    if exporter_name(config) != DYNAMO or not _options(config).torchscript_repair or not torchscript_available():
        return None
    early = (failure.stage == "export" and _CAPTURE_FAILED in failure.message) or failure.stage == "audit"
    return [
        Repair(
            description="the TorchScript exporter instead of torch.export",
            plugin=CORE_REPAIR,
            options={"exporter": TORCHSCRIPT},
            kind="exporter" if early else "exporter_after_regions",
        )
    ]
