"""export_cache: reuse exported graphs across processes, so a restarted job skips the ONNX export.

When ``ORTMODULE_CACHE_DIR`` (or ``[plugins.export_cache] dir``) is set, every graph ortcore exports is written to
that directory, and a later process that wraps the same model and calls it with the same input schema loads the
graph instead of exporting again. Entries are keyed by the fingerprint the core computes before each export
(:func:`ortcore.identity.graph_fingerprint`: input schema, train/eval, opset, exporter, the module's structure, the
code of its classes, its hidden attributes, hooks and tensor attributes, torch's default dtype, graph passes,
plugins' export keys, library versions) and by the torch.distributed rank.

An entry holds data only: a header (magic, format, fingerprint, rank, payload size and sha256) followed by
:meth:`ortcore.graph.ExportedGraph.to_bytes` (a JSON line and the ONNX model's bytes); reading one runs no code.
A graph whose parts cannot be stored as data is not cached (logged at INFO). A truncated, garbled, foreign or
stale entry is logged at WARNING, removed and exported again (and the new graph stored in its place); it never
raises and never serves a wrong graph. Entries are written with :func:`ortcore.files.atomic_writer`, so concurrent
writers (ranks, jobs) are safe.

A graph whose kernel choices are not final (``ortcore.graph.PROVISIONAL_METADATA``: decided by the default list for
now, or measured on a busy machine) is stored too, under its state: ``<key>.rank<r>.<state>.ortgraph`` (``deferred``,
``provisional``...), beside the final graph's ``<key>.rank<r>.ortgraph``. A process loads the best graph on file: the
final one if any process stored it, else the newest graph of another state (the one the last process ran, which then
finishes its kernel choice as that process would have). Storing a final graph removes the key's other states.

The cache also keeps the graph ONNX Runtime optimized when it created each training session (``<key>.rank<r>.ortsession``,
same header): a later process that builds the same gradient graph with the same session settings, ONNX Runtime
version and CPU loads it with graph optimizations off, which takes most of session creation off its first step
(BERT hidden 256 x 4 layers: 234 ms -> 32 ms). Sessions with settings ORT may refuse (``plan.add_optional``) are not
cached this way.

A directory that other users can write to (group- or world-writable without the sticky bit, or owned by another
user) is refused with a warning unless ``trust_shared`` is set; so is an entry owned by another user.

Options (``[plugins.export_cache]`` in ortcore.toml, or the environment)::

    [plugins.export_cache]
    dir = "~/.cache/ortcore"   # env ORTMODULE_CACHE_DIR; unset or "" disables the cache
    max_entries = 256          # env ORTCORE_EXPORT_CACHE_MAX_ENTRIES; 0 = no limit (graphs and session graphs each)
    max_bytes = "2GiB"         # env ORTCORE_EXPORT_CACHE_MAX_BYTES; 0 = no limit
    trust_shared = false       # env ORTCORE_EXPORT_CACHE_TRUST_SHARED; use a directory others can write to
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import sys
import time
from typing import Any

import attrs
import onnx
import onnxruntime
import torch

from ortcore.api import (
    GRAPH_FORMAT,
    PROVISIONAL_METADATA,
    Config,
    ExportedGraph,
    OptionError,
    atomic_writer,
    hookimpl,
    option,
    parse_bool,
)

logger = logging.getLogger("ortcore.export_cache")

PLUGIN_NAME = "export_cache"
MAGIC = b"ORTCORE-EXPORT-CACHE"
ENTRY_FORMAT = 2  # bump when the header layout or the payload changes (2: data only; 1 held a pickle)
ENTRY_SUFFIX = ".ortgraph"
SESSION_SUFFIX = ".ortsession"  # ORT's optimized training graph of a session, keyed by session_key()
REPAIRS_SUFFIX = ".repairs.json"  # the repairs a model needed (ortcore.repair), keyed by its unrepaired fingerprint
TMP_SUFFIX = ".tmp"
MAX_HEADER = 4096  # a header longer than this is garbage, not a header
STALE_TMP_SECONDS = 3600.0  # a writer's temporary file this old belongs to a process that died mid-write
_HEX = re.compile(r"^[0-9a-f]{64}$")
_STATE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")  # a state tag: it is part of a file name
FINAL = ""  # the state of a graph whose choices are final: the entry name carries no tag


def state_of(graph: ExportedGraph) -> str:
    """The state tag of a graph's entry: :data:`FINAL` (``""``) unless the graph is marked provisional
    (``PROVISIONAL_METADATA``), else the words in the mark's last parentheses (``"kernel choices not final
    (deferred, provisional)"`` -> ``"deferred-provisional"``), or ``"provisional"`` if it has none."""
    mark = next((p.value for p in graph.model.metadata_props if p.key == PROVISIONAL_METADATA), None)
    if mark is None:
        return FINAL
    inside = mark.rpartition("(")[2].partition(")")[0] if "(" in mark else ""
    words = re.findall(r"[a-z0-9]+", inside.lower())
    return "-".join(words[:4]) or "provisional"


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
    trust_shared: bool = option(
        False,
        parse_bool,
        "use a directory other users can write to, and entries they wrote (refused otherwise)",
        "ORTCORE_EXPORT_CACHE_TRUST_SHARED",
    )


# -- entries --------------------------------------------------------------------------------------------------------
def encode_entry(
    payload: bytes, *, fingerprint: str, rank: int, export_seconds: float = 0.0, state: str = FINAL
) -> bytes:
    """Header line, JSON header line, payload. The header names what the entry is for and checks the payload."""
    header = {
        "fingerprint": fingerprint,
        "rank": rank,
        "state": state or "final",
        "graph_format": GRAPH_FORMAT,
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "export_seconds": round(export_seconds, 4),
        "python": sys.version.split()[0],
    }
    return b"%s %d\n%s\n%s" % (MAGIC, ENTRY_FORMAT, json.dumps(header, sort_keys=True).encode(), payload)


def decode_entry(data: bytes, *, fingerprint: str, rank: int, state: str | None = None) -> tuple[bytes, dict[str, Any]]:
    """The payload and header of an entry, checked against what the caller expects (``state``: the graph's kernel
    choice state, checked when given; an entry written before states existed is final); raises EntryError."""
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
    expected: dict[str, Any] = {"fingerprint": fingerprint, "rank": rank, "graph_format": GRAPH_FORMAT}
    if state is not None:
        expected["state"] = state or "final"
        header.setdefault("state", "final")
    for key, value in expected.items():
        if header.get(key) != value:
            raise EntryError(f"header {key} is {header.get(key)!r}, expected {value!r} (a renamed or foreign entry)")
    if header.get("size") != len(payload):
        raise EntryError(f"truncated: {len(payload)} payload bytes, header says {header.get('size')}")
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        raise EntryError("checksum mismatch (the payload was modified or garbled)")
    return payload, header


def _check_graph(graph: ExportedGraph, module: torch.nn.Module) -> None:
    """A graph whose inputs are neither arguments nor the model's state belongs to another model.

    The names come from ``named_parameters``/``named_buffers``, not ``state_dict()``: that runs the model's
    state-dict hooks, and an engine's (FSDP2's reshards the blocks) would change the model in the middle of a step."""
    state = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    state |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
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


# -- who may write the directory ------------------------------------------------------------------------------------
def sharing_problem(st: os.stat_result) -> str | None:
    """Why a directory with this status lets other users write entries this process would load, or None.

    Another user's directory, or one that group or others may write without the sticky bit (which stops them from
    replacing or removing files they do not own), is shared. On systems without user ids (Windows) nothing is.
    """
    if not hasattr(os, "geteuid"):
        return None
    if st.st_uid != os.geteuid():
        return f"is owned by another user (uid {st.st_uid}; this process runs as uid {os.geteuid()})"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not st.st_mode & stat.S_ISVTX:
        who = " and ".join(w for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "all users")) if writable & bit)
        return f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit)"
    return None


_warned: set[tuple[str, str]] = set()  # (directory, reason): a refused directory is reported once per process


def _warn_once(directory: str, reason: str, message: str, *args: Any) -> None:
    if (directory, reason) not in _warned:
        _warned.add((directory, reason))
        logger.warning(message, *args)


@attrs.frozen
class ExportCache:
    """The entries of one directory: load, store (atomically) and evict least-recently-used ones."""

    directory: str
    max_entries: int = 0
    max_bytes: int = 0
    trust_shared: bool = False

    def entry_path(self, fingerprint: str, rank: int, suffix: str = ENTRY_SUFFIX, state: str = FINAL) -> str:
        if state and not _STATE.match(state):
            raise ValueError(f"export cache: state {state!r} is not allowed; allowed: lowercase words joined by '-'")
        tag = f".{state}" if state else ""
        return os.path.join(self.directory, f"{fingerprint}.rank{rank}{tag}{suffix}")

    def candidates(self, fingerprint: str, rank: int) -> list[tuple[str, str]]:
        """``(state, path)`` of the entries of a key, best first: the final graph, then the other states' graphs,
        newest first (the graph the last process ran)."""
        prefix = f"{fingerprint}.rank{rank}."
        others = []
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            scan = []
        for e in scan:
            if not (e.name.startswith(prefix) and e.name.endswith(ENTRY_SUFFIX)):
                continue
            state = e.name[len(prefix) : -len(ENTRY_SUFFIX)]
            if not _STATE.match(state):
                continue
            try:
                others.append((e.stat().st_mtime_ns, state, e.path))
            except OSError:
                continue  # removed meanwhile
        others.sort(reverse=True)
        return [(FINAL, self.entry_path(fingerprint, rank))] + [(state, path) for _, state, path in others]

    def trusted(self) -> bool:
        """Whether the directory may be used: only this user can write entries into it, or the user trusts those
        who can (``trust_shared``). A directory that does not exist yet is created by this process (mode 0700)."""
        if self.trust_shared:
            return True
        try:
            problem = sharing_problem(os.stat(self.directory))
        except FileNotFoundError:
            return True
        except OSError as e:
            _warn_once(self.directory, str(e), "export cache: cannot inspect %s (%s); not using it", self.directory, e)
            return False
        if problem is None:
            return True
        _warn_once(
            self.directory,
            problem,
            "export cache: not using %s: it %s, so other users could plant graphs this process would run. Use a "
            "directory only you can write, or, if everyone who can write it is trusted, opt in with "
            "ORTCORE_EXPORT_CACHE_TRUST_SHARED=1 ([plugins.export_cache] trust_shared = true)",
            self.directory,
            problem,
        )
        return False

    def load(
        self, module: torch.nn.Module, fingerprint: str, rank: int, final_only: bool = False
    ) -> ExportedGraph | None:
        """The best graph stored for this key (final, else the newest of another state; only a final one with
        ``final_only``), or None (a miss, or only unusable entries, which are removed)."""
        for state, path in self.candidates(fingerprint, rank)[: 1 if final_only else None]:
            graph = self._load_entry(module, fingerprint, rank, state, path)
            if graph is not None:
                return graph
        logger.info("export cache miss %s (rank %d): no usable entry", fingerprint[:12], rank)
        return None

    def _load_entry(
        self, module: torch.nn.Module, fingerprint: str, rank: int, state: str, path: str
    ) -> ExportedGraph | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("export cache: cannot read %s (%s); exporting", path, e)
            return None
        if not self.trust_shared and hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            logger.warning(
                "export cache: ignoring %s: it is owned by another user (uid %d); exporting. Opt in with "
                "ORTCORE_EXPORT_CACHE_TRUST_SHARED=1 if everyone who can write %s is trusted",
                path,
                st.st_uid,
                self.directory,
            )
            return None
        try:
            payload, header = decode_entry(data, fingerprint=fingerprint, rank=rank, state=state)
            graph = ExportedGraph.from_bytes(payload, module)
            _check_graph(graph, module)
        except Exception as e:  # whatever damaged data raises, the answer is the same: rebuild
            logger.warning(
                "export cache entry %s is unusable (%s: %s); removed it and exporting again", path, type(e).__name__, e
            )
            self._remove(path, _identity(st))
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used is evicted first
        logger.info(
            "export cache hit %s (rank %d): loaded %s%s, skipping an export that took %.2f s",
            fingerprint[:12],
            rank,
            os.path.basename(path),
            f" (kernel choices not final: {state}; the graph an earlier process ran)" if state else "",
            float(header.get("export_seconds") or 0.0),
        )
        return graph

    def store(self, fingerprint: str, rank: int, graph: ExportedGraph, state: str | None = None) -> str:
        """Write the entry of ``graph``'s state (:func:`state_of`, unless given) atomically; returns its path. A
        final graph supersedes the key's entries of other states (removed). Raises ValueError (from
        :meth:`ExportedGraph.to_bytes`) when a part of the graph cannot be stored as data."""
        state = state_of(graph) if state is None else state
        path = self.entry_path(fingerprint, rank, state=state)
        data = encode_entry(
            graph.to_bytes(), fingerprint=fingerprint, rank=rank, export_seconds=graph.export_seconds, state=state
        )
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        with atomic_writer(path, "wb") as f:  # readers see the old entry or the new one, never half of one
            f.write(data)
        logger.info(
            "export cache stored %s (rank %d): %s, %d bytes%s",
            fingerprint[:12],
            rank,
            os.path.basename(path),
            len(data),
            f" (kernel choices not final: {state}; served until a process stores the final graph)" if state else "",
        )
        if not state:
            for _other, other_path in self.candidates(fingerprint, rank)[1:]:
                with contextlib.suppress(OSError):
                    os.unlink(other_path)
                    logger.info("export cache: removed %s, superseded by the final graph", os.path.basename(other_path))
        self.evict(keep=path)
        return path

    def load_session(self, key: str, rank: int) -> bytes | None:
        """ORT's optimized graph stored for session ``key``, or None (a miss, or an unusable entry, removed)."""
        path = self.entry_path(key, rank, SESSION_SUFFIX)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("export cache: cannot read %s (%s); ONNX Runtime optimizes the graph again", path, e)
            return None
        if not self.trust_shared and hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            logger.warning("export cache: ignoring %s: it is owned by another user (uid %d)", path, st.st_uid)
            return None
        try:
            payload, _ = decode_entry(data, fingerprint=key, rank=rank)
            onnx.load_model_from_string(payload)  # a protobuf that does not parse is damage, not a graph
        except Exception as e:
            logger.warning(
                "export cache entry %s is unusable (%s: %s); removed it, ONNX Runtime optimizes the graph again",
                path,
                type(e).__name__,
                e,
            )
            self._remove(path, _identity(st))
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        logger.info("export cache hit %s (rank %d): ORT's optimized session graph", key[:12], rank)
        return payload

    def store_session(self, key: str, rank: int, model_bytes: bytes) -> str:
        """Write ORT's optimized graph for session ``key`` atomically; returns the entry's path."""
        onnx.load_model_from_string(model_bytes)  # raises on a partial file: never store one
        path = self.entry_path(key, rank, SESSION_SUFFIX)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        with atomic_writer(path, "wb") as f:
            f.write(encode_entry(model_bytes, fingerprint=key, rank=rank))
        logger.info(
            "export cache stored %s (rank %d): ORT's optimized session graph, %d bytes",
            key[:12],
            rank,
            len(model_bytes),
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
            elif e.name.endswith((ENTRY_SUFFIX, SESSION_SUFFIX)) and e.is_file(follow_symlinks=False):
                entries.append((st.st_mtime_ns, e.name, st.st_size, e.path))
        if not self.max_entries and not self.max_bytes:
            return []
        removed = []
        for suffix in (ENTRY_SUFFIX, SESSION_SUFFIX):  # the limits hold for graphs and session graphs each
            removed += self._evict_beyond_limits([e for e in entries if e[1].endswith(suffix)], keep)
        if removed:
            logger.info("export cache evicted %d least recently used entries from %s", len(removed), self.directory)
        return removed

    def _evict_beyond_limits(self, entries: list[tuple[int, str, int, str]], keep: str | None) -> list[str]:
        entries.sort(reverse=True)  # newest first; the name breaks ties so every process agrees
        if keep is not None:
            entries.sort(key=lambda entry: entry[3] != keep)  # stable: the kept entry first, then newest first
        removed, count, total = [], 0, 0
        for i, (_mtime, _name, size, path) in enumerate(entries):
            count, total = count + 1, total + size
            over = (self.max_entries and count > self.max_entries) or (self.max_bytes and total > self.max_bytes)
            if over and i > 0:  # the kept (or else the newest) entry of each kind stays
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    removed.append(path)
                count, total = count - 1, total - size
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
    return ExportCache(options.dir, options.max_entries, options.max_bytes, options.trust_shared)


# -- hooks ----------------------------------------------------------------------------------------------------------
@hookimpl
def ortcore_options_class() -> type:
    return ExportCacheOptions


# Per host (a process has one; tests make several): the keys whose graph of a state other than final this host ran
# (loaded or exported). Asked for such a key again, the host is exporting again (``export_again``: a measurement
# decided differently) or wraps the model anew; either way the graph it ran is not what it wants: only a final one
# is served, else the export runs and decides with what the host has learnt since.
_ran_not_final: dict[int, tuple[Any, set[tuple[str, int]]]] = {}


def _not_final_keys(config: Config) -> set[tuple[str, int]]:
    import weakref

    key = id(config)
    entry = _ran_not_final.get(key)
    if entry is None or entry[0]() is not config:
        try:
            ref: Any = weakref.ref(config, lambda _: _ran_not_final.pop(key, None))
        except TypeError:  # not weakly referable: held for the process
            ref = lambda config=config: config  # noqa: E731
        entry = _ran_not_final[key] = (ref, set())
    return entry[1]


@hookimpl
def ortcore_load_export(config: Config, module: torch.nn.Module, fingerprint: str) -> ExportedGraph | None:
    cache = cache_for(config)
    if cache is None or not cache.trusted():
        return None
    if not _HEX.match(fingerprint):  # the file name is built from it: accept only what the core computes
        logger.warning("export cache: ignoring a fingerprint that is not a sha256 hex digest: %r", fingerprint[:80])
        return None
    ran = _not_final_keys(config)
    graph = cache.load(module, fingerprint, _rank(), final_only=(fingerprint, _rank()) in ran)
    if graph is not None and state_of(graph):
        ran.add((fingerprint, _rank()))
    return graph


@hookimpl
def ortcore_export_done(config: Config, module: torch.nn.Module, fingerprint: str, graph: ExportedGraph) -> None:
    cache = cache_for(config)
    if cache is None or not _HEX.match(fingerprint) or not cache.trusted():
        return
    # A graph whose kernel choices are for now only is stored too, under its state: the next process runs it
    # instead of exporting, and a final graph (stored by whichever process has one) takes precedence.
    state = state_of(graph)
    if state:
        _not_final_keys(config).add((fingerprint, _rank()))
    path = cache.entry_path(fingerprint, _rank(), state=state)
    try:
        cache.store(fingerprint, _rank(), graph, state)
    except ValueError as e:  # a part that is not data (an output type defined in a function): never pickled
        logger.info("export cache: the graph of %s is not cached: %s", type(module).__name__, e)
    except Exception as e:  # a full disk costs the next process an export, no more
        logger.warning("export cache: cannot write %s (%s: %s); training goes on without it", path, type(e).__name__, e)


# -- repairs ----------------------------------------------------------------------------------------------------------
@hookimpl
def ortcore_load_repairs(config: Config, module: torch.nn.Module, fingerprint: str) -> list[dict] | None:
    """The repairs an earlier process found for this fingerprint: the next process applies them without searching."""
    cache = cache_for(config)
    if cache is None or not _HEX.match(fingerprint) or not cache.trusted():
        return None
    path = cache.entry_path(fingerprint, _rank(), REPAIRS_SUFFIX)
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.info("export cache: ignoring unreadable repairs %s (%s)", path, e)
        return None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return None
    logger.info("export cache: %d repair(s) of %s found by an earlier process", len(entries), type(module).__name__)
    return entries


@hookimpl
def ortcore_repairs_found(config: Config, module: torch.nn.Module, fingerprint: str, repairs: list[dict]) -> None:
    cache = cache_for(config)
    if cache is None or not _HEX.match(fingerprint) or not cache.trusted():
        return
    path = cache.entry_path(fingerprint, _rank(), REPAIRS_SUFFIX)
    try:
        os.makedirs(cache.directory, mode=0o700, exist_ok=True)
        with atomic_writer(path, "w") as f:
            json.dump(repairs, f, indent=1, default=str)
    except Exception as e:  # the next process searches again, no more
        logger.warning("export cache: cannot write %s (%s: %s); training goes on without it", path, type(e).__name__, e)


# -- ORT's optimized session graphs -----------------------------------------------------------------------------------
def _cpu_identity() -> str:
    """What ORT's optimizations may depend on besides the graph: the CPU's model and instruction-set flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(dict.fromkeys(lines))  # one of each: the cores agree
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


def session_key(graph: Any, plan: Any) -> str:
    """sha256 of everything the optimized graph of a session depends on: the gradient graph, the session settings
    that reach ORT's optimizers, the providers, ORT's version and the CPU."""
    h = hashlib.sha256()
    parts = {
        "format": ENTRY_FORMAT,
        "onnxruntime": onnxruntime.__version__,
        "cpu": hashlib.sha256(_cpu_identity().encode()).hexdigest(),
        "entries": sorted(plan.config_entries.items()),
        "execution_order": str(plan.execution_order),
        "providers": [[name, sorted(options.items())] for name, options in plan.providers],
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    h.update(graph.model.SerializeToString(deterministic=True))
    return h.hexdigest()


# Sessions whose optimized graph ORT is writing for the cache: id(gradient graph) -> (graph, key, path, ours).
_pending: dict[int, tuple[Any, str, str, bool]] = {}
_MAX_PENDING = 8  # a session that failed to be created leaves its entry; keep only the latest few


@hookimpl(trylast=True)  # after every other plugin has filled the plan: the key must see the final settings
def ortcore_session_plan(config: Config, graph: Any, plan: Any) -> None:
    cache = cache_for(config)
    if cache is None or graph.purpose != "train" or plan.optional or plan.prepared_model is not None:
        return
    if not cache.trusted():
        return
    try:
        key = session_key(graph, plan)
    except Exception as e:  # never fail a build over a cache
        logger.info("export cache: session graph not cached (%s: %s)", type(e).__name__, e)
        return
    prepared = cache.load_session(key, _rank())
    if prepared is not None:
        plan.prepared_model = prepared
        return
    ours = plan.optimized_model_filepath is None
    path = plan.optimized_model_filepath
    if ours:
        os.makedirs(cache.directory, mode=0o700, exist_ok=True)
        path = os.path.join(cache.directory, f".{key}.{os.getpid()}.onnx{TMP_SUFFIX}")
        plan.optimized_model_filepath = path
    while len(_pending) >= _MAX_PENDING:
        stale = _pending.pop(next(iter(_pending)))
        if stale[3]:
            with contextlib.suppress(OSError):
                os.unlink(stale[2])
    _pending[id(graph.model)] = (graph.model, key, path, ours)


@hookimpl
def ortcore_session_created(config: Config, session: Any) -> None:
    entry = _pending.pop(id(session.model), None)
    if entry is None or entry[0] is not session.model:
        return
    _, key, path, ours = entry
    cache = cache_for(config)
    if cache is None:
        return
    try:
        with open(path, "rb") as f:
            cache.store_session(key, _rank(), f.read())
    except Exception as e:  # a full disk or a missing file costs the next process ORT's optimizations, no more
        logger.warning(
            "export cache: cannot write ORT's optimized session graph to %s (%s: %s); training goes on without it",
            cache.entry_path(key, _rank(), SESSION_SUFFIX),
            type(e).__name__,
            e,
        )
    finally:
        if ours:
            with contextlib.suppress(OSError):
                os.unlink(path)
