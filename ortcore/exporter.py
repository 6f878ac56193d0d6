"""The exporter seam: turns a flat module (tensors in, tensors out) into an ``onnx.ModelProto``.

:class:`Exporter` is the whole interface the core relies on; exporters are plugins, registered by name
(``ortcore_register``). The default, ``torchscript``, is the built-in ``torchscript_exporter`` plugin; another
exporter (the dynamo one, say) only has to implement ``export`` with the same contract: graph inputs named
``input_names`` followed by the module's parameters and buffers under their ``state_dict`` names, graph outputs
named ``output_names``, every input dimension dynamic. What every exporter shares is here: the export lock, the
quieting of an exporter's noise, telling the model's own errors from the exporter's, the names of the exporters.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import onnx
import torch

from .errors import UnsupportedDataError, UnsupportedModelError
from .options import LogLevel

logger = logging.getLogger("ortcore")


@attrs.frozen
class ExportRequest:
    """What an exporter is asked to export: ``module`` (flat: tensors in, tensors out) called on ``args``, its graph
    inputs named ``input_names`` (the tensors of ``args``, then whatever the exporter adds, such as parameters),
    ``output_names`` (empty: the exporter's own), ``dynamic_axes`` per input name (an input or dimension not named
    there keeps the size it has in ``args``: the graph serves only that size), in ``training`` mode, at ``opset``,
    logging at ``log_level``."""

    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    training: bool
    opset: int
    log_level: LogLevel


class Exporter(Protocol):
    """Turns a flat module into an ONNX graph (:class:`ExportRequest` in, ``onnx.ModelProto`` out). ``name`` is part
    of every graph key; an exporter with settings that change its graphs also defines ``fingerprint() -> dict``
    (JSON-serialisable) so that caches tell them apart."""

    name: str

    def export(self, request: ExportRequest) -> onnx.ModelProto: ...


# -- custom autograd Functions: the vocabulary of the ortcore_autograd_function_handler hook -------------------------

AUTOGRAD_FUNCTION_PLUGIN = "autograd_function"
INLINE = "inline"  # a handler's answer: trace through the Function's forward, as if it were ordinary code


def custom_autograd_disabled(env: Mapping[str, str]) -> bool:
    """``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0`` or the older ``ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT=1``."""
    return env.get("ORTMODULE_ENABLE_CUSTOM_AUTOGRAD", "").strip().lower() in ("0", "false", "no", "off") or env.get(
        "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT", ""
    ).strip().lower() in ("1", "true", "yes", "on")


def raised_in(error: BaseException, function: Callable[..., Any]) -> bool:
    """Whether ``error`` was raised while ``function`` ran (its traceback passes through the function's code).

    An exporter calls this with the traced module's ``forward``: an exception from there is the model's own (a wrong
    argument type, a shape error), which PyTorch would raise too, not a failure to convert the traced graph.
    """
    code = getattr(function, "__code__", None)
    if code is None or isinstance(error, (UnsupportedDataError, UnsupportedModelError)):
        return False
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


@contextlib.contextmanager
def quiet_export(log_level: LogLevel, *, loggers: tuple[str, ...] = ()):
    """An exporter's noise kept to ortcore's log level: above INFO its Python warnings are ignored and ``loggers``
    show only errors; VERBOSE adds the exporter's own graph dump.

    Nothing here touches the process's file descriptors or ``sys.stdout``: another thread printing meanwhile would
    lose its output (or keep writing to a deleted file). What the exporter would print is prevented at its source
    instead (the ``torchscript_exporter`` plugin switches torch's IR dump off). Callers hold :data:`EXPORT_LOCK`, as the warning filters and logger levels
    changed here are process-wide."""
    with contextlib.ExitStack() as stack:
        if log_level > LogLevel.INFO:
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            for name in loggers:
                stack.enter_context(_logger_level(logging.getLogger(name), logging.ERROR))
        yield


# Exports run one at a time in the process: the TorchScript exporter keeps its state in process-wide globals (a
# second thread's export fails with "GLOBALS.in_onnx_export must be True"), symbolics are registered process-wide,
# torch.export patches torch while it traces, and quiet_export changes warning filters and logger levels.
EXPORT_LOCK = threading.RLock()


@contextlib.contextmanager
def _logger_level(log: logging.Logger, level: int):
    previous = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(previous)


def refuse_empty_inputs(args: tuple[Any, ...], input_names: list[str]) -> None:
    """Raise :class:`UnsupportedDataError` when a training export's example input is empty (a batch of 0).

    The first step of a new graph runs ORT's backward at once (the gradient audit), and ORT's CPU ``ConvGrad`` dies
    of SIGFPE on empty tensors, taking the process with it; other gradient kernels fail (Gemm, Reshape). The fallback
    policy then applies, naming the input.
    """
    for name, value in zip(input_names, args):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == 0:
            raise UnsupportedDataError(
                f"input {name!r} has a dimension of size 0 (shape {tuple(value.shape)}) in the call a training graph "
                "would be exported for: ONNX Runtime's training kernels cannot run empty tensors (ConvGrad kills the "
                "process). Skip empty batches, or run them without ORTModule"
            )


TORCHSCRIPT = "torchscript"
DYNAMO = "dynamo"
_switch_logged = False


def torchscript_available() -> bool:
    """Does this torch still ship the TorchScript exporter (``torch.onnx.export(dynamo=False)``)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("torch.onnx._internal.torchscript_exporter") is not None
    except (ImportError, ValueError):
        return False


def exporter_name(config) -> str:
    """The exporter ``config`` asks for: its ``exporter`` option, except that ``torchscript`` becomes ``dynamo`` (one
    INFO line per process) on a torch without the TorchScript exporter."""
    global _switch_logged
    name = config.core.exporter
    if name == TORCHSCRIPT and not torchscript_available():
        if not _switch_logged:
            _switch_logged = True
            logger.info(
                "this torch (%s) has no TorchScript exporter (torch.onnx.export(dynamo=False)): exporting with the "
                "dynamo route (torch.export + onnxscript) instead",
                torch.__version__,
            )
        return DYNAMO
    return name
