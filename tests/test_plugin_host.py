"""The plugin host: registration, entry points, errors naming plugin and hook, ordering, tracing, config."""

from __future__ import annotations

import re
import tomllib
import types
from pathlib import Path

import attrs
import importlib_metadata
import pytest
import torch

from ortcore import ORTModule
from ortcore.config import Config, option
from ortcore.errors import OptionError, UnsupportedModelError
from ortcore.graph_passes import GraphPass, order_passes
from ortcore.hookspecs import hookimpl
from ortcore.host import ENTRY_POINT_GROUP, PluginError, PluginHost, builtin_plugins
from ortcore.inspectors import RuntimeInspector
from ortcore.options import parse_bool
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
    def ortcore_session_plan(self, plan):
        self.calls.append("session_plan")
        plan.set_session_options(lambda session_options: self.calls.append("session_options"))

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
        "session_plan",
        "session_options",
        "session_created",
        "pre_forward:0",
        "post_forward:0",
        "pre_backward:0",
        "post_backward:0",
    ]
    plugin.calls.clear()
    model(torch.randn(4, 3)).sum().backward()  # same key: no export hooks, only the step
    assert plugin.calls == ["pre_forward:1", "post_forward:1", "pre_backward:1", "post_backward:1"]


def test_the_session_plans_providers_start_as_the_defaults_and_reach_onnx_runtime():
    seen = []

    class Providers:
        @hookimpl
        def ortcore_session_plan(self, plan):
            seen.append((plan.device.type, [name for name, _ in plan.providers]))
            plan.providers.insert(0, ("CUDAExecutionProvider", {"device_id": "0"}))

    host = make_host({"providers": Providers()})
    # ONNX Runtime warns about the provider it does not have, which shows the list it was given is the hook's.
    with pytest.warns(UserWarning, match="Specified provider 'CUDAExecutionProvider' is not in available provider"):
        assert_matches_torch(torch.nn.Linear(3, 2), (torch.randn(4, 3),), host=host)
    assert seen == [("cpu", ["CPUExecutionProvider"])]


def test_closing_the_host_unconfigures_every_plugin_with_its_config():
    closed = []

    class Closing:
        def __init__(self, name):
            self.name = name

        @hookimpl
        def ortcore_unconfigure(self, config):
            closed.append((self.name, config.plugin_options("opts")))

    host = make_host(
        {"one": Closing("one"), "opts": OptionsPlugin(), "two": Closing("two")},
        table={"plugins": {"opts": {"level": 9}}},
    )
    assert closed == []
    host.close()
    assert sorted(closed) == [("one", LevelOptions(level=9)), ("two", LevelOptions(level=9))]


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


def test_passes_ready_together_run_in_name_order():
    passes = [
        GraphPass(n, run=print, **o)
        for n, o in [("z", {}), ("c", {"after": ["b"]}), ("b", {}), ("a", {"before": ["b"]})]
    ]
    assert [p.name for p in order_passes(passes)] == ["a", "z", "b", "c"]


@pytest.mark.parametrize(
    ("passes", "message"),
    [
        (
            [
                GraphPass("a", run=print, after=["b"], plugin="p1"),
                GraphPass("b", run=print, after=["a"], plugin="p2"),
                GraphPass("free", run=print),
            ],
            r"cycle .*: '(a|b)' \(plugin 'p\d'\) -> '(a|b)' \(plugin 'p\d'\) -> '(a|b)'",
        ),
        (
            [GraphPass("a", run=print, before=["zzz"], plugin="p1"), GraphPass("b", run=print)],
            r"graph pass 'a' \(plugin 'p1'\) orders itself against unknown pass 'zzz'; known: \['a', 'b'\]",
        ),
        (
            [GraphPass("a", run=print, plugin="p1"), GraphPass("a", run=print, plugin="p2")],
            r"'a' is declared twice \(plugins 'p1' and 'p2'\)",
        ),
    ],
    ids=["cycle", "unknown_name", "duplicate_name"],
)
def test_bad_pass_order_fails_loudly(passes, message):
    with pytest.raises(OptionError, match=message):
        order_passes(passes)


def test_pass_cycle_error_names_only_the_passes_in_the_cycle():
    passes = [
        GraphPass("a", run=print, after=["c"]),
        GraphPass("b", run=print, after=["a"]),
        GraphPass("c", run=print, after=["b"]),
        GraphPass("before_cycle", run=print, before=["a"]),
    ]
    with pytest.raises(OptionError) as raised:
        order_passes(passes)
    assert "before_cycle" not in str(raised.value)
    assert all(f"'{n}' (plugin '')" in str(raised.value) for n in "abc")


def test_gradient_graph_passes_are_named_after_their_plugin_and_sorted():
    class Late:
        @hookimpl
        def ortcore_gradient_graph_passes(self):
            return [GraphPass("late", run=print, after=["early"])]

    class Early:
        @hookimpl
        def ortcore_gradient_graph_passes(self, config):
            assert config is not None
            return [GraphPass("early", run=print)]

    passes = make_host({"late": Late(), "early": Early()}).hooks.gradient_graph_passes()
    assert [(p.name, p.plugin) for p in passes] == [("early", "early"), ("late", "late")]


# -- wrappers see and change what plugins contribute -------------------------------------------------------------


class PassPlugin:
    @hookimpl
    def ortcore_graph_passes(self):
        return [GraphPass("keep", run=print), GraphPass("drop", run=print)]


class PassWrapper:
    """Drops one pass another plugin contributed and adds one of its own, ordered after the kept one."""

    def __init__(self):
        self.seen: list[list[str]] = []

    @hookimpl(wrapper=True)
    def ortcore_graph_passes(self, config):
        contributions = yield
        self.seen = [[p.name for p in c] for c in contributions]
        filtered = [[p for p in c if p.name != "drop"] for c in contributions]
        return [*filtered, [GraphPass("added", run=print, after=["keep"])]]


def test_wrapper_plugin_changes_graph_passes_and_each_pass_keeps_its_plugin():
    wrapper = PassWrapper()
    host = make_host({"passes": PassPlugin(), "wrapper": wrapper})
    passes = host.hooks.graph_passes()
    assert wrapper.seen == [["keep", "drop"]]
    assert [(p.name, p.plugin) for p in passes] == [("keep", "passes"), ("added", "wrapper")]


def test_wrapper_plugin_on_graph_passes_takes_effect_in_a_training_step():
    ran: list[str] = []

    def recording(name):
        return lambda model, context: ran.append(name)

    class Passes:
        @hookimpl
        def ortcore_graph_passes(self):
            return [GraphPass("keep", run=recording("keep")), GraphPass("drop", run=recording("drop"))]

    class Wrapper:
        @hookimpl(wrapper=True)
        def ortcore_graph_passes(self):
            contributions = yield
            kept = [[p for p in c if p.name != "drop"] for c in contributions]
            return [*kept, [GraphPass("added", run=recording("added"), after=["keep"])]]

    host = make_host({"passes": Passes(), "wrapper": Wrapper()})
    model = assert_matches_torch(torch.nn.Linear(3, 2), (torch.randn(4, 3),), host=host)
    assert ran == ["keep", "added"]
    assert model.state_machine.counters.exports == 1


def test_wrapper_exception_names_plugin_and_hook():
    class BrokenWrapper:
        @hookimpl(wrapper=True)
        def ortcore_export_symbolics(self):
            yield
            raise ValueError("no")

    with pytest.raises(PluginError, match=r"plugin 'broken' raised in hook ortcore_export_symbolics \(wrapper\)"):
        make_host({"broken": BrokenWrapper()}).hooks.export_symbolics()


def test_a_failed_first_step_crosses_another_plugins_wrapper_unchanged():
    """The repair loop reads a FirstRunError (or StepCheckError) from the first-step checks: a wrapper it passes
    through (a plugin setting up context around the checks) must not turn it into that plugin's PluginError."""
    from ortcore.errors import FirstRunError

    class Check:
        @hookimpl
        def ortcore_check_first_step(self, config, step):
            raise FirstRunError("ORT failed at node X")

    class Context:
        @hookimpl(wrapper=True)
        def ortcore_check_first_step(self, config, step):
            return (yield)

    with pytest.raises(FirstRunError, match="ORT failed at node X"):
        make_host({"check": Check(), "context": Context()}).hooks.check_first_step(None)


def test_subscriber_class_offered_by_two_plugins_names_both():
    class One:
        @hookimpl
        def ortcore_register(self, register):
            register.subscriber_class("Stats", type("Stats", (), {}))

    class Two:
        @hookimpl
        def ortcore_register(self, register):
            register.subscriber_class("Stats", type("Stats", (), {}))

    with pytest.raises(
        PluginError, match=r"plugins '(one|two)' and '(one|two)' both offer a subscriber class named 'Stats'"
    ):
        make_host({"one": One(), "two": Two()}).hooks.subscriber_classes()


def test_symbolic_registered_by_two_plugins_names_both():
    def make(fn):
        class Symbolics:
            @hookimpl
            def ortcore_export_symbolics(self):
                return {"::gelu": fn}

        return Symbolics()

    host = make_host({"first": make(lambda g, x: x), "second": make(lambda g, x: x)})
    with pytest.raises(
        PluginError, match=r"plugins '(first|second)' and '(first|second)' both register a symbolic for '::gelu'"
    ):
        host.hooks.export_symbolics()


def test_options_class_is_collected_through_pluggy_under_any_function_name():
    class Renamed:
        @hookimpl(specname="ortcore_options_class")
        def options(self):
            return LevelOptions

    host = make_host({"renamed": Renamed()}, table={"plugins": {"renamed": {"level": 4}}})
    assert host.config.plugin_options("renamed") == LevelOptions(level=4)
    assert host.records["renamed"].options_class is LevelOptions


def test_two_plugins_sharing_an_options_class_each_get_their_own_options():
    host = make_host(
        {"a": OptionsPlugin(), "b": OptionsPlugin()}, table={"plugins": {"a": {"level": 2}, "b": {"level": 7}}}
    )
    assert host.config.plugin_options("a").level == 2 and host.config.plugin_options("b").level == 7


# -- hooks no spec declares ----------------------------------------------------------------------------------------


class Misspelled:
    @hookimpl
    def ortcore_graph_pases(self):
        return []


def test_misspelled_hook_names_plugin_hook_and_the_closest_spec():
    with pytest.raises(
        PluginError,
        match=r"plugin 'typo' implements hooks that no spec declares: 'ortcore_graph_pases' \(mark .*\)\. "
        r"Did you mean 'ortcore_graph_passes'\?$",
    ):
        make_host({"typo": Misspelled()})


def test_optional_hook_without_a_spec_is_accepted():
    class Optional:
        @hookimpl(optionalhook=True)
        def ortcore_some_future_hook(self):
            return 1

    host = make_host({"optional": Optional()})
    assert host.records["optional"].status == "loaded"


def _misspelled_module(tmp_path, monkeypatch, name: str = "ortcore_test_misspelled") -> str:
    (tmp_path / f"{name}.py").write_text(
        "from ortcore.hookspecs import hookimpl\n\n\n@hookimpl\ndef ortcore_session_create(session):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_installed_plugin_with_a_misspelled_hook_is_reported_and_others_keep_working(tmp_path, monkeypatch, caplog):
    _fake_entry_point(monkeypatch, "typo", _misspelled_module(tmp_path, monkeypatch))
    host = PluginHost(Config.from_table({}, env={}))
    record = host.records["typo"]
    assert record.status == "failed" and "'ortcore_session_create'" in record.error
    assert "Did you mean 'ortcore_session_created'?" in record.error
    assert host.pm.get_plugin("typo") is None
    assert any(
        "'typo' (distribution 'some-dist'" in r.getMessage() and "keep working" in r.getMessage()
        for r in caplog.records
    )
    assert_matches_torch(torch.nn.Linear(3, 3), (torch.randn(2, 3),), host=host)


def test_installed_plugin_whose_hook_takes_unknown_arguments_is_reported(tmp_path, monkeypatch, caplog):
    (tmp_path / "ortcore_test_bad_arguments.py").write_text(
        "from ortcore.hookspecs import hookimpl\n\n\n@hookimpl\ndef ortcore_configure(config, colour):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_entry_point(monkeypatch, "bad_arguments", "ortcore_test_bad_arguments")
    host = PluginHost(Config.from_table({}, env={}))
    assert host.records["bad_arguments"].status == "failed"
    assert "colour" in host.records["bad_arguments"].error
    assert any(
        "'bad_arguments' (distribution 'some-dist'" in r.getMessage() and "failed to register" in r.getMessage()
        for r in caplog.records
    )


def test_enabled_plugin_with_a_misspelled_hook_is_an_error(tmp_path, monkeypatch):
    _fake_entry_point(monkeypatch, "typo", _misspelled_module(tmp_path, monkeypatch))
    with pytest.raises(PluginError, match=r"'typo' .*implements hooks that no spec declares: 'ortcore_session_create'"):
        PluginHost(Config.from_table({"plugins": {"enable": ["typo"]}}, env={}))


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
    host = make_host(
        {"opts": OptionsPlugin()}, table={"plugins": {"opts": {"level": 3}}}, env={"ORTCORE_TEST_LEVEL": "5"}
    )
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
    assert any("hook ortcore_register: plugin torchscript_exporter no answer" in m for m in traced)
    assert any("hook ortcore_configure: plugin opts no answer" in m for m in traced)


def test_installed_entry_points_are_pyprojects():
    """pyproject.toml is the one list of built-in plugins; the installed metadata must be its."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    listed = pyproject["project"]["entry-points"][ENTRY_POINT_GROUP]
    assert list(builtin_plugins()) == sorted(listed), "reinstall ortcore (pip install -e .): entry points are stale"
    assert all(value == f"ortcore_plugins.{name}" for name, value in listed.items())
    installed = {ep.name: ep.value for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert {name: installed.get(name) for name in listed} == listed


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
    assert any(
        "'ghost' (distribution 'some-dist', entry point 'no_such_module_anywhere')" in r.getMessage()
        for r in caplog.records
    )
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


def test_disabling_a_plugin_nobody_installed_is_an_error_with_a_suggestion():
    """A typo in ``disable`` would leave the plugin on, silently: refused as a typo in ``enable`` is."""
    with pytest.raises(
        OptionError, match=r"plugin 'export_cach' .* names no installed plugin. Did you mean 'export_cache'"
    ):
        PluginHost(Config.from_table({"plugins": {"disable": ["export_cach"]}}, env={}))
    with pytest.raises(
        OptionError, match=r"plugin 'zzz' .* names no installed plugin. Installed plugins: .*export_cache"
    ):
        PluginHost(Config.from_table({}, env={"ORTCORE_DISABLE_PLUGINS": "zzz"}))


@pytest.mark.parametrize("name", ["gradient_fixes", "kernel_types", "torchscript_exporter"])
def test_an_essential_plugin_cannot_be_disabled(name):
    with pytest.raises(OptionError, match=rf"plugin '{name}' .* cannot be disabled: it is essential, without it"):
        PluginHost(Config.from_table({"plugins": {"disable": [name]}}, env={}))


def test_enabling_a_missing_plugin_names_it():
    with pytest.raises(PluginError, match="'nope' is listed in \\[plugins\\] enable but not installed"):
        PluginHost(Config.from_table({"plugins": {"enable": ["nope"]}}, env={}), autoload=False)


def test_every_host_has_the_default_exporter_unless_a_test_kit_leaves_it_out():
    """A host of a test's plugins alone still exports with ``torchscript``; one composed without the plugin that offers
    it (a disable entry is honoured without autoloading) names the exporters it has instead of failing later."""
    assert make_host({}).hooks.registry().owner("exporter", "torchscript") == "torchscript_exporter"
    host = make_host({}, env={"ORTCORE_DISABLE_PLUGINS": "torchscript_exporter"})
    assert host.records["torchscript_exporter"].status == "disabled"
    with pytest.raises(OptionError, match=r"exporter='torchscript' .* exporters offered by the loaded plugins: none"):
        ORTModule(torch.nn.Linear(2, 2), host=host)


def test_exporter_hook_replaces_the_default():
    from ortcore_plugins.torchscript_exporter import TorchScriptExporter

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
    from ortcore.host import get_host, set_host

    set_host(None)
    default = get_host()
    previous = set_host(PluginHost(autoload=False))
    assert previous is None  # nothing was pinned
    set_host(previous)
    monkeypatch.setenv("ORTMODULE_LOG_LEVEL", "ERROR")  # the environment changed: the default host is rebuilt
    rebuilt = get_host()
    assert rebuilt is not default and rebuilt.config.core.log_level.name == "ERROR"


def test_export_failed_hook_supplies_the_symbolic_and_the_export_is_retried():
    """``ortcore_export_failed``: the TorchScript export stops at an op without a symbolic; a plugin's answer is
    registered and the export repeated; its outputs are torch's (inference: ORT has no CumSum gradient). Asked once
    more when the op fails again it declines, and the core raises instead of looping."""
    from torch.onnx import symbolic_helper

    class LogCumSumExp(torch.nn.Module):
        def forward(self, x):
            return torch.logcumsumexp(x, 1)

    asked = []

    class Symbolics:
        @hookimpl
        def ortcore_export_failed(self, error, symbolics):
            asked.append(type(error).__name__)
            if "::logcumsumexp" in symbolics:
                return None

            @symbolic_helper.parse_args("v", "i")
            def logcumsumexp(g, x, dim):
                axis = g.op("Constant", value_t=torch.tensor(dim, dtype=torch.int64))
                return g.op("Log", g.op("CumSum", g.op("Exp", x), axis))

            return {"::logcumsumexp": logcumsumexp}

    model = ORTModule(LogCumSumExp(), host=make_host({"symbolics": Symbolics()}), fallback_policy="FALLBACK_DISABLE")
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(model(x), torch.logcumsumexp(x, 1), rtol=1e-5, atol=1e-6)
    assert asked == ["UnsupportedModelError"]

    class Declines:
        @hookimpl
        def ortcore_export_failed(self, error, symbolics):
            asked.append("declined")
            return None

    refused = ORTModule(LogCumSumExp(), host=make_host({"declines": Declines()}), fallback_policy="FALLBACK_DISABLE")
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="logcumsumexp"):
        refused(x)
    assert asked[-1] == "declined"


# -- every suggestion follows a full sentence ----------------------------------------------------------------------


class TwoMisspelled:
    @hookimpl
    def ortcore_graph_pases(self):
        return []

    @hookimpl
    def ortcore_sesion_created(self, session):
        pass


@pytest.mark.parametrize(
    "build",
    [
        lambda: make_host({"typo": Misspelled()}),
        lambda: make_host({"typo": TwoMisspelled()}),
        lambda: make_host({"opts": OptionsPlugin()}, table={"plugins": {"opt": {}}}),
        lambda: make_host({"opts": OptionsPlugin()}, table={"plugins": {"opts": {"verbos": True}}}),
        lambda: PluginHost(Config.from_table({"plugins": {"enable": ["export_cach"]}}, env={})),
        lambda: PluginHost(Config.from_table({"plugins": {"disable": ["export_cach"]}}, env={})),
        lambda: Config.from_table({"opsett": 17}, env={}),
        lambda: Config.from_table({"plugin": {}}, env={}),
        lambda: Config.from_table({}, env={}).with_repaired_core({"opsett": 17}),
    ],
    ids=[
        "hook",
        "two-hooks",
        "plugin-table",
        "plugin-option",
        "enable",
        "disable",
        "core-key",
        "plugins-table",
        "repair",
    ],
)
def test_every_did_you_mean_follows_a_full_sentence(build):
    """A suggestion reads "...<sentence>. Did you mean 'x'?": never glued to a quoted name or a list."""
    with pytest.raises((OptionError, PluginError)) as raised:
        build()
    message = str(raised.value)
    assert "Did you mean" in message
    assert len(re.findall(r"Did you mean", message)) == len(re.findall(r"\. Did you mean '[^']+'", message)), message


def test_two_misspelled_hooks_each_get_their_suggestion():
    with pytest.raises(PluginError) as raised:
        make_host({"typo": TwoMisspelled()})
    assert str(raised.value).endswith(
        ". Did you mean 'ortcore_graph_passes' (for 'ortcore_graph_pases') and 'ortcore_session_created' "
        "(for 'ortcore_sesion_created')?"
    )


# -- a variable whose plugin is off --------------------------------------------------------------------------------


def _warnings_about(caplog, variable: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(variable + " ")]


@pytest.mark.parametrize(
    ("table", "env", "where"),
    [
        ({"plugins": {"disable": ["memory_recompute"]}}, {}, "[plugins] disable"),
        ({}, {"ORTCORE_DISABLE_PLUGINS": "memory_recompute"}, "ORTCORE_DISABLE_PLUGINS"),
        (
            {"plugins": {"disable": ["memory_recompute"]}},
            {"ORTCORE_DISABLE_PLUGINS": "memory_recompute"},
            "[plugins] disable and ORTCORE_DISABLE_PLUGINS",
        ),
    ],
)
def test_a_variable_of_a_disabled_plugin_says_the_plugin_is_disabled(table, env, where, caplog):
    """Not "did you mean ORTMODULE_LOG_LEVEL?": the variable is right, the plugin that reads it is off (and, being
    disabled, was never imported: the host knows its variables from PLUGIN_ENV_VARS)."""
    from ortcore_plugins.doctor.checks import doctor

    host = PluginHost(Config.from_table(table, env={**env, "ORTMODULE_MEMORY_OPT_LEVEL": "1"}))
    problem = (
        f"ORTMODULE_MEMORY_OPT_LEVEL is read by the plugin 'memory_recompute', which is disabled ({where}): "
        "it has no effect"
    )
    fix = f"enable the plugin (remove 'memory_recompute' from {where}), or unset ORTMODULE_MEMORY_OPT_LEVEL"
    assert _warnings_about(caplog, "ORTMODULE_MEMORY_OPT_LEVEL") == [f"{problem}; {fix}"]
    [finding] = [f for f in doctor(host, env=host.config.env) if "ORTMODULE_MEMORY_OPT_LEVEL" in f.what]
    assert (finding.level, finding.what, finding.fix) == ("warning", problem, fix)


def test_a_variable_of_a_plugin_the_host_did_not_load_says_so(caplog):
    make_host({}, env={"ORTMODULE_MEMORY_OPT_LEVEL": "1"})
    assert _warnings_about(caplog, "ORTMODULE_MEMORY_OPT_LEVEL") == [
        "ORTMODULE_MEMORY_OPT_LEVEL is read by the plugin 'memory_recompute', which is not loaded: it has no effect; "
        "load the plugin 'memory_recompute', or unset ORTMODULE_MEMORY_OPT_LEVEL"
    ]


def test_a_variable_of_a_plugin_that_failed_to_load_says_so(monkeypatch, caplog):
    import ortcore.host

    _fake_entry_point(monkeypatch, "ghost", "no_such_module_anywhere")
    monkeypatch.setitem(ortcore.host.PLUGIN_ENV_VARS, "ghost", ("ORTCORE_GHOST_LEVEL",))
    PluginHost(Config.from_table({}, env={"ORTCORE_GHOST_LEVEL": "2"}))
    [warning] = _warnings_about(caplog, "ORTCORE_GHOST_LEVEL")
    assert warning.startswith(
        "ORTCORE_GHOST_LEVEL is read by the plugin 'ghost', which failed to load: it has no effect; "
    )


def test_a_misspelled_variable_of_a_disabled_plugin_is_suggested_with_its_plugins_state(caplog):
    PluginHost(
        Config.from_table({"plugins": {"disable": ["memory_recompute"]}}, env={"ORTMODULE_MEMORY_OPT_LEVL": "1"})
    )
    assert _warnings_about(caplog, "ORTMODULE_MEMORY_OPT_LEVL") == [
        "ORTMODULE_MEMORY_OPT_LEVL is set but nothing reads it (did you mean ORTMODULE_MEMORY_OPT_LEVEL? It is read "
        "by the plugin 'memory_recompute', which is disabled ([plugins] disable))"
    ]


def test_variables_the_core_reads_without_their_plugin_are_not_reported(caplog):
    """With autograd_function disabled, ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 still tells the core's exporter to trace
    through custom Functions; ORTMODULE_CACHE_DIR without export_cache still places aten_fallback's kernel choices."""
    env = {"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0", "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT": "1"}
    host = PluginHost(Config.from_table({"plugins": {"disable": ["autograd_function"]}}, env=env))
    assert host.unread_env_vars(host.config.env) == []
    host = PluginHost(Config.from_table({"plugins": {"disable": ["export_cache"]}}, env={"ORTMODULE_CACHE_DIR": "x"}))
    [unread] = host.unread_env_vars(host.config.env)
    assert unread.problem == (
        "ORTMODULE_CACHE_DIR is read by the plugin 'export_cache', which is disabled ([plugins] disable): of the "
        "loaded plugins only 'aten_fallback' reads it (where its kernel choices are kept)"
    )


def test_plugin_env_vars_lists_every_variable_of_each_built_in_plugin():
    """PLUGIN_ENV_VARS is how a host knows the variables of a plugin it did not import: it must be each plugin's
    options class's own list (add a new plugin's variables there)."""
    from ortcore.host import PLUGIN_ENV_VARS

    host = PluginHost(Config.from_table({}, env={}))
    declared = {}
    for name, record in host.records.items():
        if record.builtin and record.options_class is not None:
            variables = []
            for f in attrs.fields(record.options_class):
                env = f.metadata.get("env")
                variables += [env] if isinstance(env, str) else list(env or ())
            if variables:
                declared[name] = sorted(variables)
    installed = {name: sorted(v) for name, v in PLUGIN_ENV_VARS.items() if name in builtin_plugins()}
    assert installed == declared
