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
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import onnx
import torch

from ortcore.api import (
    INLINE,
    Config,
    GraphPass,
    OptionError,
    PassContext,
    UnsupportedModelError,
    hookimpl,
    option,
    parse_bool,
)
from ortcore_plugins.services.autograd_functions import function_name, python_op_symbolic
from ortcore_plugins.services.python_op import (
    PYTHON_OP,
    PYTHON_OP_DOMAIN,
    install_runners,
    python_op_node,
    registry,
)

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


def _dim_sources(shapes: list[list], output_shapes: list[list]) -> list[list]:
    """For each output dimension, the ``[tensor input, dimension]`` with the same size (the same position first, then
    the same position from the end, then any), or None; sizes are ints, symbols (the dynamo route's), or None
    (unknown). The graph pass gives the output that input's (symbolic) dimension, so that ORT's gradient builder sees
    which dimensions agree."""
    sources = []
    for sizes in output_shapes:
        dims = []
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


def python_op_attributes(
    key: str,
    convention: str,
    constants: list,
    input_types: list[int],
    input_ranks: list[int],
    output_types: list[int],
    output_ranks: list[int],
    dims: list[list],
) -> dict[str, str | int | list[int]]:
    """The PythonOp node's attributes, the same on both routes: ``constants`` are the non-tensor arguments in order
    (``convention`` has a ``c`` for each): ints, bools and tuples of them by value, any other object (a float: ORT's
    float attributes are float32; None, a string) by reference."""
    values: dict[str, list] = {}

    def add(kind: str, position: int, items: list) -> None:
        values.setdefault(f"input_{kind}_positions", []).append(position)
        if kind.endswith("tuple"):
            values.setdefault(f"input_{kind}_begins", []).append(len(values.get(f"input_{kind}s", [])))
        values.setdefault(f"input_{kind}s", []).extend(items)

    positions = [i for i, kind in enumerate(convention) if kind != "d"]
    for position, arg in zip(positions, constants):
        if isinstance(arg, bool):  # before int: bool is an int
            add("bool_scalar", position, [int(arg)])
        elif isinstance(arg, int):
            add("int_scalar", position, [arg])
        elif isinstance(arg, tuple) and arg and all(isinstance(v, bool) for v in arg):
            add("bool_tuple", position, [int(v) for v in arg])
        elif isinstance(arg, tuple) and arg and all(isinstance(v, int) and not isinstance(v, bool) for v in arg):
            add("int_tuple", position, list(arg))
        else:
            add("pointer_scalar", position, [registry.keep(arg)])
    return {
        "func_name": key,
        "input_convention": convention,
        "input_tensor_types": input_types,
        "input_tensor_ranks": input_ranks,
        # Boolean outputs leave the node as uint8 (ORT's DLPack import has no boolean) and are cast back.
        "output_tensor_types": [onnx.TensorProto.UINT8 if t == BOOL else t for t in output_types],
        "output_tensor_ranks": output_ranks,
        "training_mode": 1,  # inference graphs get 0 (see inference_mode_pass)
        "safe_run_mode": 1,  # the runner keeps a second reference to each context
        "comment": json.dumps({"dims": dims}),
        **values,
    }


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
        if len(convention) != len(args):
            raise UnsupportedModelError(
                f"{function_name(self.function)}: {len(args)} arguments but calling convention {convention!r}"
            )
        tensors = [arg for arg, kind in zip(args, convention) if kind == "d"]
        types = [_onnx_dtype(arg) for arg in tensors]
        bool_inputs = tuple(i for i, kind in enumerate(convention) if kind == "d" and _onnx_dtype(args[i]) == BOOL)
        outputs = list(node.outputs())
        attributes = python_op_attributes(
            registry.key(self.function, bool_inputs),
            convention,
            [a for a, kind in zip(args, convention) if kind != "d"],
            types,
            [arg.type().dim() or 0 for arg in tensors],
            [_onnx_dtype(o) for o in outputs],
            [o.type().dim() or 0 for o in outputs],
            _dim_sources([_sizes(v) for v in node.inputs()], [_sizes(o) for o in outputs]),
        )
        typed = {f"{name}_s" if isinstance(value, str) else f"{name}_i": value for name, value in attributes.items()}
        results = g.op(f"{PYTHON_OP_DOMAIN}::{PYTHON_OP}", *tensors, outputs=len(outputs) + 1, **typed)
        results[0].setType(torch._C.TensorType.get().with_dtype(torch.int64))
        values = []
        for result, output in zip(results[1:], outputs):
            if _onnx_dtype(output) == BOOL:
                result.setType(output.type().with_dtype(torch.uint8))
                result = g.op("Cast", result, to_i=BOOL)
            result.setType(output.type())
            values.append(result)
        return values if len(values) > 1 else values[0]

    def dynamo_apply(self, function: type, apply: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The dynamo route: record this call in the program being exported as one ``ortcore_pyop::apply`` op,
        whose translation (:func:`translate_function_call`) writes the PythonOp node; returns the traced outputs."""
        if _forward_running():  # a Function called inside another's forward while its output shapes are computed
            return apply(function, *args, **kwargs)
        install_runners()
        arguments = _positional(function, args, kwargs)
        call = FunctionCall.record(function, apply, arguments)
        tensors = [arguments[i] for i in call.tensor_positions]
        sizes = [arguments[i] for i in call.size_positions]
        outputs = list(_function_call_op()(call.index, tensors, sizes))
        call.describe(tensors, sizes, outputs)
        return call.result(outputs)


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


# -- the dynamo route -----------------------------------------------------------------------------------------------
# torch.export would inline a Function's forward; each call is recorded instead as one op of this namespace, taking
# the call's index and its tensor arguments, whose translation writes the PythonOp node the TorchScript route writes.
OP_NAMESPACE = "ortcore_pyop"
_ONNX_DTYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
    torch.complex64: onnx.TensorProto.COMPLEX64,
    torch.complex128: onnx.TensorProto.COMPLEX128,
}
_TENSOR = object()  # marks a tensor output in a call's output structure


def _onnx_dtype_of(dtype: torch.dtype, function: type) -> int:
    try:
        return _ONNX_DTYPES[dtype]
    except KeyError:
        raise UnsupportedModelError(
            f"{function_name(function)} takes or returns a {dtype} tensor, which a PythonOp cannot carry; allowed: "
            f"{', '.join(sorted(str(d) for d in _ONNX_DTYPES))}"
        ) from None


def _symbolic_size(size: Any) -> int | str:
    """A dimension as :func:`_dim_sources` compares it: an int, or the symbol's expression (compared without
    adding a guard to the export)."""
    if isinstance(size, torch.SymInt):
        expr = size.node.expr
        return int(expr) if expr.is_number else str(expr)
    return int(size)


def _positional(function: type, args: tuple, kwargs: dict) -> tuple:
    """The call's arguments in ``forward``'s order, as ``Function.apply`` binds them (with defaults filled in for
    Functions with a ``setup_context``)."""
    setup_context = torch.autograd.function._is_setup_context_defined(function.setup_context)
    if not kwargs and not setup_context:
        return tuple(args)
    signature = inspect.signature(function.forward)
    if not setup_context:  # forward(ctx, ...): bind past the context
        bound = signature.bind(None, *args, **kwargs)
        return tuple(bound.args[1:])
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.args)


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.SymInt)


_running = threading.local()


def _forward_running() -> bool:
    return getattr(_running, "depth", 0) > 0


@attrs.define(eq=False)
class FunctionCall:
    """One Function call the dynamo route recorded: what the ``ortcore_pyop::apply`` op's shape function and its
    translation need, found by the op's ``call`` argument (calls stay recorded for the life of the process, as the
    objects PythonOp nodes refer to do)."""

    index: int
    function: type
    apply: Callable[..., Any]  # torch's own Function.apply
    arguments: tuple  # the tensor arguments are replaced by the op's at each use
    tensor_positions: tuple[int, ...]
    # Ints that are sizes of dynamic dimensions (SymInts while tracing): int64 scalar inputs of the node.
    size_positions: tuple[int, ...]
    attributes: dict[str, Any] = attrs.field(factory=dict)
    bool_outputs: tuple[int, ...] = ()
    structure: tuple | None = None  # the forward's result: None for one tensor, else its items (_TENSOR for tensors)

    calls: ClassVar[list[FunctionCall]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def record(cls, function: type, apply: Callable[..., Any], arguments: tuple) -> FunctionCall:
        positions = tuple(i for i, a in enumerate(arguments) if isinstance(a, torch.Tensor))
        for i, arg in enumerate(arguments):
            if i not in positions and any(isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(arg)):
                raise UnsupportedModelError(
                    f"{function_name(function)} receives tensors inside argument {i} ({type(arg).__name__}): a "
                    "PythonOp takes tensors only as arguments of their own; pass them as separate arguments, or skip "
                    "the Function (ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS) to trace through it"
                )
            if isinstance(arg, torch.SymFloat | torch.SymBool):
                raise UnsupportedModelError(
                    f"{function_name(function)} receives a value computed from a dynamic dimension as argument {i} "
                    f"({arg}, a {type(arg).__name__}): a PythonOp takes such values only as ints. Pass an int or a "
                    "tensor, or skip the Function (ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS) to trace through it"
                )
        sizes = tuple(i for i, a in enumerate(arguments) if isinstance(a, torch.SymInt))
        stored = tuple(None if i in positions or i in sizes else a for i, a in enumerate(arguments))
        with cls.lock:
            call = cls(len(cls.calls), function, apply, stored, positions, sizes)
            cls.calls.append(call)
        return call

    def run(self, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        """The Function's forward on copies of ``tensors`` (fake ones while exporting: that gives the outputs'
        shapes), without autograd; nested Function calls run as plain ``apply``."""
        arguments = list(self.arguments)
        for position, tensor in zip(self.tensor_positions, tensors):
            arguments[position] = tensor.clone()  # the op must not change its inputs (mark_dirty)
        for position, size in zip(self.size_positions, sizes):
            arguments[position] = size
        mode = torch._guards.detect_fake_mode(tensors) if tensors else None
        shape_env = getattr(mode, "shape_env", None)
        fresh = len(shape_env.pending_fresh_unbacked_symbols) if shape_env is not None else 0
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            with torch.no_grad():
                result = self.apply(self.function, *arguments)
        finally:
            _running.depth -= 1
        items = (result,) if isinstance(result, torch.Tensor) else tuple(result)
        self.structure = (
            None
            if isinstance(result, torch.Tensor)
            else tuple(_TENSOR if isinstance(r, torch.Tensor) else r for r in items)
        )
        # Fresh outputs: an op's outputs may not alias its inputs or each other.
        outputs = [r.clone(memory_format=torch.contiguous_format) for r in items if isinstance(r, torch.Tensor)]
        if shape_env is not None:
            from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

            # Values the forward read from its tensors (``.item()``) are symbols of the shape computation only; the
            # ones no output's shape depends on are not outputs of the op (torch.export would ask where they go).
            used = free_unbacked_symbols(outputs)
            pending = shape_env.pending_fresh_unbacked_symbols
            pending[fresh:] = [symbol for symbol in pending[fresh:] if symbol in used]
        return outputs

    def describe(self, tensors: list[torch.Tensor], sizes: list[torch.SymInt], outputs: list[torch.Tensor]) -> None:
        """The node's attributes, from the traced inputs and outputs."""
        function = self.function
        inputs = self.node_inputs(tensors, sizes)
        as_inputs = {*self.tensor_positions, *self.size_positions}
        bool_inputs = tuple(p for p, t in zip(self.tensor_positions, tensors) if t.dtype == torch.bool)
        self.bool_outputs = tuple(k for k, o in enumerate(outputs) if o.dtype == torch.bool)
        self.attributes = python_op_attributes(
            registry.key(function, bool_inputs, self.size_positions),
            "".join("d" if p in as_inputs else "c" for p in range(len(self.arguments))),
            [a for p, a in enumerate(self.arguments) if p not in as_inputs],
            [onnx.TensorProto.INT64 if _is_size(v) else _onnx_dtype_of(v.dtype, function) for v in inputs],
            [0 if _is_size(v) else v.dim() for v in inputs],
            [_onnx_dtype_of(o.dtype, function) for o in outputs],
            [o.dim() for o in outputs],
            _dim_sources(
                [[] if _is_size(v) else [_symbolic_size(d) for d in v.shape] for v in inputs],
                [[_symbolic_size(d) for d in o.shape] for o in outputs],
            ),
        )

    def node_inputs(self, tensors: list, sizes: list) -> list:
        """The node's inputs in argument order: the tensors and the sizes (as int64 scalars) interleaved."""
        at = dict(zip(self.tensor_positions, tensors)) | dict(zip(self.size_positions, sizes))
        return [at[p] for p in sorted(at)]

    def result(self, outputs: list[torch.Tensor]) -> Any:
        """What ``apply`` returns, the op's outputs in the forward's result structure."""
        if self.structure is None:
            return outputs[0]
        found = iter(outputs)
        return tuple(next(found) if item is _TENSOR else item for item in self.structure)


def _run_function_call(call: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    return FunctionCall.calls[call].run(tensors, sizes)


_library: Any = None


def _function_call_op() -> Any:
    """``ortcore_pyop::apply(int call, Tensor[] tensors, SymInt[] sizes) -> Tensor[]``, defined once per process:
    its kernel (also its fake, shape-only, kernel) runs the recorded call's forward in PyTorch."""
    global _library
    with FunctionCall.lock:
        if _library is None:
            library = torch.library.Library(OP_NAMESPACE, "DEF")
            library.define("apply(int call, Tensor[] tensors, SymInt[] sizes) -> Tensor[]")
            library.impl("apply", _run_function_call, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{OP_NAMESPACE}::apply", _run_function_call, lib=library)
            _library = library
    return torch.ops.ortcore_pyop.apply.default


def translate_function_call(call: int, tensors: list, sizes: list) -> list:
    """The onnxscript translation of ``ortcore_pyop::apply``: the call's PythonOp node (see
    :func:`python_op_attributes`), its boolean outputs cast back from uint8."""
    from onnxscript import opset18

    recorded = FunctionCall.calls[call]
    scalars = [opset18.Reshape(s, opset18.Constant(value_ints=[])) for s in sizes]  # int64 scalars
    inputs = recorded.node_inputs(list(tensors), scalars)
    outputs = python_op_node(inputs, recorded.attributes, len(recorded.attributes["output_tensor_types"]))
    return [
        opset18.Cast(value, to=BOOL) if k in recorded.bool_outputs else value for k, value in enumerate(outputs[1:])
    ]


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
