"""The build pipeline: gradient-graph passes, the session plan (settings, run wrappers, probes, optional settings),
the immutable session, and every built-in plugin that touches the build combined, in both registration orders.

Numbers are compared with PyTorch at ortcore.testing's tolerances (rtol 1e-4, atol 1e-5); the combined model also
trains three AdamW steps against PyTorch (loss curve within rtol 1e-4).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ortcore_plugins.aten_fallback as aten_fallback
import ortcore_plugins.autograd_function as autograd_function
import ortcore_plugins.compute_optimizer as compute_optimizer
import ortcore_plugins.grad_management as grad_management
import ortcore_plugins.memory_recompute as memory_recompute
import ortcore_plugins.sparse_optimizer as sparse_optimizer
from ortcore import ORTModule
from ortcore.errors import GraphBuildError
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.testing import ExecutedGraphs, assert_grads_match, assert_matches_torch, make_host

STRICT = {"fallback_policy": "FALLBACK_DISABLE"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


X = torch.randn(5, 8)


# -- gradient-graph passes -------------------------------------------------------------------------------------------


class Recorder:
    """Gradient-graph passes that record what they saw, in the order the core ran them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def _pass(self, name: str):
        def run(model: onnx.ModelProto, graph) -> None:
            self.seen.append((name, graph.kind, graph.purpose))

        return run

    @hookimpl
    def ortcore_gradient_graph_passes(self):
        # Declared in reverse: the core sorts by before/after, not by declaration.
        return [GraphPass("b", run=self._pass("b"), after=("a",)), GraphPass("a", run=self._pass("a"))]


def test_gradient_graph_passes_run_in_declared_order_on_each_built_graph():
    recorder = Recorder()
    model = assert_matches_torch(mlp(), (X,), host=make_host({"recorder": recorder}), **STRICT)
    assert recorder.seen == [("a", "training", "train"), ("b", "training", "train")]
    with torch.no_grad():
        model(X)
    assert recorder.seen[2:] == [("a", "inference", "train"), ("b", "inference", "train")]


class ScaleOutput:
    """A gradient-graph pass that changes what ORT computes: the forward output is doubled after the build."""

    @hookimpl
    def ortcore_gradient_graph_passes(self):
        def double_output(model: onnx.ModelProto, graph) -> None:
            if graph.kind != "inference":
                return
            out = model.graph.output[0].name
            for node in model.graph.node:
                for i, name in enumerate(node.output):
                    if name == out:
                        node.output[i] = out + "/raw"
            two = onnx.helper.make_tensor("two", onnx.TensorProto.FLOAT, [], [2.0])
            model.graph.initializer.append(two)
            model.graph.node.append(onnx.helper.make_node("Mul", [out + "/raw", "two"], [out]))

        return [GraphPass("double_output", run=double_output)]


def test_a_gradient_graph_pass_edits_the_graph_the_session_runs():
    model = mlp()
    wrapped = ORTModule(copy.deepcopy(model), host=make_host({"scale": ScaleOutput()}), **STRICT)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(X), 2 * model(X), rtol=1e-4, atol=1e-5)
        _, session = wrapped.state_machine.current
        assert any(n.op_type == "Mul" and n.input[1] == "two" for n in session.model.graph.node)


class Failing:
    @hookimpl
    def ortcore_gradient_graph_passes(self):
        def broken(model, graph):
            raise ValueError("no such node")

        return [GraphPass("broken", run=broken)]


def test_a_failing_gradient_graph_pass_is_named_and_falls_back_as_a_build_error():
    with pytest.raises(GraphBuildError, match=r"gradient-graph pass 'broken' \(plugin 'failing'\).*no such node"):
        ORTModule(mlp(), host=make_host({"failing": Failing()}), **STRICT)(X)
    with pytest.warns(RuntimeWarning, match="FALLBACK_UNSUPPORTED_ONNX_MODEL"):
        wrapped = ORTModule(mlp(), host=make_host({"failing": Failing()}))
        wrapped(X)
    assert wrapped.state_machine.counters.fallbacks == 1


# -- the session plan ------------------------------------------------------------------------------------------------


class Planner:
    """Contributes a config entry, a run wrapper that records each run, and (optionally) a probe."""

    def __init__(self, probe: bool = False) -> None:
        self.runs: list[str] = []
        self.probe = probe
        self.probed: list[str] = []

    @contextlib.contextmanager
    def wrapper(self, what: str):
        self.runs.append(f"enter {what}")
        yield
        self.runs.append(f"exit {what}")

    @hookimpl
    def ortcore_session_plan(self, graph, plan):
        plan.config_entries["session.use_env_allocators"] = "0"
        plan.add_run_wrapper("recorder", self.wrapper)
        plan.add_run_wrapper("recorder", self.wrapper)  # one name, one wrapper
        if self.probe and graph.kind == "training":
            probe = plan.probe("planner: look at the graph")
            self.probed.append(probe.kind)


def test_plan_settings_reach_the_session_and_run_wrappers_surround_every_run():
    planner = Planner()
    wrapped = assert_matches_torch(mlp(), (X,), host=make_host({"planner": planner}), **STRICT)
    # The gradient audit checks the step's own runs (no run of its own): wrappers surround each.
    assert planner.runs == ["enter forward", "exit forward", "enter backward", "exit backward"]
    _, session = wrapped.state_machine.current
    assert session.run_wrappers == ("recorder",)
    assert session._sess.get_session_options().get_session_config_entry("session.use_env_allocators") == "0"
    with torch.no_grad():
        wrapped(X)
    assert planner.runs[-2:] == ["enter inference", "exit inference"]


def test_a_probe_is_counted_and_logged_with_its_cause(caplog):
    caplog.set_level(logging.INFO, logger="ortcore")
    planner = Planner(probe=True)
    host = make_host({"planner": planner}, table={"log_level": "INFO"})
    wrapped = assert_matches_torch(mlp(), (X,), host=host, **STRICT)
    assert planner.probed == ["training"]
    counters = wrapped.state_machine.counters
    assert (counters.builds, counters.probes) == (1, 1)
    assert ("probe", "planner: look at the graph") in [(t.action, t.reason) for t in wrapped.state_machine.history]
    assert "probe (planner: look at the graph)" in caplog.text


class RefusedSettings:
    @hookimpl
    def ortcore_session_plan(self, graph, plan):
        path = plan.temporary_file("not json", suffix=".json")
        self.path = path
        plan.add_optional(
            "refused",
            {
                "optimization.memory_optimizer_config": path,
                "optimization.enable_memory_probe_recompute_config": "1:0",
            },
        )


def test_optional_settings_ort_refuses_are_dropped_with_a_warning_and_a_counted_build(caplog):
    plugin = RefusedSettings()
    wrapped = assert_matches_torch(mlp(), (X,), host=make_host({"refused": plugin}), **STRICT)
    assert "could not create the training session with the settings of refused" in caplog.text
    assert wrapped.state_machine.counters.builds == 2
    assert wrapped.state_machine.history[-1].reason == "again without the settings of refused"
    assert not Path(plugin.path).exists()  # the plan's temporary files go once the session exists


def test_the_session_is_immutable():
    wrapped = ORTModule(mlp(), host=make_host({}), **STRICT)
    wrapped(X).sum().backward()
    _, session = wrapped.state_machine.current
    with pytest.raises(AttributeError, match="immutable.*'run_forward'.*ortcore_session_plan"):
        session.run_forward = lambda feeds: None
    with pytest.raises(AttributeError, match="immutable"):
        session._model_bytes = b""
    assert not hasattr(session, "recreate_session")


class SeesSessions:
    def __init__(self) -> None:
        self.purposes: list[str] = []

    @hookimpl
    def ortcore_session_created(self, session):
        self.purposes.append(session.purpose)


def test_the_gradient_audit_session_is_a_probe_not_shown_to_session_created():
    # With gradients handed over during the backward, the audit builds its own session that keeps them in ORT.
    seen = SeesSessions()
    host = make_host({"seen": seen, "grad_management": grad_management}, env=BUILD_ENV)
    wrapped = assert_matches_torch(mlp(), (X,), host=host, verify_gradients=True, **STRICT)
    assert seen.purposes == ["train"]
    counters = wrapped.state_machine.counters
    assert (counters.audits, counters.builds, counters.probes) == (1, 1, 1)
    assert wrapped.gradient_audits[0].status == "passed"


# -- every built-in plugin that touches the build, together --------------------------------------------------------


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Combined(nn.Module):
    """Embedding (routed to PyTorch's kernel), a custom Function (PythonOp), GELU blocks (recompute candidates) and
    a cross-entropy over padded labels (label sparsity)."""

    def __init__(self, vocab: int = 40, dim: int = 16, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = Twice.apply(self.embed(ids))
        for block in self.blocks:
            h = h + F.gelu(block(h))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (4, 8), generator=g)
    labels = torch.randint(0, 40, (4, 8), generator=g)
    labels[:, 5:] = -100  # padding the label-sparsity gather leaves out
    return ids, labels


DumpExecuted = ExecutedGraphs  # ORT writes each session's graph: ortcore.testing


BUILD_PLUGINS = {
    "memory_recompute": memory_recompute,
    "grad_management": grad_management,
    "autograd_function": autograd_function,
    "compute_optimizer": compute_optimizer,
    "sparse_optimizer": sparse_optimizer,
    "aten_fallback": aten_fallback,
}
BUILD_ENV = {
    "ORTMODULE_MEMORY_OPT_LEVEL": "1",
    "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT": "1",
    "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER": "1",
    "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER": "1",
    "ORTCORE_TORCH_KERNELS": "embedding",
}


@pytest.mark.parametrize("order", ["declared", "reversed"])
def test_every_build_plugin_leaves_its_mark_in_the_graph_ort_runs(order, tmp_path):
    names = list(BUILD_PLUGINS) if order == "declared" else list(reversed(BUILD_PLUGINS))
    dump = DumpExecuted(tmp_path)
    plugins = {"dump": dump, **{name: BUILD_PLUGINS[name] for name in names}}
    # The audit off: its own session (grad_management hands gradients over in the step's) would be the last dumped.
    host = make_host(plugins, env={**BUILD_ENV, "ORTCORE_VERIFY_GRADIENTS": "0"})

    torch.manual_seed(0)
    model = Combined()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model, host=host, **STRICT)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for step in range(3):
        batch = _batch(step)
        loss, ref_loss = wrapped(*batch), reference(*batch)
        loss.backward()
        ref_loss.backward()
        if step == 0:
            assert_grads_match(wrapped, reference, rtol=1e-4, atol=1e-5)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)

    counters = wrapped.state_machine.counters
    assert (counters.exports, counters.builds, counters.probes, counters.fallbacks) == (1, 1, 1, 0)
    _, session = wrapped.state_machine.current
    executed = dump.last()
    ops = Counter(n.op_type for n in executed.graph.node)
    python_ops = [n for n in executed.graph.node if n.op_type == "PythonOp"]
    # memory_recompute: ORT recomputes clusters in the backward of the session it runs.
    assert any(n.name.endswith("_recompute") for n in executed.graph.node)
    # grad_management: hand-over nodes, and the core knows which gradients went to torch.
    assert sum(n.name.startswith("grad_management/") for n in python_ops) == len(session.grads_handed_over) > 0
    # autograd_function: the custom Function runs as a PythonOp (and its PythonOpGrad).
    assert any(b"Twice" in a.s for n in python_ops for a in n.attribute if a.name == "func_name")
    assert ops["PythonOpGrad"] >= 1
    # sparse_optimizer: ORT gathers the valid label rows before the loss.
    assert ops["ShrunkenGather"] >= 1
    # aten_fallback: the embedding runs on PyTorch's kernel inside the graph.
    assert any(
        a.name == "operator" and a.s == b"embedding"
        for n in executed.graph.node
        if n.op_type == "ATen"
        for a in n.attribute
    )
    assert session.run_wrappers == ("aten_executor",)


def test_initializers_a_graph_pass_left_unread_are_dropped_before_ort_sees_them():
    """ONNX Runtime warns about each unread initializer when it loads a graph (the dynamo route printed five a
    build); one read only inside a subgraph, one also a graph input, and graph outputs stay."""
    import onnx.helper as h
    from onnx import TensorProto, numpy_helper

    from ortcore.graph import drop_unread_initializers

    def const(name: str) -> onnx.TensorProto:
        return numpy_helper.from_array(np.zeros(2, np.float32), name)

    body = h.make_graph(
        [h.make_node("Add", ["x", "in_body"], ["z"])],
        "body",
        [],
        [h.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
    )
    graph = h.make_graph(
        [
            h.make_node("Add", ["x", "read"], ["y"]),
            h.make_node("If", ["cond"], ["w"], then_branch=body, else_branch=body),
        ],
        "g",
        [h.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "also_input")]
        + [h.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [h.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("y", "w", "as_output")],
        [const(n) for n in ("read", "in_body", "also_input", "as_output", "unread_1", "unread_2")],
    )
    model = h.make_model(graph)
    assert drop_unread_initializers(model) == 2
    assert sorted(t.name for t in model.graph.initializer) == ["also_input", "as_output", "in_body", "read"]


def test_the_dynamo_route_builds_without_ort_warnings(capfd):
    from models import gpt2_batch, make_batches, tiny_gpt2

    model = ORTModule(tiny_gpt2(), exporter="dynamo")
    batch = make_batches(gpt2_batch, 1)[0]
    model(**batch, labels=batch["input_ids"]).loss.backward()
    assert "Removing initializer" not in capfd.readouterr().err
