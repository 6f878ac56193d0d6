"""Run custom ``torch.autograd.Function`` s inside ONNX Runtime's graph by calling back into PyTorch.

Every Function the model calls (on the TorchScript route, except those with their own ``symbolic``, which export
themselves) is exported as one ``com.microsoft::PythonOp`` node. When ORT reaches that node it calls back into the
Function's ``apply`` with the node's inputs (zero-copy through DLPack) and the non-tensor arguments recorded at
export; ORT's gradient graph gets a ``PythonOpGrad`` node that runs the Function's ``backward`` through PyTorch's
autograd engine, so ``ctx.save_for_backward``, ``needs_input_grad``, ``mark_non_differentiable``, ``mark_dirty`` and
``set_materialize_grads`` behave as in PyTorch. The runners ORT calls are ``ctypes`` callbacks
(:mod:`ortcore_plugins.services.python_op`): no compiler is needed.

Both exporters write the same node. The TorchScript route exports the traced ``prim::PythonOp`` through its
symbolic (:meth:`PythonOpHandler.export`). On the dynamo route ``torch.export`` would inline the Function's forward;
instead each call is recorded as one ``ortcore_pyop::apply(call, tensors, sizes)`` op
(:meth:`PythonOpHandler.dynamo_apply`), whose fake kernel runs the forward on fake tensors for the outputs' (symbolic)
shapes and whose onnxscript translation (``ortcore_export_translations``) writes the PythonOp node; sizes of dynamic
dimensions passed to a Function become int64 inputs of the node, so batch and sequence changes need no re-export.

Options (``[plugins.autograd_function]`` in ortcore.toml, or the environment):

- ``enable_custom_autograd`` (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``, default on; the older
  ``ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1`` turns it off too): off traces through every Function instead;
- ``skipped_functions`` (``ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS``, comma-separated fully qualified class names):
  these are traced through;
- ``allow_checkpoint`` (``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT``): what ``torch.utils.checkpoint``'s reentrant
  ``CheckpointFunction`` becomes. ``region`` (the default, and ``1``): the checkpointed function runs in PyTorch as
  one PythonOp node with recomputation (:mod:`.checkpoint`); ``0``: refused, naming the switch; ``inline``: traced
  through, its layers exported into the graph (no recomputation unless the memory_recompute plugin's).

The plugin is split by route, so that dropping an exporter means deleting its module: :mod:`.shared` (the PythonOp
node's attributes, the output dimensions matched to input ones, the output-shape and inference-mode graph passes),
:mod:`.torchscript` (the ``prim::PythonOp`` export) and :mod:`.dynamo` (the recorded calls, their op and its
translation); this module holds the options, the handlers and the hooks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import attrs
import torch

from ortcore.api import (
    INLINE,
    Config,
    GraphPass,
    OptionError,
    UnsupportedModelError,
    hookimpl,
    option,
    parse_bool,
)
from ortcore_plugins.services.autograd_functions import function_name, python_op_symbolic

from .checkpoint import (
    TORCH_CHECKPOINT_FUNCTION,
    checkpoint_region,
    checkpoints_run_directly,
    describe_regions,
    export_origin,
)
from .dynamo import _function_call_op, apply_function_call, translate_function_call
from .shared import _has_python_op, inference_mode_pass, relate_output_shapes
from .torchscript import export_python_op

logger = logging.getLogger("ortcore.autograd_function")

NAME = "autograd_function"
SHAPES_PASS = "autograd_function.output_shapes"
INFERENCE_PASS = "autograd_function.inference_mode"
REGIONS_PASS = "autograd_function.checkpoint_regions"
# Reentrant activation checkpointing: its forward runs the checkpointed layers in PyTorch, out of ORT's sight.
CHECKPOINT_FUNCTIONS = ("torch.utils.checkpoint.CheckpointFunction", "deepspeed.checkpointing.CheckpointFunction")
CHECKPOINT_MODES = ("region", "inline", "refuse")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_<>][\w<>]*)*$")


# -- options --------------------------------------------------------------------------------------------------------
def parse_function_names(value: object, source: str) -> tuple[str, ...]:
    """Fully qualified Function class names: a list, or one comma-separated string (``""`` names none)."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value if v.strip()]
    else:
        raise OptionError(
            f"{source}={value!r} must be a list of fully qualified autograd Function class names (or one "
            "comma-separated string), e.g. 'my_pkg.ops.FusedGelu'"
        )
    for item in items:
        if not _QUALIFIED_NAME.match(item) or "." not in item:
            raise OptionError(
                f"{source}={value!r}: {item!r} is not a fully qualified class name; allowed: 'module.ClassName' "
                "names separated by commas, e.g. 'my_pkg.ops.FusedGelu'"
            )
    return tuple(dict.fromkeys(items))


def parse_checkpoint_mode(value: object, source: str) -> str:
    """``region``, ``inline`` or ``refuse``; a boolean as the older switch meant it (1: allowed, as a PythonOp that
    PyTorch runs, which is ``region``; 0: refused)."""
    text = str(value).strip().lower() if not isinstance(value, bool) else ("1" if value else "0")
    if text in CHECKPOINT_MODES:
        return text
    if text in ("1", "true", "yes", "on"):
        return "region"
    if text in ("0", "false", "no", "off"):
        return "refuse"
    raise OptionError(
        f"{source}={value!r} is not a checkpoint mode; allowed: region or 1 (the checkpointed function runs in PyTorch "
        "with recomputation, the default), inline (its layers exported into the graph, no recomputation), refuse or "
        "0 (an error naming this switch)"
    )


@attrs.frozen
class AutogradFunctionOptions:
    enable_custom_autograd: bool = option(
        True,
        parse_bool,
        "run custom autograd Functions as PythonOp (off: trace through them)",
        "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD",
    )
    disable_custom_autograd_support: bool = option(
        False,
        parse_bool,
        "older spelling: 1 traces through custom autograd Functions",
        "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT",
    )
    skipped_functions: tuple[str, ...] = option(
        (),
        parse_function_names,
        "Functions traced through instead (fully qualified names, comma-separated)",
        "ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS",
    )
    allow_checkpoint: str = option(
        "region",
        parse_checkpoint_mode,
        "reentrant torch.utils.checkpoint: region/1 (runs in PyTorch, recomputed in backward), inline (exported "
        "into the graph), refuse/0",
        "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT",
    )

    @property
    def python_op(self) -> bool:
        """Whether Functions run as PythonOp (both switches agree)."""
        return self.enable_custom_autograd and not self.disable_custom_autograd_support


def _options(config: Config) -> AutogradFunctionOptions:
    return config.plugin_options(NAME) or AutogradFunctionOptions()


# -- the handlers ---------------------------------------------------------------------------------------------------
class CheckpointRefusal:
    """Refuses reentrant activation checkpointing, explaining the switch (``explicit``: the user's ``0``) or, for a
    checkpointing Function other than torch's, what runs it."""

    def __init__(self, name: str, explicit: bool = True):
        self.name, self.explicit = name, explicit

    def export(self, g, node, args):
        self.check()

    def check(self) -> None:
        if self.explicit:
            raise UnsupportedModelError(
                f"the model uses activation checkpointing through {self.name} (torch.utils.checkpoint with "
                "use_reentrant=True), and ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=0 (or [plugins.autograd_function] "
                "allow_checkpoint = false) refuses it. Unset it (or set it to 1) to run the checkpointed function in "
                "PyTorch with recomputation, set it to 'inline' to export the checkpointed layers into the graph (no "
                "recomputation: use the memory_recompute plugin, ORTMODULE_MEMORY_OPT_LEVEL=1, for that), or call "
                "checkpoint with use_reentrant=False"
            )
        raise UnsupportedModelError(
            f"the model uses activation checkpointing through {self.name}, which ortcore runs only traced through: "
            "set ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=inline (or [plugins.autograd_function] allow_checkpoint = "
            "'inline') to export the checkpointed layers into the graph (recomputation by the memory_recompute "
            "plugin, ORTMODULE_MEMORY_OPT_LEVEL=1), or checkpoint with torch.utils.checkpoint"
        )


class CheckpointRegionHandler:
    """Reentrant activation checkpointing as a recompute region (:mod:`.checkpoint`): while tracing, the call is
    replaced by one :class:`~.checkpoint.CheckpointRegion` call, which this plugin exports as PythonOp."""

    def __init__(self, name: str):
        self.name = name

    def replace_call(self, args: tuple, kwargs: dict) -> Any:
        return checkpoint_region(args, kwargs)

    def dynamo_apply(self, function: type, apply: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return checkpoint_region(args, kwargs)

    def export(self, g, node, args):
        raise UnsupportedModelError(
            f"{self.name} reached the exporter as a call: it is replaced by a checkpoint region only while the "
            "model is traced by ortcore's exporters"
        )


class PythonOpHandler:
    """Exports one Function class as ``com.microsoft::PythonOp``; ORT runs it through the PythonOp service
    (:mod:`ortcore_plugins.services.python_op`). One handler serves both exporters, each route's work being in its
    own module (:func:`.torchscript.export_python_op`, :func:`.dynamo.apply_function_call`), so that dropping an
    exporter means deleting its module and its method here."""

    def __init__(self, function: type):
        self.function = function

    def traces_through(self, args: tuple) -> bool:
        """A call that receives a module is traced through: its parameters must get their gradients in the model
        itself, and the Function would only see the exported copy's (Reformer's reversible layers, say)."""
        modules = [a for a in args if isinstance(a, torch.nn.Module) and any(True for _ in a.parameters())]
        if modules:
            logger.info(
                "%s receives %s with parameters: traced through",
                function_name(self.function),
                type(modules[0]).__name__,
            )
        return bool(modules)

    def export(self, g, node, args):
        return export_python_op(self.function, g, node, args)

    def dynamo_apply(self, function: type, apply: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return apply_function_call(function, apply, args, kwargs)


def handler_for(config: Config, function: type) -> Any:
    """The plugin's answer for one Function class (see :func:`ortcore_autograd_function_handler`)."""
    options = _options(config)
    name = function_name(function)
    if name in options.skipped_functions:
        return INLINE
    if name in CHECKPOINT_FUNCTIONS:
        return _checkpoint_handler(options, name)
    if not options.python_op:
        return INLINE
    return PythonOpHandler(function)


_warned: set[str] = set()


def _checkpoint_handler(options: AutogradFunctionOptions, name: str) -> Any:
    mode = options.allow_checkpoint
    if mode == "inline":
        return INLINE
    if mode == "refuse":
        return CheckpointRefusal(name)
    if name != TORCH_CHECKPOINT_FUNCTION:  # DeepSpeed's: another signature and its own partitioning
        return CheckpointRefusal(name, explicit=False)
    if not options.python_op:
        if "python_op" not in _warned:
            _warned.add("python_op")
            logger.warning(
                "custom autograd Functions are traced through (ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0), so reentrant "
                "checkpointing is too: the checkpointed layers run in ORT without recomputation"
            )
        return INLINE
    return CheckpointRegionHandler(name)


# -- hooks ----------------------------------------------------------------------------------------------------------
@hookimpl
def ortcore_options_class() -> type:
    return AutogradFunctionOptions


@hookimpl
def ortcore_configure(config: Config) -> None:
    options = _options(config)
    explicit = config.env.get("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "") != ""
    if explicit and options.enable_custom_autograd and options.disable_custom_autograd_support:
        raise OptionError(
            "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=1 and ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1 contradict each other; "
            "set only ORTMODULE_ENABLE_CUSTOM_AUTOGRAD (0 or 1)"
        )


@hookimpl
def ortcore_autograd_function_handler(config: Config, function: type) -> Any:
    """:data:`ortcore.api.INLINE` (trace through), a checkpoint refusal, or a PythonOp handler."""
    return handler_for(config, function)


@hookimpl
def ortcore_export_symbolics(config: Config) -> dict[str, Any]:
    return {"prim::PythonOp": python_op_symbolic(lambda function: handler_for(config, function))}


@hookimpl
def ortcore_export_translations(config: Config) -> dict[Any, Any]:
    """The dynamo route's PythonOp: the translation of the op each Function call is recorded as."""
    return {_function_call_op(): translate_function_call} if _options(config).python_op else {}


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    if not _options(config).python_op:
        return []
    return [GraphPass(SHAPES_PASS, run=relate_output_shapes), GraphPass(REGIONS_PASS, run=describe_regions)]


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    options = _options(config)
    return {
        "autograd_function.python_op": options.python_op,
        "autograd_function.skipped": sorted(options.skipped_functions),
        "autograd_function.allow_checkpoint": options.allow_checkpoint,
    }


@hookimpl
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any:
    """Checkpoint regions find the user's tensors behind the traced copy's (:func:`.checkpoint.export_origin`)."""
    options = _options(config)
    return export_origin(module) if options.allow_checkpoint == "region" and options.python_op else None


@hookimpl(wrapper=True)
def ortcore_check_first_step(config: Config, step: Any):
    """The first-step check (the gradient audit) differentiates the model in PyTorch with ``torch.autograd.grad``,
    which PyTorch's reentrant checkpoint refuses: there, checkpointed functions run directly (same values)."""
    if _options(config).allow_checkpoint == "refuse":
        return (yield)
    with checkpoints_run_directly():
        return (yield)


@hookimpl(wrapper=True)
def ortcore_load_export(config: Config, module: Any, fingerprint: str):
    """A graph with PythonOp nodes is never taken from an export cache: its nodes name Functions registered, and
    objects passed by address, in the process that exported it."""
    graph = yield
    if graph is not None and _has_python_op(graph.model):
        logger.info("a cached graph of %s runs custom autograd Functions: exported again", type(module).__name__)
        return None
    return graph


@hookimpl
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(INFERENCE_PASS, run=inference_mode_pass)]
