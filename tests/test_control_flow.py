"""Control flow in a training graph: ONNX Runtime 1.19.2 aborts the whole process (a std::vector bounds assertion in its
gradient builder) building a training graph that holds an If/Loop/Scan node, even one no gradient crosses. ortcore
refuses such a graph before ORT sees it, naming the node and its module; inference graphs run control flow."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ortcore import GraphBuildError, ORTModule
from ortcore.config import Config
from ortcore.host import PluginHost
from ortcore_plugins.torchscript_exporter import TorchScriptExporter


def _unguarded() -> TorchScriptExporter:
    """The core's exporter without its diagonal guard: torch's diagonal export holds an If node."""
    exporter = TorchScriptExporter()
    del exporter.symbolics["::diagonal"]
    return exporter


class DiagonalOfTrained(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diagonal(x * self.w, 1, 1, 2)


class DiagonalOfInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w * torch.diagonal(x, 1, 1, 2)


@pytest.fixture
def no_routing() -> PluginHost:
    host = PluginHost(Config.from_table({}, env={"ORTCORE_OP_ROUTING": "0"}))
    yield host
    host.close()


@pytest.mark.parametrize("model_class", [DiagonalOfTrained, DiagonalOfInput])
def test_if_in_a_training_graph_is_refused_naming_node_and_module(no_routing: PluginHost, model_class: type):
    model = ORTModule(model_class(), host=no_routing, exporter=_unguarded(), fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(GraphBuildError, match=r"control flow: the If node '/module/If' \(in module the model itself\)"):
        model(torch.randn(3, 4, 5))


def test_if_on_a_gradient_path_falls_back_to_torch_by_default(no_routing: PluginHost):
    reference = DiagonalOfTrained()
    model = ORTModule(copy.deepcopy(reference), host=no_routing, exporter=_unguarded())
    x = torch.randn(3, 4, 5)
    with pytest.warns(RuntimeWarning, match="control flow"):
        model(x).sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.module.w.grad, reference.w.grad)


def test_if_in_an_inference_graph_runs_in_ort(no_routing: PluginHost):
    reference = DiagonalOfInput()
    model = ORTModule(
        copy.deepcopy(reference), host=no_routing, exporter=_unguarded(), fallback_policy="FALLBACK_DISABLE"
    )
    x = torch.randn(3, 4, 5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert model.state_machine.counters.fallbacks == 0
