"""Public modules whose names come from plugins: ``ortcore.optim`` (``register.optimizer``) and ``ortcore.utils.data``
(``register.data_utility``), both through ``ortcore_register``.

Such a module holds a :class:`ContributedNames` and forwards its module-level ``__getattr__``/``__dir__`` to it. A name
is looked up in the loaded plugins' contributions on first access. When it is missing, the plugin that would provide
it is found by reading each not-loaded plugin's source for a module-level tuple (``OPTIMIZERS``, ``DATA_UTILITIES``)
that lists it, without importing that plugin: its error says to enable it (disabled) or why it failed (load error).
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .host import PluginHost

__all__ = ["ContributedNames", "declared_names"]


def declared_names(module: str, variable: str) -> tuple[str, ...]:
    """The module-level tuple ``variable`` of the plugin module ``module``, read from its source without importing it;
    () when the module or the tuple is absent or not a literal."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ()
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return ()
            return tuple(v for v in value if isinstance(v, str))
    return ()


class ContributedNames:
    """The names one hook of the plugins offers, as attributes of the public module ``module``.

    ``collect(host)`` returns the merged ``{name: object}`` of the loaded plugins; ``declared`` is the module-level
    tuple a plugin lists its names in; ``what`` describes them in errors ("optimizers").
    """

    def __init__(self, module: str, collect: Callable[[PluginHost], dict[str, Any]], declared: str, what: str):
        self.module = module
        self.collect = collect
        self.declared = declared
        self.what = what

    def available(self, host: PluginHost | None = None) -> dict[str, Any]:
        from .host import get_host

        return self.collect(host or get_host())

    def unavailable_provider(self, host: PluginHost, name: str) -> tuple[str, str] | None:
        """``(plugin, status)`` of a plugin that is not loaded (disabled or failed) and declares ``name``, or None."""
        import importlib_metadata

        from .host import ENTRY_POINT_GROUP

        for plugin, record in sorted(host.records.items()):
            if record.enabled:
                continue
            for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=plugin):
                if name in declared_names(ep.module, self.declared):
                    return plugin, record.status
        return None

    def resolve(self, name: str, host: PluginHost | None = None) -> Any:
        from .host import get_host

        host = host or get_host()
        available = self.collect(host)
        if name in available:
            return available[name]
        provider = self.unavailable_provider(host, name)
        if provider is not None:
            plugin, status = provider
            if status == "disabled":
                raise ImportError(
                    f"{self.module}.{name} is provided by plugin {plugin!r}, which is disabled; enable it by removing "
                    f"{plugin!r} from [plugins] disable in ortcore.toml and from ORTCORE_DISABLE_PLUGINS",
                    name=self.module,
                )
            error = host.records[plugin].error
            raise ImportError(
                f"{self.module}.{name} is provided by plugin {plugin!r}, which failed to load: {error}",
                name=self.module,
            )
        raise AttributeError(
            f"module {self.module!r} has no attribute {name!r}; {self.what} from installed plugins: "
            f"{sorted(available) or 'none'}"
        )

    def getattr(self, name: str) -> Any:
        """The module-level ``__getattr__``: dunders (copy, pickle, inspect probes) never reach the plugins."""
        if name.startswith("__"):
            raise AttributeError(name)
        return self.resolve(name)

    def dir(self, module_globals: dict[str, Any]) -> list[str]:
        return sorted({*module_globals, *self.available()})
