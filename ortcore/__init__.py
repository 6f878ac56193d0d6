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

from . import hf as _hf  # noqa: E402, F401  (registers the Hugging Face cache adapter)
from .audit import GradientMismatchError  # noqa: E402
from .errors import (  # noqa: E402
    GraphBuildError,
    OptionError,
    OptionTypeError,
    ORTCoreError,
    UnsupportedDataError,
    UnsupportedDeviceError,
    UnsupportedModelError,
)
from .module import ORTModule  # noqa: E402
from .options import ONNX_OPSET_VERSION, DebugOptions, FallbackPolicy, LogLevel  # noqa: E402

__version__ = "0.1.0"

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
