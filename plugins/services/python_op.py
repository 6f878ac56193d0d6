"""The PythonOp service: ONNX Runtime runs ``com.microsoft::PythonOp`` / ``PythonOpGrad`` nodes through PyTorch.

Plugins that put PythonOp nodes into a graph (``autograd_function`` for custom autograd Functions,
``grad_management`` for its gradient hand-over) share three things from here:

* :data:`PYTHON_OP` / :data:`PYTHON_OP_DOMAIN`, the node's op type and domain;
* :data:`registry`, the Function classes by the ``func_name`` their nodes carry (:meth:`FunctionRegistry.key`),
  and the non-tensor arguments the nodes refer to by address (:meth:`FunctionRegistry.keep`);
* :func:`install_runners`, which registers the forward and backward runners below with ORT (idempotent): a plugin
  calls it before it exports or adds a PythonOp node;
* :func:`python_op_node`, which writes a PythonOp node from an onnxscript translation (the dynamo route).

The runners, without a compiler:

ORT 1.19 (``register_forward_runner`` / ``register_backward_runner``) takes the address of a C++ function::

    std::vector<PyObject*> runner(const char* func_name, void* callback,
                                  const std::vector<int64_t>& requires_grad_flags,
                                  const std::vector<int64_t>& tensor_type_flags, bool is_training_mode,
                                  const std::vector<int64_t>& inplace_map, const char* kernel_invoke_id,
                                  bool safe_run_mode_enabled, const std::vector<PyObject*>& args);

On x86-64 Linux (the System V ABI) a ``std::vector`` result is returned through a hidden first pointer argument
to caller-owned storage, and that pointer comes back in the return register. A ``ctypes`` callback taking that
pointer first and returning it is therefore the function ORT expects: it reads each ``const std::vector&`` as its
three pointers (begin, end, capacity) and writes the result vector the same way, its buffer allocated with the
process's ``operator new`` so that ORT's ``std::vector`` destructor frees it. Other architectures pass that pointer
differently, and :func:`install` refuses them with an error saying so.

Ownership, as ORT's ``TorchProxy`` defines it: every argument is a reference ORT releases after the call (tensors as
``"dltensor"`` capsules, ``None`` for a missing gradient, non-tensor arguments as objects); every returned object is
a new reference ORT releases after reading it. Forward returns ``[ctx, *outputs]``: with ``safe_run_mode`` set ORT
requires the context's reference count to be at least 2 and keeps one reference until the matching ``PythonOpGrad``
has run; each output capsule must have a reference count of exactly 1. Exceptions cannot cross into C++: a failing
call is logged with its traceback and answered with an empty vector, which ORT turns into an error of the ORT run.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import logging
import platform
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.dlpack

from ortcore.api import PYTHON_OP_DOMAIN, UnsupportedModelError, graph_autocast

from .autograd_functions import function_name

logger = logging.getLogger("ortcore.autograd_function")

PYTHON_OP = "PythonOp"

_POINTER = ctypes.sizeof(ctypes.c_void_p)
_RUNNER = ctypes.CFUNCTYPE(
    ctypes.c_void_p,  # returns the hidden result pointer, as the ABI demands
    ctypes.c_void_p,  # hidden pointer to the std::vector<PyObject*> to construct
    ctypes.c_char_p,  # func_name
    ctypes.c_void_p,  # callback (the registered apply/backward; unused: the function registry is ours)
    ctypes.c_void_p,  # const std::vector<int64_t>& requires_grad_flags
    ctypes.c_void_p,  # const std::vector<int64_t>& tensor_type_flags
    ctypes.c_bool,  # is_training_mode
    ctypes.c_void_p,  # const std::vector<int64_t>& inplace_map
    ctypes.c_char_p,  # kernel_invoke_id
    ctypes.c_bool,  # safe_run_mode_enabled
    ctypes.c_void_p,  # const std::vector<PyObject*>& args
)

_lock = threading.Lock()
_installed: tuple[Any, Any] | None = None
_operator_new: Any = None
_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_incref.restype = None


class RunnerUnavailableError(RuntimeError):
    """The PythonOp runners cannot be installed on this platform."""


def _vector(address: int) -> tuple[int, int]:
    """(begin, element count in bytes) of the ``std::vector`` at ``address``."""
    begin, end = (ctypes.c_void_p * 2).from_address(address)
    begin, end = begin or 0, end or 0
    return begin, end - begin


def _int64s(address: int) -> list[int]:
    begin, size = _vector(address)
    return list((ctypes.c_int64 * (size // 8)).from_address(begin)) if size else []


def _objects(address: int) -> list[Any]:
    begin, size = _vector(address)
    pointers = (ctypes.c_void_p * (size // _POINTER)).from_address(begin) if size else []
    return [ctypes.cast(p, ctypes.py_object).value if p else None for p in pointers]


def _write_result(result: int, objects: list[Any]) -> None:
    """Construct ``std::vector<PyObject*>`` at ``result`` holding a new reference to each object."""
    slots = (ctypes.c_void_p * 3).from_address(result)
    if not objects:
        slots[0] = slots[1] = slots[2] = None
        return
    size = len(objects) * _POINTER
    buffer = _operator_new(size)
    if not buffer:
        raise MemoryError("operator new returned NULL")
    array = (ctypes.c_void_p * len(objects)).from_address(buffer)
    for i, obj in enumerate(objects):
        _incref(obj)
        array[i] = id(obj)
    slots[0], slots[1], slots[2] = buffer, buffer + size, buffer + size


def _make_runner(name: str, run: Callable[..., list[Any]]):
    def runner(result, func_name, _callback, requires_grad, tensor_flags, training, inplace, _invoke_id, safe, args):
        objects: list[Any] = []
        try:
            objects = run(
                func_name.decode(),
                _int64s(requires_grad),
                _int64s(tensor_flags),
                bool(training),
                _int64s(inplace),
                bool(safe),
                _objects(args),
            )
        except BaseException as e:  # nothing may cross into C++; ORT fails the run on the empty result
            logger.error(
                "%s of autograd Function %s failed:\n%s",
                name,
                func_name.decode(errors="replace"),
                "".join(traceback.format_exception(e)).rstrip(),
            )
            objects = []
        try:
            _write_result(result, objects)
        except BaseException as e:
            logger.error("could not hand the %s results to ONNX Runtime: %s", name, e)
            _write_result(result, [])
        return result

    return _RUNNER(runner)


def install(forward: Callable[..., list[Any]], backward: Callable[..., list[Any]]) -> None:
    """Register ``forward`` and ``backward`` as ORT's PythonOp runners (once per process; later calls are no-ops).

    Each is called as ``run(func_name, requires_grad_flags, tensor_flags, is_training_mode, inplace_map,
    safe_run_mode, args)`` and returns the list of objects ORT expects.
    """
    global _installed, _operator_new
    with _lock:
        if _installed is not None:
            return
        if platform.machine().lower() != "x86_64" or not sys.platform.startswith("linux"):
            raise RunnerUnavailableError(
                "running custom autograd Functions as PythonOp needs x86-64 Linux (the std::vector result ABI the "
                f"runners rely on); this is {platform.machine()!r} on {sys.platform!r}. Set "
                "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 to trace through custom autograd Functions instead."
            )
        from onnxruntime.capi import _pybind_state as C

        new = ctypes.CDLL(None)._Znwm  # the process's operator new, which ORT's std::vector frees with delete
        new.argtypes, new.restype = [ctypes.c_size_t], ctypes.c_void_p
        _operator_new = new
        runners = (_make_runner("forward", forward), _make_runner("backward", backward))
        C.register_forward_runner(ctypes.cast(runners[0], ctypes.c_void_p).value)
        C.register_backward_runner(ctypes.cast(runners[1], ctypes.c_void_p).value)
        _installed = runners  # the callbacks must outlive every session
        # ORT's function registry holds references to Python objects (the Functions, the runners); released at
        # exit while the interpreter is alive, not by ORT's static destructors after it is gone (a crash at exit).
        atexit.register(C.unregister_python_functions)


def to_capsule(tensor: torch.Tensor) -> Any:
    """A ``"dltensor"`` capsule of a contiguous tensor, which ORT takes over (booleans as uint8: ORT's DLPack import
    has no boolean code)."""
    tensor = tensor.detach().contiguous()
    return torch.utils.dlpack.to_dlpack(tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor)


def from_capsule(capsule: Any) -> torch.Tensor:
    return torch.utils.dlpack.from_dlpack(capsule)


# -- the Function registry ------------------------------------------------------------------------------------------
class FunctionRegistry:
    """Function classes by the ``func_name`` their PythonOp nodes carry, and the non-tensor arguments kept alive."""

    def __init__(self):
        self.functions: dict[str, type] = {}
        self.keys: dict[tuple[type, tuple[int, ...], tuple[int, ...]], str] = {}
        self.bool_inputs: dict[str, frozenset[int]] = {}
        self.int_inputs: dict[str, frozenset[int]] = {}
        self.constants: dict[int, Any] = {}
        self.lock = threading.Lock()

    def key(self, function: type, bool_inputs: tuple[int, ...] = (), int_inputs: tuple[int, ...] = ()) -> str:
        """The node name of ``function`` called with boolean tensors at argument positions ``bool_inputs``
        (DLPack hands ORT's booleans over as uint8: the runner casts them back) and with Python ints that the node
        takes as int64 scalar tensors at ``int_inputs`` (sizes of dynamic dimensions: the runner passes ints)."""
        with self.lock:
            if (function, bool_inputs, int_inputs) in self.keys:
                return self.keys[(function, bool_inputs, int_inputs)]
            base = function_name(function)
            key = base
            for n in itertools.count(2):  # two local classes may share a qualified name
                if key not in self.functions:
                    break
                key = f"{base}#{n}"
            self.functions[key], self.keys[(function, bool_inputs, int_inputs)] = function, key
            self.bool_inputs[key] = frozenset(bool_inputs)
            self.int_inputs[key] = frozenset(int_inputs)
        from onnxruntime.capi import _pybind_state as C

        C.register_torch_autograd_function(key, function)
        return key

    def keep(self, value: Any) -> int:
        with self.lock:
            self.constants[id(value)] = value  # the graph refers to it by address for as long as the process lives
        return id(value)


registry = FunctionRegistry()


# -- running ---------------------------------------------------------------------------------------------------------
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


def run_forward(func_name: str, requires_grad: list, tensor_flags: list, training: bool, _inplace, _safe, args: list):
    held_contexts().clear()
    function = registry.functions[func_name]
    bool_inputs = registry.bool_inputs[func_name]
    int_inputs = registry.int_inputs[func_name]
    leaves: list[torch.Tensor | None] = []
    call_args = []
    for position, (arg, is_tensor, wants_grad) in enumerate(zip(args, tensor_flags, requires_grad)):
        if not is_tensor or arg is None:
            call_args.append(arg)
            leaves.append(None)
            continue
        tensor = from_capsule(arg)
        if position in int_inputs:
            call_args.append(int(tensor.item()))
            leaves.append(None)
            continue
        if position in bool_inputs:
            tensor = tensor.view(torch.bool)
        leaf = tensor.detach().requires_grad_(bool(wants_grad) and training and tensor.is_floating_point())
        # A copy per call: the Function may modify it in place (mark_dirty) or save it, and ORT owns the original.
        with torch.set_grad_enabled(leaf.requires_grad):
            call_args.append(leaf.clone())
        leaves.append(leaf)
    with torch.set_grad_enabled(training), graph_autocast():  # as the model's code ran it: under its autocast
        result = function.apply(*call_args)
    outputs = [result] if isinstance(result, torch.Tensor) else [r for r in result if isinstance(r, torch.Tensor)]
    saved: set[int] = set()
    grad_fn = next((o.grad_fn for o in outputs if o.grad_fn is not None), None)
    if grad_fn is not None and hasattr(grad_fn, "saved_tensors"):
        saved = {t.untyped_storage().data_ptr() for t in grad_fn.saved_tensors if t is not None}
    # An output the Function saved goes to ORT as a copy, so that nothing ORT does to its buffer reaches backward.
    capsules = [to_capsule(o.detach().clone() if o.untyped_storage().data_ptr() in saved else o) for o in outputs]
    if not training:
        return [None, *capsules]
    context = _Context(function, leaves, outputs)
    held_contexts().append(context)
    return [context, *capsules]


def run_backward(func_name: str, _requires_grad, tensor_flags: list, _training, _inplace, _safe, args: list):
    held_contexts().clear()
    context = args[0]
    if not isinstance(context, _Context):
        raise RuntimeError(f"PythonOpGrad of {func_name} received no forward context (got {type(context).__name__})")
    grads = [from_capsule(a) if a is not None else None for a in args[1:]]
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
        results[i] = to_capsule(grad if grad is not None else torch.zeros_like(leaf))
    context.leaves = context.outputs = None  # ORT releases the context itself after this call
    return results


def install_runners() -> None:
    """Register ortcore's PythonOp runners with ORT (idempotent); plugins that add PythonOp nodes call this."""
    try:
        install(run_forward, run_backward)
    except RunnerUnavailableError as e:
        raise UnsupportedModelError(str(e)) from e


# -- writing the node from onnxscript (the dynamo route) -------------------------------------------------------------
_ONNX_TYPES = [
    f"tensor({t})"
    for t in (
        "float", "double", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "string",
        "complex64", "complex128",
    )
]  # fmt: skip


def python_op_node(inputs: list[Any], attributes: dict[str, str | int | list[int]], outputs: int) -> list[Any]:
    """Write one ``com.microsoft::PythonOp`` node inside an onnxscript translation (``ortcore_export_translations``);
    returns its ``1 + outputs`` values: the context (an int64 scalar, typed here) and the Function's outputs.

    ``attributes`` are the node's (``func_name``, ``input_convention``, ...): strings, ints and int lists. onnxscript
    keeps only the attributes and outputs a schema declares, so each node gets a schema of its own.
    """
    import onnx_ir as ir
    import onnxscript
    from onnx.defs import OpSchema

    kinds = {str: OpSchema.AttrType.STRING, int: OpSchema.AttrType.INT, list: OpSchema.AttrType.INTS}
    ir_kinds = {str: ir.AttributeType.STRING, int: ir.AttributeType.INT, list: ir.AttributeType.INTS}
    parameter = OpSchema.FormalParameter
    schema = OpSchema(
        PYTHON_OP,
        PYTHON_OP_DOMAIN,
        1,
        inputs=[parameter("inputs", "T", param_option=OpSchema.FormalParameterOption.Variadic, is_homogeneous=False)]
        if inputs
        else [],
        outputs=[parameter("context", "TContext"), *(parameter(f"output_{i}", f"T{i}") for i in range(outputs))],
        type_constraints=[
            ("T", _ONNX_TYPES, ""),
            ("TContext", ["tensor(int64)"], ""),
            *((f"T{i}", _ONNX_TYPES, "") for i in range(outputs)),
        ],
        attributes=[OpSchema.Attribute(name, kinds[type(value)], "") for name, value in attributes.items()],
    )
    op = onnxscript.values.Op(onnxscript.values.Opset(PYTHON_OP_DOMAIN, 1), PYTHON_OP, schema)
    # Attributes as typed values: an empty list has no type of its own.
    typed = {name: ir.Attr(name, ir_kinds[type(value)], value) for name, value in attributes.items()}
    results = op(*inputs, **typed)
    results = list(results) if isinstance(results, list | tuple) else [results]
    results[0].dtype, results[0].shape = ir.DataType.INT64, ir.Shape([])
    return results


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """No TorchScript tracing inside, nor the exporter's torch-function modes (a plugin's op interception while
    exporting): code that a PythonOp node stands for (a routed region, a checkpointed function) runs as in PyTorch,
    its ops the node's, not the graph's. A no-op when nothing traces."""
    state = torch._C._get_tracing_state()
    if state is None:
        yield
        return
    torch._C._set_tracing_state(None)
    try:
        with torch._C.DisableTorchFunction():
            yield
    finally:
        torch._C._set_tracing_state(state)
