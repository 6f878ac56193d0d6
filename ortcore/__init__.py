"""ortcore: train PyTorch models in ONNX Runtime's training engine.

``ORTModule(model)`` is an ``nn.Module`` whose forward and backward run in ONNX Runtime; everything else (optimizers,
schedulers, ``state_dict``, Hugging Face models) keeps working as with the plain model.
"""

from .errors import (
    GraphBuildError,
    OptionError,
    ORTCoreError,
    UnsupportedDataError,
    UnsupportedDeviceError,
    UnsupportedModelError,
)
from . import hf as _hf  # noqa: F401  (registers the Hugging Face cache adapter)
from .module import ORTModule
from .options import DebugOptions, FallbackPolicy, LogLevel

__version__ = "0.1.0"

__all__ = [
    "ORTModule",
    "DebugOptions",
    "LogLevel",
    "FallbackPolicy",
    "ORTCoreError",
    "OptionError",
    "UnsupportedDataError",
    "UnsupportedModelError",
    "UnsupportedDeviceError",
    "GraphBuildError",
]
