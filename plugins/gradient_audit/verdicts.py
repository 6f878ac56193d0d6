"""Passed audit verdicts kept on disk beside the export cache, so a later process does not audit the same graph again.

A graph that passed its audit is recorded as ``<export cache dir>.audit-verdicts/<key>.json`` (a directory beside
the export cache's, whose own directory holds its entries only); a later process
(``ORTMODULE_CACHE_DIR`` set, the export cache enabled) whose first step resolves to a graph with the same key takes
the verdict instead of running the audit. The key (:func:`verdict_key`) is a sha256 over:

- the graph fingerprint the core computed for the step's export (:func:`ortcore.identity.graph_fingerprint`: input
  schema and sizes, train/eval, opset, exporter, the module's structure, the code of its classes, hidden attributes,
  hooks, graph passes, plugins' export keys, library versions), read from the ``ortcore_load_export`` and
  ``ortcore_export_done`` hooks; a graph whose fingerprint was not seen there gets no key and is always audited;
- the bytes of the forward graph ONNX Runtime runs and of the training graph built from it (the gradient build,
  the gradient-graph passes, the trained parameters and inputs that get gradients): what ORT computes, exactly;
- the versions of torch, onnx, onnxruntime and ortcore, the source of this plugin, the tolerances, the autocast
  state, the device, torch's thread count and this machine's CPU (model name and instruction-set flags).

Only ``passed`` is recorded; a mismatch, a graph not audited or an ORT failure never is, so they are audited again.
A verdict file that cannot be read, does not parse or names another key is ignored (logged at INFO), the audit runs
and the file is written again. Files are written atomically (``ortcore.api.atomic_writer``). A directory that other
users can write to, or a verdict file another user owns, is not trusted unless the export cache's ``trust_shared``
is set (the same rule as the export cache): a planted verdict would switch an audit off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import weakref
from pathlib import Path
from typing import Any

import attrs

from ortcore.api import atomic_writer, versions

logger = logging.getLogger("ortcore")

VERDICT_FORMAT = 1
SUFFIX = ".audit-verdicts"  # the verdicts' directory: the export cache directory's path with this added
_MAX_BYTES = 64 * 1024  # a verdict is a few hundred bytes; a larger file is not one

# The graph fingerprint of each exported graph, as the core passed it to the export hooks.
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def remember_fingerprint(graph: Any, fingerprint: str) -> None:
    """Record ``graph``'s fingerprint (from ``ortcore_load_export``'s result or ``ortcore_export_done``)."""
    try:
        _FINGERPRINTS[graph] = fingerprint
    except TypeError:  # not weak-referenceable: never keyed, always audited
        pass


def fingerprint_of(graph: Any) -> str | None:
    try:
        return _FINGERPRINTS.get(graph)
    except TypeError:
        return None


def _plugin_source_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in sorted(here.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _cpu_identity() -> str:
    """Model name and flags of the first CPU in /proc/cpuinfo (ORT and torch pick kernels by instruction set)."""
    import platform

    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            seen = set()
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen.add(key)
                    parts.append(f"{key}={value.strip()}")
                if not line.strip() and seen:
                    break
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


_STATIC: dict[str, str] = {}


def _static_parts() -> dict[str, str]:
    """What does not change within a process: versions, this plugin's source, the CPU (computed once)."""
    if not _STATIC:
        _STATIC.update({f"version:{k}": v for k, v in versions().items()})
        _STATIC["audit_source"] = _plugin_source_digest()
        _STATIC["cpu"] = _cpu_identity()
    return _STATIC


def verdict_key(req: Any) -> str | None:
    """The key a passed verdict of ``req`` (an :class:`.audit.AuditRequest`) is stored under, or None when the graph's
    fingerprint is unknown (the graph is then always audited)."""
    import torch

    fingerprint = fingerprint_of(req.graph)
    if fingerprint is None:
        return None
    h = hashlib.sha256()

    def part(name: str, value: Any) -> None:
        data = value if isinstance(value, bytes) else str(value).encode()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)

    part("format", VERDICT_FORMAT)
    part("fingerprint", fingerprint)
    part("forward_graph", req.graph.model.SerializeToString(deterministic=True))
    part("training_graph", req.session.model.SerializeToString(deterministic=True))
    part("feeds", json.dumps(list(req.session.feed_names)))
    part("handed_over", json.dumps(sorted(req.session.grads_handed_over)))
    part("trainable", json.dumps(list(req.trainable)))
    part("inputs_requiring_grad", json.dumps([bool(t.requires_grad) for t in req.tensors]))
    part("tolerances", f"{req.rtol!r} {req.atol!r}")
    part("autocast", repr(tuple(req.autocast)))
    part("device", str(getattr(req.session, "device", "")))
    part("threads", torch.get_num_threads())
    for name, value in sorted(_static_parts().items()):
        part(name, value)
    return h.hexdigest()


@attrs.frozen
class VerdictStore:
    """The verdicts directory of one export cache directory."""

    directory: Path
    trust_shared: bool = False
    cache_dir: Path | None = None  # the export cache's directory: refused by it, refused here

    @classmethod
    def for_config(cls, config: Any) -> VerdictStore | None:
        """The store beside the export cache configured for ``config``, or None (no cache directory, or the export
        cache plugin disabled)."""
        options = config.plugin_options("export_cache")
        directory = getattr(options, "dir", "") if options is not None else ""
        if not directory:
            return None
        cache_dir = Path(directory)
        return cls(
            cache_dir.with_name(cache_dir.name + SUFFIX), bool(getattr(options, "trust_shared", False)), cache_dir
        )

    def _cache_dir_refused(self) -> bool:
        return self.cache_dir is not None and self.cache_dir.exists() and self._untrusted(self.cache_dir) is not None

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _untrusted(self, path: Path) -> str | None:
        """Why ``path`` (the directory or a file) cannot be trusted, or None."""
        if self.trust_shared:
            return None
        st = path.stat()
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            return f"{path} is owned by another user (uid {st.st_uid})"
        if stat.S_ISDIR(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            return f"{path} is writable by other users"
        return None

    def load(self, key: str) -> dict[str, Any] | None:
        """The recorded verdict of ``key``, or None (none, unreadable, garbled, another key, untrusted)."""
        path = self.path(key)
        try:
            if self._cache_dir_refused():
                return None  # the export cache says why
            why = self._untrusted(self.directory) or self._untrusted(path)
            if why:
                logger.warning("gradient audit: not using the recorded verdict %s: %s", path, why)
                return None
            with open(path, "rb") as f:
                data = f.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.info("gradient audit: cannot read the recorded verdict %s (%s); auditing", path, e)
            return None
        try:
            if len(data) > _MAX_BYTES:
                raise ValueError("too large")
            record = json.loads(data.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not an object")
            if record.get("format") != VERDICT_FORMAT or record.get("key") != key or record.get("status") != "passed":
                raise ValueError("another format, key or status")
            if not isinstance(record.get("graph"), str):
                raise ValueError("'graph' is not a string")
            if not isinstance(record.get("compared"), int) or not isinstance(record.get("seconds"), float | int):
                raise ValueError("'compared' or 'seconds' is not a number")
            worst = record.get("worst")
            if worst is not None and not (
                isinstance(worst, dict)
                and isinstance(worst.get("kind"), str)
                and isinstance(worst.get("name"), str)
                and all(isinstance(worst.get(k), float | int) for k in ("max_abs", "max_rel", "used"))
            ):
                raise ValueError("'worst' is not a difference")
        except (UnicodeDecodeError, ValueError) as e:
            logger.info("gradient audit: ignoring the garbled verdict %s (%s); auditing again", path, e)
            return None
        return record

    def store(self, key: str, record: dict[str, Any]) -> None:
        """Write ``record`` as the verdict of ``key`` (atomically); a failure to write is logged, never raised."""
        path = self.path(key)
        try:
            if self._cache_dir_refused():
                return  # the export cache refuses it too, and says so
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self._untrusted(self.directory):
                return
            with atomic_writer(path) as f:
                json.dump({"format": VERDICT_FORMAT, "key": key, **record}, f, sort_keys=True)
        except Exception as e:  # a full disk costs the next process an audit, no more (the export cache warns)
            logger.info("gradient audit: cannot record the verdict in %s (%s: %s)", path, type(e).__name__, e)
