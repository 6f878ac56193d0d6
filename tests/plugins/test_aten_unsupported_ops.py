"""aten_fallback, ops the exporter cannot express: exported as ATen nodes, run by PyTorch forward and backward.

A model using ``torch.cummax`` (two outputs: values, and integer indices that take no gradient) and
``torch.logcumsumexp`` on Linear outputs trains through ORTModule without falling back: the graph holds the ATen
nodes, and outputs, loss, every gradient and an AdamW loss curve match eager PyTorch. The ops are chosen by name
(``fallback_ops``, env ``ORTCORE_ATEN_FALLBACK_OPS``) or automatically (``auto``). With the plugin off, the model
falls back to PyTorch with a warning naming the op and the plugin.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from models import (
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    assert_ran_in_ort,
    check_step_and_training,
    make_batches,
    ort_and_torch,
)
from torch import nn

import ortcore
import ortcore_plugins.aten_fallback as plugin
from ortcore import DebugOptions, ORTModule
from ortcore.config import Config
from ortcore.errors import OptionError
from ortcore.host import PluginHost


class CumulativeNet(nn.Module):
    """Linear -> cummax (values and indices) -> logcumsumexp -> Linear; returns the output and cummax's indices."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.cummax(self.fc1(x), dim=1)
        return self.fc2(torch.logcumsumexp(values, dim=0)), indices


class TwoInputs(nn.Module):
    """``torch.logaddexp(a, b)``: both tensor inputs come from trained layers and need a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logaddexp(self.a(x), self.b(x))


class SpecialNet(nn.Module):
    """``torch.special.erfcx`` (no ONNX symbolic) between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.special.erfcx(self.fc1(x)))


def make_host(fallback_ops: Any = None, env: dict[str, str] | None = None) -> PluginHost:
    """A host with only this plugin and the given ``fallback_ops`` (None: the option unset)."""
    table = {"plugins": {"aten_fallback": {"fallback_ops": fallback_ops}}} if fallback_ops is not None else {}
    return PluginHost(Config.from_table(table, env=env or {}), autoload=False, plugins={"aten_fallback": plugin})


def aten_operators(path: Path) -> Counter:
    model = onnx.load(str(path))
    return Counter(
        next(a.s.decode() for a in n.attribute if a.name == "operator")
        for n in model.graph.node
        if n.op_type == "ATen" and n.domain == plugin.ATEN_DOMAIN
    )


def cumulative_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(7, 6, generator=gen), torch.randn(7, 3, generator=gen)


def cumulative_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    x, y = batch
    out, indices = model(x)
    return (out, indices), F.mse_loss(out, y)


@pytest.mark.parametrize("fallback_ops", [["cummax", "aten::logcumsumexp"], ["auto"]])
def test_unsupported_ops_train_in_ort_with_torch_parity(tmp_path: Path, fallback_ops: list[str]):
    torch.manual_seed(0)
    debug = DebugOptions(save_onnx=True, onnx_prefix="cum", save_path=str(tmp_path))
    ort, ref = ort_and_torch(CumulativeNet(), host=make_host(fallback_ops), debug_options=debug)
    batches = make_batches(cumulative_batch, 13)
    # Outputs (values and the integer indices), loss, every gradient on batches[0]; then 12 AdamW steps.
    check_step_and_training(ort, ref, batches, cumulative_step, steps=12)
    assert_ran_in_ort(ort, exports=1)
    assert ort.state_machine.counters.fallbacks == 0
    exported = aten_operators(tmp_path / "cum_pre_grad_training.onnx")
    assert exported == Counter({"cummax": 1, "logcumsumexp": 1}), exported
    built = aten_operators(tmp_path / "cum_training.onnx")
    backward = {op for op in built if op.startswith("ortcore_aten::fallback_grad__")}
    assert backward == {
        "ortcore_aten::fallback_grad__cummax__default__0",
        "ortcore_aten::fallback_grad__logcumsumexp__default__0",
    }, built


def test_a_new_batch_size_runs_the_same_graph_shapes():
    ort, ref = ort_and_torch(CumulativeNet(), host=make_host(["cummax", "logcumsumexp"]))
    for rows in (4, 9):
        x = torch.randn(rows, 6)
        assert_outputs_match(ort(x), ref(x))


def test_every_tensor_input_gets_its_gradient():
    ort, ref = ort_and_torch(TwoInputs(), host=make_host(["logaddexp"]))
    x = torch.randn(6, 5)
    out, out_ref = ort(x), ref(x)
    assert_outputs_match(out, out_ref)
    loss, loss_ref = (out**2).mean(), (out_ref**2).mean()
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)  # a.* and b.*: the vector-Jacobian product for each input
    assert_ran_in_ort(ort)


def test_auto_finds_a_special_function():
    ort, ref = ort_and_torch(SpecialNet(), host=make_host("auto"))
    x = torch.randn(6, 5)
    out, out_ref = ort(x), ref(x)
    assert_outputs_match(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    assert_grads_match(ort, ref)
    assert_ran_in_ort(ort)


def _real_warnings(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    ignored = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
    return [w for w in caught if not issubclass(w.category, ignored)]


def test_without_the_plugin_the_model_falls_back_naming_op_and_plugin(monkeypatch: pytest.MonkeyPatch):
    # op_routing exports unsupported ops as ATen nodes by default, aten_fallback repairs an export that failed on one;
    # without both, PyTorch runs.
    monkeypatch.setenv("ORTCORE_DISABLE_PLUGINS", "aten_fallback,op_routing,region_routing")
    reference = CumulativeNet()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(5, 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, indices = model(x)
    real = _real_warnings(caught)
    assert len(real) == 1, [str(w.message) for w in real]
    message = str(real[0].message)
    assert "aten::cummax" in message and "aten_fallback" in message, message
    assert model.state_machine.counters.fallbacks == 1
    out_ref, indices_ref = reference(x)
    assert_outputs_match((out, indices), (out_ref, indices_ref))


def test_without_fallback_ops_the_failed_export_is_repaired_naming_the_op(monkeypatch: pytest.MonkeyPatch):
    # No fallback_ops and op routing off: the export fails on cummax, and this plugin's repair lists it.
    monkeypatch.delenv("ORTCORE_ATEN_FALLBACK_OPS", raising=False)
    monkeypatch.setenv("ORTCORE_OP_ROUTING", "0")
    reference = CumulativeNet()
    model = ORTModule(copy.deepcopy(reference))
    x = torch.randn(5, 6)
    out, indices = model(x)
    assert model.state_machine.counters.fallbacks == 0
    assert model.state_machine.counters.repairs >= 1
    assert any("aten::cummax" in t.reason for t in model.state_machine.history if t.action == "repair")
    assert_outputs_match((out, indices), reference(x))


def test_fallback_disabled_error_names_the_option():
    # No plugin at all (so no repair): the core's error names the op and this plugin's option.
    host = PluginHost(Config.from_table({}, env={}), autoload=False, plugins={})
    model = ORTModule(CumulativeNet(), host=host, fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(ortcore.UnsupportedModelError, match=r"aten::cummax.*fallback_ops"):
        model(torch.randn(5, 6))


def test_env_var_chooses_the_ops():
    host = make_host(env={"ORTCORE_ATEN_FALLBACK_OPS": "cummax,logcumsumexp"})
    ort, ref = ort_and_torch(CumulativeNet(), host=host)
    x = torch.randn(5, 6)
    assert_outputs_match(ort(x), ref(x))
    assert_ran_in_ort(ort)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cummax, aten::cummin", ("aten::cummax", "aten::cummin")),
        (["auto", "cummax"], ("auto", "aten::cummax")),
        ("none", ()),
        ("", ()),
    ],
)
def test_option_parsing(value: Any, expected: tuple[str, ...]):
    assert plugin.parse_fallback_ops(value, "fallback_ops") == expected


@pytest.mark.parametrize("value", ["not_an_op_at_all", "prims::cummax", 3])
def test_option_rejects_what_is_not_an_aten_op(value: Any):
    with pytest.raises(OptionError):
        plugin.parse_fallback_ops(value, "fallback_ops")


class LaterInputOnly(nn.Module):
    """``logaddexp(x, fc(x))``: only the second input needs a gradient, which ORT 1.19.2 would not build."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.logaddexp(x, self.fc(x))


def _fallback_host(fallback_ops: list[str], exporter: str) -> PluginHost:
    """This plugin alone (op routing off), with the dynamo exporter's plugin where that route is asked for."""
    if exporter == "torchscript":
        return make_host(fallback_ops)
    pytest.importorskip("onnxscript")
    import ortcore_plugins.dynamo_exporter as dynamo_exporter

    table = {"plugins": {"aten_fallback": {"fallback_ops": fallback_ops}}}
    plugins = {"aten_fallback": plugin, "dynamo_exporter": dynamo_exporter}
    return PluginHost(Config.from_table(table, env={}), autoload=False, plugins=plugins)


def _one_step_matches(model: nn.Module, host: PluginHost, *inputs: torch.Tensor, exporter: str) -> ORTModule:
    """One step against eager: outputs, a loss weighing every element differently, every parameter's gradient."""
    ref = copy.deepcopy(model)
    wrapped = ORTModule(model, host=host, exporter=exporter, fallback_policy="FALLBACK_DISABLE")
    out, out_ref = wrapped(*inputs), ref(*inputs)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    weights = torch.linspace(-1.0, 2.0, out_ref.numel()).reshape(out_ref.shape)
    (out * weights).square().sum().backward()
    (out_ref * weights).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert wrapped.state_machine.counters.fallbacks == 0
    assert wrapped.state_machine.counters.repairs == 0, wrapped.state_machine.history
    return wrapped


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("listed", [["logaddexp"], ["auto"]])
def test_a_gradient_only_for_a_later_input_trains(exporter: str, listed: list[str]):
    # ORT differentiates an ATen node only when its first input needs a gradient: the input that does goes first.
    torch.manual_seed(0)
    wrapped = _one_step_matches(
        LaterInputOnly(), _fallback_host(listed, exporter), torch.randn(3, 4), exporter=exporter
    )
    if listed != ["auto"] or exporter == "torchscript":  # the dynamo exporter translates logaddexp itself
        assert "logaddexp" in wrapped.explain().routed()


class ScatterReduceSource(nn.Module):
    """``scatter_reduce(include_self=False)`` into a constant: only the source (input 3) needs a gradient."""

    def __init__(self, reduce: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.reduce = reduce

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        target = torch.ones(5, 4)
        return target.scatter_reduce(0, index, self.fc(x), self.reduce, include_self=False)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("reduce", ["sum", "mean", "amax", "prod"])
def test_scatter_reduce_without_self_trains(exporter: str, reduce: str):
    # Without op routing (which routes scatter_reduce itself), the fallback alone: the exporter refuses
    # include_self=False on the TorchScript route, and the source is not the first input.
    torch.manual_seed(0)
    index = torch.tensor([0, 1, 1, 3, 3, 3, 4]).view(7, 1).expand(7, 4)
    host = _fallback_host(["scatter_reduce"], exporter)
    wrapped = _one_step_matches(ScatterReduceSource(reduce), host, torch.randn(7, 4), index, exporter=exporter)
    assert "scatter_reduce" in wrapped.explain().routed()
