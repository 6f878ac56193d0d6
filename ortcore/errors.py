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


class BufferWriteError(UnsupportedModelError):
    """The forward writes buffers in place in a way the exported graph does not compute: ortcore returns the new
    value of every buffer the forward writes (``buf.mul_(0.9).add_(...)``, ``copy_``, ``+=``, ``index_add_``, ``out=``)
    as a graph output and writes it back after each run, but here the graph's value is the buffer's old one (the
    exporter dropped the write, or it happened in code the exporter did not trace), so every later step would read a
    stale buffer. ``buffers`` names them, ``modules`` their owners (the modules a repair runs in PyTorch, where the
    writes happen as in eager)."""

    def __init__(self, buffers: list[str], modules: list[str], exporter: str):
        self.buffers = list(buffers)
        self.modules = list(modules)
        owners = ", ".join(repr(m) if m else "the model itself" for m in self.modules)
        super().__init__(
            f"the {exporter} exporter traced a forward that writes buffer(s) {', '.join(map(repr, self.buffers))} in "
            f"place (in module {owners}), but its graph does not compute the new value(s), so they cannot be written "
            "back and later steps would read stale values. ortcore runs such a module in PyTorch (region_routing) "
            "when it can; otherwise write the buffer with ops the exporter traces (in-place tensor ops, not .data or "
            "numpy), move the update out of forward, or wrap the model only below that module"
        )


def buffer_owners(names: list[str]) -> list[str]:
    """The module paths that own the buffers ``names`` (dotted, as ``named_buffers`` gives them), in order, once."""
    owners: list[str] = []
    for name in names:
        owner = name.rpartition(".")[0]
        if owner not in owners:
            owners.append(owner)
    return owners


class UnsupportedDeviceError(ORTCoreError, RuntimeError):
    """Inputs and parameters on a device the session cannot serve."""


class GraphBuildError(ORTCoreError, RuntimeError):
    """ONNX Runtime failed to build the gradient graph or the session for an exported model."""


class FirstRunError(GraphBuildError):
    """ONNX Runtime built a new graph but failed to run its first training step (forward or backward)."""


class StepCheckError(ORTCoreError, RuntimeError):
    """A check of a new session's first step (``ortcore_check_first_step``) found ONNX Runtime's step differs from
    PyTorch's. ``module`` names the module a repair should route (None: none named); ``result`` is the check's own
    report, listed by ``ORTModule.gradient_audits``."""

    def __init__(self, message: str, result: object = None, module: str | None = None):
        super().__init__(message)
        self.result = result
        self.module = module


class GradientMismatchError(StepCheckError):
    """The gradient audit (the ``gradient_audit`` plugin) found an output, the loss or a gradient of ONNX Runtime that
    differs from PyTorch's. ``result`` is its ``AuditResult``; ``result.location`` names the module."""


class PluginError(ORTCoreError, RuntimeError):
    """A plugin failed: to import, to configure, or inside a hook (the message names plugin and hook)."""
