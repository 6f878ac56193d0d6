"""The ``ortcore`` console command: ``demo``, ``bench`` and argument errors."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from ortcore import cli
from ortcore_plugins.bench import suite as bench
from ortcore_plugins.demo.run import DemoConfig, DemoResult, RunCurve

TINY_BENCH = ["--steps", "3", "--warmup", "1", "--hidden", "64", "--layers", "1", "--seq", "16", "--batch", "2"]


def _rows(out: str) -> list[list[str]]:
    """The demo's table rows: lines that start with a step number."""
    return [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]


# -- demo --------------------------------------------------------------------------------------------------------
def test_demo_prints_both_curves(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "torch loss" in out and "ortcore loss" in out and "rel diff" in out
    rows = _rows(out)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for row in rows:
        torch_loss, ort_loss, rel = float(row[1]), float(row[2]), float(row[3])
        assert math.isfinite(torch_loss) and torch_loss > 0
        assert rel <= 1e-4 and abs(torch_loss - ort_loss) <= 1e-4 * torch_loss
    summary = next(line for line in out.splitlines() if line.startswith("summary:"))
    assert "max rel loss diff" in summary and "first step" in summary and "median steady step" in summary
    assert summary.endswith("OK (limit 1e-04)")


def _demo_result(torch_losses: list[float], ort_losses: list[float], fallbacks: int = 0) -> DemoResult:
    times = [0.1] + [0.01] * (len(torch_losses) - 1)
    return DemoResult(
        config=DemoConfig(steps=len(torch_losses)),
        n_params=1,
        torch_run=RunCurve(torch_losses, times),
        ortcore_run=RunCurve(ort_losses, times),
        counters={"exports": 1, "builds": 1, "reuses": 0, "fallbacks": fallbacks},
        fallback_reason="GraphBuildError: no" if fallbacks else None,
    )


def test_demo_verdict() -> None:
    assert _demo_result([2.0, 1.0], [2.0, 1.00001]).passed
    diverged = _demo_result([2.0, 1.0], [2.0, 1.001])
    assert not diverged.passed and diverged.max_rel_diff == pytest.approx(1e-3, rel=1e-3)
    assert not _demo_result([2.0, 1.0], [2.0, float("nan")]).passed
    # Identical curves prove nothing if ortcore quietly ran the model in PyTorch.
    assert not _demo_result([2.0, 1.0], [2.0, 1.0], fallbacks=1).passed
    assert _demo_result([2.0], [2.0]).torch_run.steady_step_s is None


def test_demo_fails_with_nonzero_exit_when_curves_differ(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("ortcore_plugins.demo.run.run_demo", lambda cfg: _demo_result([2.0, 1.0], [2.0, 1.5]))
    assert cli.main(["demo", "--steps", "2"]) == 1
    assert "FAIL: curves differ" in capsys.readouterr().out


# -- bench -------------------------------------------------------------------------------------------------------
def test_bench_writes_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "out.json"
    code = cli.main(["bench", "--models", "gpt2", "--modes", "eager,ortcore", *TINY_BENCH, "--json", str(path)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "GOMP_SPINCOUNT=10000" in captured.out and "peak − base" in captured.out
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind

    data = json.loads(path.read_text())
    assert data["format"] == bench.JSON_FORMAT
    (config,) = data["configs"]
    assert {k: config[k] for k in ("steps", "warmup", "hidden", "layers", "seq", "batch")} == {
        "steps": 3,
        "warmup": 1,
        "hidden": 64,
        "layers": 1,
        "seq": 16,
        "batch": 2,
    }
    assert data["settings"]["worker_env"] == {"GOMP_SPINCOUNT": "10000"}
    results = {r["mode"]: r for r in data["results"]}
    assert list(results) == ["eager", "ortcore"]
    for r in results.values():
        assert r["model"] == "gpt2" and r["ok"] and r["error"] is None, r
        assert r["environment"]["GOMP_SPINCOUNT"] == "10000"  # seen inside the worker, not only requested
        assert len(r["step_times_s"]) == len(r["losses"]) == 3
        assert all(t > 0 for t in r["step_times_s"])
        assert r["first_step_s"] >= r["step_times_s"][0] > 0
        assert r["steady_step_s"] == pytest.approx(statistics.median(r["step_times_s"][1:]))
        assert 50 < r["rss_baseline_mib"] <= r["rss_peak_mib"] < 8192
        assert r["rss_peak_above_baseline_mib"] == pytest.approx(r["rss_peak_mib"] - r["rss_baseline_mib"])
        assert math.isfinite(r["final_loss"]) and r["final_loss"] == r["losses"][-1]
        assert math.log(8000) * 0.9 < r["losses"][0] < math.log(8000) * 1.1  # random init: about ln(vocab)
        assert set(r["vs_eager"]) >= {"first_step_s", "steady_step_s", "rss_peak_above_baseline_mib"}
    assert results["eager"]["vs_eager"]["steady_step_s"] == 1.0
    ort = results["ortcore"]
    assert ort["details"]["exports"] == 1 and ort["details"]["builds"] == 1 and ort["details"]["fallbacks"] == 0
    assert ort["final_loss"] == pytest.approx(results["eager"]["final_loss"], rel=1e-4)
    assert ort["vs_eager"]["final_loss_rel_diff"] < 1e-4 and ort["vs_eager"]["max_loss_rel_diff"] < 1e-4
    assert all(r["others_cpu_pct"] is None or 0 <= r["others_cpu_pct"] <= 100 for r in data["results"])
    assert "loss curves vs eager: max relative difference" in captured.out


@pytest.mark.slow
def test_bench_compile_and_console_script(tmp_path) -> None:
    """The real entry point with every mode (torch.compile alone takes 20-60 s on 2 cores)."""
    path = tmp_path / "all.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ortcore.cli", "bench", "--models", "gpt2", *TINY_BENCH, "--json", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(path.read_text())["results"]
    assert [(r["model"], r["mode"]) for r in results] == [("gpt2", mode) for mode in bench.MODES]
    for r in results:
        assert r["ok"], r["error"]
        assert r["vs_eager"]["max_loss_rel_diff"] < 1e-4
    by_mode = {r["mode"]: r for r in results}
    for mode in ("ortcore-cached", "ortcore-dynamo-cached"):  # a second process on the cache a one-step run filled
        assert by_mode[mode]["details"]["fallbacks"] == 0, mode


def test_worker_failure_becomes_an_error_result() -> None:
    # The CLI rejects unknown modes up front; the worker must still fail cleanly if handed one.
    cfg = bench.BenchConfig(steps=2, warmup=1, hidden=64, layers=1, seq=8, batch=1)
    result = bench.run_isolated("gpt2", "nonsense", cfg)
    assert not result.ok
    assert "unknown mode 'nonsense'" in result.error and result.wall_s > 0


def test_failed_run_is_shown_in_its_row() -> None:
    ok = bench.RunResult(
        model="bert",
        mode="eager",
        ok=True,
        setup_s=0.0,
        first_step_s=0.5,
        steady_step_s=0.1,
        step_times_s=[0.5, 0.1],
        losses=[0.7, 0.69],
        final_loss=0.69,
        rss_baseline_mib=400.0,
        rss_peak_mib=500.0,
        rss_peak_above_baseline_mib=100.0,
        others_cpu_pct=55.0,
    )
    failed = bench.RunResult(model="bert", mode="compile", error="BackendCompilerFailed: no C++ compiler")
    report = bench.BenchReport(bench.BenchConfig(), [ok, failed], dict(bench.WORKER_ENV), 1.0)
    bench.add_ratios(report.results)
    assert not report.ok and failed.vs_eager == {}

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(bench.results_table(report))
    text = console.export_text()
    assert "FAILED, see [1]" in text and "100 (1.00×)" in text
    # Times measured while other processes used the CPU are flagged, not silently reported.
    assert "others used 55% CPU" in text
    lines = bench.summary_lines(report)
    assert any(line.startswith("[1] bert/compile: BackendCompilerFailed") for line in lines)
    assert any(line.startswith("warning: other processes took CPU during 1 run(s)") for line in lines)


def test_others_cpu_share_is_a_percentage() -> None:
    probe = bench.OthersCPU()
    sum(i * i for i in range(300_000))  # our own work must not count as someone else's
    share = probe.stop()
    assert share is None or 0.0 <= share <= 100.0


def test_write_json_is_atomic(tmp_path) -> None:
    report = bench.BenchReport(bench.BenchConfig(), [], {}, 0.0)
    path = tmp_path / "r.json"
    path.write_text("old")
    bench.write_json(report, str(path))
    assert json.loads(path.read_text())["results"] == []
    assert os.listdir(tmp_path) == ["r.json"]


# -- argument errors ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "--models", "bert,llama"], "unknown model 'llama'; allowed: bert, gpt2"),
        (
            ["bench", "--modes", "eager,jax"],
            "unknown mode 'jax'; allowed: eager, compile, compile-ortcore, compile-ortcore-aot, ortcore",
        ),
        (["bench", "--models", ","], "comma-separated list of models from: bert, gpt2"),
        (["bench", "--steps", "3", "--warmup", "3"], "--warmup (3) must be less than --steps (3)"),
        (["bench", "--batch", "0"], "expected a positive integer, got 0"),
        (["bench", "--json", "/nonexistent-dir/x.json"], "does not exist"),
        (["demo", "--steps", "many"], "expected a positive integer, got 'many'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err


def test_no_subcommand_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "demo" in err and "bench" in err


# -- explain -----------------------------------------------------------------------------------------------------
def explain_factory():
    """A model for ``ortcore explain test_cli:explain_factory``: a Linear (ORT) and a HardSwish (PyTorch)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Hardswish()), (torch.randn(2, 4),)


def test_explain_lists_where_each_op_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["explain", "test_cli:explain_factory"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["hardswish"].split()[1:4] == ["PyTorch", "1", "1"]
    assert "ORT has no gradient builder for HardSwish" in rows["hardswish"]
    assert rows["Gemm"].split()[1] == "ORT"
    assert "1 op kind(s) run on PyTorch's kernels" in out


@pytest.mark.parametrize("spec", ["no_such_module:f", "test_cli:no_such_function", "justaname"])
def test_explain_names_a_bad_model(capsys: pytest.CaptureFixture[str], spec: str) -> None:
    assert cli.main(["explain", spec]) == 2
    assert spec in capsys.readouterr().err


# -- plugin commands and start-up cost ---------------------------------------------------------------------------
# Runs the command in a fresh interpreter and reports whether torch was imported (the exit code is the command's).
DRIVER = """
import sys
from ortcore.cli import main
code = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""

HELLO_COMMANDS = """
from ortcore.hookspecs import hookimpl

def _run(args):
    print(f"hello {args.name}")
    return 0

@hookimpl
def ortcore_commands(subparsers):
    p = subparsers.add_parser("hello", help="say hello (a test plugin's command)")
    p.add_argument("name")
    p.set_defaults(run=_run)
"""

GREET_PLUGIN = """
from ortcore.hookspecs import hookimpl

def _run(args):
    print("greetings from the main module")
    return 0

@hookimpl
def ortcore_commands(subparsers):
    subparsers.add_parser("greet", help="a command added by a plugin's main module").set_defaults(run=_run)
"""


def _distribution(root, name: str, modules: dict[str, str], entry_points: str) -> None:
    """An installed distribution, as pip leaves it: modules and a dist-info with entry points, on ``root``."""
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


@pytest.fixture
def plugin_site(tmp_path):
    """A site directory with three third-party distributions: light commands (``hello``), a commands module that
    fails to import (``broken``), and a plugin whose main module adds a command (``greet``)."""
    site = tmp_path / "site"
    site.mkdir()
    _distribution(site, "hello_cmds", {"hello_cmds": HELLO_COMMANDS}, "[ortcore.commands]\nhello = hello_cmds\n")
    _distribution(site, "broken_cmds", {}, "[ortcore.commands]\nbroken = broken_cmds_not_there\n")
    _distribution(site, "greet_plugin", {"greet_plugin": GREET_PLUGIN}, "[ortcore.plugins]\ngreet = greet_plugin\n")
    return site


def _ortcore(args: list[str], cwd, site=None, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in ("ORTCORE_CONFIG", "ORTCORE_DISABLE_PLUGINS")}
    if site is not None:
        environment["PYTHONPATH"] = str(site)
    return subprocess.run(
        [sys.executable, "-c", DRIVER, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**environment, "COLUMNS": "120", **env},
    )


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_do_not_import_torch(tmp_path, flag: str) -> None:
    done = _ortcore([flag], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "torch imported: False" in done.stdout
    assert ("usage: ortcore" if flag == "--help" else "ortcore 0.1.0") in done.stdout


def test_help_lists_the_builtin_plugin_commands(tmp_path) -> None:
    done = _ortcore(["--help"], tmp_path)
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("    ")}
    assert {"find-divergence", "merge-activation-summary"} <= listed, (
        "activation_stats' commands are missing from `ortcore --help`: is its 'ortcore.commands' entry point "
        "installed? (pip install -e .)\n" + done.stdout
    )
    assert "torch imported: False" in done.stdout


def test_plugin_command_is_listed_in_help_and_runs(tmp_path, plugin_site) -> None:
    shown = _ortcore(["--help"], tmp_path, plugin_site)
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"^\s+hello\s+say hello \(a test plugin's command\)$", shown.stdout, re.MULTILINE), shown.stdout
    assert "torch imported: False" in shown.stdout
    # A commands module that fails to load is named; the other commands keep working.
    assert "plugin 'broken' (distribution 'broken_cmds', entry point 'broken_cmds_not_there') failed" in shown.stderr
    ran = _ortcore(["hello", "world"], tmp_path, plugin_site)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["hello world", "torch imported: False"]


def test_disabled_plugin_has_no_command(tmp_path, plugin_site) -> None:
    by_env = _ortcore(["--help"], tmp_path, plugin_site, ORTCORE_DISABLE_PLUGINS="hello,broken")
    assert by_env.returncode == 0 and "hello" not in by_env.stdout and "broken" not in by_env.stderr
    (tmp_path / "ortcore.toml").write_text('[plugins]\ndisable = ["hello", "activation_stats"]\n')
    by_file = _ortcore(["--help"], tmp_path, plugin_site)
    assert by_file.returncode == 0
    assert "hello" not in by_file.stdout and "find-divergence" not in by_file.stdout and "demo" in by_file.stdout
    refused = _ortcore(["hello", "world"], tmp_path, plugin_site)
    assert refused.returncode == 2 and "invalid choice: 'hello'" in refused.stderr


def test_command_from_a_plugins_main_module_is_found_when_named(tmp_path, plugin_site) -> None:
    """A plugin without a light commands module: its command is found by loading every plugin (torch included)."""
    done = _ortcore(["greet"], tmp_path, plugin_site)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["greetings from the main module", "torch imported: True"]
