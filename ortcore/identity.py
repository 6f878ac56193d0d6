"""What shapes an exported graph: the one definition the state machine, the fingerprint and export caches share.

A call's :class:`ortcore.state.GraphKey` holds what changes from call to call (input structure, dtypes, ranks,
train/eval, opset, exporter); :func:`graph_fingerprint` adds what belongs to the model and the process (the module's
structure, the graph passes, the exporter's symbolics, plugins' export keys, library versions), hashed into one
stable digest that names the graph across processes.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import onnx
import torch

if TYPE_CHECKING:
    from .exporter import Exporter
    from .graph_passes import GraphPass
    from .state import GraphKey


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

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "ortcore": __version__}


def graph_fingerprint(
    key: GraphKey,
    module: torch.nn.Module,
    *,
    passes: Sequence[GraphPass],
    exporter: Exporter,
    plugin_keys: dict[str, Any],
) -> str:
    """The sha256 naming the graph that exporting ``module`` for a call with ``key`` gives."""
    return fingerprint(
        {
            "key": key.export_key,
            "module": module_signature(module),
            "passes": [p.name for p in passes],
            "exporter": exporter_identity(exporter),
            "plugins": plugin_keys,
            "versions": versions(),
        }
    )
