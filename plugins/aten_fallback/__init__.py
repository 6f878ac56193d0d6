"""Route chosen ops to PyTorch's own CPU kernels inside ONNX Runtime's training graph.

Some of ORT's CPU kernels are several times slower than PyTorch's (embedding's GatherGrad, GELU's gradients,
LayerNormalizationGrad, the softmax cross-entropy loss; see ``docs/plugins/aten_fallback.md`` for the numbers). This
plugin exports those ops as ``org.pytorch.aten::ATen`` nodes, gives each a gradient definition made of ATen nodes
too, and registers an ATen op executor (:mod:`ortcore_plugins._aten_executor`) that runs them with
``torch.ops.aten.*`` kernels, zero-copy through DLPack. Everything else stays in ORT.

Option ``[plugins.aten_fallback] torch_kernels`` (env ``ORTCORE_TORCH_KERNELS``, a comma list; ``""`` or ``"none"``
routes nothing) chooses the ops; with none, the exported graphs contain no ATen node.

Ops the exporter cannot express at all (``torch.cummax``, ``torch.logcumsumexp``, ``torch.special.*``, ...) are run
the same way when option ``fallback_ops`` (env ``ORTCORE_ATEN_FALLBACK_OPS``) names them, or names ``auto``: each
becomes one ATen node running the op, whose gradient re-runs it under ``torch.autograd`` (see
:func:`fallback_symbolic`). Off by default: without it such a model falls back to PyTorch, as without the plugin.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import numpy as np
import onnx
import torch

from ortcore.config import Config, option
from ortcore.errors import OptionError
from ortcore.exporter import TorchScriptExporter, custom_autograd_disabled, layer_norm
from ortcore.graph_passes import GraphPass, PassContext
from ortcore.hookspecs import hookimpl
from ortcore_plugins.services import aten_executor as executor

logger = logging.getLogger("ortcore.aten_fallback")

NAME = "aten_fallback"
ENV = "ORTCORE_TORCH_KERNELS"
FALLBACK_ENV = "ORTCORE_ATEN_FALLBACK_OPS"
ATEN_DOMAIN = "org.pytorch.aten"
# The torch.library namespace of the helper ops the gradient definitions use (see _define_helper_ops).
HELPER_NAMESPACE = "ortcore_aten"
TANH_GELU_PASS = "aten_fallback.tanh_gelu"
TYPE_OUTPUTS_PASS = "aten_fallback.typed_outputs"

# Ops this plugin can route, and those routed by default: the ones measured faster in torch than in ORT on CPU.
ROUTABLE_OPS: tuple[str, ...] = ("embedding", "gelu", "layer_norm", "cross_entropy", "linear")
DEFAULT_OPS: tuple[str, ...] = ("embedding", "gelu", "layer_norm", "cross_entropy")


# -- options --------------------------------------------------------------------------------------------------------


def parse_ops(value: object, source: str) -> tuple[str, ...]:
    """A list of op names, or a comma-separated string; ``""`` and ``"none"`` mean no op."""
    if isinstance(value, str):
        items = [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",")]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise OptionError(
            f"{source}={value!r} must be a list of op names (or a comma-separated string); "
            f"allowed: {', '.join(ROUTABLE_OPS)}, or 'none'"
        )
    if [item.lower() for item in items] == ["none"]:
        items = []
    for item in items:
        if item not in ROUTABLE_OPS:
            close = difflib.get_close_matches(item, ROUTABLE_OPS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise OptionError(
                f"{source}={value!r}: unknown op {item!r}; allowed: {', '.join(ROUTABLE_OPS)}, or 'none'.{hint}"
            )
    return tuple(dict.fromkeys(items))  # ordered, without duplicates


AUTO = "auto"


def parse_fallback_ops(value: object, source: str) -> tuple[str, ...]:
    """ATen op names (``cummax`` or ``aten::cummax``) and/or ``auto``, as a list or a comma-separated string."""
    if isinstance(value, str):
        items = [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",")]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise OptionError(f"{source}={value!r} must be a list of ATen op names, 'auto' or 'none'")
    if [item.lower() for item in items] == ["none"]:
        items = []
    names = []
    for item in items:
        if item.lower() == AUTO:
            names.append(AUTO)
            continue
        namespace, _, name = item.rpartition("::")
        if namespace not in ("", "aten") or not name.isidentifier():
            raise OptionError(
                f"{source}={value!r}: {item!r} is not an ATen op name (such as 'cummax' or 'aten::cummax')"
            )
        if not hasattr(torch.ops.aten, name):
            raise OptionError(f"{source}={value!r}: PyTorch has no op aten::{name}")
        names.append(f"aten::{name}")
    return tuple(dict.fromkeys(names))


@attrs.frozen
class AtenFallbackOptions:
    """Options of the ``aten_fallback`` plugin (``[plugins.aten_fallback]`` in ortcore.toml)."""

    torch_kernels: tuple[str, ...] = option(
        DEFAULT_OPS,
        parse_ops,
        f"ops run with PyTorch's kernels inside the ORT graph; any of {', '.join(ROUTABLE_OPS)}, or none",
        env=ENV,
    )
    fallback_ops: tuple[str, ...] = option(
        (),
        parse_fallback_ops,
        "ops the exporter cannot express, exported as ATen nodes run by PyTorch (forward and backward): ATen op "
        "names, and/or 'auto' for every op the exporter reports unsupported",
        env=FALLBACK_ENV,
    )


def routed_ops(config: Config) -> frozenset[str]:
    """The ops routed to PyTorch under ``config``.

    An empty ``ORTCORE_TORCH_KERNELS`` means "none" here, although the core's option loader treats an empty
    variable as unset: for this switch, ``ORTCORE_TORCH_KERNELS= python train.py`` must turn routing off.
    """
    if config.env.get(ENV) is not None and config.env[ENV].strip() == "":
        return frozenset()
    options = config.plugin_options(NAME)
    return frozenset(options.torch_kernels if options is not None else DEFAULT_OPS)


# -- helper ops: backward formulas as single-output, self-contained nodes ---------------------------------------------
#
# How ORT 1.19.2 handles gradient definitions shapes these ops:
# * a node of a definition keeps only its first output, so a backward that torch computes as one multi-output kernel
#   (LayerNorm's, linear's) is split into one op per gradient;
# * a definition with intermediate values (a Constant feeding a node, say) fails to build when one of the forward
#   node's inputs needs no gradient ("... is not a valid intermediate output"), so every node reads only GO(i), I(i)
#   and O(i); what an op needs beyond those (which gradient, the number of embedding rows) is fixed by the op itself
#   or read from a forward input;
# * nothing is built unless the forward node's first input needs a gradient (see _gradient_reaches_first_input).


def _layer_norm_backward(which: int) -> Callable[..., torch.Tensor]:
    """The gradient of ``native_layer_norm`` with respect to its input (0), weight (1) or bias (2)."""
    mask = [which == 0, which == 1, which == 2]  # torch computes only the requested gradient

    def backward(
        grad_out: torch.Tensor,
        input: torch.Tensor,
        normalized_shape: list[int],
        mean: torch.Tensor,
        rstd: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        grads = torch.ops.aten.native_layer_norm_backward(
            grad_out, input, normalized_shape, mean, rstd, weight, bias, mask
        )
        return grads[which]

    return backward


def _embedding_backward(
    grad: torch.Tensor, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool
) -> torch.Tensor:
    """Dense embedding gradient, as torch's autograd computes it; ``weight`` only gives the number of rows."""
    return torch.ops.aten.embedding_dense_backward(grad, indices, weight.shape[0], padding_idx, scale_grad_by_freq)


def _class_dim(logits: torch.Tensor) -> int:
    return 1 if logits.dim() >= 2 else 0


def _as_rows(log_probs: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C, d1, ...) and (N, d1, ...) as (rows, C) and (rows,): the shapes nll_loss_forward/backward take."""
    if log_probs.dim() <= 2:
        return log_probs, target
    return log_probs.movedim(1, -1).reshape(-1, log_probs.shape[1]), target.reshape(-1)


def _class_weight_view(weight: torch.Tensor, log_probs: torch.Tensor, dim: int) -> torch.Tensor:
    return weight.view([-1 if d == dim else 1 for d in range(log_probs.dim())])


def _cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.nn.functional.cross_entropy`` (class indices) returning ``(loss, log_probs, total_weight)``.

    The kernels of torch's ``cross_entropy_loss`` (log_softmax, then nll_loss), keeping what the backward needs.
    """
    dim = _class_dim(logits)
    log_probs = torch.ops.aten._log_softmax(logits, dim, False)
    rows, flat_target = _as_rows(log_probs, target)
    loss, total_weight = torch.ops.aten.nll_loss_forward(rows, flat_target, weight, reduction, ignore_index)
    if reduction == 0:
        loss = loss.reshape(target.shape)
    if label_smoothing > 0.0:
        # As torch's cross_entropy_loss_label_smoothing: (1 - eps) * nll + eps / C * smooth.
        n_classes = log_probs.shape[dim]
        weighted = log_probs * _class_weight_view(weight, log_probs, dim) if weight is not None else log_probs
        smooth = (-weighted.sum(dim)).masked_fill(target == ignore_index, 0.0)
        if reduction == 1:
            # nll_loss's total_weight is the same denominator: the summed weight (or count) of the kept targets.
            smooth = smooth.sum() / total_weight
        elif reduction == 2:
            smooth = smooth.sum()
        loss = (1 - label_smoothing) * loss + smooth * (label_smoothing / n_classes)
    return loss, log_probs, total_weight


def _cross_entropy_backward(
    grad: torch.Tensor,
    log_probs: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
    total_weight: torch.Tensor,
) -> torch.Tensor:
    """Gradient of :func:`_cross_entropy`'s loss with respect to the logits."""
    dim = _class_dim(log_probs)
    rows, flat_target = _as_rows(log_probs, target)
    flat_grad = grad.reshape(-1) if reduction == 0 else grad
    grad_rows = torch.ops.aten.nll_loss_backward(
        flat_grad, rows, flat_target, weight, reduction, ignore_index, total_weight
    )
    grad_log_probs = (
        grad_rows if rows is log_probs else grad_rows.reshape(log_probs.movedim(1, -1).shape).movedim(-1, 1)
    )
    if label_smoothing > 0.0:
        # d smooth / d log_probs[n, c] = -weight[c] * scale[n], zero on ignored targets.
        n_classes = log_probs.shape[dim]
        scale = (target != ignore_index).to(log_probs.dtype) * (grad / total_weight if reduction == 1 else grad)
        scale = scale.unsqueeze(dim)
        if weight is not None:
            scale = scale * _class_weight_view(weight, log_probs, dim)
        grad_log_probs = (1 - label_smoothing) * grad_log_probs - (label_smoothing / n_classes) * scale
    return torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, dim, log_probs.dtype)


def _linear_no_bias(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(input, weight)


def _linear_backward_input(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.matmul(weight)


def _linear_backward_weight(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).t().mm(input.reshape(-1, input.shape[-1]))


def _linear_backward_bias(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).sum(0)


# addmm(self, mat1, mat2, beta, alpha) = beta * self + alpha * mat1 @ mat2: the gradients autograd computes.
def _addmm_backward_self(grad: torch.Tensor, self: torch.Tensor, beta: float) -> torch.Tensor:
    scaled = grad if beta == 1 else grad * beta
    return scaled.sum_to_size(self.shape)


def _addmm_backward_mat1(grad: torch.Tensor, mat2: torch.Tensor, alpha: float) -> torch.Tensor:
    result = grad.mm(mat2.t())
    return result if alpha == 1 else result.mul_(alpha)


def _addmm_backward_mat2(grad: torch.Tensor, mat1: torch.Tensor, alpha: float) -> torch.Tensor:
    result = mat1.t().mm(grad)
    return result if alpha == 1 else result.mul_(alpha)


_LAYER_NORM_BACKWARD_ARGS = (
    "(Tensor grad_out, Tensor input, SymInt[] normalized_shape, Tensor mean, Tensor rstd, Tensor? weight, "
    "Tensor? bias) -> Tensor"
)

# name -> (schema, implementation)
HELPER_OPS: dict[str, tuple[str, Callable[..., Any]]] = {
    "layer_norm_backward_input": (_LAYER_NORM_BACKWARD_ARGS, _layer_norm_backward(0)),
    "layer_norm_backward_weight": (_LAYER_NORM_BACKWARD_ARGS, _layer_norm_backward(1)),
    "layer_norm_backward_bias": (_LAYER_NORM_BACKWARD_ARGS, _layer_norm_backward(2)),
    "embedding_backward": (
        "(Tensor grad, Tensor weight, Tensor indices, SymInt padding_idx, bool scale_grad_by_freq) -> Tensor",
        _embedding_backward,
    ),
    "cross_entropy": (
        "(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index, float label_smoothing) "
        "-> (Tensor, Tensor, Tensor)",
        _cross_entropy,
    ),
    "cross_entropy_backward": (
        "(Tensor grad, Tensor log_probs, Tensor target, Tensor? weight, int reduction, SymInt ignore_index, "
        "float label_smoothing, Tensor total_weight) -> Tensor",
        _cross_entropy_backward,
    ),
    "linear_no_bias": ("(Tensor input, Tensor weight) -> Tensor", _linear_no_bias),
    "linear_backward_input": ("(Tensor grad, Tensor input, Tensor weight) -> Tensor", _linear_backward_input),
    "linear_backward_weight": ("(Tensor grad, Tensor input, Tensor weight) -> Tensor", _linear_backward_weight),
    "linear_backward_bias": ("(Tensor grad) -> Tensor", _linear_backward_bias),
    "addmm_backward_self": ("(Tensor grad, Tensor self, Scalar beta) -> Tensor", _addmm_backward_self),
    "addmm_backward_mat1": ("(Tensor grad, Tensor mat2, Scalar alpha) -> Tensor", _addmm_backward_mat1),
    "addmm_backward_mat2": ("(Tensor grad, Tensor mat1, Scalar alpha) -> Tensor", _addmm_backward_mat2),
}

_helper_library: torch.library.Library | None = None


def _define_helper_ops() -> None:
    """Define the ``ortcore_aten::*`` ops once per process (the executor resolves them by schema, as aten ops)."""
    global _helper_library
    if _helper_library is not None:
        return
    lib = torch.library.Library(HELPER_NAMESPACE, "FRAGMENT")
    for name, (schema, fn) in HELPER_OPS.items():
        lib.define(f"{name}{schema}")
        # CompositeExplicitAutograd: one implementation for every device; the executor calls them without autograd.
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _helper_library = lib


# -- gradient definitions -------------------------------------------------------------------------------------------
#
# Each definition is a list of nodes (op_type or (op_type, domain), inputs, outputs, attributes). Inputs name
# GO(i) (gradient of forward output i), I(i) and O(i) (forward input/output i); outputs name GI(i) (gradient of
# forward input i). Definitions are keyed by "org.pytorch.aten::ATen::<operator>::<overload>" and the first
# registration of a key in a process wins.

NodeSpec = tuple[Any, list[str], list[str], dict[str, dict[str, Any]]]


def _aten_node(operator: str, inputs: list[str], output: str) -> NodeSpec:
    return (("ATen", ATEN_DOMAIN), inputs, [output], {"operator": {"value": operator, "dtype": "string"}})


def _helper(name: str) -> str:
    return f"{HELPER_NAMESPACE}::{name}"


_LAYER_NORM_SAVED = ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(2)", "I(3)"]
_LINEAR_SAVED = ["GO(0)", "I(0)", "I(1)"]

GRADIENTS: dict[str, list[NodeSpec]] = {
    # embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    "embedding": [_aten_node(_helper("embedding_backward"), ["GO(0)", "I(0)", "I(1)", "I(2)", "I(3)"], "GI(0)")],
    # gelu(self, approximate)
    "gelu": [_aten_node("gelu_backward", ["GO(0)", "I(0)", "I(1)"], "GI(0)")],
    # native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)
    "native_layer_norm": [
        _aten_node(_helper("layer_norm_backward_input"), _LAYER_NORM_SAVED, "GI(0)"),
        _aten_node(_helper("layer_norm_backward_weight"), _LAYER_NORM_SAVED, "GI(2)"),
        _aten_node(_helper("layer_norm_backward_bias"), _LAYER_NORM_SAVED, "GI(3)"),
    ],
    # ortcore_aten::cross_entropy(self, target, weight, reduction, ignore_index, label_smoothing)
    #     -> (loss, log_probs, total_weight)
    _helper("cross_entropy"): [
        _aten_node(
            _helper("cross_entropy_backward"),
            ["GO(0)", "O(1)", "I(1)", "I(2)", "I(3)", "I(4)", "I(5)", "O(2)"],
            "GI(0)",
        )
    ],
    # linear(input, weight, bias)
    "linear": [
        _aten_node(_helper("linear_backward_input"), _LINEAR_SAVED, "GI(0)"),
        _aten_node(_helper("linear_backward_weight"), _LINEAR_SAVED, "GI(1)"),
        _aten_node(_helper("linear_backward_bias"), ["GO(0)"], "GI(2)"),
    ],
    # ortcore_aten::linear_no_bias(input, weight)
    # addmm(self, mat1, mat2, beta, alpha): GPT-2's Conv1D
    "addmm": [
        _aten_node(_helper("addmm_backward_self"), ["GO(0)", "I(0)", "I(3)"], "GI(0)"),
        _aten_node(_helper("addmm_backward_mat1"), ["GO(0)", "I(2)", "I(4)"], "GI(1)"),
        _aten_node(_helper("addmm_backward_mat2"), ["GO(0)", "I(1)", "I(4)"], "GI(2)"),
    ],
    _helper("linear_no_bias"): [
        _aten_node(_helper("linear_backward_input"), _LINEAR_SAVED, "GI(0)"),
        _aten_node(_helper("linear_backward_weight"), _LINEAR_SAVED, "GI(1)"),
    ],
}

# Inputs that never get a gradient: class weights of the loss (torch refuses to differentiate them too).
STOP_GRADIENT_EDGES: dict[str, set[int]] = {_helper("cross_entropy"): {1, 2}, "embedding": {1}}


def _gradient_key(operator: str, overload: str = "") -> str:
    return f"{ATEN_DOMAIN}::ATen::{operator}::{overload}"


def _to_definition(nodes: list[NodeSpec]) -> list[Any]:
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


_registered_gradients = False


def _register_gradients() -> None:
    """Register every gradient definition once per process (ORT keeps the first registration of a key)."""
    global _registered_gradients
    if _registered_gradients:
        return
    from onnxruntime.capi import _pybind_state as C

    for operator, nodes in GRADIENTS.items():
        C.register_gradient_definition(_gradient_key(operator), _to_definition(nodes))
    for operator, edges in STOP_GRADIENT_EDGES.items():
        C.register_custom_stop_gradient_edges(_gradient_key(operator), edges)
    _registered_gradients = True


_prepare_lock = threading.Lock()


def _prepare_runtime() -> None:
    """What every routed graph needs before ORT builds it: helper ops, gradient definitions, the executor."""
    with _prepare_lock:
        _define_helper_ops()
        _register_gradients()
        executor.install()


# -- symbolics --------------------------------------------------------------------------------------------------------
#
# Each symbolic emits an ATen node and types its outputs: ORT cannot infer an ATen node's output types. Sizes keep
# what is static (1 for a broadcast dimension, the hidden size) and leave dynamic dimensions unknown; the
# ``typed_outputs`` pass then drops the names the exporter invents for those, because ORT would take two differently
# named dimensions for two different sizes when it plans broadcasting gradients (see type_aten_outputs).


def _aten(g: Any, operator: str, *inputs: Any, outputs: int = 1) -> Any:
    return g.op(f"{ATEN_DOMAIN}::ATen", *inputs, operator_s=operator, overload_name_s="", outputs=outputs)


def _constant(g: Any, value: Any, dtype: torch.dtype) -> Any:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _string(g: Any, text: str) -> Any:
    # The executor decodes uint8 tensors into the str arguments of the op's schema.
    return _constant(g, list(text.encode("utf-8")), torch.uint8)


def _sizes(value: Any) -> list[int | None] | None:
    """A value's sizes as far as the exporter knows them (None entries are dynamic), or None if its rank is unknown."""
    return value.type().varyingSizes()


def _typed(value: Any, like: Any, sizes: list[int | None] | None) -> Any:
    """Give ``value`` the element type of ``like`` and ``sizes`` (None: unknown rank)."""
    t = like.type()
    value.setType(t.with_sizes(list(sizes)) if sizes is not None else torch._C.TensorType.get().with_dtype(t.dtype()))
    return value


def _requires_grad(value: Any) -> bool | None:
    """Whether the traced value requires grad (None if the exporter does not know)."""
    from torch.onnx import symbolic_helper as sh

    if value is None or sh._is_none(value):
        return False
    try:
        return value.type().requires_grad()
    except (AttributeError, RuntimeError):
        return None


def _gradient_reaches_first_input(first: Any, *others: Any) -> bool:
    """Can ORT build this ATen node's gradient? Not if only inputs after the first need one.

    ORT 1.19.2 builds the gradient of an ATen node only when its first input is on the gradient path: with a
    LayerNorm over a frozen embedding (or a Linear over the raw input), weight and bias would get no gradient
    ("failed to find NodeArg by name: <weight>_grad"). Such nodes keep ORT's kernels. The answer holds for the
    requires_grad flags seen at export; see the limitations in docs/plugins/aten_fallback.md.
    """
    if _requires_grad(first) is True:
        return True
    return all(_requires_grad(v) is False for v in others)


def _symbolic_embedding(
    g: Any, weight: Any, indices: Any, padding_idx: Any, scale_grad_by_freq: Any, sparse: Any
) -> Any:
    from torch.onnx import symbolic_helper as sh

    out = _aten(
        g,
        "embedding",
        weight,
        indices,
        _constant(g, sh._get_const(padding_idx, "i", "padding_idx"), torch.int64),
        _constant(g, bool(sh._get_const(scale_grad_by_freq, "b", "scale_grad_by_freq")), torch.bool),
        # The gradient inside the ORT graph is dense whatever `sparse` says; the forward result is the same.
        _constant(g, False, torch.bool),
    )
    indices_sizes, weight_sizes = _sizes(indices), _sizes(weight)
    known = indices_sizes is not None and weight_sizes is not None
    return _typed(out, weight, [*indices_sizes, weight_sizes[-1]] if known else None)


def _symbolic_gelu(g: Any, self: Any, approximate: Any = "none") -> Any:
    from torch.onnx import symbolic_helper as sh

    if not isinstance(approximate, str):
        approximate = sh._get_const(approximate, "s", "approximate")
    return _typed(_aten(g, "gelu", self, _string(g, approximate)), self, _sizes(self))


def _symbolic_layer_norm(
    g: Any, input: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any, cudnn_enable: Any
) -> Any:
    from torch.onnx import symbolic_helper as sh

    if not _gradient_reaches_first_input(input, weight, bias):
        return layer_norm(g, input, normalized_shape, weight, bias, eps)
    shape = list(sh._get_const(normalized_shape, "is", "normalized_shape"))
    # Without weight or bias, feed ones and zeros: the gradient definition names a gradient for each, and ORT names
    # every gradient of a missing input "_grad", which would then be defined twice.
    dtype = input.type().dtype() or torch.float32
    if sh._is_none(weight):
        weight = _constant(g, torch.ones(shape).tolist(), dtype)
    if sh._is_none(bias):
        bias = _constant(g, torch.zeros(shape).tolist(), dtype)
    out, mean, rstd = _aten(
        g,
        "native_layer_norm",
        input,
        _constant(g, shape, torch.int64),
        weight,
        bias,
        _constant(g, float(sh._get_const(eps, "f", "eps")), torch.float64),
        outputs=3,
    )
    sizes = _sizes(input)
    _typed(mean, input, None if sizes is None else [*sizes[: len(sizes) - len(shape)], *[1] * len(shape)])
    _typed(rstd, input, None if sizes is None else [*sizes[: len(sizes) - len(shape)], *[1] * len(shape)])
    return _typed(out, input, sizes)


def _symbolic_cross_entropy(
    g: Any, self: Any, target: Any, weight: Any, reduction: Any, ignore_index: Any, label_smoothing: Any
) -> Any:
    from torch.onnx import symbolic_helper as sh

    if target.type().scalarType() in ("Float", "Double", "Half", "BFloat16"):
        # Class probabilities as targets: not this op's formula; ONNX's export decides.
        return _DEFAULTS["cross_entropy"](g, self, target, weight, reduction, ignore_index, label_smoothing)
    reduction = sh._get_const(reduction, "i", "reduction")
    smoothing = sh._maybe_get_const(label_smoothing, "f")
    loss, log_probs, total_weight = _aten(
        g,
        _helper("cross_entropy"),
        self,
        target,
        weight,  # a None value becomes a missing optional input
        _constant(g, reduction, torch.int64),
        _constant(g, sh._get_const(ignore_index, "i", "ignore_index"), torch.int64),
        _constant(g, float(smoothing or 0.0), torch.float64),
        outputs=3,
    )
    _typed(log_probs, self, _sizes(self))
    _typed(total_weight, self, [])
    return _typed(loss, self, _sizes(target) if reduction == 0 else [])


def _symbolic_linear(g: Any, input: Any, weight: Any, bias: Any) -> Any:
    from torch.onnx import symbolic_helper as sh

    if not _gradient_reaches_first_input(input, weight, bias):
        return _DEFAULTS["linear"](g, input, weight, bias)
    if sh._is_none(bias):
        # A separate op, so that its gradient definition does not name a gradient for the missing bias.
        out = _aten(g, _helper("linear_no_bias"), input, weight)
    else:
        out = _aten(g, "linear", input, weight, bias)
    input_sizes, weight_sizes = _sizes(input), _sizes(weight)
    known = input_sizes is not None and weight_sizes is not None
    return _typed(out, input, [*input_sizes[:-1], weight_sizes[0]] if known else None)


def _symbolic_addmm(g: Any, self: Any, mat1: Any, mat2: Any, beta: Any, alpha: Any) -> Any:
    from torch.onnx import symbolic_helper as sh

    if not _gradient_reaches_first_input(self, mat1, mat2):
        return _DEFAULTS["addmm"](g, self, mat1, mat2, beta, alpha)
    scalars = []
    for value in (beta, alpha):
        number = sh._maybe_get_const(value, "f")
        if sh._is_value(number):  # a tensor-valued scale: leave it to ONNX's export
            return _DEFAULTS["addmm"](g, self, mat1, mat2, beta, alpha)
        scalars.append(_constant(g, float(number), torch.float64))
    out = _aten(g, "addmm", self, mat1, mat2, *scalars)
    mat1_sizes, mat2_sizes = _sizes(mat1), _sizes(mat2)
    known = mat1_sizes is not None and mat2_sizes is not None
    # The output needs a gradient if the bias does even when mat1 does not: later symbolics read that flag.
    like = self if _requires_grad(self) else mat1
    return _typed(out, like, [mat1_sizes[0], mat2_sizes[1]] if known else None)


# The ONNX symbolic each routable op has when it is not routed (TorchScript symbolics are process-wide: a routed
# symbolic registered for one model would otherwise stay in force for the next one).
def _default_symbolic(op: str) -> Callable[..., Any]:
    def symbolic(g: Any, *args: Any) -> Any:
        from torch.onnx import symbolic_opset9, symbolic_opset12, symbolic_opset20

        if op == "embedding":
            return symbolic_opset9.embedding(g, *args)
        if op == "gelu":
            return (symbolic_opset20 if g.opset >= 20 else symbolic_opset9).gelu(g, *args)
        if op == "cross_entropy":
            return symbolic_opset12.cross_entropy_loss(g, *args)
        if op == "addmm":
            return symbolic_opset9.addmm(g, *args)
        return symbolic_opset9.linear(g, *args)

    symbolic.__name__ = f"default_{op}"
    return symbolic


# op name -> (TorchScript symbolic names, routed symbolic). layer_norm has no default here: the core registers its own.
_SYMBOLICS: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "embedding": (("::embedding",), _symbolic_embedding),
    "gelu": (("::gelu",), _symbolic_gelu),
    "layer_norm": (("::layer_norm",), _symbolic_layer_norm),
    "cross_entropy": (("::cross_entropy_loss",), _symbolic_cross_entropy),
    "linear": (("::linear",), _symbolic_linear),
}
# `linear` also routes addmm, the other dense layer (GPT-2's Conv1D): both are Gemm/MatMul in ORT.
_EXTRA_SYMBOLICS: dict[str, tuple[str, str, Callable[..., Any]]] = {"addmm": ("linear", "::addmm", _symbolic_addmm)}
_DEFAULTS: dict[str, Callable[..., Any]] = {
    op: _default_symbolic(op) for op in ("embedding", "gelu", "cross_entropy", "linear", "addmm")
}


def symbolics_for(ops: Iterable[str]) -> dict[str, Callable[..., Any]]:
    """The TorchScript symbolics that route ``ops`` (and restore ONNX's own export of the other routable ops)."""
    ops = set(ops)
    result: dict[str, Callable[..., Any]] = {}
    for op, (names, routed) in _SYMBOLICS.items():
        fn = routed if op in ops else _DEFAULTS.get(op)
        if fn is not None:
            result.update(dict.fromkeys(names, fn))
    for symbol, (option_name, name, routed) in _EXTRA_SYMBOLICS.items():
        result[name] = routed if option_name in ops else _DEFAULTS[symbol]
    return result


# -- ops the exporter cannot express ----------------------------------------------------------------------------------
#
# An op without an ONNX symbolic (torch.cummax, torch.logcumsumexp, torch.special.*, ...) is exported as one ATen node
# running the op itself. Its gradient definition has one node per tensor input i, a helper op
# ``ortcore_aten::fallback_grad__<op>__<overload>__<i>`` that re-runs the op under torch.autograd on the forward inputs
# and returns the vector-Jacobian product for input i (one single-output node per gradient: see the helper ops above).
# Integer outputs (cummax's indices) take no gradient; integer tensor inputs get none either.


def fallback_ops(config: Config) -> tuple[str, ...]:
    """The ``fallback_ops`` option: ``aten::<name>`` entries and possibly ``"auto"``."""
    options = config.plugin_options(NAME)
    return options.fallback_ops if options is not None else ()


_FLOAT_TYPES = ("Float", "Double", "Half", "BFloat16")


def _schema_type(t: Any, op: str, name: str) -> str:
    """A schema argument type as text for the helper op's schema (the executor converts each from a tensor)."""
    kind = t.kind()
    if kind == "OptionalType":
        return f"{_schema_type(t.getElementType(), op, name)}?"
    if kind == "ListType":
        element = _schema_type(t.getElementType(), op, name)
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


def _grad_helper_name(operator: str, overload: str, index: int) -> str:
    return f"fallback_grad__{operator.replace('::', '__')}__{overload or 'default'}__{index}"


def op_packet(operator: str) -> Any:
    """``torch.ops.<namespace>.<name>`` of ``operator`` (``name`` alone is an aten op)."""
    namespace, _, name = operator.rpartition("::")
    return getattr(getattr(torch.ops, namespace or "aten"), name)


# Gradients of one backward run, computed once for every input of a node (see _make_vjp); cleared around each run.
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


def _make_vjp(
    overload_packet: Any,
    schema: Any,
    n_grads: int,
    differentiable: tuple[int, ...],
    index: int,
    float_inputs: tuple[int, ...] = (),
) -> Any:
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
        key = (id(overload_packet), _tensor_key(list(values)))
        if len(targets) > 1:
            _, done = _vjp_results.get(key, (None, {}))
            if index in done:
                result = done.pop(index)
                if not done:
                    del _vjp_results[key]
                return result
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
                    [o for o, _ in pairs], [leaves[i] for i in present], [g.expand_as(o) for o, g in pairs],
                    allow_unused=True,
                )
        gradients = {i: torch.zeros_like(leaves[i]) if g is None else g for i, g in zip(present, computed, strict=True)}
        mine = gradients.pop(index)
        if gradients:
            _vjp_results[key] = (list(values), gradients)
        return mine

    return vjp


_fallback_lock = threading.Lock()
_fallback_gradients: set[tuple[str, str]] = set()


def _register_fallback_gradient(
    operator: str, overload: str, schema: Any, differentiable: tuple[int, ...], float_inputs: tuple[int, ...]
) -> None:
    """Define the VJP helper ops of ``aten::<operator>.<overload>`` and register its gradient definition (once)."""
    from onnxruntime.capi import _pybind_state as C

    with _fallback_lock:
        if (operator, overload) in _fallback_gradients:
            return
        _prepare_runtime()
        packet = getattr(op_packet(operator), overload or "default")
        grad_args = [f"Tensor? grad_{j}" for j in range(len(differentiable))]
        arguments = [f"{_schema_type(a.type, operator, a.name)} {a.name}" for a in schema.arguments]
        nodes: list[NodeSpec] = []
        for i in float_inputs:
            name = _grad_helper_name(operator, overload, i)
            # CompositeImplicitAutograd: the kernel is called above autograd, so it can record and differentiate.
            _helper_library.define(f"{name}({', '.join([*grad_args, *arguments])}) -> Tensor")
            _helper_library.impl(
                name, _make_vjp(packet, schema, len(differentiable), differentiable, i, float_inputs), "CompositeImplicitAutograd"
            )
            inputs = [f"GO({j})" for j in differentiable] + [f"I({k})" for k in range(len(schema.arguments))]
            nodes.append(_aten_node(_helper(name), inputs, f"GI({i})"))
        key = _gradient_key(operator, overload)
        if nodes:
            C.register_gradient_definition(key, _to_definition(nodes))
        tensor_inputs = {
            k for k, a in enumerate(schema.arguments) if _schema_type(a.type, operator, a.name) in ("Tensor", "Tensor?")
        }
        stopped = tensor_inputs - set(float_inputs)
        if stopped:
            C.register_custom_stop_gradient_edges(key, stopped)
        _fallback_gradients.add((operator, overload))


def _constant_argument(g: Any, value: Any, kind: str, op: str, name: str) -> Any:
    """A non-tensor argument of the op as a graph value: a Constant when it is known at export, else the value."""
    from torch.onnx import symbolic_helper as sh

    if sh._is_none(value):
        return value  # a missing optional input: the executor passes None (or the schema default)
    base = kind.rstrip("?")
    if not sh._is_constant(value):
        return value  # computed in the graph (a size, say): the executor reads it from the tensor
    if base == "str":
        return _string(g, sh._get_const(value, "s", name))
    if base in ("int[]", "float[]", "bool[]"):
        items = sh._get_const(value, "is" if base == "int[]" else "fs" if base == "float[]" else "is", name)
        dtype = {"int[]": torch.int64, "float[]": torch.float64, "bool[]": torch.bool}[base]
        return _constant(g, list(items), dtype)
    number = sh._maybe_get_const(value, "t")
    if isinstance(number, torch.Tensor):
        number = number.item()
    if base == "bool":
        return _constant(g, bool(number), torch.bool)
    if base == "float" or (base == "Scalar" and isinstance(number, float)):
        return _constant(g, float(number), torch.float64)
    if isinstance(number, bool):
        return _constant(g, number, torch.bool)
    return _constant(g, int(number), torch.int64)


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


def fallback_symbolic(op: str) -> Callable[..., Any]:
    """The TorchScript symbolic exporting ``aten::<op>`` as an ATen node run by PyTorch, with a gradient."""

    def symbolic(g: Any, *args: Any, **_kwargs: Any) -> Any:
        from ortcore.errors import UnsupportedModelError

        node = g.original_node
        parsed = _match_overload(op, args)
        if parsed is None:
            raise UnsupportedModelError(
                f"the aten_fallback plugin cannot run aten::{op}: no overload of it takes the {len(args)} arguments "
                "the exporter passed"
            )
        schema = str(parsed)
        operator, overload = op, parsed.overload_name
        try:
            kinds = [_schema_type(a.type, operator, a.name) for a in parsed.arguments]
        except TypeError as e:
            raise UnsupportedModelError(f"the aten_fallback plugin cannot run aten::{operator}: {e}") from e
        if len(args) != len(kinds):
            raise UnsupportedModelError(
                f"the aten_fallback plugin cannot run aten::{operator}: the exporter passed {len(args)} arguments "
                f"for the schema {schema}"
            )
        outputs_traced = list(node.outputs())
        if any(r.type.kind() != "TensorType" for r in parsed.returns):
            raise UnsupportedModelError(f"the aten_fallback plugin cannot run aten::{operator}: it returns non-tensors")
        tensor_args = [k for k, kind in enumerate(kinds) if kind in ("Tensor", "Tensor?")]
        float_inputs = tuple(
            k for k in tensor_args if not _is_none(args[k]) and args[k].type().scalarType() in _FLOAT_TYPES
        )
        differentiable = tuple(j for j, v in enumerate(outputs_traced) if v.type().scalarType() in _FLOAT_TYPES)
        needs = [k for k in float_inputs if _requires_grad(args[k]) is not False]
        if needs and (not tensor_args or tensor_args[0] not in needs):
            raise UnsupportedModelError(
                f"the aten_fallback plugin cannot run aten::{operator} here: ONNX Runtime builds an ATen node's "
                "gradient only when its first input needs one, and here only later inputs do"
            )
        for kind, value in zip(kinds, args, strict=True):
            if kind == "Tensor" and _is_none(value):
                raise UnsupportedModelError(f"the aten_fallback plugin cannot run aten::{operator}: a tensor is None")
        inputs = [
            value if kind in ("Tensor", "Tensor?") else _constant_argument(g, value, kind, operator, a.name)
            for kind, value, a in zip(kinds, args, parsed.arguments, strict=True)
        ]
        _register_fallback_gradient(operator, overload, parsed, differentiable, float_inputs)
        return aten_node(g, operator, overload, inputs, outputs_traced)

    symbolic.__name__ = f"aten_fallback_{op}"
    return symbolic


def _is_string_constant(value: Any) -> bool:
    node = value.node()
    return (
        node.kind() in ("prim::Constant", "onnx::Constant")
        and node.hasAttribute("value")
        and (node.kindOf("value") == "s")
    )


def _match_overload(op: str, args: tuple[Any, ...]) -> Any:
    """The schema of the ``aten::<op>`` overload the traced call used (the exporter does not say which): the first,
    ``default`` first, that takes as many arguments, with a string exactly where the call passed one."""
    packet = getattr(torch.ops.aten, op)
    names = sorted(packet.overloads(), key=lambda n: n != "default")
    for name in names:
        schema = getattr(packet, name)._schema
        if len(schema.arguments) != len(args):
            continue
        fits = True
        for a, value in zip(schema.arguments, args, strict=True):
            kind = a.type.getElementType().kind() if a.type.kind() == "OptionalType" else a.type.kind()
            if _is_none(value):
                fits = a.type.kind() == "OptionalType" or a.has_default_value()
            elif kind == "StringType":
                fits = _is_string_constant(value)
            else:  # a traced number is a (constant) tensor too: only strings tell overloads apart here
                fits = not _is_string_constant(value)
            if not fits:
                break
        if fits:
            return schema
    return None


def _is_none(value: Any) -> bool:
    from torch.onnx import symbolic_helper as sh

    return value is None or sh._is_none(value)


def fallback_symbolics(ops: Iterable[str]) -> dict[str, Callable[..., Any]]:
    """``{"::<name>": symbolic}`` for each ``aten::<name>`` listed (``auto`` is not an op)."""
    return {f"::{op.split('::')[-1]}": fallback_symbolic(op.split("::")[-1]) for op in ops if op != AUTO}


_UNSUPPORTED_ATEN = re.compile(r"operator '?aten::(\w+)'?")
MAX_AUTO_OPS = 32


class FallbackExporter(TorchScriptExporter):
    """The core's TorchScript exporter that, when an ``aten::`` op has no ONNX symbolic, exports it as an ATen node
    run by PyTorch (:func:`fallback_symbolic`) and exports again: at most :data:`MAX_AUTO_OPS` such ops a model."""

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "aten_fallback.auto": True}

    def export(self, module: torch.nn.Module, args: tuple[torch.Tensor, ...], **kwargs: Any) -> onnx.ModelProto:
        from ortcore.errors import UnsupportedModelError

        for _ in range(MAX_AUTO_OPS + 1):
            try:
                return super().export(module, args, **kwargs)
            except UnsupportedModelError as e:
                cause = e.__cause__
                match = (
                    _UNSUPPORTED_ATEN.search(str(cause))
                    if isinstance(cause, torch.onnx.errors.UnsupportedOperatorError)
                    else None
                )
                name = f"::{match.group(1)}" if match else None
                if name is None or name in self.symbolics:
                    raise
                logger.info(
                    "aten::%s has no ONNX symbolic: exporting it as an ATen node run by PyTorch", match.group(1)
                )
                self.symbolics[name] = fallback_symbolic(match.group(1))
        raise UnsupportedModelError(
            f"{type(module).__name__} uses more than {MAX_AUTO_OPS} ops the exporter cannot express"
        )


# -- the tanh-GELU formula ------------------------------------------------------------------------------------------
#
# Hugging Face's "gelu_new" (GPT-2) writes GELU out: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))). It
# exports as Pow/Mul/Add/Tanh nodes, which ORT fuses into FastGelu (whose gradient is its slowest kernel). This pass
# finds the formula in the exported graph and replaces it with one ATen gelu(approximate="tanh") node.


class _GraphIndex:
    """Producers, consumers and constant values of an ONNX graph."""

    def __init__(self, graph: onnx.GraphProto):
        # One list of node objects, held for the index's life, so that id() identifies a node throughout a pass.
        self.nodes: list[onnx.NodeProto] = list(graph.node)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.output:
                self.producer[name] = node
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_outputs = {o.name for o in graph.output}

    def constant(self, name: str) -> float | None:
        """The value of a scalar constant (a Constant node or an initializer), else None."""
        tensor = self.initializers.get(name)
        node = self.producer.get(name)
        if tensor is None and node is not None and node.op_type == "Constant":
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
        if tensor is None:
            return None
        array = onnx.numpy_helper.to_array(tensor)
        return float(array.reshape(-1)[0]) if array.size == 1 else None

    def node(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def split_constant(self, node: onnx.NodeProto, value: float) -> str | None:
        """For a binary node with one constant operand close to ``value``, the other operand."""
        for i in (0, 1):
            c = self.constant(node.input[i])
            if c is not None and math.isclose(c, value, rel_tol=1e-5):
                return node.input[1 - i]
        return None


def _is_cube_of(index: _GraphIndex, name: str, x: str) -> list[onnx.NodeProto] | None:
    """The nodes computing x**3 as ``name`` (Pow(x, 3) or x * (x * x) in any order), else None."""
    pow_ = index.node(name, "Pow")
    if pow_ is not None:
        return [pow_] if pow_.input[0] == x and index.constant(pow_.input[1]) == 3.0 else None
    mul = index.node(name, "Mul")
    if mul is None:
        return None
    for i in (0, 1):
        square = index.node(mul.input[1 - i], "Mul")
        if mul.input[i] == x and square is not None and list(square.input) == [x, x]:
            return [mul, square]
    return None


def _match_tanh_gelu(index: _GraphIndex, tanh: onnx.NodeProto) -> tuple[str, str, list[onnx.NodeProto]] | None:
    """Match 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) around ``tanh``: (x, output, nodes)."""
    inner = index.node(tanh.input[0], "Mul")
    scaled = index.split_constant(inner, math.sqrt(2 / math.pi)) if inner is not None else None
    add = index.node(scaled, "Add") if scaled is not None else None
    if add is None:
        return None
    for i in (0, 1):
        x, cubic_term = add.input[i], add.input[1 - i]
        kappa_mul = index.node(cubic_term, "Mul")
        cube_name = index.split_constant(kappa_mul, 0.044715) if kappa_mul is not None else None
        cube = _is_cube_of(index, cube_name, x) if cube_name is not None else None
        if cube is not None:
            break
    else:
        return None
    users = index.consumers.get(tanh.output[0], [])
    one_plus = users[0] if len(users) == 1 and users[0].op_type == "Add" else None
    if one_plus is None or index.split_constant(one_plus, 1.0) != tanh.output[0]:
        return None
    users = index.consumers.get(one_plus.output[0], [])
    final = users[0] if len(users) == 1 and users[0].op_type == "Mul" else None
    if final is None:
        return None
    # The other factor is 0.5 * x (or x * 0.5); torch's own tanh GELU symbolic nests it as 0.5 * (x * (1 + tanh)).
    other = final.input[0] if final.input[1] == one_plus.output[0] else final.input[1]
    half = index.node(other, "Mul")
    nodes = [inner, add, kappa_mul, *cube, tanh, one_plus, final]
    output = final.output[0]
    if half is not None and index.split_constant(half, 0.5) == x:
        nodes.append(half)
    elif other == x:
        users = index.consumers.get(final.output[0], [])
        outer = users[0] if len(users) == 1 and users[0].op_type == "Mul" else None
        if outer is None or index.split_constant(outer, 0.5) != final.output[0]:
            return None
        nodes.append(outer)
        output = outer.output[0]
    else:
        return None
    # Every intermediate must be used only inside the formula, or removing the nodes would break other users.
    inside = {id(n) for n in nodes}
    for n in nodes:
        for name in n.output:
            if name == output:
                continue
            if name in index.graph_outputs or any(id(u) not in inside for u in index.consumers.get(name, [])):
                return None
    return x, output, nodes


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every value ONNX can type: declared ones, then what shape inference adds."""
    graph = model.graph
    declared = {v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.value_info, *graph.output)}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info
    except Exception:  # inference is a convenience here: a value it cannot type falls back below
        inferred = []
    return {**{v.name: v.type.tensor_type.elem_type for v in inferred}, **{k: t for k, t in declared.items() if t}}


def replace_tanh_gelu(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """Replace each written-out tanh-GELU in ``model`` with an ATen gelu node; returns how many were replaced."""
    graph = model.graph
    index = _GraphIndex(graph)
    removed: set[int] = set()
    replacements: dict[int, list[onnx.NodeProto]] = {}
    typed: list[tuple[str, str, onnx.NodeProto]] = []
    for node in index.nodes:
        if node.op_type != "Tanh" or id(node) in removed:
            continue
        match = _match_tanh_gelu(index, node)
        if match is None:
            continue
        x, output, nodes = match
        if any(id(n) in removed for n in nodes):
            continue
        name = f"{node.name or output}/ortcore_gelu_tanh"
        approximate = onnx.helper.make_node(
            "Constant",
            [],
            [f"{name}/approximate"],
            name=f"{name}/approximate",
            value=onnx.numpy_helper.from_array(np.frombuffer(b"tanh", dtype=np.uint8).copy()),
        )
        gelu = onnx.helper.make_node(
            "ATen",
            [x, approximate.output[0]],
            [output],
            name=name,
            domain=ATEN_DOMAIN,
            operator="gelu",
            overload_name="",
        )
        # Insert where the formula's last node was: every consumer of the output still follows its producer.
        last = next(n for n in nodes if output in n.output)
        replacements[id(last)] = [approximate, gelu]
        removed.update(id(n) for n in nodes)
        typed.append((x, output, nodes[0]))
    if not typed:
        return 0
    # The formula's Constant nodes (0.5, 3, 0.044715, ...) go too once nothing else reads them: ORT would warn about
    # each unused one in every session it builds.
    still_read = {name for n in index.nodes if id(n) not in removed for name in n.input} | index.graph_outputs
    for node in index.nodes:
        if node.op_type == "Constant" and not any(name in still_read for name in node.output):
            if any(id(u) in removed for name in node.output for u in index.consumers.get(name, [])):
                removed.add(id(node))
    kept: list[onnx.NodeProto] = []
    for node in index.nodes:
        if id(node) in replacements:
            kept.extend(replacements[id(node)])
        elif id(node) not in removed:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            kept.append(copy)
    del graph.node[:]
    graph.node.extend(kept)
    # ORT cannot infer an ATen output's type: record it (GELU keeps its input's element type).
    types = _elem_types(model)
    known = {v.name for v in graph.value_info}
    for x, output, _node in typed:
        if output not in known:
            elem_type = types.get(x) or onnx.TensorProto.FLOAT
            graph.value_info.append(onnx.helper.make_tensor_value_info(output, elem_type, None))
    if not any(o.domain == ATEN_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ATEN_DOMAIN, 1))
    logger.debug("replaced %d tanh-GELU formula(s) with ATen gelu", len(typed))
    return len(typed)


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


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return AtenFallbackOptions


@hookimpl
def ortcore_configure(config: Config) -> None:
    ops = routed_ops(config)
    if ops or fallback_ops(config):
        _prepare_runtime()
    logger.debug("ops run with PyTorch's kernels: %s", sorted(ops) or "none")


@hookimpl
def ortcore_export_symbolics(config: Config) -> dict[str, Any]:
    ops = routed_ops(config)
    listed = fallback_ops(config)
    if ops or listed:
        _prepare_runtime()  # idempotent; ortcore_configure did it already for hosts that configure plugins
    return {**symbolics_for(ops), **fallback_symbolics(listed)}


@hookimpl
def ortcore_exporter(config: Config) -> TorchScriptExporter | None:
    """With ``fallback_ops = ["auto"]``: the core's exporter, exporting unsupported ``aten::`` ops as ATen nodes."""
    if AUTO not in fallback_ops(config):
        return None
    return FallbackExporter(inline_autograd_functions=custom_autograd_disabled(config.env))


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    ops = routed_ops(config)
    if not ops and not fallback_ops(config):
        return []
    passes = [GraphPass(TYPE_OUTPUTS_PASS, run=type_aten_outputs)]
    if "gelu" in ops:
        passes.append(GraphPass(TANH_GELU_PASS, run=replace_tanh_gelu, before=(TYPE_OUTPUTS_PASS,)))
    return passes


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    key: dict[str, Any] = {"aten_fallback.torch_kernels": sorted(routed_ops(config))}
    listed = fallback_ops(config)
    if listed:  # only then: the keys (and export caches) of models without fallback ops stay as they were
        key["aten_fallback.fallback_ops"] = sorted(listed)
    return key


@hookimpl
def ortcore_session_plan(graph: Any, plan: Any) -> None:
    """Executor failures in a graph with ATen nodes are raised from the run that hit them, naming the op."""
    executor.on_run_boundary(clear_vjp_results)  # a routed op's shared gradients must not outlive a run
    executor.guard_runs(graph, plan)
