"""ortcore.toml: discovery, precedence, validation with named keys and suggestions, no half-applied config."""

from __future__ import annotations

import pytest
import torch

from ortcore import DebugOptions, LogLevel, ORTModule
from ortcore.config import Config, find_config_file
from ortcore.errors import OptionError
from ortcore.options import FallbackPolicy
from ortcore.testing import make_host


def test_file_is_found_from_working_directory_upwards(tmp_path, monkeypatch):
    (tmp_path / "ortcore.toml").write_text('opset = 15\nlog_level = "INFO"\n')
    nested = tmp_path / "a" / "b"
    nested.mkdir(parents=True)
    monkeypatch.chdir(nested)
    config = Config.load(env={})
    assert config.core.opset == 15 and config.core.log_level == LogLevel.INFO
    assert config.path == tmp_path / "ortcore.toml"
    assert config.sources["core.opset"] == f"file {tmp_path / 'ortcore.toml'}"


def test_pyproject_tool_table_is_used(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.ortcore]\nopset = 16\n')
    monkeypatch.chdir(tmp_path)
    assert Config.load(env={}).core.opset == 16


def test_env_variable_and_argument_select_the_file(tmp_path):
    path = tmp_path / "custom.toml"
    path.write_text("opset = 14\n")
    assert Config.load(env={"ORTCORE_CONFIG": str(path)}).core.opset == 14
    assert Config.load(path, env={}).core.opset == 14
    with pytest.raises(OptionError, match="does not exist"):
        Config.load(tmp_path / "missing.toml", env={})


def test_precedence_default_file_code_env():
    config = Config.from_table({"opset": 15, "log_level": "ERROR"}, env={})
    assert config.core.opset == 15
    coded = config.with_code_options(DebugOptions(log_level=LogLevel.INFO), opset=16)
    assert coded.core.opset == 16 and coded.core.log_level == LogLevel.INFO
    assert coded.sources["core.opset"] == "argument"
    env = Config.from_table({"opset": 15}, env={"ORTMODULE_ONNX_OPSET_VERSION": "14"})
    assert env.with_code_options(None, opset=16).core.opset == 14
    assert env.sources["core.opset"] == "env ORTMODULE_ONNX_OPSET_VERSION"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"opsett": 17}, r"unknown key 'opsett'.*Did you mean 'opset'"),
        ({"opset": "seventeen"}, r"opset='seventeen' is not a supported ONNX opset; allowed: an integer from 14 to 20"),
        ({"log_level": "LOUD"}, r"log_level='LOUD' is not a log level; allowed: VERBOSE"),
        ({"fallback_policy": "FALLBACK_SOMETIMES"}, r"'FALLBACK_SOMETIMES' is not a fallback policy"),
        ({"save_onnx": "maybe"}, r"save_onnx='maybe' is not a boolean"),
        ({"plugins": {"enable": "export_cache"}}, r"plugins.enable='export_cache' must be a list"),
        ({"plugins": {"enable": ["a"], "disable": ["a"]}}, r"both enabled and disabled"),
        ({"plugins": {"level": 3}}, r"unknown key 'plugins.level'"),
        ({"save_onnx": True}, r"needs a non-empty onnx_prefix"),
    ],
)
def test_bad_values_name_key_value_and_allowed(table, message):
    with pytest.raises(OptionError, match=message):
        Config.from_table(table, env={})


@pytest.mark.parametrize(
    "text",
    ['[plugin]\ndisable = ["memory_recompute"]\n', "[plugin.memory_recompute]\nlevel = 1\n", "plugin = 3\n"],
)
def test_a_misspelled_plugins_table_suggests_plugins(tmp_path, text):
    """``[plugin]`` for ``[plugins]``: the top level of ortcore.toml holds the core's options and the [plugins]
    table, and the suggestion is drawn from both."""
    path = tmp_path / "ortcore.toml"
    path.write_text(text)
    with pytest.raises(OptionError) as raised:
        Config.load(path, env={})
    message = str(raised.value)
    assert message.startswith(f"unknown key 'plugin' (in file {path}); allowed: opset, fallback_policy, ")
    assert message.endswith("verify_gradients_atol and the [plugins] table. Did you mean 'plugins'?")


def test_a_plugin_table_at_the_top_level_says_where_plugin_tables_go():
    with pytest.raises(OptionError) as raised:
        Config.from_table({"memory_recompute": {"level": 1}}, env={})
    message = str(raised.value)
    assert "unknown key 'memory_recompute' (in table); allowed: opset, " in message
    assert message.endswith("and the [plugins] table. A plugin's options go in [plugins.memory_recompute].")


def test_bad_env_value_names_variable():
    with pytest.raises(OptionError, match=r"ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT='sometimes' is not a boolean"):
        Config.from_table({}, env={"ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT": "sometimes"})


def test_invalid_toml_is_reported_with_path(tmp_path):
    path = tmp_path / "ortcore.toml"
    path.write_text("opset = [\n")
    with pytest.raises(OptionError, match="is not valid TOML"):
        Config.load(path, env={})


def test_broken_file_never_half_applies(tmp_path, monkeypatch):
    # A valid key followed by a bad one: loading fails as a whole and models keep the defaults.
    (tmp_path / "ortcore.toml").write_text('log_level = "ERROR"\nopset = "x"\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OptionError):
        Config.load(env={})
    monkeypatch.chdir(tmp_path.parent)
    assert find_config_file(env={}) is None or find_config_file(env={}).parent != tmp_path
    assert Config.load(search=False, env={}).core.log_level == LogLevel.WARNING


def test_fallback_policy_from_file_reaches_the_model():
    host = make_host(table={"fallback_policy": "FALLBACK_DISABLE"})
    model = ORTModule(torch.nn.Linear(2, 2), host=host)
    assert model.runtime_options.fallback_policy == FallbackPolicy.FALLBACK_DISABLE


def test_a_config_file_written_after_a_failed_construction_is_read(tmp_path, monkeypatch):
    """The process-wide host is rebuilt when the config file changes (path, mtime, size), not only when the
    environment does: an ORTModule that failed to construct must not leave a host that ignores a file written after."""
    from ortcore.host import set_host

    monkeypatch.chdir(tmp_path)
    previous = set_host(None)  # the unpinned default host, built from this directory
    try:
        with pytest.raises(OptionError, match="opset"):
            ORTModule(torch.nn.Linear(2, 2), opset=3)
        (tmp_path / "ortcore.toml").write_text('exporter = "no_such_exporter"\n')
        with pytest.raises(OptionError, match="no_such_exporter"):
            ORTModule(torch.nn.Linear(2, 2))(torch.randn(1, 2))
        (tmp_path / "ortcore.toml").write_text("opset = 99\n")
        with pytest.raises(OptionError, match="99"):
            ORTModule(torch.nn.Linear(2, 2))(torch.randn(1, 2))
    finally:
        set_host(previous)
