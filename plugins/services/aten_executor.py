"""The ATen executor service: ONNX Runtime's ATen nodes run PyTorch kernels, through ``ctypes`` callbacks.

No compiler, no C++ extension. Plugins that put ``org.pytorch.aten::ATen`` nodes into a graph (``aten_fallback``,
``op_routing``, ``efficient_attention``) call :func:`install` before ORT builds such a graph, and
:func:`guard_runs` from their ``ortcore_session_plan`` (with :func:`on_run_boundary` for state that must not
outlive a run): the first makes ORT able to run the nodes, the second raises a kernel's failure from the run it hit.

ORT's ``org.pytorch.aten::ATen`` kernel hands each node (its ``operator`` and ``overload_name`` attributes and its
inputs as DLPack tensors) to a process-wide executor. :func:`install` registers this module's executor, which runs
``torch.ops.<namespace>.<operator>.<overload>`` with PyTorch's own kernels:

* inputs arrive as ``DLManagedTensor*``; each is wrapped in a PyCapsule named ``dltensor`` and given to
  ``torch._C._from_dlpack`` (zero copy; the torch tensor then owns ORT's deleter). A NULL input is a missing optional
  argument (or one that takes its schema default);
* non-tensor arguments (int, float, bool, lists of them, strings) arrive as small tensors and are converted as the
  op's schema says; strings travel as uint8 tensors of their UTF-8 bytes;
* outputs are ``torch._C._to_dlpack`` capsules of contiguous tensors: ORT takes the ``DLManagedTensor*`` and the
  capsule is renamed ``used_dltensor`` so that torch does not free what ORT now owns. An undefined result is NULL.

Operator names without a namespace are ``aten`` ops; ``"ortcore_aten::name"`` runs an op of another
``torch.library`` namespace (plugins define their single-output backward helpers there).

Errors: an exception cannot cross into C. The executor logs it (ERROR, with the traceback the first time per op),
counts it, stores it for the calling thread, and makes ORT fail the node on the spot (it hands back an output ORT
rejects), so the run stops at the failing ATen node instead of computing on garbage. Python code then takes the
stored error with :func:`take_pending_error` and raises it (:func:`run_guard` does so as soon as the run returns or
fails); the count stays available from :func:`stats`. Ctrl-C inside a kernel is handled the same way and re-raised
as ``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

logger = logging.getLogger("ortcore.aten")

# The C signatures ORT 1.19 calls (aten_op_executor.h):
#   bool IsTensorArgument(const char* op, const char* overload, size_t index, bool is_input)
#   void ExecuteATenOperator(const char* op, const char* overload, size_t n_in, DLManagedTensor** in,
#                            size_t n_out, DLManagedTensor** out)
_IS_TENSOR_ARGUMENT = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_bool)
_EXECUTE = ctypes.CFUNCTYPE(
    None,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
)

# PyCapsule keeps a pointer to its name, so the names must live as long as the process: module constants.
_DLTENSOR = b"dltensor"
_USED_DLTENSOR = b"used_dltensor"

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]


class ATenExecutorError(RuntimeError):
    """A PyTorch kernel failed inside an ONNX Runtime ATen node (the message names the op and the error)."""


@attrs.frozen
class ExecutorFailure:
    """One failed ATen call: which op, and what was raised."""

    op: str
    overload: str
    error: str
    traceback: str
    # Ctrl-C while a kernel ran: the run is stopped like any failure, and KeyboardInterrupt is raised after it.
    interrupted: bool = False

    def describe(self) -> str:
        overload = f".{self.overload}" if self.overload else ""
        return f"the ATen executor failed running {self.op}{overload}: {self.error}"


@attrs.define
class ExecutorStats:
    """Process-wide counters: ATen calls run, and calls that failed."""

    calls: int = 0
    errors: int = 0
    last_error: ExecutorFailure | None = None


# -- argument conversion, driven by the op's schema -----------------------------------------------------------------


def _scalar(t: torch.Tensor) -> Any:
    if t.numel() != 1:
        raise ValueError(f"expected a single value, got a tensor of shape {tuple(t.shape)}")
    return t.reshape(()).item()


def _converter(kind: str, element: str | None, name: str) -> Callable[[torch.Tensor], Any]:
    """How to turn the tensor ORT passes into the Python value the schema wants."""
    if kind == "TensorType":
        return lambda t: t
    if kind in ("IntType", "SymIntType"):
        return lambda t: int(_scalar(t))
    if kind == "FloatType":
        return lambda t: float(_scalar(t))
    if kind == "BoolType":
        return lambda t: bool(_scalar(t))
    if kind == "NumberType":  # a Scalar: keep the tensor's own type (int stays int, float stays float)
        return _scalar
    if kind == "StringType":
        # Strings travel as uint8 tensors of their UTF-8 bytes.
        return lambda t: bytes(t.reshape(-1).to(torch.uint8).tolist()).decode("utf-8")
    if kind == "ListType":
        cast = {"IntType": int, "SymIntType": int, "FloatType": float, "BoolType": bool}.get(element or "")
        if cast is None:
            raise TypeError(f"argument {name!r}: lists of {element} are not supported by the ATen executor")
        return lambda t: [cast(v) for v in t.reshape(-1).tolist()]
    raise TypeError(f"argument {name!r}: type {kind} is not supported by the ATen executor")


@attrs.frozen
class _Argument:
    name: str
    is_tensor: bool
    optional: bool
    kwarg_only: bool
    has_default: bool
    default: Any
    convert: Callable[[torch.Tensor], Any] = attrs.field(eq=False)


@attrs.frozen
class ResolvedOp:
    """An ``OpOverload`` with its arguments' converters and which results are tensors."""

    qualified_name: str
    overload: Any = attrs.field(eq=False)
    arguments: tuple[_Argument, ...]
    returns_tensor: tuple[bool, ...]

    def call(self, inputs: list[torch.Tensor | None]) -> tuple[Any, ...]:
        if len(inputs) > len(self.arguments):
            raise TypeError(f"{self.qualified_name} takes {len(self.arguments)} arguments, ORT passed {len(inputs)}")
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for i, arg in enumerate(self.arguments):
            t = inputs[i] if i < len(inputs) else None
            if t is not None:
                value = arg.convert(t)
            elif arg.optional:
                value = None
            elif arg.has_default:
                value = arg.default
            else:
                raise TypeError(f"{self.qualified_name}: required argument {arg.name!r} is missing")
            if arg.kwarg_only:
                kwargs[arg.name] = value
            else:
                args.append(value)
        result = self.overload(*args, **kwargs)
        return result if isinstance(result, tuple | list) else (result,)


def _split_name(op: str) -> tuple[str, str]:
    namespace, _, name = op.rpartition("::")
    return namespace or "aten", name


_cache: dict[tuple[str, str], ResolvedOp] = {}


def resolve(op: str, overload: str) -> ResolvedOp:
    """The op ``op`` (``"gelu"``, ``"aten::gelu"``, ``"ortcore::name"``) at ``overload`` (``""`` is ``default``)."""
    key = (op, overload)
    found = _cache.get(key)
    if found is not None:
        return found
    namespace, name = _split_name(op)
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        target = getattr(packet, overload or "default")
    except (AttributeError, RuntimeError) as e:
        raise LookupError(f"no PyTorch op {namespace}::{name}.{overload or 'default'}") from e
    arguments = []
    for a in target._schema.arguments:
        kind = a.type.kind()
        optional = kind == "OptionalType"
        inner = a.type.getElementType() if optional else a.type
        element = inner.getElementType().kind() if inner.kind() == "ListType" else None
        if inner.kind() == "ListType" and element == "TensorType":
            raise TypeError(f"{namespace}::{name}: argument {a.name!r} is a tensor list, not supported")
        arguments.append(
            _Argument(
                name=a.name,
                is_tensor=inner.kind() == "TensorType",
                optional=optional,
                kwarg_only=a.kwarg_only,
                has_default=a.has_default_value(),
                default=a.default_value if a.has_default_value() else None,
                convert=_converter(inner.kind(), element, a.name),
            )
        )
    returns = tuple(r.type.kind() == "TensorType" for r in target._schema.returns)
    found = ResolvedOp(f"{namespace}::{name}", target, tuple(arguments), returns)
    _cache[key] = found
    return found


# -- DLPack in and out ------------------------------------------------------------------------------------------------


def _from_ort(pointer: int | None) -> torch.Tensor | None:
    if not pointer:
        return None
    # No destructor on our capsule: torch._from_dlpack takes ownership (it renames the capsule and calls ORT's
    # deleter when the tensor dies).
    return torch._C._from_dlpack(_capsule_new(pointer, _DLTENSOR, None))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _to_ort(value: Any, inputs: frozenset[int] = frozenset()) -> int | None:
    """``value`` handed to ORT, which takes ownership: a tensor sharing the memory of one of the node's inputs
    (``inputs``: their storages) is copied first. A kernel may return an input itself or a view of it (a gradient
    passed through unchanged, as ``broadcast_tensors``' is for an input already of the broadcast shape); ORT would
    otherwise own, and free or reuse, a buffer it also holds as that input."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):  # an int result (a size, say) becomes a 0-d tensor, as ORT expects
        value = torch.tensor(value)
    elif value.numel() and _storage(value) in inputs:
        value = value.clone(memory_format=torch.contiguous_format)
    if value.dtype == torch.bool:
        # ORT 1.19.2's DLPack import refuses bool (kDLBool) and types uint8 as uint8: no faithful way back.
        raise TypeError("a bool result cannot be handed back to ONNX Runtime's ATen kernel")
    if not value.is_contiguous():
        value = value.contiguous()
    capsule = torch._C._to_dlpack(value)
    pointer = _capsule_get_pointer(capsule, _DLTENSOR)
    # ORT owns the DLManagedTensor now and calls its deleter; torch must not free it when the capsule dies.
    _capsule_set_name(capsule, _USED_DLTENSOR)
    return pointer


def _rejected_output() -> int:
    """An output ORT refuses (it is not contiguous): the ATen node then fails, which stops the run right there.

    ORT checks contiguity before taking ownership, so this DLManagedTensor is leaked (a few bytes per failure):
    a leak is safe where handing it back to torch could double-free.
    """
    capsule = torch._C._to_dlpack(torch.zeros(2, 2).t())
    pointer = _capsule_get_pointer(capsule, _DLTENSOR)
    _capsule_set_name(capsule, _USED_DLTENSOR)
    return pointer


# -- the callbacks ------------------------------------------------------------------------------------------------------

_stats = ExecutorStats()
_local = threading.local()
_lock = threading.Lock()
_logged_ops: set[tuple[str, str]] = set()


def _record_failure(op: str, overload: str, error: BaseException) -> None:
    failure = ExecutorFailure(
        op,
        overload,
        f"{type(error).__name__}: {error}",
        traceback.format_exc(),
        interrupted=isinstance(error, KeyboardInterrupt),
    )
    with _lock:
        _stats.errors += 1
        _stats.last_error = failure
        first = (op, overload) not in _logged_ops
        _logged_ops.add((op, overload))
    if getattr(_local, "pending", None) is None:  # the first failure of a run is the cause; later ones follow from it
        _local.pending = failure
    if first:
        logger.error("%s\n%s", failure.describe(), failure.traceback)
    else:
        logger.error("%s", failure.describe())


def _is_tensor_argument(op: bytes, overload: bytes, index: int, is_input: bool) -> bool:
    op_name, overload_name = op.decode(), overload.decode()
    try:
        resolved = resolve(op_name, overload_name)
        if is_input:
            return index < len(resolved.arguments) and resolved.arguments[index].is_tensor
        return index < len(resolved.returns_tensor) and resolved.returns_tensor[index]
    except BaseException as e:  # nothing may propagate into ORT's C++ frames
        _record_failure(op_name, overload_name, e)
        return False


def _execute(op: bytes, overload: bytes, n_in: int, inputs: Any, n_out: int, outputs: Any) -> None:
    op_name, overload_name = op.decode(), overload.decode()
    try:
        # Take ownership of every input first, so ORT's deleters run even if resolving the op fails.
        tensors = [_from_ort(inputs[i]) for i in range(n_in)]
        resolved = resolve(op_name, overload_name)
        results = resolved.call(tensors)
        inputs_memory = frozenset(_storage(t) for t in tensors if t is not None and t.numel())
        del tensors
        if len(results) < n_out:
            raise TypeError(f"{resolved.qualified_name} returned {len(results)} results, the node has {n_out} outputs")
        pointers = []
        handed: set[int] = set(inputs_memory)
        for i in range(n_out):  # nor may two outputs share memory: ORT would own (and free) it twice
            result = results[i]
            if isinstance(result, torch.Tensor) and result.numel():
                memory = _storage(result)
                pointers.append(_to_ort(result, frozenset(handed)))
                handed.add(memory)
            else:
                pointers.append(_to_ort(result))
    except BaseException as e:  # nothing may propagate into ORT's C++ frames
        try:
            _record_failure(op_name, overload_name, e)
            for i in range(n_out):
                outputs[i] = _rejected_output()
        except BaseException:  # only if logging or torch itself is broken: NULL outputs still fail the run
            for i in range(n_out):
                outputs[i] = None
        return
    for i, pointer in enumerate(pointers):
        outputs[i] = pointer
    _stats.calls += 1


# The callback objects must live as long as the process: ORT keeps only their addresses.
_callbacks: tuple[Any, Any] | None = None


def install() -> bool:
    """Register the executor with ORT, once per process. Returns True if this call registered it."""
    global _callbacks
    with _lock:
        if _callbacks is not None:
            return False
        from onnxruntime.capi import _pybind_state as C

        is_tensor = _IS_TENSOR_ARGUMENT(_is_tensor_argument)
        execute = _EXECUTE(_execute)
        is_tensor_address = ctypes.cast(is_tensor, ctypes.c_void_p).value
        execute_address = ctypes.cast(execute, ctypes.c_void_p).value
        C.register_aten_op_executor(str(is_tensor_address), str(execute_address))
        _callbacks = (is_tensor, execute)
        logger.debug("registered the ATen op executor")
        return True


def installed() -> bool:
    return _callbacks is not None


def take_pending_error() -> ExecutorFailure | None:
    """The first failure on this thread since the last call (and forget it), or None."""
    failure = getattr(_local, "pending", None)
    _local.pending = None
    return failure


def stats() -> ExecutorStats:
    """A snapshot of the process-wide counters."""
    with _lock:
        return attrs.evolve(_stats)


# -- raising failures from the session runs that hit them --------------------------------------------------------------

_run_resets: list[Callable[[], None]] = []


def on_run_boundary(reset: Callable[[], None]) -> None:
    """Call ``reset`` before and after every guarded session run (state keyed by ORT's buffers, which ORT reuses
    across runs, must not outlive a run). Registering the same function again does nothing."""
    if reset not in _run_resets:
        _run_resets.append(reset)


@contextlib.contextmanager
def run_guard(what: str) -> Iterator[None]:
    """A session run wrapper (``SessionPlan.add_run_wrapper("aten_executor", run_guard)``): an ATen failure during
    the run is raised as :class:`ATenExecutorError` naming the op, instead of ORT's generic error or nothing."""
    take_pending_error()  # a failure of an earlier, unrelated run must not be blamed on this one
    for reset in _run_resets:
        reset()
    try:
        yield
    except Exception as e:
        for reset in _run_resets:
            reset()
        failure = take_pending_error()
        if failure is None:
            raise
        if failure.interrupted:
            raise KeyboardInterrupt from e
        raise ATenExecutorError(f"{failure.describe()} (during the ORT {what}; ORT said: {e})") from e
    for reset in _run_resets:
        reset()
    failure = take_pending_error()
    if failure is not None:  # a failure that did not stop the run (a query ORT made of the executor, say)
        if failure.interrupted:
            raise KeyboardInterrupt
        raise ATenExecutorError(f"{failure.describe()} (during the ORT {what})")


def has_aten_nodes(model: Any) -> bool:
    """Whether a graph holds ATen nodes (whose failures :func:`run_guard` surfaces)."""
    return any(n.op_type == "ATen" and n.domain == "org.pytorch.aten" for n in model.graph.node)


def _loaded_libgomp() -> str | None:
    """The path of the libgomp this process loaded (torch's), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split(maxsplit=5)[-1].strip()
                if "libgomp" in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


def torch_threads_spin() -> bool:
    """Whether torch's OpenMP workers spin after each parallel region: libgomp loaded with its default wait policy
    (neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` set) and more than one torch thread."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ or torch.get_num_threads() < 2:
        return False
    return _openmp() is not None


_omp: Any = None


def _openmp() -> Any:
    """torch's libgomp through ctypes (the library already loaded: the same instance torch uses), or None."""
    global _omp
    if _omp is None:
        path = _loaded_libgomp()
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)
            lib.omp_get_max_threads.restype = ctypes.c_int
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            return None
        _omp = lib
    return _omp


@contextlib.contextmanager
def single_threaded_torch(what: str) -> Iterator[None]:
    """A run wrapper: torch's kernels inside the run (ATen nodes, called on this thread) use one thread, so torch's
    OpenMP workers stay asleep instead of spinning on the cores ORT's kernels need.

    It sets OpenMP's thread count of the calling thread only (``omp_set_num_threads`` is per thread), never
    ``torch.set_num_threads``: that one also rebuilds torch's thread pool, which other threads (DDP's communication,
    data loading) may be using at that moment."""
    omp = _openmp()
    if omp is None:
        yield
        return
    threads = omp.omp_get_max_threads()
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(threads)


_told_about_spinning = False


def guard_runs(graph: Any, plan: Any) -> None:
    """From a plugin's ``ortcore_session_plan``: guard the session's runs if its graph holds ATen nodes.

    If torch's OpenMP workers spin (libgomp's default, when torch was imported before ortcore and
    ``GOMP_SPINCOUNT`` is not set), the ATen nodes of such a graph also run single-threaded
    (:func:`single_threaded_torch`): measured on 2 cores, BERT's step 103-112 -> 94-106 ms and GPT-2's 155-181 ->
    135-162 ms, against 93-108 and 123-141 ms with ``GOMP_SPINCOUNT=10000`` (docs/performance.md).
    """
    global _told_about_spinning
    if not has_aten_nodes(graph.model):
        return
    plan.add_run_wrapper("aten_executor", run_guard)
    if graph.request.device.type == "cpu" and torch_threads_spin():  # on a GPU, torch's CPU threads are idle
        plan.add_run_wrapper("single_threaded_torch", single_threaded_torch)
        if not _told_about_spinning:
            _told_about_spinning = True
            logger.info(
                "torch's OpenMP threads spin after each op (GOMP_SPINCOUNT is unset and torch was imported before "
                "ortcore): PyTorch kernels inside ORT's graph run single-threaded. GOMP_SPINCOUNT=10000 set before "
                "Python starts (or importing ortcore before torch) is faster still (docs/performance.md)"
            )
