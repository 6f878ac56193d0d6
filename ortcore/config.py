"""Configuration: ``ortcore.toml`` (or ``[tool.ortcore]`` in ``pyproject.toml``), code arguments and env vars.

Precedence, lowest first: defaults < file < code (``DebugOptions``, ``ORTModule`` arguments) < environment.
Every value is validated before anything is applied: a bad key or value raises :class:`OptionError` naming the
key, the value, what is allowed and the closest match, and a broken file never half-applies.

Example ``ortcore.toml``::

    opset = 17
    log_level = "INFO"
    fallback_policy = "FALLBACK_DISABLE"

    [plugins]
    disable = ["runtime_inspector"]

    [plugins.memory_recompute]
    level = 1
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .errors import OptionError
from .options import ONNX_OPSET_VERSION, DebugOptions, FallbackPolicy, LogLevel, parse_bool, parse_opset

CONFIG_FILE = "ortcore.toml"
CONFIG_ENV = "ORTCORE_CONFIG"


def _str(value: object, source: str) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{source}={value!r} must be a string")
    return value


DYNAMIC_SHAPES = ("auto", "always")


def _dynamic_shapes(value: object, source: str) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in DYNAMIC_SHAPES:
        raise OptionError(
            f"{source}={value!r} is not allowed; allowed: auto (export the first call's sizes, a dimension dynamic "
            "once a call changes it) or always (every dimension dynamic from the first export)"
        )
    return text


def _exporter_name(value: object, source: str) -> str:
    """An exporter's name; which names exist is known once plugins are loaded (``Hooks.exporter`` checks it)."""
    if not isinstance(value, str) or not value.strip().isidentifier():
        raise OptionError(
            f"{source}={value!r} is not allowed; expected an exporter's name, such as torchscript or dynamo"
        )
    return value.strip()


def int_at_least(minimum: int) -> Callable[[object, str], int]:
    """An option parser for integers ``>= minimum`` (from the TOML file or a string from the environment); anything
    else raises :class:`OptionError` naming the source, the value and what is allowed. Plugins use it too."""

    def parse(value: object, source: str) -> int:
        try:
            number = int(str(value).strip()) if not isinstance(value, bool | float) else None
        except ValueError:
            number = None
        if number is None or number < minimum:
            raise OptionError(f"{source}={value!r} is not allowed; allowed: an integer >= {minimum}")
        return number

    return parse


_positive_int = int_at_least(1)


def _tolerance(value: object, source: str) -> float:
    try:
        number = float(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not 0.0 <= number < float("inf"):
        raise OptionError(f"{source}={value!r} is not allowed; allowed: a finite number >= 0, e.g. 1e-3")
    return number


def option(default: Any, parse: Callable[[object, str], Any], doc: str, env: str | None = None, **meta: Any):
    """An ``attrs`` field of an options class: its parser, its doc line and its environment variable."""
    return attrs.field(default=default, metadata={"parse": parse, "doc": doc, "env": env, **meta})


@attrs.frozen
class CoreOptions:
    """The core's options; each field's metadata names its ``ORTMODULE_*`` twin."""

    opset: int = option(
        ONNX_OPSET_VERSION, parse_opset, "ONNX opset of the export (14-20)", "ORTMODULE_ONNX_OPSET_VERSION"
    )
    fallback_policy: FallbackPolicy = option(
        FallbackPolicy.default(),
        FallbackPolicy.parse,
        "which failures fall back to PyTorch (flags joined by '|')",
        "ORTMODULE_FALLBACK_POLICY",
    )
    fallback_retry: bool = option(
        False, parse_bool, "after a fallback, retry ORT on later calls", "ORTMODULE_FALLBACK_RETRY"
    )
    log_level: LogLevel = option(LogLevel.WARNING, LogLevel.parse, "VERBOSE..FATAL", "ORTMODULE_LOG_LEVEL")
    save_onnx: bool = option(False, parse_bool, "save the exported and built graphs")
    onnx_prefix: str = option("", _str, "file name prefix of saved graphs")
    save_onnx_path: str = option("", _str, "directory of saved graphs (default: cwd)", "ORTMODULE_SAVE_ONNX_PATH")
    deepcopy_before_export: bool = option(
        True, parse_bool, "trace a deep copy of the model", "ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT"
    )
    max_cached_graphs: int = option(8, _positive_int, "graphs and sessions kept per model (LRU)")
    dynamic_shapes: str = option(
        "auto",
        _dynamic_shapes,
        "auto: the graph is exported for the first call's input sizes and a dimension becomes dynamic once a call "
        "changes it (as torch.compile's automatic dynamic shapes); always: every input dimension dynamic from the "
        "first export",
        "ORTCORE_DYNAMIC_SHAPES",
    )
    exporter: str = option(
        "torchscript",
        _exporter_name,
        "which exporter turns the model into ONNX: torchscript (the default), dynamo (torch.export + onnxscript), or "
        "one a plugin registers (ortcore_register)",
        "ORTCORE_EXPORTER",
    )
    verify_gradients: bool = option(
        True,
        parse_bool,
        "gradient audit: on the first step of each new training graph, compare outputs, loss and every gradient "
        "with PyTorch's (docs/gradient_audit.md)",
        "ORTCORE_VERIFY_GRADIENTS",
    )
    verify_gradients_rtol: float = option(
        1e-3, _tolerance, "gradient audit: allowed difference, relative to the largest value of PyTorch's tensor"
    )
    verify_gradients_atol: float = option(1e-6, _tolerance, "gradient audit: allowed absolute difference")

    @property
    def save_dir(self) -> str:
        return self.save_onnx_path or os.getcwd()


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def build_options(
    cls: type,
    layers: list[tuple[str, Mapping[str, Any]]],
    env: Mapping[str, str],
    where: str,
) -> tuple[Any, dict[str, str]]:
    """Fill an options class from layers of ``(source, values)`` (lowest first), then its env vars.

    Returns the instance and, per field, where its value came from. Raises OptionError naming the bad key.
    """
    fields = {f.name: f for f in attrs.fields(cls)}
    values: dict[str, Any] = {}
    sources = dict.fromkeys(fields, "default")
    for source, layer in layers:
        for key, raw in layer.items():
            if key not in fields:
                raise OptionError(
                    f"unknown key {where + key!r} (in {source}); allowed: {', '.join(fields)}.{_suggest(key, list(fields))}"
                )
            values[key] = fields[key].metadata["parse"](raw, f"{where}{key}")
            sources[key] = source
    for name, f in fields.items():
        var = f.metadata.get("env")
        if var and env.get(var, "") != "":
            values[name] = f.metadata["parse"](env[var], var)
            sources[name] = f"env {var}"
    try:
        return cls(**values), sources
    except (TypeError, ValueError) as e:
        raise OptionError(f"invalid options for {where or 'core'}: {e}") from e


def find_config_file(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    """The config file: the argument, ``ORTCORE_CONFIG``, or the first ortcore.toml (or pyproject.toml with
    ``[tool.ortcore]``) from the working directory upwards."""
    env = os.environ if env is None else env
    explicit = path or env.get(CONFIG_ENV) or None
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            source = "argument" if path else CONFIG_ENV
            raise OptionError(f"config file {str(p)!r} (from {source}) does not exist")
        return p
    for folder in [Path.cwd(), *Path.cwd().parents]:
        if (folder / CONFIG_FILE).is_file():
            return folder / CONFIG_FILE
        pyproject = folder / "pyproject.toml"
        if pyproject.is_file() and "ortcore" in _read_toml(pyproject).get("tool", {}):
            return pyproject
    return None


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise OptionError(f"config file {str(path)!r} is not valid TOML: {e}") from e


@attrs.frozen
class Config:
    """The effective configuration: core options, which plugins to load, and each plugin's options."""

    core: CoreOptions = attrs.field(factory=CoreOptions)
    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()  # [plugins] disable and ORTCORE_DISABLE_PLUGINS together
    disable_in_file: tuple[str, ...] = ()  # [plugins] disable alone
    core_table: Mapping[str, Any] = attrs.field(factory=dict)
    plugin_tables: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    path: Path | None = None
    sources: Mapping[str, str] = attrs.field(factory=dict, eq=False)
    env: Mapping[str, str] = attrs.field(factory=dict, eq=False, repr=False)
    # Filled by the plugin host once plugins declared their option classes.
    plugins: Mapping[str, Any] = attrs.field(factory=dict, eq=False)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        *,
        env: Mapping[str, str] | None = None,
        search: bool = True,
    ) -> Config:
        """Load and validate the configuration (``search=False`` ignores files found by searching)."""
        env = dict(os.environ if env is None else env)
        file = find_config_file(path, env) if (path or search or env.get(CONFIG_ENV)) else None
        table: dict[str, Any] = {}
        if file is not None:
            data = _read_toml(file)
            table = data.get("tool", {}).get("ortcore", {}) if file.name == "pyproject.toml" else data
            if not isinstance(table, dict):
                raise OptionError(f"[tool.ortcore] in {str(file)!r} must be a table")
        return cls.from_table(table, file=file, env=env)

    @classmethod
    def from_table(
        cls, table: Mapping[str, Any], *, file: Path | None = None, env: Mapping[str, str] | None = None
    ) -> Config:
        env = dict(os.environ if env is None else env)
        table = dict(table)
        plugins = table.pop("plugins", {})
        if not isinstance(plugins, dict):
            raise OptionError(f"'plugins' must be a table ([plugins]), not {type(plugins).__name__}")
        source = f"file {file}" if file else "table"
        _check_top_level_keys(table, source)
        core, core_sources = _core_options([(source, table)], env)
        enable = _name_list(plugins.pop("enable", []), "plugins.enable")
        disable = _name_list(plugins.pop("disable", []), "plugins.disable")
        both = sorted(set(enable) & set(disable))
        if both:
            raise OptionError(f"plugins {both} are both enabled and disabled in [plugins]")
        for name, value in plugins.items():
            if not isinstance(value, dict):
                raise OptionError(
                    f"unknown key 'plugins.{name}' = {value!r}; allowed: enable, disable, and [plugins.<name>] tables"
                )
        env_disable = [n.strip() for n in env.get("ORTCORE_DISABLE_PLUGINS", "").split(",") if n.strip()]
        return cls(
            core=core,
            enable=tuple(enable),
            disable=tuple(dict.fromkeys([*disable, *env_disable])),
            disable_in_file=tuple(disable),
            core_table=table,
            plugin_tables=plugins,
            path=file,
            sources=core_sources,
            env=env,
        )

    def with_code_options(
        self,
        debug_options: DebugOptions | None,
        *,
        fallback_policy: object = None,
        opset: object = None,
        verify_gradients: object = None,
        exporter: object = None,
    ) -> Config:
        """Apply an ORTModule's code arguments: above the file, below the environment."""
        layer: dict[str, Any] = {}
        if debug_options is not None:
            layer.update(
                log_level=debug_options.log_level,
                save_onnx=debug_options.save_onnx,
                onnx_prefix=debug_options.onnx_prefix,
            )
            if debug_options.save_path:
                layer["save_onnx_path"] = debug_options.save_path
        if fallback_policy is not None:
            layer["fallback_policy"] = fallback_policy
        if opset is not None:
            layer["opset"] = opset
        if verify_gradients is not None:
            layer["verify_gradients"] = verify_gradients
        if exporter is not None:
            layer["exporter"] = exporter
        if not layer:
            return self
        core, sources = _core_options([(self._file_source, self.core_table), ("argument", layer)], self.env)
        return attrs.evolve(self, core=core, sources={**self.sources, **sources})

    def with_repaired_core(self, options: Mapping[str, Any]) -> Config:
        """Apply a repair's core options (``ortcore.repair.Repair`` with ``plugin = "core"``): above every other
        layer, the environment included, since a repair is the decision that the value asked for cannot serve this
        model. Each value is validated as the option's own parser would; a bad key or value raises OptionError."""
        fields = {f.name: f for f in attrs.fields(CoreOptions)}
        values: dict[str, Any] = {}
        for key, raw in options.items():
            if key not in fields:
                raise OptionError(
                    f"unknown core option {key!r} in a repair; allowed: {', '.join(fields)}.{_suggest(key, list(fields))}"
                )
            values[key] = fields[key].metadata["parse"](raw, key)
        core = attrs.evolve(self.core, **values)
        return attrs.evolve(self, core=core, sources={**self.sources, **{f"core.{k}": "repair" for k in values}})

    @property
    def _file_source(self) -> str:
        return f"file {self.path}" if self.path else "table"

    def disabled_by(self, name: str) -> str:
        """Where plugin ``name`` is disabled: ``[plugins] disable``, ``ORTCORE_DISABLE_PLUGINS`` or both ('' if it
        is not)."""
        env_disable = {n.strip() for n in self.env.get("ORTCORE_DISABLE_PLUGINS", "").split(",")}
        lists = (("[plugins] disable", self.disable_in_file), ("ORTCORE_DISABLE_PLUGINS", env_disable))
        return " and ".join(where for where, listed in lists if name in listed)

    def plugin_options(self, name: str) -> Any:
        """The validated options object of plugin ``name`` (None if it declares none)."""
        return self.plugins.get(name)


def _core_options(layers: list[tuple[str, Mapping[str, Any]]], env: Mapping[str, str]) -> tuple[CoreOptions, dict]:
    core, sources = build_options(CoreOptions, layers, env, "")
    if env.get("ORTMODULE_SAVE_ONNX_PATH", "") != "" and not core.save_onnx:
        # Setting the directory is asking for the files: save them even without DebugOptions(save_onnx=True).
        core = attrs.evolve(core, save_onnx=True, onnx_prefix=core.onnx_prefix or "ortcore")
        sources.update(save_onnx="env ORTMODULE_SAVE_ONNX_PATH", onnx_prefix="env ORTMODULE_SAVE_ONNX_PATH")
    if core.save_onnx and not core.onnx_prefix.strip():
        raise OptionError("onnx_prefix='': save_onnx=True needs a non-empty onnx_prefix to name the saved files")
    return core, {f"core.{k}": v for k, v in sources.items()}


def _check_top_level_keys(table: Mapping[str, Any], source: str) -> None:
    """The top level of ortcore.toml holds the core's options and the ``[plugins]`` table: an unknown key is matched
    against both (``[plugin]`` is a misspelled ``[plugins]``, not a misspelled option)."""
    fields = [f.name for f in attrs.fields(CoreOptions)]
    for key, value in table.items():
        if key in fields:
            continue
        hint = _suggest(key, [*fields, "plugins"])
        if not hint and isinstance(value, dict):
            hint = f" A plugin's options go in [plugins.{key}]."
        raise OptionError(
            f"unknown key {key!r} (in {source}); allowed: {', '.join(fields)} and the [plugins] table.{hint}"
        )


def _name_list(value: object, key: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise OptionError(f'{key}={value!r} must be a list of plugin names, e.g. ["export_cache"]')
    return list(value)


def disabled_plugins() -> set[str]:
    """The plugins ``[plugins] disable`` and ``ORTCORE_DISABLE_PLUGINS`` switch off, read without loading plugins;
    from the environment alone if ortcore.toml is broken (``ortcore config`` then names the problem: a command's
    ``--help`` must still work)."""
    try:
        return set(Config.load().disable)
    except (OptionError, OSError, ValueError):
        return {n.strip() for n in os.environ.get("ORTCORE_DISABLE_PLUGINS", "").split(",") if n.strip()}
