"""ortcore's public plugin API: the one module a plugin, built-in or third-party, imports from ortcore.

    from ortcore.api import hookimpl, GraphPass, PassContext, Config, option, OptionError

Everything listed in :data:`__all__` is promised: a name is removed or changes meaning only with a new major
:data:`API_VERSION`, and a plugin can check the version it was written for (``ortcore.api.API_VERSION >= (1, 0)``).
Everything else in ``ortcore`` is private, whatever its spelling. The built-in plugin package's shared services
(``ortcore_plugins.services``: ATen and PythonOp nodes, the ATen executor) are public too and documented there.

Names resolve lazily (PEP 562): importing this module imports neither torch, onnx nor onnxruntime, so a plugin's
command-line module stays fast. See ``docs/plugins.md`` for what each group is for.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The API's version: (major, minor). A minor version adds names; a major one may remove or change them.
API_VERSION = (3, 8)

# name -> the module that defines it.
_NAMES: dict[str, str] = {
    # the user surface, for plugins that train a model (bench, demo, explain)
    "ORTModule": "ortcore.module",
    "export_again": "ortcore.module",
    "ORTCORE_VERSION": "ortcore.version",
    # hooks
    "hookimpl": "ortcore.markers",
    "Registry": "ortcore.registry",
    # graph passes
    "GraphPass": "ortcore.graph_passes",
    "PassContext": "ortcore.graph_passes",
    "ValueNames": "ortcore.graph_passes",
    "splice": "ortcore.graph_passes",
    # configuration and options
    "Config": "ortcore.config",
    "disabled_plugins": "ortcore.config",
    "load_host": "ortcore.report",
    "option": "ortcore.config",
    "int_at_least": "ortcore.config",
    "parse_bool": "ortcore.options",
    "LogLevel": "ortcore.options",
    "positive_int": "ortcore.argtypes",
    "non_negative_int": "ortcore.argtypes",
    "non_negative_float": "ortcore.argtypes",
    "exporter_name": "ortcore.exporter",
    "torchscript_available": "ortcore.exporter",
    "TORCHSCRIPT": "ortcore.exporter",
    "DYNAMO": "ortcore.exporter",
    "custom_autograd_disabled": "ortcore.exporter",
    "AUTOGRAD_FUNCTION_PLUGIN": "ortcore.exporter",
    # errors
    "ORTCoreError": "ortcore.errors",
    "OptionError": "ortcore.errors",
    "UnsupportedModelError": "ortcore.errors",
    "UnsupportedDataError": "ortcore.errors",
    "BufferWriteError": "ortcore.errors",
    "GraphBuildError": "ortcore.errors",
    "buffer_owners": "ortcore.errors",
    "PluginError": "ortcore.errors",
    "FirstRunError": "ortcore.errors",
    "StepCheckError": "ortcore.errors",
    "GradientMismatchError": "ortcore.errors",
    # exporters
    "Exporter": "ortcore.exporter",
    "ExportRequest": "ortcore.exporter",
    "EXPORT_LOCK": "ortcore.exporter",
    "quiet_export": "ortcore.exporter",
    "raised_in": "ortcore.exporter",
    "refuse_empty_inputs": "ortcore.exporter",
    "INLINE": "ortcore.exporter",
    "STOP_GRADIENT": "ortcore.domains",
    "STOP_GRADIENT_DOMAIN": "ortcore.domains",
    # graphs, sessions and what plugins receive from hooks
    "ExportedGraph": "ortcore.graph",
    "GRAPH_FORMAT": "ortcore.graph",
    "INPUT_RANGES_METADATA": "ortcore.graph",
    "PROVISIONAL_METADATA": "ortcore.graph",
    "StopGradientLowering": "ortcore.graph",
    "value_dependencies": "ortcore.graph",
    "BuiltGraph": "ortcore.session",
    "TrainingSession": "ortcore.session",
    "copied_outputs": "ortcore.output_integrity",
    "measurement_session": "ortcore.pipeline",
    "measurement_sessions": "ortcore.pipeline",
    "probe_session": "ortcore.pipeline",
    "SessionPlan": "ortcore.session_plan",
    "RuntimeInspector": "ortcore.inspectors",
    "ForwardInputs": "ortcore.inspectors",
    "FirstStep": "ortcore.inspectors",
    "StepWatch": "ortcore.inspectors",
    "hooks_set_aside": "ortcore.inspectors",
    "hook_defined_in": "ortcore.inspectors",
    "InputSchema": "ortcore.schema",
    "OutputSchema": "ortcore.schema",
    "Constant": "ortcore.schema",
    "TensorConstant": "ortcore.schema",
    "flatten_outputs": "ortcore.schema",
    "node_module": "ortcore.repair",
    "Tapper": "ortcore.taps",
    "tapping": "ortcore.taps",
    "current_tapper": "ortcore.taps",
    "tensor_leaves": "ortcore.taps",
    "is_tracing": "ortcore.taps",
    "subscribers_paused": "ortcore.taps",
    "StepRecorder": "ortcore.taps",
    "attach_recorder": "ortcore.taps",
    "detach_recorder": "ortcore.taps",
    "recorder_of": "ortcore.taps",
    "contributed_subscribers": "ortcore.host",
    "Failure": "ortcore.repair",
    "Repair": "ortcore.repair",
    "CORE_REPAIR": "ortcore.repair",
    "SubscriberBase": "ortcore.taps",
    "versions": "ortcore.identity",
    # mixed precision (torch.autocast)
    "autocast_state": "ortcore.amp",
    "graph_autocast": "ortcore.amp",
    "autocast_as": "ortcore.amp",
    "running_graph": "ortcore.amp",
    # graph metadata and node kinds
    "ROUTED_METADATA_PREFIX": "ortcore.explain",
    "KEPT_METADATA_PREFIX": "ortcore.explain",
    "ATEN_DOMAIN": "ortcore.domains",
    "PYTHON_OP_DOMAIN": "ortcore.domains",
    "operator_of": "ortcore.explain",
    "aten_kind": "ortcore.explain",
    # files and tables
    "atomic_write": "ortcore.files",
    "atomic_writer": "ortcore.files",
    "format_table": "ortcore.tables",
}

__all__ = ["API_VERSION", *_NAMES]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'ortcore.api' has no attribute {name!r}; the plugin API is ortcore.api.__all__")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
