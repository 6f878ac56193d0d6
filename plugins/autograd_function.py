"""Run custom ``torch.autograd.Function`` s inside ONNX Runtime's graph by calling back into PyTorch.

Every Function the model calls (except those with their own ``symbolic``, which export themselves) is exported as
one ``com.microsoft::PythonOp`` node. When ORT reaches that node it calls back into the Function's ``apply`` with
the node's inputs (zero-copy through DLPack) and the non-tensor arguments recorded at export; ORT's gradient graph
gets a ``PythonOpGrad`` node that runs the Function's ``backward`` through PyTorch's autograd engine, so
``ctx.save_for_backward``, ``needs_input_grad``, ``mark_non_differentiable``, ``mark_dirty`` and
``set_materialize_grads`` behave as in PyTorch. The runners ORT calls are ``ctypes`` callbacks
(:mod:`ortcore_plugins._pythonop_runner`): no compiler is needed.

Options (``[plugins.autograd_function]`` in ortcore.toml, or the environment):

- ``enable_custom_autograd`` (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``, default on; the older
  ``ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1`` turns it off too): off traces through every Function instead;
- ``skipped_functions`` (``ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS``, comma-separated fully qualified class names):
  these are traced through;
- ``allow_checkpoint`` (``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT``, default off): ``torch.utils.checkpoint``'s
  reentrant ``CheckpointFunction`` is refused unless set, and then traced through.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
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

from . import _pythonop_runner as runner

logger = logging.getLogger("ortcore.autograd_function")

NAME = "autograd_function"
PYTHON_OP_DOMAIN = "com.microsoft"
PYTHON_OP = "PythonOp"
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


class _Registry:
    """Function classes by the ``func_name`` their PythonOp nodes carry, and the non-tensor arguments kept alive."""

    def __init__(self):
        self.functions: dict[str, type] = {}
        self.keys: dict[tuple[type, tuple[int, ...]], str] = {}
        self.bool_inputs: dict[str, frozenset[int]] = {}
        self.constants: dict[int, Any] = {}
        self.lock = threading.Lock()

    def key(self, function: type, bool_inputs: tuple[int, ...] = ()) -> str:
        """The node name of ``function`` called with boolean tensors at argument positions ``bool_inputs``
        (DLPack hands ORT's booleans over as uint8: the runner casts them back)."""
        with self.lock:
            if (function, bool_inputs) in self.keys:
                return self.keys[(function, bool_inputs)]
            base = function_name(function)
            key = base
            for n in itertools.count(2):  # two local classes may share a qualified name
                if key not in self.functions:
                    break
                key = f"{base}#{n}"
            self.functions[key], self.keys[(function, bool_inputs)] = function, key
            self.bool_inputs[key] = frozenset(bool_inputs)
        from onnxruntime.capi import _pybind_state as C

        C.register_torch_autograd_function(key, function)
        return key

    def keep(self, value: Any) -> int:
        with self.lock:
            self.constants[id(value)] = value  # the graph refers to it by address for as long as the process lives
        return id(value)


registry = _Registry()


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
    """Exports one Function class as ``com.microsoft::PythonOp``; ORT runs it through :mod:`._pythonop_runner`."""

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
class _Context:
    """What one PythonOp call keeps for its PythonOpGrad: ORT holds it as the node's context output."""

    __slots__ = ("function", "leaves", "outputs")

    def __init__(self, function: type, leaves: list, outputs: list):
        self.function, self.leaves, self.outputs = function, leaves, outputs


# ORT checks a context's reference count right after the forward runner returns (safe run mode wants >= 2): the
# thread's last context is held here until its next runner call.
_held = threading.local()


def held_contexts() -> list[_Context]:
    """The contexts this thread holds for ORT's reference-count check (at most the last forward's)."""
    if not hasattr(_held, "contexts"):
        _held.contexts = []
    return _held.contexts


def _forward(func_name: str, requires_grad: list, tensor_flags: list, training: bool, _inplace, _safe, args: list):
    held_contexts().clear()
    function = registry.functions[func_name]
    bool_inputs = registry.bool_inputs[func_name]
    leaves: list[torch.Tensor | None] = []
    call_args = []
    for position, (arg, is_tensor, wants_grad) in enumerate(zip(args, tensor_flags, requires_grad)):
        if not is_tensor or arg is None:
            call_args.append(arg)
            leaves.append(None)
            continue
        tensor = runner.from_capsule(arg)
        if position in bool_inputs:
            tensor = tensor.view(torch.bool)
        leaf = tensor.detach().requires_grad_(bool(wants_grad) and training and tensor.is_floating_point())
        # A copy per call: the Function may modify it in place (mark_dirty) or save it, and ORT owns the original.
        with torch.set_grad_enabled(leaf.requires_grad):
            call_args.append(leaf.clone())
        leaves.append(leaf)
    with torch.set_grad_enabled(training):
        result = function.apply(*call_args)
    outputs = [result] if isinstance(result, torch.Tensor) else [r for r in result if isinstance(r, torch.Tensor)]
    saved: set[int] = set()
    grad_fn = next((o.grad_fn for o in outputs if o.grad_fn is not None), None)
    if grad_fn is not None and hasattr(grad_fn, "saved_tensors"):
        saved = {t.untyped_storage().data_ptr() for t in grad_fn.saved_tensors if t is not None}
    # An output the Function saved goes to ORT as a copy, so that nothing ORT does to its buffer reaches backward.
    capsules = [
        runner.to_capsule(o.detach().clone() if o.untyped_storage().data_ptr() in saved else o) for o in outputs
    ]
    if not training:
        return [None, *capsules]
    context = _Context(function, leaves, outputs)
    held_contexts().append(context)
    return [context, *capsules]


def _backward(func_name: str, _requires_grad, tensor_flags: list, _training, _inplace, _safe, args: list):
    held_contexts().clear()
    context = args[0]
    if not isinstance(context, _Context):
        raise RuntimeError(f"PythonOpGrad of {func_name} received no forward context (got {type(context).__name__})")
    grads = [runner.from_capsule(a) if a is not None else None for a in args[1:]]
    pairs = [(o, g) for o, g in zip(context.outputs, grads) if g is not None and o.requires_grad]
    wanted = [i for i, leaf in enumerate(context.leaves) if leaf is not None and leaf.requires_grad]
    computed: tuple = ()
    if pairs and wanted:
        computed = torch.autograd.grad(
            [o for o, _ in pairs], [context.leaves[i] for i in wanted], [g for _, g in pairs], allow_unused=True
        )
    results: list[Any] = [None] * len(context.leaves)
    for i, grad in itertools.zip_longest(wanted, computed):
        leaf = context.leaves[i]
        results[i] = runner.to_capsule(grad if grad is not None else torch.zeros_like(leaf))
    context.leaves = context.outputs = None  # ORT releases the context itself after this call
    return results


def install_runners() -> None:
    """Register ortcore's PythonOp runners with ORT (idempotent); plugins that add PythonOp nodes call this."""
    try:
        runner.install(_forward, _backward)
    except runner.RunnerUnavailableError as e:
        raise UnsupportedModelError(str(e)) from e


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
