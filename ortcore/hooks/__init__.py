"""Activation collection: subscribe a model, receive every submodule's output and gradient.

The user's import path (upstream's ``onnxruntime.training.utils.hooks``). :class:`SubscriberBase` is the core's
subscriber protocol (:mod:`ortcore.taps`); ``GlobalSubscriberManager`` and ``inspect_activation`` come from the
built-in ``subscriber_manager`` plugin, and subscriber classes such as ``StatisticsSubscriber`` from the plugins that
register them, all resolved on first access::

    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(output_dir="pt_out", override_output_dir=True)])
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from ..taps import SubscriberBase

__all__ = ["GlobalSubscriberManager", "SubscriberBase", "inspect_activation", "subscriber_classes"]

# The plugin that manages subscriptions (a compatibility path: the names users import from here).
MANAGER_PLUGIN = "ortcore_plugins.subscriber_manager"


def subscriber_classes(host: Any = None) -> dict[str, type]:
    """Subscriber classes contributed by plugins through ``ortcore_register`` (``register.subscriber_class``), by name."""
    from ..host import get_host

    return (host or get_host()).hooks.subscriber_classes()


def __getattr__(name: str) -> Any:
    if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # dunders, and submodules not imported yet: no plugin lookup
    if name in ("GlobalSubscriberManager", "inspect_activation"):
        return getattr(importlib.import_module(MANAGER_PLUGIN), name)
    classes = subscriber_classes()
    if name in classes:
        return classes[name]
    raise AttributeError(
        f"module 'ortcore.hooks' has no attribute {name!r}; subscriber classes from installed plugins: "
        f"{sorted(classes) or 'none'}"
    )
