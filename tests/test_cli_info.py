"""ortcore plugins / config / doctor: what they print for a configured project."""

from __future__ import annotations

import pytest

from ortcore.cli import main


def _row(out: str, name: str) -> str:
    """The table row whose first cell is ``name``."""
    return next(line for line in out.splitlines() if line.strip("│ ").startswith(name + " "))


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("ORTCORE_CONFIG", "ORTCORE_DISABLE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
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
    (project / "ortcore.toml").write_text('opsett = 17\n')
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
