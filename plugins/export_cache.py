"""export_cache: reuse exported graphs across processes, so a restarted job skips the ONNX export.

When ``ORTMODULE_CACHE_DIR`` (or ``[plugins.export_cache] dir``) is set, every graph ortcore exports is written to
that directory, and a later process that wraps the same model and calls it with the same input schema loads the
graph instead of exporting again. Entries are keyed by the fingerprint the core computes (input schema,
train/eval, opset, exporter, module structure, graph passes, plugins' export keys, library versions) *and* by a
digest of what the core's fingerprint does not see but the tracer bakes into the graph: the source files of the
model's classes, the versions of the packages that define them, every submodule's plain attributes, train/eval
flag and forward hooks, unregistered tensor attributes, and torch's default dtype (see :func:`module_digest`).

An entry is a header (magic, format, fingerprint, module digest, rank, payload size and sha256) followed by
:meth:`ortcore.graph.ExportedGraph.to_bytes`. A truncated, garbled, foreign or stale entry is logged at WARNING,
removed and exported again; it never raises and never serves a wrong graph. Entries are written to a temporary
file in the cache directory and moved into place with :func:`os.replace`, so concurrent writers (ranks, jobs) are
safe. Each torch.distributed rank has its own entries.

The payload is a pickle: point the cache only at a directory you trust.

Options (``[plugins.export_cache]`` in ortcore.toml, or the environment)::

    [plugins.export_cache]
    dir = "~/.cache/ortcore"   # env ORTMODULE_CACHE_DIR; unset or "" disables the cache
    max_entries = 256          # env ORTCORE_EXPORT_CACHE_MAX_ENTRIES; 0 = no limit
    max_bytes = "2GiB"         # env ORTCORE_EXPORT_CACHE_MAX_BYTES; 0 = no limit
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
import tempfile
import threading
import time
import types
import weakref
from typing import Any

import attrs
import numpy as np
import torch

from ortcore.config import Config, option
from ortcore.errors import OptionError
from ortcore.graph import GRAPH_FORMAT, ExportedGraph
from ortcore.hookspecs import hookimpl

logger = logging.getLogger("ortcore.export_cache")

PLUGIN_NAME = "export_cache"
MAGIC = b"ORTCORE-EXPORT-CACHE"
ENTRY_FORMAT = 1  # bump when the header layout changes
ENTRY_SUFFIX = ".ortgraph"
TMP_SUFFIX = ".tmp"
MAX_HEADER = 4096  # a header longer than this is garbage, not a header
STALE_TMP_SECONDS = 3600.0  # a writer's temporary file this old belongs to a process that died mid-write
_HEX = re.compile(r"^[0-9a-f]{64}$")


class EntryError(ValueError):
    """A cache entry is unusable; the message says why (truncated, checksum mismatch, another fingerprint...)."""


# -- options ------------------------------------------------------------------------------------------------------
def _directory_problem(path: str) -> str | None:
    """Why ``path`` cannot serve as a cache directory, or None. Creates nothing: it is created at the first write."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is not writable"
        return None
    ancestor = os.path.dirname(path)
    while ancestor and not os.path.exists(ancestor) and ancestor != os.path.dirname(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"cannot be created: {ancestor!r} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {ancestor!r} is not writable"
    return None


def _parse_dir(value: object, source: str) -> str:
    """An absolute, writable (or creatable) directory; "" disables the cache."""
    if not isinstance(value, str | os.PathLike):
        raise OptionError(f"{source}={value!r} must be a directory path (a string)")
    text = os.fspath(value)
    if not text.strip():
        return ""
    # Absolute now, so a later os.chdir does not move the cache.
    path = os.path.abspath(os.path.expanduser(text))
    problem = _directory_problem(path)
    if problem:
        raise OptionError(
            f"{source}={value!r}: the export cache directory {path!r} {problem}; "
            "allowed: a writable directory, or unset/empty to disable the export cache"
        )
    return path


def _parse_count(value: object, source: str) -> int:
    """An integer >= 0 (0 = no limit)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if number is None or number < 0:
        raise OptionError(f"{source}={value!r} is not allowed; allowed: an integer >= 0 (0 = no limit)")
    return number


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _parse_size(value: object, source: str) -> int:
    """Bytes: an integer >= 0, or a string such as ``"500MiB"``, ``"2G"`` (binary units; 0 = no limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise OptionError(
            f"{source}={value!r} is not allowed; allowed: a byte count >= 0 such as 1073741824, '500MiB' or '2G' "
            "(0 = no limit)"
        )
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


@attrs.frozen
class ExportCacheOptions:
    """Options of the export cache; none of them shapes a graph, so the plugin contributes no export key."""

    dir: str = option("", _parse_dir, "directory of exported graphs (unset: no cache)", "ORTMODULE_CACHE_DIR")
    max_entries: int = option(
        256,
        _parse_count,
        "entries kept in the directory, least recently used evicted (0: no limit)",
        "ORTCORE_EXPORT_CACHE_MAX_ENTRIES",
    )
    max_bytes: int = option(
        0, _parse_size, "total size of the entries, e.g. '2GiB' (0: no limit)", "ORTCORE_EXPORT_CACHE_MAX_BYTES"
    )


# -- what the core's fingerprint does not see ---------------------------------------------------------------------
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
    for dist in sorted(set(_distributions().get(top, ()))):  # scanning installed distributions takes ~0.1 s: once
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


def _describe_code(code: types.CodeType) -> list[Any]:
    consts = [_describe_code(c) if isinstance(c, types.CodeType) else _describe_plain(c) for c in code.co_consts]
    return [code.co_qualname, hashlib.sha256(code.co_code).hexdigest(), list(code.co_names), consts]


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
            raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
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
    finally:
        seen.discard(id(value))


def _hooks_of(owner: Any, prefix: str = "") -> list[Any]:
    """Hooks in registration order with their flags, without the handle ids that key them."""
    described = []
    for main, flags in _HOOKS:
        hooks = getattr(owner, prefix + main, None) or {}
        flag_dicts = [getattr(owner, prefix + f, None) or {} for f in flags]
        described.append(
            [main, [[_describe(hook, set(), 0), [bool(d.get(k)) for d in flag_dicts]] for k, hook in hooks.items()]]
        )
    return described


def _global_hooks() -> list[Any]:
    from torch.nn.modules import module as nn_module

    return _hooks_of(nn_module, "_global")


def module_digest(module: torch.nn.Module) -> str:
    """A digest of what shapes the traced graph beyond the core's fingerprint.

    The core's fingerprint sees the module's printed form and its parameters and buffers. The tracer also bakes in
    the code of every class it runs (a model file edited between runs, a library upgraded), plain attributes that
    ``repr`` hides (``self.scale = 2.0``, a Hugging Face config's attention implementation), the train/eval flag of
    each submodule (a frozen batch norm in eval inside a training model), forward hooks, tensors kept as plain
    attributes (constants in the graph) and torch's default dtype. All of them are hashed here.
    """
    seen_classes: dict[type, None] = {}
    modules = []
    for name, sub in module.named_modules(remove_duplicate=False):
        for cls in type(sub).__mro__:
            if not _skip_class(cls):
                seen_classes.setdefault(cls)
        state = {k: v for k, v in vars(sub).items() if k not in _MODULE_BOOKKEEPING and k not in _IGNORED_ATTRIBUTES}
        kind = f"{type(sub).__module__}.{type(sub).__qualname__}"
        modules.append([name, kind, _describe(state, set(), 0), _hooks_of(sub)])
    parts = {
        "classes": [_class_entry(cls) for cls in seen_classes],
        "modules": modules,
        "global_hooks": _global_hooks(),
        "default_dtype": str(torch.get_default_dtype()),
    }
    text = json.dumps(parts, sort_keys=True, default=lambda v: _ADDRESS.sub("", repr(v)))
    return hashlib.sha256(text.encode()).hexdigest()


# -- entries --------------------------------------------------------------------------------------------------------
def encode_entry(payload: bytes, *, fingerprint: str, digest: str, rank: int, export_seconds: float = 0.0) -> bytes:
    """Header line, JSON header line, payload. The header names what the entry is for and checks the payload."""
    header = {
        "fingerprint": fingerprint,
        "module_digest": digest,
        "rank": rank,
        "graph_format": GRAPH_FORMAT,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "export_seconds": round(export_seconds, 4),
        "python": sys.version.split()[0],
    }
    return b"%s %d\n%s\n%s" % (MAGIC, ENTRY_FORMAT, json.dumps(header, sort_keys=True).encode(), payload)


def decode_entry(data: bytes, *, fingerprint: str, digest: str, rank: int) -> tuple[bytes, dict[str, Any]]:
    """The payload and header of an entry, checked against what the caller expects; raises EntryError."""
    first, _, rest = data.partition(b"\n")
    if not first.startswith(MAGIC + b" "):
        raise EntryError("not an ortcore export-cache entry (bad magic)")
    if first != b"%s %d" % (MAGIC, ENTRY_FORMAT):
        raise EntryError(f"entry format {first[len(MAGIC) + 1 :][:16]!r}, expected {ENTRY_FORMAT}")
    line, newline, payload = rest[:MAX_HEADER].partition(b"\n")
    if not newline:
        raise EntryError("truncated or garbled header")
    payload = rest[len(line) + 1 :]
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EntryError(f"garbled header ({e})") from e
    if not isinstance(header, dict):
        raise EntryError("garbled header (not an object)")
    expected = {"fingerprint": fingerprint, "module_digest": digest, "rank": rank, "graph_format": GRAPH_FORMAT}
    for key, value in expected.items():
        if header.get(key) != value:
            raise EntryError(f"header {key} is {header.get(key)!r}, expected {value!r} (a renamed or foreign entry)")
    if header.get("size") != len(payload):
        raise EntryError(f"truncated: {len(payload)} payload bytes, header says {header.get('size')}")
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise EntryError("checksum mismatch (the payload was modified or garbled)")
    return payload, header


def _check_graph(graph: ExportedGraph, module: torch.nn.Module) -> None:
    """A graph whose inputs are neither arguments nor the model's state belongs to another model."""
    state = set(module.state_dict(keep_vars=True))
    users = set(graph.user_input_names)
    foreign = [n for n in graph.input_names if n not in state and n not in users]
    if foreign:
        raise EntryError(f"graph inputs {foreign[:5]} are neither arguments nor state of {type(module).__name__}")


def _rank() -> int:
    """The torch.distributed rank, or 0: ranks never share entries."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@attrs.frozen
class ExportCache:
    """The entries of one directory: load, store (atomically) and evict least-recently-used ones."""

    directory: str
    max_entries: int = 0
    max_bytes: int = 0

    def entry_path(self, fingerprint: str, digest: str, rank: int) -> str:
        return os.path.join(self.directory, f"{fingerprint}.{digest[:16]}.rank{rank}{ENTRY_SUFFIX}")

    def load(self, module: torch.nn.Module, fingerprint: str, digest: str, rank: int) -> ExportedGraph | None:
        """The graph stored for this key, or None (a miss, or an unusable entry, which is removed)."""
        path = self.entry_path(fingerprint, digest, rank)
        try:
            with open(path, "rb") as f:
                identity = _identity(os.fstat(f.fileno()))
                data = f.read()
        except FileNotFoundError:
            logger.info(
                "export cache miss %s (rank %d): %s", fingerprint[:12], rank, self._miss_reason(fingerprint, rank)
            )
            return None
        except OSError as e:
            logger.warning("export cache: cannot read %s (%s); exporting", path, e)
            return None
        try:
            payload, header = decode_entry(data, fingerprint=fingerprint, digest=digest, rank=rank)
            graph = ExportedGraph.from_bytes(payload, module)
            _check_graph(graph, module)
        except Exception as e:  # whatever a damaged pickle raises, the answer is the same: rebuild
            logger.warning(
                "export cache entry %s is unusable (%s: %s); removed it and exporting again", path, type(e).__name__, e
            )
            self._remove(path, identity)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used is evicted first
        logger.info(
            "export cache hit %s (rank %d): loaded %s, skipping an export that took %.2f s",
            fingerprint[:12],
            rank,
            os.path.basename(path),
            float(header.get("export_seconds") or 0.0),
        )
        return graph

    def _miss_reason(self, fingerprint: str, rank: int) -> str:
        try:
            siblings = [n for n in os.listdir(self.directory) if n.startswith(fingerprint + ".")]
        except OSError:
            return "no entry"
        if any(n.endswith(f".rank{rank}{ENTRY_SUFFIX}") for n in siblings):
            return "an entry with this fingerprint exists, but the model's code, attributes or hooks changed"
        return "no entry"

    def store(self, fingerprint: str, digest: str, rank: int, graph: ExportedGraph) -> str:
        """Write the entry atomically (temporary file in the same directory, then os.replace); returns its path."""
        data = encode_entry(
            graph.to_bytes(), fingerprint=fingerprint, digest=digest, rank=rank, export_seconds=graph.export_seconds
        )
        path = self.entry_path(fingerprint, digest, rank)
        os.makedirs(self.directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{os.path.basename(path)}.", suffix=TMP_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # readers see the old entry or the new one, never half of one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        logger.info(
            "export cache stored %s (rank %d): %s, %d bytes", fingerprint[:12], rank, os.path.basename(path), len(data)
        )
        self.evict(keep=path)
        return path

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least-recently-used entries beyond the limits (never ``keep``) and writers' stale temporary files."""
        entries = []
        now = time.time()
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            return []
        for e in scan:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # removed by another process meanwhile
            if e.name.startswith(".") and e.name.endswith(TMP_SUFFIX):
                if now - st.st_mtime > STALE_TMP_SECONDS:
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)
            elif e.name.endswith(ENTRY_SUFFIX) and e.is_file(follow_symlinks=False):
                entries.append((st.st_mtime_ns, e.name, st.st_size, e.path))
        if not self.max_entries and not self.max_bytes:
            return []
        entries.sort(reverse=True)  # newest first; the name breaks ties so every process agrees
        if keep is not None:
            entries.sort(key=lambda entry: entry[3] != keep)  # stable: the kept entry first, then newest first
        removed, count, total = [], 0, 0
        for _mtime, _name, size, path in entries:
            count, total = count + 1, total + size
            over = (self.max_entries and count > self.max_entries) or (self.max_bytes and total > self.max_bytes)
            if over and path != keep:
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(path)
                count, total = count - 1, total - size
        if removed:
            logger.info("export cache evicted %d least recently used entries from %s", len(removed), self.directory)
        return removed

    @staticmethod
    def _remove(path: str, identity: tuple[int, int, int]) -> None:
        """Remove a bad entry unless another process has meanwhile replaced it with a new one."""
        try:
            if _identity(os.stat(path)) == identity:
                os.unlink(path)
        except OSError:
            pass


def cache_for(config: Config) -> ExportCache | None:
    """The cache configured for this host, or None if no directory is set."""
    options = config.plugin_options(PLUGIN_NAME)
    if not isinstance(options, ExportCacheOptions):  # registered under another name: find our options by type
        options = next((o for o in config.plugins.values() if isinstance(o, ExportCacheOptions)), None)
    if options is None or not options.dir:
        return None
    return ExportCache(options.dir, options.max_entries, options.max_bytes)


# The digest computed when the core asked for a graph, reused when it stores the export: tracing may run the
# model itself (ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT=0) and change its attributes, and the next process looks
# entries up with the state before its own export.
_pending: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()


# -- hooks ----------------------------------------------------------------------------------------------------------
@hookimpl
def ortcore_options_class() -> type:
    return ExportCacheOptions


@hookimpl
def ortcore_load_export(config: Config, module: torch.nn.Module, fingerprint: str) -> ExportedGraph | None:
    cache = cache_for(config)
    if cache is None:
        return None
    if not _HEX.match(fingerprint):  # the file name is built from it: accept only what the core computes
        logger.warning("export cache: ignoring a fingerprint that is not a sha256 hex digest: %r", fingerprint[:80])
        return None
    try:
        digest = module_digest(module)
    except Exception as e:  # an attribute we cannot describe must not stop training: export, and do not store
        logger.warning(
            "export cache: cannot digest %s (%s: %s); exporting without the cache",
            type(module).__name__,
            type(e).__name__,
            e,
        )
        _pending.pop(module, None)
        return None
    _pending[module] = (fingerprint, digest)
    return cache.load(module, fingerprint, digest, _rank())


@hookimpl
def ortcore_export_done(config: Config, module: torch.nn.Module, fingerprint: str, graph: ExportedGraph) -> None:
    cache = cache_for(config)
    pending = _pending.pop(module, None)
    if cache is None or pending is None or pending[0] != fingerprint:
        return
    path = cache.entry_path(fingerprint, pending[1], _rank())
    try:
        cache.store(fingerprint, pending[1], _rank(), graph)
    except Exception as e:  # a full disk or an unpicklable output type costs the next process an export, no more
        logger.warning("export cache: cannot write %s (%s: %s); training goes on without it", path, type(e).__name__, e)
