"""The dynamo route of the plugin: ``torch.export`` would inline a Function's forward (ORT would then differentiate
it, a wrong gradient wherever it and ``backward`` disagree), so each call is recorded as one ``ortcore_pyop::apply``
op whose fake kernel runs the forward for the outputs' (symbolic) shapes and whose onnxscript translation writes the
PythonOp node the TorchScript route writes.

Everything the dynamo exporter alone needs is here: without that exporter, this module goes.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import onnx
import torch

from ortcore.api import UnsupportedModelError
from ortcore_plugins.services.autograd_functions import function_name
from ortcore_plugins.services.python_op import install_runners, python_op_node, registry

from .shared import BOOL, _dim_sources, python_op_attributes

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
    """A dimension as :func:`.shared._dim_sources` compares it: an int, or the symbol's expression (compared without
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


def apply_function_call(function: type, apply: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The handler's ``dynamo_apply``: record this call in the program being exported as one ``ortcore_pyop::apply``
    op, whose translation (:func:`translate_function_call`) writes the PythonOp node; returns the traced outputs."""
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
