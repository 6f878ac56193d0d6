"""Activation taps: a model's activations as extra outputs of its graph, handed to the model's step recorder.

The core's half of activation recording. A plugin (the built-in ``subscriber_manager``, whose
``GlobalSubscriberManager`` users call) attaches a :class:`StepRecorder` to a model with :func:`attach_recorder`.
Each training step of an ORTModule wrapping that model asks the recorder whether it records the step; if it does,
the graph is exported with taps: while the exporter traces, the recorder's own module hooks hand tensors to the
:class:`Tapper` of :func:`tapping`, and each becomes an extra graph output (``ExportedGraph.taps``), read, never
differentiated. The step then hands the tapped outputs, and their gradients from ORT's backward, to the recorder.
:class:`SubscriberBase` is the protocol of the subscribers a recorder serves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

# Activations are flattened through schema's leaf adapters, the Hugging Face cache adapter among them (registered on
# import). ORTModule's outputs need it too.
from . import hf as _hf  # noqa: F401


class SubscriberBase:
    """What a subscriber implements; override any callback, the defaults do nothing.

    Steps are counted per subscribed model: each top-level ``forward`` in training mode starts one (the first is
    step 0). Within a step, forward outputs and gradients are numbered in one sequence, ``order``, in execution
    order: forward outputs as each module returns (children before their parent), then gradients as autograd
    computes them. Callbacks run only for steps in ``[start_step, end_step)``.

    Example::

        class Printer(SubscriberBase):
            def on_forward(self, step, order, name, tensor):
                print(step, order, name, tensor.shape)

    Args:
        start_step: the first step whose activations are delivered (default: 0).
        end_step: the step at which delivery stops, exclusive (default: never).

    Attributes:
        engine: what computed the current step's tensors, set before ``on_step_start``: ``"torch"`` for a plain
            model, ``"ortcore"`` when an :class:`ortcore.ORTModule` ran the step in ONNX Runtime.
    """

    engine: str = "torch"

    def __init__(self, start_step: int | None = None, end_step: int | None = None):
        if start_step is not None and end_step is not None and end_step <= start_step:
            raise ValueError(f"end_step={end_step} must be greater than start_step={start_step}")
        self.start_step = start_step
        self.end_step = end_step

    def is_active(self, step: int) -> bool:
        """Whether this subscriber takes part in ``step`` (no hook work is done for steps nobody wants)."""
        return (self.start_step is None or step >= self.start_step) and (self.end_step is None or step < self.end_step)

    def on_subscribe(self, model: torch.nn.Module) -> None:
        """The subscriber was attached to ``model`` (called once, before any step)."""

    def on_step_start(self, step: int) -> None:
        """A training step begins: the model's top-level forward was called in training mode."""

    def on_forward(self, step: int, order: int, name: str, tensor: torch.Tensor) -> None:
        """A forward output (or a named intermediate from ``inspect_activation``); do not modify it."""

    def on_backward(self, step: int, order: int, name: str, grad: torch.Tensor) -> None:
        """The gradient of the activation ``name``; do not modify it."""

    def on_step_end(self, step: int) -> None:
        """``step`` is over: called when the next step starts, or at ``GlobalSubscriberManager.unsubscribe``
        (a step's backward may run any time after its forward, so only the next step proves it finished)."""

    def on_unsubscribe(self, model: torch.nn.Module) -> None:
        """The model was unsubscribed (after the last ``on_step_end``): close files, flush buffers."""


def _flatten_with_path(value: Any) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """``value``'s leaves with their pytree paths (``""`` for a bare tensor, ``.logits``, ``[0]``, ...).

    Leaf types pytree does not know are offered once to ortcore's leaf adapters (a Hugging Face cache, say), as
    ORTModule does with its outputs, so a plain model and an ORTModule see the same activations.
    """
    from .errors import UnsupportedDataError
    from .schema import flatten_adapted

    try:
        pairs, spec = flatten_adapted(value, "activation")
    except (ValueError, TypeError, NotImplementedError, UnsupportedDataError):  # a type without key paths, say
        flat, spec = pytree.tree_flatten(value)
        return [(f"[{i}]", leaf) for i, leaf in enumerate(flat)], spec
    return [(pytree.keystr(path), leaf) for path, leaf in pairs], spec


def _tensor_leaves(value: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with its pytree path."""
    return [(path, leaf) for path, leaf in _flatten_with_path(value)[0] if isinstance(leaf, torch.Tensor)]


def tensor_leaves(value: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with its pytree path."""
    return [(path, leaf) for path, leaf in _flatten_with_path(value)[0] if isinstance(leaf, torch.Tensor)]


def is_tracing() -> bool:
    """An exporter is running the model (TorchScript tracing, or torch.export on the dynamo route): not a step."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


class Tapper:
    """Collects a model's activations while an ORTModule exports it (see :func:`tapping`).

    Nothing in the model changes: each activation tensor is only remembered, in execution order, and the exporter
    makes it an extra output of the graph (ORT then computes it in its own run, and its gradient can be fetched
    from the backward graph). A tensor that several modules return (a zero-rate dropout's output, a model output
    that is also a submodule's) is one value in the graph, as it is one tensor in torch. ``owner`` is the recorder
    whose hooks tap (None: anyone's, as the gradient audit's own tapper).
    """

    def __init__(self, owner: Any = None):
        self.owner = owner
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forget what an earlier tracing run collected (an exporter may run the forward more than once)."""
        self.names.clear()
        self.tensors.clear()

    def tap(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.tensors.append(tensor)

    def tap_output(self, path: str, output: Any) -> None:
        """Collect every tensor leaf of ``output`` under ``path`` + its pytree path (as :func:`tensor_leaves`)."""
        for key, tensor in tensor_leaves(output):
            self.tap(path + key, tensor)


_local = threading.local()


def current_tapper() -> Tapper | None:
    """The tapper of the export running on this thread, if it collects taps."""
    return getattr(_local, "tapper", None)


@contextlib.contextmanager
def tapping(owner: Any = None) -> Iterator[Tapper]:
    """While an ORTModule exports a recorded model: the tensors ``owner``'s hooks tap become extra graph outputs."""
    previous = current_tapper()
    _local.tapper = tapper = Tapper(owner)
    try:
        yield tapper
    finally:
        _local.tapper = previous


class StepRecorder(Protocol):
    """What an ORTModule's step asks of the recorder attached to its model (:func:`attach_recorder`)."""

    def next_step_active(self) -> bool:
        """Whether a training step started now would be recorded: the step's graph is then exported with taps."""

    def start_step(self, engine: str) -> Any:
        """Start the next step (``engine`` computed it: "ortcore"); returns its state to record into, or None."""

    def deliver_forward(self, state: Any, name: str, tensor: torch.Tensor) -> None:
        """A tapped activation of the step ``state``."""

    def deliver_backward(self, state: Any, name: str, grad: torch.Tensor) -> None:
        """The gradient of the tapped activation ``name``, from ORT's backward."""

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Calls of the model inside are no step of the recorder (a check's own PyTorch run)."""


_recorders: dict[int, tuple[torch.nn.Module, StepRecorder]] = {}


def attach_recorder(model: torch.nn.Module, recorder: StepRecorder) -> None:
    """Record ``model``'s steps with ``recorder`` (replacing any other); an ORTModule wrapping it asks it each step."""
    _recorders[id(model)] = (model, recorder)


def detach_recorder(model: torch.nn.Module) -> None:
    _recorders.pop(id(model), None)


def recorder_of(model: torch.nn.Module) -> StepRecorder | None:
    """The recorder attached to ``model`` (the model an ORTModule wraps), if any."""
    found = _recorders.get(id(model))
    return found[1] if found is not None and found[0] is model else None


@contextlib.contextmanager
def subscribers_paused(model: torch.nn.Module) -> Iterator[None]:
    """A run of ``model`` that is no step of its recorder (a check's own PyTorch run): it neither starts a step nor
    records one."""
    recorder = recorder_of(model)
    if recorder is None:
        yield
        return
    with recorder.paused():
        yield
