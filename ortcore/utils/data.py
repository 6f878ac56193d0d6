"""Data-loading utilities contributed by plugins, resolved on first access through the process-wide plugin host::

    from ortcore.utils.data import LoadBalancingDistributedSampler, LoadBalancingDistributedBatchSampler
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=complexity_fn)
    batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=batch_fn)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler)

Each name comes from a plugin's ``ortcore_register`` hook (``register.data_utility``) (the built-in ``load_balancing_sampler`` plugin
provides the two samplers). A name whose plugin is disabled raises an ImportError naming that plugin and how to
enable it; one that no installed plugin knows raises an AttributeError listing what is available.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..contributed import ContributedNames

if TYPE_CHECKING:
    from ..host import PluginHost

__all__ = ["data_utilities"]

_names = ContributedNames(
    __name__, lambda host: host.hooks.data_utilities(), "DATA_UTILITIES", "data utilities (samplers)"
)


def data_utilities(host: PluginHost | None = None) -> dict[str, Any]:
    """``{name: object}`` of every data utility the loaded plugins of ``host`` (default: the process-wide host) offer."""
    return _names.available(host)


def resolve(name: str, host: PluginHost | None = None) -> Any:
    """The data utility ``name`` from ``host``'s plugins (default: the process-wide host); see the module docstring."""
    return _names.resolve(name, host)


def __getattr__(name: str) -> Any:
    return _names.getattr(name)


def __dir__() -> list[str]:
    return _names.dir(globals())
