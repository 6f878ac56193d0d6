"""Automatic mixed precision (``torch.autocast``) as the core sees it: a state that shapes the exported graph.

Autocast decides, per op, whether it runs in the low-precision type or in float32 and casts its inputs; the
exporters trace those casts, so a graph exported under autocast computes autocast's numbers. The state is therefore
part of a call's :class:`~ortcore.state.GraphKey` (``autocast``): entering or leaving autocast, or changing its
dtype, is another graph. Three rules keep the graph and the run apart:

* the export runs under the key's autocast state (:func:`autocast_as`), whichever thread exports;
* ORT's forward and backward run with autocast off (:func:`running_graph`): the graph already holds autocast's
  casts, and PyTorch kernels ORT calls back into for one op (ATen nodes) must compute in the types the graph gives
  them, not be cast again; PyTorch code that stands for a part of the model (a routed module, a custom Function's
  forward) runs under the graph's autocast state again (:func:`graph_autocast`);
* the gradient audit's PyTorch reference runs under the call's autocast, as the user's own eager run would.

Which low-precision nodes ORT can run, and where the others go, is the ``mixed_precision`` plugin's decision.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

# The autocast device types the core follows: the ones ORTModule runs on.
DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, str], ...]:
    """The autocast state of this thread: ``(device type, dtype name)`` per device type autocast is on for, e.g.
    ``(("cpu", "bfloat16"),)``; ``()`` when it is off."""
    state = []
    for device in DEVICE_TYPES:
        if torch.is_autocast_enabled(device):
            state.append((device, str(torch.get_autocast_dtype(device)).removeprefix("torch.")))
    return tuple(state)


def describe(state: tuple[tuple[str, str], ...]) -> str:
    """``cpu bfloat16`` for ``(("cpu", "bfloat16"),)``; ``off`` for ``()``."""
    return ", ".join(f"{device} {dtype}" for device, dtype in state) or "off"


def low_precision_dtype(state: tuple[tuple[str, str], ...], device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on ``device_type`` under ``state``, or None when it is off there."""
    for device, dtype in state:
        if device == device_type:
            return getattr(torch, dtype)
    return None


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Autocast exactly as ``state`` says, for every device type the core follows (on for the ones it names, off for
    the others), whatever this thread's own state is."""
    with contextlib.ExitStack() as stack:
        on = dict(state)
        for device in DEVICE_TYPES:
            if device in on:
                stack.enter_context(torch.autocast(device, dtype=getattr(torch, on[device])))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


_graph = threading.local()


@contextlib.contextmanager
def running_graph(state: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """Around ORT's runs of a graph exported under ``state``: autocast off for this thread (nothing done when it is
    off already), and ``state`` remembered for the PyTorch code the graph calls back into (:func:`graph_autocast`)."""
    previous = getattr(_graph, "state", ())
    _graph.state = state
    try:
        if not any(torch.is_autocast_enabled(device) for device in DEVICE_TYPES):
            yield
            return
        with contextlib.ExitStack() as stack:
            for device in DEVICE_TYPES:
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield
    finally:
        _graph.state = previous


def graph_autocast() -> contextlib.AbstractContextManager[None]:
    """For PyTorch code that runs *in place of a part of the model* inside an ORT run (a module routed to PyTorch, a
    custom autograd Function's forward): the autocast state the graph was exported under, as the model's own code
    ran under it. Kernels that stand for one op of the graph (ATen nodes) run in the graph's types instead."""
    state = getattr(_graph, "state", ())
    return autocast_as(state) if state else contextlib.nullcontext()
