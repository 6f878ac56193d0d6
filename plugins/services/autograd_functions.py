"""Custom ``torch.autograd.Function`` calls while a model is traced, on either route.

A Function with its own ``symbolic`` staticmethod is exported by it (torch calls it before any ``prim::PythonOp``
symbolic). Every other Function reaches :func:`python_op_symbolic` on the TorchScript route, which asks a handler
per Function class (the ``ortcore_autograd_function_handler`` hook: :data:`ortcore.api.INLINE`, or an object that
writes the node); :func:`tracing_through` makes the tracer record the forward of those answered ``INLINE``. The
dynamo route sees the calls through :func:`function_apply_replaced`. Used by ``torchscript_exporter`` (its default
when no plugin answers), ``autograd_function`` and ``dynamo_exporter``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from ortcore.api import AUTOGRAD_FUNCTION_PLUGIN, INLINE, UnsupportedModelError

# Reentrant activation checkpointing, the one torch Function a handler decides about (see the autograd_function plugin).
TORCH_CHECKPOINT_FUNCTION = "torch.utils.checkpoint.CheckpointFunction"


def function_name(function: type) -> str:
    """The fully qualified name of a Function class, as ``ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS`` lists them."""
    return f"{function.__module__}.{function.__qualname__}"


def inline_autograd_function(g, node) -> list:
    """Export the body the tracer recorded for one Function call (its forward) in place of the call."""
    from torch.onnx._internal.torchscript_exporter._globals import GLOBALS

    blocks = list(node.blocks())
    if not blocks:
        raise UnsupportedModelError(
            f"the exporter recorded no body for autograd Function {node.kind()}; cannot inline it"
        )
    body = blocks[0]
    env = g.env
    for inner, outer in zip(body.inputs(), node.inputs()):
        env[inner] = env[outer]
    env = torch._C._jit_pass_onnx_block(body, g.block, GLOBALS.operator_export_type, env, g.values_in_env, True)
    return [env[output] for output in body.outputs()]


class _TracingContext:
    """The ``ctx`` of a Function traced through: records what forward asks for, which only backward would read."""

    def __init__(self, args: tuple):
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        self.saved_tensors: tuple = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors) -> None:
        pass

    def mark_dirty(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _trace_through(function: type, args: tuple, kwargs: dict) -> Any:
    from torch.autograd.function import _SingleLevelFunction

    if function.setup_context is not _SingleLevelFunction.setup_context:  # forward(*args) + setup_context style
        return function.forward(*args, **kwargs)
    return function.forward(_TracingContext(args), *args, **kwargs)


# Function.apply is replaced once for all threads while any thread has a replacement in force (reference counted);
# each thread's replacements are its own stack, innermost first. Replacing and restoring the class attribute per
# thread instead let threads that overlapped (each model's first-step check, another's export) restore each other's
# wrappers: one thread's replacement stayed in force for the others, and their gradients came out wrong.
_replacements = threading.local()
_install_lock = threading.Lock()
_installed = 0
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"]


def _dispatch(cls, *args, **kwargs):
    stack = getattr(_replacements, "stack", None)
    if not stack:
        return _TORCH_APPLY.__func__(cls, *args, **kwargs)
    return _call_from(len(stack) - 1, cls, args, kwargs)


def _call_from(level: int, cls: type, args: tuple, kwargs: dict) -> Any:
    """Replacement ``level`` of this thread's stack; the "original" it is given is the next one out (torch's own
    apply below the outermost)."""
    if level < 0:
        return _TORCH_APPLY.__func__(cls, *args, **kwargs)
    replacement = _replacements.stack[level]
    return replacement(cls, lambda c, *a, **k: _call_from(level - 1, c, a, k), args, kwargs)


@contextlib.contextmanager
def function_apply_replaced(replacement: Callable[..., Any]):
    """Inside, ``SomeFunction.apply(*args, **kwargs)`` of every ``torch.autograd.Function`` subclass calls
    ``replacement(cls, apply, args, kwargs)``, where ``apply(cls, *args, **kwargs)`` is torch's own (or the
    replacement entered before this one on the same thread); restored after. Exporters use it to see or redirect
    custom Functions while tracing. Only calls on the thread that entered are replaced: another thread's model (an
    ORTModule's own step is a Function) runs as it would without it."""
    global _installed
    stack = getattr(_replacements, "stack", None)
    if stack is None:
        stack = _replacements.stack = []
    with _install_lock:
        if _installed == 0:
            torch.autograd.Function.apply = classmethod(_dispatch)
        _installed += 1
    stack.append(replacement)
    try:
        yield
    finally:
        stack.pop()
        with _install_lock:
            _installed -= 1
            if _installed == 0:
                torch.autograd.Function.apply = _TORCH_APPLY


@contextlib.contextmanager
def tracing_through(handler_for: Callable[[type], Any] | None):
    """While tracing, call the forward of each Function whose handler answers :data:`INLINE` as ordinary code, so
    that the tracer records its ops (the body torch records for a Function call is wrong for some Functions, e.g.
    with non-differentiable outputs)."""
    if handler_for is None:
        yield
        return

    def apply(cls, original, args, kwargs):
        if torch.jit.is_tracing() and getattr(cls, "symbolic", None) is None:
            handler = _handler(handler_for, cls)
            if handler == INLINE or getattr(handler, "traces_through", lambda _args: False)(args):
                return _trace_through(cls, args, kwargs)
            replace_call = getattr(handler, "replace_call", None)
            if replace_call is not None:  # the handler traces something else in place of the call
                return replace_call(args, kwargs)
        return original(cls, *args, **kwargs)

    with function_apply_replaced(apply):
        yield


def _handler(handler_for: Callable[[type], Any], function: type) -> Any:
    """The handler of ``function``: :data:`INLINE` or an object with ``export(g, node, args)``; its optional
    ``check()`` may refuse the Function (raising), its optional ``traces_through(args)`` may ask to trace through
    one call, and its optional ``replace_call(args, kwargs)`` is traced in place of the call; no handler is an error naming the plugin to enable."""
    handler = handler_for(function)
    if handler is None:
        raise UnsupportedModelError(
            f"the model calls the custom autograd Function {function_name(function)} and no plugin runs it: "
            f"enable the {AUTOGRAD_FUNCTION_PLUGIN!r} plugin (remove it from [plugins] disable or "
            "ORTCORE_DISABLE_PLUGINS), or set ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0 to trace through it"
        )
    if handler != INLINE and hasattr(handler, "check"):
        handler.check()
    return handler


def python_op_symbolic(handler_for: Callable[[type], Any]):
    """The ``prim::PythonOp`` symbolic: ``handler_for(function_class)`` answers :data:`INLINE`, None (no plugin runs
    it: an :class:`UnsupportedModelError` naming the plugin to enable) or a handler whose ``export(g, node, args)``
    returns the node's outputs."""

    def python_op(g, *args, **_attributes):
        node = g.original_node
        function = getattr(node.pyobj(), "__self__", None)
        if not (isinstance(function, type) and issubclass(function, torch.autograd.Function)):
            raise UnsupportedModelError(
                f"cannot export Python call {node.pyname()!r}: it is not a torch.autograd.Function"
            )
        handler = _handler(handler_for, function)
        if handler == INLINE:
            return inline_autograd_function(g, node)
        return handler.export(g, node, args)

    python_op.handler_for = handler_for  # the exporter traces through the Functions it answers INLINE for
    return python_op
