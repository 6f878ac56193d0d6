"""Measuring one op both ways, for kernel choice: a pair of one-op training graphs with the same inputs and output,
ORT's node(s) and the ATen node the routed symbolic emits, built by the core (``ortcore.api.measurement_session``),
timed forward + backward, interleaved, medians kept (:func:`measure_case`). :data:`_BUILDERS` holds one graph-pair
builder per routable op.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import onnx
import torch
from onnx import TensorProto, helper

from ortcore.api import ATEN_DOMAIN, measurement_session

REPEATS = 5  # timed forward + backward runs per side (after one warm-up each), interleaved
MIN_REPEATS = 3  # ... at least this many when the budget runs out
BUDGET_SECONDS = 0.3  # per case, for the timed runs (graph builds and warm-ups come on top)


_ONNX_TYPES = {
    "float32": TensorProto.FLOAT,
    "float64": TensorProto.DOUBLE,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "int64": TensorProto.INT64,
}
TORCH_TYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@attrs.define
class _OneOp:
    """A one-op graph pair: the same inputs and output, ORT's nodes and the routed ATen nodes."""

    inputs: list[tuple[str, torch.Tensor]]
    train: list[str]
    ort_nodes: list[onnx.NodeProto]
    torch_nodes: list[onnx.NodeProto]
    # values the ATen nodes produce besides the output, with their reference tensors (ORT needs their types)
    aten_values: dict[str, torch.Tensor]
    output: torch.Tensor


def _const(name: str, value: Any, dtype: torch.dtype) -> onnx.NodeProto:
    array = torch.tensor(value, dtype=dtype).numpy()
    return helper.make_node("Constant", [], [name], name=name, value=onnx.numpy_helper.from_array(array, name))


def _aten_node(operator: str, inputs: list[str], outputs: list[str]) -> onnx.NodeProto:
    return helper.make_node(
        "ATen", inputs, outputs, name=f"aten_{operator}", domain=ATEN_DOMAIN, operator=operator, overload_name=""
    )


def _embedding(case: Any, p: dict, rand: Callable[[Sequence[int]], torch.Tensor], generator: torch.Generator) -> _OneOp:
    """Gather against aten::embedding."""
    (rows, width), index_shape = case.shapes
    weight = rand((rows, width))
    indices = torch.randint(0, rows, tuple(index_shape), generator=generator)
    consts = [_const("pad", p.get("padding_idx", -1), torch.int64), _const("scale", False, torch.bool)]
    consts.append(_const("sparse", False, torch.bool))
    return _OneOp(
        [("weight", weight), ("indices", indices)],
        ["weight"],
        [helper.make_node("Gather", ["weight", "indices"], ["y"])],
        [*consts, _aten_node("embedding", ["weight", "indices", "pad", "scale", "sparse"], ["y"])],
        {},
        torch.nn.functional.embedding(indices, weight),
    )


def _gelu(case: Any, p: dict, rand: Callable[[Sequence[int]], torch.Tensor], generator: torch.Generator) -> _OneOp:
    """Gelu (FastGelu for tanh), with the bias add before it if the case has one, against aten::gelu."""
    (shape,) = case.shapes[:1]
    x = rand(shape)
    approximate = p.get("approximate", "none")
    inputs, h, ort_pre, train = [("x", x)], "x", [], ["x"]
    h_value = x
    if p.get("bias"):
        b = rand(shape[-1:])
        inputs.append(("b", b))
        train.append("b")
        ort_pre = [helper.make_node("Add", ["x", "b"], ["h"])]
        h, h_value = "h", x + b
    kind = "FastGelu" if approximate == "tanh" else "Gelu"
    text = _const("approximate", list(approximate.encode()), torch.uint8)
    return _OneOp(
        inputs,
        train,
        [*ort_pre, helper.make_node(kind, [h], ["y"], domain="com.microsoft")],
        [*ort_pre, text, _aten_node("gelu", [h, "approximate"], ["y"])],
        {},
        torch.nn.functional.gelu(h_value, approximate=approximate),
    )


def _layer_norm(
    case: Any, p: dict, rand: Callable[[Sequence[int]], torch.Tensor], generator: torch.Generator
) -> _OneOp:
    """LayerNormalization against aten::native_layer_norm (its mean and rstd outputs too)."""
    shape, normalized = case.shapes[0], tuple(case.shapes[1])
    x, w, b = rand(shape), rand(normalized), rand(normalized)
    train = ["x"] + [n for n, g in (("w", p.get("grad_weight")), ("b", p.get("grad_bias"))) if g]
    eps = float(p.get("eps", 1e-5))
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, list(normalized), w, b, eps)
    return _OneOp(
        [("x", x), ("w", w), ("b", b)],
        train,
        [
            helper.make_node(
                "LayerNormalization", ["x", "w", "b"], ["y", "mean", "rstd"], axis=-len(normalized), epsilon=eps
            )
        ],
        [
            _const("shape", list(normalized), torch.int64),
            _const("eps", eps, torch.float64),
            _aten_node("native_layer_norm", ["x", "shape", "w", "b", "eps"], ["y", "mean", "rstd"]),
        ],
        {"mean": mean, "rstd": rstd},
        y,
    )


def _cross_entropy_pair(
    case: Any, p: dict, rand: Callable[[Sequence[int]], torch.Tensor], generator: torch.Generator
) -> _OneOp:
    """SoftmaxCrossEntropyLoss against ortcore's cross-entropy kernel."""
    from ortcore_plugins.services.torch_kernels import cross_entropy

    logits_shape, target_shape = case.shapes[0], case.shapes[1]
    logits = rand(logits_shape)
    classes = logits_shape[1] if len(logits_shape) >= 2 else logits_shape[0]
    target = torch.randint(0, classes, tuple(target_shape), generator=generator)
    reduction = int(p.get("reduction", 1))
    ignore = int(p.get("ignore_index", -100))
    inputs = [("logits", logits), ("target", target)]
    weight = None
    if len(case.shapes) > 2:
        weight = rand(case.shapes[2]).abs()
        inputs.append(("class_weight", weight))
    loss, log_probs, total = cross_entropy(logits, target, weight, reduction, ignore, 0.0)
    ort_inputs = ["logits", "target"] + (["class_weight"] if weight is not None else [])
    names = {0: "none", 1: "mean", 2: "sum"}
    return _OneOp(
        inputs,
        ["logits"],
        [
            helper.make_node(
                "SoftmaxCrossEntropyLoss",
                ort_inputs,
                ["y", "log_prob"],
                reduction=names[reduction],
                ignore_index=ignore,
            )
        ],
        [
            _const("reduction", reduction, torch.int64),
            _const("ignore", ignore, torch.int64),
            _const("smoothing", 0.0, torch.float64),
            _aten_node(
                "ortcore_aten::cross_entropy",
                [
                    "logits",
                    "target",
                    "class_weight" if weight is not None else "",
                    "reduction",
                    "ignore",
                    "smoothing",
                ],
                ["y", "log_probs", "total_weight"],
            ),
        ],
        {"log_probs": log_probs, "total_weight": total},
        loss,
    )


def _addmm(case: Any, p: dict, rand: Callable[[Sequence[int]], torch.Tensor], generator: torch.Generator) -> _OneOp:
    """Gemm against aten::addmm (a linear traced as addmm)."""
    bias_shape, mat1_shape, mat2_shape = case.shapes
    bias, mat1, mat2 = rand(bias_shape), rand(mat1_shape), rand(mat2_shape)
    beta, alpha = float(p.get("beta", 1.0)), float(p.get("alpha", 1.0))
    train = [
        n for n, g in (("bias", p.get("grad_bias")), ("mat1", p.get("grad_mat1")), ("mat2", p.get("grad_mat2"))) if g
    ]
    return _OneOp(
        [("bias", bias), ("mat1", mat1), ("mat2", mat2)],
        train,
        [helper.make_node("Gemm", ["mat1", "mat2", "bias"], ["y"], alpha=alpha, beta=beta)],
        [
            _const("beta", beta, torch.float64),
            _const("alpha", alpha, torch.float64),
            _aten_node("addmm", ["bias", "mat1", "mat2", "beta", "alpha"], ["y"]),
        ],
        {},
        torch.addmm(bias, mat1, mat2, beta=beta, alpha=alpha),
    )


def _linear(case: Any, p: dict, rand: Callable[[Sequence[int]], torch.Tensor], generator: torch.Generator) -> _OneOp:
    """Gemm, or Transpose + MatMul (+ Add), against aten::linear (ortcore's linear without bias)."""
    x_shape, w_shape = case.shapes[0], case.shapes[1]
    x, w = rand(x_shape), rand(w_shape)
    has_bias = len(case.shapes) > 2
    inputs = [("x", x), ("w", w)]
    train = [n for n, g in (("x", p.get("grad_input")), ("w", p.get("grad_weight"))) if g]
    b = None
    if has_bias:
        b = rand(case.shapes[2])
        inputs.append(("b", b))
        if p.get("grad_bias"):
            train.append("b")
    if has_bias and len(x_shape) == 2:
        ort_nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1)]
    else:
        ort_nodes = [
            helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "wt"], ["xw" if has_bias else "y"]),
        ]
        if has_bias:
            ort_nodes.append(helper.make_node("Add", ["xw", "b"], ["y"]))
    aten = (
        _aten_node("linear", ["x", "w", "b"], ["y"])
        if has_bias
        else _aten_node("ortcore_aten::linear_no_bias", ["x", "w"], ["y"])
    )
    return _OneOp(inputs, train, ort_nodes, [aten], {}, torch.nn.functional.linear(x, w, b))


# One builder per (op, form): the pair of one-op graphs a case is measured on. A new routable op adds one here.
_BUILDERS: dict[tuple[str, str | None], Callable[..., _OneOp]] = {
    ("embedding", None): _embedding,
    ("gelu", None): _gelu,
    ("layer_norm", None): _layer_norm,
    ("cross_entropy", None): _cross_entropy_pair,
    ("linear", "addmm"): _addmm,
    ("linear", None): _linear,
}


def one_op(case: Any, generator: torch.Generator) -> _OneOp:
    """The graph pair of ``case`` (a :class:`~.kernel_choice.Case`), on random inputs of its sizes."""
    builder = _BUILDERS.get((case.op, case.form)) or _BUILDERS.get((case.op, None))
    if builder is None:
        raise ValueError(f"no measurement for op {case.op!r}; measured: {', '.join(sorted({o for o, _ in _BUILDERS}))}")
    dtype = TORCH_TYPES[case.dtype]

    def rand(shape: Sequence[int]) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float32).to(dtype)

    return builder(case, case.param, rand, generator)


def _value_info(name: str, tensor: torch.Tensor) -> onnx.ValueInfoProto:
    dtype = {torch.int64: "int64", torch.bool: "int64"}.get(tensor.dtype) or str(tensor.dtype).replace("torch.", "")
    return helper.make_tensor_value_info(name, _ONNX_TYPES[dtype], list(tensor.shape))


def _model(pair: _OneOp, nodes: list[onnx.NodeProto], aten: bool) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "kernel_choice",
        [_value_info(name, t) for name, t in pair.inputs],
        [_value_info("y", pair.output)],
        # ORT cannot infer an ATen node's output types, and drops graph output types in the gradient build.
        value_info=[_value_info(n, t) for n, t in {**pair.aten_values, "y": pair.output}.items()] if aten else [],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    if aten:
        opsets.append(helper.make_opsetid(ATEN_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def _session(model: onnx.ModelProto, pair: _OneOp) -> Any:
    return measurement_session(model, [name for name, _ in pair.inputs], pair.train, purpose="kernel_choice")


def _step(session: Any, feeds: list[torch.Tensor], grad: torch.Tensor) -> float:
    start = time.perf_counter()
    outputs, state = session.run_forward(feeds)
    session.run_backward([grad], [(tuple(grad.shape), grad.dtype)], state)
    del outputs, state
    return (time.perf_counter() - start) * 1000.0


def measure_case(case: Any, repeats: int = REPEATS, budget: float = BUDGET_SECONDS) -> tuple[float, float]:
    """``(ort_ms, torch_ms)``: median forward + backward time of ``case`` with ORT's kernels and with the ATen
    nodes the routed symbolic emits, on random inputs of the case's sizes; runs interleaved, order alternating."""
    from ortcore_plugins.services.torch_kernels import prepare_runtime

    if case.device != "cpu":
        raise ValueError(f"kernel choice measures on CPU only, not {case.device}")
    prepare_runtime()
    generator = torch.Generator().manual_seed(0)
    pair = one_op(case, generator)
    sessions = {
        "ort": _session(_model(pair, pair.ort_nodes, False), pair),
        "torch": _session(_model(pair, pair.torch_nodes, True), pair),
    }
    feeds = [t for _, t in pair.inputs]
    grad = torch.randn(pair.output.shape, generator=generator).to(pair.output.dtype)
    times: dict[str, list[float]] = {"ort": [], "torch": []}
    for side in ("ort", "torch"):  # warm-up: first runs allocate
        _step(sessions[side], feeds, grad)
    start = time.perf_counter()
    for i in range(repeats):
        for side in ("ort", "torch") if i % 2 == 0 else ("torch", "ort"):
            times[side].append(_step(sessions[side], feeds, grad))
        if i + 1 >= MIN_REPEATS and time.perf_counter() - start > budget:
            break
    return statistics.median(times["ort"]), statistics.median(times["torch"])
