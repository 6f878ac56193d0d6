"""The gradient audit names a returned output that changes after the call ("output X changed after the call").

ONNX Runtime keeps some forward values for its backward; one handed to the user without a copy is overwritten when
the backward reuses its buffer. The audit copies every output when the forward returns it and compares after its
backward. The overwrite is planted here (the session's backward writes into the output the forward returned, as
ORT's buffer reuse does), so the check cannot pass vacuously; the same model without the plant passes. The first
step is audited as it runs (the change seen at its backward), the second by a step of the audit's own, which names
the output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ortcore import GradientMismatchError, ORTModule
from ortcore.session import TrainingSession
from ortcore.testing import make_host
from ortcore_plugins.gradient_audit.audit import CHANGED_AFTER_CALL, changed_after_call

NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


class Scaled(nn.Module):
    """Returns a prediction and the scale it normalised by, in a dict (as time-series forecasters do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = x.abs().mean(1, keepdim=True) + 1.0
        return {"prediction": self.fc(x / scale), "scale": scale}


def _plant_overwrite(monkeypatch: pytest.MonkeyPatch, output: int) -> list[int]:
    """Make every session's backward write into output ``output`` of its forward; returns a list counting writes."""
    forward, backward = TrainingSession.run_forward, TrainingSession.run_backward
    last: dict[int, torch.Tensor] = {}
    writes: list[int] = []

    def run_forward(self, feeds):
        outputs, state = forward(self, feeds)
        last[id(state)] = outputs[output]
        return outputs, state

    def run_backward(self, grad_outputs, meta, state, *args, **kwargs):
        target = last.pop(id(state), None)
        grads = backward(self, grad_outputs, meta, state, *args, **kwargs)
        if target is not None:
            target.mul_(-0.5).add_(0.25)  # a reused buffer: other numbers
            writes.append(1)
        return grads

    monkeypatch.setattr(TrainingSession, "run_forward", run_forward)
    monkeypatch.setattr(TrainingSession, "run_backward", run_backward)
    return writes


def test_an_output_overwritten_by_the_backward_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Scaled()
    host = make_host({}, env=NO_FALLBACK)
    writes = _plant_overwrite(monkeypatch, output=1)  # outputs flatten in key order: prediction, scale
    wrapped = ORTModule(model, verify_gradients=True, fallback_policy="FALLBACK_DISABLE", host=host)
    # The first step is audited as it runs: its outputs differ from PyTorch's after the backward, so it takes
    # PyTorch's gradients and the next call is audited by a step of its own, which names the output.
    wrapped(torch.randn(4, 6))["prediction"].sum().backward()
    assert writes, "the plant never ran: the test would show nothing"
    assert wrapped.gradient_audits == []
    with pytest.raises(GradientMismatchError) as caught:
        wrapped(torch.randn(4, 6))
    message = str(caught.value)
    assert "output 'output.scale' changed after the call" in message, message
    assert "no single module named" not in message
    result = caught.value.result
    changed = [d for d in result.differences if d.kind == CHANGED_AFTER_CALL]
    assert [d.name for d in changed] == ["output.scale"]
    # The comparison used the values the forward returned: nothing else differs from PyTorch.
    assert [d for d in result.differences if d.kind != CHANGED_AFTER_CALL] == []
    assert result.location is None and caught.value.module is None  # no module to route: the outputs are ortcore's
    host.close()


def test_the_same_model_passes_without_the_overwrite() -> None:
    torch.manual_seed(0)
    host = make_host({}, env=NO_FALLBACK)
    wrapped = ORTModule(Scaled(), verify_gradients=True, fallback_policy="FALLBACK_DISABLE", host=host)
    x = torch.randn(4, 6)
    out = wrapped(x)
    scale = out["scale"].clone()
    out["prediction"].square().sum().backward()
    assert [r.status for r in wrapped.gradient_audits] == ["passed"]
    assert torch.equal(out["scale"], scale)
    host.close()


def test_changed_after_call_compares_bit_for_bit() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert changed_after_call([a.clone()], [a]) == []  # NaN at the same place is unchanged
    b = a.clone()
    b[2] = 3.5
    assert changed_after_call([a], [b]) == [(0, 0.5)]
    c = a.clone()
    c[0] = float("nan")
    assert changed_after_call([a], [c])[0][1] == float("inf")
    ints = torch.tensor([1, 2, 3])
    assert changed_after_call([ints], [torch.tensor([1, 0, 0])]) == [(0, 2.0)]
    assert changed_after_call([ints], [ints.clone()]) == []
