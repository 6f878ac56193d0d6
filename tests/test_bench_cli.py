"""``ortcore bench``: presets and overrides, the JSON that rebuilds every table, the plot, ``--from``, ``--explain``,
``--amp``.

The fast tests replace the worker processes with synthetic results (or, for ``--amp``, run the worker's own code in
this process); slow tests run ``ortcore bench --quick`` end to end.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import attrs
import pytest

from ortcore import cli
from ortcore_plugins.bench import commands as bench_commands
from ortcore_plugins.bench import suite as bench


# -- synthetic results -------------------------------------------------------------------------------------------
def _run(model: str, mode: str, step_ms: float, added_mib: float, n_params: int, **extra: Any) -> bench.RunResult:
    steps = [1.0 + step_ms / 1e3] + [step_ms / 1e3] * 4
    losses = [2.0, 1.9, 1.8, 1.7, 1.6 + (1e-7 if mode != "eager" else 0.0)]
    fields = dict(
        ok=True,
        setup_s=0.01,
        first_step_s=0.01 + steps[0],
        steady_step_s=step_ms / 1e3,
        step_times_s=steps,
        losses=losses,
        final_loss=losses[-1],
        rss_baseline_mib=400.0,
        rss_peak_mib=400.0 + added_mib,
        rss_peak_above_baseline_mib=added_mib,
        peak_method="kernel high-water mark",
        n_params=n_params,
        environment={"GOMP_SPINCOUNT": "10000", "torch_threads": 2, "torch": "2.x", "onnxruntime": "1.x"},
        wall_s=3.0,
        others_cpu_pct=1.0,
    )
    fields.update(extra)
    return bench.RunResult(model=model, mode=mode, **fields)


def _report(name: str, scale: float, *, failed_compile: bool = False) -> bench.BenchReport:
    cfg = bench.PRESETS[name]
    results = []
    for model, n in (("bert", int(4.6e6 * scale)), ("gpt2", int(3.2e6 * scale))):
        results.append(_run(model, "eager", 200 * scale, 200 * scale, n))
        if failed_compile and model == "bert":
            results.append(bench.RunResult(model=model, mode="compile", error="BackendCompilerFailed: no compiler"))
        else:
            results.append(_run(model, "compile", 250 * scale, 300 * scale, n, details={"graph_breaks": 1}))
        ortcore_details = {"exports": 1, "builds": 1, "reuses": 4, "fallbacks": 0, "fallback_reason": None}
        results.append(
            _run(model, "ortcore", 220 * scale, 240 * scale, n, details=ortcore_details, others_cpu_pct=40.0)
        )
    for r in results:
        r.config = name
    bench.add_ratios(results)
    return bench.BenchReport(cfg, results, dict(bench.WORKER_ENV), 30.0 * scale, name=name)


def _suite(*names: str, failed_compile: bool = False) -> bench.BenchSuite:
    scales = {"quick": 0.05, "default": 1.0, "large": 20.0}
    reports = [_report(n, scales[n], failed_compile=failed_compile) for n in names]
    return bench.BenchSuite(reports, {"cpu_count": 2, "python": "3.x"}, sum(r.wall_s for r in reports))


def _rendered(suite: bench.BenchSuite) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    bench_commands._print_suite(console, suite)
    return console.export_text()


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _expected_png_size() -> tuple[int, int]:
    w, h = bench.PLOT_SIZE_IN
    return round(w * bench.PLOT_DPI), round(h * bench.PLOT_DPI)


# -- presets and overrides ---------------------------------------------------------------------------------------
def test_presets_are_the_documented_sizes() -> None:
    assert set(bench.PRESETS) == {"default", "large", "quick"}
    assert bench.PRESETS["default"] == bench.BenchConfig()
    large = bench.PRESETS["large"]
    assert (large.hidden, large.layers, large.seq, large.batch, large.heads) == (768, 12, 256, 4, 12)
    for cfg in bench.PRESETS.values():
        cfg.validate()


def _configs(argv: list[str]) -> tuple[dict[str, bench.BenchConfig], dict[str, int]]:
    args = cli.build_parser(["bench"]).parse_args(["bench", *argv])
    return bench_commands._bench_configs(args)


def test_config_names_run_in_order_and_quick_is_an_alias() -> None:
    configs, overrides = _configs(["--config", "large,default"])
    assert list(configs) == ["large", "default"] and overrides == {}
    assert configs["large"] == bench.PRESETS["large"]
    assert _configs(["--quick"])[0] == {"quick": bench.PRESETS["quick"]}
    assert _configs([])[0] == {"default": bench.BenchConfig()}


def test_flags_override_every_config_and_only_what_they_name() -> None:
    configs, overrides = _configs(["--config", "default,large", "--hidden", "128", "--steps", "6"])
    assert overrides == {"hidden": 128, "steps": 6}
    assert configs["default"] == attrs.evolve(bench.BenchConfig(), hidden=128, steps=6)
    assert configs["large"] == attrs.evolve(bench.PRESETS["large"], hidden=128, steps=6)
    assert bench.preset("quick", batch=None, layers=3) == attrs.evolve(bench.PRESETS["quick"], layers=3)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--config", "default,huge"], "argument --config: unknown config 'huge'; allowed: default, large, quick"),
        (["--config", "large", "--quick"], "argument --quick: not allowed with argument --config"),
        (["--quick", "--steps", "2"], "--warmup (2) must be less than --steps (2) (config 'quick')"),
        (["--plot", "/nonexistent-dir/p.png"], "--plot: directory of '/nonexistent-dir/p.png' does not exist"),
        (["--from", "x.json", "--quick", "--steps", "3"], "--from redraws a saved run; --quick, --steps would need"),
        (["--from", "/nonexistent-dir/r.json"], "--from: cannot read '/nonexistent-dir/r.json'"),
    ],
)
def test_bad_bench_arguments_are_named(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_an_unknown_preset_is_refused_by_the_api_too() -> None:
    with pytest.raises(ValueError, match=r"unknown config 'huge'; allowed: default, large, quick"):
        bench.preset("huge")


def test_help_imports_no_torch() -> None:
    code = "import sys; from ortcore import cli; cli.build_parser(['bench']); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


# -- the JSON rebuilds every table -------------------------------------------------------------------------------
def test_json_round_trip_rebuilds_every_table_cell(tmp_path: Path) -> None:
    suite = _suite("quick", "default", failed_compile=True)
    suite.reports[0].explain_errors["gpt2"] = "RuntimeError: no profiler"
    before = _rendered(suite)
    assert "FAILED, see [1]" in before and "others used 40% CPU" in before and "graph breaks 1" in before
    path = tmp_path / "r.json"
    bench.write_json(suite, str(path))
    loaded = bench.load_suite(str(path))
    assert _rendered(loaded) == before
    data = json.loads(path.read_text())
    assert loaded.to_json() == data
    # The table's derived cells are in the file as shown, for readers other than ortcore.
    assert [r["notes"] for r in data["results"]][:2] == ["", "FAILED, see [1]"]
    assert all(r["notes"] in before for r in data["results"])
    assert all(line in before for c in data["configs"] for line in c["summary"])


def test_json_carries_configs_environment_and_raw_measurements(tmp_path: Path) -> None:
    suite = _suite("quick", "large")
    suite.reports[0].overrides = {"steps": 5}
    path = tmp_path / "r.json"
    bench.write_json(suite, str(path))
    data = json.loads(path.read_text())
    assert data["format"] == bench.JSON_FORMAT
    assert set(data) == {"format", "settings", "environment", "configs", "results", "wall_s"}
    assert data["settings"]["worker_env"] == {"GOMP_SPINCOUNT": "10000"}
    assert data["environment"] == {"cpu_count": 2, "python": "3.x"}
    quick, large = data["configs"]
    assert quick["name"] == "quick" and quick["overrides"] == {"steps": 5}
    assert {k: large[k] for k in ("hidden", "layers", "seq", "batch", "heads")} == {
        "hidden": 768, "layers": 12, "seq": 256, "batch": 4, "heads": 12,
    }  # fmt: skip
    assert large["n_params"] == {"bert": 92_000_000, "gpt2": 64_000_000}
    assert [(r["config"], r["model"], r["mode"]) for r in data["results"][:3]] == [
        ("quick", "bert", "eager"), ("quick", "bert", "compile"), ("quick", "bert", "ortcore"),
    ]  # fmt: skip
    first = data["results"][0]
    for key in ("step_times_s", "losses", "first_step_s", "steady_step_s", "rss_baseline_mib", "rss_peak_mib",
                "rss_peak_above_baseline_mib", "vs_eager", "others_cpu_pct", "environment", "details"):  # fmt: skip
        assert key in first


def test_a_file_without_format_one_config_inline_still_loads(tmp_path: Path) -> None:
    report = _report("default", 1.0)
    legacy = {
        "settings": {**report.config.to_dict(), "heads": 4, "worker_env": {"GOMP_SPINCOUNT": "10000"}},
        "results": [{k: v for k, v in vars(r).items() if k != "config"} for r in report.results],
        "wall_s": 30.0,
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(legacy))
    loaded = bench.load_suite(str(path))
    assert [(r.model, r.mode) for r in loaded.reports[0].results] == [(r.model, r.mode) for r in report.results]
    assert loaded.reports[0].config == report.config


def test_from_a_file_that_is_not_a_bench_result_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"loss": 1}')
    assert cli.main(["bench", "--from", str(path)]) == 2
    assert f"--from: '{path}': not an ortcore bench result file (KeyError: 'settings')" in capsys.readouterr().err


# -- the plot ----------------------------------------------------------------------------------------------------
def test_plot_from_saved_json_draws_lines_for_several_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "r.json"
    bench.write_json(_suite("quick", "default", "large"), str(source))
    drawn = []
    monkeypatch.setattr(bench, "_lines", lambda ax, *a, _f=bench._lines: drawn.append("lines") or _f(ax, *a))
    monkeypatch.setattr(bench, "_bars", lambda ax, *a, _f=bench._bars: drawn.append("bars") or _f(ax, *a))
    # Nothing may run: a worker process would fail this test.
    monkeypatch.setattr(bench, "_spawn", lambda *a, **k: pytest.fail("--from ran a worker"))
    png = tmp_path / "plot.png"
    assert cli.main(["bench", "--from", str(source), "--plot", str(png)]) == 0
    assert _png_size(png) == _expected_png_size()
    assert drawn == ["lines", "lines"]  # one panel each: steady step, memory added
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "r.json"]


def test_plot_of_one_config_draws_bars_and_tolerates_a_failed_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = []
    monkeypatch.setattr(bench, "_bars", lambda ax, *a, _f=bench._bars: drawn.append("bars") or _f(ax, *a))
    png = tmp_path / "one.png"
    bench.plot_suite(_suite("default", failed_compile=True), str(png))
    assert drawn == ["bars", "bars"] and _png_size(png) == _expected_png_size()


def test_plot_is_written_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    png = tmp_path / "plot.png"
    png.write_bytes(b"old")
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: replaced.append((src, dst)) or real_replace(src, dst))
    bench.plot_suite(_suite("quick", "default"), str(png))
    ((src, dst),) = replaced
    assert Path(src).parent == tmp_path and Path(dst) == png  # rendered beside the target, then moved into place
    assert _png_size(png) == _expected_png_size()

    def broken_savefig(self: Any, f: Any, **kwargs: Any) -> None:
        f.write(b"\x89PNG half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    before = png.read_bytes()
    with pytest.raises(RuntimeError, match="disk full"):
        bench.plot_suite(_suite("quick"), str(png))
    assert png.read_bytes() == before and os.listdir(tmp_path) == ["plot.png"]


def test_plot_without_any_successful_run_is_an_error(tmp_path: Path) -> None:
    failed = bench.RunResult(model="bert", mode="eager", error="MemoryError")
    suite = bench.BenchSuite([bench.BenchReport(bench.BenchConfig(), [failed], {}, 1.0)], {}, 1.0)
    with pytest.raises(ValueError, match="nothing to plot: no successful run"):
        bench.plot_suite(suite, str(tmp_path / "p.png"))
    assert not (tmp_path / "p.png").exists()


# -- --explain ---------------------------------------------------------------------------------------------------
def test_explain_without_the_plugin_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench, "_spawn", lambda *a, **k: pytest.fail("ran a worker although --explain cannot work"))
    monkeypatch.setenv("ORTCORE_DISABLE_PLUGINS", bench.EXPLAIN_PLUGIN)
    assert cli.main(["bench", "--quick", "--explain"]) == 2
    assert "--explain needs the op_profiler plugin, which is disabled" in capsys.readouterr().err

    monkeypatch.delenv("ORTCORE_DISABLE_PLUGINS")
    real_find_spec = bench_commands.importlib.util.find_spec
    monkeypatch.setattr(
        bench_commands.importlib.util,
        "find_spec",
        lambda name, package=None: None if name == bench.EXPLAIN_MODULE else real_find_spec(name, package),
    )
    assert cli.main(["bench", "--quick", "--explain-only"]) == 2
    assert "--explain needs the op_profiler plugin, which is not installed" in capsys.readouterr().err


def _fake_plugin(monkeypatch: pytest.MonkeyPatch, calls: list) -> None:
    """An op_profiler module with the plugin's interface, in place of the real one."""
    fake = types.ModuleType(bench.EXPLAIN_MODULE)

    def explain_bench(model_name: str, cfg: bench.BenchConfig, steps: int = 3, warmup: int = 2) -> dict:
        calls.append((model_name, cfg))
        return {"model": model_name, "categories": [{"category": "matmul", "ratio": 1.1}], "hidden": cfg.hidden}

    fake.explain_bench = explain_bench
    fake.render_explain = lambda data: f"EXPLAINED {data['model']} hidden {data['hidden']}"
    monkeypatch.setitem(sys.modules, bench.EXPLAIN_MODULE, fake)
    monkeypatch.setattr(bench_commands, "_explain_unavailable", lambda: None)


def _fake_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs and explain workers in this process: the run is synthetic, the explain worker's own code runs."""
    monkeypatch.setattr(
        bench, "run_isolated", lambda model, mode, cfg, timeout_s: _run(model, mode, cfg.hidden, cfg.hidden, cfg.hidden)
    )

    def explain_in_process(
        model: str, cfg: bench.BenchConfig, timeout_s: float, amp: str = "off"
    ) -> tuple[dict | None, str | None]:
        out = os.path.join(os.environ["BENCH_TEST_TMP"], f"{model}.json")
        bench._worker_main(["--explain", model, "--amp", amp, "--config", json.dumps(cfg.to_dict()), "--out", out])
        data = json.loads(Path(out).read_text())
        return (data["data"], None) if data["ok"] else (None, data["error"])

    monkeypatch.setattr(bench, "explain_isolated", explain_in_process)


def test_quick_is_a_smoke_run_of_the_quick_modes_and_says_what_it_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_workers(monkeypatch)
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--quick", "--json", str(out)]) == 0
    said = " ".join(capsys.readouterr().err.split())
    assert "a smoke run: modes eager, ortcore, ortcore-dynamo; compile, compile-ortcore, compile-ortcore-aot, ortcore-cached" in said
    data = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in data["results"]] == [
        (model, mode) for model in bench.MODELS for mode in bench.QUICK_MODES
    ]
    # Modes named on the command line are run as named, with or without --quick.
    assert cli.main(["bench", "--quick", "--modes", "eager,compile", "--json", str(out)]) == 0
    assert "a smoke run" not in capsys.readouterr().err
    assert [r["mode"] for r in json.loads(out.read_text())["results"]] == ["eager", "compile"] * len(bench.MODELS)


def test_explain_data_goes_into_the_json_under_each_model_and_is_rendered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list = []
    _fake_plugin(monkeypatch, calls)
    _fake_workers(monkeypatch)
    monkeypatch.setenv("BENCH_TEST_TMP", str(tmp_path))
    out = tmp_path / "r.json"
    argv = ["bench", "--config", "quick,default", "--modes", "eager,ortcore", "--explain", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "EXPLAINED bert hidden 64" in printed and "EXPLAINED gpt2 hidden 256" in printed
    assert [(m, c.hidden) for m, c in calls] == [("bert", 64), ("gpt2", 64), ("bert", 256), ("gpt2", 256)]
    data = json.loads(out.read_text())
    quick, default = data["configs"]
    assert quick["explain"]["gpt2"] == {"model": "gpt2", "categories": [{"category": "matmul", "ratio": 1.1}],
                                        "hidden": 64}  # fmt: skip
    assert set(default["explain"]) == {"bert", "gpt2"} and default["explain_errors"] == {}
    assert len(data["results"]) == 8
    # --from prints the same explain data again.
    assert cli.main(["bench", "--from", str(out)]) == 0
    assert "EXPLAINED gpt2 hidden 256" in capsys.readouterr().out


def test_explain_only_runs_no_timed_rows_and_a_failing_explain_fails_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_plugin(monkeypatch, [])
    _fake_workers(monkeypatch)
    monkeypatch.setenv("BENCH_TEST_TMP", str(tmp_path))

    def broken(model_name: str, cfg: bench.BenchConfig, steps: int = 3, warmup: int = 2) -> dict:
        raise RuntimeError(f"cannot profile {model_name}")

    sys.modules[bench.EXPLAIN_MODULE].explain_bench = broken
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--quick", "--models", "gpt2", "--explain-only", "--json", str(out)]) == 1
    assert "explain quick/gpt2 FAILED: RuntimeError: cannot profile gpt2" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["results"] == [] and data["configs"][0]["explain_errors"] == {
        "gpt2": "RuntimeError: cannot profile gpt2"
    }


def test_explain_with_the_real_plugin_in_a_fresh_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The op_profiler plugin's own explain_bench, in the worker process ``--explain`` starts (about 10 s)."""
    if problem := bench_commands._explain_unavailable():
        pytest.skip(problem)
    from ortcore_plugins.op_profiler.explain import EXPLAIN_KEYS

    out = tmp_path / "r.json"
    code = cli.main(["bench", "--quick", "--models", "gpt2", "--explain-only", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "where the time goes, config 'quick', gpt2:" in printed.out
    explained = json.loads(out.read_text())["configs"][0]["explain"]["gpt2"]
    assert set(EXPLAIN_KEYS) <= set(explained)
    assert explained["settings"]["hidden"] == bench.PRESETS["quick"].hidden


# -- the two exporters -------------------------------------------------------------------------------------------
def test_every_ortcore_mode_names_its_exporter_and_a_cached_mode_its_cold_twin() -> None:
    assert set(bench.ORTCORE_EXPORTERS) == {m for m in bench.MODES if m.startswith("ortcore")}
    assert {bench.ORTCORE_EXPORTERS[m] for m in ("ortcore", "ortcore-cached")} == {"torchscript"}
    assert {bench.ORTCORE_EXPORTERS[m] for m in ("ortcore-dynamo", "ortcore-dynamo-cached")} == {"dynamo"}
    for mode in bench.MODES:
        if mode.endswith("-cached"):
            cold = mode.removesuffix("-cached")
            assert bench.ORTCORE_EXPORTERS[cold] == bench.ORTCORE_EXPORTERS[mode]


@pytest.mark.parametrize(("mode", "exporter"), [("ortcore-cached", "torchscript"), ("ortcore-dynamo-cached", "dynamo")])
def test_a_cached_mode_fills_the_cache_with_its_own_exporter_then_reads_it(
    mode: str, exporter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[tuple[list[str], bench.BenchConfig, dict[str, str]]] = []

    def spawn(task: list[str], cfg: bench.BenchConfig, timeout_s: float, extra_env: dict | None = None) -> tuple:
        spawned.append((task, cfg, dict(extra_env or {})))
        run = _run(task[1], task[2], 10.0, 10.0, 1000, details={"exporter": exporter})
        return vars(run), "", 1.0

    monkeypatch.setattr(bench, "_spawn", spawn)
    cfg = bench.PRESETS["quick"]
    result = bench.run_isolated("gpt2", mode, cfg)
    assert result.ok and result.mode == mode
    (fill_task, fill_cfg, fill_env), (task, run_cfg, env) = spawned
    assert fill_task == ["--worker", "gpt2", mode.removesuffix("-cached")] and task == ["--worker", "gpt2", mode]
    assert (fill_cfg.steps, fill_cfg.warmup) == (1, 0) and run_cfg == cfg
    assert fill_env == env and env["ORTCORE_EXPORTER"] == exporter and os.path.basename(env["ORTMODULE_CACHE_DIR"])


@pytest.mark.parametrize(
    ("mode", "exporter"), [("eager", None), ("ortcore", "torchscript"), ("ortcore-dynamo", "dynamo")]
)
def test_a_worker_runs_on_the_exporter_its_mode_names(
    mode: str, exporter: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    spawned: list[dict[str, str]] = []

    def spawn(task: list[str], cfg: bench.BenchConfig, timeout_s: float, extra_env: dict | None = None) -> tuple:
        spawned.append(dict(extra_env or {}))
        return vars(_run(task[1], task[2], 10.0, 10.0, 1000)), "", 1.0

    monkeypatch.setattr(bench, "_spawn", spawn)
    bench.run_isolated("bert", mode, bench.PRESETS["quick"])
    assert spawned == [{"ORTCORE_EXPORTER": exporter} if exporter else {}]


def _two_exporters_report() -> bench.BenchReport:
    results = []
    for model in ("bert", "gpt2"):
        results.append(_run(model, "eager", 200, 200, 1000))
        for mode, exporter in bench.ORTCORE_EXPORTERS.items():
            details = {"exports": 1, "builds": 1, "reuses": 4, "fallbacks": 0, "exporter": exporter}
            run = _run(model, mode, 150, 100, 1000, details=details)
            if mode == "ortcore-dynamo" and model == "gpt2":
                run.losses[2] *= 1.01  # the curve drifts in the middle and meets eager's again at the end
            results.append(run)
    bench.add_ratios(results)
    return bench.BenchReport(bench.PRESETS["quick"], results, dict(bench.WORKER_ENV), 10.0, name="quick")


def test_dynamo_rows_sit_beside_torchscript_rows_and_their_loss_curves_are_compared_with_eager() -> None:
    report = _two_exporters_report()
    by_mode = {(r.model, r.mode): r for r in report.results}
    for (_model, mode), r in by_mode.items():
        if mode != "eager":
            assert r.vs_eager["steady_step_s"] == pytest.approx(0.75)
            assert r.vs_eager["max_loss_rel_diff"] is not None
    assert by_mode["gpt2", "ortcore-dynamo"].vs_eager["max_loss_rel_diff"] == pytest.approx(0.01 / 1.01)
    assert by_mode["gpt2", "ortcore-dynamo"].vs_eager["final_loss_rel_diff"] < 1e-6
    text = _rendered(bench.BenchSuite([report], {}, 10.0))
    assert "max relative difference 9.9e-03 over all 5 steps (gpt2/ortcore-dynamo)" in text
    rows = [line.split("│")[2].strip() for line in text.splitlines() if line.count("│") > 5 and "bert" in line]
    assert rows == ["eager", *bench.ORTCORE_EXPORTERS]


def test_a_row_that_ran_on_another_exporter_than_its_mode_says_so() -> None:
    report = _two_exporters_report()
    row = next(r for r in report.results if r.mode == "ortcore-dynamo")
    assert bench._notes(row, None) == "exports 1, builds 1, fallbacks 0"
    row.details["exporter"] = "torchscript"
    assert bench._notes(row, None) == "exports 1, builds 1, fallbacks 0, ran on exporter 'torchscript'"


def test_a_cached_row_says_whether_the_export_cache_served_its_graph() -> None:
    """A cache hit is not a fresh export: the cached modes' notes say which the row measured."""
    row = next(r for r in _two_exporters_report().results if r.mode == "ortcore-dynamo-cached")
    row.details["cache_loads"] = 1
    assert bench._notes(row, None) == "graphs from the export cache 1 (no export), builds 1, fallbacks 0"
    row.details["cache_loads"] = 0
    assert bench._notes(row, None) == "exports 1 (the export cache missed), builds 1, fallbacks 0"


def test_plot_draws_the_dynamo_modes_in_colours_of_their_own(tmp_path: Path) -> None:
    png = tmp_path / "two.png"
    bench.plot_suite(bench.BenchSuite([_two_exporters_report()], {}, 10.0), str(png))
    assert _png_size(png) == _expected_png_size()
    colours = [bench._MODE_COLORS[m] for m in bench.MODES]
    assert len(set(colours)) == len(colours)


# -- end to end --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_quick_runs_every_model_and_quick_mode_and_its_json_redraws_the_same_table(tmp_path: Path) -> None:
    """``ortcore bench --quick --json --plot`` through the console script (under 90 s on 2 cores)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"}
    out, png = tmp_path / "quick.json", tmp_path / "quick.png"
    argv = [sys.executable, "-m", "ortcore.cli", "bench", "--quick", "--json", str(out), "--plot", str(png)]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert [(r["model"], r["mode"]) for r in data["results"]] == [
        (model, mode) for model in bench.MODELS for mode in bench.QUICK_MODES
    ]
    for r in data["results"]:
        assert r["ok"], r["error"]
        assert r["config"] == "quick" and len(r["step_times_s"]) == bench.PRESETS["quick"].steps
        assert r["vs_eager"]["max_loss_rel_diff"] < 1e-4  # same seed, weights and batches: same loss curve
        if r["mode"] in bench.ORTCORE_EXPORTERS:  # each ortcore row on the exporter its mode names
            assert r["details"]["exporter"] == bench.ORTCORE_EXPORTERS[r["mode"]]
    assert data["configs"][0]["n_params"].keys() == {"bert", "gpt2"}
    assert _png_size(png) == _expected_png_size()

    redrawn = subprocess.run(
        [sys.executable, "-m", "ortcore.cli", "bench", "--from", str(out)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120,
    )  # fmt: skip
    assert redrawn.returncode == 0, redrawn.stderr
    table = run.stdout[: run.stdout.index("results written to")]
    assert redrawn.stdout == table


def test_a_compile_backend_row_with_some_graphs_in_pytorch_still_counts_and_says_how_many() -> None:
    """torch.compile's backend trains every model by running the graphs ORT cannot serve in PyTorch: such a row keeps
    its numbers (the notes count those graphs); it fell back only when every graph ran in PyTorch."""
    row = bench.RunResult(model="bert", mode="compile-ortcore-aot")
    row.details.update(graph_breaks=0, graphs=4, exports=4, fallbacks=2)
    assert not row.fell_back
    assert bench._notes(row, None) == "graph breaks 0, ORT graphs 4, exports 4, in PyTorch 2"
    row.details["fallbacks"] = 4
    assert row.fell_back


# -- --amp: autocast rows beside the float32 ones ----------------------------------------------------------------
def _machine(bf16: str | None = "AMX-BF16", fp16: str | None = "AVX512-FP16") -> dict[str, Any]:
    units = {"bfloat16": bf16, "float16": fp16}
    return {"cpu": "Test CPU 9000", "cores": 2, "isa": "AMX", "low_precision_units": units}


def _amp_report(amp: str = "bf16", machine: dict[str, Any] | None = None) -> bench.BenchReport:
    """Synthetic rows of ``--modes eager,ortcore --amp AMP``: the autocast rows faster, their losses a little off."""
    env = {"torch_threads": 2, "torch": "2.x", "onnxruntime": "1.x", "hardware": machine or _machine()}
    results = []
    for model in ("bert", "gpt2"):
        for mode, step_ms, added in (("eager", 200, 200), (f"eager-{amp}", 160, 150), ("ortcore", 180, 240),
                                     (f"ortcore-{amp}", 80, 120)):  # fmt: skip
            run = _run(model, mode, step_ms, added, 1000, environment=env)
            if mode.endswith(amp):
                run.losses = [x + (3e-3 if mode.startswith("eager") else 4e-3) for x in run.losses]
                run.final_loss = run.losses[-1]
            results.append(run)
    bench.add_ratios(results)
    return bench.BenchReport(bench.PRESETS["quick"], results, dict(bench.WORKER_ENV), 10.0, name="quick", amp=amp)


def test_amp_names_its_rows_after_their_float32_twins() -> None:
    assert bench.AMP_CHOICES == ("off", "bf16", "fp16")
    assert bench.with_amp(["eager", "compile", "ortcore", "ortcore-dynamo"], "bf16") == [
        "eager", "eager-bf16", "compile", "compile-bf16", "ortcore", "ortcore-bf16", "ortcore-dynamo",
    ]  # fmt: skip
    assert bench.with_amp(["eager", "ortcore"], "off") == ["eager", "ortcore"]
    assert bench.split_mode("ortcore-fp16") == ("ortcore", "fp16")
    assert bench.split_mode("ortcore-dynamo-cached") == ("ortcore-dynamo-cached", None)
    assert set(bench.AMP_MODES) <= set(bench.ALL_MODES) and not set(bench.AMP_MODES) & set(bench.MODES)
    with pytest.raises(ValueError, match=r"unknown amp setting 'fp8'; allowed: off, bf16, fp16"):
        bench.with_amp(["eager"], "fp8")


def test_amp_rows_have_ratios_to_eager_of_their_precision_and_to_float32_eager() -> None:
    report = _amp_report()
    by = {(r.model, r.mode): r for r in report.results}
    ort16, eager16, ort32 = by["gpt2", "ortcore-bf16"], by["gpt2", "eager-bf16"], by["gpt2", "ortcore"]
    assert ort16.vs_eager["steady_step_s"] == pytest.approx(80 / 160)  # ortcore bf16 / eager bf16
    assert ort16.vs_eager_fp32["steady_step_s"] == pytest.approx(80 / 200)  # ortcore bf16 / eager fp32
    assert ort16.vs_eager["rss_peak_above_baseline_mib"] == pytest.approx(120 / 150)
    assert ort16.vs_eager["max_loss_rel_diff"] == pytest.approx(1e-3 / (1.6 + 4e-3), rel=1e-3)
    assert eager16.vs_eager["steady_step_s"] == 1.0 and eager16.vs_eager_fp32["steady_step_s"] == pytest.approx(0.8)
    assert ort32.vs_eager["steady_step_s"] == pytest.approx(0.9) and ort32.vs_eager_fp32 == {}
    text = _rendered(bench.BenchSuite([report], {}, 10.0))
    assert "80.0 (0.50×; 0.40× fp32)" in text and "180.0 (0.90×)" in text and "160.0 (1.00×; 0.80× fp32)" in text
    rows = [line.split("│")[2].strip() for line in text.splitlines() if line.count("│") > 5 and "gpt2" in line]
    assert rows == ["eager", "eager-bf16", "ortcore", "ortcore-bf16"]
    # Loss agreement: float32 rows against eager, bf16 rows against eager-bf16, and how far bf16 moves eager itself.
    assert "loss curves vs eager: max relative difference 6.2e-08 over all 5 steps (bert/ortcore)" in text
    assert "bf16 loss curves vs eager-bf16: max relative difference 6.2e-04 over all 5 steps" in text
    assert "eager-bf16 vs eager (float32): max relative difference 1.9e-03 (bert): bfloat16's own rounding" in text


def test_amp_table_and_json_name_the_cpu_s_low_precision_unit(tmp_path: Path) -> None:
    report = _amp_report()
    text = " ".join(_rendered(bench.BenchSuite([report], {}, 10.0)).split())
    assert "ortcore bench on Test CPU 9000" in text
    assert ('bf16 rows: forward under torch.autocast("cpu", dtype=torch.bfloat16); this CPU\'s bfloat16 matrix '
            "unit: AMX-BF16 (best of AMX-BF16, AVX512-BF16)") in text  # fmt: skip
    assert "-bf16 rows: ratios to eager-bf16, then to float32 eager (× fp32)" in text
    path = tmp_path / "amp.json"
    bench.write_json(bench.BenchSuite([report], {}, 10.0), str(path))
    data = json.loads(path.read_text())
    (config,) = data["configs"]
    assert (config["amp"], config["amp_dtype"]) == ("bf16", "bfloat16")
    assert config["low_precision_units"] == {"bfloat16": "AMX-BF16", "float16": "AVX512-FP16"}
    ort16 = next(r for r in data["results"] if r["mode"] == "ortcore-bf16")
    assert ort16["vs_eager_fp32"]["steady_step_s"] == pytest.approx(0.4)
    # --from rebuilds the same table, the autocast line included.
    assert _rendered(bench.load_suite(str(path))) == _rendered(bench.BenchSuite([report], {}, 10.0))

    bare = _amp_report("fp16", _machine(bf16=None, fp16=None))
    text = " ".join(_rendered(bench.BenchSuite([bare], {}, 10.0)).split())
    assert ("fp16 rows: forward under torch.autocast(\"cpu\", dtype=torch.float16); this CPU has no float16 matrix "
            "unit (no AMX-FP16, no AVX512-FP16): oneDNN emulates float16, slower than float32") in text  # fmt: skip
    plain = " ".join(_rendered(_suite("quick")).split())
    assert "rows: forward under torch.autocast" not in plain and "fp32" not in plain


def test_amp_rows_plot_in_colours_of_their_own(tmp_path: Path) -> None:
    png = tmp_path / "amp.png"
    bench.plot_suite(bench.BenchSuite([_amp_report()], {}, 10.0), str(png))
    assert _png_size(png) == _expected_png_size()
    colours = [bench._MODE_COLORS[m] for m in bench.ALL_MODES]
    assert len(set(colours)) == len(colours)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--amp", "fp8"], "argument --amp: invalid choice: 'fp8' (choose from "),
        (
            ["--amp", "bf16", "--modes", "ortcore-dynamo"],
            "--amp bf16 adds autocast rows for eager, compile, ortcore; --modes names none of them",
        ),
        (["--from", "x.json", "--amp", "fp16"], "--from redraws a saved run; --amp would need a new one"),
    ],
)
def test_bad_amp_arguments_are_named(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err
    if "invalid choice" in expected:  # the allowed values, however this Python's argparse quotes them
        allowed = err[err.index("choose from") :]
        assert all(name in allowed for name in ("off", "bf16", "fp16"))


def test_an_amp_row_runs_in_its_own_worker_on_its_base_mode_s_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[tuple[list[str], dict[str, str]]] = []

    def spawn(task: list[str], cfg: bench.BenchConfig, timeout_s: float, extra_env: dict | None = None) -> tuple:
        spawned.append((task, dict(extra_env or {})))
        return vars(_run(task[1], task[2], 10.0, 10.0, 1000)), "", 1.0

    monkeypatch.setattr(bench, "_spawn", spawn)
    for mode in ("eager-bf16", "compile-fp16", "ortcore-bf16"):
        assert bench.run_isolated("gpt2", mode, bench.PRESETS["quick"]).mode == mode
    assert spawned == [
        (["--worker", "gpt2", "eager-bf16"], {}),
        (["--worker", "gpt2", "compile-fp16"], {}),
        (["--worker", "gpt2", "ortcore-bf16"], {"ORTCORE_EXPORTER": "torchscript"}),
    ]


def test_amp_bf16_trains_the_autocast_rows_in_the_worker_s_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--amp bf16`` end to end through the command, each row the worker's own code (run_worker) in this process
    instead of a fresh one (process start-up is most of a quick run): GPT-2, quick preset, 4 steps (about 10 s)."""

    def in_process(model: str, mode: str, cfg: bench.BenchConfig, timeout_s: float) -> bench.RunResult:
        result = bench.run_worker(model, mode, cfg)
        result.wall_s = 1.0
        return result

    monkeypatch.setattr(bench, "run_isolated", in_process)
    out = tmp_path / "amp.json"
    argv = ["bench", "--quick", "--models", "gpt2", "--modes", "eager,ortcore", "--amp", "bf16", "--steps", "4",
            "--json", str(out)]  # fmt: skip
    code = cli.main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    data = json.loads(out.read_text())
    by_mode = {r["mode"]: r for r in data["results"]}
    assert list(by_mode) == ["eager", "eager-bf16", "ortcore", "ortcore-bf16"]
    for r in data["results"]:
        assert r["ok"], r["error"]
        times = [r["first_step_s"], r["steady_step_s"], r["rss_peak_mib"], *r["step_times_s"]]
        assert len(r["step_times_s"]) == 4 and all(math.isfinite(t) and t > 0 for t in times), r["mode"]
        assert all(math.isfinite(x) for x in r["losses"])
    ort16, eager16 = by_mode["ortcore-bf16"], by_mode["eager-bf16"]
    assert ort16["details"]["autocast"] == eager16["details"]["autocast"] == "cpu bfloat16"
    assert ort16["details"]["fallbacks"] == 0
    # ortcore under autocast computes eager autocast's numbers, within bf16's rounding.
    assert all(abs(a - b) <= 0.05 for a, b in zip(ort16["losses"], eager16["losses"]))
    assert ort16["vs_eager"]["max_loss_rel_diff"] < 0.01 and ort16["vs_eager_fp32"]["steady_step_s"] > 0
    assert data["configs"][0]["amp"] == "bf16"
    assert set(data["configs"][0]["low_precision_units"]) == {"bfloat16", "float16"}
    assert "bf16 loss curves vs eager-bf16: max relative difference" in printed.out
    assert "bf16 rows: forward under torch.autocast" in printed.out


def test_explain_under_amp_asks_the_plugin_for_the_autocast_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list = []
    _fake_plugin(monkeypatch, calls)
    _fake_workers(monkeypatch)
    monkeypatch.setenv("BENCH_TEST_TMP", str(tmp_path))
    fake = sys.modules[bench.EXPLAIN_MODULE]
    # A plugin written before autocast (no amp parameter) still serves float32: the bench passes no amp then.
    assert cli.main(["bench", "--quick", "--models", "gpt2", "--explain-only"]) == 0
    amps: list = []

    def explain_bench(model_name: str, cfg: bench.BenchConfig, steps: int = 3, warmup: int = 2, amp: Any = None):
        amps.append(amp)
        return {"model": model_name, "hidden": cfg.hidden}

    fake.explain_bench = explain_bench
    assert cli.main(["bench", "--quick", "--models", "gpt2", "--explain-only", "--amp", "fp16"]) == 0
    assert cli.main(["bench", "--quick", "--models", "gpt2", "--explain-only", "--amp", "bf16"]) == 0
    assert amps == ["float16", "bfloat16"]
    assert "gpt2 / explain (op_profiler, autocast bfloat16)" in capsys.readouterr().err


def test_explain_under_amp_with_the_real_plugin_profiles_the_autocast_step(tmp_path: Path) -> None:
    """The op_profiler plugin's explain_bench under autocast, through the explain worker's entry (in this process;
    about 10 s): both sides' forward under autocast bf16, their losses within bf16 rounding of each other."""
    if problem := bench_commands._explain_unavailable():
        pytest.skip(problem)
    out = tmp_path / "explain.json"
    cfg = bench.PRESETS["quick"]
    argv = ["--explain", "gpt2", "--amp", "bf16", "--config", json.dumps(cfg.to_dict()), "--out", str(out)]
    assert bench._worker_main(argv) == 0, out.read_text()
    data = json.loads(out.read_text())["data"]
    assert data["settings"]["amp"] == "bfloat16"
    eager, ortcore = data["losses"]["eager"], data["losses"]["ortcore"]
    assert len(eager) == len(ortcore) > 0 and all(abs(a - b) <= 0.05 for a, b in zip(eager, ortcore))
    # matrix products under autocast on PyTorch's bf16 kernels inside the ORT graph, where the CPU has the units
    assert any(row["category"] == "matmul/gemm" for row in data["categories"])


@pytest.mark.slow
def test_amp_bf16_through_the_console_script_in_fresh_processes(tmp_path: Path) -> None:
    """``ortcore bench --quick --amp bf16``, every row in its own worker process (about 50 s on 2 cores)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "200"}
    out = tmp_path / "amp.json"
    argv = [sys.executable, "-m", "ortcore.cli", "bench", "--quick", "--models", "gpt2", "--modes", "eager,ortcore",
            "--amp", "bf16", "--json", str(out)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    by_mode = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert list(by_mode) == ["eager", "eager-bf16", "ortcore", "ortcore-bf16"]
    assert all(r["ok"] for r in by_mode.values())
    assert abs(by_mode["ortcore-bf16"]["final_loss"] - by_mode["eager-bf16"]["final_loss"]) <= 0.05
    assert by_mode["ortcore"]["vs_eager"]["max_loss_rel_diff"] < 1e-4
