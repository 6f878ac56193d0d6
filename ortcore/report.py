"""What ``ortcore plugins`` and ``ortcore config`` report, as plain data (the CLI prints it); :func:`load_host` builds
the host as an ORTModule would (the doctor plugin uses it too)."""

from __future__ import annotations

from typing import Any

import attrs

from .config import Config, CoreOptions
from .host import PluginHost


@attrs.frozen
class PluginRow:
    name: str
    version: str
    source: str  # "built-in" or the distribution
    enabled: str  # "yes", "no (disabled)", "failed: ..."
    hooks: tuple[str, ...]
    options: tuple[str, ...]


def plugin_rows(host: PluginHost) -> list[PluginRow]:
    rows = []
    for name, record in sorted(host.records.items()):
        if name == "core":
            continue
        if record.status == "loaded":
            enabled = "yes"
        elif record.status == "disabled":
            enabled = "no (disabled)"
        else:
            enabled = f"failed: {record.error}"
        options = ()
        if record.options_class is not None:
            values = host.config.plugin_options(name)
            options = tuple(f"{f.name}={getattr(values, f.name)!r}" for f in attrs.fields(record.options_class))
        rows.append(
            PluginRow(
                name=name,
                version=record.version,
                source="built-in" if record.builtin else record.distribution,
                enabled=enabled,
                hooks=tuple(h for h in host.hooks_of(name)),
                options=options,
            )
        )
    return rows


@attrs.frozen
class ConfigRow:
    key: str
    value: str
    source: str
    env: str
    doc: str


def config_rows(host: PluginHost) -> list[ConfigRow]:
    """Every effective option, where it came from, and its environment variable."""
    config = host.config
    rows = []

    def add(prefix: str, cls: type, values: Any) -> None:
        for f in attrs.fields(cls):
            key = f"{prefix}{f.name}"
            rows.append(
                ConfigRow(
                    key=key,
                    value=_show(getattr(values, f.name)),
                    source=config.sources.get(key, "default"),
                    env=f.metadata.get("env") or "",
                    doc=f.metadata.get("doc", ""),
                )
            )

    add("core.", CoreOptions, config.core)
    for name, record in sorted(host.records.items()):
        if record.options_class is not None and record.enabled:
            add(f"plugins.{name}.", record.options_class, config.plugin_options(name))
    return rows


def _show(value: Any) -> str:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else repr(value)


def load_host() -> tuple[PluginHost | None, Exception | None]:
    """The host as an ORTModule would build it, or the configuration error that prevents it."""
    try:
        return PluginHost(Config.load()), None
    except Exception as e:  # reported by the caller, naming the problem
        return None, e
