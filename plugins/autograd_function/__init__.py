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
- ``allow_checkpoint`` (``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT``, default off): ``torch.utils.checkpoint``'s
  reentrant ``CheckpointFunction`` is refused unless set, and then traced through.

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

from .dynamo import _function_call_op, apply_function_call, translate_function_call
from .shared import _has_python_op, inference_mode_pass, relate_output_shapes
from .torchscript import export_python_op

logger = logging.getLogger("ortcore.autograd_function")

NAME = "autograd_function"
SHAPES_PASS = "autograd_function.output_shapes"
INFERENCE_PASS = "autograd_function.inference_mode"
# Reentrant activation checkpointing: its forward runs the checkpointed layers in PyTorch, out of ORT's sight.
CHECKPOINT_FUNCTIONS = ("torch.utils.checkpoint.CheckpointFunction", "deepspeed.checkpointing.CheckpointFunction")
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
    allow_checkpoint: bool = option(
        False,
        parse_bool,
        "trace through torch.utils.checkpoint's reentrant CheckpointFunction instead of refusing it",
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
    """Refuses reentrant activation checkpointing, explaining the switch that allows it."""

    def __init__(self, name: str):
        self.name = name

    def export(self, g, node, args):
        self.check()

    def check(self) -> None:
        raise UnsupportedModelError(
            f"the model uses activation checkpointing through {self.name} (torch.utils.checkpoint with "
            "use_reentrant=True), whose forward would run the checkpointed layers in PyTorch outside ONNX Runtime. "
            "Set ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=1 (or [plugins.autograd_function] allow_checkpoint = true) to "
            "export the checkpointed layers into the graph instead (no recomputation: use the memory_recompute "
            "plugin, ORTMODULE_MEMORY_OPT_LEVEL=1, for that), or call checkpoint with use_reentrant=False"
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
        return INLINE if options.allow_checkpoint else CheckpointRefusal(name)
    if not options.python_op:
        return INLINE
    return PythonOpHandler(function)


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
    return [GraphPass(SHAPES_PASS, run=relate_output_shapes)] if _options(config).python_op else []


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    options = _options(config)
    return {
        "autograd_function.python_op": options.python_op,
        "autograd_function.skipped": sorted(options.skipped_functions),
        "autograd_function.allow_checkpoint": options.allow_checkpoint,
    }


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
