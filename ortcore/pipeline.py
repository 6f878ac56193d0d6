"""The build pipeline: the one place where a call's graph is exported and its ONNX Runtime session is created.

Stages, in the order data flows, with the hook plugins implement at each (docs/architecture.md)::

    export                     ortcore_exporter, ortcore_export_symbolics (TorchScript) or ortcore_export_translations
                               and ortcore_program_passes (dynamo), ortcore_load_export/ortcore_export_done
    pre-gradient graph passes  ortcore_graph_passes
    gradient build             ortcore_graph_transformer_config            -> BuiltGraph
    gradient-graph passes      ortcore_gradient_graph_passes               (edit BuiltGraph.model)
    session plan               ortcore_session_plan, ortcore_session_options, ortcore_provider_options
    session, created once      ortcore_session_created (inspect only: TrainingSession is immutable)
    steps                      run wrappers from the plan, runtime inspectors, activation subscribers

The state machine (:mod:`ortcore.state`) decides *when* a stage runs (re-export, rebuild, reuse) and counts and logs
every session this pipeline creates, with its cause: the sessions steps run on, the gradient audit's, and the plan
probes plugins ask for. Nothing else creates a session.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state as C

from .errors import GraphBuildError
from .exporter import EXPORT_LOCK
from .files import atomic_write
from .graph import ExportedGraph, export_graph
from .hooks._subscribers import tapping
from .identity import graph_fingerprint
from .options import LogLevel
from .session import BuildRequest, BuiltGraph, TrainingSession, build_graph, default_providers, explain_ort_error

if TYPE_CHECKING:
    from .config import Config, CoreOptions
    from .exporter import Exporter
    from .plugins import Hooks
    from .schema import InputSchema
    from .state import ExportStateMachine, GraphKey

logger = logging.getLogger("ortcore")

RUN_KINDS = ("forward", "backward", "inference")

RunWrapper = Callable[[str], contextlib.AbstractContextManager]


@attrs.define(eq=False)
class _Optional:
    """Session settings a plugin contributes on condition that ORT accepts them (a memory plan, say)."""

    owner: str
    config_entries: dict[str, str]
    execution_order: Any = None


@attrs.define(eq=False)
class SessionPlan:
    """Everything the core needs to create one session, filled by the ``ortcore_session_plan`` hooks.

    Attributes:
        config_entries: ORT session config entries (``SessionOptions.add_session_config_entry``).
        execution_order: an ``onnxruntime.ExecutionOrder``, or None for ORT's default.
        providers: execution providers with their options, first preferred.
        optimized_model_filepath: where ORT writes the graph it runs (``save_onnx``), or None.
        run_wrappers: ``(name, wrapper)``: ``wrapper(what)`` is a context manager entered around each run.
        prepared_model: ONNX bytes ORT already optimized for exactly this graph and plan (a cache's copy of what it
            wrote to ``optimized_model_filepath`` before): the session loads them with graph optimizations off, which
            skips most of session creation. If ORT refuses them, the core creates the session from the graph.
        profile_file_prefix: when set, ORT's profiler records every kernel the session runs into
            ``<prefix>_<date>.json`` (Chrome trace format), written by :meth:`TrainingSession.end_profiling`.
    """

    device: torch.device
    log_level: LogLevel
    providers: list[tuple[str, dict[str, str]]]
    config_entries: dict[str, str] = attrs.Factory(dict)
    execution_order: Any = None
    optimized_model_filepath: str | None = None
    run_wrappers: list[tuple[str, RunWrapper]] = attrs.Factory(list)
    prepared_model: bytes | None = None
    profile_file_prefix: str | None = None
    optional: list[_Optional] = attrs.Factory(list)
    configure_session: Callable[[onnxruntime.SessionOptions, torch.device], None] | None = None
    temporary_files: list[str] = attrs.Factory(list)
    prober: Callable[[SessionPlan, str], TrainingSession] | None = None

    def add_run_wrapper(self, name: str, wrapper: RunWrapper) -> None:
        """Enter ``wrapper(what)`` around every run of the session (``what``: forward, backward or inference).
        A name already added is kept once: plugins that share a service (the ATen executor) add it by one name."""
        if all(existing != name for existing, _ in self.run_wrappers):
            self.run_wrappers.append((name, wrapper))

    def add_optional(self, owner: str, config_entries: dict[str, str], execution_order: Any = None) -> None:
        """Settings the session gets if ORT accepts them; if creating the session fails with them, the core logs a
        warning naming ``owner`` and creates the session without (counted as a second build)."""
        self.optional.append(_Optional(owner, dict(config_entries), execution_order))

    def temporary_file(self, text: str, suffix: str = ".json") -> str:
        """A file holding ``text`` that exists until the session is created (ORT reads some settings from files)."""
        fd, path = tempfile.mkstemp(prefix="ortcore_plan_", suffix=suffix)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        self.temporary_files.append(path)
        return path

    def probe(self, cause: str) -> TrainingSession:
        """A throw-away session of the graph with the plan as it stands (no run wrappers), for analysis (ORT's
        memory statistics, say). Counted and logged by the state machine with ``cause``."""
        if self.prober is None:
            raise GraphBuildError("this session plan cannot create probe sessions")
        return self.prober(self, cause)

    def session_options(self, with_optional: bool = True) -> onnxruntime.SessionOptions:
        """The ``onnxruntime.SessionOptions`` the plan describes (the core's defaults, then the plan, then the
        ``ortcore_session_options`` hooks)."""
        so = base_session_options(self.log_level)
        entries = dict(self.config_entries)
        order = self.execution_order
        if with_optional:
            for extra in self.optional:
                entries.update(extra.config_entries)
                order = extra.execution_order if extra.execution_order is not None else order
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        if order is not None:
            so.execution_order = order
        if self.optimized_model_filepath:
            so.optimized_model_filepath = self.optimized_model_filepath
            if so.log_severity_level == LogLevel.WARNING.ort_severity:
                # ORT warns on every such write that an ORT_ENABLE_ALL graph suits this machine only; the copies
                # ortcore writes (debug files, a cache keyed by machine) are meant for it. Errors still show.
                so.log_severity_level = LogLevel.ERROR.ort_severity
        if self.prepared_model is not None:
            so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        if self.profile_file_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = self.profile_file_prefix
        if self.configure_session is not None:
            self.configure_session(so, self.device)
        return so

    def remove_temporary_files(self) -> None:
        for path in self.temporary_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.temporary_files.clear()


def base_session_options(log_level: LogLevel) -> onnxruntime.SessionOptions:
    """The settings measured best for training on CPU (ENGINE-NOTES): no memory patterns, no prepacking, no spin."""
    so = onnxruntime.SessionOptions()
    so.enable_mem_pattern = False
    so.enable_mem_reuse = False
    so.log_severity_level = log_level.ort_severity
    # Sequential execution: kernels that call back into Python hold the GIL.
    so.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    so.use_deterministic_compute = torch.are_deterministic_algorithms_enabled()
    so.add_session_config_entry("session.disable_prepacking", "1")
    # A spinning idle ORT worker steals the core the torch optimizer step needs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # As many threads as torch uses (OMP_NUM_THREADS, torch.set_num_threads): torchrun gives each of several ranks
    # on a machine one thread, and ORT's own default (one per physical core) would give each rank every core.
    so.intra_op_num_threads = torch.get_num_threads()
    return so


def _upstream_mode(training: bool) -> str:
    """The ``<mode>`` of upstream's file names: training for a model in ``train()`` with grad enabled."""
    return "training" if training and torch.is_grad_enabled() else "inference"


class _OrtWrittenGraphs:
    """Graphs ONNX Runtime writes itself (the optimized pre-gradient graph, the execution model), under upstream's
    names ``<prefix>_<name>_<mode>.onnx``: ORT writes each into a temporary file in the save directory, renamed to
    its name once the session exists, so a reader never sees half a file."""

    def __init__(self, options: CoreOptions, mode: str):
        self.options = options
        self.mode = mode
        self.pending: list[tuple[str, str]] = []

    def path(self, name: str) -> str:
        opts = self.options
        final = os.path.join(opts.save_dir, f"{opts.onnx_prefix}_{name}_{self.mode}.onnx")
        fd, tmp = tempfile.mkstemp(dir=opts.save_dir, prefix=f".{opts.onnx_prefix}_{name}.", suffix=".tmp.onnx")
        os.close(fd)
        self.pending.append((tmp, final))
        return tmp

    def finish(self, keep: bool) -> None:
        """Rename what ORT wrote (``keep``), or remove it; ORT writes no pre-gradient graph for some builds."""
        for tmp, final in self.pending:
            if keep and os.path.getsize(tmp) > 0:
                os.replace(tmp, final)
                logger.info("saved %s", final)
            else:
                os.unlink(tmp)
        self.pending.clear()


def save_model(model: onnx.ModelProto, options: CoreOptions, suffix: str) -> None:
    """Write ``<prefix>_<suffix>.onnx`` atomically into the save directory."""
    path = atomic_write(
        os.path.join(options.save_dir, f"{options.onnx_prefix}_{suffix}.onnx"), model.SerializeToString()
    )
    logger.info("saved %s", path)


class Pipeline:
    """Export and build for one ORTModule: the stages above, in order, each calling its hooks once."""

    def __init__(self, config: Config, hooks: Hooks, exporter: Exporter, state: ExportStateMachine):
        self.config = config
        self.options = config.core
        self.hooks = hooks
        self.exporter = exporter
        self.state = state
        self._last_identity: tuple[GraphKey, list, str] | None = None

    # -- export and pre-gradient passes ----------------------------------------------------------------------------
    def export(
        self,
        module: torch.nn.Module,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        key: GraphKey,
        subscription: Any = None,
    ) -> ExportedGraph:
        """The graph of a call with ``key``: from an export cache (``ortcore_load_export``) or exported anew."""
        opts = self.options
        passes, fp = self._identity(module, key)
        cached = self.hooks.load_export(module, fp)
        if cached is not None:
            return cached
        with tapping(subscription) if key.taps else contextlib.nullcontext() as tapper:
            graph = self._export_graph(module, schema, tensors, passes, tapper, keep_raw=opts.save_onnx)
        self.hooks.export_done(module, fp, graph)
        if opts.save_onnx:
            mode = "training" if graph.training else "eval"
            save_model(graph.raw_model, opts, f"exported_{mode}")
            save_model(graph.model, opts, f"pre_grad_{mode}")
            # graph.raw_model stays: each build saves it under upstream's name for its mode
        return graph

    def fingerprint(self, module: torch.nn.Module, key: GraphKey) -> str:
        """What the export cache stores the graph of ``key`` under (:func:`ortcore.identity.graph_fingerprint`)."""
        return self._identity(module, key)[1]

    def _identity(self, module: torch.nn.Module, key: GraphKey) -> tuple[list, str]:
        """The graph passes and the fingerprint of ``key``'s export, asked of the hooks once per key (the export
        asks again for a key the state machine decided to export once more)."""
        if self._last_identity is not None and self._last_identity[0] == key:
            _, passes, fp = self._last_identity
            self._last_identity = None
            return passes, fp
        passes = self.hooks.graph_passes()
        fp = graph_fingerprint(key, module, passes=passes, exporter=self.exporter, plugin_keys=self.hooks.export_key())
        self._last_identity = (key, passes, fp)
        return passes, fp

    def export_for_audit(
        self, module: torch.nn.Module, schema: InputSchema, tensors: list[torch.Tensor], tapper: Any
    ) -> ExportedGraph:
        """A graph of this call for the gradient audit: exported anew (no export cache), taps from ``tapper``."""
        return self._export_graph(module, schema, tensors, self.hooks.graph_passes(), tapper)

    def _export_graph(
        self,
        module: torch.nn.Module,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        passes: list,
        tapper: Any,
        keep_raw: bool = False,
    ) -> ExportedGraph:
        """One export, inside the plugins' export contexts (``ortcore_export_context``)."""
        opts = self.options
        with self._export_contexts(module):
            return export_graph(
                module,
                schema,
                tensors,
                exporter=self.exporter,
                opset=opts.opset,
                log_level=opts.log_level,
                deepcopy=opts.deepcopy_before_export,
                graph_passes=passes,
                config=self.config,
                keep_raw=keep_raw,
                tapper=tapper,
            )

    @contextlib.contextmanager
    def _export_contexts(self, module: torch.nn.Module):
        """Plugins' contexts around tracing (``ortcore_export_context``: region routing's submodule replacement), under
        :data:`EXPORT_LOCK` like the trace itself: a context may patch process-wide state (torch functions), and one
        thread's contexts must not interleave with another's."""
        with EXPORT_LOCK, contextlib.ExitStack() as stack:
            for context in self.hooks.export_contexts(module, self.config):
                stack.enter_context(context)
            yield

    # -- gradient build, gradient-graph passes, session plan, session ----------------------------------------------
    def build(self, graph: ExportedGraph, key: GraphKey, purpose: str = "train") -> TrainingSession:
        """The session of ``graph`` for ``key``.

        ``purpose`` is ``"train"`` for the session steps run on, ``"audit"`` for the gradient audit's own session
        (not saved, not shown to ``ortcore_session_created``; plugins see the purpose in ``BuiltGraph.purpose``
        and leave out what would change the gradients it compares).
        """
        opts = self.options
        graph_names = dict(zip(graph.argument_names, graph.user_input_names))
        inputs_rg = {graph_names[n] for n in key.input_requires_grad}
        trainable = set(key.trainable)
        transformer_config = C.TrainingGraphTransformerConfiguration()
        self.hooks.graph_transformer_config(transformer_config, training=key.grad_enabled)
        mode = _upstream_mode(key.training)
        ort_written = _OrtWrittenGraphs(opts, mode) if opts.save_onnx and purpose == "train" else None
        if ort_written is not None:
            transformer_config.optimized_pre_grad_filepath = ort_written.path("optimized_pre_grad")
        request = BuildRequest(
            model=graph.model,
            input_names=graph.input_names,
            user_input_names=graph.user_input_names,
            train_names=[n for n in graph.input_names if n in inputs_rg or n in trainable],
            build_gradient=key.grad_enabled,
            device=torch.device(key.device),
            log_level=opts.log_level,
            transformer_config=transformer_config,
            taps=[(tap.value, tap.output) for tap in graph.taps],
        )
        try:
            built = build_graph(request, purpose)
            self._run_gradient_graph_passes(built)
            plan = self._plan(built)
            written_elsewhere = None
            if ort_written is not None:
                if not plan.optimized_model_filepath:
                    plan.optimized_model_filepath = ort_written.path("execution_model")
                else:  # a plugin keeps ORT's optimized graph too (export_cache): copy it for the debug files
                    written_elsewhere = plan.optimized_model_filepath
            session = self._create(built, plan)
            if written_elsewhere is not None and os.path.exists(written_elsewhere):
                shutil.copyfile(written_elsewhere, ort_written.path("execution_model"))
        except BaseException:
            if ort_written is not None:
                ort_written.finish(keep=False)
            raise
        if ort_written is not None:
            ort_written.finish(keep=True)
        if purpose != "train":
            return session
        self.hooks.session_created(session)
        if ort_written is not None:
            if graph.raw_model is not None:  # None when the graph came from an export cache
                save_model(graph.raw_model, opts, f"torch_exported_{mode}")
            save_model(session.model, opts, f"optimized_{mode}")
            save_model(session.model, opts, session.kind)
        return session

    def _run_gradient_graph_passes(self, built: BuiltGraph) -> None:
        for graph_pass in self.hooks.gradient_graph_passes():
            try:
                graph_pass.run(built.model, built)
            except GraphBuildError:
                raise
            except Exception as e:
                raise GraphBuildError(
                    f"gradient-graph pass {graph_pass.name!r} (plugin {graph_pass.plugin!r}) failed on the {built.kind} "
                    f"graph: {type(e).__name__}: {e}"
                ) from e

    def _plan(self, built: BuiltGraph) -> SessionPlan:
        request = built.request
        plan = SessionPlan(
            device=request.device,
            log_level=request.log_level,
            providers=default_providers(request.device),
            configure_session=self.hooks.session_options,
            prober=lambda p, cause: self._probe(built, p, cause),
        )
        self.hooks.session_plan(built, plan)
        self.hooks.provider_options(request.device, plan.providers)
        return plan

    def _probe(self, built: BuiltGraph, plan: SessionPlan, cause: str) -> TrainingSession:
        self.state.record_probe(cause)
        return TrainingSession(
            built,
            attrs.evolve(
                plan,
                run_wrappers=[],
                optimized_model_filepath=None,
                prepared_model=None,
                profile_file_prefix=None,
                prober=None,
            ),
        )

    def _create(self, built: BuiltGraph, plan: SessionPlan) -> TrainingSession:
        try:
            if plan.prepared_model is not None:
                try:
                    return TrainingSession(built, plan)
                except GraphBuildError as e:
                    logger.warning(
                        "ONNX Runtime refused the prepared %s graph (%s); creating the session from the graph",
                        built.kind,
                        e,
                    )
                    self.state.record_build("again from the graph: the prepared one was refused")
                    plan.prepared_model = None
            try:
                return TrainingSession(built, plan)
            except GraphBuildError as e:
                if not plan.optional:
                    raise
                owners = sorted({o.owner for o in plan.optional})
                logger.warning(
                    "ONNX Runtime could not create the %s session with the settings of %s (%s); creating it without them",
                    built.kind,
                    ", ".join(owners),
                    e,
                )
                self.state.record_build(f"again without the settings of {', '.join(owners)}")
                return TrainingSession(built, attrs.evolve(plan, optional=[]))
        finally:
            plan.remove_temporary_files()


__all__ = [
    "BuiltGraph",
    "Pipeline",
    "SessionPlan",
    "RUN_KINDS",
    "base_session_options",
    "explain_ort_error",
    "save_model",
]
