"""Hook specifications: everything a plugin can contribute to ortcore, grouped by lifecycle.

Every hook is named ``ortcore_*`` and called by keyword, so argument names are API: a plugin implements a hook
with any subset of the arguments, in any order. Hooks run last-registered-first; where order matters (graph
passes) it is declared explicitly, never left to registration order. The core calls hooks through
:class:`ortcore.plugins.Hooks`, and per-step paths never go through pluggy: inspectors and subscribers are
collected once per model and then called directly.

The build pipeline (docs/architecture.md), in the order data flows, with the hook at each stage:

    export (ortcore_exporter, ortcore_export_symbolics, ortcore_export_context, ortcore_load_export /
            ortcore_export_done)
      → pre-gradient graph passes (ortcore_graph_passes)
      → gradient build (ortcore_graph_transformer_config)
      → gradient-graph passes (ortcore_gradient_graph_passes)
      → session plan (ortcore_session_plan, ortcore_session_options, ortcore_provider_options)
      → session created once (ortcore_session_created: inspect only; the session is immutable)
      → steps (ortcore_runtime_inspectors, ortcore_activation_subscribers; run wrappers from the plan)
    a stage that fails on a new graph → ortcore_repairs (route the failing op or module, export again)

Only the core creates sessions; what needs another session asks the state machine (``ORTModule.state_machine``),
which counts and logs every build with its cause.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .markers import (
    hookimpl,  # noqa: F401 (re-exported: the import plugins and their docs use)
    hookspec,
)

if TYPE_CHECKING:
    import onnxruntime
    import torch

    from .config import Config
    from .exporter import Exporter
    from .graph import ExportedGraph
    from .graph_passes import GraphPass
    from .inspectors import RuntimeInspector
    from .repair import Failure, Repair
    from .session import BuiltGraph, SessionPlan, TrainingSession


# -- configure ----------------------------------------------------------------------------------------------------
@hookspec
def ortcore_options_class() -> type | None:
    """Declare this plugin's options: a frozen ``attrs`` class, filled from ``[plugins.<name>]`` in ortcore.toml
    and from the environment variables named in each field's ``metadata={"env": "ORTMODULE_..."}``.

    Called once per plugin when the configuration is loaded, before :func:`ortcore_configure`.
    Returns the class, or None if the plugin has no options.
    """


@hookspec
def ortcore_configure(config: Config) -> None:
    """The configuration is loaded and validated; a plugin reads ``config.plugin_options(name)`` here.

    Called once per plugin host, after every plugin is registered. Return value ignored.
    """


# -- export -------------------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def ortcore_exporter(config: Config) -> Exporter | None:
    """Who exports? Return an :class:`ortcore.exporter.Exporter` to use instead of the one the ``exporter`` option
    names. A plugin that specialises one route (op_routing's TorchScript exporter) answers only when
    ``ortcore.exporter.exporter_name(config)`` is that route's name.

    Called once per ORTModule, with its config. Stops at the first non-None result; with none, the core builds the
    exporter the ``exporter`` option names from ``ortcore_exporters``.
    """


@hookspec
def ortcore_exporters(config: Config) -> dict[str, Callable[[Config], Exporter]] | None:
    """Named exporters this plugin offers, as factories: ``{"dynamo": lambda config: DynamoExporter()}``. The
    ``exporter`` option (``ORTCORE_EXPORTER``, ``ORTModule(exporter="dynamo")``) picks one by name; an unknown name is
    an error listing the names offered. The core offers ``torchscript``. Collected from every plugin; a name offered
    twice is an error naming both plugins. None: nothing to offer.
    """


@hookspec
def ortcore_export_symbolics(config: Config) -> dict[str, Any] | None:
    """Extra TorchScript symbolics: ``{"::op_name": symbolic_fn}`` registered for the export opset.

    Called once per ORTModule; later plugins cannot override an op an earlier one claimed (a duplicate is an error
    naming both plugins). Return None to contribute nothing.
    """


@hookspec
def ortcore_export_translations(config: Config) -> dict[Any, Callable[..., Any]] | None:
    """Extra onnxscript translations for the dynamo route (``torch.onnx.export``'s ``custom_translation_table``):
    ``{torch.ops.ns.op.overload: onnxscript_function}``. An op with a translation is kept whole in the exported
    program (not decomposed) and becomes whatever nodes its function writes (``org.pytorch.aten::ATen``,
    ``com.microsoft::PythonOp``, ...). The dynamo counterpart of ``ortcore_export_symbolics``.

    Called once per ORTModule on the dynamo route; an overload claimed by two plugins is an error naming both. None:
    nothing to add.
    """


@hookspec
def ortcore_program_passes(config: Config) -> list[GraphPass] | None:
    """Passes over ``torch.export``'s program on the dynamo route, before it is translated to ONNX: each
    ``GraphPass``'s ``run(program: torch.export.ExportedProgram, context)`` edits ``program.graph_module`` in place
    (replacing calls ONNX Runtime cannot serve by custom ops that ``ortcore_export_translations`` translate, say).
    Ordered by their ``before``/``after`` names like graph passes. None: nothing to add.
    """


@hookspec
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any | None:
    """A context manager to enter around tracing ``module`` (the user's model, before the exporter's deep copy):
    region routing replaces chosen submodules' ``forward`` for the trace's duration. Return None for nothing.

    Called once per export (and per export of the gradient audit), on both routes; contexts are entered in the
    order collected and left in reverse.
    """


@hookspec
def ortcore_graph_passes(config: Config) -> list[GraphPass] | None:
    """Post-export graph passes: small objects with a unique ``name``, ``before``/``after`` lists of other passes'
    names, and ``run(model: onnx.ModelProto, context) -> None`` that edits the forward graph in place.

    Called once per export; all contributions are collected and sorted by their declared order (a cycle, an unknown
    or a duplicate name is an error). Passes run after the core's own processing, before the gradient build.
    """


@hookspec
def ortcore_export_key(config: Config) -> dict[str, Any] | None:
    """Values that shape the exported graph beyond the core's key (a pass's options, say), for caches.

    Return a JSON-serialisable dict, or None.
    """


@hookspec(firstresult=True)
def ortcore_load_export(config: Config, module: torch.nn.Module, fingerprint: str) -> ExportedGraph | None:
    """Return a previously exported, post-processed graph for ``fingerprint`` (an export cache), or None to export.

    ``fingerprint`` is :func:`ortcore.identity.graph_fingerprint`, a sha256 over everything that shapes the graph:
    the input schema, train/eval, opset, exporter, the module's structure and what the tracer bakes in beyond it
    (class code, hidden attributes, hooks, tensor attributes, default dtype, versions of the defining packages),
    the graph passes and plugins' ``ortcore_export_key`` values, and the torch/onnx/onnxruntime/ortcore versions.
    :meth:`ExportedGraph.from_bytes` restores what :meth:`ExportedGraph.to_bytes` stored (JSON and ONNX bytes:
    data only).
    Called before each export. Stops at the first non-None result.
    """


@hookspec
def ortcore_export_done(config: Config, module: torch.nn.Module, fingerprint: str, graph: ExportedGraph) -> None:
    """A graph was exported and post-processed (not loaded from a cache): store it, inspect it.

    Called after each export. Return value ignored.
    """


# -- graph build ----------------------------------------------------------------------------------------------------
@hookspec
def ortcore_graph_transformer_config(config: Config, transformer_config: Any, training: bool) -> None:
    """Adjust ORT's ``TrainingGraphTransformerConfiguration`` (compute optimizer, sparsity, recompute) in place.

    Called before each gradient-graph build. Return value ignored.
    """


@hookspec
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass] | None:
    """Passes over the graph ONNX Runtime's gradient builder made (forward and backward for a training build, the
    optimized forward for an inference build), run before the session is created: the same :class:`GraphPass`
    objects as ``ortcore_graph_passes``, with ``run(model: onnx.ModelProto, graph: BuiltGraph) -> None`` editing
    ``model`` in place. ``graph`` (:class:`ortcore.pipeline.BuiltGraph`) says what was built (``graph.kind``,
    ``graph.purpose``, ``graph.request``, the feeds) and takes the pass's declarations
    (``graph.hand_over_gradient(feed_index)``).

    Called once per build; the contributions are sorted by their ``before``/``after`` names among themselves (a
    cycle, an unknown or a duplicate name is an error).
    """


# -- session --------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_session_plan(config: Config, graph: BuiltGraph, plan: SessionPlan) -> None:
    """Contribute to the session the core is about to create for ``graph`` (after the gradient-graph passes):
    ``plan.config_entries`` (ORT session config entries), ``plan.execution_order``, ``plan.providers`` (a list of
    ``(name, options)``), ``plan.add_run_wrapper(name, wrapper)`` (a context manager factory entered around every
    forward, backward and inference run: ``wrapper(what)`` with ``what`` one of ``"forward"``, ``"backward"``,
    ``"inference"``), ``plan.add_optional(owner, entries, execution_order)`` (settings the session gets if ORT accepts
    them; otherwise it is created without, with a warning naming ``owner``), ``plan.temporary_file(text, suffix)`` (a
    file that lives until the session exists) and ``plan.probe(cause)`` (a throw-away session of the graph as
    planned so far, for analysis; counted and logged by the state machine as a probe, with ``cause``).

    Called once per build, before ``ortcore_session_options`` and ``ortcore_provider_options``. Return value
    ignored.
    """


@hookspec
def ortcore_session_options(config: Config, session_options: onnxruntime.SessionOptions, device: torch.device) -> None:
    """Adjust the ``onnxruntime.SessionOptions`` of a new session in place (config entries, threads, EP options).

    Called before each session is created. Return value ignored.
    """


@hookspec
def ortcore_provider_options(config: Config, device: torch.device, providers: list[tuple[str, dict[str, str]]]) -> None:
    """Adjust the execution providers of a new session in place: ``providers`` is a list of ``(name, options)``
    (for CUDA: ``[("CUDAExecutionProvider", {"device_id": "0"}), ("CPUExecutionProvider", {})]``).

    Called before each session is created, after ``ortcore_session_options``. Return value ignored.
    """


@hookspec
def ortcore_session_created(config: Config, session: TrainingSession) -> None:
    """A :class:`ortcore.session.TrainingSession` was created for the model's steps: inspect its graph
    (``session.model``) or its memory plan, or remember it (a runtime inspector keyed by session).

    The session is immutable: setting an attribute raises. A plugin that needs a different graph edits it in a
    gradient-graph pass; one that needs other session settings contributes them to the session plan. Not called
    for the sessions the gradient audit and plan probes create. Return value ignored.
    """


# -- step -----------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_runtime_inspectors(config: Config, module: torch.nn.Module) -> list[RuntimeInspector] | None:
    """Objects called around each step: any of ``pre_forward(step, inputs)``, ``post_forward(step, outputs)``,
    ``pre_backward(step)``, ``post_backward(step)`` (see :class:`ortcore.inspectors.RuntimeInspector`).

    Called once per ORTModule; the objects are then called directly on every step, without pluggy.
    """


@hookspec
def ortcore_activation_subscribers(config: Config, module: torch.nn.Module) -> list[Any] | None:
    """Subscribers that receive activation tensors (forward outputs and their gradients) during each step.

    Called on every ``GlobalSubscriberManager.subscribe(module, ...)`` (subscribing a model again calls it again: a
    plugin that wants one subscriber per model checks ``module`` itself); the subscribers are then called
    directly.
    """


@hookspec
def ortcore_subscriber_classes() -> dict[str, type] | None:
    """Subscriber classes this plugin provides, by name: ``{"StatisticsSubscriber": StatisticsSubscriber}``.

    ``ortcore.hooks`` exposes them (``from ortcore.hooks import StatisticsSubscriber``). Collected from every plugin;
    a name offered twice is an error naming both plugins.
    """


@hookspec
def ortcore_optimizers(config: Config) -> dict[str, Any] | None:
    """Optimizer classes, optimizer factories or wrappers (``FP16_Optimizer(optimizer)``) and the names that go with
    them (an enum of modes) this plugin provides, by name: ``{"FusedAdam": FusedAdam, "AdamWMode": AdamWMode}``.

    ``ortcore.optim`` exposes them (``from ortcore.optim import FusedAdam``); called when it is asked for a name.
    Collected from every plugin; a name offered twice is an error naming both plugins. None: nothing to offer.
    A plugin may also list its names in a module-level ``OPTIMIZERS`` tuple, so that when it is disabled
    ``ortcore.optim`` can say which plugin to enable (read from the source, never imported).
    """


@hookspec
def ortcore_data_utilities(config: Config) -> dict[str, Any] | None:
    """Data-loading classes (samplers, batch samplers) this plugin provides, by name:
    ``{"LoadBalancingDistributedSampler": LoadBalancingDistributedSampler, ...}``.

    ``ortcore.utils.data`` exposes them (``from ortcore.utils.data import LoadBalancingDistributedSampler``); called
    when it is asked for a name. Collected from every plugin; a name offered twice is an error naming both plugins.
    None: nothing to offer. A plugin may also list its names in a module-level ``DATA_UTILITIES`` tuple, so that when
    it is disabled ``ortcore.utils.data`` can say which plugin to enable (read from the source, never imported).
    """


@hookspec(firstresult=True)
def ortcore_autograd_function_handler(config: Config, function: type) -> Any | None:
    """Who runs this ``torch.autograd.Function`` subclass inside the graph? Return a handler (exports it and runs
    its forward/backward) or None. Stops at the first non-None result.

    A handler is ``ortcore.exporter.INLINE`` (trace through the Function's forward) or an object with
    ``export(g, node, args)`` returning the node's outputs (TorchScript route) and ``dynamo_apply(function, apply,
    args, kwargs)`` returning the call's outputs while torch.export traces (dynamo route), and optionally ``check()``
    (raise to refuse the Function) and ``traces_through(args) -> bool`` (trace one call through). Called while exporting, for each Function call;
    Functions with their own ``symbolic`` never reach it.
    """


# -- repair ---------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_repairs(config: Config, failure: Failure) -> list[Repair] | None:
    """Ways to repair ``failure`` (a :class:`ortcore.repair.Failure`: the stage that failed, its message, the
    ``aten::`` ops, ONNX nodes and modules that hold it) by changing this plugin's options: route an op to PyTorch,
    run a module in PyTorch, switch a graph optimizer off. Each :class:`ortcore.repair.Repair` names the plugin
    whose options it sets and their new values (what ``[plugins.<name>]`` in ortcore.toml would say).

    Called when export, the gradient build, the first run or the gradient audit of a new graph fails. The core
    tries the answers smallest change first (``kind``: switch, op, region), applies the first that changes the
    effective options, exports, builds and audits again (``ortcore.repair.MAX_REPAIRS`` times at most per model).
    Collected from every plugin; None: no repair to offer.
    """


@hookspec(firstresult=True)
def ortcore_load_repairs(config: Config, module: torch.nn.Module, fingerprint: str) -> list[dict] | None:
    """The repairs an earlier process found for this model and call (an export cache), so that the search is not
    repeated: a list of :class:`ortcore.repair.Repair` fields as dicts, or None.

    ``fingerprint`` is the graph fingerprint of the call before any repair. Called once per ORTModule, before its
    first export. Stops at the first non-None result.
    """


@hookspec
def ortcore_repairs_found(config: Config, module: torch.nn.Module, fingerprint: str, repairs: list[dict]) -> None:
    """Repairs made a model's first step pass: store them under ``fingerprint`` (the call's graph fingerprint before
    any repair) for :func:`ortcore_load_repairs`. ``repairs`` are every repair in force, oldest first, as dicts.

    Called after the repaired graph passed (its audit, when the audit is on). Return value ignored.
    """


# -- command line --------------------------------------------------------------------------------------------------
@hookspec
def ortcore_commands(subparsers: Any) -> None:
    """Add ``ortcore`` subcommands: ``subparsers`` is the ``argparse`` sub-parser action of the ``ortcore`` command;
    a plugin calls ``subparsers.add_parser(name, help=...)``, declares its arguments and binds
    ``set_defaults(run=function)`` where ``function(args) -> int`` is the exit status.

    Called when the command line is built; ``ortcore --help`` lists the commands. Return value ignored.
    """


# -- teardown -------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_unconfigure(config: Config) -> None:
    """The plugin host is shutting down (process exit or a test's host going away). Return value ignored."""
