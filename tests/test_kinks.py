"""ortcore_plugins.gradient_audit.kinks tells float32 rounding at a ReLU kink from a wrong gradient (float64 runs of a small model)."""

from __future__ import annotations

import copy
import types

import onnx
import pytest
import torch

from ortcore import GradientMismatchError, ORTModule
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.testing import make_host
from ortcore_plugins.gradient_audit.kinks import KinksAsTaken, ReluKinks, explain_by_kinks
from tests.zoo.relu_signs import ortcore_relu_signs


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.lin(x))))


def _grads(model, loss_of, flips=None) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    with ReluKinks(flips=flips):
        loss = loss_of(m)
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _pre_relu(model, loss_of) -> torch.Tensor:
    seen = []
    hook = model.bn.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    with torch.no_grad():
        loss_of(model)
    hook.remove()
    return seen[0]


def _near_zero(model, loss_of, above: float) -> tuple[int, torch.Tensor]:
    """Move one batch-norm bias so that the ReLU input nearest zero sits ``above`` (relative to the call's largest
    input) above zero; its flat index, and the ReLU's input after the move."""
    pre = _pre_relu(model, loss_of)
    index = pre.abs().flatten().argmin().item()
    row, col = divmod(index, pre.shape[1])
    with torch.no_grad():
        model.bn.bias[col] -= pre[row, col] - above * pre.abs().max()
    return index, _pre_relu(model, loss_of)


def _runner(model, loss_of):
    """``run(mode)``: a fresh copy of ``model``'s gradients with ``mode`` active, as the kink checks call it."""

    def run(mode) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model)
        with mode:
            loss = loss_of(m)
        loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

    return run


def test_a_flipped_kink_is_explained_and_a_wrong_gradient_is_not() -> None:
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(16, 6, dtype=torch.float64)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    # One ReLU input 1e-9 (relative) above zero: within float32 rounding.
    index, pre = _near_zero(model, loss_of, 1e-9)
    assert 0 < pre.flatten()[index].item() < 1e-8 * pre.abs().max().item()

    exact = _grads(model, loss_of)
    flipped = _grads(model, loss_of, flips={0: [index]})  # what a float32 run on the kink's other side computes
    names = [n for n in exact if (flipped[n] - exact[n]).abs().max() > 1e-4]
    assert names, "the flip must move some gradient, else the test shows nothing"
    run = _runner(model, loss_of)
    allowed = {n: 1e-6 for n in names}  # float32 rounding-sized
    got = explain_by_kinks(run, {n: flipped[n].float() for n in names}, allowed)
    assert got.explained, got
    assert got.flips == ((0, index),)
    assert "1 ReLU input(s)" in got.describe()

    wrong = {n: (exact[n] * 1.05).float() for n in names}  # a 5% error: no flip of near-zero elements gives it
    got = explain_by_kinks(run, wrong, allowed)
    assert not got.explained, got

    untouched = explain_by_kinks(run, {n: exact[n].float() for n in names}, allowed)
    assert untouched.explained and untouched.flips == ()  # nothing to explain: no flip is kept


def test_float64_follows_the_side_another_run_took_within_the_band_only() -> None:
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(16, 6, dtype=torch.float64)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    index, pre = _near_zero(model, loss_of, 1e-7)  # 1e-7 of the largest: within the band
    exact = _grads(model, loss_of)
    flipped = _grads(model, loss_of, flips={0: [index]})
    own = pre > 0
    run = _runner(model, loss_of)

    # Its own signs: nothing moves, and the gradients are the plain run's bit for bit.
    same = KinksAsTaken({0: own})
    got = run(same)
    assert same.taken == [] and same.refused == 0
    for n in exact:
        assert torch.equal(got[n], exact[n]), n

    # The other side at that element (as a float32 run that crossed zero there): float64 follows it.
    other = own.clone()
    other.view(-1)[index] = ~other.view(-1)[index]
    follow = KinksAsTaken({0: other})
    got = run(follow)
    assert follow.taken == [(0, index)] and follow.refused == 0
    for n in exact:
        torch.testing.assert_close(got[n], flipped[n], rtol=1e-12, atol=1e-12)
    assert any((flipped[n] - exact[n]).abs().max() > 1e-4 for n in exact)

    # An element far from zero on the other side is no rounding: counted, not followed.
    far = own.clone()
    big = pre.abs().flatten().argmax().item()
    far.view(-1)[big] = ~far.view(-1)[big]
    refuse = KinksAsTaken({0: far})
    got = run(refuse)
    assert refuse.taken == [] and refuse.refused == 1
    for n in exact:
        assert torch.equal(got[n], exact[n]), n


def test_relu_taps_read_onnx_runtime_side_of_each_kink_through_an_activation_subscriber() -> None:
    """ReluTaps with no tapper of its own taps every ReLU output of an ORTModule's export for a subscriber
    (``tests.zoo.relu_signs``): the signs ORT computed, call by call, equal PyTorch's on a network whose ReLU inputs
    are far from zero."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3), torch.nn.ReLU(inplace=True)
    )
    x = torch.randn(2, 3, 8, 8)
    expected = []
    with torch.no_grad():
        h = x
        for layer in net:
            h = layer(h)
            if isinstance(layer, torch.nn.ReLU):
                expected.append(h > 0)

    positive = ortcore_relu_signs(copy.deepcopy(net), lambda ort: ort(x).sum().backward())
    assert sorted(positive) == [0, 1]  # both calls tapped, neither overwritten later
    for call, want in enumerate(expected):
        assert torch.equal(positive[call], want), call


def _shift_relu_input(offset: float):
    """A graph pass: ``Relu(x)`` becomes ``Relu(x - offset)`` (ORT computing the ReLU's input a little lower)."""

    def run(model, context) -> None:
        nodes = list(model.graph.node)
        index, node = next((i, n) for i, n in enumerate(nodes) if n.op_type == "Relu")
        shifted = node.input[0] + "_shifted"
        const = onnx.helper.make_node(
            "Constant", [], [shifted + "_c"], value=onnx.helper.make_tensor("c", onnx.TensorProto.FLOAT, [], [offset])
        )
        sub = onnx.helper.make_node("Sub", [node.input[0], shifted + "_c"], [shifted], name="planted/shift")
        node.input[0] = shifted
        del model.graph.node[:]
        model.graph.node.extend([*nodes[:index], const, sub, *nodes[index:]])

    return run


@pytest.mark.parametrize("shift, passes", [(1e-4, True), (3e-3, False)], ids=["rounding-sized", "beyond-rounding"])
def test_audit_reads_the_side_of_each_kink_onnx_runtime_took(shift: float, passes: bool) -> None:
    """One ReLU input 5e-5 of its call's largest above zero (about 400 float32 ulp: beyond the one-at-a-time search's
    64-ulp band); ORT's graph computes every ReLU input ``shift`` of that largest lower, so it takes that element on
    the other side of the kink and its gradients move by far more than the tolerance. Rounding-sized (1e-4): the
    audit reads ORT's side of each kink from a tapped run and passes, float64 following it. Beyond (3e-3): elements
    far from zero change side too, and the graph is refused."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(16, 6)
    index, pre = _near_zero(model, lambda m: m(x), 5e-5)
    top = pre.abs().max().item()
    assert 4e-5 * top < pre.flatten()[index].item() < 6e-5 * top
    plugin = types.SimpleNamespace(
        ortcore_graph_passes=hookimpl(lambda: [GraphPass("shift", run=_shift_relu_input(shift * top))])
    )
    host = make_host({"shift": plugin}, env={"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"})
    wrapped = ORTModule(copy.deepcopy(model), verify_gradients=True, host=host)
    try:
        if passes:
            wrapped(x).square().mean().backward()
            (result,) = wrapped.gradient_audits
            assert result.status == "passed", result.message()
            assert "on the side ONNX Runtime took" in result.message(), result.message()
        else:
            with pytest.raises(GradientMismatchError):
                wrapped(x).square().mean().backward()
    finally:
        host.close()
