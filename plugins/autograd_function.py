"""Run custom ``torch.autograd.Function`` s inside ONNX Runtime's graph by calling back into PyTorch.

Every Function the model calls (except those with their own ``symbolic``, which export themselves) is exported as
one ``com.microsoft::PythonOp`` node. When ORT reaches that node it calls back into the Function's ``apply`` with
the node's inputs (zero-copy through DLPack) and the non-tensor arguments recorded at export; ORT's gradient graph
gets a ``PythonOpGrad`` node that runs the Function's ``backward`` through PyTorch's autograd engine, so
``ctx.save_for_backward``, ``needs_input_grad``, ``mark_non_differentiable``, ``mark_dirty`` and
``set_materialize_grads`` behave as in PyTorch. The runners ORT calls are ``ctypes`` callbacks
(:mod:`ortcore_plugins.services.python_op`): no compiler is needed.

Options (``[plugins.autograd_function]`` in ortcore.toml, or the environment):

- ``enable_custom_autograd`` (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``, default on; the older
  ``ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1`` turns it off too): off traces through every Function instead;
- ``skipped_functions`` (``ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS``, comma-separated fully qualified class names):
  these are traced through;
- ``allow_checkpoint`` (``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT``, default off): ``torch.utils.checkpoint``'s
  reentrant ``CheckpointFunction`` is refused unless set, and then traced through.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import attrs
import onnx
import torch

from ortcore.config import Config, option
from ortcore.errors import OptionError, UnsupportedModelError
from ortcore.exporter import INLINE, function_name, python_op_symbolic
from ortcore.graph_passes import GraphPass, PassContext
from ortcore.hookspecs import hookimpl
from ortcore.options import parse_bool
from ortcore_plugins.services.python_op import PYTHON_OP, PYTHON_OP_DOMAIN, install_runners, registry

logger = logging.getLogger("ortcore.autograd_function")

NAME = "autograd_function"
SHAPES_PASS = "autograd_function.output_shapes"
INFERENCE_PASS = "autograd_function.inference_mode"
BOOL = onnx.TensorProto.BOOL
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


def _onnx_dtype(value) -> int:
    from torch.onnx._internal.torchscript_exporter import _type_utils

    return int(_type_utils.JitScalarType.from_value(value, _type_utils.JitScalarType.UNDEFINED).onnx_type())


def _sizes(value) -> list[int | None]:
    try:
        return list(value.type().sizes() or [])
    except (RuntimeError, AttributeError):  # no shape was recorded
        return []


def _dim_sources(inputs: list, outputs: list) -> list[list]:
    """For each output dimension, the ``[tensor input, dimension]`` with the same traced size (the same position
    first, then the same position from the end, then any), or None: the graph pass gives the output that input's
    (symbolic) dimension, so that ORT's gradient builder sees which dimensions agree."""
    shapes = [_sizes(v) for v in inputs]
    sources = []
    for output in outputs:
        dims = []
        sizes = _sizes(output)
        for k, size in enumerate(sizes):
            found = None
            candidates = [(i, k) for i, s in enumerate(shapes) if k < len(s)]
            candidates += [(i, len(s) - len(sizes) + k) for i, s in enumerate(shapes) if 0 <= len(s) - len(sizes) + k]
            candidates += [(i, j) for i, s in enumerate(shapes) for j in range(len(s))]
            for i, j in candidates:
                if size is not None and shapes[i][j] == size:
                    found = [i, j]
                    break
            dims.append(found)
        sources.append(dims)
    return sources


class PythonOpHandler:
    """Exports one Function class as ``com.microsoft::PythonOp``; ORT runs it through the PythonOp service
    (:mod:`ortcore_plugins.services.python_op`)."""

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
        install_runners()
        convention = node.cconv()
        bool_inputs = tuple(
            i for i, (arg, kind) in enumerate(zip(args, convention)) if kind == "d" and _onnx_dtype(arg) == BOOL
        )
        key = registry.key(self.function, bool_inputs)
        if len(convention) != len(args):
            raise UnsupportedModelError(f"{key}: {len(args)} arguments but calling convention {convention!r}")
        tensors, types, ranks = [], [], []
        constants: dict[str, list] = {}

        def add(kind: str, position: int, values: list) -> None:
            constants.setdefault(f"input_{kind}_positions", []).append(position)
            if kind.endswith("tuple"):
                constants.setdefault(f"input_{kind}_begins", []).append(len(constants.get(f"input_{kind}s", [])))
            constants.setdefault(f"input_{kind}s", []).extend(values)

        for position, (arg, kind) in enumerate(zip(args, convention)):
            if kind == "d":
                tensors.append(arg)
                types.append(_onnx_dtype(arg))
                ranks.append(arg.type().dim() or 0)
            elif isinstance(arg, bool):  # before int: bool is an int
                add("bool_scalar", position, [int(arg)])
            elif isinstance(arg, int):
                add("int_scalar", position, [arg])
            elif isinstance(arg, tuple) and arg and all(isinstance(v, bool) for v in arg):
                add("bool_tuple", position, [int(v) for v in arg])
            elif isinstance(arg, tuple) and arg and all(isinstance(v, int) and not isinstance(v, bool) for v in arg):
                add("int_tuple", position, list(arg))
            else:  # any other object (a float: ORT's float attributes are float32; None, a string) by reference
                add("pointer_scalar", position, [registry.keep(arg)])
        outputs = list(node.outputs())
        attributes: dict[str, Any] = {
            "func_name_s": key,
            "input_convention_s": convention,
            "input_tensor_types_i": types,
            "input_tensor_ranks_i": ranks,
            # Boolean outputs leave the node as uint8 (ORT's DLPack import has no boolean) and are cast back.
            "output_tensor_types_i": [
                onnx.TensorProto.UINT8 if _onnx_dtype(o) == BOOL else _onnx_dtype(o) for o in outputs
            ],
            "output_tensor_ranks_i": [o.type().dim() or 0 for o in outputs],
            "training_mode_i": 1,  # inference graphs get 0 (see inference_mode_pass)
            "safe_run_mode_i": 1,  # the runner keeps a second reference to each context
            "comment_s": json.dumps({"dims": _dim_sources(list(node.inputs()), outputs)}),
        }
        for name, values in constants.items():
            attributes[name + "_i"] = values
        results = g.op(f"{PYTHON_OP_DOMAIN}::{PYTHON_OP}", *tensors, outputs=len(outputs) + 1, **attributes)
        results[0].setType(torch._C.TensorType.get().with_dtype(torch.int64))
        values = []
        for result, output in zip(results[1:], outputs):
            if _onnx_dtype(output) == BOOL:
                result.setType(output.type().with_dtype(torch.uint8))
                result = g.op("Cast", result, to_i=BOOL)
            result.setType(output.type())
            values.append(result)
        return values if len(values) > 1 else values[0]


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


# -- running --------------------------------------------------------------------------------------------------------
def _python_ops(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == PYTHON_OP and n.domain == PYTHON_OP_DOMAIN]


def _comment(node: onnx.NodeProto) -> dict:
    for attribute in node.attribute:
        if attribute.name == "comment":
            try:
                return json.loads(attribute.s.decode())
            except ValueError:
                return {}
    return {}


def relate_output_shapes(model: onnx.ModelProto, _context: PassContext) -> None:
    """Give each PythonOp output the shape its inputs imply: dimension k of an output takes the (symbolic) dimension
    of the input the export matched it to. Without this every output dimension is a fresh symbol, and ORT's gradient
    builder cannot differentiate a broadcast between a PythonOp output and anything else."""
    infos = {v.name: v for v in model.graph.value_info}
    for node in _python_ops(model):  # in graph order: a PythonOp's inputs may come from an earlier one
        sources_of = _comment(node).get("dims")
        if not sources_of:
            continue
        known = {
            v.name: v.type.tensor_type
            for v in (*onnx.shape_inference.infer_shapes(model).graph.value_info, *model.graph.input)
        }
        inputs = list(node.input)
        for output, sources in zip(node.output[1:], sources_of):
            info = infos.get(output)
            if info is None or not info.type.tensor_type.HasField("shape"):
                continue
            for dim, source in zip(info.type.tensor_type.shape.dim, sources):
                if source is None or source[0] >= len(inputs) or inputs[source[0]] not in known:
                    continue
                shape = known[inputs[source[0]]].shape.dim
                if source[1] < len(shape) and (shape[source[1]].dim_param or shape[source[1]].dim_value):
                    dim.CopyFrom(shape[source[1]])


def _has_python_op(model: onnx.ModelProto) -> bool:
    return any(n.op_type == PYTHON_OP and n.domain == PYTHON_OP_DOMAIN for n in model.graph.node)


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
    """:data:`ortcore.exporter.INLINE` (trace through), a checkpoint refusal, or a PythonOp handler."""
    return handler_for(config, function)


@hookimpl
def ortcore_export_symbolics(config: Config) -> dict[str, Any]:
    return {"prim::PythonOp": python_op_symbolic(lambda function: handler_for(config, function))}


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


def inference_mode_pass(model: onnx.ModelProto, graph: Any) -> None:
    """In an inference graph, PythonOps run without autograd and keep no context: ORT runs no PythonOpGrad there."""
    if graph.kind != "inference":
        return
    for node in _python_ops(model):
        for attribute in node.attribute:
            if attribute.name == "training_mode":
                attribute.i = 0


@hookimpl
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(INFERENCE_PASS, run=inference_mode_pass)]
