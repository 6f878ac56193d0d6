"""A forward that writes buffers in place (an exponential moving average, a counter, spectral norm's power
iteration): ONNX Runtime's graph computes the new values but cannot write them back, so ortcore refuses such a graph
(``BufferWriteError``, naming buffers and modules) and its repair runs the owning module in PyTorch, where the writes
happen as in eager. Before, the writes were silently lost: the buffers never moved, outputs left eager's from the
second step and gradients from the first that read a stale buffer."""

from __future__ import annotations

import copy

import pytest
import torch
from models import assert_grads_match
from torch import nn

from ortcore import ORTModule
from ortcore.errors import BufferWriteError

RTOL, ATOL = 1e-5, 1e-6


class MovingAverage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(3))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * h.mean(0))
                self.count += 1
        return h - self.avg


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ema = MovingAverage()
        self.bn = nn.BatchNorm1d(3)  # its running statistics are ortcore's to update: not a buffer write
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.ema(x)))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_buffer_writes_run_the_module_in_pytorch_and_match_eager(
    exporter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    # SGD, not Adam: the batch norm cancels ema.lin's bias, whose gradient is then rounding noise around 0, which
    # Adam would turn into steps of size lr in either direction.
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(8, 3)
        out, out_ref = ort(x), reference(x)
        torch.testing.assert_close(out, out_ref, rtol=RTOL, atol=ATOL)
        for (name, b), (_, b_ref) in zip(model.named_buffers(), reference.named_buffers()):
            torch.testing.assert_close(b, b_ref, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
        out.square().sum().backward()
        out_ref.square().sum().backward()
        assert_grads_match(model, reference, rtol=RTOL, atol=ATOL)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    assert [r.region for r in ort.repairs] == ["ema"]
    assert "BufferWriteError" in ort.repairs[0].reason and "'ema.avg'" in ort.repairs[0].reason
    assert ort.state_machine.counters.fallbacks == 0


class WritesItsOwnBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.copy_(x.detach().amax(0))
        return self.lin(x) * self.seen


def test_a_buffer_of_the_model_itself_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """No module below the model holds the write, so nothing can be routed: the error names the buffer."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    ort = ORTModule(WritesItsOwnBuffer())
    with pytest.raises(BufferWriteError, match="'seen'.*the model itself"):
        ort(torch.randn(4, 3))


def test_with_fallback_a_buffer_of_the_model_itself_trains_in_pytorch() -> None:
    torch.manual_seed(0)
    model = WritesItsOwnBuffer()
    reference = copy.deepcopy(model)
    ort = ORTModule(model)
    x = torch.randn(4, 3)
    with pytest.warns(RuntimeWarning, match="writes buffer"):
        out = ort(x)
    torch.testing.assert_close(out, reference(x))
    torch.testing.assert_close(model.seen, reference.seen)
    assert ort.state_machine.counters.fallbacks == 1
