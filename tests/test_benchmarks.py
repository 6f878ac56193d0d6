"""The plugin benchmarks in ``benchmarks/``: their summaries, their input checks, and (slow) one run at the smallest
setting, whose losses must agree with PyTorch's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64, "batch": 2, "seq": 16, "steps": 2}


def load_bench(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def attention_bench() -> ModuleType:
    return load_bench("efficient_attention_bench")


@pytest.fixture(scope="module")
def recompute_bench() -> ModuleType:
    return load_bench("memory_recompute_bench")


# -- efficient_attention --------------------------------------------------------------------------------------------


def test_attention_bench_summary_gives_ratios_to_plugin_off(attention_bench: ModuleType) -> None:
    def result(setting: str, wall: list[float], cpu: list[float], peak: float, replaced: int | None) -> dict:
        return {"attn": "eager", "setting": setting, "replaced": replaced, "times": {"wall": wall, "cpu": cpu},
                "peak_rss_mib": peak, "first_step_s": 1.0, "loss": 2.0}  # fmt: skip

    rows = attention_bench.summarize(
        [result("torch", [0.3, 0.2, 0.4], [0.5, 0.6, 0.4], 900.0, None),
         result("off", [0.2, 0.1, 0.3], [0.2, 0.2, 0.2], 1000.0, 0),
         result("on", [0.1, 0.05, 0.2], [0.1, 0.3, 0.1], 800.0, 4)]
    )  # fmt: skip
    assert rows[0][:9] == ("eager", "PyTorch eager", "-", "300", "1.50", "500", "2.50", "900", "0.90")
    assert rows[2][:9] == ("eager", "ortcore, plugin on", 4, "100", "0.50", "100", "0.50", "800", "0.80")


def test_attention_bench_refuses_an_unknown_setting_naming_the_allowed_ones(attention_bench: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"unknown benchmark setting\(s\) \['fast'\]; allowed: torch, off, on"):
        attention_bench.bench_efficient_attention(["fast"])


@pytest.mark.slow
def test_attention_bench_runs_every_setting_and_the_plugin_fires(attention_bench: ModuleType) -> None:
    results = attention_bench.bench_efficient_attention(spec=TINY_GPT2)
    assert [(r["setting"], r["replaced"]) for r in results] == [("torch", None), ("off", 0), ("on", 2)]
    losses = [r["loss"] for r in results]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), results  # rounding, not rounded digits


# -- memory_recompute -----------------------------------------------------------------------------------------------


def test_recompute_bench_settings_are_torch_and_every_level(recompute_bench: ModuleType) -> None:
    import ortcore_plugins.memory_recompute as plugin

    assert recompute_bench.BENCH_SETTINGS == ("torch", *(str(level) for level in sorted(plugin.LEVELS)))


def test_recompute_bench_refuses_an_unknown_setting_naming_the_allowed_ones(recompute_bench: ModuleType) -> None:
    with pytest.raises(ValueError, match=r"unknown benchmark setting\(s\) \['3'\]; allowed: torch, 0, 1, 2"):
        recompute_bench.bench_memory_recompute(["torch", "3"])


def test_recompute_bench_command_line_names_a_bad_setting() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "memory_recompute_bench.py"), "--settings", "torch,fast"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--settings 'torch,fast': unknown ['fast']; allowed: torch, 0, 1, 2" in done.stderr


@pytest.mark.slow
def test_recompute_bench_level_1_trains_as_pytorch_does(recompute_bench: ModuleType) -> None:
    results = recompute_bench.bench_memory_recompute(("torch", "1"), spec=TINY_GPT2)
    assert [r["setting"] for r in results] == ["torch", "1"]
    torch_loss, ort_loss = (r["loss"] for r in results)
    assert abs(ort_loss - torch_loss) <= 1e-4 * abs(torch_loss), results  # the first step's loss, same seed and data
    assert all(r["peak_rss_mib"] > 0 and r["step_s"] > 0 for r in results), results


# -- before_after ---------------------------------------------------------------------------------------------------


def test_first_step_breakdown_times_functions_that_exist() -> None:
    """Each stage it wraps is still where it looks (a rename in the pipeline must not break the script)."""
    bench = load_bench("first_step_breakdown")
    for owner, attribute, label in bench.STAGES:
        assert callable(getattr(bench.stage_owner(owner), attribute, None)), f"{owner}.{attribute} ({label})"


def test_before_after_refuses_an_env_that_is_not_name_value(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("before_after")
    with pytest.raises(SystemExit):
        bench.main(["--before", ".", "--env", "ORTCORE_VERIFY_GRADIENTS"])
    assert "'ORTCORE_VERIFY_GRADIENTS' is not NAME=VALUE" in capsys.readouterr().err


@pytest.mark.slow  # two fresh processes, each exporting and training BERT for a few steps
def test_before_after_of_a_tree_against_itself_reports_both_sides_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    root = str(BENCHMARKS.parent)
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "before_after.py"), "--before", root, "--after", root]
        + ["--models", "bert", "--rounds", "1", "--steps", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPU: " in done.stdout and "bert   after/before: first step x" in done.stdout
    summary = json.loads(out.read_text())["summary"]["bert"]
    assert set(summary) == {"before", "after"}
    assert all(side["steady_ms"] > 0 and side["first_step_s"] > 0 for side in summary.values())
