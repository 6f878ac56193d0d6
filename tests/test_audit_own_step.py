"""The gradient audit of the user's own first step (``ortcore_plugins.gradient_audit.own_step``).

The first step of a new session is audited as it runs: PyTorch's forward beside ORT's, PyTorch's side differentiated
in the user's backward with the user's own output gradients, no ORT step of the audit's own. Shown here against
PyTorch itself: a right model runs ORT's forward and backward once and trains as eager does; a planted wrong
gradient gives the first step PyTorch's gradients (equal to eager's, where ORT's are 1% off) and the next call is
audited by a step of its own and repaired; a planted wrong forward runs the call again (its outputs and batch-norm
statistics as eager's, updated once); gradient accumulation, a forward never differentiated, a second backward and
an engine that shards parameters each take the path stated. Tolerances: rtol 1e-5 / atol 1e-6 for what runs
in ORT against eager, exact equality where both sides are PyTorch's.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import onnx
import pytest
import torch
from models import builtin_plugins
from torch import nn

from ortcore import ORTModule
from ortcore.api import RuntimeInspector, StepWatch
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.session import TrainingSession
from ortcore.testing import make_host

NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 6, generator=generator) for _ in range(n)]


def _scale(value: str, factor: float):
    """A graph pass: the value ``value`` (a node output) times ``factor``."""

    def run(graph: onnx.ModelProto, context: Any) -> None:
        nodes = list(graph.graph.node)
        index = next(i for i, n in enumerate(nodes) if value in n.output)
        producer = nodes[index]
        producer.output[list(producer.output).index(value)] = value + "_unscaled"
        const = onnx.helper.make_node(
            "Constant", [], [value + "_s"], value=onnx.helper.make_tensor("s", onnx.TensorProto.FLOAT, [], [factor])
        )
        mul = onnx.helper.make_node("Mul", [value + "_unscaled", value + "_s"], [value], name=f"planted/{value}")
        del graph.graph.node[:]
        graph.graph.node.extend([*nodes[: index + 1], const, mul, *nodes[index + 1 :]])

    return run


def _fc2_output(graph: onnx.ModelProto, context: Any) -> None:
    """fc2's Gemm (the model's output) 1% off, while ORT computes it (not once fc2 is routed to PyTorch)."""
    node = next((n for n in graph.graph.node if n.op_type == "Gemm" and "fc2" in n.name), None)
    if node is not None:
        _scale(node.output[0], 1.01)(graph, context)


def _fc1_weight_gradient(graph: onnx.ModelProto, context: Any) -> None:
    """fc1.weight's gradient 1% off, while ORT's Gemm computes fc1 (not once fc1 is routed to PyTorch)."""
    if any(n.op_type == "Gemm" and "fc1" in n.name for n in graph.graph.node):
        _scale("fc1.weight_grad", 1.01)(graph, context)


def _plant(hook: str, run: Any) -> Any:
    return types.SimpleNamespace(**{hook: hookimpl(lambda: [GraphPass("planted", run=run)])})


def _builtins_and(extra: dict[str, Any]) -> Any:
    """The built-in plugins (the repairs route modules) and ``extra``; not grad_management, which hands gradients to
    torch during ORT's backward (off by default; such a step is audited by a step of the audit's own)."""
    return make_host({**builtin_plugins(without=("grad_management",)), **extra}, env=NO_FALLBACK)


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts ORT's forward and backward runs of training sessions."""
    counts = {"forward": 0, "backward": 0}
    forward, backward = TrainingSession.run_forward, TrainingSession.run_backward

    def run_forward(self, *args, **kwargs):
        counts["forward"] += 1
        return forward(self, *args, **kwargs)

    def run_backward(self, *args, **kwargs):
        counts["backward"] += 1
        return backward(self, *args, **kwargs)

    monkeypatch.setattr(TrainingSession, "run_forward", run_forward)
    monkeypatch.setattr(TrainingSession, "run_backward", run_backward)
    return counts


def _train(model: nn.Module, batches: list[torch.Tensor], lr: float = 0.1) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x in batches:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _assert_same_model(ort: nn.Module, eager: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    for (name, p), q in zip(ort.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), c in zip(ort.named_buffers(), eager.buffers()):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_the_first_step_is_audited_on_itself_with_one_ort_run(runs: dict[str, int]) -> None:
    eager = _model()
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=make_host({}, env=NO_FALLBACK))
    x = _batches(1)[0]
    wrapped(x).square().mean().backward()
    assert runs == {"forward": 1, "backward": 1}  # the step's own: no ORT step of the audit's
    (result,) = wrapped.gradient_audits
    assert result.status == "passed" and result.own_step, result.message()
    assert "the step itself" in result.message()
    # every output, the audit's loss (sum(output * g) with the user's g), every trained parameter
    assert result.compared == 1 + 1 + sum(1 for p in wrapped.parameters() if p.requires_grad)
    eager(x).square().mean().backward()
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_a_right_model_trains_as_eager_does_through_the_audited_step() -> None:
    eager = _model()
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=make_host({}, env=NO_FALLBACK))
    batches = _batches(4)
    ort_losses, eager_losses = _train(wrapped, batches), _train(eager, batches)
    torch.testing.assert_close(torch.tensor(ort_losses), torch.tensor(eager_losses), rtol=RTOL, atol=ATOL)
    _assert_same_model(wrapped.module, eager)
    assert [r.status for r in wrapped.gradient_audits] == ["passed"]


def test_a_wrong_gradient_takes_pytorchs_gradients_and_the_next_call_repairs(runs: dict[str, int]) -> None:
    """fc1.weight's gradient 1% off after ORT's gradient build: the first step's gradients are PyTorch's (equal to
    eager's), the second call is audited by a step of its own, which names the module and routes it; the curve over
    four SGD steps is eager's."""
    eager = _model()
    host = _builtins_and({"planted": _plant("ortcore_gradient_graph_passes", _fc1_weight_gradient)})
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=host)
    batches = _batches(4)
    x = batches[0]
    wrapped(x).square().mean().backward()
    eager(x).square().mean().backward()
    assert wrapped.gradient_audits == [] and wrapped.repairs == []  # decided by the next call's audit
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        # PyTorch's own gradients on both sides: ORT's fc1.weight gradient would be 1% off
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    for p in (*wrapped.parameters(), *eager.parameters()):
        p.grad = None
    ort_losses, eager_losses = _train(wrapped, batches), _train(eager, batches)
    torch.testing.assert_close(torch.tensor(ort_losses), torch.tensor(eager_losses), rtol=RTOL, atol=ATOL)
    _assert_same_model(wrapped.module, eager, rtol=1e-4, atol=1e-6)
    first, second = wrapped.gradient_audits
    assert first.status == "mismatch" and not first.own_step
    assert any(d.name == "fc1.weight" for d in first.differences), first.message()
    assert second.status == "passed"
    assert [r.region for r in wrapped.repairs] == ["fc1"]


def test_a_wrong_forward_runs_the_call_again_and_updates_batch_norm_once() -> None:
    """fc2's output 1% off in ORT's forward: the outputs are compared right after ORT's forward, the call runs again
    audited by a step of its own, which routes fc2: the first call returns eager's outputs, and the batch-norm
    statistics move once."""
    eager = _model()
    host = _builtins_and({"planted": _plant("ortcore_graph_passes", _fc2_output)})
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=host)
    x = _batches(1)[0]
    out = wrapped(x)
    expected = eager(x)
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(wrapped.module.norm.running_mean, eager.norm.running_mean, rtol=RTOL, atol=ATOL)
    assert int(wrapped.module.norm.num_batches_tracked) == 1
    out.square().mean().backward()
    expected.square().mean().backward()
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    statuses = [r.status for r in wrapped.gradient_audits]
    assert statuses == ["mismatch", "passed"], [r.message() for r in wrapped.gradient_audits]
    assert [r.region for r in wrapped.repairs] == ["fc2"]


def test_gradient_accumulation_audits_the_first_forward_once(runs: dict[str, int]) -> None:
    """Two forwards, then one backward of their sum: the first forward is watched, the second runs unchecked while
    the first is pending; one audit, gradients as eager's."""
    eager = _model()
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=make_host({}, env=NO_FALLBACK))
    a, b = _batches(2)
    (wrapped(a).square().mean() + wrapped(b).square().mean()).backward()
    (eager(a).square().mean() + eager(b).square().mean()).backward()
    assert runs == {"forward": 2, "backward": 2}
    assert [(r.status, r.own_step) for r in wrapped.gradient_audits] == [("passed", True)]
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_a_forward_never_differentiated_leaves_the_next_call_to_a_step_of_the_audits_own() -> None:
    wrapped = ORTModule(_model(), verify_gradients=True, host=make_host({}, env=NO_FALLBACK))
    a, b = _batches(2)
    wrapped(a)  # its outputs dropped: the watch goes with them
    assert wrapped.gradient_audits == []
    wrapped(b).square().mean().backward()
    (result,) = wrapped.gradient_audits
    assert result.status == "passed" and not result.own_step


def test_a_second_backward_through_the_audited_step_is_eagers() -> None:
    eager = _model()
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=make_host({}, env=NO_FALLBACK))
    x = _batches(1)[0]
    for model in (wrapped, eager):
        loss = model(x).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    assert [r.status for r in wrapped.gradient_audits] == ["passed"]
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


class _Sharding(RuntimeInspector):
    shards_parameters = True


def test_an_engine_that_shards_parameters_gets_a_step_of_the_audits_own(runs: dict[str, int]) -> None:
    seen: list[bool] = []

    @hookimpl(wrapper=True)
    def ortcore_check_first_step(step: Any) -> Any:
        seen.append(step.watchable)
        return (yield)

    plugin = types.SimpleNamespace(
        ortcore_runtime_inspectors=hookimpl(lambda: [_Sharding()]), ortcore_check_first_step=ortcore_check_first_step
    )
    wrapped = ORTModule(_model(), verify_gradients=True, host=make_host({"sharding": plugin}, env=NO_FALLBACK))
    wrapped(_batches(1)[0]).square().mean().backward()
    assert seen == [False]
    assert runs == {"forward": 2, "backward": 2}  # the audit's step, then the user's
    (result,) = wrapped.gradient_audits
    assert result.status == "passed" and not result.own_step


def test_a_watch_that_hands_over_gradients_gives_them_to_the_step() -> None:
    """The core's side of the contract (:class:`ortcore.api.StepWatch`), with a third-party check: the gradients a
    watch returns are the step's; the session is checked again at its next call, by a step of the check's own."""
    calls: list[tuple[str, bool]] = []

    class Halving(StepWatch):
        def gradients(self, output_grads, grads):
            return {name: g / 2 for name, g in grads.items() if g is not None}

    def check(step: Any) -> Any:
        calls.append(("check", step.watchable))
        return Halving() if step.watchable else None

    plugin = types.SimpleNamespace(ortcore_check_first_step=hookimpl(check))
    host = make_host({"halving": plugin}, env=NO_FALLBACK, audit=False)
    eager = _model()
    wrapped = ORTModule(copy.deepcopy(eager), verify_gradients=True, host=host)
    x = _batches(1)[0]
    wrapped(x).square().mean().backward()
    eager(x).square().mean().backward()
    for (name, p), q in zip(wrapped.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad / 2, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
    wrapped(x).square().mean().backward()
    assert calls == [("check", True), ("check", False)]
