"""The plugin host: finds plugins through entry points, configures them, and calls their hooks.

Built-in plugins and third-party plugins enter through the same door, the entry-point group ``ortcore.plugins``.
A plugin listed in ``[plugins] disable`` (or ``ORTCORE_DISABLE_PLUGINS``) is never imported. A plugin that fails
to import is reported with its distribution and entry-point name while the rest keep working (an error if it was
listed in ``[plugins] enable``); so is a plugin that implements a hook no spec declares (a misspelled
``ortcore_*`` name; ``@hookimpl(optionalhook=True)`` marks a hook meant for a spec that may be absent). A plugin
that raises inside a hook gives a :class:`PluginError` naming the plugin and the hook. ``ORTCORE_TRACE_HOOKS=1``
logs every hook call: who answered and how long it took.

The core calls hooks only through :class:`Hooks`, a typed facade, and always through pluggy, so that plugins'
wrappers (``@hookimpl(wrapper=True)``) apply. Where the core must know which plugin contributed what (a graph pass's
``plugin``, an error naming two plugins), the host's guard around each implementation records what it answered
during the call (:meth:`Hooks._collect`).
"""

from __future__ import annotations

import contextvars
import difflib
import functools
import importlib
import logging
import os
import time
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any

import attrs
import importlib_metadata
import pluggy

from . import hookspecs
from .config import Config, CoreOptions, build_options, find_config_file
from .errors import FirstRunError, OptionError, PluginError, StepCheckError
from .graph_passes import GraphPass, order_passes
from .registry import Registry

logger = logging.getLogger("ortcore")
trace_logger = logging.getLogger("ortcore.hooks")

ENTRY_POINT_GROUP = "ortcore.plugins"

BUILTIN_DISTRIBUTION = "ortcore"
# Plugins the core cannot serve models correctly without: always loaded from the entry points, and a `[plugins]
# disable` (or ORTCORE_DISABLE_PLUGINS) naming one is refused. A test kit may still compose a host without them
# (``ortcore.testing.make_host``), to show what they fix; the default exporter's plugin, and gradient_fixes' lowering
# of detach() markers, which every host has, it leaves out by disabling them.
ESSENTIAL_PLUGINS: dict[str, str] = {
    "gradient_fixes": "without it ORT computes some gradients wrongly (Where/Pow with broadcast inputs, ...)",
    "kernel_types": "without it graphs holding ops in types ORT's CPU provider has no kernel for cannot run",
    "torchscript_exporter": "without it there is no default exporter (exporter = 'torchscript'), nor the one the "
    "dynamo route's repair switches a model to",
}
# The plugin offering the `exporter` option's default: every host registers it, autoloaded or not, so that a host
# composed of a few plugins (``ortcore.testing.make_host``) exports as one with all of them does.
DEFAULT_EXPORTER_PLUGIN = "torchscript_exporter"
# The module of gradient_fixes that lowers traced detach() markers (ortcore_lower_stop_gradients): a host composed
# without gradient_fixes registers it alone, as "gradient_fixes.stop_gradients", so that a model calling detach()
# builds there as on any host (the rest of gradient_fixes is what a kit leaves out to show what it fixes). A kit
# leaves this out too by disabling gradient_fixes; a model with detach() markers is then refused, naming the plugin.
STOP_GRADIENT_LOWERING = ("gradient_fixes", "stop_gradients")
# The environment variables of the built-in plugins' options, by plugin. A host knows a loaded plugin's variables from
# its options class; this table is how it knows those of a plugin that is disabled (never imported), failed to import
# or was left out of the host, so that such a variable is reported as "read by the plugin X, which is disabled", not
# as a misspelling of some other variable. A test checks it against the options classes of the installed plugins
# (tests/test_plugin_host.py): a plugin that adds a variable adds it here.
PLUGIN_ENV_VARS: dict[str, tuple[str, ...]] = {
    "aten_fallback": ("ORTCORE_TORCH_KERNELS", "ORTCORE_ATEN_FALLBACK_OPS", "ORTCORE_KERNEL_MEASURE"),
    "autograd_function": (
        "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD",
        "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT",
        "ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS",
        "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT",
    ),
    "bias_gemv": ("ORTCORE_BIAS_GEMV", "ORTCORE_BIAS_GEMV_MIN_ROWS"),
    "compile_backend": ("ORTCORE_COMPILE_BACKEND", "ORTCORE_COMPILE_DESIGN"),
    "compute_optimizer": ("ORTMODULE_ENABLE_COMPUTE_OPTIMIZER",),
    "control_flow": ("ORTCORE_CONTROL_FLOW",),
    "cuda_execution": (
        "ORTMODULE_ENABLE_TUNING",
        "ORTMODULE_MAX_TUNING_DURATION_MS",
        "ORTMODULE_TUNING_RESULTS_PATH",
        "ORTMODULE_CONV_ALGO_SEARCH",
        "ORTMODULE_USE_TRITON",
        "ORTMODULE_TRITON_CONFIG_FILE",
        "ORTMODULE_TRITON_DEBUG",
        "ORTMODULE_USE_FLASH_ATTENTION",
    ),
    "dynamo_exporter": ("ORTCORE_DYNAMO_VALUE_BRANCHES", "ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR"),
    "efficient_attention": ("ORTMODULE_USE_EFFICIENT_ATTENTION",),
    "export_cache": (
        "ORTMODULE_CACHE_DIR",
        "ORTCORE_EXPORT_CACHE_MAX_ENTRIES",
        "ORTCORE_EXPORT_CACHE_MAX_BYTES",
        "ORTCORE_EXPORT_CACHE_TRUST_SHARED",
    ),
    "grad_management": ("ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",),
    "gradient_audit": ("ORTCORE_AUDIT_RECORDED_VERDICTS",),
    "memory_recompute": ("ORTMODULE_MEMORY_OPT_LEVEL", "ORTMODULE_MEMORY_OPT_CONFIG"),
    "mixed_precision": (
        "ORTCORE_MIXED_PRECISION",
        "ORTCORE_AMP_MATMUL",
        "ORTCORE_AMP_EXACT_ROUNDING",
        "ORTCORE_AMP_TORCH_CASTS",
    ),
    "op_profiler": (
        "ORTCORE_PROFILE_OPS",
        "ORTCORE_PROFILE_OPS_WARMUP",
        "ORTCORE_PROFILE_OPS_STEPS",
        "ORTCORE_PROFILE_OPS_OUTPUT",
    ),
    "op_routing": ("ORTCORE_OP_ROUTING", "ORTCORE_OP_ROUTING_NEVER"),
    "random_seed": ("ORTCORE_SEED_FROM_TORCH",),
    "region_routing": ("ORTCORE_PYTORCH_MODULES",),
    "runtime_inspector": ("ORTMODULE_PRINT_INPUT_DENSITY", "ORTMODULE_PRINT_MEMORY_STATS"),
    "sparse_optimizer": (
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER",
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER",
    ),
    "zero_stage3": ("ORTMODULE_ENABLE_ZERO_STAGE3",),
}
# Variables a plugin's options declare that something else reads too, whatever that plugin's state.
# The core's exporter: =0 (or the older variable =1) traces through custom autograd Functions, plugin or not.
CORE_READ_ENV_VARS: dict[str, str] = {
    "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "the exporter: 0 traces through custom autograd Functions",
    "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT": "the exporter: 1 traces through custom autograd Functions",
}
# Other plugins: variable -> (plugin, what it reads the variable for). When the variable's own plugin is off it is still
# reported (what the user set it for does not happen), naming the loaded ones that read it.
ALSO_READ_BY: dict[str, tuple[tuple[str, str], ...]] = {
    "ORTMODULE_CACHE_DIR": (("aten_fallback", "where its kernel choices are kept"),),
}


@functools.cache
def builtin_plugins() -> tuple[str, ...]:
    """The plugins shipped in ``plugins/``: the ``ortcore.plugins`` entry points of the ortcore distribution, whose
    one list is ``pyproject.toml`` (a test checks the installed ones are the file's)."""
    return tuple(
        sorted(
            ep.name
            for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name == BUILTIN_DISTRIBUTION
        )
    )


@functools.cache
def _builtin_entry(name: str) -> tuple[Any, ...]:
    """The entry point of the built-in plugin ``name`` (none if it is not installed), looked up once per process."""
    return tuple(
        ep
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
        if ep.dist is not None and ep.dist.name == BUILTIN_DISTRIBUTION
    )


@attrs.define
class PluginRecord:
    """What the host knows of one plugin, loaded or not (``ortcore plugins`` prints these)."""

    name: str
    distribution: str
    version: str
    builtin: bool
    status: str  # "loaded", "disabled" or "failed"
    error: str | None = None
    plugin: Any = None
    options_class: type | None = None

    @property
    def enabled(self) -> bool:
        return self.status == "loaded"


@attrs.frozen
class _Answer:
    """What one implementation answered during a recorded hook call (a wrapper: the result it returned)."""

    plugin: str
    value: Any
    wrapper: bool


@attrs.frozen
class UnreadVariable:
    """An ``ORTMODULE_*``/``ORTCORE_*`` variable that is set but that nothing loaded reads, and why: the plugin that
    reads it is off (``plugin``, ``state``), or it is no variable anything reads (then ``suggestion`` is the closest
    known name, a typo's likely meaning, and ``suggestion_note`` the state of that variable's plugin when it is off)."""

    name: str
    plugin: str | None = None
    state: str = ""  # "is disabled ([plugins] disable)", "failed to load", "is not loaded", "is not installed"
    fix_plugin: str = ""  # what turns that plugin on
    others: str = ""  # loaded plugins that read it all the same, and what for
    suggestion: str | None = None
    suggestion_note: str = ""

    @property
    def problem(self) -> str:
        if self.plugin is None:
            return f"{self.name} is set but nothing reads it"
        effect = f"of the loaded plugins only {self.others}" if self.others else "it has no effect"
        return f"{self.name} is read by the plugin {self.plugin!r}, which {self.state}: {effect}"

    @property
    def fix(self) -> str:
        if self.plugin is not None:
            return f"{self.fix_plugin}, or unset {self.name}"
        if self.suggestion is not None:
            return f"did you mean {self.suggestion}?{self.suggestion_note}"
        return "unset it (see docs/options.md for the variables)"

    def __str__(self) -> str:
        if self.plugin is not None:
            return f"{self.problem}; {self.fix}"
        return f"{self.problem} ({self.fix})" if self.suggestion is not None else self.problem


# The hook call being recorded in this thread or task, and the answers of its implementations (see Hooks._collect).
_recording: contextvars.ContextVar[tuple[str, list[_Answer]] | None] = contextvars.ContextVar(
    "ortcore_hook_recording", default=None
)


class PluginHost:
    """A pluggy manager with ortcore's hook specs, its plugins and their configuration.

    Args:
        config: the configuration (default: :meth:`Config.load`).
        autoload: load plugins from the ``ortcore.plugins`` entry points.
        plugins: extra ``{name: plugin}`` objects to register (tests register only the plugin under test).
        builtins: without ``autoload``, built-in plugins to load from their entry points all the same (the default
            exporter's and gradient_fixes' lowering of detach() markers always are), unless ``plugins`` has one of
            that name.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        autoload: bool = True,
        plugins: Mapping[str, Any] | None = None,
        builtins: Sequence[str] = (),
    ):
        self.config = config if config is not None else Config.load()
        self.autoload = autoload
        self.extra_plugins = dict(plugins or {})
        self.builtins = tuple(builtins)
        self.pm = pluggy.PluginManager("ortcore")
        self.pm.add_hookspecs(hookspecs)
        self.records: dict[str, PluginRecord] = {}
        self.trace = self.config.env.get("ORTCORE_TRACE_HOOKS", "") not in ("", "0")
        if self.trace and not trace_logger.handlers:
            trace_logger.addHandler(logging.StreamHandler())
            trace_logger.setLevel(logging.INFO)
            trace_logger.propagate = False
        if autoload:
            self._load_entry_points()
        else:
            wanted = [(DEFAULT_EXPORTER_PLUGIN, None), STOP_GRADIENT_LOWERING, *((name, None) for name in builtins)]
            for name, part in wanted:
                if name not in self.extra_plugins:
                    self._load_entry_points(only=name, part=part)
        for name, plugin in (plugins or {}).items():
            self._register(name, plugin, PluginRecord(name, "<registered>", "", False, "loaded"))
        self._configure()
        try:  # plugins were checked as they registered; this also covers any a plugin registered itself
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise PluginError(f"{e}; no spec declares this hook (@hookimpl(optionalhook=True) allows that)") from e
        self.hooks = Hooks(self)

    def with_plugin_options(self, changes: Mapping[str, Mapping[str, Any]]) -> PluginHost:
        """A host like this one whose ``[plugins.<name>]`` tables carry ``changes`` (a repair's new option values)
        on top of this host's: same plugins, same code options, the environment still applied over the tables."""
        tables = {name: dict(table) for name, table in self.config.plugin_tables.items()}
        for name, values in changes.items():
            tables.setdefault(name, {}).update(values)
        config = attrs.evolve(self.config, plugin_tables=tables, plugins={})
        return PluginHost(config, autoload=self.autoload, plugins=self.extra_plugins, builtins=self.builtins)

    # -- loading ----------------------------------------------------------------------------------------------------
    def _load_entry_points(self, only: str | None = None, part: str | None = None) -> None:
        """Load the plugins of the ``ortcore.plugins`` entry points (``only``: the built-in plugin of that name;
        ``part``: only that module of it, registered as ``<plugin>.<part>``)."""
        disabled = set(self.config.disable)
        distributions: dict[Any, tuple[str, str]] = {}  # each METADATA file read once, not twice per plugin
        found = importlib_metadata.entry_points(group=ENTRY_POINT_GROUP) if only is None else _builtin_entry(only)
        for ep in found:
            if ep.dist is None:
                dist, version = "<unknown>", ""
            else:
                key = getattr(ep.dist, "_path", None) or id(ep.dist)
                if key not in distributions:
                    distributions[key] = (ep.dist.name, ep.dist.version)
                dist, version = distributions[key]
            name = ep.name if part is None else f"{ep.name}.{part}"
            record = PluginRecord(
                name,
                dist,
                version,
                builtin=dist == BUILTIN_DISTRIBUTION,
                status="disabled",
            )
            if name in self.records:
                raise PluginError(
                    f"two plugins are named {name!r}: from {self.records[name].distribution!r} and {dist!r}"
                )
            if ep.name in disabled:
                self.records[name] = record  # never imported
                continue
            where = f"plugin {name!r} (distribution {dist!r}, entry point {ep.value!r})"
            stage = "import"
            try:
                plugin = ep.load() if part is None else importlib.import_module(f"{ep.module}.{part}")
                stage = "register"  # pluggy refuses a hook implementation whose arguments its spec does not have
                self._register(name, plugin, record, where=where)
            except Exception as e:  # any failure of one plugin to load must not take ortcore down
                failure = str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
                record.status, record.error, record.plugin = "failed", failure, None
                self.records[name] = record
                message = failure if isinstance(e, PluginError) else f"{where} failed to {stage}: {failure}"
                if ep.name in self.config.enable:
                    raise PluginError(message) from e
                logger.warning("%s; the other plugins keep working", message)

    def _check_disabled(self, known: list[str]) -> None:
        """Refuse a ``disable`` entry that names an essential plugin, or no plugin at all (a typo would otherwise
        leave the plugin on, silently)."""
        source = "ORTCORE_DISABLE_PLUGINS / [plugins] disable"
        for name in self.config.disable:
            if name in ESSENTIAL_PLUGINS:
                raise OptionError(
                    f"plugin {name!r} ({source}) cannot be disabled: it is essential, {ESSENTIAL_PLUGINS[name]}"
                )
            if name not in self.records and name not in builtin_plugins():
                hint = _suggest(name, known) or f" Installed plugins: {', '.join(known)}."
                raise OptionError(f"plugin {name!r} ({source}) names no installed plugin.{hint}")

    def _register(self, name: str, plugin: Any, record: PluginRecord, where: str | None = None) -> None:
        """Register ``plugin``, refusing (unregistered again) one that implements a hook no spec declares."""
        self.pm.register(plugin, name=name)
        callers = self.pm.get_hookcallers(plugin) or []
        unknown = sorted(
            c.name
            for c in callers
            if not c.has_spec() and any(i.plugin is plugin and not i.optionalhook for i in c.get_hookimpls())
        )
        if unknown:
            self.pm.unregister(plugin)
            specs = sorted(n for n in vars(hookspecs) if n.startswith("ortcore_"))
            close = {hook: difflib.get_close_matches(hook, specs, n=1) for hook in unknown}
            guesses = [(hook, found[0]) for hook, found in close.items() if found]
            if len(guesses) == 1 and len(unknown) == 1:
                hint = f" Did you mean {guesses[0][1]!r}?"
            elif guesses:
                hint = " Did you mean " + " and ".join(f"{spec!r} (for {hook!r})" for hook, spec in guesses) + "?"
            else:
                hint = ""
            raise PluginError(
                f"{where or f'plugin {name!r}'} implements hooks that no spec declares: "
                f"{', '.join(repr(hook) for hook in unknown)} "
                f"(mark an implementation @hookimpl(optionalhook=True) if its spec may be absent).{hint}"
            )
        record.plugin, record.status = plugin, "loaded"
        self.records[name] = record
        for caller in callers:
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    if impl.wrapper or impl.hookwrapper:
                        guarded = self._guard_wrapper(name, caller.name, impl.function, returns=impl.wrapper)
                    else:
                        guarded = self._guard(name, caller.name, impl.function)
                    impl.function = guarded  # type: ignore[misc]

    def _guard(self, plugin: str, hook: str, function: Callable) -> Callable:
        """Name plugin and hook in any exception; record the answer for :meth:`Hooks._collect`; time the call when
        tracing."""

        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = function(*args, **kwargs)
            except (PluginError, OptionError, StepCheckError, FirstRunError):
                # Already name what is wrong (an option error names the key or variable); a failed first-step
                # check is the hook's answer, which the core's repair loop reads.
                raise
            except Exception as e:
                raise PluginError(f"plugin {plugin!r} raised in hook {hook}: {type(e).__name__}: {e}") from e
            _record_answer(hook, _Answer(plugin, result, wrapper=False))
            if self.trace:
                answer = "no answer" if result is None else f"answered {type(result).__name__}"
                trace_logger.info(
                    "hook %s: plugin %s %s in %.3f ms", hook, plugin, answer, (time.perf_counter() - start) * 1e3
                )
            return result

        return guarded

    def _guard_wrapper(self, plugin: str, hook: str, function: Callable, returns: bool) -> Callable:
        """The guard of a wrapper: the same, around the generator pluggy drives (``yield from`` hands it the inner
        result or exception unchanged). Only new-style wrappers (``returns``) return a result to record."""

        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
            start = time.perf_counter()
            try:
                result = yield from function(*args, **kwargs)
            except (PluginError, OptionError, StepCheckError, FirstRunError):
                # As in _guard; and an inner implementation's exception passes through a wrapper unchanged here,
                # so a failed first step stays the answer the repair loop reads, whichever wrapper it crossed.
                raise
            except Exception as e:
                raise PluginError(f"plugin {plugin!r} raised in hook {hook} (wrapper): {type(e).__name__}: {e}") from e
            if returns:
                _record_answer(hook, _Answer(plugin, result, wrapper=True))
            if self.trace:
                trace_logger.info(
                    "hook %s: wrapper of plugin %s done in %.3f ms", hook, plugin, (time.perf_counter() - start) * 1e3
                )
            return result

        return guarded

    def _configure(self) -> None:
        known = sorted(self.records)
        for name in self.config.enable:
            record = self.records.get(name)
            if record is None:
                raise PluginError(
                    f"plugin {name!r} is listed in [plugins] enable but not installed; installed: "
                    f"{', '.join(known) or 'none'}.{_suggest(name, known)}"
                )
        if self.autoload:
            self._check_disabled(known)
        for name in self.config.plugin_tables:
            if name not in self.records:
                raise OptionError(
                    f"[plugins.{name}] names no installed plugin; installed: {', '.join(known) or 'none'}."
                    f"{_suggest(name, known)}"
                )
        options: dict[str, Any] = {}
        sources: dict[str, str] = {}
        declared: dict[str, type] = {}
        for name, options_class in Hooks(self)._collect("ortcore_options_class"):
            if name in declared and declared[name] is not options_class:
                raise PluginError(f"plugin {name!r} declares two options classes (hook ortcore_options_class)")
            declared[name] = options_class
        for name, record in self.records.items():
            if not record.enabled:
                continue
            record.options_class = declared.get(name)
            table = self.config.plugin_tables.get(name, {})
            if record.options_class is None:
                if table:
                    raise OptionError(f"[plugins.{name}] sets {sorted(table)} but plugin {name!r} takes no options")
                continue
            where = f"plugins.{name}."
            options[name], found = build_options(
                record.options_class, [(self.config._file_source, table)], self.config.env, where
            )
            sources.update({f"{where}{k}": v for k, v in found.items()})
        self.config = attrs.evolve(self.config, plugins=options, sources={**self.config.sources, **sources})
        for unread in self.unread_env_vars(self.config.env):
            # Never silent: a variable nothing reads is a typo or the variable of a plugin that is off.
            logger.warning("%s", unread)
        self.pm.hook.ortcore_configure(config=self.config)

    def close(self) -> None:
        self.pm.hook.ortcore_unconfigure(config=self.config)

    # -- introspection ----------------------------------------------------------------------------------------------
    def known_env_vars(self) -> dict[str, str]:
        """Every environment variable ortcore or a loaded plugin reads, with the option it sets."""
        known = {f.metadata["env"]: f"core.{f.name}" for f in attrs.fields(CoreOptions) if f.metadata.get("env")}
        known.update(CORE_READ_ENV_VARS)
        for name, record in self.records.items():
            if record.options_class is not None:
                for f in attrs.fields(record.options_class):
                    env = f.metadata.get("env")
                    for var in (env,) if isinstance(env, str) else env or ():
                        known[var] = f"plugins.{name}.{f.name}"
        known.update(
            {
                "ORTCORE_CONFIG": "the ortcore.toml to use",
                "ORTCORE_DISABLE_PLUGINS": "plugins not to load (comma list)",
                "ORTCORE_TRACE_HOOKS": "log every hook call",
            }
        )
        return known

    def unread_env_vars(self, env: Mapping[str, str]) -> list[UnreadVariable]:
        """``ORTMODULE_*``/``ORTCORE_*`` variables that are set but that nothing loaded reads: each names the plugin
        that would read it and why that plugin is off (disabled, failed to load, not loaded, not installed), or,
        for a variable no plugin declares, the closest known name (a typo)."""
        known = self.known_env_vars()
        readers = {var: plugin for plugin, variables in PLUGIN_ENV_VARS.items() for var in variables}
        unread = []
        for var in sorted(v for v in env if v.startswith(("ORTMODULE_", "ORTCORE_"))):
            if var in known:
                continue
            if var in readers:
                plugin = readers[var]
                others = ", ".join(
                    f"{p!r} reads it ({what})"
                    for p, what in ALSO_READ_BY.get(var, ())
                    if p in self.records and self.records[p].enabled
                )
                unread.append(UnreadVariable(var, plugin, *self._plugin_off(plugin), others=others))
                continue
            close = difflib.get_close_matches(var, [*known, *(v for v in readers if v not in known)], n=1)
            note = ""
            if close and close[0] not in known:
                state, _ = self._plugin_off(readers[close[0]])
                note = f" It is read by the plugin {readers[close[0]]!r}, which {state}"
            unread.append(UnreadVariable(var, suggestion=close[0] if close else None, suggestion_note=note))
        return unread

    def _plugin_off(self, name: str) -> tuple[str, str]:
        """Why plugin ``name`` reads nothing in this host, and what turns it on."""
        record = self.records.get(name)
        if record is not None and record.status == "disabled":
            where = self.config.disabled_by(name) or "[plugins] disable / ORTCORE_DISABLE_PLUGINS"
            return f"is disabled ({where})", f"enable the plugin (remove {name!r} from {where})"
        if record is not None and record.status == "failed":
            return "failed to load", f"fix or reinstall {record.distribution!r} (its error is logged)"
        if name in builtin_plugins():
            return "is not loaded", f"load the plugin {name!r}"
        return "is not installed", f"install the plugin {name!r} (it ships with ortcore: reinstall ortcore)"

    def hooks_of(self, name: str) -> list[str]:
        """Names of the hooks plugin ``name`` implements."""
        plugin = self.pm.get_plugin(name)
        return sorted(c.name for c in self.pm.get_hookcallers(plugin) or []) if plugin is not None else []


def _record_answer(hook: str, answer: _Answer) -> None:
    recording = _recording.get()
    if recording is not None and recording[0] == hook:  # not a hook some plugin calls from inside the recorded one
        recording[1].append(answer)


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


class Hooks:
    """The typed facade through which the core calls plugins."""

    def __init__(self, host: PluginHost):
        self._host = host
        self._hook = host.pm.hook
        self._registry: Registry | None = None

    @property
    def config(self) -> Config:
        return self._host.config

    @property
    def host(self) -> PluginHost:
        """The plugin host these hooks call into."""
        return self._host

    def exporter(self, config: Config | None = None) -> Any:
        """The exporter for an ORTModule with ``config`` (default: the host's): a plugin's ``ortcore_exporter``
        answer, else the one the ``exporter`` option names among those registered (``ortcore_register``)."""
        from .exporter import exporter_name

        config = config or self.config
        chosen = self._hook.ortcore_exporter(config=config)
        if chosen is not None:
            return chosen
        name = exporter_name(config)
        factories = self.exporters()
        if name not in factories:
            source = config.sources.get("core.exporter", "option")
            raise OptionError(
                f"exporter={name!r} ({source}) is not allowed; exporters offered by the loaded plugins: "
                f"{', '.join(sorted(factories)) or 'none'}"
            )
        return factories[name](config)

    def registry(self) -> Registry:
        """What the plugins registered by name (``ortcore_register``), collected once: each implementation is
        called on its own (last registered first, as pluggy orders them), so every name is known by its plugin."""
        if self._registry is None:
            registry = Registry()
            arguments = {"config": self.config, "register": registry}
            for impl in reversed(self._hook.ortcore_register.get_hookimpls()):
                if impl.hookwrapper or impl.wrapper:
                    continue
                registry.plugin = impl.plugin_name
                impl.function(**{name: arguments[name] for name in impl.argnames})
            self._registry = registry
        return self._registry

    def exporters(self) -> dict[str, Any]:
        return self.registry().of("exporter")

    # -- calling a hook and knowing who answered -------------------------------------------------------------------
    def _call_recorded(self, hook: str, kwargs: Mapping[str, Any]) -> tuple[list[Any], list[_Answer]]:
        """The hook's results, called through pluggy (plugins' wrappers apply), and what each implementation
        answered, in call order (the guard records it; a wrapper's answer is the result it returned)."""
        answers: list[_Answer] = []
        token = _recording.set((hook, answers))
        try:
            results = getattr(self._hook, hook)(**kwargs)
        finally:
            _recording.reset(token)
        return results, answers

    def _collect(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """``(plugin, contribution)`` for each contribution in a collecting hook's result, in pluggy's order.

        A contribution belongs to the implementation that answered it (identity, not equality: two plugins may
        answer equal values); one only a wrapper returned belongs to the innermost wrapper that returned it."""
        results, answers = self._call_recorded(hook, kwargs)
        unclaimed = [a for a in answers if not a.wrapper]
        pairs = []
        for contribution in results:
            owner = next((a for a in unclaimed if a.value is contribution), None)
            if owner is not None:
                unclaimed.remove(owner)
                pairs.append((owner.plugin, contribution))
                continue
            made_by = (a.plugin for a in answers if a.wrapper and any(c is contribution for c in a.value or ()))
            pairs.append((next(made_by, "<unknown>"), contribution))
        return pairs

    def _collect_items(self, hook: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """``(plugin, item)`` for every item of a hook whose contributions are lists. An item belongs to the
        implementation that first answered it, so a wrapper that filters or reorders another plugin's list does not
        take its items over; items a wrapper added belong to that wrapper."""
        results, answers = self._call_recorded(hook, kwargs)
        owners: dict[int, str] = {}
        for answer in answers:  # implementations first, then wrappers inner to outer: the call order
            if not answer.wrapper and not isinstance(answer.value, (list, tuple, type(None))):
                raise PluginError(
                    f"plugin {answer.plugin!r} answered hook {hook} with a {type(answer.value).__name__}; "
                    "a list is expected"
                )
            contributions = (answer.value or ()) if answer.wrapper else (answer.value,)
            for contribution in contributions:
                for item in contribution or ():
                    owners.setdefault(id(item), answer.plugin)
        return [(owners.get(id(item), "<unknown>"), item) for contribution in results for item in contribution or ()]

    def _merged(self, hook: str, offer: str, **kwargs: Any) -> dict[str, Any]:
        """The dicts ``hook``'s implementations return, merged; one name offered by two plugins with different values
        is a PluginError: "plugins 'a' and 'b' both <offer> 'name'"."""
        merged: dict[str, tuple[str, Any]] = {}
        for plugin, contribution in self._collect(hook, **kwargs):
            for name, value in (contribution or {}).items():
                if name in merged and merged[name][1] is not value:
                    raise PluginError(f"plugins {merged[name][0]!r} and {plugin!r} both {offer} {name!r}")
                merged[name] = (plugin, value)
        return {name: value for name, (_, value) in merged.items()}

    # -- export ---------------------------------------------------------------------------------------------------
    def export_failed(self, error: Any, symbolics: dict[str, Any], config: Config | None = None) -> dict | None:
        """Symbolics a plugin adds so that the TorchScript export ``error`` stopped succeeds (``ortcore_export_failed``,
        the first answer), or None."""
        return self._hook.ortcore_export_failed(config=config or self.config, error=error, symbolics=symbolics)

    def export_symbolics(self, config: Config | None = None) -> dict[str, Any]:
        return self._merged("ortcore_export_symbolics", "register a symbolic for", config=config or self.config)

    def export_translations(self) -> dict[Any, Any]:
        return self._merged("ortcore_export_translations", "translate", config=self.config)

    def program_passes(self) -> list[GraphPass]:
        found = self._collect_items("ortcore_program_passes", config=self.config)
        return order_passes(attrs.evolve(p, plugin=plugin) for plugin, p in found)

    def graph_passes(self) -> list[GraphPass]:
        found = self._collect_items("ortcore_graph_passes", config=self.config)
        return order_passes(attrs.evolve(p, plugin=plugin) for plugin, p in found)

    def export_key(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for contribution in self._hook.ortcore_export_key(config=self.config):
            merged.update(contribution or {})
        return merged

    def load_export(self, module: Any, fingerprint: str) -> Any:
        return self._hook.ortcore_load_export(config=self.config, module=module, fingerprint=fingerprint)

    def export_done(self, module: Any, fingerprint: str, graph: Any) -> None:
        self._hook.ortcore_export_done(config=self.config, module=module, fingerprint=fingerprint, graph=graph)

    def graph_transformer_config(self, transformer_config: Any, training: bool) -> None:
        self._hook.ortcore_graph_transformer_config(
            config=self.config, transformer_config=transformer_config, training=training
        )

    def lower_stop_gradients(self, lowering: Any) -> None:
        """Let plugins decide how ``lowering``'s detach() markers run (``ortcore_lower_stop_gradients``); what they
        left undecided the core reads from ``lowering.result()``."""
        self._hook.ortcore_lower_stop_gradients(config=self.config, lowering=lowering)

    def gradient_graph_passes(self) -> list[GraphPass]:
        found = self._collect_items("ortcore_gradient_graph_passes", config=self.config)
        return order_passes(attrs.evolve(p, plugin=plugin) for plugin, p in found)

    def session_plan(self, graph: Any, plan: Any) -> None:
        self._hook.ortcore_session_plan(config=self.config, graph=graph, plan=plan)

    def commands(self, subparsers: Any) -> None:
        self._hook.ortcore_commands(subparsers=subparsers)

    def session_created(self, session: Any) -> None:
        self._hook.ortcore_session_created(config=self.config, session=session)

    def runtime_inspectors(self, module: Any) -> list[Any]:
        return [
            i for found in self._hook.ortcore_runtime_inspectors(config=self.config, module=module) for i in found or []
        ]

    def explain_notes(self, module: Any, config: Config | None = None) -> list[str]:
        """The lines plugins add below ``module``'s ``explain()`` table (``ortcore_explain_notes``), in answer order."""
        found = self._collect_items("ortcore_explain_notes", config=config or self.config, module=module)
        return [str(line) for _, line in found]

    def activation_subscribers(self, module: Any) -> list[Any]:
        found = self._hook.ortcore_activation_subscribers(config=self.config, module=module)
        return [s for group in found for s in group or []]

    def subscriber_classes(self) -> dict[str, type]:
        return self.registry().of("subscriber_class")

    def optimizers(self) -> dict[str, type]:
        return self.registry().of("optimizer")

    def export_contexts(self, module: Any, config: Any = None) -> list[Any]:
        """The context managers plugins enter around tracing ``module`` (``ortcore_export_context``), asked with
        ``config``: the ORTModule's own (its keyword options, such as ``exporter=``), else the host's."""
        config = config if config is not None else self.config
        return [c for _, c in self._collect("ortcore_export_context", config=config, module=module) if c]

    def repairs(self, failure: Any, config: Config | None = None) -> list[Any]:
        """Every plugin's repairs of ``failure`` (``ortcore_repairs``) for a model with ``config`` (default: the
        host's), in the order plugins answered."""
        found = self._collect_items("ortcore_repairs", config=config or self.config, failure=failure)
        return [item for _, item in found]

    def load_repairs(self, module: Any, fingerprint: str) -> list[dict] | None:
        return self._hook.ortcore_load_repairs(config=self.config, module=module, fingerprint=fingerprint)

    def repairs_found(self, module: Any, fingerprint: str, repairs: list[dict]) -> None:
        self._hook.ortcore_repairs_found(config=self.config, module=module, fingerprint=fingerprint, repairs=repairs)

    def data_utilities(self) -> dict[str, Any]:
        return self.registry().of("data_utility")

    def check_first_step(self, step: Any) -> list[Any]:
        """The checks' reports on a new session's first step (``ortcore_check_first_step``); a check that fails it
        raises. Empty when no enabled plugin checks."""
        return [r for r in self._hook.ortcore_check_first_step(config=self.config, step=step) if r is not None]

    def checks_first_steps(self) -> bool:
        return bool(self._hook.ortcore_check_first_step.get_hookimpls())

    def autograd_function_handler(self, function: type) -> Any:
        return self._hook.ortcore_autograd_function_handler(config=self.config, function=function)


_default_host: PluginHost | None = None
_default_host_key: tuple | None = None
_pinned = False


def _environment_key() -> tuple:
    """What the default host was built from: the working directory, every ortcore-related variable and the config
    file found from them (its path, modification time and size), so a file written or edited since is read again."""
    variables = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("ORTMODULE_", "ORTCORE_"))))
    try:
        file = find_config_file()
        stat = file.stat() if file is not None else None
        found = (str(file), stat.st_mtime_ns, stat.st_size) if stat is not None else None
    except (OptionError, OSError) as e:  # building the host reports it
        found = ("error", str(e))
    return os.getcwd(), variables, found


def get_host() -> PluginHost:
    """The process-wide host, built from :meth:`Config.load`; rebuilt if the environment or directory changed."""
    global _default_host, _default_host_key
    key = _environment_key()
    if _default_host is None or (not _pinned and key != _default_host_key):
        _default_host, _default_host_key = PluginHost(), key
    return _default_host


def contributed_subscribers(model: Any, host: PluginHost | None = None) -> list[Any]:
    """The activation subscribers plugins contribute for ``model`` (``ortcore_activation_subscribers``), asked of
    ``host`` or of the process-wide host."""
    return (host or get_host()).hooks.activation_subscribers(model)


def set_host(host: PluginHost | None) -> PluginHost | None:
    """Pin the process-wide host (``None`` unpins it); returns the host pinned before, or None if none was, so that
    ``set_host(previous)`` restores exactly what was there. Tests and embedders use this."""
    global _default_host, _default_host_key, _pinned
    previous = _default_host if _pinned else None
    _default_host, _default_host_key, _pinned = host, _environment_key(), host is not None
    return previous
