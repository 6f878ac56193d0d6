"""The build pipeline: the one place where a call's graph is exported and its ONNX Runtime session is created.

Stages, in the order data flows, with the hook plugins implement at each (docs/architecture.md)::

    export                     ortcore_exporter, ortcore_export_symbolics (TorchScript) or ortcore_export_translations
                               and ortcore_program_passes (dynamo), ortcore_load_export/ortcore_export_done
    pre-gradient graph passes  ortcore_graph_passes
    detach() markers lowered   ortcore_lower_stop_gradients                (StopGradientLowering)
    gradient build             ortcore_graph_transformer_config            -> BuiltGraph
    gradient-graph passes      ortcore_gradient_graph_passes               (edit BuiltGraph.model)
    session plan               ortcore_session_plan (providers, config entries, session options: one plan)
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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import onnx
import torch
from onnxruntime.capi import _pybind_state as C

from . import amp
from .errors import GraphBuildError
from .exporter import EXPORT_LOCK
from .files import atomic_write
from .graph import ExportedGraph, export_graph
from .identity import fingerprint, graph_description
from .options import LogLevel
from .session import BuildRequest, BuiltGraph, TrainingSession, build_graph, default_providers, explain_ort_error
from .session_plan import RunWrapper, SessionPlan, base_session_options  # noqa: F401 (re-exported: the plan's former home)
from .taps import tapping

if TYPE_CHECKING:
    from .config import Config, CoreOptions
    from .exporter import Exporter
    from .host import Hooks
    from .schema import InputSchema
    from .state import ExportStateMachine, GraphKey

logger = logging.getLogger("ortcore")

RUN_KINDS = ("forward", "backward", "inference")


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
        self._last_identity: tuple[GraphKey, list, str, dict] | None = None
        #: Attributes engines keep on the model's modules that the forward never reads (the runtime inspectors'
        #: ``untraced_attributes``): not part of the graph's fingerprint.
        self.untraced_attributes: frozenset[str] = frozenset()
        #: Hooks the runtime inspectors' engines install and the export sets aside (``untraced_hooks``): named by
        #: their code only in the graph's fingerprint. None: every hook is described with what it refers to.
        self.untraced_hooks: Callable[[Any], bool] | None = None

    # -- export and pre-gradient passes ----------------------------------------------------------------------------
    def export(
        self,
        module: torch.nn.Module,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        key: GraphKey,
        recorder: Any = None,
    ) -> ExportedGraph:
        """The graph of a call with ``key``: from an export cache (``ortcore_load_export``) or exported anew."""
        opts = self.options
        passes, fp, _ = self._identity(module, key)
        cached = self.hooks.load_export(module, fp)
        if cached is not None:
            cached.from_cache = True
            return cached
        with tapping(recorder) if key.taps else contextlib.nullcontext() as tapper:
            graph = self._export_graph(
                module,
                schema,
                tensors,
                passes,
                tapper,
                keep_raw=opts.save_onnx,
                dynamic_dims=key.dynamic_dims,
                autocast=key.autocast,
            )
        self.hooks.export_done(module, fp, graph)
        if opts.save_onnx:
            mode = "training" if graph.training else "eval"
            save_model(graph.raw_model, opts, f"exported_{mode}")
            save_model(graph.model, opts, f"pre_grad_{mode}")
            # graph.raw_model stays: each build saves it under upstream's name for its mode
        return graph

    def fingerprint(self, module: torch.nn.Module, key: GraphKey, sizes: bool = True) -> str:
        """What the export cache stores the graph of ``key`` under (:func:`ortcore.identity.graph_fingerprint`);
        with ``sizes=False``, the same for every input size (what repairs are stored under: they hold for the model,
        whatever the sizes of the call that found them)."""
        _, fp, description = self._identity(module, key)
        if sizes or not key.static_sizes:
            return fp
        return fingerprint({**description, "key": attrs.evolve(key, static_sizes=()).export_key})

    def _identity(self, module: torch.nn.Module, key: GraphKey) -> tuple[list, str, dict]:
        """The graph passes, the fingerprint of ``key``'s export and what it hashes (:func:`graph_description`),
        asked of the hooks once per key (the export asks again for a key the state machine decided to export once
        more)."""
        if self._last_identity is not None and self._last_identity[0] == key:
            _, passes, fp, description = self._last_identity
            self._last_identity = None
            return passes, fp, description
        passes = self.hooks.graph_passes()
        description = graph_description(
            key,
            module,
            passes=passes,
            exporter=self.exporter,
            plugin_keys=self.hooks.export_key(),
            untraced=self.untraced_attributes,
            untraced_hooks=self.untraced_hooks,
        )
        fp = fingerprint(description)
        self._last_identity = (key, passes, fp, description)
        return passes, fp, description

    def export_for_audit(
        self, module: torch.nn.Module, schema: InputSchema, tensors: list[torch.Tensor], tapper: Any, key: GraphKey
    ) -> ExportedGraph:
        """A graph of this call for the gradient audit: exported anew (no export cache) with ``key``'s dynamic
        dimensions, taps from ``tapper``."""
        return self._export_graph(
            module,
            schema,
            tensors,
            self.hooks.graph_passes(),
            tapper,
            dynamic_dims=key.dynamic_dims,
            autocast=key.autocast,
        )

    def _export_graph(
        self,
        module: torch.nn.Module,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        passes: list,
        tapper: Any,
        keep_raw: bool = False,
        dynamic_dims: dict[int, list[int]] | None = None,
        autocast: tuple = (),
    ) -> ExportedGraph:
        """One export, inside the plugins' export contexts (``ortcore_export_context``), under the autocast state
        ``autocast`` (:attr:`GraphKey.autocast`); ``dynamic_dims`` as :attr:`GraphKey.dynamic_dims` (None: every
        dimension dynamic)."""
        opts = self.options
        with self._export_contexts(module), amp.autocast_as(autocast):
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
                dynamic_dims=dynamic_dims,
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
            built = build_graph(request, purpose, self.hooks.lower_stop_gradients)
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
            prober=lambda p, cause: self._probe(built, p, cause),
        )
        self.hooks.session_plan(built, plan)
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


_measurement_sessions = 0


def measurement_session(
    model: onnx.ModelProto, input_names: Sequence[str], train_names: Sequence[str], purpose: str
) -> TrainingSession:
    """A training session of a small graph that belongs to no model, for a plugin's measurement (say, one op's
    forward + backward with ORT's kernel and with PyTorch's): ``model``'s inputs are all fed by the caller, those in
    ``train_names`` get gradients; CPU, ORT's default providers, errors only in the log. Built and created by the
    core's own path, so the graph gets every fix a model's graph gets; counted (:func:`measurement_sessions`) and
    logged at DEBUG with ``purpose``."""
    global _measurement_sessions
    device = torch.device("cpu")
    names = list(input_names)
    request = BuildRequest(
        model=model,
        input_names=names,
        user_input_names=names,
        train_names=list(train_names),
        build_gradient=True,
        device=device,
        log_level=LogLevel.ERROR,
    )
    built = build_graph(request, purpose=purpose)
    session = TrainingSession(
        built, SessionPlan(device=device, log_level=LogLevel.ERROR, providers=default_providers(device))
    )
    _measurement_sessions += 1
    logger.debug("measurement session %d built (%s)", _measurement_sessions, purpose)
    return session


def probe_session(
    model: onnx.ModelProto, purpose: str, *, threads: int = 0, optimize: bool = True, quiet: bool = False
) -> Any:
    """An ONNX Runtime inference session of a small graph that belongs to no model, for a plugin's question to ORT
    (does a kernel exist for these types; a few integer ops run beside each step). Raises what ORT raises when it
    refuses the graph: that is the answer to such a question. ``threads`` 0 is ORT's default; ``optimize`` False
    keeps the graph as given; ``quiet`` logs nothing of ORT's own. CPU. Counted (:func:`measurement_sessions`) and
    logged at DEBUG with ``purpose``."""
    import onnxruntime

    global _measurement_sessions
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4 if quiet else 3
    options.intra_op_num_threads = threads
    if not optimize:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    _measurement_sessions += 1
    logger.debug("probe session %d (%s)", _measurement_sessions, purpose)
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measurement_sessions() -> int:
    """How many sessions this process built for plugins' measurements and probes (:func:`measurement_session`,
    :func:`probe_session`)."""
    return _measurement_sessions
