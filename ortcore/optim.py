"""Optimizers contributed by plugins, resolved on first access through the process-wide plugin host::

    from ortcore.optim import FusedAdam, AdamWMode
    optimizer = FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH)

Each name comes from a plugin's ``ortcore_optimizers`` hook (the built-in ``fused_adam`` plugin provides
``FusedAdam`` and ``AdamWMode``). A name whose plugin is disabled raises an ImportError naming that plugin and how to
enable it; one that no installed plugin knows raises an AttributeError listing what is available.
"""

from __future__ import annotations

import ast
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plugins import PluginHost

__all__ = ["optimizers"]


def optimizers(host: PluginHost | None = None) -> dict[str, type]:
    """``{name: class}`` of every optimizer the loaded plugins of ``host`` (default: the process-wide host) offer."""
    from .plugins import get_host

    return (host or get_host()).hooks.optimizers()


def declared_names(module: str) -> tuple[str, ...]:
    """The module-level ``OPTIMIZERS`` tuple of a plugin module, read from its source without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ()
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "OPTIMIZERS" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return ()
            return tuple(v for v in value if isinstance(v, str))
    return ()


def _unavailable_provider(host: PluginHost, name: str) -> tuple[str, str] | None:
    """``(plugin, status)`` of a plugin that is not loaded (disabled or failed) and declares ``name``, or None."""
    import importlib_metadata

    from .plugins import ENTRY_POINT_GROUP

    for plugin, record in sorted(host.records.items()):
        if record.enabled:
            continue
        for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP, name=plugin):
            if name in declared_names(ep.module):
                return plugin, record.status
    return None


def resolve(name: str, host: PluginHost | None = None) -> type:
    """The optimizer ``name`` from ``host``'s plugins (default: the process-wide host); see the module docstring."""
    from .plugins import get_host

    host = host or get_host()
    available = host.hooks.optimizers()
    if name in available:
        return available[name]
    provider = _unavailable_provider(host, name)
    if provider is not None:
        plugin, status = provider
        if status == "disabled":
            raise ImportError(
                f"ortcore.optim.{name} is provided by plugin {plugin!r}, which is disabled; enable it by removing "
                f"{plugin!r} from [plugins] disable in ortcore.toml and from ORTCORE_DISABLE_PLUGINS",
                name=__name__,
            )
        error = host.records[plugin].error
        raise ImportError(
            f"ortcore.optim.{name} is provided by plugin {plugin!r}, which failed to load: {error}", name=__name__
        )
    raise AttributeError(
        f"module 'ortcore.optim' has no attribute {name!r}; optimizers from installed plugins: "
        f"{sorted(available) or 'none'}"
    )


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)  # dunders (copy, pickle, inspect probes): no plugin lookup
    return resolve(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *optimizers()})
