"""Ops ONNX Runtime cannot run as exported, and an op PyTorch differentiates for only some of its float inputs.

* kernel_types: an op exported in a bool or small integer type ORT's CPU provider has no kernel for (``torch.eye``
  of bools is a bool ``EyeLike``, ``masked_fill`` of bools a bool ``Where``, ``torch.maximum`` of uint8 a uint8
  ``Max``, ...) runs in a wider type ORT has a kernel for and is cast back. Each small model below trains through
  ORTModule with the kernel_types plugin alone, with PyTorch's outputs, loss, every parameter's gradient and a short
  AdamW curve; without the plugin ORT refuses the session.
* aten_fallback's repair: an op in a type no wider type serves (an int64 ``ArgMax``) fails session creation naming
  the ONNX node; the repair routes its ``aten::`` op to PyTorch, and the model trains with PyTorch's numbers.
* the fallback gradient of an op run by PyTorch differentiates it only with respect to the inputs PyTorch does, on
  both exporters: ``fractional_max_pool2d``'s ``random_samples`` (through aten_fallback's listed and ``auto`` ops and
  through op_routing) and ``binary_cross_entropy``'s ``weight`` (through op_routing's wrapper op) are float tensors
  PyTorch refuses to differentiate. Outputs, loss, every parameter's gradient and the input's are compared with
  ``torch.autograd``, then a short AdamW curve.

Tolerances are the parity suite's (``tests/models.py``): outputs and gradients ``rtol=1e-4, atol=1e-5``, losses and
curves ``rtol=1e-4``. The masks and integer values themselves are exact, so they agree to the last bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from models import (
    assert_close,
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    check_step_and_training,
    make_batches,
    ort_and_torch,
)
from onnx import TensorProto, helper
from torch import nn

import ortcore_plugins.aten_fallback as aten_fallback
import ortcore_plugins.dynamo_exporter as dynamo_exporter
import ortcore_plugins.kernel_types as kernel_types
import ortcore_plugins.op_routing as op_routing
from ortcore.errors import GraphBuildError
from ortcore.repair import Failure
from ortcore.testing import make_host
from ortcore_plugins.aten_fallback.repairs import repairs_for, unrunnable_nodes
from ortcore_plugins.services import ort_kernels
from ortcore_plugins.services.differentiability import differentiable_arguments, differentiates, parse_derivatives

# -- models: a narrow-type computation on a Linear's output, whose result scales that output ---------------------------


def eye_mask(h: torch.Tensor) -> torch.Tensor:
    """``torch.eye`` of bools: a bool ``EyeLike`` (ORT: int32, int64, float, double)."""
    scores = h @ h.T
    return scores.masked_fill(torch.eye(h.shape[0], dtype=torch.bool), 0.0)


def bool_where(h: torch.Tensor) -> torch.Tensor:
    """``torch.where`` on bool data: a bool ``Where`` (ORT: uint8, int32, int64, float, double, ...)."""
    keep = torch.where(h > 0, torch.ones_like(h, dtype=torch.bool), h < -0.5)
    return h * keep


def uint8_maximum(h: torch.Tensor) -> torch.Tensor:
    """``torch.maximum`` of uint8 values: a uint8 ``Max``."""
    q = (h.abs() * 20).clamp(max=250).to(torch.uint8)
    return h * torch.maximum(q, q.flip(-1))


def int32_tril(h: torch.Tensor) -> torch.Tensor:
    """``torch.tril`` of an int32 tensor: an int32 ``Trilu`` (ORT: bool, int64, float, double)."""
    q = (h * 4).to(torch.int32)
    return h * torch.tril(q, -1)


def int16_ranks(h: torch.Tensor) -> torch.Tensor:
    """Ranks by int16 comparisons: an int16 ``Less``."""
    q = (h * 100).clamp(-3000, 3000).to(torch.int16)
    return h * (q.unsqueeze(-1) < q.unsqueeze(-2)).sum(-1)


def int8_wrapping(h: torch.Tensor) -> torch.Tensor:
    """int8 arithmetic that overflows and wraps: uint8/int8 ``Mul`` and ``Add``; computed in int32 and cast back, it
    wraps the same way."""
    q = (h * 20).clamp(-100, 100).to(torch.int8)
    return h * (q * q + q)


def int8_topk(h: torch.Tensor) -> torch.Tensor:
    """``topk`` of int8 values: an int8 ``TopK``."""
    q = (h * 20).clamp(-100, 100).to(torch.int8)
    return h[:, :2] * q.topk(2, -1).values


def int_all(h: torch.Tensor) -> torch.Tensor:
    """``torch.all`` of int32 values: the TorchScript exporter writes ``Not`` on the integers (ONNX takes bools)."""
    q = (h * 3).to(torch.int32)
    return h * q.all(-1, keepdim=True)


def int_then_bool(h: torch.Tensor) -> torch.Tensor:
    """``x.to(torch.int32).bool()``: ``Cast(to int32) -> Cast(to bool)``, whose first Cast ORT drops (0.3 -> True)."""
    return h * (h * 3).to(torch.int32).bool()


NARROW_TYPE_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    f.__name__: f
    for f in (
        eye_mask,
        bool_where,
        uint8_maximum,
        int32_tril,
        int16_ranks,
        int8_wrapping,
        int8_topk,
        int_all,
        int_then_bool,
    )
}


class NarrowTypeNet(nn.Module):
    """Linear -> ``op`` (a float result computed through a bool or small-integer op) -> Linear."""

    def __init__(self, op: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.op = op
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.op(self.fc1(x))
        return self.fc2(F.pad(h, (0, 6 - h.shape[-1])))


def regression_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 6, generator=gen), torch.randn(6, 3, generator=gen)


def regression_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    out = model(x)
    return out, F.mse_loss(out, y)


def graph_nodes(model: Any) -> list[onnx.NodeProto]:
    """The nodes of the training graph the model's last call ran."""
    return list(model.state_machine.current[1].model.graph.node)


# -- kernel_types: each op of the class, in ORT with PyTorch's numbers ---------------------------------------------


@pytest.mark.parametrize("name", list(NARROW_TYPE_OPS))
def test_narrow_type_op_trains_in_ort_with_torch_parity(name: str) -> None:
    torch.manual_seed(0)
    # Every dimension dynamic: on a graph of static sizes ORT folds ops whose inputs the sizes decide (eye_mask's).
    host = make_host({kernel_types.NAME: kernel_types}, env={"ORTCORE_DYNAMIC_SHAPES": "always"})
    ort, ref = ort_and_torch(NarrowTypeNet(NARROW_TYPE_OPS[name]), host=host)
    # Outputs, loss and every parameter's gradient on the first batch, then 3 AdamW steps' losses.
    check_step_and_training(ort, ref, make_batches(regression_batch, 4), regression_step, steps=3)
    assert ort.repairs == []
    # The pass's own nodes: casts, and a comparison with zero where a value is read as bool.
    added = {n.op_type for n in graph_nodes(ort) if "ortcore.kernel_types" in n.name}
    assert "Cast" in added or "Equal" in added, added
    assert added <= {"Cast", "Constant", "Equal", "Not"}, added


@pytest.mark.parametrize("name", list(NARROW_TYPE_OPS))
def test_narrow_type_op_trains_on_the_dynamo_route(name: str) -> None:
    """The same models through torch.export and onnxscript, which write some of them in types ORT runs (nothing to
    rewrite there) and ``all`` of integers as a Cast chain to bool."""
    torch.manual_seed(0)
    host = make_host({kernel_types.NAME: kernel_types, dynamo_exporter.NAME: dynamo_exporter})
    ort, ref = ort_and_torch(NarrowTypeNet(NARROW_TYPE_OPS[name]), host=host, exporter="dynamo")
    check_step_and_training(ort, ref, make_batches(regression_batch, 4), regression_step, steps=3)
    assert ort.repairs == []


def test_without_the_plugin_ort_refuses_a_bool_eye() -> None:
    """The class exists: ORT 1.19.2 has no bool EyeLike kernel (this fails once ORT has one: drop the entry then)."""
    ort, _ = ort_and_torch(NarrowTypeNet(eye_mask), host=make_host({}))
    with pytest.raises(GraphBuildError, match=r"Could not find an implementation for EyeLike"):
        ort(torch.randn(6, 6))


def test_ort_runs_asks_ort_which_types_it_serves() -> None:
    node = helper.make_node("EyeLike", ["x"], ["y"])
    assert ort_kernels.ort_runs(node, [TensorProto.BOOL], 17) is False
    assert ort_kernels.ort_runs(node, [TensorProto.INT32], 17) is True
    assert ort_kernels.ort_runs(helper.make_node("Max", ["a", "b"], ["m"]), [TensorProto.BOOL] * 2, 17) is False
    assert ort_kernels.ort_runs(node, [None], 17) is None  # an unknown type: never rewritten


def _one_node_graph(node: onnx.NodeProto, inputs: dict[str, int], outputs: dict[str, int]) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, t, None) for n, t in inputs.items()],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    ("node", "feeds", "expected"),
    [
        # uint8 Max of three inputs: computed in int32, cast back.
        (
            helper.make_node("Max", ["a", "b", "c"], ["y"], name="max"),
            {"a": np.array([1, 200], np.uint8), "b": np.array([3, 4], np.uint8), "c": np.array([2, 255], np.uint8)},
            np.array([3, 255], np.uint8),
        ),
        # int8 Mul that overflows: int32, then the cast back wraps as int8 arithmetic does (100 * 100 = 16 mod 256).
        (
            helper.make_node("Mul", ["a", "b"], ["y"], name="mul"),
            {"a": np.array([100, -7], np.int8), "b": np.array([100, 3], np.int8)},
            np.array([16, -21], np.int8),
        ),
        # double NonZero: read as bool (a tiny value is not zero; float32 would lose it).
        (
            helper.make_node("NonZero", ["a"], ["y"], name="nonzero"),
            {"a": np.array([0.0, 1e-300, -0.0, 2.0])},
            np.array([[1, 3]], np.int64),
        ),
    ],
    ids=["uint8_max", "int8_mul_wraps", "double_nonzero"],
)
def test_widened_node_gives_the_narrow_types_result(node: onnx.NodeProto, feeds: dict, expected: np.ndarray) -> None:
    types = {name: helper.np_dtype_to_tensor_dtype(value.dtype) for name, value in feeds.items()}
    out_type = helper.np_dtype_to_tensor_dtype(expected.dtype)
    model = _one_node_graph(node, types, {"y": out_type})
    assert kernel_types.widen_kernel_types(model) == 1
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (result,) = session.run(None, feeds)
    assert result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected)


def test_cast_chain_to_bool_reads_the_middle_value() -> None:
    """``Cast(float -> int32) -> Cast(to bool)``: 0.3 truncates to 0, so False, where ORT alone says True."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT32),
            helper.make_node("Cast", ["i"], ["y"], to=TensorProto.BOOL),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.BOOL, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = np.array([0.3, -0.7, 2.0, 0.0], np.float32)
    unfixed = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert unfixed.run(None, {"x": x})[0].tolist() == [True, True, True, False]  # ORT's bug, still there
    assert kernel_types.read_cast_chains_as_bool(model) == 1
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x.astype(np.int32).astype(bool))


def test_graph_ort_runs_is_left_as_exported() -> None:
    model = _one_node_graph(
        helper.make_node("Max", ["a", "b"], ["y"]), {"a": TensorProto.INT32, "b": TensorProto.INT32}, {"y": 6}
    )
    before = model.SerializeToString()
    assert kernel_types.widen_kernel_types(model) == 0
    assert kernel_types.read_cast_chains_as_bool(model) == 0
    assert model.SerializeToString() == before


# -- aten_fallback's repair: a type with no lossless wider type -----------------------------------------------------


class Int64ArgMax(nn.Module):
    """An int64 ``argmax`` (ORT's CPU ArgMax has int32 and float kernels, and int64 has no lossless wider type)
    choosing embedding rows that scale a Linear's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)
        self.emb = nn.Embedding(9, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.emb(ids.argmax(-1))


def argmax_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(5, 6, generator=gen), torch.randint(0, 1000, (5, 9), generator=gen), torch.randn(5, 3)


def argmax_step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    x, ids, y = batch
    out = model(x, ids)
    return out, F.mse_loss(out, y)


def test_op_ort_has_no_kernel_for_is_repaired_by_routing_it_to_pytorch() -> None:
    torch.manual_seed(0)
    host = make_host({aten_fallback.NAME: aten_fallback, kernel_types.NAME: kernel_types})
    ort, ref = ort_and_torch(Int64ArgMax(), host=host)
    check_step_and_training(ort, ref, make_batches(argmax_batch, 4), argmax_step, steps=3)
    assert [r.op for r in ort.repairs] == ["aten::argmax"], ort.repairs
    assert "ArgMax" in ort.repairs[0].reason
    assert not [n for n in graph_nodes(ort) if n.op_type == "ArgMax"]


@pytest.mark.parametrize(
    ("message", "found"),
    [
        (
            "ONNX Runtime could not create the training session: Could not find an implementation for EyeLike(9) "
            "node with name '/module/EyeLike'",
            [("EyeLike", "/module/EyeLike")],
        ),
        (
            "This is an invalid model. Type Error: Type 'tensor(bool)' of input parameter (/module/x) of operator "
            "(Max) in node (/module/enc/Max) is invalid.",
            [("Max", "/module/enc/Max")],
        ),
        (
            "Failed to find kernel for com.microsoft.FusedMatMul(1) (node:'/module/MatMul/MatmulTransposeFusion/' "
            "ep:'CPUExecutionProvider').",
            [("FusedMatMul", "/module/MatMul/MatmulTransposeFusion/")],
        ),
        ("ONNX Runtime could not create the training session: out of memory", []),
    ],
)
def test_unrunnable_nodes_are_read_from_orts_messages(message: str, found: list[tuple[str, str]]) -> None:
    assert unrunnable_nodes(message) == found


def test_build_failure_on_a_node_without_kernel_offers_its_aten_ops() -> None:
    config = make_host({aten_fallback.NAME: aten_fallback}).config
    message = "Could not find an implementation for Trilu(14) node with name '/module/Trilu'"
    offered = repairs_for(config, Failure("build", message))
    assert [r.op for r in offered] == ["aten::tril", "aten::triu"]
    assert offered[0].options == {"fallback_ops": ["aten::tril"]} and offered[0].kind == "op"
    assert repairs_for(config, Failure("build", "ConvGrad failed")) == []
    assert repairs_for(config, Failure("audit", message)) == []


# -- the fallback gradient: only the inputs PyTorch differentiates, on both exporters ---------------------------------


def check_every_gradient(ort: Any, ref: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], input_grad: bool) -> None:
    """One step of each side on ``batch``: outputs, loss, every parameter's gradient and, with ``input_grad``, the
    gradient of the input (which then requires grad: another build of the same export)."""
    x, y = batch
    x_ort, x_ref = (x.clone().requires_grad_(input_grad) for _ in range(2))
    out, out_ref = ort(x_ort), ref(x_ref)
    assert_outputs_match(out, out_ref)
    loss, loss_ref = F.mse_loss(out, y), F.mse_loss(out_ref, y)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    if input_grad:
        assert_close(x_ort.grad, x_ref.grad, "gradient of x", "grads")
    ort.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def gradient_helpers(model: Any, op: str) -> set[int]:
    """The inputs of ``op``'s ATen node the training graph's VJP helper nodes differentiate (``..._<i>``)."""
    found = set()
    for node in graph_nodes(model):
        operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
        if node.op_type == "ATen" and operator.startswith("ortcore_aten::fallback_grad__") and f"__{op}__" in operator:
            found.add(int(operator.rpartition("__")[2]))
    return found


def fallback_host(exporter: str, plugin: str, fallback_ops: list[str] | None = None) -> Any:
    """A host with ``plugin`` alone (and the dynamo exporter on that route), ``fallback_ops`` set if given."""
    plugins: dict[str, Any] = (
        {aten_fallback.NAME: aten_fallback} if plugin == "aten_fallback" else {op_routing.NAME: op_routing}
    )
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
        plugins[dynamo_exporter.NAME] = dynamo_exporter
    table = {"plugins": {"aten_fallback": {"fallback_ops": fallback_ops}}} if fallback_ops else None
    return make_host(plugins, table=table)


class FractionalPool(nn.Module):
    """Conv2d -> fractional_max_pool2d with fixed samples (a float buffer PyTorch does not differentiate) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 5 * 5, 3)
        self.register_buffer("samples", torch.rand(2, 4, 2, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.fractional_max_pool2d(self.conv(x), 2, output_size=(5, 5), _random_samples=self.samples)
        return self.head(pooled.flatten(1))


def pool_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 3, 12, 12, generator=gen), torch.randn(2, 3, generator=gen)


# (exporter, plugin, fallback_ops): aten_fallback's listed and auto ops on each route (TorchScript: its symbolic; dynamo:
# its program pass through services.aten_program), and op_routing alone (dynamo: the call it finds without a
# translation, as in the wide zoo's unusual_max_pool; TorchScript: aten_fallback's auto exporter it uses).
POOL_ROUTES = [
    pytest.param("torchscript", "aten_fallback", ["fractional_max_pool2d"], id="torchscript-listed"),
    pytest.param("torchscript", "aten_fallback", ["auto"], id="torchscript-auto"),
    pytest.param("torchscript", "op_routing", None, id="torchscript-op_routing"),
    pytest.param("dynamo", "aten_fallback", ["fractional_max_pool2d"], id="dynamo-listed"),
    pytest.param("dynamo", "aten_fallback", ["auto"], id="dynamo-auto"),
    pytest.param("dynamo", "op_routing", None, id="dynamo-op_routing"),
]


@pytest.mark.parametrize(("exporter", "plugin", "fallback_ops"), POOL_ROUTES)
def test_fallback_gradient_leaves_inputs_pytorch_does_not_differentiate(
    exporter: str, plugin: str, fallback_ops: list[str] | None
) -> None:
    torch.manual_seed(0)
    ort, ref = ort_and_torch(FractionalPool(), host=fallback_host(exporter, plugin, fallback_ops), exporter=exporter)
    batches = make_batches(pool_batch, 6)
    check_every_gradient(ort, ref, batches[0], input_grad=True)
    check_every_gradient(ort, ref, batches[1], input_grad=False)
    check_step_and_training(ort, ref, batches[2:], regression_step, steps=3)
    # One VJP helper, for the pooled input (first on both routes); none for random_samples.
    assert gradient_helpers(ort, "fractional_max_pool2d") == {0}
    assert ort.repairs == []


class WeightedBCE(nn.Module):
    """``binary_cross_entropy(sigmoid(x), sigmoid(fc(x)), weight)``: a float ``weight`` buffer PyTorch does not
    differentiate, and a first input that needs no gradient unless ``x`` requires grad, so on the TorchScript route
    the call is the routed-calls service's wrapper (``emit_call``), which takes ``target`` first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("weight", torch.rand(4, 6, generator=torch.Generator().manual_seed(5)) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(self.fc(x)), self.weight, reduction="none")


def bce_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_routed_wrapper_leaves_inputs_pytorch_does_not_differentiate(exporter: str) -> None:
    torch.manual_seed(0)
    host = fallback_host(exporter, "aten_fallback", ["binary_cross_entropy"])
    ort, ref = ort_and_torch(WeightedBCE(), host=host, exporter=exporter)
    batches = make_batches(bce_batch, 6)
    check_every_gradient(ort, ref, batches[0], input_grad=False)
    check_every_gradient(ort, ref, batches[1], input_grad=True)
    check_step_and_training(ort, ref, batches[2:], regression_step, steps=3)
    # The wrapper takes target, then self, then weight: helpers for the first two only.
    assert gradient_helpers(ort, "binary_cross_entropy") == {0, 1}
    assert ort.repairs == []


def test_differentiable_arguments_follow_pytorchs_autograd_table() -> None:
    aten = torch.ops.aten
    assert differentiable_arguments(aten.fractional_max_pool2d.default._schema) == {"self"}
    assert differentiable_arguments(aten.grid_sampler_2d.default._schema) == {"input", "grid"}
    assert differentiable_arguments(aten.gather.default._schema) == {"self"}  # not the int64 index
    assert differentiable_arguments(aten.logaddexp.default._schema) == {"self", "other"}
    assert differentiable_arguments(aten.lu_solve.default._schema) is None  # composite: not in the table
    other = torch._C.parse_schema("mylib::fractional_max_pool2d(Tensor self, int[2] k, int[2] o, Tensor r) -> Tensor")
    assert differentiable_arguments(other) is None  # another namespace: its own autograd
    pool = aten.fractional_max_pool2d.default._schema
    assert [differentiates(pool, k) for k in range(4)] == [True, False, False, False]
    assert [differentiates(other, k) for k in range(4)] == [True, True, True, True]
    bce = aten.binary_cross_entropy.default._schema
    assert [a.name for k, a in enumerate(bce.arguments) if not differentiates(bce, k)] == ["weight", "reduction"]


def test_derivatives_table_reads_dispatch_defaults_and_non_differentiable_entries() -> None:
    text = """
# a comment
- name: op(Tensor self, Tensor other, Tensor idx) -> Tensor
  self, other: grad * 2
  idx: non_differentiable
  result: auto_linear

- name: op2.overload(Tensor self, Tensor w) -> Tensor
  dispatch:
    Default:
      self: grad
      result: auto_linear
    AutogradNestedTensor:
      w: grad
"""
    table = parse_derivatives(text)
    assert table[("op", "default")] == {"self", "other", "result"}
    assert table[("op2", "overload")] == {"self", "result"}
