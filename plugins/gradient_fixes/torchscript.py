"""The TorchScript route's part of gradient_fixes: ``no_grad`` regions, which the tracer does not record, read their
inputs through ``detach()`` so the traced graph carries the stop-gradient marker."""

from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

# -- no_grad regions on the TorchScript route ----------------------------------------------------------------------


class NoGradInputsDetached(TorchFunctionMode):
    """While the TorchScript exporter traces, every call made with gradients off reads the tensors that require grad
    through ``detach()``: the traced graph then carries the exporter's stop-gradient marker where torch's autograd
    records nothing.

    The tracer records the ops of a ``torch.no_grad()`` block like any others, so ORT's gradient builder
    differentiates through them: spectral norm's power iteration (``F.normalize(W @ v, out=u)`` under no_grad, then
    ``sigma = u . (W v)``) gets a gradient through ``u`` and ``v`` that torch never computes (the weight's gradient
    came out 1.5% off). Values are unchanged; only where gradients may flow is.

    Not inside a custom autograd Function's forward: torch runs it with gradients off by design, and its gradient is
    the Function's backward, which ORT reproduces by differentiating the traced forward (Reformer's reversible layers
    compute their whole forward under no_grad and recompute it in backward).
    """

    def __init__(self) -> None:
        super().__init__()
        self._forwards: frozenset | None = None  # code objects of every autograd Function's forward

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled() or func in _DETACHING:
            return func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves) or self._in_function_forward():
            return func(*args, **kwargs)
        leaves = [t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in leaves]
        args, kwargs = tree_unflatten(leaves, spec)
        return func(*args, **kwargs)

    def _in_function_forward(self) -> bool:
        if self._forwards is None:
            self._forwards = _function_forwards()
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in self._forwards:
                return True
            frame = frame.f_back
        return False


def _function_forwards() -> frozenset:
    """The code objects of the ``forward`` of every ``torch.autograd.Function`` subclass defined so far."""
    codes, classes = set(), [torch.autograd.Function]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        forward = cls.__dict__.get("forward")
        code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        if code is not None:
            codes.add(code)
    return frozenset(codes)


_DETACHING = frozenset({torch.Tensor.detach, torch.detach, torch.Tensor.detach_, torch.Tensor.requires_grad_})


