"""No tensor a call returned changes after the call: not in the backward, not at the optimizer step.

ORT hands each forward output to torch as its own buffer (DLPack, no copy). Three kinds of output could be written
afterwards, and the session copies exactly those (``ortcore.output_integrity``, ``TrainingSession.copy_reasons``):
views (a buffer ORT frees after the forward), outputs computed in place in another value's buffer (freed too: a
time-series model's returned ``scale``), and outputs a backward kernel may overwrite in place (a returned softmax).
Outputs that alias an input or a parameter are handed out as such, as PyTorch does (they change at the optimizer step
in both). Each model here is compared with eager PyTorch on every step (outputs, loss, every gradient), the returned
tensors bitwise before and after ``backward()`` and after ``optimizer.step()``; one test removes the copies and sees
ORT overwrite the outputs, so the checks are not vacuous.
"""

from __future__ import annotations

import copy

import onnx
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

import ortcore.api
import ortcore.session
from ortcore import ORTModule
from ortcore.output_integrity import IN_PLACE, REUSED, VIEW, WRITTEN_IN_BACKWARD, outputs_at_risk

EXPORTERS = ["torchscript", "dynamo"]
RTOL, ATOL = 1e-5, 1e-6  # float32 parity with eager on these small models
STEPS = 3


class MeanScaled(nn.Module):
    """A forecaster's mean scaling (as Hugging Face's time-series models do it), returning the scale with the loss:
    ORT computes the clamp in place in the ``where``'s buffer, which it frees after the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, data: torch.Tensor, observed: torch.Tensor):
        ts_sum = (data * observed).abs().sum(1, keepdim=True)
        num_observed = observed.sum(1, keepdim=True)
        scale = ts_sum / torch.clamp(num_observed, min=1)
        default = torch.squeeze(ts_sum.sum(0) / torch.clamp(num_observed.sum(0), min=1))
        scale = torch.where(num_observed > 0, scale, default * torch.ones_like(scale))
        scale = torch.clamp(scale, min=1e-10)
        scaled = data / scale
        h = self.out(torch.relu(self.fc(scaled.unsqueeze(-1)))).squeeze(-1)
        return ((h - scaled) ** 2).mean(), scale

    @staticmethod
    def batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return torch.rand(4, 15, generator=gen) + 1, torch.ones(4, 15)


class SoftmaxReturned(nn.Module):
    """Returns attention-like probabilities that the backward reads (softmax's gradient): ORT's backward may compute
    in their buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor):
        p = torch.softmax(self.fc(x), -1)
        return (p * p).sum(), p

    @staticmethod
    def batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(32, 64, generator=gen),)


class Aliases(nn.Module):
    """Every other kind of returned tensor: a view of an intermediate, an output returned twice and viewed, the input
    itself and a view of it, a parameter (changed by the optimizer in PyTorch too), a tanh kept for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.fc(x))
        loss = (h * h).mean() + h.sum(0).square().mean()
        return loss, h, h, h.t(), h.reshape(-1), x, x.view(-1), self.fc.bias, (h * 2).unsqueeze(-1)

    @staticmethod
    def batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(5, 8, generator=gen),)


class BatchNormed(nn.Module):
    """A convolution, batch norm and ReLU returning its features: the core reads each batch norm's input (an extra
    forward output) for the running statistics as soon as the forward returns, so that one needs no copy."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor):
        features = torch.relu(self.bn(self.conv(x)))
        return features.square().mean(), features

    @staticmethod
    def batch(gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        return (torch.randn(4, 3, 10, 10, generator=gen),)


MODELS = {
    "mean_scaled": MeanScaled,
    "softmax_returned": SoftmaxReturned,
    "aliases": Aliases,
    "batch_normed": BatchNormed,
}


def _wrap(model: nn.Module, exporter: str, **kwargs) -> ORTModule:
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    return ORTModule(model, exporter=exporter, fallback_policy="FALLBACK_DISABLE", **kwargs)


def _session(model: ORTModule):
    sessions = [s for _, s in model.state_machine._sessions.values() if s.request.build_gradient]
    assert len(sessions) == 1, f"expected one training session, got {len(sessions)}"
    return sessions[0]


def _snapshot(outputs) -> list[torch.Tensor]:
    return [t.detach().clone() for t in outputs]


def _changed(outputs, snapshot) -> list[int]:
    return [i for i, (t, s) in enumerate(zip(outputs, snapshot)) if not torch.equal(t.detach(), s)]


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", list(MODELS))
def test_returned_tensors_never_change_after_the_call(name: str, exporter: str) -> None:
    """Outputs, loss, gradients and buffers as eager's on each of three SGD steps; each returned tensor bitwise the same after
    ``backward()``, and after ``optimizer.step()`` (and after the later calls) changed exactly where eager's changed
    (a returned parameter)."""
    torch.manual_seed(0)
    reference = MODELS[name]()
    model = _wrap(copy.deepcopy(reference), exporter)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        batch = MODELS[name].batch(gen)
        outputs, expected = model(*batch), reference(*batch)
        torch.testing.assert_close(outputs, expected, rtol=RTOL, atol=ATOL)
        mine, theirs = _snapshot(outputs), _snapshot(expected)
        outputs[0].backward()
        expected[0].backward()
        assert _changed(outputs, mine) == [], f"step {step}: returned tensors changed in backward()"
        for (pname, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=pname: f"{n}: {m}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        assert _changed(outputs, mine) == _changed(expected, theirs), f"step {step}: after optimizer.step()"
        torch.testing.assert_close(outputs, expected, rtol=RTOL, atol=ATOL)
        for (bname, b), c in zip(model.named_buffers(), reference.buffers()):
            torch.testing.assert_close(b, c, rtol=RTOL, atol=ATOL, msg=lambda m, n=bname: f"buffer {n}: {m}")
        if step == 0:
            first = (outputs, mine, expected, theirs)
    # The first call's tensors after every later call: unchanged where eager's are.
    outputs, mine, expected, theirs = first
    assert _changed(outputs, mine) == _changed(expected, theirs), "the first call's outputs after later calls"
    assert model.fallback_reason is None


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize(
    ("name", "output", "reason"), [("mean_scaled", 1, IN_PLACE), ("softmax_returned", 1, WRITTEN_IN_BACKWARD)]
)
def test_without_the_copy_ort_overwrites_the_output(
    monkeypatch: pytest.MonkeyPatch, name: str, output: int, reason: str, exporter: str
) -> None:
    """The same models with the copies removed: ORT's backward writes into the returned tensor (so the test above
    can fail), and the session names why the output is copied."""
    found: dict[int, str] = {}

    def nothing_at_risk(executed: onnx.ModelProto, *args, **kwargs) -> dict[int, str]:
        found.update(outputs_at_risk(executed, *args, **kwargs))
        return {}

    monkeypatch.setattr(ortcore.session, "outputs_at_risk", nothing_at_risk)
    torch.manual_seed(0)
    model = _wrap(MODELS[name](), exporter, verify_gradients=False)
    outputs = model(*MODELS[name].batch(torch.Generator().manual_seed(1)))
    snapshot = _snapshot(outputs)
    outputs[0].backward()
    assert output in _changed(outputs, snapshot), "ORT no longer overwrites this output: find another planted case"
    assert found.get(output) == reason, found


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_session_names_its_copies_and_aliases_stay_aliases(exporter: str) -> None:
    """``ortcore.api.copied_outputs`` lists each copied output by name with its reason; the returned input is the
    input's memory, as in PyTorch (no copy); views of intermediates are copies."""
    torch.manual_seed(0)
    model = _wrap(Aliases(), exporter)
    (x,) = Aliases.batch(torch.Generator().manual_seed(1))
    outputs = model(x)
    session = _session(model)
    copied = ortcore.api.copied_outputs(session)
    assert set(copied.values()) <= {VIEW, IN_PLACE, WRITTEN_IN_BACKWARD}
    assert set(copied.values()) >= {
        VIEW,
        WRITTEN_IN_BACKWARD,
    }  # h.reshape(-1) and (h * 2).unsqueeze(-1); the tanh kept for the backward
    assert set(copied) == {session.user_output_names[i] for i in session.copied_outputs}
    assert outputs[5].data_ptr() == x.data_ptr(), "the returned input should be the input's memory, as in PyTorch"
    for k in (1, 3, 4, 8):  # h (the tanh kept for the backward), h.t(), h.reshape(-1), (h * 2).unsqueeze(-1)
        assert outputs[k].data_ptr() != x.data_ptr()
    assert ortcore.api.copied_outputs(object()) == {}  # not a training session: nothing copied


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_core_s_own_outputs_read_at_once_are_not_copied(exporter: str) -> None:
    """A batch norm's input, an extra forward output the core reads for the running statistics right after the
    forward, is copied only if ORT could free it before then (never for the backward's sake)."""
    model = _wrap(BatchNormed(), exporter)
    model(*BatchNormed.batch(torch.Generator().manual_seed(1)))[0].backward()
    assert not any("batch_norm_input" in name for name in ortcore.api.copied_outputs(_session(model)))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_an_output_at_no_risk_is_not_copied(exporter: str) -> None:
    """A classifier returning its logits (a Gemm ORT allocates for them, read by nothing else in ORT) is handed over
    without a copy: the copies cost only where ORT could write."""

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = _wrap(Logits(), exporter)
    model(torch.randn(3, 8)).sum().backward()
    assert _session(model).copied_outputs == ()


# -- the analysis on hand-made graphs ------------------------------------------------------------------------------


def _graph(nodes: list, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """A forward (``x`` -> ... -> YieldOp) and backward graph; every value a float32 tensor of its given shape."""
    infos = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in shapes.items() if n != "x"]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shapes["x"])], [])
    graph.value_info.extend(infos)
    return helper.make_model(graph)


def _yield(*names: str) -> onnx.NodeProto:
    return helper.make_node("YieldOp", list(names), [f"{n}_grad" for n in names], domain="com.microsoft")


def test_the_analysis_rules() -> None:
    """Only the YieldOp reads a value computed in place: ORT's guard spares it. Another reader: at risk. A product
    (MatMul) never computes in place; a different size cannot share a buffer; a view is always at risk, even of the
    caller's input (it holds no reference to it), the caller's input itself never; a backward reader may write into
    a kept output."""
    shapes = {"x": [2, 3], "a": [2, 3], "b": [2, 3], "c": [2, 3], "m": [2, 3], "v": [3, 2], "w": [6], "s": [1]}
    spared = _graph(
        [helper.make_node("Exp", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]), _yield("b")], shapes
    )
    assert outputs_at_risk(spared) == {}
    read_again = _graph(
        [
            helper.make_node("Exp", ["x"], ["a"]),
            helper.make_node("Relu", ["a"], ["b"]),
            helper.make_node("ReduceSum", ["b"], ["s"]),
            _yield("s", "b"),
        ],
        shapes,
    )
    assert outputs_at_risk(read_again) == {1: IN_PLACE}
    product = _graph(
        [
            helper.make_node("Exp", ["x"], ["a"]),
            helper.make_node("MatMul", ["a", "a"], ["m"]),
            helper.make_node("ReduceSum", ["m"], ["s"]),
            _yield("s", "m"),
        ],
        shapes,
    )
    assert outputs_at_risk(product) == {}
    views = _graph(
        [
            helper.make_node("Exp", ["x"], ["a"]),
            helper.make_node("Transpose", ["a"], ["v"]),
            helper.make_node("Reshape", ["x"], ["w"]),
            helper.make_node("Reshape", ["a"], ["c"]),
            _yield("v", "w", "c", "x"),
        ],
        shapes,
    )
    assert outputs_at_risk(views) == {1: VIEW, 2: VIEW}
    kept = _graph(
        [helper.make_node("Exp", ["x"], ["a"]), _yield("a"), helper.make_node("Mul", ["a_grad", "a"], ["x_grad"])],
        {**shapes, "a_grad": [2, 3], "x_grad": [2, 3]},
    )
    assert outputs_at_risk(kept) == {0: WRITTEN_IN_BACKWARD}
    resized = _graph(
        [helper.make_node("Exp", ["x"], ["a"]), _yield("a"), helper.make_node("ReduceSum", ["a"], ["s"])], shapes
    )
    assert outputs_at_risk(resized) == {}
    # With ORT's memory reuse on, any buffer ORT allocated may go to a later value once its last reader ran.
    assert outputs_at_risk(resized, memory_reuse=True) == {0: REUSED}
    assert outputs_at_risk(views, memory_reuse=True) == {0: REUSED, 1: VIEW, 2: VIEW}
    assert outputs_at_risk(_graph([helper.make_node("Exp", ["x"], ["a"])], shapes)) == {}  # no YieldOp: inference
    # An output the core reads before the backward runs (a batch norm's input) needs no copy for the backward's sake.
    assert outputs_at_risk(kept, read_before_backward=[0]) == {}
    assert outputs_at_risk(views, read_before_backward=[2]) == {1: VIEW, 2: VIEW}
