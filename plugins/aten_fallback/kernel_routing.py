"""Kernel routing: embedding, GELU, LayerNorm, cross-entropy (and linear) run on PyTorch's CPU kernels in ORT's graph.

Some of ORT's CPU kernels are several times slower than PyTorch's (embedding's GatherGrad, GELU's gradients,
LayerNormalizationGrad, the softmax cross-entropy loss; see ``docs/plugins/aten_fallback.md`` for the numbers). The
symbolics here export those ops as ``org.pytorch.aten::ATen`` nodes, each with a gradient definition made of ATen
nodes too; the ATen executor (:mod:`ortcore_plugins.services.aten_executor`) runs them with ``torch.ops.aten.*``
kernels, zero-copy through DLPack. :func:`symbolics_for` gives the symbolics of the chosen ops; the helper ops their
gradients use, and what ORT needs before it builds a graph with them, are the
:mod:`ortcore_plugins.services.torch_kernels` service's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ortcore_plugins.services.aten_nodes import (
    ATEN_DOMAIN,
    constant,
    helper_op,
    requires_grad,
    string_constant,
)
from ortcore_plugins.services.torch_kernels import gradient_reaches_first_input
from ortcore_plugins.services.torchscript_symbolics import exporter_symbolic

# -- symbolics --------------------------------------------------------------------------------------------------------
#
# Each symbolic emits an ATen node and types its outputs: ORT cannot infer an ATen node's output types. Sizes keep
# what is static (1 for a broadcast dimension, the hidden size) and leave dynamic dimensions unknown; the
# ``typed_outputs`` pass then drops the names the exporter invents for those, because ORT would take two differently
# named dimensions for two different sizes when it plans broadcasting gradients (see type_aten_outputs).


def _aten(g: Any, operator: str, *inputs: Any, outputs: int = 1) -> Any:
    return g.op(f"{ATEN_DOMAIN}::ATen", *inputs, operator_s=operator, overload_name_s="", outputs=outputs)


def _sizes(value: Any) -> list[int | None] | None:
    """A value's sizes as far as the exporter knows them (None entries are dynamic), or None if its rank is unknown."""
    return value.type().varyingSizes()


def _typed(value: Any, like: Any, sizes: list[int | None] | None) -> Any:
    """Give ``value`` the element type of ``like`` and ``sizes`` (None: unknown rank)."""
    t = like.type()
    value.setType(t.with_sizes(list(sizes)) if sizes is not None else torch._C.TensorType.get().with_dtype(t.dtype()))
    return value


def _symbolic_embedding(
    g: Any, weight: Any, indices: Any, padding_idx: Any, scale_grad_by_freq: Any, sparse: Any
) -> Any:
    from torch.onnx import symbolic_helper as sh

    out = _aten(
        g,
        "embedding",
        weight,
        indices,
        constant(g, sh._get_const(padding_idx, "i", "padding_idx"), torch.int64),
        constant(g, bool(sh._get_const(scale_grad_by_freq, "b", "scale_grad_by_freq")), torch.bool),
        # The gradient inside the ORT graph is dense whatever `sparse` says; the forward result is the same.
        constant(g, False, torch.bool),
    )
    indices_sizes, weight_sizes = _sizes(indices), _sizes(weight)
    known = indices_sizes is not None and weight_sizes is not None
    return _typed(out, weight, [*indices_sizes, weight_sizes[-1]] if known else None)


def _symbolic_gelu(g: Any, self: Any, approximate: Any = "none") -> Any:
    from torch.onnx import symbolic_helper as sh

    if not isinstance(approximate, str):
        approximate = sh._get_const(approximate, "s", "approximate")
    return _typed(_aten(g, "gelu", self, string_constant(g, approximate)), self, _sizes(self))


def _symbolic_layer_norm(
    g: Any, input: Any, normalized_shape: Any, weight: Any, bias: Any, eps: Any, cudnn_enable: Any
) -> Any:
    from torch.onnx import symbolic_helper as sh

    if not gradient_reaches_first_input(input, weight, bias):
        return exporter_symbolic("::layer_norm")(g, input, normalized_shape, weight, bias, eps)
    shape = list(sh._get_const(normalized_shape, "is", "normalized_shape"))
    # Without weight or bias, feed ones and zeros: the gradient definition names a gradient for each, and ORT names
    # every gradient of a missing input "_grad", which would then be defined twice.
    dtype = input.type().dtype() or torch.float32
    if sh._is_none(weight):
        weight = constant(g, torch.ones(shape).tolist(), dtype)
    if sh._is_none(bias):
        bias = constant(g, torch.zeros(shape).tolist(), dtype)
    out, mean, rstd = _aten(
        g,
        "native_layer_norm",
        input,
        constant(g, shape, torch.int64),
        weight,
        bias,
        constant(g, float(sh._get_const(eps, "f", "eps")), torch.float64),
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
        helper_op("cross_entropy"),
        self,
        target,
        weight,  # a None value becomes a missing optional input
        constant(g, reduction, torch.int64),
        constant(g, sh._get_const(ignore_index, "i", "ignore_index"), torch.int64),
        constant(g, float(smoothing or 0.0), torch.float64),
        outputs=3,
    )
    _typed(log_probs, self, _sizes(self))
    _typed(total_weight, self, [])
    return _typed(loss, self, _sizes(target) if reduction == 0 else [])


def _symbolic_linear(g: Any, input: Any, weight: Any, bias: Any) -> Any:
    from torch.onnx import symbolic_helper as sh

    if not gradient_reaches_first_input(input, weight, bias):
        return _DEFAULTS["linear"](g, input, weight, bias)
    if sh._is_none(bias):
        # A separate op, so that its gradient definition does not name a gradient for the missing bias.
        out = _aten(g, helper_op("linear_no_bias"), input, weight)
    else:
        out = _aten(g, "linear", input, weight, bias)
    input_sizes, weight_sizes = _sizes(input), _sizes(weight)
    known = input_sizes is not None and weight_sizes is not None
    return _typed(out, input, [*input_sizes[:-1], weight_sizes[0]] if known else None)


def _symbolic_addmm(g: Any, self: Any, mat1: Any, mat2: Any, beta: Any, alpha: Any) -> Any:
    from torch.onnx import symbolic_helper as sh

    if not gradient_reaches_first_input(self, mat1, mat2):
        return _DEFAULTS["addmm"](g, self, mat1, mat2, beta, alpha)
    scalars = []
    for value in (beta, alpha):
        number = sh._maybe_get_const(value, "f")
        if sh._is_value(number):  # a tensor-valued scale: leave it to ONNX's export
            return _DEFAULTS["addmm"](g, self, mat1, mat2, beta, alpha)
        scalars.append(constant(g, float(number), torch.float64))
    out = _aten(g, "addmm", self, mat1, mat2, *scalars)
    mat1_sizes, mat2_sizes = _sizes(mat1), _sizes(mat2)
    known = mat1_sizes is not None and mat2_sizes is not None
    # The output needs a gradient if the bias does even when mat1 does not: later symbolics read that flag.
    like = self if requires_grad(self) else mat1
    return _typed(out, like, [mat1_sizes[0], mat2_sizes[1]] if known else None)


def _gradient_is_not_gathers(weight: Any, indices: Any, padding_idx: Any, scale_grad_by_freq: Any, *_: Any) -> bool:
    """An embedding whose gradient is not ONNX Gather's: a padding row (torch leaves its gradient zero) or frequency
    scaling, on a weight that needs a gradient."""
    from torch.onnx import symbolic_helper as sh

    padding = sh._maybe_get_const(padding_idx, "i")
    by_freq = sh._maybe_get_const(scale_grad_by_freq, "b")
    shaped = (isinstance(padding, int) and padding >= 0) or by_freq is True
    return shaped and requires_grad(weight)


# The ONNX symbolic each routable op has when it is not routed (TorchScript symbolics are process-wide: a routed
# symbolic registered for one model would otherwise stay in force for the next one).
def _default_symbolic(op: str) -> Callable[..., Any]:
    def symbolic(g: Any, *args: Any) -> Any:
        from torch.onnx import symbolic_opset9, symbolic_opset12, symbolic_opset20

        if op == "embedding":
            if _gradient_is_not_gathers(*args):
                # ONNX's Gather gives the padding row a gradient (torch's is zero), and knows no frequency scaling:
                # such an embedding runs on PyTorch's kernel whether or not speed would route it.
                return _symbolic_embedding(g, *args)
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


# op name -> (TorchScript symbolic names, routed symbolic). layer_norm has no default here: the TorchScript exporter has its own.
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


# -- torch_kernels = "auto": each call routed where PyTorch measured faster (see kernel_choice) -----------------------

_tanh_sizes: list[tuple[tuple[int, ...], str, str] | None] = []


def _symbolic_tanh(g: Any, self: Any) -> Any:
    """ONNX's Tanh, noting the traced sizes: the tanh-GELU pass decides the written-out formula on them."""
    from . import kernel_choice

    _tanh_sizes.append(kernel_choice._traced(next(iter(g.original_node.inputs()))))
    return g.op("Tanh", self)


def take_tanh_sizes() -> list[tuple[tuple[int, ...], str, str] | None]:
    """The traced sizes of the export's tanh calls, in graph order (and forget them)."""
    taken = list(_tanh_sizes)
    _tanh_sizes.clear()
    return taken


def _auto_symbolic(op: str, routed: Callable[..., Any], default: Callable[..., Any], config: Any) -> Callable[..., Any]:
    def symbolic(g: Any, *args: Any) -> Any:
        from . import kernel_choice

        decision = kernel_choice.decide_call(config, op, g, args)
        if decision is None:
            return default(g, *args)
        kernel_choice.note(decision)
        return (routed if decision.routed else default)(g, *args)

    symbolic.__name__ = f"auto_{op}"
    return symbolic


def auto_symbolics(config: Any) -> dict[str, Callable[..., Any]]:
    """The symbolics of ``torch_kernels = "auto"``: each call is routed or not by its measured decision."""
    result: dict[str, Callable[..., Any]] = {}
    for op, (names, routed) in _SYMBOLICS.items():
        default = _DEFAULTS.get(op) or exporter_symbolic("::layer_norm")
        result.update(dict.fromkeys(names, _auto_symbolic(op, routed, default, config)))
    for symbol, (_option, name, routed) in _EXTRA_SYMBOLICS.items():
        result[name] = _auto_symbolic(symbol, routed, _DEFAULTS[symbol], config)
    result["::tanh"] = _symbolic_tanh
    return result


# -- the dynamo route: onnxscript translations ------------------------------------------------------------------------
#
# Embedding, GELU, LayerNorm and cross-entropy become the same ATen nodes as their symbolics write (their gradient
# definitions above apply). Embedding and GELU have one differentiable input, their first, so every call can be
# routed and a translation of the aten op itself does (an op in the translation table is not decomposed). LayerNorm
# and cross-entropy need a decision per call (does the first input need a gradient where the others do; integer
# targets), taken by a program pass (program_kernels) that makes the calls it routes call ops of KERNEL_NAMESPACE,
# which the translations write. linear (and "auto") stay TorchScript-only.


def _translate_embedding(
    weight: Any, indices: Any, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse: bool = False
) -> Any:
    from ortcore_plugins.services.aten_program import aten_op, onnx_input

    return aten_op(1)(
        weight,
        indices,
        onnx_input("int", padding_idx),
        onnx_input("bool", scale_grad_by_freq),
        # The gradient inside the ORT graph is dense whatever `sparse` says; the forward result is the same.
        onnx_input("bool", False),
        operator="embedding",
        overload_name="",
    )


def _translate_gelu(self: Any, approximate: str = "none") -> Any:
    from ortcore_plugins.services.aten_program import aten_op, onnx_input

    return aten_op(1)(self, onnx_input("str", approximate), operator="gelu", overload_name="")


KERNEL_NAMESPACE = "ortcore_kernels"
_kernel_library: torch.library.Library | None = None
_kernel_lock = threading.Lock()


def _kernel_ops() -> Any:
    """``torch.ops.ortcore_kernels``: the calls :func:`program_kernels` routes (CompositeImplicitAutograd: each
    decomposes into the aten op it stands for while the program is traced)."""
    global _kernel_library
    with _kernel_lock:
        if _kernel_library is None:
            lib = torch.library.Library(KERNEL_NAMESPACE, "FRAGMENT")
            lib.define(
                "layer_norm(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> Tensor"
            )
            lib.impl(
                "layer_norm",
                lambda input, shape, weight, bias, eps: torch.ops.aten.layer_norm(input, shape, weight, bias, eps),
                "CompositeImplicitAutograd",
            )
            lib.define(
                "cross_entropy(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index, "
                "float label_smoothing) -> Tensor"
            )
            lib.impl(
                "cross_entropy",
                lambda self, target, weight, reduction, ignore_index, smoothing: torch.ops.aten.cross_entropy_loss(
                    self, target, weight, reduction, ignore_index, smoothing
                ),
                "CompositeImplicitAutograd",
            )
            _kernel_library = lib
    return getattr(torch.ops, KERNEL_NAMESPACE)


def _typed_like(value: Any, like: Any, rank: int | None) -> Any:
    """``value`` typed as ``like``'s element type with ``rank`` unknown dimensions (ORT cannot infer an ATen node's
    output types, and the exporter types only the outputs the program returns)."""
    from onnxscript import ir

    value.dtype = like.dtype
    if rank is not None:
        value.shape = ir.Shape([None] * rank)
    return value


def _rank(value: Any) -> int | None:
    return len(value.shape) if value.shape is not None else None


def _translate_layer_norm(input: Any, normalized_shape: list[int], weight: Any, bias: Any, eps: float) -> Any:
    import numpy as np
    from onnxscript import ir
    from onnxscript import opset18 as op

    from ortcore_plugins.services.aten_program import aten_op, onnx_input

    dtype = input.dtype.numpy()
    # Without weight or bias, ones and zeros: the gradient definition names a gradient for each, and ORT names every
    # gradient of a missing input "_grad", which would then be defined twice.
    if weight is None:
        weight = op.Constant(value=ir.tensor(np.ones(normalized_shape, dtype=dtype)))
    if bias is None:
        bias = op.Constant(value=ir.tensor(np.zeros(normalized_shape, dtype=dtype)))
    out, mean, rstd = aten_op(3)(
        input,
        onnx_input("int[]", normalized_shape),
        weight,
        bias,
        onnx_input("float", eps),
        operator="native_layer_norm",
        overload_name="",
    )
    _typed_like(mean, input, _rank(input))
    _typed_like(rstd, input, _rank(input))
    return out


def _translate_cross_entropy(
    self: Any, target: Any, weight: Any, reduction: int, ignore_index: Any, label_smoothing: float
) -> Any:
    from ortcore_plugins.services.aten_program import aten_op, onnx_input

    # A stand-in for a missing weight, replaced by a missing input below. Not None: the recorder would make None a
    # constant of the logits' type, which it cannot for bfloat16 ("expected number, got NoneType").
    placeholder = onnx_input("float", 0.0) if weight is None else weight
    loss, log_probs, total_weight = aten_op(3)(
        self,
        target,
        placeholder,
        onnx_input("int", reduction),
        onnx_input("SymInt", ignore_index),
        onnx_input("float", label_smoothing),
        operator=helper_op("cross_entropy"),
        overload_name="",
    )
    if weight is None:
        # The recorder turns None into a constant; the executor must see a missing input (no class weights).
        loss.producer().replace_input_with(2, None)
    _typed_like(log_probs, self, _rank(self))
    _typed_like(total_weight, self, 0)
    return loss


def _computed_in(graph: Any, node: Any, input: Any) -> Any:
    """``input`` cast to the floating type ``node`` computes in, where the two differ: torch.export records a call
    under autocast as the call, its float32 computation (autocast's cast of a bf16 ``cross_entropy_loss`` input) inside
    it; the kernel that stands for the call runs as written, so the cast is made explicit here."""
    out, value = node.meta.get("val"), input.meta.get("val") if isinstance(input, torch.fx.Node) else None
    if not (isinstance(out, torch.Tensor) and isinstance(value, torch.Tensor)):
        return input
    if out.dtype == value.dtype or not (out.dtype.is_floating_point and value.dtype.is_floating_point):
        return input
    with graph.inserting_before(node):
        cast = graph.call_function(torch.ops.aten._to_copy.default, (input,), {"dtype": out.dtype})
    cast.meta["val"] = value.to(out.dtype)
    return cast


DYNAMO_OPS: tuple[str, ...] = ("embedding", "gelu", "layer_norm", "cross_entropy")


def translations_for(ops: Iterable[str]) -> dict[Any, Callable[..., Any]]:
    """The dynamo route's translations that route ``ops`` (those of :data:`DYNAMO_OPS` among them)."""
    ops = set(ops)
    table: dict[Any, Callable[..., Any]] = {}
    if "embedding" in ops:
        table[torch.ops.aten.embedding.default] = _translate_embedding
    if "gelu" in ops:
        table[torch.ops.aten.gelu.default] = _translate_gelu
    if "layer_norm" in ops:
        table[_kernel_ops().layer_norm.default] = _translate_layer_norm
    if "cross_entropy" in ops:
        table[_kernel_ops().cross_entropy.default] = _translate_cross_entropy
    return table


def program_kernels(ops: Iterable[str]) -> Callable[[Any, Any], int]:
    """The dynamo route's program pass of ``torch_kernels``: each LayerNorm and cross-entropy call (when ``ops``
    names them) that can be routed calls the ``ortcore_kernels`` op its translation writes as an ATen node.

    A LayerNorm is routed when its input certainly needs a gradient (it is computed from a trained parameter) or
    neither its weight nor its bias needs one: ORT builds an ATen node's gradient only when its first input needs
    one. A cross-entropy is routed when its target holds class indices (integers).
    """
    from ortcore_plugins.services import aten_program

    ops = set(ops)

    def run(program: Any, context: Any) -> int:
        reach = aten_program.GradientReach(program, context.module)
        kernels = _kernel_ops()
        routed = 0
        for node in program.graph_module.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten.layer_norm.default and "layer_norm" in ops:
                input, shape, weight, bias, eps, _ = aten_program.bind(node)
                if not all(isinstance(d, int) for d in shape):
                    continue  # a size computed in the graph: ORT's kernel
                if reach.of(input) != aten_program.CERTAIN and (reach.of(weight) or reach.of(bias)):
                    continue
                node.target, node.args, node.kwargs = (
                    kernels.layer_norm.default,
                    (input, list(shape), weight, bias, eps),
                    {},
                )
                routed += 1
            elif node.target is torch.ops.aten.cross_entropy_loss.default and "cross_entropy" in ops:
                self, target, weight, reduction, ignore_index, smoothing = aten_program.bind(node)
                value = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
                if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point:
                    continue  # class probabilities as targets: not this op's formula
                self = _computed_in(program.graph_module.graph, node, self)
                args = (self, target, weight, reduction, ignore_index, float(smoothing))
                node.target, node.args, node.kwargs = kernels.cross_entropy.default, args, {}
                routed += 1
        if routed:
            program.graph_module.recompile()
        return routed

    return run
