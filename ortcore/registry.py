"""What plugins contribute by name, through one hook: ``ortcore_register(config, register)``.

A plugin calls ``register.exporter(name, factory)``, ``register.subscriber_class(name, cls)``,
``register.optimizer(name, obj)`` or ``register.data_utility(name, obj)``; the host collects every plugin's calls
once, remembering who registered what, and refuses one name registered twice with different values (naming both
plugins). The core reads the kinds through :class:`ortcore.host.Hooks` (``exporters()``, ``optimizers()``, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import PluginError

#: The kinds of named things, and how an error names a registration of each.
KINDS: dict[str, str] = {
    "exporter": "offer an exporter named",
    "subscriber_class": "offer a subscriber class named",
    "optimizer": "offer an optimizer",
    "data_utility": "offer a data utility",
}


class Registry:
    """The ``register`` argument of ``ortcore_register``; one per host, filled once."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, tuple[str, Any]]] = {kind: {} for kind in KINDS}
        self.plugin = ""  # who is registering now (set by the host around each plugin's call)

    def _add(self, kind: str, name: str, value: Any) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {self.plugin!r} registered a {kind} under {name!r}: a name must be a string")
        entries = self._entries[kind]
        if name in entries and entries[name][1] is not value:
            raise PluginError(f"plugins {entries[name][0]!r} and {self.plugin!r} both {KINDS[kind]} {name!r}")
        entries[name] = (self.plugin, value)

    def exporter(self, name: str, factory: Callable[[Any], Any]) -> None:
        """An exporter the ``exporter`` option can name: ``factory(config)`` returns an ``ortcore.api.Exporter``."""
        self._add("exporter", name, factory)

    def subscriber_class(self, name: str, cls: type) -> None:
        """An activation-subscriber class, importable as ``ortcore.hooks.<name>``."""
        self._add("subscriber_class", name, cls)

    def optimizer(self, name: str, value: Any) -> None:
        """An optimizer class, factory, wrapper or mode enum, importable as ``ortcore.optim.<name>``."""
        self._add("optimizer", name, value)

    def data_utility(self, name: str, value: Any) -> None:
        """A data-loading class (a sampler), importable as ``ortcore.utils.data.<name>``."""
        self._add("data_utility", name, value)

    def of(self, kind: str) -> dict[str, Any]:
        """Everything registered of ``kind``, by name."""
        return {name: value for name, (_, value) in self._entries[kind].items()}

    def owner(self, kind: str, name: str) -> str | None:
        """The plugin that registered ``name`` of ``kind``."""
        entry = self._entries[kind].get(name)
        return entry[0] if entry else None
