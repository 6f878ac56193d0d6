"""bias_gemv: bias gradients summed by a GEMV instead of ReduceSum, gradients and training as PyTorch's.

The rewrite is checked three ways: on small ONNX graphs against numpy (which reductions it takes and which it leaves),
on models against ``torch.autograd`` (every gradient, a loss curve), and on the training graph ORT builds (which
``ReduceSum`` nodes are gone)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from models import bert_batch, check_step_and_training, hf_step, make_batches, ort_and_torch, tiny_bert
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import ortcore_plugins.bias_gemv as plugin
from ortcore.errors import OptionError
from ortcore.host import PluginHost

HostFactory = Callable[..., PluginHost]


def reduce_model(shape: list, axes: list[int], keepdims: int, elem_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", elem_type, shape)
    y = helper.make_tensor_value_info("y", elem_type, None)
    axes_init = numpy_helper.from_array(np.array(axes, np.int64), "axes")
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=keepdims)
    graph = helper.make_graph([node], "g", [x], [y], [axes_init])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize(
    ("shape", "axes", "keepdims"),
    [
        ([8, 16, 32], [0, 1], 0),  # a bias gradient of a [B, S, N] activation
        ([8, 16, 32], [1, 0], 0),  # ORT's builder lists the axes in reverse
        ([8, 16, 32], [-3, -2], 1),  # negative axes, kept dimensions (a [1, 1, N] parameter)
        ([2, 4, 8, 6], [0, 1, 2], 0),  # three leading axes
        ([128, 5, 3], [0], 0),  # one leading axis, two trailing: the product is reshaped back
    ],
)
def test_leading_axis_sums_become_a_gemv_with_the_same_result(shape: list, axes: list[int], keepdims: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32)
    model = reduce_model(shape, axes, keepdims)
    assert plugin.reductions_as_gemv(model, min_rows=1) == ["y"]
    ops = [n.op_type for n in model.graph.node]
    assert "ReduceSum" not in ops and "MatMul" in ops, ops
    assert "axes" not in {t.name for t in model.graph.initializer}  # nothing reads it now (ORT would warn)
    expected = x.sum(axis=tuple(a % len(shape) for a in axes), keepdims=bool(keepdims))
    actual = run(model, x)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "axes", "min_rows", "why"),
    [
        ([4, 8, 16], [0, 2], 1, "not the leading axes (a channel bias of NCHW sums axes 0, 2, 3)"),
        ([4, 8, 16], [0, 1, 2], 1, "every axis: no column left"),
        ([4, 8, 16], [0, 1], 64, "fewer rows than min_rows"),
        (["batch", 8, 16], [0, 1], 1, "a dynamic dimension: the ones vector's length is unknown"),
    ],
)
def test_other_reductions_are_left_alone(shape: list, axes: list[int], min_rows: int, why: str) -> None:
    model = reduce_model(shape, axes, 0)
    assert plugin.reductions_as_gemv(model, min_rows=min_rows) == [], why
    assert [n.op_type for n in model.graph.node] == ["ReduceSum"]


def test_integer_sums_are_left_alone() -> None:
    model = reduce_model([8, 16, 4], [0, 1], 0, elem_type=TensorProto.INT64)
    assert plugin.reductions_as_gemv(model, min_rows=1) == []


def test_float16_sums_use_a_float16_ones_vector() -> None:
    x = np.random.default_rng(1).standard_normal([16, 8, 4]).astype(np.float16)
    model = reduce_model([16, 8, 4], [0, 1], 0, elem_type=TensorProto.FLOAT16)
    assert plugin.reductions_as_gemv(model, min_rows=1) == ["y"]
    np.testing.assert_allclose(run(model, x), x.astype(np.float32).sum(axis=(0, 1)), rtol=1e-2, atol=1e-2)


def test_a_constant_name_the_graph_uses_is_not_reused() -> None:
    model = reduce_model([8, 16, 32], [0, 1], 0)
    taken = numpy_helper.from_array(np.zeros(3, np.float32), "bias_gemv_ones_128_float")
    model.graph.initializer.append(taken)
    plugin.reductions_as_gemv(model, min_rows=1)
    names = [t.name for t in model.graph.initializer]
    assert len(names) == len(set(names)), names
    x = np.ones([8, 16, 32], np.float32)
    np.testing.assert_allclose(run(model, x), np.full(32, 128.0, np.float32))


class Biases(nn.Module):
    """Linear layers on 3-D and 4-D activations, a ``[1, 1, N]`` parameter added to one, and a channel bias that sums
    over non-leading axes (left to ReduceSum)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 8)
        self.shift = nn.Parameter(torch.randn(1, 1, 8) * 0.1)
        self.grid = nn.Linear(8, 6)
        self.channel = nn.Parameter(torch.randn(3, 1, 1) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x))) + self.shift  # [B, S, 8]
        g = self.grid(h.reshape(2, 3, -1, 8))  # [2, 3, S*B/6, 6]: three leading axes
        return (g + self.channel).pow(2).mean() + h.sum() * 0.01


def reductions(model) -> list[str]:
    return [n.output[0] for n in model.state_machine.current[1].model.graph.node if n.op_type == "ReduceSum"]


def test_a_model_trains_like_torch_and_its_bias_sums_are_gemvs(ortcore_host: HostFactory) -> None:
    torch.manual_seed(0)
    host = ortcore_host({"bias_gemv": plugin}, env={"ORTCORE_BIAS_GEMV_MIN_ROWS": "8"})
    ort_model, ref = ort_and_torch(Biases(), host=host)
    batches = [(torch.randn(6, 16, 12, generator=g),) for g in [torch.Generator().manual_seed(i) for i in range(6)]]

    def step(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(*batch)
        return out, out

    check_step_and_training(ort_model, ref, batches, step, steps=5)
    # Only the channel bias (axes 0, 2, 3) is still a ReduceSum (and the forward's h.sum()); the graph holds the
    # GEMVs' ones vectors.
    left = reductions(ort_model)
    assert not [name for name in left if name.endswith(("bias_grad", "shift_grad"))], left
    assert [name for name in left if "channel" in name], left
    graph = ort_model.state_machine.current[1].model.graph
    assert any(t.name.startswith("bias_gemv_ones_") for t in graph.initializer)


def test_switched_off_the_reductions_stay(ortcore_host: HostFactory) -> None:
    torch.manual_seed(0)
    host = ortcore_host({"bias_gemv": plugin}, env={"ORTCORE_BIAS_GEMV": "0"})
    ort_model, ref = ort_and_torch(Biases(), host=host)
    ort_model(torch.randn(6, 16, 12)).backward()
    assert {"a.bias_grad", "b.bias_grad", "shift_grad", "grid.bias_grad"} <= set(reductions(ort_model))


def test_bert_trains_like_torch(ortcore_host: HostFactory) -> None:
    ort_model, ref = ort_and_torch(tiny_bert(), host=ortcore_host({"bias_gemv": plugin}))
    check_step_and_training(ort_model, ref, make_batches(bert_batch, 4), hf_step, steps=3)
    # tiny BERT's batch is 4 x 12 = 48 rows, under the default min_rows: nothing was rewritten
    assert "bias_gemv" not in ort_model.state_machine.current[1].notes


def test_bert_bias_sums_run_as_gemvs(ortcore_host: HostFactory) -> None:
    host = ortcore_host({"bias_gemv": plugin}, env={"ORTCORE_BIAS_GEMV_MIN_ROWS": "16"})
    ort_model, ref = ort_and_torch(tiny_bert(), host=host)
    check_step_and_training(ort_model, ref, make_batches(bert_batch, 4), hf_step, steps=3)
    rewritten = ort_model.state_machine.current[1].notes["bias_gemv"]["rewritten"]
    assert any(name.endswith("dense.bias_grad") for name in rewritten), rewritten
    assert not [name for name in reductions(ort_model) if name.endswith("dense.bias_grad")]


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_bad_min_rows_names_the_variable(ortcore_host: HostFactory, value: str) -> None:
    with pytest.raises(OptionError, match=f"ORTCORE_BIAS_GEMV_MIN_ROWS={value!r}"):
        ortcore_host({"bias_gemv": plugin}, env={"ORTCORE_BIAS_GEMV_MIN_ROWS": value})
