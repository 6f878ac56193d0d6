"""docs/models.md is what the zoo's records render to, and the zoo's pieces that read it agree with it (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .catalog import MODELS
from .catalogs import models
from .failures import BY_KEY, CATEGORIES, categorize
from .harness import EXPORTERS, child_env, run_model
from .report import (
    DEFAULT_OUT,
    REGENERATE,
    WIDE,
    documented_statuses,
    load_records,
    main,
    make_record,
    read_results,
    render,
    render_page,
)


def _error(first_line: str, type_: str = "UnsupportedModelError") -> dict:
    return {
        "model": "conv1d",
        "family": "torch",
        "description": "conv",
        "status": "error",
        "phase": "first ortcore step (export, build, forward)",
        "error": {"type": type_, "first_line": first_line, "message": first_line},
    }


def test_page_is_what_the_records_render_to() -> None:
    records = load_records()
    assert set(records) == set(EXPORTERS), f"missing records; run {REGENERATE}"
    assert DEFAULT_OUT.read_text() == render_page(), f"docs/models.md is stale or edited by hand; run {REGENERATE}"


def test_wide_zoo_is_another_40_models_each_described_and_recorded() -> None:
    wide = models(WIDE)
    assert len(wide) >= 40
    assert not set(wide) & set(MODELS), "the wide zoo repeats models of the main zoo"
    assert all(m.description for m in wide.values())
    record = load_records(catalog=WIDE).get(EXPORTERS[0])
    assert record is not None, f"no record of the wide zoo; run {REGENERATE} --catalog wide --exporter {EXPORTERS[0]}"
    assert list(record["models"]) == list(wide)


def test_a_curve_point_within_the_perturbed_eager_spread_passes() -> None:
    from .run_model import _judge_by_perturbed, compare

    def check(ortcore: float, eager: float, perturbed: float) -> dict:
        entry = compare(torch.tensor(ortcore), torch.tensor(eager), None)
        _judge_by_perturbed(entry, ortcore, eager, perturbed)
        return entry

    assert check(1.003, 1.0, 1.001)["judged_by"] == "perturbed eager"  # 3x the spread float32 itself shows
    assert not check(1.1, 1.0, 1.001)["ok"]  # 100x: not rounding
    assert not check(1.003, 1.0, 1.0)["ok"]  # no spread at all
    assert "judged_by" not in check(1.0, 1.0, 1.1)  # within tolerance: judged as before


def test_ort_op_share_counts_aten_and_python_op_nodes_as_pytorch() -> None:
    import types

    import onnx.helper as h

    from .run_model import ort_op_share

    nodes = [
        h.make_node("MatMul", ["a", "b"], ["c"]),
        h.make_node("ATen", ["c"], ["d"], domain="org.pytorch.aten", operator="gelu"),
        h.make_node("YieldOp", ["d"], ["e"], domain="com.microsoft"),
        h.make_node("PythonOpGrad", ["e"], ["f"], domain="com.microsoft", func_name="mod.Fn"),
        h.make_node("Add", ["f", "f"], ["g"]),
    ]
    nodes.append(h.make_node("PythonOp", ["w", "g"], ["y"], domain="com.microsoft", func_name="RegionFunction"))
    model = h.make_model(h.make_graph(nodes, "g", [], []))
    module = torch.nn.Module()
    module.w, module.v = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(2))
    session = types.SimpleNamespace(model=model)
    ort = types.SimpleNamespace(state_machine=types.SimpleNamespace(current=(None, session)), module=module)
    share = ort_op_share(ort)
    assert share["nodes"] == 5 and share["ort_nodes"] == 2 and share["share"] == 0.4
    assert share["pytorch_nodes"] == {"ATen:gelu": 1, "PythonOp:RegionFunction": 1, "PythonOpGrad:mod.Fn": 1}
    assert share["param_share"] == 0.25 and share["params_in_python_ops"] == ["w"]  # a region takes 6 of 8 elements


def test_page_documents_every_model_on_every_route() -> None:
    statuses = documented_statuses(DEFAULT_OUT.read_text())
    assert list(statuses) == list(EXPORTERS)
    for route, by_model in statuses.items():
        assert list(by_model) == list(MODELS), route
        assert set(by_model.values()) <= {"pass", "error", "mismatch", "crash", "timeout", "not run"}, route


def test_documented_statuses_reads_the_rendered_table() -> None:
    passing = {"model": "conv1d", "family": "torch", "status": "pass"}
    records = {
        "torchscript": make_record("torchscript", [passing], 1.0, "run", "abc"),
        "dynamo": make_record(
            "dynamo", [_error("exported graph has inputs that are neither arguments nor state")], 1.0, "run", "abc"
        ),
    }
    assert documented_statuses(render(records)) == {"torchscript": {"conv1d": "pass"}, "dynamo": {"conv1d": "error"}}


@pytest.mark.parametrize("category", CATEGORIES, ids=lambda c: c.key)
def test_each_category_has_a_cause_and_recognises_its_own_error(category) -> None:
    assert category.label and category.cause
    record = make_record("dynamo", [_error(category.patterns[0].replace("\\", ""))], 1.0, "run", "abc")
    assert record["models"]["conv1d"]["category"] == category.key


def test_an_unrecognised_error_is_other_and_a_mismatch_is_its_own_cause() -> None:
    assert categorize(_error("something new")) is BY_KEY["other"]
    assert categorize({"status": "mismatch"}) is BY_KEY["mismatch"]
    assert categorize({"status": "pass"}) is None


def test_results_of_another_route_are_refused(tmp_path: Path) -> None:
    (tmp_path / "conv1d.json").write_text(json.dumps({**_error("x"), "exporter": "dynamo"}))
    with pytest.raises(ValueError, match="'dynamo' exporter, not 'torchscript'"):
        read_results(tmp_path, ["conv1d"], "torchscript")
    assert read_results(tmp_path, ["conv1d"], "dynamo")[0]["status"] == "error"


def test_rerunning_one_route_keeps_the_other_routes_record(tmp_path: Path) -> None:
    records, page = tmp_path / "records", tmp_path / "models.md"
    for route in EXPORTERS:
        (tmp_path / route).mkdir()
        (tmp_path / route / "conv1d.json").write_text(json.dumps({**_error(f"{route} failed"), "exporter": route}))
        main(
            ["--exporter", route, "--results", str(tmp_path / route), "--models", "conv1d"]
            + ["--records", str(records), "--out", str(page), "--commit", "abc"]
        )
    kept = json.loads((records / "torchscript.json").read_text())
    (tmp_path / "dynamo" / "conv1d.json").write_text(
        json.dumps({**_error("x"), "status": "pass", "exporter": "dynamo"})
    )
    main(
        ["--exporter", "dynamo", "--results", str(tmp_path / "dynamo"), "--models", "conv1d"]
        + ["--records", str(records), "--out", str(page), "--commit", "def"]
    )
    assert json.loads((records / "torchscript.json").read_text()) == kept
    assert documented_statuses(page.read_text()) == {"torchscript": {"conv1d": "error"}, "dynamo": {"conv1d": "pass"}}


def test_child_process_gets_the_route_and_nothing_else_of_ortcore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTCORE_EXPORTER", "torchscript")
    monkeypatch.setenv("ORTCORE_SOMETHING", "1")
    env = child_env("dynamo")
    assert env["ORTCORE_EXPORTER"] == "dynamo" and "ORTCORE_SOMETHING" not in env
    with pytest.raises(ValueError, match="allowed: torchscript, dynamo"):
        child_env("onnx")
    with pytest.raises(ValueError, match="not a zoo route"):
        run_model("conv1d", Path("."), exporter="onnx")


@pytest.mark.slow
@pytest.mark.parametrize("category", [c for c in CATEGORIES if c.repro], ids=lambda c: c.key)
def test_each_repro_still_fails_as_its_category_says(category) -> None:
    """A repro that stops failing means the exporter fixed that cause: drop the category (or its repro) then."""
    from .failures import run_repro

    still, last = run_repro(category)
    assert still, f"{category.key}'s repro no longer fails with {category.patterns}; last stderr line: {last}"
