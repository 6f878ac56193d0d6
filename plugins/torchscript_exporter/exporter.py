"""The TorchScript exporter (``torch.onnx.export(dynamo=False)``) with the symbolics ORT's training engine needs,
and its retry loop: an export that stops at an op it cannot express asks plugins for a symbolic and runs again."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from typing import Any

import onnx
import torch

from ortcore.api import (
    EXPORT_LOCK,
    INLINE,
    ExportRequest,
    LogLevel,
    UnsupportedDataError,
    UnsupportedModelError,
    quiet_export,
    raised_in,
    refuse_empty_inputs,
)
from ortcore_plugins.services.autograd_functions import python_op_symbolic, tracing_through
from ortcore_plugins.services.pooling import POOLING_VERSION
from ortcore_plugins.services.torchscript_symbolics import SYMBOLICS

from .registration import register_symbolics

ATEN_FALLBACK_PLUGIN = "aten_fallback"  # runs ops without an ONNX symbolic (named in the exporter's error)

_UNSUPPORTED_OP = re.compile(r"operator '?([\w:.]+)'?")


@contextlib.contextmanager
def _no_ir_dump(verbose: bool) -> Iterator[None]:
    """The TorchScript exporter's C++ log (``_jit_onnx_log``: the graph it exported, or "Torch IR graph at
    exception" when an op has no symbolic, written to std::cout) on only when ``verbose``.

    torch's ``setup_onnx_logging`` reads ``_C._jit_is_onnx_log_enabled`` without calling it, so it takes the log as
    already on: every export switches it on for good, and a failed export dumps the whole graph on the terminal.
    Its replacement here leaves the switch alone; the switch is set for this export and restored after. Callers
    hold :data:`EXPORT_LOCK` (the switch and the replaced function are process-wide).
    """
    try:
        from torch.onnx._internal.torchscript_exporter import utils
    except ImportError:  # another torch layout: nothing to replace
        utils = None

    @contextlib.contextmanager
    def setup_onnx_logging(verbose: bool) -> Iterator[None]:
        yield

    was_on = torch._C._jit_is_onnx_log_enabled()
    original = getattr(utils, "setup_onnx_logging", None)
    if original is not None:
        utils.setup_onnx_logging = setup_onnx_logging
    torch._C._jit_set_onnx_log_enabled(verbose)
    try:
        yield
    finally:
        torch._C._jit_set_onnx_log_enabled(was_on)
        if original is not None:
            utils.setup_onnx_logging = original


MAX_EXPORT_RETRIES = 33  # exports of one model: the first, then one per op plugins make exportable


class TorchScriptExporter:
    """The TorchScript exporter (``dynamo=False``) with the symbolics ORT's training engine needs.

    ``symbolics`` adds or replaces symbolics (plugins contribute them through ``ortcore_export_symbolics``; the
    ``autograd_function`` plugin contributes ``prim::PythonOp``). Without a plugin for it, a custom autograd Function
    is traced through when ``inline_autograd_functions`` (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0``) and refused
    otherwise, naming the plugin to enable.
    """

    name = "torchscript"

    def __init__(self, symbolics: dict[str, Any] | None = None, *, inline_autograd_functions: bool = False):
        self.inline_autograd_functions = inline_autograd_functions
        self._on_failure: Callable[[UnsupportedModelError], dict | None] | None = None
        default = python_op_symbolic(self._no_function_handler)
        self.symbolics = {**SYMBOLICS, "prim::PythonOp": default, **(symbolics or {})}

    def _no_function_handler(self, function: type) -> str | None:
        return INLINE if self.inline_autograd_functions else None

    def use_function_handlers(self, ask: Callable[[type], Any]) -> None:
        """Export every custom autograd Function as ``ask(function_class)`` answers (the
        ``ortcore_autograd_function_handler`` hook); no answer means the default: traced through when
        ``inline_autograd_functions``, refused otherwise."""
        self.symbolics["prim::PythonOp"] = python_op_symbolic(lambda f: ask(f) or self._no_function_handler(f))

    def fingerprint(self) -> dict[str, Any]:
        return {"inline_autograd_functions": self.inline_autograd_functions, "pooling": POOLING_VERSION}

    def use_hooks(self, hooks: Any, config: Any = None) -> None:
        """Ask ``hooks`` (``ortcore_export_failed``) for symbolics when an export stops at an op the exporter cannot
        express (no symbolic, or one that refuses these arguments), then export again: at most
        :data:`MAX_EXPORT_RETRIES` times. The symbolics added stay for the model's later exports."""
        self._on_failure = lambda error: hooks.export_failed(error, self.symbolics, config)

    def export(self, request: ExportRequest) -> onnx.ModelProto:
        for _ in range(MAX_EXPORT_RETRIES):
            try:
                return self._export_once(request)
            except UnsupportedModelError as e:
                added = self._on_failure(e) if self._on_failure is not None else None
                if not added:
                    raise
                self.symbolics.update(added)
        raise UnsupportedModelError(
            f"{type(request.module).__name__} uses more than {MAX_EXPORT_RETRIES} ops the TorchScript exporter cannot "
            "express"
        )

    def _export_once(self, request: ExportRequest) -> onnx.ModelProto:
        module, args, log_level, opset = request.module, request.args, request.log_level, request.opset
        input_names, output_names, dynamic_axes = request.input_names, request.output_names, request.dynamic_axes
        if request.training:
            refuse_empty_inputs(args, input_names)
        buffer = io.BytesIO()
        handler_for = getattr(self.symbolics.get("prim::PythonOp"), "handler_for", None)
        try:
            with (
                EXPORT_LOCK,
                quiet_export(log_level),
                _no_ir_dump(log_level == LogLevel.VERBOSE),
                tracing_through(handler_for),
            ):
                register_symbolics(self.symbolics, opset)
                torch.onnx.export(
                    module,
                    args,
                    buffer,
                    dynamo=False,
                    opset_version=opset,
                    do_constant_folding=False,
                    # PRESERVE: every submodule keeps its own mode (a frozen batch norm in a training model).
                    training=torch.onnx.TrainingMode.PRESERVE,
                    export_params=False,
                    keep_initializers_as_inputs=True,
                    input_names=input_names,
                    output_names=output_names,
                    dynamic_axes=dynamic_axes,
                    verbose=log_level == LogLevel.VERBOSE,
                )
        except (UnsupportedDataError, UnsupportedModelError):
            raise  # already names what is wrong (a symbolic raised it)
        except Exception as e:  # the exporter raises many types; all mean "this model did not export"
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            match = _UNSUPPORTED_OP.search(str(e))
            what = f"op {match.group(1)}" if match else "the model"
            hint = ""
            if (
                match
                and match.group(1).startswith("aten::")
                and isinstance(e, torch.onnx.errors.UnsupportedOperatorError)
            ):
                hint = (
                    f"; the {ATEN_FALLBACK_PLUGIN!r} plugin can run it in ORT with PyTorch's kernel: list it in "
                    f"[plugins.{ATEN_FALLBACK_PLUGIN}] fallback_ops (or ORTCORE_ATEN_FALLBACK_OPS={match.group(1)}, or auto)"
                )
            raise UnsupportedModelError(
                f"the TorchScript exporter could not export {what} of {type(module).__name__}: {text}{hint}",
                raised_in_forward=e if raised_in(e, type(module).forward) else None,
            ) from e
        return onnx.load_model_from_string(buffer.getvalue())
