"""Exceptions. Each failure kind maps to one fallback-policy flag, so the policy decides what falls back."""

from __future__ import annotations


class ORTCoreError(Exception):
    """Base class of ortcore's errors."""


class OptionError(ORTCoreError, ValueError):
    """A bad option, argument or environment variable; the message names the value and what is allowed."""


class UnsupportedDataError(ORTCoreError, TypeError):
    """An input or output that ortcore cannot pass to or from an ONNX graph."""


class UnsupportedModelError(ORTCoreError, TypeError):
    """A module that cannot be wrapped or exported (the message names the op or module)."""


class UnsupportedDeviceError(ORTCoreError, RuntimeError):
    """Inputs and parameters on a device the session cannot serve."""


class GraphBuildError(ORTCoreError, RuntimeError):
    """ONNX Runtime failed to build the gradient graph or the session for an exported model."""
