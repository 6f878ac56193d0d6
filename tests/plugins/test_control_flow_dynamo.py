"""``torch.cond`` on the dynamo route: each call runs with PyTorch inside the ORT graph (the control_flow plugin), so
a model with data-dependent control flow written as ``torch.cond`` trains with PyTorch's loss and gradients on
whichever branch each batch takes, from one export. Tolerances: rtol 1e-5, atol 1e-6 (float32, one branch's ops
run by the same PyTorch kernels as the reference)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ortcore_plugins.control_flow as plugin
import ortcore_plugins.dynamo_exporter as dynamo_exporter
from ortcore import GraphBuildError, ORTModule
from ortcore.explain import ROUTED_METADATA_PREFIX
from ortcore.testing import make_host

pytest.importorskip("onnxscript")

RTOL, ATOL = 1e-5, 1e-6


class Gated(nn.Module):
    """A branch on the sign of an activation's sum: one branch reads a parameter the other does not."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.up = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = torch.cond(h.sum() > 0, lambda t: torch.relu(self.up(t)) * 2, lambda t: torch.tanh(t) - 1, (h,))
        return nn.functional.cross_entropy(self.head(h), y)


class TwoOutputs(nn.Module):
    """A cond with two outputs, both used."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)

        def wide(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return t * self.scale, t.sin()

        def narrow(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return t - 1, t.cos() * self.scale

        a, b = torch.cond(x.mean() > 0, wide, narrow, (h,))
        return a.sum() + (b * b).sum(), a


def host(**env: str):
    return make_host({dynamo_exporter.NAME: dynamo_exporter, plugin.NAME: plugin}, env=env)


def batch(n: int, seed: int, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return sign * (torch.rand(n, 4, generator=g) + 0.5), torch.randint(0, 3, (n,), generator=g)


def _graph(model: ORTModule):
    return next(iter(model.state_machine._graphs.values())).model


def _assert_grads(model: nn.Module, reference: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), f"{what}: {name} has a gradient where torch has none"
            continue
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")


def test_cond_trains_like_pytorch_on_both_branches_from_one_export():
    """Batches of both signs take both branches; loss and every gradient equal PyTorch's over 6 SGD steps with
    changing batch sizes, and the graph runs the cond as one ATen node (no If)."""
    torch.manual_seed(0)
    reference = Gated()
    model = ORTModule(copy.deepcopy(reference), host=host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    ours = torch.optim.SGD(model.parameters(), lr=0.05)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step, (n, sign) in enumerate([(5, 1.0), (3, -1.0), (7, 1.0), (4, -1.0), (6, -1.0), (2, 1.0)]):
        x, y = batch(n, step, sign)
        loss, expected = model(x, y), reference(x, y)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
        _assert_grads(model, reference, f"step {step}")
        for optimizer in (ours, theirs):
            optimizer.step()
            optimizer.zero_grad()
    assert model.state_machine.counters.exports == 2  # the first call's sizes, then one graph dynamic in the dimension a call changed
    graph = _graph(model)
    assert not [n.op_type for n in graph.graph.node if n.op_type == "If"]
    operators = [
        a.s.decode() for n in graph.graph.node if n.op_type == "ATen" for a in n.attribute if a.name == "operator"
    ]
    assert any("cond_" in o for o in operators), operators
    assert {p.key for p in graph.metadata_props} >= {f"{ROUTED_METADATA_PREFIX}cond"}


def test_cond_with_two_outputs_and_a_parameter_read_only_in_the_branches():
    torch.manual_seed(1)
    reference = TwoOutputs()
    model = ORTModule(copy.deepcopy(reference), host=host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    for step, sign in enumerate([1.0, -1.0, 1.0]):
        x = batch(3 + step, step, sign)[0]
        (loss, a), (expected, b) = model(x), reference(x)
        (loss + a.sum()).backward()
        (expected + b.sum()).backward()
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        _assert_grads(model, reference, f"step {step}")
        assert model.scale.grad is not None and model.scale.grad.abs() > 0
        model.zero_grad()
        reference.zero_grad()


def test_cond_runs_in_inference():
    torch.manual_seed(2)
    reference = Gated().eval()
    model = ORTModule(copy.deepcopy(reference), host=host(), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    with torch.no_grad():
        for step, sign in enumerate([1.0, -1.0]):
            x, y = batch(4, step, sign)
            torch.testing.assert_close(model(x, y), reference(x, y), rtol=RTOL, atol=ATOL)


def test_disabled_leaves_the_if_which_a_training_graph_refuses():
    model = ORTModule(
        Gated(),
        host=host(ORTCORE_CONTROL_FLOW="0", ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR="0"),  # this route's own outcome
        exporter="dynamo",
        fallback_policy="FALLBACK_DISABLE",
    )
    with pytest.raises(GraphBuildError, match="If node"):
        model(*batch(4, 0, 1.0))


def test_with_every_installed_plugin():
    """The default host (every built-in plugin, op_routing's translations too) trains the cond the same way."""
    torch.manual_seed(3)
    reference = Gated()
    model = ORTModule(copy.deepcopy(reference), exporter="dynamo", fallback_policy="FALLBACK_DISABLE")
    for step, sign in enumerate([-1.0, 1.0]):
        x, y = batch(4, step, sign)
        loss, expected = model(x, y), reference(x, y)
        loss.backward()
        expected.backward()
        torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
        _assert_grads(model, reference, f"step {step}")
        model.zero_grad()
        reference.zero_grad()
