"""The zoo under torch.autocast (``tests.zoo.autocast``): the pass criterion, its records and page section (fast), and
a few models trained under bfloat16 autocast (slow)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from .autocast import EAGER_FACTOR, UNIT_ROUNDOFF, criterion, judge, off_by
from .catalog import MODELS
from .harness import run_model
from .report import (
    autocast_record_path,
    load_autocast_records,
    main,
    make_autocast_record,
    read_results,
    render_autocast,
)

EXACT = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)


def _off(by: float) -> torch.Tensor:
    """``EXACT`` with its last element moved by ``by`` (max abs error ``by``)."""
    return EXACT + torch.tensor([0.0, 0.0, by], dtype=torch.float64)


def test_ortcore_within_twice_eager_autocasts_own_error_passes() -> None:
    floor = UNIT_ROUNDOFF["bf16"] * 4.0
    eager = _off(0.1)
    assert judge(_off(0.1), eager, EXACT, "bf16")["ok"]
    assert judge(_off(2 * 0.1 + floor * 0.99), eager, EXACT, "bf16")["ok"]
    entry = judge(_off(2 * 0.1 + floor * 1.01), eager, EXACT, "bf16")
    assert not entry["ok"] and entry["ratio"] > 1
    assert entry["allowed"] == pytest.approx(EAGER_FACTOR * 0.1 + floor)


def test_the_floor_is_one_rounding_of_the_largest_element() -> None:
    """Eager exact to the last bit: ortcore may still be one rounding to the autocast type away, not more."""
    for dtype, u in UNIT_ROUNDOFF.items():
        assert judge(_off(4.0 * u * 0.9), EXACT, EXACT, dtype)["ok"], dtype
        assert not judge(_off(4.0 * u * 1.1), EXACT, EXACT, dtype)["ok"], dtype
    assert UNIT_ROUNDOFF == {"bf16": 2.0**-8, "fp16": 2.0**-11}
    assert "2·max|eager autocast − float64| + 1·2^-8·max|float64|" in criterion("bf16")


def test_missing_nan_and_shape_errors_fail_and_none_on_every_side_passes() -> None:
    assert judge(None, None, None, "bf16")["ok"]
    assert not judge(None, _off(0.0), EXACT, "bf16")["ok"]  # a gradient ortcore lost counts as zeros
    assert not judge(torch.full((3,), math.nan), _off(0.1), EXACT, "bf16")["ok"]
    assert not judge(torch.zeros(2), _off(0.1), EXACT, "bf16")["ok"]


def test_a_failing_tensor_names_eager_autocasts_spread_on_perturbed_batches() -> None:
    entry = judge(_off(1.0), _off(0.1), EXACT, "bf16")
    assert "rounding luck" not in off_by("w", {**entry, "perturbed_eager_vs_f64": 0.5})
    assert "up to 1.2 from float64 (as far as ortcore: rounding luck)" in off_by(
        "w", {**entry, "perturbed_eager_vs_f64": 1.2}
    )


def _result(name: str, status: str = "pass", dtype: str = "bf16", **extra) -> dict:
    base = {
        "model": name,
        "family": MODELS[name].family,
        "description": MODELS[name].description,
        "autocast": dtype,
        "exporter": "torchscript",
        "status": status,
        "phase": "done",
        "in_ort": True,
        "clean": True,
        "repairs": [],
        "counters": {"exports": 1, "fallbacks": 0},
        "routed_ops": [{"op": "linear", "count": 3}],
        "checks": {
            "loss": judge(_off(0.0), _off(0.0), EXACT, dtype),
            "grads": {"w": judge(_off(0.1), _off(0.1), EXACT, dtype)},
        },
        "worst_ratio": 0.5,
    }
    return {**base, **extra}


def test_the_section_counts_passes_and_names_each_failures_cause() -> None:
    bad = judge(_off(1.0), _off(0.1), EXACT, "bf16")
    results = [
        _result("conv1d"),
        _result(
            "bert",
            status="mismatch",
            off=[{"name": "bert.pooler.dense.weight", **bad}],
            failed_checks=["1/1 gradients"],
        ),
        _result(
            "gpt2",
            status="error",
            phase="first ortcore backward",
            error={"type": "RuntimeError", "first_line": "no kernel for BFloat16 Foo"},
        ),
    ]
    record = make_autocast_record("bf16", "torchscript", results, 60.0, "run", "abc")
    assert list(record["models"]) == ["bert", "gpt2", "conv1d"]  # catalog order
    page = render_autocast("bf16", record)
    assert page.startswith("## Under bf16 autocast")
    assert "**bf16 autocast: 1/3 pass (1 error, 1 mismatch); 1 of the 1 with no repairs**" in page
    assert "bert.pooler.dense.weight 1 from float64, allowed 0.2" in page
    assert "RuntimeError: no kernel for BFloat16 Foo" in page


def test_results_under_another_autocast_type_are_refused(tmp_path: Path) -> None:
    (tmp_path / "conv1d.json").write_text(json.dumps(_result("conv1d", dtype="fp16")))
    with pytest.raises(ValueError, match="run under fp16, not bf16"):
        read_results(tmp_path, ["conv1d"], "torchscript", autocast="bf16")
    with pytest.raises(ValueError, match="run under fp16, not no autocast"):
        read_results(tmp_path, ["conv1d"], "torchscript")
    assert read_results(tmp_path, ["conv1d"], "torchscript", autocast="fp16")[0]["status"] == "pass"


def test_recording_autocast_results_keeps_the_routes_records(tmp_path: Path) -> None:
    records, page, results = tmp_path / "records", tmp_path / "models.md", tmp_path / "results"
    records.mkdir()
    results.mkdir()
    torchscript = autocast_record_path("bf16").with_name("torchscript.json")
    (records / "torchscript.json").write_text(torchscript.read_text())
    (results / "conv1d.json").write_text(json.dumps(_result("conv1d")))
    main(
        ["--autocast", "bf16", "--results", str(results), "--models", "conv1d"]
        + ["--records", str(records), "--out", str(page), "--commit", "abc"]
    )
    assert (records / "torchscript.json").read_text() == torchscript.read_text()
    assert list(load_autocast_records(records)) == ["bf16"]
    text = page.read_text()
    assert "## Under bf16 autocast" in text and "## Results" in text
    assert "| conv1d | torch | ✅ pass |" in text


@pytest.mark.parametrize(
    "argv",
    [
        ["--autocast", "bf16", "--catalog", "wide"],
        ["--autocast", "bf16", "--exporter", "dynamo"],
        ["--autocast", "int8"],
    ],
)
def test_autocast_runs_the_main_zoo_on_the_default_route(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv + ["--render"])


def test_the_bf16_record_holds_every_model_of_the_main_zoo() -> None:
    record = load_autocast_records().get("bf16")
    assert record is not None, "no records/autocast-bf16.json; run python -m tests.zoo.report --autocast bf16"
    assert list(record["models"]) == list(MODELS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conv1d", "bert", "gpt2"])
def test_model_trains_under_bf16_autocast_as_accurately_as_eager(name: str, tmp_path: Path) -> None:
    result = run_model(name, tmp_path, autocast="bf16")
    from .autocast import describe

    assert result["status"] == "pass", f"{name}: {describe(result)}"
    assert result["clean"], f"{name}: repairs {result['repairs']}, counters {result['counters']}"
