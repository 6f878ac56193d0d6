"""torchscript_exporter: the TorchScript route (``torch.onnx.export(dynamo=False)``), registered as the exporter
named ``torchscript``, the ``exporter`` option's default.

Essential (``ortcore.host.ESSENTIAL_PLUGINS``): ``[plugins] disable = ["torchscript_exporter"]`` is refused with
the reason, and every plugin host registers it, autoloaded or not. The core's default configuration exports with
it, the dynamo route's repair switches a model that route cannot serve to it, and hosts composed of a few plugins
(``ortcore.testing.make_host``, third-party plugins' tests) export with it: without it each of these would fail on
an exporter that is not there. A torch that no longer ships the TorchScript exporter still loads it, unused: the
core then exports with ``dynamo`` (``ortcore.api.exporter_name``).

The package: :mod:`.exporter` (:class:`TorchScriptExporter`, which drives torch's exporter and exports again when a
plugin's ``ortcore_export_failed`` answer makes a failing op exportable), :mod:`.registration` (the symbolics in
torch's process-wide registry, one model's set at a time); this module holds the hook. What other plugins use too is
in ``ortcore_plugins.services``: the route's own symbolics (``torchscript_symbolics``), the pooling builders both
routes write (``pooling``) and the tracing of custom autograd Functions (``autograd_functions``).
"""

from __future__ import annotations

from typing import Any

from ortcore.api import TORCHSCRIPT, Registry, custom_autograd_disabled, hookimpl

from .exporter import MAX_EXPORT_RETRIES, TorchScriptExporter  # noqa: F401 (re-exported: the plugin's names)


def make_exporter(config: Any) -> TorchScriptExporter:
    """The exporter of an ORTModule with ``config``: custom autograd Functions no plugin answers for are traced
    through under ``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0`` and refused otherwise."""
    return TorchScriptExporter(inline_autograd_functions=custom_autograd_disabled(config.env))


@hookimpl
def ortcore_register(register: Registry) -> None:
    register.exporter(TORCHSCRIPT, make_exporter)
