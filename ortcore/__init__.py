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


def _block_upstream_ortmodule() -> None:
    """Keep ``import onnxruntime`` from importing upstream's ORTModule.

    onnxruntime-training's package check imports ``onnxruntime.training.ortmodule`` on every ``import onnxruntime``:
    on current PyTorch that import fails (``cannot import name 'jit_utils'``) after about 0.6 s spent importing sympy
    and its shape inference, time every ortcore process paid before its first step. A stub module in its place fails
    at once with an ImportError naming ortcore, which the check expects and ignores.
    """
    name = "onnxruntime.training.ortmodule"
    if name in _sys.modules or "onnxruntime" in _sys.modules:
        return
    import types

    stub = types.ModuleType(name, "Upstream ORTModule, which does not import on this PyTorch: use ortcore.ORTModule.")

    def __getattr__(attr: str) -> _Any:
        # AttributeError, not ImportError: code that scans every loaded module (torch.compile's cache pickler,
        # inspect) expects it; ``from onnxruntime.training.ortmodule import ORTModule`` still raises ImportError.
        raise AttributeError(
            f"onnxruntime.training.ortmodule.{attr}: upstream's ORTModule does not work with this PyTorch; "
            "ortcore.ORTModule replaces it"
        )

    stub.__getattr__ = __getattr__  # type: ignore[attr-defined]
    _sys.modules[name] = stub


import importlib as _importlib  # noqa: E402
from typing import Any as _Any  # noqa: E402

_block_upstream_ortmodule()

from .version import ORTCORE_VERSION as __version__  # noqa: E402, F401 (the package's version)

# The public names, imported on first access (PEP 562): `import ortcore` and the `ortcore` command's --help and
# --version stay free of torch and ONNX Runtime. name -> module that defines it.
_LAZY = {
    "ORTModule": ".module",
    "GradientMismatchError": ".errors",
    "StepCheckError": ".errors",
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
    "StepCheckError",
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
