"""gradient_fixes: graph passes that make ONNX Runtime's gradients match PyTorch's where ORT's builders are wrong.

ORT 1.19.2's gradient builders get broadcasting wrong in two ways (see ``docs/plugins/gradient_fixes.md``):

* ``Where`` and ``Pow`` never reduce a gradient back to the shape of a broadcast input: the gradient of ``w[1, N]``
  in ``Where(cond[B, N], w, 0)`` comes out ``[B, N]``. Values are then wrong (a following ``TanhGrad`` reads
  ``w``'s activation with the wrong strides) or the backward fails (T5's position bias).
* ``Add``/``Sub``/``Mul``/``Div``/``Min``/``Max``/``Expand`` reduce correctly when shapes are fully static or unknown,
  but with *symbolic* dimensions they trust the names: a dimension ``x_dim0`` is taken never to broadcast against
  ``3`` or against ``y_dim0``. ortcore exports every input dimension as symbolic, so an input of shape ``[1, N]``
  requiring grad gets a ``[B, N]`` gradient.

The pass :func:`fix_broadcast_gradients` edits the forward graph before the gradient build:

* for a ``Where`` data input or a ``Pow`` base that may be broadcast (its shape is not provably the output's), it
  inserts ``Expand(x, Shape(other))`` for each other input that may be larger: the op then sees no broadcasting, and
  ORT's ``Expand`` gradient sums the gradient back to ``x``'s shape;
* for an input of the other ops whose symbolic dimension might broadcast, it inserts ``Expand(x, Shape(x))``: the
  same values, with a shape ORT cannot infer, so ORT builds the op's shape-reading (dynamic) gradient, which is right.

Only inputs that may carry a gradient (computed from a floating-point graph input) and that need it are changed:
a graph without such ops is left as it was.

A second pass, :func:`fix_conv_gradients`, works around two bugs of ORT's CPU ``ConvGrad`` *kernel*:

* for a grouped convolution (``group > 1``) whose kernel is not 2-D, the input gradient of each group is computed by
  ``Col2imNd``, which first zeroes ``C * spatial`` elements from the group's start instead of ``C / group *
  spatial``. The gradient itself comes out right, but the last group of the last image zeroes ``(group - 1) / group
  * C * spatial`` elements *past the end* of ``dX``: whatever ORT keeps there (another gradient still to be read) is
  silently corrupted. Wav2Vec2's positional convolution is one. A 1-D grouped ``Conv`` becomes a 2-D one on
  ``Unsqueeze``d input and weight (kernel ``[1, k]``), then ``Squeeze``: ORT's 2-D path zeroes only the group's own
  elements. A grouped ``Conv`` with a 3-D (or unknown-rank) kernel is split into one ``Conv`` per group. Only
  convolutions whose input may need a gradient are rewritten (``dX`` is computed only then);
* ``auto_pad`` is ignored (only ``pads`` is read), so ``padding="same"`` (exported as ``SAME_UPPER``) is
  differentiated as an unpadded convolution. ``SAME_UPPER``/``SAME_LOWER`` become the explicit ``pads`` ONNX defines.

Every traced ``detach()`` reaches the graph as a stop-gradient marker, which ORT cannot build:
:mod:`.stop_gradients` lowers each before the gradient build (``ortcore_lower_stop_gradients``), to an ``Identity``
where that is exact, else to a real stop-gradient (an ATen ``detach_copy`` no gradient crosses).

The package: :mod:`.onnx_passes` (the ONNX passes, both routes), :mod:`.stop_gradients` (the detach lowering, which
a host composed without this plugin registers alone), :mod:`.torchscript` (``no_grad`` regions on the TorchScript
route), :mod:`.dynamo` (program passes of the dynamo route); this module holds the hooks (the lowering's is its
module's). Dropping a route drops its module.
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from ortcore.api import Config, GraphPass, PassContext, hookimpl

from .dynamo import (  # noqa: F401 (re-exported: the plugin's names)
    STOP_NAMESPACE,
    STOP_PASS_NAME,
    _run_stop_gradients,
    _stop_gradient_translation,
    _warn_hidden_broadcasts,
    hidden_broadcasts,
    mark_stop_gradients,
    stop_gradient_op,
)
from .onnx_passes import (  # noqa: F401 (re-exported: the plugin's names)
    BATCH_NORM_PASS_NAME,
    BATCH_NORM_PASS_VERSION,
    CONV_PASS_NAME,
    CONV_PASS_VERSION,
    HIDDEN_PASS_NAME,
    MATMUL_PASS_NAME,
    MATMUL_PASS_VERSION,
    NAME,
    PASS_NAME,
    PASS_VERSION,
    fix_broadcast_gradients,
    fix_conv_gradients,
    fix_vector_matmul_gradients,
    infer_shapes,
    stateless_batch_norms_as_arithmetic,
)
from .stop_gradients import (  # noqa: F401 (re-exported: the plugin's names; the hook is the plugin's too)
    REAL_STOP_GRADIENT_PREFIX,
    ortcore_lower_stop_gradients,
    plan_stop_gradients,
    resolve_stop_gradients,
)
from .torchscript import NoGradInputsDetached  # noqa: F401

# -- hooks ----------------------------------------------------------------------------------------------------------


def _run(model: onnx.ModelProto, context: PassContext) -> None:
    fix_broadcast_gradients(model, context)


def _run_conv(model: onnx.ModelProto, context: PassContext) -> None:
    fix_conv_gradients(model, context)


def _run_matmul(model: onnx.ModelProto, context: PassContext) -> None:
    fix_vector_matmul_gradients(model, context)


def _run_stateless_batch_norms(model: onnx.ModelProto, context: PassContext) -> None:
    stateless_batch_norms_as_arithmetic(model, context)


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    return [
        GraphPass(PASS_NAME, run=_run, plugin=NAME),
        GraphPass(CONV_PASS_NAME, run=_run_conv, plugin=NAME),
        GraphPass(MATMUL_PASS_NAME, run=_run_matmul, plugin=NAME),
        GraphPass(BATCH_NORM_PASS_NAME, run=_run_stateless_batch_norms, plugin=NAME),
    ]


@hookimpl
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any:
    # torch.export records no_grad blocks itself (set_grad_enabled in the program): only the tracer needs this.
    # The dynamo route sees no_grad blocks in the exported program instead (mark_stop_gradients).
    return NoGradInputsDetached() if config.core.exporter == "torchscript" else None


@hookimpl
def ortcore_program_passes(config: Config) -> list[GraphPass]:
    return [
        GraphPass(HIDDEN_PASS_NAME, run=_warn_hidden_broadcasts, plugin=NAME),
        GraphPass(STOP_PASS_NAME, run=_run_stop_gradients, plugin=NAME),
    ]


@hookimpl
def ortcore_export_translations(config: Config) -> dict[Any, Any]:
    return {stop_gradient_op(): _stop_gradient_translation()}


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    return {
        "gradient_fixes.broadcast": PASS_VERSION,
        "gradient_fixes.conv": CONV_PASS_VERSION,
        "gradient_fixes.vector_matmul": MATMUL_PASS_VERSION,
        "gradient_fixes.stateless_batch_norms": BATCH_NORM_PASS_VERSION,
    }
