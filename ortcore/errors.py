"""Exceptions. Each failure kind maps to one fallback-policy flag, so the policy decides what falls back."""

from __future__ import annotations


class ORTCoreError(Exception):
    """Base class of ortcore's errors."""


class OptionError(ORTCoreError, ValueError):
    """A bad option, argument or environment variable; the message names the value and what is allowed."""


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type (a prefix that is not a string, a log level that is not a ``LogLevel``).

    Also a ``TypeError``, which is what code written for upstream's ``DebugOptions`` expects.
    """


class UnsupportedDataError(ORTCoreError, TypeError):
    """An input or output that ortcore cannot pass to or from an ONNX graph."""


class UnsupportedModelError(ORTCoreError, TypeError):
    """A module that cannot be wrapped or exported (the message names the op or module).

    ``raised_in_forward`` is the exception the model's own forward raised while the exporter traced it (a wrong
    argument type, a shape error), or None when the exporter itself failed. ORTModule then runs the forward in
    PyTorch and, if PyTorch raises too, raises PyTorch's exception instead of falling back.
    """

    def __init__(self, *args: object, raised_in_forward: BaseException | None = None):
        super().__init__(*args)
        self.raised_in_forward = raised_in_forward


class UnsupportedDeviceError(ORTCoreError, RuntimeError):
    """Inputs and parameters on a device the session cannot serve."""


class GraphBuildError(ORTCoreError, RuntimeError):
    """ONNX Runtime failed to build the gradient graph or the session for an exported model."""


class FirstRunError(GraphBuildError):
    """ONNX Runtime built a new graph but failed to run its first training step (forward or backward)."""
