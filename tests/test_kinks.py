"""ortcore_plugins.gradient_audit.kinks tells float32 rounding at a ReLU kink from a wrong gradient (float64 runs of a small model)."""

from __future__ import annotations

import copy

import torch

from ortcore_plugins.gradient_audit.kinks import ReluKinks, explain_by_kinks


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


def test_a_flipped_kink_is_explained_and_a_wrong_gradient_is_not() -> None:
    torch.manual_seed(0)
    model = _Net().double()
    x = torch.randn(16, 6, dtype=torch.float64)

    def loss_of(m: torch.nn.Module) -> torch.Tensor:
        return m(x).square().mean()

    # Move one batch-norm bias so that one ReLU input sits 1e-9 (relative) above zero: within float32 rounding.
    pre = _pre_relu(model, loss_of)
    index = pre.abs().flatten().argmin().item()
    row, col = divmod(index, 8)
    with torch.no_grad():
        model.bn.bias[col] -= pre[row, col] - 1e-9 * pre.abs().max()
    pre = _pre_relu(model, loss_of)
    assert 0 < pre.flatten()[index].item() < 1e-8 * pre.abs().max().item()

    exact = _grads(model, loss_of)
    flipped = _grads(model, loss_of, flips={0: [index]})  # what a float32 run on the kink's other side computes
    names = [n for n in exact if (flipped[n] - exact[n]).abs().max() > 1e-4]
    assert names, "the flip must move some gradient, else the test shows nothing"

    def run(mode: ReluKinks) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model)
        with mode:
            loss = loss_of(m)
        loss.backward()
        return {n: p.grad for n, p in m.named_parameters()}

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
