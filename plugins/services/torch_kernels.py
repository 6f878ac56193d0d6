"""PyTorch's kernels as ORT sees them: the ops whose PyTorch kernel may beat ORT's (:data:`ROUTABLE_OPS`), the
helper ops (backward formulas as single-output ops), their gradient definitions, and :func:`prepare_runtime`, what
every graph with such ATen nodes needs before ORT builds it.

A service rather than part of ``aten_fallback``, which routes and measures these ops, because ``op_routing`` needs the
same facts without that plugin: which ATen nodes are there for speed (the reason it records for them), and the
preparation any graph of ATen nodes may need, whichever plugin put the nodes there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from . import aten_executor
from .aten_nodes import (
    NodeSpec,
    gradient_key,
    gradient_node,
    helper_library,
    helper_op,
    requires_grad,
    shared_gradient,
    to_gradient_definition,
)

# Ops whose PyTorch kernel can replace ORT's, the ones measured faster in torch than in ORT on CPU (aten_fallback's
# torch_kernels option takes these names; op_routing names them as run on PyTorch for speed).
ROUTABLE_OPS: tuple[str, ...] = ("embedding", "gelu", "layer_norm", "cross_entropy", "linear")


# -- helper ops: backward formulas as single-output, self-contained nodes ---------------------------------------------
#
# How ORT 1.19.2 handles gradient definitions shapes these ops:
# * a node of a definition keeps only its first output, so a backward that torch computes as one multi-output kernel
#   (LayerNorm's, linear's) is split into one op per gradient;
# * a definition with intermediate values (a Constant feeding a node, say) fails to build when one of the forward
#   node's inputs needs no gradient ("... is not a valid intermediate output"), so every node reads only GO(i), I(i)
#   and O(i); what an op needs beyond those (which gradient, the number of embedding rows) is fixed by the op itself
#   or read from a forward input;
# * nothing is built unless the forward node's first input needs a gradient (see gradient_reaches_first_input).


_native_layer_norm_backward = torch.ops.aten.native_layer_norm_backward


def _layer_norm_backward(which: int) -> Callable[..., torch.Tensor]:
    """The gradient of ``native_layer_norm`` with respect to its input (0), weight (1) or bias (2).

    The first of the op's helper nodes to run computes every gradient the op has (one ``native_layer_norm_backward``
    call, as torch's autograd makes) and leaves the others for their nodes: one kernel per LayerNorm and step instead
    of three, each of which would redo the reductions over the whole activation.
    """

    def backward(
        grad_out: torch.Tensor,
        input: torch.Tensor,
        normalized_shape: list[int],
        mean: torch.Tensor,
        rstd: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        arguments = [grad_out, input, normalized_shape, mean, rstd, weight, bias]

        def compute() -> dict[int, torch.Tensor]:
            mask = [True, weight is not None, bias is not None]
            mask[which] = True
            grads = _native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)
            return {i: g for i, g in enumerate(grads) if g is not None}

        return shared_gradient(_native_layer_norm_backward, arguments, which, compute)

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


def cross_entropy(
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
    """Gradient of :func:`cross_entropy`'s loss with respect to the logits."""
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


# matmul(a, b) of any ranks: autograd's gradients, reduced over broadcast batch dimensions. The ``_rhs_first``
# variants take (b, a): ORT builds an ATen node's gradient only when its first input is on the gradient path.
def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def _matmul_rhs_first(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def _matmul_gradients(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.dim() >= 2 and b.dim() >= 2:
        return (grad.matmul(b.mT).sum_to_size(a.shape), a.mT.matmul(grad).sum_to_size(b.shape))
    with torch.enable_grad():  # a vector operand: autograd's own rules for the squeezed dimension
        a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
        return torch.autograd.grad(torch.matmul(a_, b_), (a_, b_), grad)


def _matmul_backward_a(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() >= 2 and b.dim() >= 2:
        return grad.matmul(b.mT).sum_to_size(a.shape)
    return _matmul_gradients(grad, a, b)[0]


def _matmul_backward_b(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.dim() == 2 and a.dim() > 2:
        # a [..., m, k] @ b [k, n]: one GEMM over the batch's rows, not a product per batch element summed after
        return a.reshape(-1, a.shape[-1]).t().mm(grad.reshape(-1, grad.shape[-1]))
    if a.dim() >= 2 and b.dim() >= 2:
        return a.mT.matmul(grad).sum_to_size(b.shape)
    return _matmul_gradients(grad, a, b)[1]


# Casts between float32 and the low-precision types, on PyTorch's vectorised kernels (ORT's CPU Cast to and from
# bfloat16 and float16 is 2-9x slower on a [8, 128, 256] tensor). Used after the gradient build: no gradients.
def _to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def _to_float16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16)


def _to_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _linear_weight_first(weight: torch.Tensor, input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(input, weight, bias)


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
        cross_entropy,
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
    "matmul": ("(Tensor a, Tensor b) -> Tensor", _matmul),
    "matmul_rhs_first": ("(Tensor b, Tensor a) -> Tensor", _matmul_rhs_first),
    "matmul_backward_a": ("(Tensor grad, Tensor a, Tensor b) -> Tensor", _matmul_backward_a),
    "matmul_backward_b": ("(Tensor grad, Tensor a, Tensor b) -> Tensor", _matmul_backward_b),
    "to_bfloat16": ("(Tensor x) -> Tensor", _to_bfloat16),
    "to_float16": ("(Tensor x) -> Tensor", _to_float16),
    "to_float32": ("(Tensor x) -> Tensor", _to_float32),
    "linear_weight_first": ("(Tensor weight, Tensor input, Tensor? bias) -> Tensor", _linear_weight_first),
    "addmm_backward_self": ("(Tensor grad, Tensor self, Scalar beta) -> Tensor", _addmm_backward_self),
    "addmm_backward_mat1": ("(Tensor grad, Tensor mat2, Scalar alpha) -> Tensor", _addmm_backward_mat1),
    "addmm_backward_mat2": ("(Tensor grad, Tensor mat1, Scalar alpha) -> Tensor", _addmm_backward_mat2),
}

_helper_ops_defined = False


def define_helper_ops() -> None:
    """Define the ``ortcore_aten::*`` ops of :data:`HELPER_OPS` once per process (the executor resolves them by
    schema, as aten ops)."""
    global _helper_ops_defined
    if _helper_ops_defined:
        return
    lib = helper_library()
    for name, (schema, fn) in HELPER_OPS.items():
        lib.define(f"{name}{schema}")
        # CompositeExplicitAutograd: one implementation for every device; the executor calls them without autograd.
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _helper_ops_defined = True


# -- gradient definitions (see ortcore_plugins.services.aten_nodes for their form) ------------------------------------

_LAYER_NORM_SAVED = ["GO(0)", "I(0)", "I(1)", "O(1)", "O(2)", "I(2)", "I(3)"]
_LINEAR_SAVED = ["GO(0)", "I(0)", "I(1)"]

GRADIENTS: dict[str, list[NodeSpec]] = {
    # embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
    "embedding": [gradient_node(helper_op("embedding_backward"), ["GO(0)", "I(0)", "I(1)", "I(2)", "I(3)"], "GI(0)")],
    # gelu(self, approximate)
    "gelu": [gradient_node("gelu_backward", ["GO(0)", "I(0)", "I(1)"], "GI(0)")],
    # native_layer_norm(input, normalized_shape, weight, bias, eps) -> (out, mean, rstd)
    "native_layer_norm": [
        gradient_node(helper_op("layer_norm_backward_input"), _LAYER_NORM_SAVED, "GI(0)"),
        gradient_node(helper_op("layer_norm_backward_weight"), _LAYER_NORM_SAVED, "GI(2)"),
        gradient_node(helper_op("layer_norm_backward_bias"), _LAYER_NORM_SAVED, "GI(3)"),
    ],
    # ortcore_aten::cross_entropy(self, target, weight, reduction, ignore_index, label_smoothing)
    #     -> (loss, log_probs, total_weight)
    helper_op("cross_entropy"): [
        gradient_node(
            helper_op("cross_entropy_backward"),
            ["GO(0)", "O(1)", "I(1)", "I(2)", "I(3)", "I(4)", "I(5)", "O(2)"],
            "GI(0)",
        )
    ],
    # linear(input, weight, bias)
    "linear": [
        gradient_node(helper_op("linear_backward_input"), _LINEAR_SAVED, "GI(0)"),
        gradient_node(helper_op("linear_backward_weight"), _LINEAR_SAVED, "GI(1)"),
        gradient_node(helper_op("linear_backward_bias"), ["GO(0)"], "GI(2)"),
    ],
    # ortcore_aten::linear_no_bias(input, weight)
    # addmm(self, mat1, mat2, beta, alpha): GPT-2's Conv1D
    "addmm": [
        gradient_node(helper_op("addmm_backward_self"), ["GO(0)", "I(0)", "I(3)"], "GI(0)"),
        gradient_node(helper_op("addmm_backward_mat1"), ["GO(0)", "I(2)", "I(4)"], "GI(1)"),
        gradient_node(helper_op("addmm_backward_mat2"), ["GO(0)", "I(1)", "I(4)"], "GI(2)"),
    ],
    # ortcore_aten::matmul(a, b), ortcore_aten::matmul_rhs_first(b, a)
    helper_op("matmul"): [
        gradient_node(helper_op("matmul_backward_a"), ["GO(0)", "I(0)", "I(1)"], "GI(0)"),
        gradient_node(helper_op("matmul_backward_b"), ["GO(0)", "I(0)", "I(1)"], "GI(1)"),
    ],
    helper_op("matmul_rhs_first"): [
        gradient_node(helper_op("matmul_backward_a"), ["GO(0)", "I(1)", "I(0)"], "GI(1)"),
        gradient_node(helper_op("matmul_backward_b"), ["GO(0)", "I(1)", "I(0)"], "GI(0)"),
    ],
    # ortcore_aten::linear_weight_first(weight, input, bias)
    helper_op("linear_weight_first"): [
        gradient_node(helper_op("linear_backward_input"), ["GO(0)", "I(1)", "I(0)"], "GI(1)"),
        gradient_node(helper_op("linear_backward_weight"), ["GO(0)", "I(1)", "I(0)"], "GI(0)"),
        gradient_node(helper_op("linear_backward_bias"), ["GO(0)"], "GI(2)"),
    ],
    helper_op("linear_no_bias"): [
        gradient_node(helper_op("linear_backward_input"), _LINEAR_SAVED, "GI(0)"),
        gradient_node(helper_op("linear_backward_weight"), _LINEAR_SAVED, "GI(1)"),
    ],
}

# Inputs that never get a gradient: class weights of the loss (torch refuses to differentiate them too).
STOP_GRADIENT_EDGES: dict[str, set[int]] = {helper_op("cross_entropy"): {1, 2}, "embedding": {1}}


_registered_gradients = False


def register_gradients() -> None:
    """Register every gradient definition once per process (ORT keeps the first registration of a key)."""
    global _registered_gradients
    if _registered_gradients:
        return
    from onnxruntime.capi import _pybind_state as C

    for operator, nodes in GRADIENTS.items():
        C.register_gradient_definition(gradient_key(operator), to_gradient_definition(nodes))
    for operator, edges in STOP_GRADIENT_EDGES.items():
        C.register_custom_stop_gradient_edges(gradient_key(operator), edges)
    _registered_gradients = True


_prepare_lock = threading.Lock()


def prepare_runtime() -> None:
    """What every routed graph needs before ORT builds it: helper ops, gradient definitions, the executor."""
    with _prepare_lock:
        define_helper_ops()
        register_gradients()
        aten_executor.install()


def gradient_reaches_first_input(first: Any, *others: Any) -> bool:
    """Can ORT build this ATen node's gradient? Not if only inputs after the first need one.

    ORT 1.19.2 builds the gradient of an ATen node only when its first input is on the gradient path: with a
    LayerNorm over a frozen embedding (or a Linear over the raw input), weight and bias would get no gradient
    ("failed to find NodeArg by name: <weight>_grad"). Such nodes keep ORT's kernels. The answer holds for the
    requires_grad flags seen at export; see the limitations in docs/plugins/aten_fallback.md.
    """
    if requires_grad(first) is True:
        return True
    return all(requires_grad(v) is False for v in others)
