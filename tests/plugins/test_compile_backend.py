"""compile_backend: ``torch.compile(model, backend="ortcore")`` trains with eager's gradients, ORT running each graph
dynamo captured, through graph breaks, recompiles and ``no_grad``; registered where torch looks for backends."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import adamw, assert_grads_match, assert_losses_match
from torch import nn

import ortcore_plugins.compile_backend as plugin


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    plugin.reset()
    yield
    torch._dynamo.reset()


class Breaks(nn.Module):
    """Python torch.compile cannot capture: ``.item()`` and a branch on its value, a print, a data-dependent shape."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.a(x)))
        if h.sum().item() > 0:  # value-dependent branch
            h = h * 2
        print("a Python side effect")
        kept = h[h.abs() > 0.5]  # data-dependent shape
        return self.b(h).square().mean() + kept.sum() * 1e-3


def _train(model: nn.Module, batches: list[torch.Tensor]) -> list[float]:
    optimizer = adamw(model)
    losses = []
    for x in batches:
        optimizer.zero_grad()
        loss = model(x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _batches(n: int, rows: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randn(rows, 8, generator=gen) for _ in range(n)]


def _one_step_as_eager(**compile_kwargs: Any) -> tuple[Any, nn.Module]:
    """``Breaks`` compiled with ``backend="ortcore"`` and eager from the same weights: the loss and every gradient.
    Returns the compiled model and the eager one."""
    torch.manual_seed(0)
    model = Breaks()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ortcore", **compile_kwargs)
    x = _batches(1)[0]
    loss, loss_ref = compiled(x), ref(x)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(model, ref)
    return compiled, ref


def test_a_model_with_graph_breaks_trains_with_eagers_gradients_in_ort(capsys) -> None:
    _one_step_as_eager()
    assert capsys.readouterr().out.count("a Python side effect") == 2
    graphs = plugin.compiled_graphs()
    assert len(graphs) >= 2  # the breaks split the model
    for graph in graphs:
        assert graph.reason_in_pytorch is None, graph.describe()
        assert graph.ortmodule.state_machine.counters.exports == 1


def test_a_loss_curve_over_adamw_steps_is_eagers() -> None:
    torch.manual_seed(0)
    model = Breaks()
    ref = copy.deepcopy(model)
    curve = _train(torch.compile(model, backend="ortcore"), _batches(5))
    curve_ref = _train(ref, _batches(5))
    for step, (a, b) in enumerate(zip(curve, curve_ref)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {a} vs {b}"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_no_grad_runs_an_inference_graph() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    compiled = torch.compile(model, backend="ortcore")
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    (graph,) = plugin.compiled_graphs()
    _, session = graph.ortmodule.state_machine.current
    assert not session.request.build_gradient


def test_sizes_dynamo_marks_dynamic_are_a_dimension_of_the_ort_graph() -> None:
    """A recompile is dynamo's (a new graph module, a new ORTModule); within one, a symbolic size is read from the
    tensor's shape: one static export, then one graph dynamic in that dimension for every later size."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ortcore", dynamic=True)
    for rows in (5, 7, 9, 4):
        x = torch.randn(rows, 8)
        out, out_ref = compiled(x), ref(x)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
        out.sum().backward()
        out_ref.sum().backward()
    assert_grads_match(model, ref)
    (graph,) = plugin.compiled_graphs()
    assert graph.ortmodule.state_machine.counters.exports == 2


def test_a_recompile_builds_a_new_ort_graph() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    compiled = torch.compile(model, backend="ortcore", dynamic=False)
    compiled(torch.randn(3, 8)).sum().backward()
    compiled(torch.randn(5, 8)).sum().backward()  # a guard on the size fails: dynamo compiles again
    assert len(plugin.compiled_graphs()) == 2


def test_options_reach_the_ortmodules_and_a_bad_one_names_what_is_allowed() -> None:
    model = nn.Linear(4, 2)
    compiled = torch.compile(model, backend="ortcore", options={"verify_gradients": False})
    compiled(torch.randn(2, 4)).sum().backward()
    (graph,) = plugin.compiled_graphs()
    assert graph.options == {"verify_gradients": False}
    assert graph.ortmodule.state_machine.counters.audits == 0
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option 'verify'; allowed: design, exporter, fallback_policy"):
        torch.compile(nn.Linear(4, 2), backend="ortcore", options={"verify": False})(torch.randn(2, 4))


def test_switched_off_the_backend_says_how_to_switch_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTCORE_DISABLE_PLUGINS", "compile_backend")
    with pytest.raises(Exception, match="the plugin 'compile_backend' is disabled"):
        torch.compile(nn.Linear(4, 2), backend="ortcore")(torch.randn(2, 4))


def test_torch_finds_the_backend_without_ortcore_imported_first() -> None:
    code = (
        "import sys, torch\n"
        "assert 'ortcore' not in sys.modules\n"
        "fn = torch._dynamo.backends.registry.lookup_backend('ortcore')\n"
        "print(fn.__module__, fn.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ortcore_plugins.compile_backend ortcore_backend" in done.stdout


def test_the_report_lists_graphs_where_ops_run_and_the_breaks_with_torchs_reasons() -> None:
    torch.manual_seed(0)
    compiled = torch.compile(Breaks(), backend="ortcore")
    compiled(_batches(1)[0]).backward()
    text = plugin.report()
    assert f"{len(plugin.compiled_graphs())} graph(s) compiled" in text
    assert "graph 0:" in text and "runs in ONNX Runtime" in text
    assert "Gemm" in text or "MatMul" in text  # explain()'s op table of a graph
    breaks = plugin.graph_break_reasons()
    assert breaks and f"graph breaks: {sum(breaks.values())}" in text
    assert any(reason in text for reason in breaks)


@pytest.mark.slow  # the dynamo exporter takes seconds per captured graph
def test_the_dynamo_exporter_serves_the_captured_graphs_too() -> None:
    _one_step_as_eager(options={"exporter": "dynamo"})
    for graph in plugin.compiled_graphs():
        assert graph.reason_in_pytorch is None
        assert graph.ortmodule.state_machine.last_key.exporter == "dynamo"


def test_a_graph_ortcore_raises_on_runs_in_pytorch_as_dynamos_graph_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile trains every model: a captured graph ortcore cannot serve (here: every build fails) runs as the
    graph module in PyTorch, with eager's gradients, and the report says why."""
    from ortcore.errors import GraphBuildError
    from ortcore.pipeline import Pipeline

    def failing_build(self, graph, key):
        raise GraphBuildError("no build today")

    monkeypatch.setattr(Pipeline, "build", failing_build)
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    compiled = torch.compile(model, backend="ortcore")
    compiled(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert_grads_match(model, ref)
    (graph,) = plugin.compiled_graphs()
    assert graph.reason_in_pytorch and "no build today" in graph.reason_in_pytorch
    assert "runs in PyTorch" in plugin.report()


# -- design = "aot_autograd": PyTorch's derivative formulas, forward and backward each an ORT inference graph ---------


def test_the_aot_autograd_design_trains_a_model_with_breaks_with_eagers_loss_curve() -> None:
    compiled, ref = _one_step_as_eager(options={"design": "aot_autograd"})
    graphs = plugin.compiled_graphs()
    # A forward and a backward graph per captured graph that needs gradients; an inference graph for the one that
    # computes only the branch's condition.
    assert {g.kind for g in graphs} == {"forward", "backward", "inference"}
    for graph in graphs:
        assert graph.reason_in_pytorch is None, graph.describe()
        _, session = graph.ortmodule.state_machine.current
        assert not session.request.build_gradient  # ORT's gradient builder is not used: an inference graph each
    assert "(backward, AOTAutograd)" in plugin.report()
    curve = _train(compiled, _batches(4))
    curve_ref = _train(ref, _batches(4))
    for step, (a, b) in enumerate(zip(curve, curve_ref)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {a} vs {b}"


def test_the_design_comes_from_the_config_too_and_a_bad_one_names_the_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTCORE_COMPILE_DESIGN", "aot_autograd")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    torch.compile(model, backend="ortcore")(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert_grads_match(model, ref)
    assert {g.kind for g in plugin.compiled_graphs()} == {"forward", "backward"}
    torch._dynamo.reset()
    with pytest.raises(
        Exception, match="'joint' is not a compile_backend design; allowed: ort_gradients, aot_autograd"
    ):
        torch.compile(nn.Linear(4, 2), backend="ortcore", options={"design": "joint"})(torch.randn(2, 4))


def test_numbers_a_graph_returns_are_recomputed_per_call_not_traced_constants() -> None:
    """With dynamic sizes, AOTAutograd's forward graph returns the symbolic sizes its backward needs; an export would
    trace each as the number it was on the first call. They are recomputed from each call's shapes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="ortcore", dynamic=True, options={"design": "aot_autograd"})
    for rows in (5, 9, 3):
        x = torch.randn(rows, 8)
        out, out_ref = compiled(x), ref(x)
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
        out.square().sum().backward()
        out_ref.square().sum().backward()
        assert_grads_match(model, ref)
        for m in (model, ref):
            m.zero_grad()
    graphs = plugin.compiled_graphs()
    assert any(g.scalars.exprs for g in graphs), [g.describe() for g in graphs]
    assert all(g.reason_in_pytorch is None for g in graphs), [g.describe() for g in graphs]


@pytest.mark.parametrize("verify", [True, False])
def test_an_aot_graph_whose_first_call_differs_from_pytorch_runs_in_pytorch(
    monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    """The aot_autograd design's counterpart of the gradient audit: each graph's first call is compared with the graph
    module run by PyTorch (here ORT's outputs are made wrong on purpose; the dynamo exporter's nll_loss_forward gave a
    wrong total weight this way, and every gradient came out 4x). verify_gradients=False skips the check."""
    inference = plugin.CompiledGraph._inference

    def wrong(self, inputs):
        outputs = inference(self, inputs)
        return type(outputs)(o * 2 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in outputs)

    monkeypatch.setattr(plugin.CompiledGraph, "_inference", wrong)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    options = {"design": "aot_autograd", "verify_gradients": verify}
    out = torch.compile(model, backend="ortcore", options=options)(x)
    out.square().sum().backward()
    ref(x).square().sum().backward()
    graphs = plugin.compiled_graphs()
    if verify:
        torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)
        assert_grads_match(model, ref)
        assert all("of its first call differs from PyTorch's" in (g.reason_in_pytorch or "") for g in graphs)
    else:
        assert all(g.reason_in_pytorch is None for g in graphs)
        torch.testing.assert_close(out, 2 * ref(x), rtol=1e-5, atol=1e-6)  # unchecked: ORT's (wrong) numbers
