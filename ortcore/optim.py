"""Optimizers contributed by plugins, resolved on first access through the process-wide plugin host::

    from ortcore.optim import FusedAdam, AdamWMode
    optimizer = FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH)

Each name comes from a plugin's ``ortcore_register`` hook (``register.optimizer``) (the built-in ``fused_adam`` plugin provides
``FusedAdam`` and ``AdamWMode``). A name whose plugin is disabled raises an ImportError naming that plugin and how to
enable it; one that no installed plugin knows raises an AttributeError listing what is available.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .contributed import ContributedNames
from .contributed import declared_names as _declared_names

if TYPE_CHECKING:
    from .host import PluginHost

__all__ = ["optimizers"]

_names = ContributedNames(__name__, lambda host: host.hooks.optimizers(), "OPTIMIZERS", "optimizers")


def optimizers(host: PluginHost | None = None) -> dict[str, type]:
    """``{name: class}`` of every optimizer the loaded plugins of ``host`` (default: the process-wide host) offer."""
    return _names.available(host)


def declared_names(module: str) -> tuple[str, ...]:
    """The module-level ``OPTIMIZERS`` tuple of a plugin module, read from its source without importing it."""
    return _declared_names(module, "OPTIMIZERS")


def resolve(name: str, host: PluginHost | None = None) -> type:
    """The optimizer ``name`` from ``host``'s plugins (default: the process-wide host); see the module docstring."""
    return _names.resolve(name, host)


def __getattr__(name: str) -> Any:
    return _names.getattr(name)


def __dir__() -> list[str]:
    return _names.dir(globals())
