"""The plugin host: registration, entry points, errors naming plugin and hook, ordering, tracing, config."""

from __future__ import annotations

import types

import attrs
import importlib_metadata
import pytest
import torch

from ortcore import ORTModule, hookspecs
from ortcore.config import Config, option
from ortcore.errors import OptionError
from ortcore.graph_passes import GraphPass, order_passes
from ortcore.hookspecs import hookimpl
from ortcore.inspectors import RuntimeInspector
from ortcore.options import parse_bool
from ortcore.plugins import BUILTIN_DISTRIBUTION, BUILTIN_PLUGINS, ENTRY_POINT_GROUP, PluginError, PluginHost
from ortcore.testing import assert_matches_torch, make_host


class RecordingPlugin:
    """Records every hook the core calls, in order."""

    def __init__(self):
        self.calls: list[str] = []

    @hookimpl
    def ortcore_configure(self, config):
        self.calls.append("configure")

    @hookimpl
    def ortcore_runtime_inspectors(self, module):
        plugin = self

        class Recorder(RuntimeInspector):
            def pre_forward(self, step, inputs):
                plugin.calls.append(f"pre_forward:{step}")

            def post_forward(self, step, outputs):
                plugin.calls.append(f"post_forward:{step}")

            def pre_backward(self, step):
                plugin.calls.append(f"pre_backward:{step}")

            def post_backward(self, step):
                plugin.calls.append(f"post_backward:{step}")

        self.calls.append("runtime_inspectors")
        return [Recorder()]

    @hookimpl
    def ortcore_export_key(self):
        self.calls.append("export_key")

    @hookimpl
    def ortcore_load_export(self, fingerprint):
        self.calls.append("load_export")

    @hookimpl
    def ortcore_graph_passes(self):
        self.calls.append("graph_passes")
        return [GraphPass("record", run=lambda model, context: self.calls.append("pass"))]

    @hookimpl
    def ortcore_export_done(self, graph):
        self.calls.append("export_done")

    @hookimpl
    def ortcore_graph_transformer_config(self, transformer_config, training):
        self.calls.append(f"graph_transformer_config:{training}")

    @hookimpl
    def ortcore_session_options(self, session_options, device):
        self.calls.append("session_options")

    @hookimpl
    def ortcore_session_created(self, session):
        self.calls.append("session_created")


def test_hooks_run_in_lifecycle_order_for_one_export_and_training_step():
    plugin = RecordingPlugin()
    model = ORTModule(torch.nn.Linear(3, 2), host=make_host({"recorder": plugin}))
    model(torch.randn(4, 3)).sum().backward()
    assert plugin.calls == [
        "configure",
        "runtime_inspectors",
        "graph_passes",
        "export_key",
        "load_export",
        "pass",
        "export_done",
        "graph_transformer_config:True",
        "session_options",
        "session_created",
        "pre_forward:0",
        "post_forward:0",
        "pre_backward:0",
        "post_backward:0",
    ]
    plugin.calls.clear()
    model(torch.randn(2, 3)).sum().backward()  # same key: no export hooks, only the step
    assert plugin.calls == ["pre_forward:1", "post_forward:1", "pre_backward:1", "post_backward:1"]


def test_every_hookspec_is_documented_and_in_the_reference():
    from pathlib import Path

    reference = (Path(__file__).parents[1] / "docs" / "hooks.md").read_text()
    specs = [name for name in dir(hookspecs) if name.startswith("ortcore_")]
    assert len(specs) >= 15
    for name in specs:
        assert getattr(hookspecs, name).__doc__, f"{name} has no docstring"
        assert f"`{name}" in reference, f"{name} is missing from docs/hooks.md"


def test_plugin_exception_names_plugin_and_hook():
    class Broken:
        @hookimpl
        def ortcore_runtime_inspectors(self, module):
            raise KeyError("boom")

    with pytest.raises(PluginError, match=r"plugin 'broken' raised in hook ortcore_runtime_inspectors: KeyError"):
        ORTModule(torch.nn.Linear(2, 2), host=make_host({"broken": Broken()}))


def test_graph_passes_follow_declared_order_not_registration_order():
    seen: list[str] = []

    def make(name, **order):
        return GraphPass(name, run=lambda model, context: seen.append(name), **order)

    class First:
        @hookimpl
        def ortcore_graph_passes(self):
            return [make("c", after=["b"]), make("a")]

    class Second:
        @hookimpl
        def ortcore_graph_passes(self):
            return [make("b", after=["a"], before=["c"])]

    model = ORTModule(torch.nn.Linear(2, 2), host=make_host({"first": First(), "second": Second()}))
    model(torch.randn(1, 2))
    assert seen == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("passes", "message"),
    [
        ([GraphPass("a", run=print, after=["b"]), GraphPass("b", run=print, after=["a"])], "cycle"),
        ([GraphPass("a", run=print, before=["zzz"])], "unknown pass 'zzz'"),
        ([GraphPass("a", run=print, plugin="p1"), GraphPass("a", run=print, plugin="p2")], "declared twice"),
    ],
)
def test_bad_pass_order_fails_loudly(passes, message):
    with pytest.raises(OptionError, match=message):
        order_passes(passes)


@attrs.frozen
class LevelOptions:
    level: int = option(1, lambda v, s: int(v), "a level", "ORTCORE_TEST_LEVEL")
    verbose: bool = option(False, parse_bool, "talk more")


class OptionsPlugin:
    seen = None

    @hookimpl
    def ortcore_options_class(self):
        return LevelOptions

    @hookimpl
    def ortcore_configure(self, config):
        OptionsPlugin.seen = config.plugin_options("opts")


def test_plugin_options_come_from_table_and_env_overrides():
    host = make_host({"opts": OptionsPlugin()}, table={"plugins": {"opts": {"level": 3}}})
    assert OptionsPlugin.seen == LevelOptions(level=3)
    assert host.config.sources["plugins.opts.level"].startswith("table")
    host = make_host({"opts": OptionsPlugin()}, table={"plugins": {"opts": {"level": 3}}}, env={"ORTCORE_TEST_LEVEL": "5"})
    assert host.config.plugin_options("opts").level == 5
    assert host.config.sources["plugins.opts.level"] == "env ORTCORE_TEST_LEVEL"


def test_unknown_plugin_option_names_key_and_suggests():
    with pytest.raises(OptionError, match=r"unknown key 'plugins\.opts\.verbos'.*allowed: level, verbose.*'verbose'"):
        make_host({"opts": OptionsPlugin()}, table={"plugins": {"opts": {"verbos": True}}})


def test_unknown_plugin_table_suggests_installed_name():
    with pytest.raises(OptionError, match=r"\[plugins\.opt\] names no installed plugin.*Did you mean 'opts'"):
        make_host({"opts": OptionsPlugin()}, table={"plugins": {"opt": {}}})


def test_trace_hooks_logs_who_answered_and_how_long(capfd):
    host = make_host({"opts": OptionsPlugin()}, env={"ORTCORE_TRACE_HOOKS": "1"})
    ORTModule(torch.nn.Linear(2, 2), host=host)(torch.randn(1, 2))
    traced = capfd.readouterr().err.splitlines()
    assert any("hook ortcore_exporter: plugin core answered TorchScriptExporter in" in m for m in traced)
    assert any("hook ortcore_configure: plugin opts no answer" in m for m in traced)


def test_installed_entry_points_match_builtin_list():
    installed = sorted(ep.name for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.dist.name == BUILTIN_DISTRIBUTION)
    assert installed == sorted(BUILTIN_PLUGINS), "reinstall ortcore (pip install -e .): entry points are stale"


def _fake_entry_point(monkeypatch, name: str, value: str, dist: str = "some-dist"):
    ep = importlib_metadata.EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)
    ep = ep._for(types.SimpleNamespace(name=dist, version="9.9"))  # type: ignore[attr-defined]
    real = importlib_metadata.entry_points

    def entry_points(**kwargs):
        found = list(real(**kwargs))
        return found + [ep] if kwargs.get("group") == ENTRY_POINT_GROUP else found

    monkeypatch.setattr(importlib_metadata, "entry_points", entry_points)


def test_plugin_that_fails_to_import_is_reported_and_others_keep_working(monkeypatch, caplog):
    _fake_entry_point(monkeypatch, "ghost", "no_such_module_anywhere")
    host = PluginHost(Config.from_table({}, env={}))
    assert host.records["ghost"].status == "failed"
    assert "ModuleNotFoundError" in host.records["ghost"].error
    assert any("'ghost' (distribution 'some-dist', entry point 'no_such_module_anywhere')" in r.getMessage() for r in caplog.records)
    assert_matches_torch(torch.nn.Linear(3, 3), (torch.randn(2, 3),), host=host)


def test_explicitly_enabled_plugin_that_fails_to_import_is_an_error(monkeypatch):
    _fake_entry_point(monkeypatch, "ghost", "no_such_module_anywhere")
    with pytest.raises(PluginError, match="'ghost' .*failed to import"):
        PluginHost(Config.from_table({"plugins": {"enable": ["ghost"]}}, env={}))


def test_disabled_plugin_is_never_imported(monkeypatch):
    _fake_entry_point(monkeypatch, "ghost", "no_such_module_anywhere")
    host = PluginHost(Config.from_table({"plugins": {"disable": ["ghost"]}}, env={}))
    assert host.records["ghost"].status == "disabled"
    host = PluginHost(Config.from_table({}, env={"ORTCORE_DISABLE_PLUGINS": "ghost"}))
    assert host.records["ghost"].status == "disabled"


def test_enabling_a_missing_plugin_names_it():
    with pytest.raises(PluginError, match="'nope' is listed in \\[plugins\\] enable but not installed"):
        PluginHost(Config.from_table({"plugins": {"enable": ["nope"]}}, env={}), autoload=False)


def test_exporter_hook_replaces_the_default():
    from ortcore.exporter import TorchScriptExporter

    class Named(TorchScriptExporter):
        name = "named"

    class ExporterPlugin:
        @hookimpl
        def ortcore_exporter(self):
            return Named()

    model = ORTModule(torch.nn.Linear(2, 2), host=make_host({"exp": ExporterPlugin()}))
    model(torch.randn(1, 2))
    assert model.state_machine.last_key.exporter == "named"


def test_restoring_the_previous_host_leaves_the_default_unpinned(monkeypatch):
    from ortcore.plugins import get_host, set_host

    set_host(None)
    default = get_host()
    previous = set_host(PluginHost(autoload=False))
    assert previous is None  # nothing was pinned
    set_host(previous)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "ERROR")  # the environment changed: the default host is rebuilt
    rebuilt = get_host()
    assert rebuilt is not default and rebuilt.config.core.log_level.name == "ERROR"
