"""Repair by routing: a failing stage of a new graph is located, the failing part moved to PyTorch, and the call
tried again; the result is always compared with PyTorch."""

from __future__ import annotations

import copy

import attrs
import onnx
import pytest
import torch
from models import FFTFilter
from torch import nn

from ortcore import GradientMismatchError, ORTModule
from ortcore.config import option
from ortcore.errors import GraphBuildError
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.options import parse_bool
from ortcore.repair import MAX_REPAIRS, Repair, locate, ops_named, trace_modules, with_ancestors
from ortcore.testing import assert_matches_torch
from ortcore_plugins import autograd_function, region_routing

RTOL, ATOL = 1e-4, 1e-5


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.filter = FFTFilter(16)
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.filter(x)))


class FNetLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.mix = Mixer()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(x)) + x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.l(x))


class ThreeBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bad, self.c = Block(), Block(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.bad(self.a(x)))


class RootRelu(nn.Module):
    """The wrong op is in the model's own forward: no submodule holds it, so no region can repair it."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(torch.relu(x))


class Corrupt:
    """A graph pass that makes ORT compute something else than PyTorch: every Relu of the modules named becomes a
    LeakyRelu (what a wrong symbolic or kernel looks like to the user: no error, other numbers)."""

    def __init__(self, scope: str):
        self.scope = scope

    @hookimpl
    def ortcore_graph_passes(self, config):
        def run(model: onnx.ModelProto, context) -> None:
            for node in model.graph.node:
                if node.op_type == "Relu" and self.scope in node.name:
                    node.op_type = "LeakyRelu"
                    node.attribute.append(onnx.helper.make_attribute("alpha", 0.5))

        return [GraphPass("test.corrupt", run=run)]


@attrs.frozen
class CrashingOptimizerOptions:
    enable: bool = option(True, parse_bool, "a graph optimizer that throws on this model")


class CrashingOptimizer:
    """A gradient-graph pass that throws (as ORT's compute optimizer does on some symbolic dimensions) while
    enabled, and offers to switch itself off."""

    @hookimpl
    def ortcore_options_class(self):
        return CrashingOptimizerOptions

    @hookimpl
    def ortcore_gradient_graph_passes(self, config):
        if not config.plugin_options("crashing").enable:
            return []

        def run(built, context) -> None:
            raise RuntimeError("upstream_gather_actors.cc:51 CreateNewShapeWithUpdatedDim: dim is not static")

        return [GraphPass("test.crashing_optimizer", run=run)]

    @hookimpl
    def ortcore_repairs(self, config, failure):
        if "upstream_gather_actors" not in failure.message:
            return None
        return [Repair("crashing optimizer off", plugin="crashing", options={"enable": False}, kind="switch")]


def _host(ortcore_host, *extra: tuple[str, object], table: dict | None = None):
    plugins = {"autograd_function": autograd_function, "region_routing": region_routing, **dict(extra)}
    return ortcore_host(plugins, table=table or {})


def test_complex_valued_code_is_repaired_into_the_innermost_real_region(ortcore_host):
    torch.manual_seed(0)
    model = FNetLike()
    wrapped = assert_matches_torch(model, (torch.randn(4, 16),), host=_host(ortcore_host), rtol=RTOL, atol=ATOL)
    assert [r.description for r in wrapped.repairs] == ["module mix.filter runs in PyTorch"]
    assert wrapped.repairs[0].reason.startswith("export failed")
    counters = wrapped.state_machine.counters
    assert (counters.repairs, counters.fallbacks, counters.exports) == (1, 0, 1)
    assert [t.action for t in wrapped.state_machine.history].count("repair") == 1


def test_repaired_model_trains_like_eager_and_reuses_its_graph(ortcore_host):
    torch.manual_seed(0)
    model = FNetLike()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, host=_host(ortcore_host))
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (wrapped, reference))
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(5, 16, generator=generator)
        losses = []
        for net, optimizer in ((wrapped, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    counters = wrapped.state_machine.counters
    assert (counters.exports, counters.builds, counters.repairs, counters.audits) == (1, 1, 1, 1)


def test_gradient_audit_mismatch_is_repaired_by_routing_the_module_it_names(ortcore_host):
    torch.manual_seed(0)
    model = ThreeBlocks()
    host = _host(ortcore_host, ("corrupt", Corrupt("/bad/")))
    wrapped = assert_matches_torch(model, (torch.randn(5, 8),), host=host, rtol=RTOL, atol=ATOL)
    assert [a.status for a in wrapped.gradient_audits] == ["mismatch", "passed"]
    assert [r.region for r in wrapped.repairs] == ["bad.act"]
    assert "audit failed at module bad.act" in wrapped.repairs[0].reason


def test_without_the_audit_the_wrong_graph_is_not_repaired(ortcore_host):
    """The audit is what finds a silently wrong graph: switched off, the numbers are ORT's (this is why it is on)."""
    torch.manual_seed(0)
    model = ThreeBlocks()
    reference = copy.deepcopy(model)
    host = _host(ortcore_host, ("corrupt", Corrupt("/bad/")), table={"verify_gradients": False})
    wrapped = ORTModule(model, host=host)
    x = torch.randn(5, 8)
    assert not torch.allclose(wrapped(x), reference(x), rtol=RTOL, atol=ATOL)
    assert wrapped.repairs == [] and wrapped.gradient_audits == []


def test_switching_an_optimizer_off_comes_before_any_region(ortcore_host):
    torch.manual_seed(0)
    host = _host(ortcore_host, ("crashing", CrashingOptimizer()))
    wrapped = assert_matches_torch(ThreeBlocks(), (torch.randn(3, 8),), host=host, rtol=RTOL, atol=ATOL)
    assert [(r.kind, r.description) for r in wrapped.repairs] == [("switch", "crashing optimizer off")]
    assert wrapped.ortcore_config.plugin_options("crashing").enable is False
    assert wrapped.repairs[0].reason.startswith("build failed")


def test_unrepairable_mismatch_raises_naming_what_was_tried(ortcore_host):
    torch.manual_seed(0)
    host = _host(ortcore_host, ("corrupt", Corrupt("Relu")))
    wrapped = ORTModule(RootRelu(), host=host, fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(GradientMismatchError) as raised:
        wrapped(torch.randn(4, 8))
    assert any("could not repair this by routing" in note for note in raised.value.__notes__)


def test_repairs_stop_after_the_bound(ortcore_host):
    offered = []

    class AlwaysFails:
        @hookimpl
        def ortcore_gradient_graph_passes(self, config):
            def run(built, context) -> None:
                raise RuntimeError("this graph never builds")

            return [GraphPass("test.always_fails", run=run)]

        @hookimpl
        def ortcore_repairs(self, config, failure):
            n = len(offered)
            offered.append(n)
            return [Repair(f"attempt {n}", plugin="region_routing", options={"modules": [f"m{n}"]}, kind="switch")]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            for i in range(MAX_REPAIRS + 3):
                self.add_module(f"m{i}", nn.Linear(2, 2))

        def forward(self, x):
            for module in self.children():
                x = module(x)
            return x

    host = _host(ortcore_host, ("fails", AlwaysFails()))
    wrapped = ORTModule(Net(), host=host, fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(GraphBuildError):
        wrapped(torch.randn(2, 2))
    assert len(wrapped.repairs) == MAX_REPAIRS
    assert wrapped.state_machine.counters.repairs == MAX_REPAIRS


def test_verify_gradients_is_on_by_default_and_off_by_env(ortcore_host, monkeypatch):
    torch.manual_seed(0)
    on = assert_matches_torch(nn.Linear(3, 2), (torch.randn(2, 3),), host=_host(ortcore_host))
    assert [a.status for a in on.gradient_audits] == ["passed"]
    monkeypatch.setenv("ORTCORE_VERIFY_GRADIENTS", "0")
    from ortcore.config import Config
    from ortcore.host import PluginHost

    off = assert_matches_torch(nn.Linear(3, 2), (torch.randn(2, 3),), host=PluginHost(Config.load(), autoload=False))
    assert off.gradient_audits == []


def test_failures_are_located_by_op_node_and_module():
    torch.manual_seed(0)
    model = FNetLike()
    trace = trace_modules(model, (torch.randn(2, 16),), {})
    assert "aten::fft_rfft" in trace.ops["mix.filter"]
    assert trace.complex_regions() == ["mix.filter"]
    failure = locate("export", "ScalarType ComplexFloat is an unexpected tensor scalar type", model, trace=trace)
    assert failure.modules == ("mix.filter", "mix")
    assert ops_named("Exporting the operator 'aten::fft_rfft' to ONNX opset version 17 is not supported") == (
        "aten::fft_rfft",
    )
    # "an operator with ..." names no op: a word after "operator" is not an op's name
    assert ops_named("ONNX export failed on an operator with unrecognized namespace lib::grouped_mm") == ()
    by_node = locate("build", "Node (/module/mix/proj/Gemm) failed", model)
    assert by_node.modules == ("mix.proj", "mix")
    assert with_ancestors(["a.b.c"]) == ("a.b.c", "a.b", "a")


def test_a_failing_node_names_the_aten_op_it_was_exported_from():
    """The dynamo route's nodes record their aten op (``namespace``); a build error names a forward node, a run error
    (``Name:'<node>'``) may name a node of ORT's gradient graph, which stands for the forward node it differentiates."""
    matmul = onnx.helper.make_node("MatMul", ["x", "w"], ["y"], name="node_MatMul_340")
    matmul.metadata_props.add(key="namespace", value=": transformers.Cvt/linear: aten.linear.default")
    col2im = onnx.helper.make_node("Col2Im", ["y", "s", "k"], ["z"], name="node_col2im")
    col2im.metadata_props.add(key="namespace", value=": torch.nn.Fold/col2im: aten.col2im.default")
    graph = onnx.helper.make_graph([matmul, col2im], "g", [], [])
    model = onnx.helper.make_model(graph)
    built = locate(
        "build",
        "The gradient builder has not been registered: Col2Im for node node_col2im",
        nn.Linear(2, 2),
        onnx_model=model,
    )
    assert built.ops == ("aten::col2im",) and "node_col2im" in built.nodes
    run = locate(
        "run",
        "Non-zero status code returned while running Gemm node. Name:'node_MatMul_340_Grad/Gemm_10/GemmTransposeFusion/'"
        " Status Message: GEMM: Dimension mismatch",
        nn.Linear(2, 2),
        onnx_model=model,
    )
    assert run.ops == ("aten::linear",)
    assert run.nodes[0] == "node_MatMul_340_Grad/Gemm_10/GemmTransposeFusion/"


def test_dynamo_route_repairs_complex_code_into_a_region(ortcore_host):
    from ortcore_plugins import dynamo_exporter

    torch.manual_seed(0)
    host = _host(ortcore_host, ("dynamo_exporter", dynamo_exporter), table={"exporter": "dynamo"})
    wrapped = assert_matches_torch(FNetLike(), (torch.randn(4, 16),), host=host, rtol=RTOL, atol=ATOL)
    assert [r.region for r in wrapped.repairs] == ["mix.filter"]
    assert wrapped.state_machine.counters.fallbacks == 0


def test_a_second_process_applies_the_repairs_the_first_found(ortcore_host, tmp_path):
    from ortcore_plugins import export_cache

    cache = {"plugins": {"export_cache": {"dir": str(tmp_path / "cache")}}}
    torch.manual_seed(0)
    model = FNetLike()
    first = ORTModule(copy.deepcopy(model), host=_host(ortcore_host, ("export_cache", export_cache), table=cache))
    first(torch.randn(2, 16)).sum().backward()
    assert "export failed" in first.repairs[0].reason
    assert list((tmp_path / "cache").glob("*.repairs.json"))
    # A fresh host and model stand for the next process: the repair is applied before the first export.
    host = _host(ortcore_host, ("export_cache", export_cache), table=cache)
    second = assert_matches_torch(model, (torch.randn(3, 16),), host=host, rtol=RTOL, atol=ATOL)
    assert [r.region for r in second.repairs] == ["mix.filter"]
    assert second.state_machine.history[0].action == "repair"
    assert "found by an earlier process" in second.state_machine.history[0].reason
    assert [a.status for a in second.gradient_audits] == ["passed"]


def test_a_third_party_store_of_repairs_gets_them_and_serves_them(ortcore_host):
    stored: dict[str, list[dict]] = {}

    class MemoryStore:
        @hookimpl
        def ortcore_load_repairs(self, config, module, fingerprint):
            return stored.get(fingerprint)

        @hookimpl
        def ortcore_repairs_found(self, config, module, fingerprint, repairs):
            stored[fingerprint] = repairs

    torch.manual_seed(0)
    model = ThreeBlocks()
    x = torch.randn(4, 8)
    first = ORTModule(copy.deepcopy(model), host=_host(ortcore_host, ("store", MemoryStore()), ("c", Corrupt("/bad/"))))
    first(x).sum().backward()
    ((fingerprint, repairs),) = stored.items()
    assert [r["region"] for r in repairs] == ["bad.act"] and "audit failed" in repairs[0]["reason"]
    host = _host(ortcore_host, ("store", MemoryStore()), ("c", Corrupt("/bad/")))
    second = assert_matches_torch(model, (x,), host=host, rtol=RTOL, atol=ATOL)
    assert [a.status for a in second.gradient_audits] == ["passed"]  # no mismatch to find: repaired from the start
    assert second.state_machine.counters.exports == 1


def test_explain_says_what_runs_in_pytorch_and_why(ortcore_host):
    torch.manual_seed(0)
    wrapped = ORTModule(FNetLike(), host=_host(ortcore_host))
    wrapped(torch.randn(2, 16)).sum().backward()
    explanation = wrapped.explain()
    assert explanation.routed()["RegionFunction"].endswith("(region_routing)")
    assert any(r["runs_on"] == "ORT" and r["op"] == "Gemm" for r in explanation)
    assert "runs in PyTorch: module mix.filter, because export failed" in str(explanation)


class _Notes:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    @hookimpl
    def ortcore_explain_notes(self, module):
        if self.fail:
            raise RuntimeError("broken note")
        return [f"graph of {type(module.module).__name__}: {len(module.state_machine.current[1].model.graph.node)} nodes"]


def test_explain_prints_what_plugins_note_and_survives_a_failing_note(ortcore_host, caplog):
    torch.manual_seed(0)
    for fail in (False, True):
        wrapped = ORTModule(nn.Linear(4, 2), host=_host(ortcore_host, ("notes", _Notes(fail))))
        wrapped(torch.randn(3, 4)).sum().backward()
        text = str(wrapped.explain())
        assert text.startswith("op")  # the table first
        assert ("graph of Linear:" in text.splitlines()[-1]) is not fail, text
    assert "explain: a plugin's notes failed (PluginError" in caplog.text or "broken note" in caplog.text


class RunningMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cummax(self.proj(x), dim=1).values


def test_an_op_the_exporter_cannot_write_is_repaired_into_an_aten_node_before_any_region(ortcore_host):
    from ortcore_plugins import aten_fallback

    torch.manual_seed(0)
    host = _host(ortcore_host, ("aten_fallback", aten_fallback))  # no op_routing: the repair is what routes it
    wrapped = assert_matches_torch(RunningMax(), (torch.randn(3, 5, 6),), host=host, rtol=RTOL, atol=ATOL)
    assert [(r.kind, r.op) for r in wrapped.repairs] == [("op", "aten::cummax")]
    assert wrapped.ortcore_config.plugin_options("aten_fallback").fallback_ops == ("aten::cummax",)
    assert "cummax" in wrapped.explain().routed()


def test_locating_leaves_torch_cond_working_for_the_process():
    """The eager run that locates a failure records torch functions, not dispatched ops: a dispatch mode around
    torch.cond leaves torch.compile's state broken, and every later torch.cond in the process fails."""

    def gated(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: torch.relu(t) * 2, lambda t: torch.tanh(t) - 1, (x,))

    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return gated(self.fc(x))

    model = Gated()
    x = torch.randn(2, 3)
    trace = trace_modules(model, (x,), {})
    assert trace.ran and "aten::linear" in trace.ops["fc"]
    torch.testing.assert_close(
        gated(x), torch.cond(x.sum() > 0, lambda t: torch.relu(t) * 2, lambda t: torch.tanh(t) - 1, (x,))
    )


class TwoMixers(nn.Module):
    """The same complex-valued block in two layers: one failure, repeated."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Mixer(), Mixer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_failure_repeated_in_every_layer_is_one_repair_of_every_innermost_module(ortcore_host):
    torch.manual_seed(0)
    wrapped = assert_matches_torch(TwoMixers(), (torch.randn(3, 16),), host=_host(ortcore_host), rtol=RTOL, atol=ATOL)
    assert [r.description for r in wrapped.repairs] == ["modules layers.0.filter, layers.1.filter run in PyTorch"]
    assert wrapped.ortcore_config.plugin_options("region_routing").modules == ("layers.0.filter", "layers.1.filter")


def test_a_failure_in_the_models_own_forward_says_how_to_make_it_routable(ortcore_host):
    """Complex code in the root's forward has no module below the model to run in PyTorch: the error says to move it
    into a submodule; a traceback frame or an ancestor found with the failure never makes the whole model a region."""
    model = FFTFilter(16)
    wrapped = ORTModule(model, host=_host(ortcore_host), fallback_policy="FALLBACK_DISABLE")
    with pytest.raises(Exception) as raised:
        wrapped(torch.randn(2, 16))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "could not repair this by routing" in notes
    assert "moved into a submodule" in notes
    assert wrapped.repairs == []


def test_only_the_innermost_of_the_modules_found_is_routed_first():
    """Traceback frames name every module on the call path (``mix``, ``mix.filter``): the innermost is the one that
    holds the failure; the others are enclosing candidates, tried later."""
    model = FNetLike()
    error = RuntimeError("boom")
    error.modules = ["mix", "mix.filter"]
    failure = locate("export", error, model)
    assert failure.innermost == ("mix.filter",)
    assert failure.modules == ("mix.filter", "mix")
