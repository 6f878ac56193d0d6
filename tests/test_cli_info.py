"""ortcore plugins / config / doctor: what they print for a configured project."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ortcore.cli import main
from ortcore.report import config_rows, load_host, plugin_rows


def _row(out: str, name: str) -> str:
    """The table row whose first cell is ``name``."""
    return next(line for line in out.splitlines() if line.strip("│ ").startswith(name + " "))


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("ORTCORE_CONFIG", "ORTCORE_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "250")  # wide enough for the tables: one row per plugin or option
    return tmp_path


def test_plugins_lists_builtins_with_hooks_and_options(project, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    row = _row(out, "runtime_inspector")
    assert "built-in" in row and "yes" in row and "runtime_inspectors" in row
    assert "print_input_density=False" in out


def test_plugins_shows_a_disabled_plugin_as_not_enabled(project, capsys):
    (project / "ortcore.toml").write_text('[plugins]\ndisable = ["memory_recompute"]\n')
    assert main(["plugins"]) == 0
    row = _row(capsys.readouterr().out, "memory_recompute")
    assert "no (disabled)" in row


def test_config_shows_value_source_and_env_twin(project, capsys, monkeypatch):
    (project / "ortcore.toml").write_text("opset = 15\n")
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "INFO")
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    opset = _row(out, "core.opset")
    assert "15" in opset and "file" in opset and "ORTMODULE_ONNX_OPSET_VERSION" in opset
    level = _row(out, "core.log_level")
    assert "INFO" in level and "env ORTMODULE_LOG_LEVEL" in level


def test_config_with_a_bad_file_names_the_key_and_fails(project, capsys):
    (project / "ortcore.toml").write_text("opsett = 17\n")
    assert main(["config"]) == 1
    err = capsys.readouterr().err
    assert "unknown key 'opsett'" in err and "Did you mean 'opset'" in err


def test_doctor_runs_a_training_step_and_flags_a_misspelled_variable(project, capsys, monkeypatch):
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSTY", "1")
    assert main(["doctor"]) == 0  # warnings only
    out = capsys.readouterr().out
    assert "training bindings" in out
    assert "one training step in ONNX Runtime matches torch" in out
    assert "ORTMODULE_PRINT_INPUT_DENSTY is set but nothing reads it" in out
    assert "did you mean ORTMODULE_PRINT_INPUT_DENSITY?" in out


def test_plugins_lists_the_commands_hook_of_activation_stats(project, capsys):
    assert main(["plugins"]) == 0
    row = _row(capsys.readouterr().out, "activation_stats")
    assert "register" in row and "commands" in row


def test_disabled_plugin_command_is_refused(project, capsys):
    (project / "ortcore.toml").write_text('[plugins]\ndisable = ["activation_stats"]\n')
    assert main(["find-divergence", "a", "b"]) == 2
    assert "invalid choice: 'find-divergence'" in capsys.readouterr().err
    (project / "ortcore.toml").unlink()
    assert main(["find-divergence", "a", "b", "--no-html"]) == 2  # enabled again: runs, and names the bad input
    assert "a: directory not found" in capsys.readouterr().err


# -- the tables in a terminal of any width, --wide and --json ---------------------------------------------------
@pytest.fixture(scope="module")
def no_config(tmp_path_factory):
    return tmp_path_factory.mktemp("no_config")


@pytest.fixture(scope="module")
def ortcore(no_config):
    """``ortcore ARGS`` in a fresh process (stdout a pipe, no ortcore.toml), with ``COLUMNS``; the output is cached."""
    env = {k: v for k, v in os.environ.items() if k not in ("ORTCORE_CONFIG", "ORTCORE_DISABLE_PLUGINS")}
    done: dict[tuple, str] = {}

    def run(*args: str, columns: int = 80) -> str:
        if (args, columns) not in done:
            proc = subprocess.run(
                [sys.executable, "-m", "ortcore.cli", *args],
                capture_output=True,
                text=True,
                cwd=no_config,
                env={**env, "COLUMNS": str(columns)},
            )
            assert proc.returncode == 0, proc.stderr
            done[args, columns] = proc.stdout
        return done[args, columns]

    return run


@pytest.fixture(scope="module")
def rows(no_config):
    """What the commands report there, from the plugin host: {'plugins': [PluginRow], 'config': [ConfigRow]}."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(no_config)
        for var in ("ORTCORE_CONFIG", "ORTCORE_DISABLE_PLUGINS"):
            mp.delenv(var, raising=False)
        host, error = load_host()
    assert error is None
    return {"plugins": plugin_rows(host), "config": config_rows(host)}


def _hooks(row) -> list[str]:
    return [h.removeprefix("ortcore_") for h in row.hooks]


def _names(command: str, rows: dict) -> list[str]:
    """What must never be broken: plugin and hook names, options with their values; option keys, values (each flag
    of A|B), sources and environment variables."""
    if command == "plugins":
        return [name for r in rows["plugins"] for name in (r.name, *_hooks(r), *r.options)]
    return [name for r in rows["config"] for name in (r.key, *r.value.split("|"), r.source, r.env) if name]


def _whole(name: str, lines: list[str]) -> bool:
    """``name`` on one line, not as part of a longer name."""
    pattern = re.compile(rf"(?<![\w.]){re.escape(name)}(?![\w.])")
    return any(pattern.search(line) for line in lines)


@pytest.mark.parametrize("columns", [80, 60])
@pytest.mark.parametrize("command", ["plugins", "config"])
def test_output_fits_the_terminal_and_breaks_no_name(ortcore, rows, command, columns):
    lines = ortcore(command, columns=columns).splitlines()
    too_wide = [line for line in lines if len(line) > columns]
    assert not too_wide, f"{len(too_wide)} lines wider than {columns}, e.g. {too_wide[0]!r}"
    broken = [name for name in _names(command, rows) if not _whole(name, lines)]
    assert not broken, f"broken across lines at COLUMNS={columns}: {broken}"
    if columns == 80:  # a few lines per row, not one per word (the report: 167 and 338 lines)
        assert len(lines) < 4 * len(rows[command])


@pytest.mark.parametrize("command", ["plugins", "config"])
def test_wide_wraps_nothing(ortcore, rows, command):
    lines = ortcore(command, "--wide", columns=80).splitlines()
    assert max(len(line) for line in lines) > 80  # the terminal's width does not matter
    assert all(_whole(name, lines) for name in _names(command, rows))
    if command == "plugins":  # each plugin's row holds all its hooks
        for r in rows["plugins"]:
            assert any(r.name in line and ", ".join(_hooks(r)) in line for line in lines), r.name
    else:  # each option's row holds every field, its meaning too
        for r in rows["config"]:
            assert any(all(f in line for f in (r.key, r.value, r.source, r.env, r.doc)) for line in lines), r.key


@pytest.mark.parametrize("command", ["plugins", "config"])
def test_json_holds_every_plugin_and_option_and_nothing_else(ortcore, rows, command):
    data = json.loads(ortcore(command, "--json"))  # the whole of stdout
    assert data["configuration"] is None
    if command == "plugins":
        assert [p["name"] for p in data["plugins"]] == [r.name for r in rows["plugins"]]
        for p, r in zip(data["plugins"], rows["plugins"]):
            assert (p["version"], p["source"], p["enabled"]) == (r.version, r.source, r.enabled)
            assert tuple(p["hooks"]) == r.hooks
            assert [f"{k}={v}" for k, v in p["options"].items()] == list(r.options)
        inspector = next(p for p in data["plugins"] if p["name"] == "runtime_inspector")
        assert "ortcore_runtime_inspectors" in inspector["hooks"]
        assert inspector["options"]["print_input_density"] == "False"
    else:
        assert [o["key"] for o in data["options"]] == [r.key for r in rows["config"]]
        for o, r in zip(data["options"], rows["config"]):
            assert (o["value"], o["source"], o["env"] or "", o["meaning"]) == (r.value, r.source, r.env, r.doc)
        opset = next(o for o in data["options"] if o["key"] == "core.opset")
        assert opset["env"] == "ORTMODULE_ONNX_OPSET_VERSION" and opset["value"] == "17"
        assert data["plugins_disabled"] == []


def test_json_prints_nothing_on_a_configuration_error(project, capsys):
    (project / "ortcore.toml").write_text("opsett = 17\n")
    assert main(["config", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown key 'opsett'" in captured.err
    assert main(["plugins", "--json", "--wide"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
