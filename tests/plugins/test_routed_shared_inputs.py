"""Routed ops sharing inputs: ATen nodes whose gradient definitions write ``<input>_grad`` read one value.

ORT's gradient builder writes every input gradient an ATen node's definition names under the input's name, whether
or not the input needs a gradient in that build, and sums the gradients only of values it differentiates. So two
routed ops reading one value must not define its gradient twice ("Duplicate definition of name"), also where ORT's
own optimizers merge equal values before building gradients (two ``zeros_like`` of one tensor, two ``Identity`` of
one input, ``y.t()`` computed twice), and a value that does need a gradient must get the sum of every op's part.
A float value PyTorch does not differentiate (``fractional_max_pool2d``'s ``random_samples``) gets no gradient
definition at all, so two ops read it as it is.

Each model trains through ``ORTModule`` with ``FALLBACK_DISABLE`` on both exporters and is compared with
``torch.autograd`` on a deep copy: outputs, the loss and every parameter's gradient (and an input's, where it
requires grad) within ``rtol=1e-4, atol=1e-5`` (``tests.models``' fp32 tolerances), the loss within ``1e-4``
relative.
"""

from __future__ import annotations

import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ortcore import ORTModule
from ortcore_plugins.services import aten_program
from tests.models import assert_close, assert_grads_match, assert_losses_match, assert_outputs_match, ort_and_torch

EXPORTERS = ("torchscript", "dynamo")


def _exporter(name: str) -> str:
    if name == "dynamo":
        pytest.importorskip("onnxscript")
    return name


def _loss(outputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A loss whose gradient differs per element (a plain sum of a normalised output has none)."""
    total = torch.zeros(())
    for k, out in enumerate(outputs):
        weights = torch.linspace(-1.0, 2.0, out.numel()).reshape(out.shape) * (k + 1)
        total = total + (out * weights).sum() + out.square().mean()
    return total


def _operator(node: onnx.NodeProto) -> str:
    return next(a.s.decode() for a in node.attribute if a.name == "operator")


def _routed(model: ORTModule) -> dict[str, int]:
    """How many ATen nodes of each routed op the training graph of the last call holds (forward nodes)."""
    counts: dict[str, int] = {}
    for node in model.state_machine.current[1].model.graph.node:
        if node.op_type == "ATen":
            operator = _operator(node)
            if operator.startswith("ortcore_route::"):
                op = operator.split("::")[1].split("__")[0]
                counts[op] = counts.get(op, 0) + 1
    return counts


def _step(wrapped: ORTModule, ref: nn.Module, args: tuple, ref_args: tuple) -> None:
    """One forward and backward on each side; outputs, loss and every parameter's gradient compared."""
    out, expected = wrapped(*args), ref(*ref_args)
    assert_outputs_match(out, expected)
    loss, ref_loss = _loss(out), _loss(expected)
    assert_losses_match(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    assert_grads_match(wrapped, ref)


class SharedTrained(nn.Module):
    """A parameter, an activation and the model's input, each read by several routed ops (and an op reading one of
    them twice): all need gradients, which ORT must sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        return (
            torch.einsum("ij,bj->bi", self.w, h),
            torch.einsum("bi,ij,bj->b", h, self.w, h),
            torch.einsum("ij,bi->bj", self.w, h.tanh()),
            torch.cumsum(h, 1),
            torch.einsum("bi,bi->b", x, x) + torch.einsum("bi,ij->bj", x, self.w).sum(1),
        )


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_shared_input_that_needs_a_gradient_gets_the_sum_of_every_routed_op(exporter: str):
    torch.manual_seed(0)
    wrapped, ref = ort_and_torch(SharedTrained(), exporter=_exporter(exporter))
    x = torch.randn(4, 8)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    _step(wrapped, ref, (xo,), (xr,))
    assert_close(xo.grad, xr.grad, "gradient of x", "grads")
    assert _routed(wrapped).get("einsum", 0) >= 5, _routed(wrapped)


class SharedUntrained(nn.Module):
    """Values that need no gradient (an input without requires_grad, a frozen parameter, a buffer), each read by
    several routed ops: ``y`` by four (twice by one of them), ``y.t()`` computed twice (ORT merges the two), the frozen
    parameter and the buffer by two each. Freezing and ``requires_grad`` change per build, without a new export."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.frozen = nn.Parameter(torch.randn(8, 8) * 0.3, requires_grad=False)
        self.register_buffer("mix", torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        return (
            torch.einsum("bi,ij,bj->bj", y, self.mix, h),
            torch.einsum("bi,bi,ij,bj->bj", y, y, self.frozen, h),
            torch.einsum("ib,bj->ij", y.t(), h),
            torch.einsum("ib,bj->ij", y.t(), h.tanh()),
            torch.einsum("ij,bj->bi", self.frozen, h) + torch.einsum("ij,bj->bi", self.mix, h.sigmoid()),
        )


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_shared_input_without_gradient_is_not_defined_twice(exporter: str):
    torch.manual_seed(0)
    wrapped, ref = ort_and_torch(SharedUntrained(), exporter=_exporter(exporter))
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    # The same export, built again when the frozen parameter trains and y requires grad.
    for trained in (False, True):
        wrapped.frozen.requires_grad_(trained)
        ref.frozen.requires_grad_(trained)
        yo, yr = y.clone().requires_grad_(trained), y.clone().requires_grad_(trained)
        _step(wrapped, ref, (x, yo), (x, yr))
        if trained:
            assert_close(yo.grad, yr.grad, "gradient of y", "grads")
        wrapped.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    counters = wrapped.state_machine.counters
    assert counters.exports == 1 and counters.builds == 2, counters
    assert counters.fallbacks == 0 and counters.repairs == 0, wrapped.state_machine.history
    assert _routed(wrapped).get("einsum", 0) >= 6, _routed(wrapped)


class SharedConstant(nn.Module):
    """Constants read by several routed ops: two ``zeros_like`` of one tensor (ORT merges them into one value),
    a ``new_zeros`` read by two scatters, a fixed vector read by two einsums, once twice in one call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x)
        summed = torch.zeros_like(h).index_add(0, index, h)
        biggest = torch.zeros_like(h).scatter_reduce(0, index[:, None].expand_as(h), h, "amax", include_self=False)
        groups = index % 3
        base = h.new_zeros(3, 8)
        pooled = base.index_add(0, groups, h) + base.scatter_reduce(
            0, groups[:, None].expand_as(h), h, "mean", include_self=False
        )
        table = torch.linspace(-1.0, 1.0, 8)
        weighted = torch.einsum("j,bj->b", table, h) + torch.einsum("j,bj,j->b", table, h.tanh(), table)
        return self.head(summed + biggest), pooled, weighted


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_shared_constant_gets_no_gradient_definition(exporter: str):
    torch.manual_seed(0)
    wrapped, ref = ort_and_torch(SharedConstant(), exporter=_exporter(exporter))
    x, index = torch.randn(6, 8), torch.tensor([0, 2, 2, 5, 1, 2])
    _step(wrapped, ref, (x, index), (x, index))
    routed = _routed(wrapped)
    assert routed.get("index_add", 0) == 2 and routed.get("scatter_reduce", 0) == 2, routed
    # No gradient of a constant: the training graph differentiates only what the parameters reach.
    training = wrapped.state_machine.current[1].model
    constants = {o for n in training.graph.node if n.op_type in ("Constant", "ConstantOfShape") for o in n.output}
    constants.update(t.name for t in training.graph.initializer)
    written = {o for n in training.graph.node for o in n.output}
    assert not {f"{c}_grad" for c in constants} & written


class SharedSamples(nn.Module):
    """One fixed-samples buffer read by two ``fractional_max_pool2d`` calls: a float value PyTorch does not
    differentiate (``random_samples``), so neither routed op's gradient definition writes its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("samples", torch.rand(2, 4, 2, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.conv(x)
        return (
            F.fractional_max_pool2d(h, 2, output_size=(5, 5), _random_samples=self.samples),
            F.fractional_max_pool2d(h.tanh(), 3, output_size=(4, 4), _random_samples=self.samples),
        )


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_shared_input_pytorch_does_not_differentiate_is_a_stop_gradient_edge(exporter: str):
    torch.manual_seed(0)
    wrapped, ref = ort_and_torch(SharedSamples(), exporter=_exporter(exporter))
    x = torch.randn(2, 3, 12, 12)
    xo, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    _step(wrapped, ref, (xo,), (xr,))
    assert_close(xo.grad, xr.grad, "gradient of x", "grads")
    graph = wrapped.state_machine.current[1].model.graph
    pools = [n for n in graph.node if n.op_type == "ATen" and "fractional_max_pool2d" in _operator(n)]
    assert len(pools) == 4, [_operator(n) for n in pools]  # two forward nodes, a VJP helper each
    assert all("samples" in n.input for n in pools)  # read as it is: no Identity separates it
    assert not [o for n in graph.node for o in n.output if o.startswith("samples") and o != "samples"]


def test_ort_sums_the_gradient_of_a_value_two_aten_nodes_read(monkeypatch: pytest.MonkeyPatch):
    """What the separation relies on: without it, a parameter two routed ops read directly gets the sum of their
    gradients from ORT (a ``Sum`` writes ``w_grad``)."""
    monkeypatch.setattr(aten_program, "separate_shared_aten_inputs", lambda model, context=None: 0)

    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = self.lin(x)
            return torch.einsum("ij,bj->bi", self.w, h), torch.einsum("ij,bi->bj", self.w, h.tanh())

    torch.manual_seed(0)
    wrapped, ref = ort_and_torch(TwoReaders())
    x = torch.randn(4, 8)
    _step(wrapped, ref, (x,), (x,))
    graph = wrapped.state_machine.current[1].model.graph
    readers = [
        n for n in graph.node if n.op_type == "ATen" and "w" in n.input and _operator(n).startswith("ortcore_route")
    ]
    assert len(readers) == 2, [n.name for n in readers]
    assert any(n.op_type == "Sum" and "w_grad" in n.output for n in graph.node)


def _aten(inputs: list[str], output: str) -> onnx.NodeProto:
    return onnx.helper.make_node(
        "ATen", inputs, [output], domain=aten_program.ATEN_DOMAIN, operator="test_shared::op", overload_name=""
    )


def test_separation_survives_merged_copies_and_is_idempotent():
    """A value read by three ATen nodes, once twice, with an ``Identity`` of it already in the graph: every input
    whose gradient a node writes reads a value no merge of equal expressions makes another such input's."""
    floats = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [4]) for n in ("x", "w")]
    nodes = [
        onnx.helper.make_node("Identity", ["x"], ["x_again"]),
        _aten(["w", "x", "x_again"], "a"),
        _aten(["x", "w"], "b"),
        onnx.helper.make_node("Identity", ["x"], ["x_copy"]),
        _aten(["x_copy", "a", "b"], "c"),
    ]
    out = onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, [4])
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid(aten_program.ATEN_DOMAIN, 1)]
    model = onnx.helper.make_model(onnx.helper.make_graph(nodes, "g", floats, [out]), opset_imports=opsets)
    assert aten_program.separate_shared_aten_inputs(model) > 0
    onnx.checker.check_model(model)
    numbers = aten_program._ValueNumbers(model.graph)
    read = [numbers.of[i] for n in model.graph.node if n.op_type == "ATen" for i in n.input]
    assert len(read) == len(set(read)), [list(n.input) for n in model.graph.node]
    assert aten_program.separate_shared_aten_inputs(model) == 0
