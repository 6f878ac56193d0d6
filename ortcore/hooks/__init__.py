"""Activation collection: subscribe a model, receive every submodule's output and gradient.

``GlobalSubscriberManager``, ``SubscriberBase`` and ``inspect_activation`` are core; subscriber classes such as
``StatisticsSubscriber`` come from plugins and are resolved on first access::

    from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber
    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(output_dir="pt_out", override_output_dir=True)])
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ._subscribers import GlobalSubscriberManager, SubscriberBase, inspect_activation, subscriber_classes

__all__ = ["GlobalSubscriberManager", "SubscriberBase", "inspect_activation", "subscriber_classes"]


def __getattr__(name: str) -> Any:
    if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        raise AttributeError(name)  # dunders, and submodules not imported yet: no plugin lookup
    classes = subscriber_classes()
    if name in classes:
        return classes[name]
    raise AttributeError(
        f"module 'ortcore.hooks' has no attribute {name!r}; subscriber classes from installed plugins: "
        f"{sorted(classes) or 'none'}"
    )
