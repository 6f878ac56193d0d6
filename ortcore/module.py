"""``ORTModule``: a drop-in ``nn.Module`` whose forward and backward run in ONNX Runtime's training engine."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch

from . import hf as _hf  # noqa: F401  (registers the Hugging Face cache adapter)
from .amp import autocast_state, running_graph
from .config import Config, CoreOptions
from .errors import (
    FirstRunError,
    GraphBuildError,
    StepCheckError,
    UnsupportedDataError,
    UnsupportedDeviceError,
    UnsupportedModelError,
)
from .exporter import Exporter
from .graph import ExportedGraph, range_violations, update_batch_norm, write_back_buffers
from .host import Hooks, PluginHost, get_host
from .inspectors import FirstStep, ForwardInputs, StepWatch, phase_callbacks
from .options import ONNX_OPSET_VERSION, DebugOptions, FallbackPolicy
from .pipeline import Pipeline
from .repair import CORE_REPAIR, EXPORTER_KINDS, MAX_REPAIRS, Failure, Repair, locate, order_repairs, trace_modules
from .schema import InputSchema, flatten_inputs
from .session import TrainingSession
from .state import ExportStateMachine, GraphKey, describe_violation
from .taps import recorder_of

logger = logging.getLogger("ortcore")


# Graphs one key may grow for calls whose sizes fall outside the ranges of the graphs before (Module._resolve).
MAX_SHAPE_CLASSES = 4

_FALLBACK_FLAG = {
    UnsupportedDataError: FallbackPolicy.FALLBACK_UNSUPPORTED_DATA,
    UnsupportedModelError: FallbackPolicy.FALLBACK_UNSUPPORTED_TORCH_MODEL,
    GraphBuildError: FallbackPolicy.FALLBACK_UNSUPPORTED_ONNX_MODEL,
    UnsupportedDeviceError: FallbackPolicy.FALLBACK_UNSUPPORTED_DEVICE,
}


class _RankZeroFilter(logging.Filter):
    """At WARNING and above only rank 0 logs, as the seeds describe; DEVINFO and below log on every rank."""

    def __init__(self, all_ranks: bool):
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        if self.all_ranks or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return True
        return torch.distributed.get_rank() == 0


def _configure_logging(options: CoreOptions) -> None:
    """Set ortcore's log level; print through our own handler only if the application configured no logging."""
    logger.setLevel(options.log_level.python_level)
    ours = [h for h in logger.handlers if getattr(h, "_ortcore", False)]
    if not ours and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s ortcore: %(message)s"))
        handler._ortcore = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.filters = [f for f in logger.filters if not isinstance(f, _RankZeroFilter)]
    logger.addFilter(_RankZeroFilter(all_ranks=options.log_level <= 1))


# Frames of these packages are not the user's: a warning names the first frame outside them.
_INTERNAL_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, sys.modules[__package__]))


def _user_stacklevel() -> int:
    """The ``stacklevel`` at which ``warnings.warn``, called by this function's caller, names the user's line.

    The call reaches ortcore through torch (``nn.Module.__call__``, ``_call_impl``, DDP, ...) at a depth that
    changes between torch versions and wrappers, so the frames are walked instead of counted.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL_DIRS):
        frame = frame.f_back
        level += 1
    return level


def _assigned_opset() -> int | None:
    """``ortcore.ONNX_OPSET_VERSION`` if the application assigned it another value (upstream's way to change the
    opset), applied like the ``opset`` argument."""
    value = getattr(sys.modules.get(__package__), "ONNX_OPSET_VERSION", ONNX_OPSET_VERSION)
    return None if value == ONNX_OPSET_VERSION else value


def _any_of(predicates: list) -> Any:
    """One predicate true where any of ``predicates`` is (None for none)."""
    if not predicates:
        return None
    if len(predicates) == 1:
        return predicates[0]
    return lambda value: any(p(value) for p in predicates)


class _Runtime:
    """Per-ORTModule state that is rebuilt, not pickled: config, hooks, state machine, inspectors, fallback."""

    def __init__(self, module: torch.nn.Module, config: Config, hooks: Hooks, exporter: Exporter | None):
        self.custom_exporter = exporter  # pickled with the model; the plugins' exporter is asked for again
        self.state = ExportStateMachine(config.core.max_cached_graphs)
        self.step = 0
        inspectors = hooks.runtime_inspectors(module)
        self.phases = phase_callbacks(inspectors)
        # Attributes an engine keeps on the model for its own bookkeeping (RuntimeInspector.untraced_attributes):
        # setting them is no change of the model, nor part of the graph's fingerprint (the pipeline's).
        self.untraced_attributes = frozenset().union(*(getattr(i, "untraced_attributes", ()) for i in inspectors))
        self.untraced_hooks = _any_of([p for i in inspectors if (p := getattr(i, "untraced_hooks", None)) is not None])
        self.inspectors = inspectors
        self._use(config, hooks)
        # Repairs in force (ortcore.repair), oldest first, and every repair tried (by key), kept or not.
        self.repairs: list[Repair] = []
        self.tried: set[tuple] = set()
        self.unrepaired_fingerprint: str | None = None  # the first call's graph fingerprint before any repair
        self.told_empty = False  # a training call with an empty input ran in PyTorch (said once)
        # export_again() requests acted on (the count the module's entry had; earlier ones concern older wrappers)
        self.export_requests_seen = _export_requests.get(module, (0, ""))[0]
        # Per kind of call (a key's export fields, sizes aside, and grad mode): the sizes graphs are exported for,
        # None where a call changed a dimension (dynamic_shapes = "auto", :meth:`static_sizes`).
        self.sizes: dict[tuple, tuple] = {}
        # Each training session's first step is checked once (ortcore_check_first_step: the gradient audit); a
        # session that failed its check keeps the failure, raised again on every step. A check watching the user's
        # step (a StepWatch) is pending until that step's backward: a weak reference to it.
        self.checked: weakref.WeakKeyDictionary[
            TrainingSession, StepCheckError | FirstRunError | weakref.ref | None
        ] = weakref.WeakKeyDictionary()
        # Sessions whose watched step did not pass, or whose watch was dropped without a backward: checked again
        # by a step of the check's own.
        self.watch_again: weakref.WeakSet[TrainingSession] = weakref.WeakSet()
        self.audits: list[Any] = []  # the checks' reports, oldest first
        self.told_unchecked = False  # verify_gradients is on and no enabled plugin checks (said once)
        try:
            self.signature: inspect.Signature | None = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self.signature = None

    def _use(self, config: Config, hooks: Hooks) -> None:
        """Export and build with ``config`` and ``hooks`` from now on (at start, and after a repair)."""
        self.config = config
        self.options = config.core
        self.hooks = hooks
        self.exporter = self.custom_exporter or hooks.exporter(config)
        symbolics = hooks.export_symbolics(config)
        if symbolics and hasattr(self.exporter, "symbolics"):
            self.exporter.symbolics.update(symbolics)
        if hasattr(self.exporter, "use_hooks"):  # an exporter that takes its own contributions (the dynamo route)
            self.exporter.use_hooks(hooks, config)
        self.pipeline = Pipeline(config, hooks, self.exporter, self.state)
        self.pipeline.untraced_attributes = self.untraced_attributes
        self.pipeline.untraced_hooks = self.untraced_hooks

    def static_sizes(self, key: GraphKey, tensors: list[torch.Tensor]) -> tuple:
        """The sizes ``key``'s graph is exported for (``dynamic_shapes = "auto"``): the first call's, with each
        dimension that a later call of the same kind (same export key otherwise, and grad mode) changed as None,
        dynamic from then on.
        Dimensions only ever become dynamic, so a model whose sizes vary gets at most one graph more per dimension."""
        sizes = tuple(tuple(t.shape) for t in tensors)
        known = self.sizes.get(key.sizes_family)
        if known is not None:  # the export that follows logs which dimensions turned dynamic (describe_change)
            sizes = tuple(
                tuple(k if k == s else None for k, s in zip(known_dims, dims)) for known_dims, dims in zip(known, sizes)
            )
        self.sizes[key.sizes_family] = sizes
        return sizes

    def all_dynamic(self, key: GraphKey, error: Exception) -> GraphKey | None:
        """``key`` with every dimension dynamic, if its graph was exported for static sizes, else None. A graph for
        static sizes that ORT fails to build or run is the first thing given up: ORT's graph
        transformers and gradient builders take other paths on static shapes (a reshaped graph output's gradient is
        one that fails), and the dynamic graph is the one every repair was made for. A wrong gradient the audit finds is
        repaired by routing as on any graph."""
        if not any(size is not None for sizes in key.static_sizes for size in sizes):
            return None
        dynamic = tuple((None,) * len(sizes) for sizes in key.static_sizes)
        self.sizes[key.sizes_family] = dynamic
        logger.info(
            "the graph exported for the call's sizes failed (%s: %s); exporting it with every dimension dynamic",
            type(error).__name__,
            str(error).splitlines()[0][:300] if str(error) else "",
        )
        return attrs.evolve(key, static_sizes=dynamic)

    @property
    def repairs_key(self) -> tuple:
        return tuple(r.description for r in self.repairs)

    def repair(self, failure: Failure) -> Repair | None:
        """Apply the smallest repair of ``failure`` that plugins offer and that changes the effective options
        (``ortcore_repairs``); None when none is left or :data:`~ortcore.repair.MAX_REPAIRS` routing repairs were applied
        (another exporter is not counted: it is offered once and routes nothing)."""
        if sum(r.kind not in EXPORTER_KINDS for r in self.repairs) >= MAX_REPAIRS:
            return None
        for candidate in order_repairs(self.hooks.repairs(failure, self.config)):
            if candidate.key in self.tried:
                continue
            self.tried.add(candidate.key)
            config, hooks = self._repaired([candidate])
            if config.core == self.config.core and config.plugin_options(
                candidate.plugin
            ) == self.config.plugin_options(candidate.plugin):
                logger.info(
                    "repair %r changes nothing (an environment variable sets the option)", candidate.description
                )
                continue
            repair = attrs.evolve(candidate, reason=failure.describe())
            self._apply(repair, config, hooks)
            self.state.record_repair(repair.description, repair.reason)
            return repair
        return None

    def _repaired(self, repairs: list[Repair]) -> tuple[Config, Hooks]:
        """The configuration and hooks with ``repairs`` applied: plugin options through a host whose tables carry
        them (the environment still over them), core options (``plugin = "core"``) over every layer."""
        changes: dict[str, dict] = {}
        core: dict[str, Any] = {}
        for repair in repairs:
            (core if repair.plugin == CORE_REPAIR else changes.setdefault(repair.plugin, {})).update(repair.options)
        config, hooks = self.config, self.hooks
        if changes:
            host = hooks.host.with_plugin_options(changes)
            config = attrs.evolve(config, plugins=host.config.plugins, plugin_tables=host.config.plugin_tables)
            hooks = host.hooks
        if core:
            config = config.with_repaired_core(core)
        return config, hooks

    def _apply(self, repair: Repair, config: Config, hooks: Hooks) -> None:
        self._use(config, hooks)
        self.repairs.append(repair)
        self.tried.add(repair.key)

    def restore(self, stored: list[dict]) -> bool:
        """Apply repairs an earlier process found (``ortcore_load_repairs``); False if they do not apply here (an
        entry this version cannot read, a plugin missing), and then none is applied."""
        try:
            repairs = [Repair(**entry) for entry in stored]
            config, hooks = self._repaired(repairs)
        except Exception as e:  # a stale or foreign entry costs a search, never the step
            logger.info("stored repairs not applied (%s: %s)", type(e).__name__, e)
            return False
        for repair in repairs:
            self._apply(repair, config, hooks)
            self.state.record_repair(repair.description, f"{repair.reason} (found by an earlier process)")
        return True


class _OutputsDiffer(Exception):
    """A watched first step's outputs differ from the check's: the call is run again, checked by a step of the
    check's own."""


class _Watching:
    """The first-step checks watching one training step (:class:`StepWatch`), for the session that runs it."""

    def __init__(self, runtime: _Runtime, session: TrainingSession, graph: ExportedGraph, watches: list[StepWatch]):
        self.runtime = runtime
        self.session = weakref.ref(session)
        self.n_outputs = graph.n_user_outputs
        self.feed_names = list(session.feed_names)
        self.watches = watches

    def outputs(self, outputs: tuple) -> None:
        """Raises :class:`_OutputsDiffer` when a watch does not accept ORT's outputs."""
        for watch in self.watches:
            try:
                accepted = watch.outputs(list(outputs[: self.n_outputs]))
            except Exception as e:  # a check's own failure: its session is checked again, by a step of its own
                logger.warning("a first-step check failed on the step's outputs (%s: %s)", type(e).__name__, e)
                accepted = False
            if not accepted:
                self._not_passed()
                raise _OutputsDiffer

    def gradients(self, grad_outputs: tuple, grads: list) -> list:
        """ORT's gradients of the watched step, or those a watch hands over instead."""
        by_name = dict(zip(self.feed_names, grads))
        replaced: dict[str, Any] = {}
        reports = []
        for watch in self.watches:
            asked, instead = self._ask(watch, grad_outputs, dict(by_name))
            if not asked:
                self._not_passed()
                return grads
            if instead is not None:
                replaced.update(instead)
            elif watch.report is not None:
                reports.append(watch.report)
        if replaced:
            self._not_passed()
            return [replaced.get(name, g) for name, g in zip(self.feed_names, grads)]
        self.runtime.audits.extend(reports)
        session = self.session()
        if session is not None:
            self.runtime.checked[session] = None
        return grads

    def failed(self, grad_outputs: tuple, error: Exception) -> list | None:
        """The gradients a watch hands over when ORT's backward of the watched step failed with ``error``; None when
        none does."""
        self._not_passed()
        logger.info("ONNX Runtime's backward of the watched first step failed (%s: %s)", type(error).__name__, error)
        for watch in self.watches:
            _, instead = self._ask(watch, grad_outputs, None)
            if instead is not None:
                return [instead.get(name) for name in self.feed_names]
        return None

    def _ask(self, watch: StepWatch, grad_outputs: tuple, grads: dict | None) -> tuple[bool, dict | None]:
        """``(answered, gradients instead)`` of ``watch.gradients``; a check's own failure is logged, not answered."""
        try:
            return True, watch.gradients(list(grad_outputs[: self.n_outputs]), grads)
        except Exception as e:
            logger.warning("a first-step check failed on the step's gradients (%s: %s)", type(e).__name__, e)
            return False, None

    def _not_passed(self) -> None:
        session = self.session()
        if session is not None:
            self.runtime.checked.pop(session, None)
            self.runtime.watch_again.add(session)


class _ORTFunction(torch.autograd.Function):
    """Runs one training step's forward in ORT and, when autograd asks, the matching backward."""

    @staticmethod
    def forward(
        ctx,
        session: TrainingSession,
        runtime: _Runtime,
        recording: Any,
        anchor: Any,
        autocast: tuple,
        watch: _Watching | None,
        *feeds: torch.Tensor,
    ):
        with running_graph(autocast):  # the graph holds autocast's casts (ortcore.amp)
            outputs, state = session.run_forward(feeds)
        ctx.autocast = autocast
        ctx.watch = watch  # a first-step check watching this step (StepWatch): given ORT's gradients once
        ctx.session = session
        ctx.runtime = runtime
        ctx.recording = recording  # (recorder, its step state, the graph's taps) when activations are recorded
        ctx.step = runtime.step
        ctx.feeds = feeds  # references only: a second backward (retain_graph=True) recomputes the forward
        ctx.state = state
        ctx.meta = [(o.shape, o.dtype) for o in outputs]
        ctx.set_materialize_grads(False)
        # One call with all of them: each call replaces the previous set.
        ctx.mark_non_differentiable(*(outputs[i] for i in session.torch_non_differentiable))
        # ORT keeps these for backward itself; saving them lets torch detect in-place changes by the user.
        ctx.save_for_backward(*(outputs[i] for i in session.save_for_backward))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs: torch.Tensor | None):
        _ = ctx.saved_tensors
        session: TrainingSession = ctx.session
        phases = ctx.runtime.phases
        for call in phases["pre_backward"]:
            call(ctx.step)
        state = ctx.__dict__.pop("state", None)  # ORT's saved activations: freed now, not when the graph is collected
        if state is None:
            # ORT's state serves one backward; for another (retain_graph=True) the forward is recomputed.
            logger.info("second backward through one forward (retain_graph=True): recomputing the forward in ORT")
            with running_graph(ctx.autocast):
                _, state = session.run_forward(ctx.feeds)
        tap_grads: list[tuple[int, torch.Tensor]] | None = [] if ctx.recording is not None else None
        watch = ctx.__dict__.pop("watch", None)
        try:
            with running_graph(ctx.autocast):
                grads = session.run_backward(
                    grad_outputs, ctx.meta, state, tap_gradients=tap_grads, feed_shapes=[f.shape for f in ctx.feeds]
                )
        except Exception as e:
            # A watched first step whose backward ORT cannot run: the step takes the check's gradients, if it has
            # them, and the session is checked again (by a step of the check's own, which names the failure).
            if watch is None or (grads := watch.failed(grad_outputs, e)) is None:
                raise
        else:
            if watch is not None:
                grads = watch.gradients(grad_outputs, grads)
        del state
        if tap_grads:
            recorder, step_state, taps = ctx.recording
            for k, grad in tap_grads:
                recorder.deliver_backward(step_state, taps[k].name, grad)
        for call in phases["post_backward"]:
            call(ctx.step)
        return (None, None, None, None, None, None, *grads)


# export_again(): per wrapped module, (how many requests so far, the last one's reason). Each ORTModule remembers the
# count it has acted on, so every ORTModule wrapping the module exports again once.
_export_requests: weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, str]] = weakref.WeakKeyDictionary()


def export_again(module: torch.nn.Module, reason: str) -> None:
    """Ask every ORTModule that wraps ``module`` to export it again at its next call (its graphs and sessions are
    dropped; repairs and options stay). For a plugin whose choices, made at export, changed since: the
    ``aten_fallback`` plugin calls it once a kernel it measured on a later step should run on the other side.
    ``module`` is the module the plugin was given (``ortcore_runtime_inspectors``), the one ORTModule wraps."""
    count, _ = _export_requests.get(module, (0, ""))
    _export_requests[module] = (count + 1, reason)


_WRAPPER_ATTRIBUTES = frozenset({"_original_module", "_ortcore", "training"})
_MISSING = object()


def _stage_of(error: Exception, eager_ran: bool) -> tuple[str | None, str | None]:
    """``(stage, module)`` of a failure a repair may serve (``stage`` None: the model's own error, or bad data);
    ``module`` is the one a first-step check (the gradient audit) named. An error the forward raised while the
    exporter traced it is the model's own only if the forward fails in eager PyTorch too (``eager_ran`` False)."""
    if isinstance(error, StepCheckError):
        return "audit", error.module
    if isinstance(error, FirstRunError):
        return "run", None
    if isinstance(error, GraphBuildError):
        return "build", None
    if isinstance(error, UnsupportedModelError) and (eager_ran or not _may_be_the_models_error(error)):
        return "export", None
    return None, None


def _may_be_the_models_error(error: Exception) -> bool:
    """Whether PyTorch may raise for this call too: the model's forward raised while traced, or the arguments do
    not match its signature."""
    if isinstance(error, UnsupportedModelError):
        # A layer that rewords the exporter's error raises a new one while handling it: look down the context chain.
        seen: BaseException | None = error
        while seen is not None:
            if getattr(seen, "raised_in_forward", None) is not None:
                return True
            seen = seen.__context__
        return False
    return isinstance(error, UnsupportedDataError) and isinstance(error.__cause__, TypeError)


def _unroutable_hint(failure: Any) -> str:
    """What the user can change when the failure lies in the model's own forward, where no module can be routed."""
    if failure.innermost:
        return ""
    if "omplex" in failure.message:
        return (
            ". The complex-valued code is in the model's own forward: moved into a submodule (an nn.Module that takes "
            "and returns real tensors), it runs in PyTorch inside the ORT graph and the rest stays in ONNX Runtime"
        )
    return (
        ". The failure is in the model's own forward, where nothing smaller than the whole model can run in "
        "PyTorch: code moved into a submodule can be routed on its own"
    )


class ORTModule(torch.nn.Module):
    """Wrap a ``torch.nn.Module`` so that its forward and backward run in ONNX Runtime.

    The wrapper behaves as the model does: same parameters and ``state_dict`` keys, same forward signature,
    attribute access falls through to the model, and any torch optimizer works on ``parameters()``.

    Example::

        model = ORTModule(MyModel())
        loss = model(x).sum()
        loss.backward()

    Args:
        module: the model to wrap (not a ``torch.nn.DataParallel``).
        debug_options: logging and ONNX saving; ``ORTMODULE_LOG_LEVEL`` and ``ORTMODULE_SAVE_ONNX_PATH`` override.
        fallback_policy: a :class:`FallbackPolicy` or its names joined by ``|``; ``ORTMODULE_FALLBACK_POLICY`` wins.
        opset: ONNX opset (default 17); ``ORTMODULE_ONNX_OPSET_VERSION`` wins.
        verify_gradients: audit the first step of each new training graph against PyTorch (outputs, loss, every
            gradient; on by default). A difference is repaired by running the first module that differs in PyTorch
            (``model.repairs``); when nothing repairs it, :class:`ortcore.GradientMismatchError` names the
            module. ``ORTCORE_VERIFY_GRADIENTS`` wins. See docs/gradient_audit.md.
        exporter: the exporter to use: a name (``"torchscript"``, the default, or ``"dynamo"``: the ``exporter``
            option) or an exporter object (default: the plugins' choice, else the one the option names).
        config: a :class:`ortcore.config.Config` (default: ``ortcore.toml`` and the environment).
        host: a :class:`ortcore.host.PluginHost` (default: the process-wide host); ``config`` then comes from it.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        debug_options: DebugOptions | None = None,
        *,
        fallback_policy: FallbackPolicy | str | None = None,
        opset: int | None = None,
        verify_gradients: bool | None = None,
        exporter: Exporter | str | None = None,
        config: Config | None = None,
        host: PluginHost | None = None,
    ):
        if isinstance(module, torch.nn.DataParallel):
            raise UnsupportedModelError(
                "ORTModule cannot wrap torch.nn.DataParallel; wrap the model itself with ORTModule and use "
                "torch.nn.parallel.DistributedDataParallel around it"
            )
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) or any(
            cls.__name__ == "DeepSpeedEngine" for cls in type(module).__mro__
        ):
            # Their forward would run only while exporting: gradients would never be reduced across ranks.
            raise UnsupportedModelError(
                f"ORTModule cannot wrap {type(module).__name__}: it would never synchronise gradients across ranks; "
                "wrap the model itself and put the distributed wrapper around it: "
                "DistributedDataParallel(ORTModule(model)), deepspeed.initialize(model=ORTModule(model), ...)"
            )
        if isinstance(module, ORTModule):
            raise UnsupportedModelError("the module is already an ORTModule")
        if not isinstance(module, torch.nn.Module):
            raise UnsupportedModelError(f"ORTModule wraps a torch.nn.Module, not {type(module).__name__}")
        if debug_options is not None and not isinstance(debug_options, DebugOptions):
            raise TypeError(f"debug_options must be a DebugOptions, not {type(debug_options).__name__}")
        super().__init__()
        self._original_module = module
        host = host or (PluginHost(config) if config is not None else get_host())
        if opset is None:
            opset = _assigned_opset()
        exporter_option = exporter if isinstance(exporter, str) else None
        if exporter_option is not None:
            exporter = None  # a name: the plugins' exporter of that name (Hooks.exporter)
        elif exporter is not None and not callable(getattr(exporter, "export", None)):
            raise TypeError(
                f"exporter={exporter!r} is not allowed; expected an exporter's name (torchscript, dynamo, or one a "
                "plugin offers) or an object with an export() method (ortcore.exporter.Exporter)"
            )
        config = host.config.with_code_options(
            debug_options,
            fallback_policy=fallback_policy,
            opset=opset,
            verify_gradients=verify_gradients,
            exporter=exporter_option,
        )
        if config.core.save_onnx and not os.access(config.core.save_dir, os.W_OK):
            raise OSError(
                f"cannot save ONNX models: directory {config.core.save_dir!r} is not writable; set "
                "ORTMODULE_SAVE_ONNX_PATH to a writable directory"
            )
        self._init_runtime(config, host.hooks, exporter)
        _bind_model_methods(self)
        self.register_load_state_dict_post_hook(_model_key_names)

    def _init_runtime(self, config: Config, hooks: Hooks, exporter: Exporter | None) -> None:
        _configure_logging(config.core)
        self._ortcore = _Runtime(self._original_module, config, hooks, exporter)

    def __new__(cls, module: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> ORTModule:
        if cls is ORTModule and isinstance(module, torch.nn.Module) and not isinstance(module, ORTModule):
            cls = _wrapper_class(type(module))
        return super().__new__(cls)

    def __reduce_ex__(self, protocol: int):
        # Instances of the per-model subclass are rebuilt through it (the subclass itself is not importable).
        return (_new_wrapper, (type(self._original_module),), self.__getstate__())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model's forward in ONNX Runtime (its signature is the wrapped model's)."""
        return self._run(args, kwargs)

    # -- public state ------------------------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model."""
        return self._original_module

    @property
    def __ortcore_wrapped__(self) -> torch.nn.Module:
        """The wrapped model, for code below this module that must not import it (activation subscriptions belong
        to the wrapped model)."""
        return self._original_module

    @property
    def state_machine(self) -> ExportStateMachine:
        """The export state machine; ``state_machine.counters`` counts exports, builds, reuses and fallbacks."""
        return self._ortcore.state

    @property
    def runtime_options(self) -> CoreOptions:
        """The effective core options (``ortcore_config.sources`` says where each value came from)."""
        return self._ortcore.options

    @property
    def ortcore_config(self) -> Config:
        """The effective configuration: core options, plugin options, and the source of each value."""
        return self._ortcore.config

    @property
    def gradient_audits(self) -> list[Any]:
        """The reports of the first-step checks this model ran, oldest first: the gradient audit's ``AuditResult``
        (``verify_gradients``; docs/gradient_audit.md)."""
        return list(self._ortcore.audits)

    @property
    def repairs(self) -> list[Repair]:
        """The repairs in force, oldest first: each names what runs in PyTorch (or which optimizer is off), the
        plugin options it set and the failure it repaired (``ortcore.repair``)."""
        return list(self._ortcore.repairs)

    @property
    def fallback_reason(self) -> str | None:
        """Why the model now runs in PyTorch, or None while it runs in ORT."""
        return self._ortcore.state.fallback_reason

    # -- the step ----------------------------------------------------------------------------------------------
    def _run(self, args: tuple, kwargs: dict) -> Any:
        rt = self._ortcore
        if _export_requests:
            request = _export_requests.get(self._original_module)
            if request is not None and request[0] != rt.export_requests_seen:
                rt.export_requests_seen = request[0]
                self._model_changed(f"a plugin asked to export again: {request[1]}")
        for inspect_call in rt.phases["pre_call"]:
            inspect_call(rt.step, self)
        # One walk of the model's state per step, shared by the key and the feeds.
        params = dict(self._original_module.named_parameters())
        buffers = dict(self._original_module.named_buffers())
        # A step recorder on the wrapped model (activation subscribers, ortcore.taps): a training step it records
        # runs a graph with taps.
        recorder = recorder_of(self._original_module) if self._original_module.training else None
        taps = recorder is not None and recorder.next_step_active()
        try:
            schema, tensors = flatten_inputs(rt.signature, args, kwargs)
            key = self._graph_key(schema, tensors, params, buffers, taps)
        except tuple(_FALLBACK_FLAG) as e:
            error, failed = e, (type(e).__name__, str(e))  # no key yet: the error names the call's bad input
        else:
            if key.grad_enabled and any(t.dim() > 0 and t.numel() == 0 for t in tensors):
                # ORT's training kernels cannot run empty tensors (ConvGrad kills the process): this call alone runs
                # in PyTorch, which has nothing to learn from it either; the next call is ORT's again.
                if not rt.told_empty:
                    rt.told_empty = True
                    logger.info("a training call with an empty input runs in PyTorch (so does every such call)")
                return self._original_module(*args, **kwargs)
            known = rt.state.known_failure(key)
            if known is not None and not rt.options.fallback_retry:
                rt.state.fallback_reason = known
                return self._original_module(*args, **kwargs)
            while True:
                try:
                    graph, session, key, watch = self._resolve_verified(
                        key, schema, tensors, params, buffers, recorder, args, kwargs
                    )
                except tuple(_FALLBACK_FLAG) as e:
                    # The key the next such call gets: a graph for static sizes that failed made its sizes dynamic.
                    error, failed = e, self._graph_key(schema, tensors, params, buffers, taps)
                    break
                rt.state.record_ort_run(key)
                step_state = recorder.start_step("ortcore") if recorder is not None else None
                recording = (recorder, step_state) if step_state is not None else None
                try:
                    return self._execute(
                        graph, session, tensors, params, buffers, (args, kwargs), recording, key.autocast, watch
                    )
                except _OutputsDiffer:  # a watched first step: the call again, its session checked by a step of its own
                    logger.info("the first step's outputs differ from the check's: the call runs again, checked")
        # Out of the except blocks: an exception the model raises in PyTorch reaches the user as PyTorch raised it,
        # not chained to ortcore's. The model's own forward runs, and its hooks record the step.
        return self._fall_back(error, failed, args, kwargs)

    def _resolve_verified(
        self,
        key: GraphKey,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        params: dict,
        buffers: dict,
        recorder: Any,
        args: tuple,
        kwargs: dict,
    ) -> tuple:
        """``(graph, session, key, watch)`` for the call, the first step of a new training graph audited against
        PyTorch (``verify_gradients``; ``watch`` a :class:`_Watching` when a check watches the step itself). When
        export, the gradient build, the first run or the audit fails, the failure is located and repaired by routing
        (:mod:`ortcore.repair`), and the call tried again under the repaired key; when no repair is left the error
        propagates (the fallback policy then applies), noting what was tried."""
        rt = self._ortcore
        trace = None
        if rt.unrepaired_fingerprint is None:  # the model's first resolve: repairs an earlier process found
            rt.unrepaired_fingerprint = rt.pipeline.fingerprint(self._original_module, key, sizes=False)
            stored = rt.hooks.load_repairs(self._original_module, rt.unrepaired_fingerprint)
            if stored and rt.restore(stored):
                key = attrs.evolve(key, repairs=rt.repairs_key)
        in_force = len(rt.repairs)
        while True:
            try:
                graph, session, key = self._resolve(key, schema, tensors, recorder)
                watch = None
                if rt.options.verify_gradients and session.request.build_gradient:
                    watch = self._check_first_step(graph, session, key, schema, tensors, params, buffers)
                if len(rt.repairs) > in_force:
                    found = [attrs.asdict(r) for r in rt.repairs]
                    rt.hooks.repairs_found(self._original_module, rt.unrepaired_fingerprint, found)
                return graph, session, key, watch
            except (UnsupportedModelError, GraphBuildError, StepCheckError) as e:
                dynamic = rt.all_dynamic(key, e) if isinstance(e, GraphBuildError) else None
                if dynamic is not None:  # the static graph failed: the one dynamic in every dimension comes first
                    key = dynamic
                    continue
                if trace is None:
                    trace = trace_modules(self._original_module, args, kwargs)
                stage, module = _stage_of(e, eager_ran=trace.ran)
                if stage is None:
                    raise
                graph = rt.state.graph_for(key)
                failure = locate(
                    stage,
                    e,
                    self._original_module,
                    trace=trace,
                    onnx_model=getattr(graph, "model", None),
                    module=module,
                )
                if rt.repair(failure) is None:
                    tried = ", ".join(r.description for r in rt.repairs)
                    e.add_note(
                        f"ortcore could not repair this by routing ({failure.describe()}); "
                        + (f"repairs in force: {tried}" if tried else "no plugin offered a repair")
                        + _unroutable_hint(failure)
                    )
                    raise
                key = attrs.evolve(key, repairs=rt.repairs_key)

    def _resolve(self, key: GraphKey, schema: InputSchema, tensors: list[torch.Tensor], recorder: Any) -> tuple:
        """``(graph, session, key)`` for the call. A graph valid for some input sizes only (the exporter's
        ``ortcore.input_ranges``: the model branches on a size) serves the calls within them; a call outside gets a
        graph of its own, under a key that records which ranges it fell outside of (at most
        :data:`MAX_SHAPE_CLASSES` graphs deep), instead of running a graph exported for other sizes."""
        rt = self._ortcore
        while True:
            graph, session = rt.state.resolve(
                key,
                export=lambda key=key: rt.pipeline.export(self._original_module, schema, tensors, key, recorder),
                build=lambda g, key=key: rt.pipeline.build(g, key),
            )
            violations = range_violations(graph.input_ranges, graph.user_input_names, tensors)
            if not violations:
                return graph, session, key
            if len(key.shape_class) >= MAX_SHAPE_CLASSES:
                raise UnsupportedDataError(
                    f"the input sizes of this call fall outside the ranges of {MAX_SHAPE_CLASSES + 1} graphs exported "
                    f"for {type(self._original_module).__name__} ("
                    + ", ".join(describe_violation(v) for v in violations)
                    + "): the model branches on these sizes in more ways than ortcore keeps graphs for"
                )
            key = attrs.evolve(key, shape_class=(*key.shape_class, violations))

    def _execute(
        self,
        graph: ExportedGraph,
        session: TrainingSession,
        tensors: list[torch.Tensor],
        params: dict,
        buffers: dict,
        call: tuple,
        step_recording: Any = None,
        autocast: tuple = (),
        watch: _Watching | None = None,
    ) -> Any:
        by_name = dict(zip(graph.user_input_names, tensors))
        by_name.update(params)
        by_name.update(buffers)
        for stats in graph.batch_norms:
            for name in stats.buffer_names:
                by_name[name] = by_name[name].clone()
        for write in graph.buffer_writes:  # written back after the forward: ORT's backward reads the old value
            if write.buffer in by_name:
                by_name[write.buffer] = by_name[write.buffer].clone()
        feeds = [by_name[name] for name in session.feed_names]
        rt = self._ortcore
        if rt.phases["pre_forward"]:
            inputs = ForwardInputs(call[0], call[1], dict(zip(graph.user_input_names, tensors)), session)
            for inspect_call in rt.phases["pre_forward"]:
                inspect_call(rt.step, inputs)
        recording = (*step_recording, graph.taps) if step_recording is not None and graph.taps else None
        if session.request.build_gradient:
            anchor = None
            if session.grads_handed_over:
                # A plugin hands these gradients to torch itself during ORT's backward: no autograd edge to them,
                # or torch would call their hooks (and DDP's) again, with None. If nothing else requires grad, an
                # anchor keeps the outputs differentiable.
                feeds = [f.detach() if i in session.grads_handed_over else f for i, f in enumerate(feeds)]
                if not any(f.requires_grad for f in feeds):
                    anchor = torch.zeros((), requires_grad=True)
            outputs = _ORTFunction.apply(session, rt, recording, anchor, autocast, watch, *feeds)
            if watch is not None:
                watch.outputs(outputs)  # raises _OutputsDiffer before any buffer is written back
        else:
            with running_graph(autocast):
                outputs = session.run_inference(feeds)
        n = graph.n_user_outputs
        for inspect_call in rt.phases["post_forward"]:
            inspect_call(rt.step, outputs[:n])  # the model's outputs; not the core's extra ones
        if session.request.build_gradient:
            rt.step += 1
        if graph.batch_norms or graph.buffer_writes:
            index = {o.name: i for i, o in enumerate(graph.model.graph.output)}  # the core's extra outputs, by name
            for stats in graph.batch_norms:
                update_batch_norm(stats, outputs[index[stats.output_name]])
            user = list(outputs[:n])
            write_back_buffers(graph, [outputs[index[w.output]] for w in graph.buffer_writes], buffers, user)
            outputs = (*user, *outputs[n:])
        if recording is not None:
            recorder, step_state, _ = recording
            for tap, i in zip(graph.taps, graph.tap_outputs):
                recorder.deliver_forward(step_state, tap.name, outputs[i])
        return graph.output_schema.restore(outputs[:n])

    def _check_first_step(
        self,
        graph: ExportedGraph,
        session: TrainingSession,
        key: GraphKey,
        schema: InputSchema,
        tensors: list[torch.Tensor],
        params: dict,
        buffers: dict,
    ) -> _Watching | None:
        """The plugins' checks of a session's first step (``ortcore_check_first_step``), once per session; the
        checks watching the step itself (:class:`StepWatch`), if any, to run it with."""
        rt = self._ortcore
        pending = rt.checked.get(session)
        if isinstance(pending, weakref.ref):
            if pending() is not None:  # a watched step not differentiated yet (gradient accumulation): unchecked
                return None
            logger.info("the watched first step was never differentiated: the next one is checked by a step of its own")
            del rt.checked[session]
            rt.watch_again.add(session)
        watching = None
        if session not in rt.checked:
            if not rt.hooks.checks_first_steps():
                if not rt.told_unchecked:
                    rt.told_unchecked = True
                    logger.warning(
                        "verify_gradients is on but no enabled plugin checks first steps (is gradient_audit "
                        "disabled?): nothing is audited; verify_gradients = false (ORTCORE_VERIFY_GRADIENTS=0) says so"
                    )
                return
            step = FirstStep(
                model=self._original_module,
                graph=graph,
                session=session,
                schema=schema,
                tensors=tensors,
                params=params,
                buffers=buffers,
                trainable=key.trainable,
                export=lambda tapper: rt.pipeline.export_for_audit(self._original_module, schema, tensors, tapper, key),
                build=lambda g: self._check_build(g, key),
                autocast=key.autocast,
                # An engine that shards the parameters between forward and backward: checks run steps of their own.
                watchable=not graph.taps
                and session not in rt.watch_again
                and not any(getattr(i, "shards_parameters", False) for i in rt.inspectors),
            )
            rt.state.counters.audits += 1
            try:
                reports = rt.hooks.check_first_step(step)
                watches = [r for r in reports if isinstance(r, StepWatch)]
                rt.audits.extend(r for r in reports if not isinstance(r, StepWatch))
                if watches and step.watchable:
                    watching = _Watching(rt, session, graph, watches)
                    rt.checked[session] = weakref.ref(watching)
                else:
                    rt.checked[session] = None
            except (StepCheckError, FirstRunError) as e:
                report = getattr(e, "result", None)  # the check's report, if it attached one
                if report is not None:
                    rt.audits.append(report)
                rt.checked[session] = e
        failed = rt.checked[session]
        if isinstance(failed, (StepCheckError, FirstRunError)):
            raise failed.with_traceback(None)
        return watching

    def _check_build(self, graph: ExportedGraph, key: GraphKey) -> TrainingSession:
        self._ortcore.state.record_probe("gradient audit")
        return self._ortcore.pipeline.build(graph, key, purpose="audit")

    def _device(self, tensors: list[torch.Tensor], params: dict) -> torch.device:
        devices = {p.device for p in params.values()} | {t.device for t in tensors}
        if len(devices) > 1:
            raise UnsupportedDeviceError(
                f"inputs and parameters are on several devices {sorted(map(str, devices))}; ORTModule runs on one"
            )
        device = devices.pop() if devices else torch.device("cpu")
        if device.type not in ("cpu", "cuda"):
            raise UnsupportedDeviceError(f"device {device} is not supported; allowed: cpu, cuda")
        return device

    def _graph_key(
        self, schema: InputSchema, tensors: list[torch.Tensor], params: dict, buffers: dict, taps: bool = False
    ) -> GraphKey:
        rt = self._ortcore
        trainable = tuple(n for n, p in params.items() if p.requires_grad)
        inputs_rg = tuple(n for n, t in zip(schema.names, tensors) if t.requires_grad)
        key = GraphKey(
            structure=schema.structure,
            constants=schema.constants,
            inputs=schema.tensors,
            state_dtypes=tuple((n, p.dtype) for n, p in params.items())
            + tuple((n, b.dtype) for n, b in buffers.items()),
            training=self._original_module.training,
            module_modes=tuple(m.training for m in self._original_module.modules()),
            opset=rt.options.opset,
            exporter=rt.exporter.name,
            grad_enabled=torch.is_grad_enabled() and bool(trainable or inputs_rg),
            trainable=trainable,
            input_requires_grad=inputs_rg,
            device=str(self._device(tensors, params)),
            taps=taps,
            repairs=rt.repairs_key,
            autocast=autocast_state(),
        )
        if rt.options.dynamic_shapes == "always":
            return key
        return attrs.evolve(key, static_sizes=rt.static_sizes(key, tensors))

    def _fall_back(self, error: Exception, failed: Any, args: tuple, kwargs: dict) -> Any:
        """Run the call in PyTorch as the policy allows, remembering ``failed`` (the call's key) as falling back.

        If PyTorch raises too, the error is the model's own (a wrong argument, a shape error): PyTorch's exception
        goes to the user and nothing falls back.
        """
        rt = self._ortcore
        policy = rt.options.fallback_policy
        flag = next(f for t, f in _FALLBACK_FLAG.items() if isinstance(error, t))
        forced = FallbackPolicy.FALLBACK_FORCE_TORCH_FORWARD in policy
        if FallbackPolicy.FALLBACK_DISABLE in policy or not (forced or flag in policy):
            if _may_be_the_models_error(error):
                self._original_module(*args, **kwargs)  # raises what PyTorch raises for this call, if anything
            raise error
        outputs = self._original_module(*args, **kwargs)
        reason = f"{type(error).__name__}: {error}"
        if rt.state.record_fallback(failed, reason):
            message = f"running {type(self._original_module).__name__} in PyTorch ({flag.name}): {error}"
            logger.info(message)  # the warning below is what the user sees, once per failing kind of call
            warnings.warn(message, RuntimeWarning, stacklevel=_user_stacklevel())
        return outputs

    def _model_changed(self, reason: str) -> None:
        """The model's structure or code changed: export again, and let calls that fell back try ORT again."""
        self._ortcore.state.reset(reason)

    def explain(self) -> Any:
        """Where each op kind of the current graphs runs (ONNX Runtime's kernel or PyTorch's) and why; see
        ortcore.explain."""
        from .explain import explain

        return explain(self)

    # -- nn.Module behaviour -----------------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "_original_module" in modules:
                return getattr(modules["_original_module"], name)
            raise

    def __setattr__(self, name: str, value: Any) -> None:
        modules = self.__dict__.get("_modules", {})
        wrapped = modules.get("_original_module")
        if wrapped is None or name in _WRAPPER_ATTRIBUTES or name in self.__dict__ or hasattr(type(self), name):
            super().__setattr__(name, value)
            return
        # Everything else is the model's. Any new value (a submodule, a tensor, a constant or a method the forward
        # reads) can change the graph, as upstream assumes too.
        previous = getattr(wrapped, name, _MISSING)
        setattr(wrapped, name, value)
        runtime = self.__dict__.get("_ortcore")
        # A parameter replaced by a parameter is an input of the graph like the one before it (engines swap them:
        # FSDP2 registers its unsharded parameters for a step and its shards after); its shape, dtype and
        # requires_grad are part of the graph key.
        swapped = isinstance(previous, torch.nn.Parameter) and isinstance(value, torch.nn.Parameter)
        if previous is not value and not swapped and (runtime is None or name not in runtime.untraced_attributes):
            self._model_changed(f"attribute {name!r} of the model was {'set' if previous is _MISSING else 'replaced'}")

    # Container protocol of the wrapped model (a Sequential, a ModuleList): dunder lookups skip __getattr__.
    def __getitem__(self, index: Any) -> Any:
        return self._original_module[index]

    def __len__(self) -> int:
        return len(self._original_module)

    def __iter__(self):
        return iter(self._original_module)

    # The module tree is the model's, as are the parameter names: DDP, DeepSpeed (tied-parameter names in its
    # checkpoints), subscribers and `model.apply(init)` walk the model and never see the wrapper.
    def named_children(self):
        return self._original_module.named_children()

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        # The wrapper stands where the model is, at the root: an engine that finds its modules by walking the tree
        # from the module it was applied to (FSDP2's fully_shard(ORTModule(model)) looks for its root state there)
        # finds it, and every name is the model's.
        model = self._original_module
        for name, module in model.named_modules(memo, prefix, remove_duplicate):
            yield name, (self if module is model else module)

    def train(self, mode: bool = True) -> ORTModule:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self.training = mode
        self._original_module.train(mode)
        return self

    def apply(self, fn: Callable[[torch.nn.Module], None]) -> ORTModule:
        self._original_module.apply(fn)
        return self

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ORTModule:
        self._original_module._apply(fn, recurse)
        return self

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._original_module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._original_module.named_buffers(prefix, recurse, remove_duplicate)

    # Registering on the wrapper would hide the tensor or module from the model's forward: it goes to the model,
    # as with upstream's ORTModule, and the next call exports again (the new one is then fed, or trained).
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        """Register a buffer on the wrapped model; the next call exports the model again."""
        self._original_module.register_buffer(name, tensor, persistent=persistent)
        self._model_changed(f"buffer {name!r} registered on the model")

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        """Register a parameter on the wrapped model; the next call exports the model again."""
        self._original_module.register_parameter(name, param)
        self._model_changed(f"parameter {name!r} registered on the model")

    def add_module(self, name: str, module: torch.nn.Module | None) -> None:
        """Add a submodule to the wrapped model; the next call exports the model again."""
        self._original_module.add_module(name, module)
        self._model_changed(f"submodule {name!r} added to the model")

    def state_dict(self, *args: Any, **kwargs: Any):
        return self._original_module.state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        # A parent's load_state_dict (a wrapper module, DDP) walks _modules, where the model is "_original_module",
        # but state_dict() has the model's keys without that level (the checkpoint moves between ortcore and torch):
        # move this module's keys to where the walk looks for them. state_dict is the walk's own copy of them.
        inner = f"{prefix}_original_module."
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
            state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        # The model's methods bound to the wrapper are bound again on unpickling (a bound method would pickle as a
        # lookup on the object still being built).
        for name in [n for n, v in state.items() if isinstance(v, types.MethodType) and v.__self__ is self]:
            del state[name]
        rt = state.pop("_ortcore")
        state["_ortcore_config"] = (rt.config, rt.custom_exporter)
        return state

    def __setstate__(self, state: dict) -> None:
        config, exporter = state.pop("_ortcore_config")
        self.__dict__.update(state)
        self._init_runtime(config, get_host().hooks, exporter)
        _bind_model_methods(self)


def _model_key_names(module: ORTModule, incompatible_keys: Any) -> None:
    """Missing and unexpected keys of a parent's load_state_dict under the names state_dict() uses (without the
    ``_original_module.`` level that ``ORTModule._load_from_state_dict`` adds for the walk)."""
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [k.replace("_original_module.", "", 1) for k in keys]


def _bind_model_methods(wrapper: ORTModule) -> None:
    """Bind the model's own methods to the wrapper, as upstream's ORTModule does, so that one calling ``self(...)``
    (``model.run_forward(x)``, ``generate``) runs the forward in ONNX Runtime, not in PyTorch.

    Own methods are the plain functions of the model's classes (mixins included) that ``torch.nn.Module`` does not
    define. Left to fall through to the model: names the wrapper has (``forward``, ``state_dict``, ``module``: the
    wrapper's win), dunders, and methods using zero-argument ``super()``, which needs ``self`` to be the model's class.
    """
    model = wrapper._original_module
    seen: set[str] = set()
    for cls in type(model).__mro__:
        if cls in (torch.nn.Module, object):
            continue
        for name, value in vars(cls).items():
            if name in seen:
                continue
            seen.add(name)
            if not isinstance(value, types.FunctionType) or name.startswith("__") or hasattr(type(wrapper), name):
                continue
            if "__class__" in value.__code__.co_freevars:  # zero-argument super()
                continue
            if name in vars(model):  # an instance attribute of that name shadows the method on the model
                continue
            wrapper.__dict__[name] = types.MethodType(value, wrapper)


@functools.cache
def _wrapper_class(model_class: type) -> type[ORTModule]:
    """An ORTModule subclass whose class-level ``forward`` has the model class's signature.

    Tools read signatures from the class, not the instance: Hugging Face's Trainer finds label names with
    ``inspect.signature(type(model).forward)`` and selects dataset columns from ``model.forward``.
    """
    try:
        signature = inspect.signature(model_class.forward)
    except (TypeError, ValueError):
        return ORTModule

    def forward(self: ORTModule, *args: Any, **kwargs: Any) -> Any:
        return self._run(args, kwargs)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__ = model_class.forward.__doc__
    name = f"ORTModule[{model_class.__name__}]"
    return type(name, (ORTModule,), {"forward": forward, "__module__": __name__, "__qualname__": name})


def _new_wrapper(model_class: type) -> ORTModule:
    """Unpickling: an empty instance of the wrapper class, filled by ``__setstate__``."""
    return torch.nn.Module.__new__(_wrapper_class(model_class))
