"""op_profiler: kernels per op kind against the graph ORT runs, forward/backward by ORT call, ATen nodes reported as
PyTorch, the eager side's categories, explain_bench's keys and table, nothing when off, numerics unchanged.

No timing is asserted beyond sanity: every ms is >= 0 and the sums are consistent.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import transformers
from rich.console import Console

import ortcore_plugins.aten_fallback as aten_fallback
import ortcore_plugins.op_profiler as plugin
from ortcore import ORTModule
from ortcore.errors import OptionError
from ortcore.explain import operator_of
from ortcore.hookspecs import hookimpl
from ortcore.host import set_host
from ortcore_plugins.op_profiler import (
    explain_bench,
    format_profile,
    phase,
    profile_eager_steps,
    profile_steps,
    render_explain,
    render_profile,
)
from ortcore_plugins.op_profiler.categories import aten_category, autograd_node_op, ort_category
from ortcore_plugins.op_profiler.eager_side import classify
from ortcore_plugins.op_profiler.explain import EXPLAIN_KEYS
from ortcore_plugins.op_profiler.ort_side import Kernel, Run, assign_runs, recorder_of
from ortcore_plugins.services.example_models import BenchConfig

STRICT = {"fallback_policy": "FALLBACK_DISABLE"}


class SaveExecutedGraph:
    """Has ORT write the graph it runs (after its own optimizations): the nodes the trace must account for."""

    def __init__(self, path: Path):
        self.path = path

    @hookimpl
    def ortcore_session_plan(self, graph: Any, plan: Any) -> None:
        if graph.purpose == "train":
            plan.optimized_model_filepath = str(self.path)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def tiny_bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config)


def trainer(name: str, model: torch.nn.Module) -> tuple[Callable[[], None], list[float], torch.optim.Optimizer]:
    """A step function over seeded batches (forward, zero_grad, backward, AdamW), phases marked; and its losses."""
    gen = torch.Generator().manual_seed(1)
    losses: list[float] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        if name == "mlp":
            x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
            with phase("forward"):
                loss = torch.nn.functional.mse_loss(model(x), y)
        else:
            ids = torch.randint(0, 100, (2, 12), generator=gen)
            with phase("forward"):
                loss = model(input_ids=ids, labels=torch.randint(0, 2, (2,), generator=gen)).loss
        with phase("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
        losses.append(loss.item())

    return step, losses, optimizer


@pytest.fixture
def host(ortcore_host: Callable[..., Any]) -> Callable[..., Any]:
    def make(*extra: Any, **table: Any) -> Any:
        plugins = {"op_profiler": plugin, "aten_fallback": aten_fallback}
        plugins.update({f"extra_{i}": p for i, p in enumerate(extra)})
        return ortcore_host(plugins, table={"plugins": {"op_profiler": table}} if table else None)

    return make


def executed_kinds(path: Path) -> tuple[Counter[str], Counter[str]]:
    """Nodes of the graph ORT ran, by op kind (ATen nodes by operator): all of them, and those before YieldOp."""
    graph = onnx.load(str(path)).graph
    every, forward, side = Counter(), Counter(), "forward"
    for node in graph.node:
        if node.op_type == "YieldOp":
            side = "backward"
            continue
        op = operator_of(node) if node.op_type == "ATen" else node.op_type
        kind = op if node.op_type != "ATen" or "::" in op else f"aten::{op}"
        every[kind] += 1
        if side == "forward":
            forward[kind] += 1
    return every, forward


@pytest.mark.parametrize("name", ["mlp", "bert"])
def test_kernels_per_op_kind_are_the_executed_graphs_nodes_forward_and_backward(name, host, tmp_path):
    executed = tmp_path / "executed.onnx"
    model = ORTModule(mlp() if name == "mlp" else tiny_bert(), host=host(SaveExecutedGraph(executed)), **STRICT)
    step, _, _ = trainer(name, model)
    result = profile_steps(model, step, steps=2, warmup=1)
    every, forward = executed_kinds(executed)
    counted = {r["op"]: r["count"] for r in result["ops"]}
    assert counted == dict(every)
    # The forward is what ran in ORT's forward call: exactly the nodes before the YieldOp of the graph ORT ran.
    assert {r["op"]: r["fw_count"] for r in result["ops"] if r["fw_count"]} == dict(forward)
    assert result["kernels_straddling_calls"] == 0
    assert result["calls"]["forward"]["calls"] == result["calls"]["backward"]["calls"] == 1


def test_aten_nodes_are_reported_as_pytorch_by_their_operator(host):
    model = ORTModule(tiny_bert(), host=host(), **STRICT)
    step, _, _ = trainer("bert", model)
    result = profile_steps(model, step, steps=1, warmup=1)
    runs_on = {r["op"]: r["runs_on"] for r in result["ops"]}
    assert runs_on["aten::native_layer_norm"] == runs_on["aten::gelu"] == runs_on["aten::embedding"] == "PyTorch"
    assert {r["category"] for r in result["ops"] if r["op"] == "aten::native_layer_norm"} == {"layer_norm"}
    assert all(v == "ORT" for k, v in runs_on.items() if not k.startswith(("aten::", "ortcore_aten::")))
    assert "PyTorch" in result["categories"]["layer_norm"]["runs_on"]
    assert result["categories"]["matmul/gemm"]["runs_on"] == "ORT"


def test_times_are_consistent(host):
    model = ORTModule(tiny_bert(), host=host(), **STRICT)
    step, _, _ = trainer("bert", model)
    result = profile_steps(model, step, steps=2, warmup=1)
    for call in result["calls"].values():
        assert 0 <= call["kernel_ms"] <= call["wall_ms"]
    o = result["outside"]
    assert all(r["fw_ms"] >= 0 and r["bw_ms"] >= 0 for r in result["ops"])
    assert sum(r["total_ms"] for r in result["ops"]) == pytest.approx(o["kernel_ms"])
    assert sum(c["total_ms"] for c in result["categories"].values()) == pytest.approx(o["kernel_ms"])
    assert o["kernel_ms"] <= o["ort_calls_ms"] <= o["step_ms"]
    assert o["forward_call_ms"] <= result["phases_ms"]["forward"]
    assert o["glue_ms"] >= 0 and len(result["step_ms"]) == 2
    json.dumps(result)
    assert "matmul/gemm" in format_profile(result)
    Console(file=io.StringIO(), width=120).print(render_profile(result))


def test_profiling_changes_no_numerics(host):
    losses = {}
    for profiled in (False, True):
        torch.manual_seed(0)
        model = ORTModule(tiny_bert(), host=host(), **STRICT)
        step, losses[profiled], _ = trainer("bert", model)
        if profiled:
            profile_steps(model, step, steps=2, warmup=1)
        else:
            for _ in range(3):
                step()
        step()  # after profiling, too
    torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=0)


def test_off_by_default_no_profiler_no_run_wrapper(host):
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), f"ortcore_op_profiler_{os.getpid()}_*")))
    model = ORTModule(mlp(), host=host(), **STRICT)
    step, _, _ = trainer("mlp", model)
    step()
    step()
    session = model.state_machine.current[1]
    assert "op_profiler" not in session.run_wrappers
    assert recorder_of(session) is None
    assert session.end_profiling() is None  # ORT's profiler was never on
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), f"ortcore_op_profiler_{os.getpid()}_*"))) == before


def test_profiling_a_model_that_already_ran_rebuilds_it_with_the_profiler(host):
    model = ORTModule(mlp(), host=host(), **STRICT)
    step, _, _ = trainer("mlp", model)
    step()
    result = profile_steps(model, step, steps=1, warmup=1)
    counters = model.state_machine.counters
    assert result["ops"] and counters.exports == 1 and counters.builds == 2  # the session again, not the export
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        profile_steps(model, step, steps=1, warmup=0)  # the profiler ended: another session is needed


def test_without_the_plugin_profile_steps_names_it(ortcore_host):
    model = ORTModule(mlp(), host=ortcore_host({}), **STRICT)
    step, _, _ = trainer("mlp", model)
    with pytest.raises(RuntimeError, match="op_profiler plugin disabled"):
        profile_steps(model, step, steps=1, warmup=1)


def test_option_logs_the_table_once_and_writes_json(host, tmp_path, caplog):
    output = tmp_path / "ops.json"
    model = ORTModule(mlp(), host=host(enable=True, warmup=1, steps=2, output=str(output)), **STRICT)
    step, _, _ = trainer("mlp", model)
    with caplog.at_level(logging.INFO, logger="ortcore.op_profiler"):
        for _ in range(5):
            step()
    assert caplog.text.count("op profiler: 2 training steps") == 1
    result = json.loads(output.read_text())
    assert result["steps"] == 2 and {r["op"] for r in result["ops"]} >= {"Gemm", "aten::gelu"}
    assert result["calls"]["backward"]["calls"] == 1


def test_bad_option_values_name_the_variable(ortcore_host):
    with pytest.raises(OptionError, match="ORTCORE_PROFILE_OPS_STEPS='0'"):
        ortcore_host({"op_profiler": plugin}, env={"ORTCORE_PROFILE_OPS_STEPS": "0"})


def test_eager_side_reports_each_category_by_phase():
    model = tiny_bert()
    model.train()
    step, _, _ = trainer("bert", model)
    result = profile_eager_steps(step, steps=1, warmup=1)
    c = result["categories"]
    for name in ("matmul/gemm", "layer_norm", "gelu", "embedding/gather", "cross_entropy"):
        assert c[name]["fw_ms"] > 0 and c[name]["bw_ms"] > 0, name
    assert c["optimizer"]["other_ms"] > 0 and c["optimizer"]["fw_ms"] == 0
    o = result["outside"]
    assert o["op_ms"] == pytest.approx(sum(r["total_ms"] for r in result["ops"]))
    assert o["backward_op_ms"] <= result["phases_ms"]["backward"]
    assert {"forward", "backward", "optimizer", "zero_grad"} <= set(result["phases_ms"])


class _Event:
    def __init__(self, name: str, parent: _Event | None = None):
        self.name, self.cpu_parent = name, parent


def test_eager_ops_belong_to_their_outermost_op_or_autograd_node():
    linear = _Event("aten::linear", _Event("op_profiler::forward"))
    assert classify(_Event("aten::addmm", linear)) == ("aten::linear", "forward")
    node = _Event("NativeLayerNormBackward0", _Event("autograd::engine::evaluate_function: NativeLayerNormBackward0"))
    assert classify(_Event("aten::native_layer_norm_backward", node)) == ("native_layer_norm (backward)", "backward")
    assert classify(_Event("aten::lerp_", _Event("Optimizer.step#AdamW.step")))[1] == "optimizer"
    assert autograd_node_op("ScaledDotProductFlashAttentionForCpuBackward0").startswith("scaled_dot_product")
    assert autograd_node_op("torch::autograd::AccumulateGrad") == "accumulate_grad"


def test_categories_match_both_sides_op_names():
    assert ort_category("FusedMatMul") == aten_category("aten::addmm") == aten_category("mm") == "matmul/gemm"
    assert ort_category("LayerNormalizationGrad") == aten_category("ortcore_aten::layer_norm_backward_input")
    assert aten_category("native_layer_norm") == "layer_norm"
    assert ort_category("SoftmaxCrossEntropyLossInternal") == aten_category("aten::cross_entropy_loss")
    assert aten_category("log_softmax") == aten_category("nll_loss") == "cross_entropy"
    assert ort_category("GatherGrad") == aten_category("aten::embedding_dense_backward") == "embedding/gather"
    assert ort_category("NoSuchOp") == aten_category("aten::no_such_op") == "other"


def test_a_kernel_belongs_to_the_call_whose_window_holds_it():
    start = 1_000_000_000
    runs = [Run("forward", start + 10_000, start + 20_000), Run("backward", start + 30_000, start + 40_000)]
    kernels = [
        Kernel("a", "MatMul", "CPU", 5, 1),  # before any timed call: a warm-up step
        Kernel("b", "MatMul", "CPU", 12, 3),
        Kernel("c", "MatMulGrad", "CPU", 32, 5),
        Kernel("d", "Add", "CPU", 25, 1),  # between the calls: an untimed call
        Kernel("e", "Add", "CPU", 38, 10),  # runs past its call's end
    ]
    found, straddling = assign_runs(kernels, start, runs)
    assert [(k.node, r.what) for k, r in found] == [("b", "forward"), ("c", "backward"), ("e", "backward")]
    assert straddling == 1


@pytest.fixture
def pinned_host(ortcore_host: Callable[..., Any]) -> Iterator[Any]:
    host = ortcore_host({"op_profiler": plugin, "aten_fallback": aten_fallback})
    previous = set_host(host)
    yield host
    set_host(previous)


def test_explain_bench_returns_the_documented_keys_and_renders(pinned_host):
    cfg = BenchConfig(batch=2, seq=16, hidden=32, layers=2, steps=2, warmup=1, vocab=200)
    data = explain_bench("bert", cfg, steps=1, warmup=1)
    assert tuple(data) == EXPLAIN_KEYS
    json.dumps(data)
    categories = {r["category"]: r for r in data["categories"]}
    assert {"matmul/gemm", "layer_norm", "gelu", "cross_entropy", "optimizer"} <= set(categories)
    assert categories["layer_norm"]["runs_on"] == "PyTorch"
    assert categories["matmul/gemm"]["eager_fw_ms"] > 0 and categories["matmul/gemm"]["ort_bw_ms"] > 0
    torch.testing.assert_close(data["losses"]["ortcore"], data["losses"]["eager"], rtol=1e-4, atol=1e-5)
    assert len(data["step_ms"]["ortcore"]["profiled"]) == len(data["step_ms"]["eager"]["unprofiled"]) == 1
    console = Console(file=io.StringIO(), width=160, record=True)
    console.print(render_explain(data))
    text = console.export_text()
    assert "layer_norm" in text and "where the step goes" in text
    placement = {(r["op"], r["runs_on"]): r for r in data["placement"]}
    assert placement[("layer_norm", "PyTorch")]["reason"]  # routed ops say why, and the table shows it
    assert "where op kinds run, and why" in text
