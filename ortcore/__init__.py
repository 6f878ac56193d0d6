"""ortcore: train PyTorch models in ONNX Runtime's training engine.

``ORTModule(model)`` is an ``nn.Module`` whose forward and backward run in ONNX Runtime; everything else (optimizers,
schedulers, ``state_dict``, Hugging Face models) keeps working as with the plain model.
"""

import os as _os
import sys as _sys

# libgomp reads GOMP_SPINCOUNT once, when torch loads it: its default spinning steals the core ORT's kernels need.
# Set it only if ortcore is imported before torch and the user chose nothing (docs/performance.md).
if "torch" not in _sys.modules:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import importlib as _importlib  # noqa: E402
from typing import Any as _Any  # noqa: E402

__version__ = "0.1.0"

# The public names, imported on first access (PEP 562): `import ortcore` and the `ortcore` command's --help and
# --version stay free of torch and ONNX Runtime. name -> module that defines it.
_LAZY = {
    "ORTModule": ".module",
    "GradientMismatchError": ".audit",
    "ORTCoreError": ".errors",
    "OptionError": ".errors",
    "OptionTypeError": ".errors",
    "UnsupportedDataError": ".errors",
    "UnsupportedModelError": ".errors",
    "UnsupportedDeviceError": ".errors",
    "GraphBuildError": ".errors",
    "DebugOptions": ".options",
    "LogLevel": ".options",
    "FallbackPolicy": ".options",
    "ONNX_OPSET_VERSION": ".options",
}

__all__ = [
    "ORTModule",
    "DebugOptions",
    "LogLevel",
    "FallbackPolicy",
    "ONNX_OPSET_VERSION",
    "ORTCoreError",
    "OptionError",
    "OptionTypeError",
    "UnsupportedDataError",
    "UnsupportedModelError",
    "UnsupportedDeviceError",
    "GraphBuildError",
    "GradientMismatchError",
]


def __getattr__(name: str) -> _Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
