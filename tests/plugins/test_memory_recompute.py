"""memory_recompute: options are validated, ORT's recompute really happens (recompute nodes in the graph ORT runs),
gradients still match PyTorch, the opportunity table is logged at INFO, and nothing is done when it is off.

What ORT runs is observed by a helper plugin that points ``SessionOptions.optimized_model_filepath`` at a file:
ORT writes its optimized graph there, recompute nodes included (named ``..._recompute``).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import onnx
import pytest
import torch

import ortcore_plugins.memory_recompute as plugin
from ortcore import ORTModule
from ortcore.errors import OptionError
from ortcore.testing import ExecutedGraphs, assert_grads_match, assert_matches_torch
from ortcore_plugins.memory_recompute import RecomputeEntry, parse_config, parse_level


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(torch.nn.Module):
    """Linear + GELU blocks: the GELU outputs are kept for backward, and ORT can recompute them instead."""

    def __init__(self, width: int = 16, depth: int = 3):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


DumpExecutedGraph = ExecutedGraphs  # ORT writes each session's graph: ortcore.testing


# A fallback to PyTorch would make every parity check pass without ORT: fail instead.
STRICT = {"fallback_policy": "FALLBACK_DISABLE"}


def recompute_nodes(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.name.endswith("_recompute")]


@pytest.fixture
def dump(tmp_path: Path) -> DumpExecutedGraph:
    return DumpExecutedGraph(tmp_path)


def host_with(ortcore_host, dump: DumpExecutedGraph, table: dict | None = None, env: dict | None = None, **core):
    return ortcore_host(
        {"memory_recompute": plugin, "dump": dump},
        table={**core, "plugins": {"memory_recompute": table or {}}},
        env=env or {},
    )


# -- recompute happens, gradients match ------------------------------------------------------------------------------


def test_level_1_recomputes_in_the_executed_graph_and_gradients_match(ortcore_host, dump):
    host = host_with(ortcore_host, dump, env={"ORTMODULE_MEMORY_OPT_LEVEL": "1"})
    assert_matches_torch(Stack(), (torch.randn(4, 8, 16),), host=host, **STRICT)

    assert dump.sessions == 2  # built once to find the opportunities, once with the plan
    executed = recompute_nodes(dump.last())
    assert any("Gelu" in name for name in executed), executed
    assert len(executed) >= 3  # at least one per block
    assert recompute_nodes(onnx.load(str(dump.directory / "executed_1.onnx"))) == []


def test_config_entry_recomputes_only_that_cluster(ortcore_host, dump):
    host = host_with(ortcore_host, dump, {"config": ["Gelu+:1:-1"]})
    model = assert_matches_torch(Stack(), (torch.randn(4, 8, 16),), host=host, **STRICT)
    executed = recompute_nodes(dump.last())
    assert len(executed) == 3 and all("Gelu" in name for name in executed), executed

    # Training goes on with the rebuilt session: a second step, still with PyTorch's gradients.
    model.zero_grad()
    model(torch.randn(4, 8, 16)).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_count_zero_or_strategy_zero_leaves_a_cluster_alone(ortcore_host, dump):
    # Level 1 would recompute the GELUs too; the user's entry takes them out.
    host = host_with(ortcore_host, dump, {"level": 1, "config": ["Gelu+:0:-1"]})
    assert_matches_torch(Stack(), (torch.randn(4, 8, 16),), host=host, **STRICT)
    executed = recompute_nodes(dump.last())
    assert executed and not any(name.startswith("Gelu") for name in executed), executed

    # ORT 1.19.2 itself would still recompute some occurrences for a count of 0: such entries are never passed on.
    dump.sessions = 0
    host = host_with(ortcore_host, dump, env={"ORTMODULE_MEMORY_OPT_CONFIG": "Gelu+:1:0"})
    assert_matches_torch(Stack(), (torch.randn(4, 8, 16),), host=host, **STRICT)
    assert dump.sessions == 1 and recompute_nodes(dump.last()) == []


def test_saved_execution_model_with_save_onnx(ortcore_host, tmp_path):
    host = ortcore_host(
        {"memory_recompute": plugin},
        table={"save_onnx": True, "onnx_prefix": "stack", "save_onnx_path": str(tmp_path)},
        env={"ORTMODULE_MEMORY_OPT_LEVEL": "2"},
    )
    model = ORTModule(Stack(), host=host, **STRICT)
    model(torch.randn(2, 4, 16)).sum().backward()
    saved = onnx.load(str(tmp_path / "stack_execution_model_training.onnx"))
    assert len(recompute_nodes(saved)) >= 3


def test_inference_sessions_are_left_alone(ortcore_host, dump):
    host = host_with(ortcore_host, dump, env={"ORTMODULE_MEMORY_OPT_LEVEL": "1"})
    model = ORTModule(Stack().eval(), host=host, **STRICT)
    with torch.no_grad():
        model(torch.randn(2, 4, 16))
    assert dump.sessions == 1 and recompute_nodes(dump.last()) == []


# -- logging -----------------------------------------------------------------------------------------------------


def test_opportunity_table_at_info_even_when_off(ortcore_host, dump, caplog):
    caplog.set_level(logging.INFO, logger="ortcore.memory_recompute")
    host = host_with(ortcore_host, dump, log_level="INFO")
    ORTModule(Stack(), host=host, **STRICT)(torch.randn(2, 4, 16)).sum().backward()

    [table] = [r.getMessage() for r in caplog.records if r.name == "ortcore.memory_recompute"]
    assert table.startswith("memory recompute: level 0 (USER_SPECIFIED), 0 of ")
    gelu = next(line for line in table.splitlines() if "Gelu+:1:-1" in line).split()
    assert gelu[1:4] == ["OFF", "Gelu+:1:-1", "3"]  # three occurrences, one per block
    assert "enable with ORTMODULE_MEMORY_OPT_LEVEL=1" in table
    assert dump.sessions == 1  # nothing to apply: no second build


def test_table_marks_applied_plans_on(ortcore_host, dump, caplog):
    caplog.set_level(logging.INFO, logger="ortcore.memory_recompute")
    host = host_with(ortcore_host, dump, {"level": 1}, log_level="INFO")
    ORTModule(Stack(), host=host, **STRICT)(torch.randn(2, 4, 16)).sum().backward()
    [table] = [r.getMessage() for r in caplog.records if r.name == "ortcore.memory_recompute"]
    assert "(TRANSFORMER_LAYERWISE_RECOMPUTE)" in table
    statuses = [line.split()[1] for line in table.splitlines()[2:] if line.split()[0].isdigit()]
    assert statuses and set(statuses) == {"ON"}
    assert "enable with" not in table


def test_unknown_cluster_is_named_with_the_closest_found(ortcore_host, dump, caplog):
    host = host_with(ortcore_host, dump, {"config": ["Gelo+:1:-1"]})
    model = ORTModule(Stack(), host=host, **STRICT)
    model(torch.randn(2, 4, 16)).sum().backward()
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "Gelo+" in r.getMessage()]
    assert "did you mean 'Gelu+'?" in warning
    # The probe found the opportunities; the only entry named nothing ORT found, so the session gets no plan.
    counters = model.state_machine.counters
    assert (dump.sessions, counters.probes, counters.builds) == (2, 1, 1)
    assert recompute_nodes(dump.last()) == []


def test_off_by_default_does_not_analyse_or_rebuild(ortcore_host, dump, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("probed while off")

    monkeypatch.setattr(plugin, "find_opportunities", must_not_run)
    host = host_with(ortcore_host, dump)
    assert_matches_torch(Stack(), (torch.randn(2, 4, 16),), host=host, **STRICT)
    assert dump.sessions == 1 and recompute_nodes(dump.last()) == []


# -- options -----------------------------------------------------------------------------------------------------


def test_config_forms(tmp_path):
    expected = (RecomputeEntry("BiasGelu+", 1, 1), RecomputeEntry("Cast+", 2, -1))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(["BiasGelu+:1:1", "Cast+:2:-1"]))
    assert parse_config('["BiasGelu+:1:1", "Cast+:2:-1"]', "env") == expected
    assert parse_config("BiasGelu+:1:1, Cast+:2:-1", "env") == expected
    assert parse_config(["BiasGelu+:1:1,Cast+:2:-1"], "toml") == expected  # upstream's combined plans
    assert parse_config(str(path), "env") == expected
    assert parse_config("", "env") == ()
    assert [str(e) for e in expected] == ["BiasGelu+:1:1", "Cast+:2:-1"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("BiasGelu+:1", "entry 'BiasGelu+:1' is not '<cluster id>:<strategy 0|1|2>:<count|-1>' (it needs three fields"),
        ("A+:1:1,BiasGelu+:3:1", "entry 'BiasGelu+:3:1' is not"),
        ("BiasGelu+:1:-2", "count '-2' is not an integer >= -1"),
        (":1:1", "the cluster id is empty"),
        ('["BiasGelu+:1:1"', "is not a valid JSON list"),
        ("missing.json", "'missing.json': no such file"),
        (7, "must be a list of"),
    ],
)
def test_bad_config_entries_are_named(value, message):
    with pytest.raises(OptionError, match=__import__("re").escape(message)):
        parse_config(value, "ORTMODULE_MEMORY_OPT_CONFIG")


def test_levels():
    assert [parse_level(v, "level") for v in (0, "1", " 2 ", "transformer_layerwise_recompute")] == [0, 1, 2, 1]
    for bad in (3, "-1", True, "fast"):
        with pytest.raises(OptionError, match=r"allowed: 0 \(USER_SPECIFIED\), 1 \(TRANSFORMER_LAYERWISE_RECOMPUTE\)"):
            parse_level(bad, "ORTMODULE_MEMORY_OPT_LEVEL")


def test_bad_level_from_the_environment_fails_at_start_up(ortcore_host):
    with pytest.raises(OptionError, match="ORTMODULE_MEMORY_OPT_LEVEL='3' is not a memory optimization level"):
        ortcore_host({"memory_recompute": plugin}, env={"ORTMODULE_MEMORY_OPT_LEVEL": "3"})


def test_level_choice_and_user_overrides():
    found = [
        plugin.Opportunity("Gelu+:1:-1", 3, "0"),
        plugin.Opportunity("Cast+:2:-1", 1, "0"),
        plugin.Opportunity("LayerNormalization+:1:-1,Reshape+:1:-1", 2, "0"),
    ]
    level1 = plugin.MemoryRecomputeOptions(level=1)
    assert [str(e) for e in plugin.choose_entries(level1, found)[0]] == [
        "Gelu+:1:-1",
        "LayerNormalization+:1:-1",
        "Reshape+:1:-1",
    ]
    level2 = plugin.MemoryRecomputeOptions(level=2, config=parse_config("Gelu+:0:0,Nope+:1:1", "t"))
    chosen, unknown = plugin.choose_entries(level2, found)
    assert [str(e) for e in chosen] == ["Cast+:2:-1", "LayerNormalization+:1:-1", "Reshape+:1:-1"]
    assert [str(e) for e in unknown] == ["Nope+:1:1"]


def test_saving_expressions_are_compacted():
    # One term per occurrence, each with dimensions ORT could not name (a fresh symbol each).
    ort = " + ".join(f"(((((empty_dim_param{i})*(empty_dim_param{i + 1})*(32)) * 4 * 1.000000)))" for i in (1, 3))
    assert plugin.simplify_saving(ort + " + (((x_dim0 * 8 * 1.000000)))") == "8*x_dim0 + 2x(128*?*?)"
    assert plugin.simplify_saving("not an expression (") == "not an expression ("


# -- a transformer -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpt2_level_1_recomputes_and_gradients_match(ortcore_host, dump):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    reference = transformers.GPT2LMHeadModel(config).train()
    model = ORTModule(copy.deepcopy(reference), host=host_with(ortcore_host, dump, {"level": 1}), **STRICT)
    ids = torch.randint(0, 64, (2, 16))
    loss, expected = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    loss.backward()
    expected.backward()
    assert_grads_match(model, reference)
    executed = recompute_nodes(dump.last())
    assert any("ln_1" in name for name in executed) and any("attn" in name for name in executed), executed
