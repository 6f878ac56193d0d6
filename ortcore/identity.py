"""What shapes an exported graph: the one definition the state machine, the fingerprint and export caches share.

A call's :class:`ortcore.state.GraphKey` holds what changes from call to call (input structure, dtypes, ranks,
train/eval, opset, exporter); :func:`graph_fingerprint` adds what belongs to the model and the process, hashed into
one stable digest that names the graph across processes:

- the module's structure (:func:`module_signature`: printed form, every parameter's and buffer's name, shape,
  dtype and requires_grad);
- what the tracer bakes into the graph beyond that structure (:func:`module_digest`): the code of the model's
  classes and the versions of the packages defining them, every submodule's plain attributes (which ``repr``
  hides), train/eval flag and hooks, global module hooks, tensors kept as plain attributes, torch's default dtype;
- the graph passes, the exporter's symbolics and declared settings, plugins' export keys, library versions.

Weights are never part of it: graphs are exported without parameters, so a checkpoint at any step names the
same graph. Cost: :func:`graph_fingerprint` runs once per export, not per step. Measured on a Hugging Face
``BertForMaskedLM`` (hidden 256, 4 layers, 4 heads, 2-core CPU): about 25 ms for the first export of a process
(source files, package versions and bytecode are read once per process), then 8-10 ms (:func:`module_digest`;
:func:`module_signature` about 1 ms), next to an export of several seconds.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import re
import sys
import threading
import types
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch

from .inspectors import hook_code

if TYPE_CHECKING:
    from .exporter import Exporter
    from .graph_passes import GraphPass
    from .state import GraphKey

logger = logging.getLogger("ortcore")


def fingerprint(parts: dict[str, Any]) -> str:
    """A stable hash of a JSON-able description."""
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def module_signature(module: torch.nn.Module) -> dict[str, Any]:
    """The module's structure: its printed form, and every parameter's and buffer's name, shape, dtype and
    requires_grad (the printed form alone misses shapes and frozen parameters)."""
    return {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "repr": repr(module),
        "parameters": [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()],
        "buffers": [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
    }


def exporter_identity(exporter: Exporter) -> dict[str, Any]:
    """What of the exporter shapes graphs: its name, which symbolic serves each op (plugins add some), and the
    settings an exporter declares through an optional ``fingerprint()`` method."""
    symbolics = getattr(exporter, "symbolics", {}) or {}
    declared = getattr(exporter, "fingerprint", None)
    return {
        "name": exporter.name,
        "symbolics": sorted(f"{op}={fn.__module__}.{fn.__qualname__}" for op, fn in symbolics.items()),
        "settings": declared() if callable(declared) else None,
    }


@functools.cache
def versions() -> dict[str, str]:
    import onnxruntime

    from . import __version__

    return {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
        "ortcore": __version__,
    }


# -- what the tracer bakes in beyond the module's structure ---------------------------------------------------------
# nn.Module bookkeeping in vars(module): registered children, parameters and buffers are in the core's fingerprint,
# and hook dictionaries are described by _hooks_of (their keys are handle ids, which differ between processes).
_MODULE_BOOKKEEPING = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
    | {name for name in vars(torch.nn.Module()) if "hook" in name}
)
# The hooks the tracer runs (forward hooks and pre-hooks) and backward hooks, each with its flag dictionaries.
_HOOKS = (
    ("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
    ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")),
    ("_backward_pre_hooks", ()),
    ("_backward_hooks", ()),
)
# Attributes that never reach a graph and differ between processes for the same model: Hugging Face's generation
# settings (used by generate(), not forward) and the hash(self) it keeps, which depends on the process's hash seed.
_IGNORED_ATTRIBUTES = frozenset({"generation_config", "_original_object_hash"})
_CALLABLES = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    functools.partial,
    staticmethod,
    classmethod,
)
# Objects some models keep that never shape a graph and whose state (every logger of the process, open files,
# threads) differs between processes: described by type (and a logger by its name) only.
_OPAQUE = (logging.Logger, logging.Handler, logging.Manager, io.IOBase, threading.Thread)
_MAX_DEPTH = 10
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_TENSOR_HASH_LIMIT = 1 << 28  # bytes; bigger unregistered tensors are described by dtype and shape only


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def _package_version(top: str) -> str:
    """The version of the package ``top`` (a library upgrade changes the code the tracer runs), or ""."""
    version = getattr(sys.modules.get(top), "__version__", None)
    if isinstance(version, str):
        return version
    parts = []
    # Scanning installed distributions takes ~0.1 s: once per process. Broken metadata leaves the version out.
    with contextlib.suppress(Exception):
        for dist in sorted(set(_distributions().get(top, ()))):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                parts.append(f"{dist}=={importlib.metadata.version(dist)}")
    return ", ".join(parts)


@functools.lru_cache(maxsize=1024)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _source_file(cls: type) -> Any:
    """The sha256 of the file defining ``cls`` (helpers in that file included), or None without a source file."""
    try:
        path = inspect.getsourcefile(cls)
        if path and os.path.isfile(path):
            st = os.stat(path)
            return [os.path.basename(path), _file_digest(path, st.st_mtime_ns, st.st_size)]
    except (OSError, TypeError):  # defined by exec() or in an interactive session
        pass
    return None


# Entries of a class's __dict__ that say nothing about what its code does.
_CLASS_NOISE = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__", "__annotations__"})


def _class_entry(cls: type) -> list[Any]:
    """A class the tracer runs: its name, defining file, package version, and its methods' bytecode, closures and
    class attributes (the file alone misses classes made by a factory function). torch's own classes are covered
    by the torch version in the core's fingerprint."""
    top = cls.__module__.partition(".")[0]
    members = {k: v for k, v in vars(cls).items() if k not in _CLASS_NOISE}
    return [cls.__module__, cls.__qualname__, _package_version(top), _source_file(cls), _describe(members, set(), 0)]


def _skip_class(cls: type) -> bool:
    top = cls.__module__.partition(".")[0]
    return top in ("torch", "builtins") or cls is object


def _describe_code(code: types.CodeType) -> tuple[Any, ...]:
    # Code equality ignores co_qualname, which the description includes: key the cache by both.
    return _describe_code_once(code, code.co_qualname)


# Code objects are immutable: each is described once per process (this halves the digest's time).
@functools.lru_cache(maxsize=8192)
def _describe_code_once(code: types.CodeType, qualname: str) -> tuple[Any, ...]:
    consts = tuple(_describe_code(c) if isinstance(c, types.CodeType) else _describe_plain(c) for c in code.co_consts)
    return (qualname, hashlib.sha256(code.co_code).hexdigest(), tuple(code.co_names), consts)


def _describe_plain(value: Any) -> Any:
    """A constant of bytecode: frozensets are sorted because their order depends on the process's hash seed."""
    if isinstance(value, frozenset | set):
        return ["set", sorted(repr(v) for v in value)]
    if isinstance(value, tuple):
        return [_describe_plain(v) for v in value]
    return repr(value)


def _describe_callable(fn: Any, seen: set[int], depth: int) -> Any:
    if isinstance(fn, functools.partial):
        parts = (fn.func, fn.args, fn.keywords)
        return ["partial", *(_describe(p, seen, depth + 1) for p in parts)]
    if isinstance(fn, types.MethodType):
        return ["method", _describe(fn.__self__, seen, depth + 1), _describe_callable(fn.__func__, seen, depth + 1)]
    if isinstance(fn, staticmethod | classmethod):
        return _describe_callable(fn.__func__, seen, depth + 1)
    if isinstance(fn, types.FunctionType):
        closure = [c.cell_contents for c in fn.__closure__ or () if _cell_filled(c) and c.cell_contents is not fn]
        return [
            "function",
            f"{fn.__module__}.{fn.__qualname__}",
            _describe_code(fn.__code__),
            _describe(fn.__defaults__, seen, depth + 1),
            _describe(fn.__kwdefaults__, seen, depth + 1),
            _describe(closure, seen, depth + 1),
        ]
    # Builtins (torch.relu, len) are identified by name; their code belongs to a versioned library.
    return ["builtin", f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"]


def _cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises ValueError)
    except ValueError:
        return False
    return True


def _describe_tensor(t: torch.Tensor) -> list[Any]:
    spec = ["tensor", str(t.dtype), list(t.shape), str(t.device.type)]
    try:
        if t.numel() * t.element_size() <= _TENSOR_HASH_LIMIT and t.layout == torch.strided and t.device.type != "meta":
            # A copy is read: numpy's view would make the tensor's own storage unresizable for good (an engine
            # that frees and re-allocates storage in place, FSDP2's unshard and reshard, then fails).
            raw = t.detach().cpu().reshape(-1).view(torch.uint8).clone().numpy().tobytes()
            spec.append(hashlib.sha256(raw).hexdigest())
    except (RuntimeError, TypeError):  # exotic tensors (sparse, quantized, subclasses): dtype and shape only
        pass
    return spec


def _describe_object(value: Any, seen: set[int], depth: int) -> Any:
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and depth < _MAX_DEPTH:
        state = {k: v for k, v in state.items() if k not in _IGNORED_ATTRIBUTES}
        return ["object", name, _describe(state, seen, depth + 1)]
    # No __dict__ (or too deep): its printed form, minus memory addresses, which differ in every process.
    return ["object", name, _ADDRESS.sub("", repr(value))]


def _describe(value: Any, seen: set[int], depth: int) -> Any:
    """A JSON-able description of a value the tracer may bake into a graph; equal in every process for equal values."""
    if value is None or isinstance(value, bool | int | float | str):
        return value if not isinstance(value, float) else repr(value)  # repr keeps nan/inf and -0.0 apart
    if isinstance(value, bytes):
        return ["bytes", hashlib.sha256(value).hexdigest()]
    if isinstance(value, enum.Enum | torch.dtype | torch.device | torch.Size):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _describe_tensor(value)
    if isinstance(value, torch.nn.Module):
        # Registered submodules are described on their own; a plain reference (a parent, say) only by class.
        return ["module", f"{type(value).__module__}.{type(value).__qualname__}"]
    if isinstance(value, type):
        return ["class", f"{value.__module__}.{value.__qualname__}"]
    if isinstance(value, types.ModuleType):
        return ["pymodule", value.__name__]
    if isinstance(value, _OPAQUE):
        return ["opaque", f"{type(value).__module__}.{type(value).__qualname__}", getattr(value, "name", None)]
    if id(value) in seen:
        return "<cycle>"
    if depth > _MAX_DEPTH:
        return ["deep", f"{type(value).__module__}.{type(value).__qualname__}"]
    seen.add(id(value))
    try:
        return _describe_container(value, seen, depth)
    except Exception as e:  # a repr or attribute that raises: such a value never names a graph another call reuses
        return _undescribable(value, e)
    finally:
        seen.discard(id(value))


def _describe_container(value: Any, seen: set[int], depth: int) -> Any:
    if isinstance(value, list | tuple):
        return [type(value).__name__, [_describe(v, seen, depth + 1) for v in value]]
    if isinstance(value, dict):
        items = [[repr(k), _describe(v, seen, depth + 1)] for k, v in value.items()]
        return ["dict", sorted(items, key=lambda kv: kv[0])]
    if isinstance(value, set | frozenset):
        return ["set", sorted(json.dumps(_describe(v, seen, depth + 1), sort_keys=True) for v in value)]
    if isinstance(value, _CALLABLES):
        return _describe_callable(value, seen, depth)
    if isinstance(value, property):
        return ["property", *(_describe(f, seen, depth + 1) for f in (value.fget, value.fset, value.fdel))]
    if isinstance(value, np.ndarray):
        return ["ndarray", str(value.dtype), list(value.shape), hashlib.sha256(value.tobytes()).hexdigest()]
    return _describe_object(value, seen, depth)


def _undescribable(value: Any, error: Exception) -> list[str]:
    """A value the fingerprint cannot describe: a token of its own, so that no cache ever serves a graph for it."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    logger.info(
        "graph fingerprint: cannot describe a %s (%s: %s); its graphs are exported, never taken from an export cache",
        kind,
        type(error).__name__,
        error,
    )
    return ["undescribable", kind, uuid.uuid4().hex]


def _hooks_of(owner: Any, prefix: str = "", untraced: Callable[[Any], bool] | None = None) -> list[Any]:
    """Hooks in registration order with their flags, without the handle ids that key them; a hook ``untraced``
    accepts is named by its code only (:attr:`ortcore.inspectors.RuntimeInspector.untraced_hooks`)."""
    described = []
    for main, flags in _HOOKS:
        hooks = getattr(owner, prefix + main, None) or {}
        flag_dicts = [getattr(owner, prefix + f, None) or {} for f in flags]
        described.append(
            [
                main,
                [
                    [_describe_hook(hook, untraced), [bool(d.get(k)) for d in flag_dicts]]
                    for k, hook in hooks.items()
                ],
            ]
        )
    return described


def _describe_hook(hook: Any, untraced: Callable[[Any], bool] | None) -> Any:
    if untraced is not None and untraced(hook):
        target = hook_code(hook)
        return ["untraced hook", f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '?')}"]
    return _describe(hook, set(), 0)


def _global_hooks() -> list[Any]:
    from torch.nn.modules import module as nn_module

    return _hooks_of(nn_module, "_global")


def module_digest(
    module: torch.nn.Module, ignored: frozenset[str] = frozenset(), untraced_hooks: Callable[[Any], bool] | None = None
) -> str:
    """A sha256 of what the tracer bakes into the graph beyond :func:`module_signature` (part of
    :func:`graph_fingerprint`).

    :func:`module_signature` sees the module's printed form and its parameters and buffers. The tracer also bakes
    in the code of every class it runs (a model file edited between runs, a library upgraded), plain attributes that
    ``repr`` hides (``self.scale = 2.0``, a Hugging Face config's attention implementation), the train/eval flag of
    each submodule (a frozen batch norm in eval inside a training model), forward hooks and pre-hooks (module and
    global), tensors kept as plain attributes (constants in the graph) and torch's default dtype. Weights are not
    part of it, nor the attributes named in ``ignored`` (an engine's bookkeeping on the modules, which the forward
    never reads: ``RuntimeInspector.untraced_attributes``), nor the state that hooks ``untraced_hooks`` accepts are
    bound to (``RuntimeInspector.untraced_hooks``: named by their code only). A value it cannot describe (its ``repr`` raises) gets a
    random token, so no cache serves its graph.

    Example::

        module_digest(model) == module_digest(copy.deepcopy(model))  # True: same code, attributes and hooks
    """
    seen_classes: dict[type, None] = {}
    modules = []
    for name, sub in module.named_modules(remove_duplicate=False):
        for cls in type(sub).__mro__:
            if not _skip_class(cls):
                seen_classes.setdefault(cls)
        state = {
            k: v
            for k, v in vars(sub).items()
            if k not in _MODULE_BOOKKEEPING and k not in _IGNORED_ATTRIBUTES and k not in ignored
        }
        kind = f"{type(sub).__module__}.{type(sub).__qualname__}"
        modules.append([name, kind, _describe(state, set(), 0), _hooks_of(sub, untraced=untraced_hooks)])
    parts = {
        "classes": [_class_entry(cls) for cls in seen_classes],
        "modules": modules,
        "global_hooks": _global_hooks(),
        "default_dtype": str(torch.get_default_dtype()),
    }
    text = json.dumps(parts, sort_keys=True, default=lambda v: _ADDRESS.sub("", repr(v)))
    return hashlib.sha256(text.encode()).hexdigest()


def graph_fingerprint(
    key: GraphKey,
    module: torch.nn.Module,
    *,
    passes: Sequence[GraphPass],
    exporter: Exporter,
    plugin_keys: dict[str, Any],
) -> str:
    """The sha256 naming the graph that exporting ``module`` for a call with ``key`` gives.

    Equal in every process for the same model code, attributes, hooks, call structure, options and library
    versions; different whenever one of them changes the graph (see the module docstring). Example::

        fp = graph_fingerprint(key, model, passes=passes, exporter=exporter, plugin_keys=hooks.export_key())
    """
    return fingerprint(graph_description(key, module, passes=passes, exporter=exporter, plugin_keys=plugin_keys))


def graph_description(
    key: GraphKey,
    module: torch.nn.Module,
    *,
    passes: Sequence[GraphPass],
    exporter: Exporter,
    plugin_keys: dict[str, Any],
    untraced: frozenset[str] = frozenset(),
    untraced_hooks: Callable[[Any], bool] | None = None,
) -> dict[str, Any]:
    """What :func:`graph_fingerprint` hashes (the module's signature and digest computed once per call);
    ``untraced`` and ``untraced_hooks`` as :func:`module_digest`'s ``ignored`` and ``untraced_hooks``."""
    return {
        "key": key.export_key,
        "module": module_signature(module),
        "module_digest": module_digest(module, untraced, untraced_hooks),
        "passes": [p.name for p in passes],
        "exporter": exporter_identity(exporter),
        "plugins": plugin_keys,
        "versions": versions(),
    }
