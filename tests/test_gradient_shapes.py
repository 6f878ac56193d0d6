"""run_backward never returns a wrong-shaped gradient: with the forward's feed shapes, each gradient is checked.

torch's autograd silently sums a broadcastable wrong-shaped gradient down to the input's shape, so a wrong gradient
graph would train with wrong numbers; ortcore raises instead, naming the feed and the gradient node.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx
import pytest
import torch
from onnx import helper
from torch import nn

from ortcore import ORTModule
from ortcore.errors import GraphBuildError
from ortcore.graph_passes import GraphPass, PassContext
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginHost
from ortcore.session import TrainingSession
from ortcore.testing import make_host

NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


def _cut_bias_reduction(model: onnx.ModelProto, context: PassContext) -> None:
    """A deliberately wrong edit: ``Add(h, bias)`` becomes ``Where(True, bias, h)`` with ``bias`` broadcast.

    ORT's Where gradient does not reduce, so the bias's gradient keeps the output's shape ``[B, N]``.
    """
    graph = model.graph
    add = next(n for n in graph.node if n.op_type == "Add" and "bias" in n.input)
    other = next(name for name in add.input if name != "bias")
    true = helper.make_node(
        "Constant", [], ["always"], value=helper.make_tensor("t", onnx.TensorProto.BOOL, [], [True]), name="always"
    )
    add.op_type = "Where"
    del add.input[:]
    add.input.extend(["always", "bias", other])
    nodes = [true, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)


class _WrongGradientPlugin:
    @hookimpl
    def ortcore_graph_passes(self, config: Any) -> list[GraphPass]:
        return [GraphPass("test.cut_bias_reduction", run=_cut_bias_reduction)]


class Biased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * 2.0 + self.bias)


@pytest.fixture
def wrong_host() -> Iterator[PluginHost]:
    # The audit off: it would find the wrong gradient first; these tests are about the shape check behind it.
    host = make_host({"wrong_gradient": _WrongGradientPlugin()}, env={**NO_FALLBACK, "ORTCORE_VERIFY_GRADIENTS": "0"})
    yield host
    host.close()


def _session(model: ORTModule) -> TrainingSession:
    model(torch.randn(3, 4, requires_grad=True))  # builds the training session (no backward: it would raise)
    return model.state_machine.current[1]


def _forward_backward(session: TrainingSession, feeds: list[torch.Tensor], **kwargs: Any) -> list:
    outputs, state = session.run_forward(feeds)
    grads = [torch.ones_like(o) for o in outputs]
    return session.run_backward(grads, [(o.shape, o.dtype) for o in outputs], state, **kwargs)


def _feeds(model: nn.Module, session: TrainingSession, x: torch.Tensor) -> list[torch.Tensor]:
    named = {"x": x, **dict(model.named_parameters())}
    return [named[name] for name in session.feed_names]


def test_wrong_shaped_gradient_raises_naming_the_parameter_and_node(wrong_host: PluginHost) -> None:
    module = Biased()
    model = ORTModule(module, host=wrong_host)
    session = _session(model)
    x = torch.randn(3, 4, requires_grad=True)
    feeds = _feeds(module, session, x)
    with pytest.raises(GraphBuildError) as error:
        _forward_backward(session, feeds, feed_shapes=[f.shape for f in feeds])
    message = str(error.value)
    assert "parameter 'bias' has shape (3, 4), but 'bias' has shape (4,)" in message
    assert "gradient node" in message and "op Where" in message


def test_without_feed_shapes_the_wrong_gradient_is_not_checked(wrong_host: PluginHost) -> None:
    """What torch would see without the check: a [3, 4] gradient for a [4] parameter."""
    module = Biased()
    session = _session(ORTModule(module, host=wrong_host))
    feeds = _feeds(module, session, torch.randn(3, 4))
    grads = _forward_backward(session, feeds)
    assert grads[session.feed_names.index("bias")].shape == (3, 4)


def test_right_shaped_gradients_pass_the_check_unchanged() -> None:
    host = make_host({}, env=NO_FALLBACK)
    module = Biased()
    session = _session(ORTModule(module, host=host))
    x = torch.randn(3, 4, requires_grad=True)
    feeds = _feeds(module, session, x)
    checked = _forward_backward(session, feeds, feed_shapes=[f.shape for f in feeds])
    unchecked = _forward_backward(session, feeds)
    for a, b, feed in zip(checked, unchecked, feeds):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.shape == feed.shape
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    host.close()


def test_the_input_kind_is_named_for_a_user_input(wrong_host: PluginHost) -> None:
    """The message says 'input' for a model argument (here the broadcast ``bias`` is an argument)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4))

        def forward(self, bias: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.w * 2.0 + bias)

    module = Scaled()
    model = ORTModule(module, host=wrong_host)
    bias = torch.randn(4, requires_grad=True)
    model(bias)
    session = model.state_machine.current[1]
    feeds = [bias if name == "bias" else module.w for name in session.feed_names]
    with pytest.raises(GraphBuildError, match=r"input 'bias' has shape \(3, 4\), but 'bias' has shape \(4,\)"):
        _forward_backward(session, feeds, feed_shapes=[f.shape for f in feeds])


def test_ortmodule_backward_raises_on_a_wrong_shaped_gradient(wrong_host: PluginHost) -> None:
    """The check is on in every ORTModule backward: torch never sees the [3, 4] gradient of the [4] bias."""
    module = Biased()
    model = ORTModule(module, host=wrong_host)
    with pytest.raises(GraphBuildError, match=r"parameter 'bias' has shape \(3, 4\), but 'bias' has shape \(4,\)"):
        model(torch.randn(3, 4)).sum().backward()
    assert module.bias.grad is None
