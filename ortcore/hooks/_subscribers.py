"""Activation subscribers: forward outputs of every submodule, named intermediates, and their gradients.

:class:`GlobalSubscriberManager` puts forward hooks on every submodule of a plain PyTorch model and tensor hooks on
their outputs; each activation then goes to the model's subscribers (:class:`SubscriberBase` objects), called
directly, never through pluggy. Subscriber classes contributed by plugins (``StatisticsSubscriber``) are found
through the plugin host, see :func:`subscriber_classes`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

# Activations are flattened through schema's leaf adapters, the Hugging Face cache adapter among them (registered on
# import). ORTModule's outputs need it too, and ortcore.module imports this module.
from .. import hf as _hf  # noqa: F401

logger = logging.getLogger("ortcore.hooks")


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
        """A forward output (or a named intermediate from :func:`inspect_activation`); do not modify it."""

    def on_backward(self, step: int, order: int, name: str, grad: torch.Tensor) -> None:
        """The gradient of the activation ``name``; do not modify it."""

    def on_step_end(self, step: int) -> None:
        """``step`` is over: called when the next step starts, or at :meth:`GlobalSubscriberManager.unsubscribe`
        (a step's backward may run any time after its forward, so only the next step proves it finished)."""

    def on_unsubscribe(self, model: torch.nn.Module) -> None:
        """The model was unsubscribed (after the last ``on_step_end``): close files, flush buffers."""


def _flatten_with_path(value: Any) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    """``value``'s leaves with their pytree paths (``""`` for a bare tensor, ``.logits``, ``[0]``, ...).

    Leaf types pytree does not know are offered once to ortcore's leaf adapters (a Hugging Face cache, say), as
    ORTModule does with its outputs, so a plain model and an ORTModule see the same activations.
    """
    from ..errors import UnsupportedDataError
    from ..schema import flatten_adapted

    try:
        pairs, spec = flatten_adapted(value, "activation")
    except (ValueError, TypeError, NotImplementedError, UnsupportedDataError):  # a type without key paths, say
        flat, spec = pytree.tree_flatten(value)
        return [(f"[{i}]", leaf) for i, leaf in enumerate(flat)], spec
    return [(pytree.keystr(path), leaf) for path, leaf in pairs], spec


def _tensor_leaves(value: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with its pytree path."""
    return [(path, leaf) for path, leaf in _flatten_with_path(value)[0] if isinstance(leaf, torch.Tensor)]


def _tracing() -> bool:
    """An exporter is running the model (TorchScript tracing, or torch.export on the dynamo route): not a step."""
    return torch.jit.is_tracing() or torch.onnx.is_in_onnx_export() or torch.compiler.is_exporting()


class Tapper:
    """Collects the activations of a subscribed model while an ORTModule exports it (see :func:`tapping`).

    Nothing in the model changes: each activation tensor is only remembered, in execution order, and the exporter
    makes it an extra output of the graph (ORT then computes it in its own run, and its gradient can be fetched
    from the backward graph). A tensor that several modules return (a zero-rate dropout's output, a model output
    that is also a submodule's) is one value in the graph, as it is one tensor in torch.
    """

    def __init__(self, subscription: _Subscription):
        self.subscription = subscription
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
        """Collect every tensor leaf of ``output`` under ``path`` + its pytree path (as :func:`_tensor_leaves`)."""
        for key, tensor in _tensor_leaves(output):
            self.tap(path + key, tensor)


def _tapper() -> Tapper | None:
    return getattr(_local, "tapper", None)


class _StepState:
    """One step of one subscribed model: its number, the subscribers taking part, and the next ``order``."""

    def __init__(self, step: int, subscribers: list[SubscriberBase]):
        self.step = step
        self.subscribers = subscribers
        self.order = 0

    def next_order(self) -> int:
        order, self.order = self.order, self.order + 1
        return order


class _Subscription:
    """The hooks and step counter of one subscribed model."""

    def __init__(self, model: torch.nn.Module, subscribers: list[SubscriberBase]):
        self.model = model
        self.root_name = type(model).__name__
        self.subscribers = subscribers
        self.step = -1
        self.current: _StepState | None = None  # the step being recorded; None in eval mode or an unwanted step
        self.depth = 0  # re-entrant calls of the root's forward
        self.handles = [model.register_forward_pre_hook(self._root_pre_hook)]
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_hook(self._output_hook(path or self.root_name)))
        # Last, so the root's own output is recorded before the step's forward is marked finished.
        self.handles.append(model.register_forward_hook(self._root_post_hook, always_call=True))

    # -- steps ------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Calls of the model inside are no step: none starts, nothing is recorded."""
        saved, self.current = self.current, None
        self.depth += 1  # a call inside another call of the root starts no step
        try:
            yield
        finally:
            self.depth -= 1
            self.current = saved

    def _root_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth > 1 or _tracing():
            return
        if module.training:
            self.start_step()
        _running().append(self)

    def next_step_active(self) -> bool:
        """Whether a training step started now would be recorded by any subscriber."""
        return any(s.is_active(self.step + 1) for s in self.subscribers)

    def start_step(self, engine: str = "torch") -> _StepState | None:
        """Finish the open step and start the next; returns the state to record into (None: nobody wants it)."""
        self.end_step()
        self.step += 1
        active = [s for s in self.subscribers if s.is_active(self.step)]
        self.current = _StepState(self.step, active) if active else None
        for subscriber in active:
            subscriber.engine = engine
            subscriber.on_step_start(self.step)
        return self.current

    def _root_post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0 and not _tracing():
            stack = _running()
            if stack and stack[-1] is self:
                stack.pop()

    def end_step(self) -> None:
        if self.current is not None:
            for subscriber in self.current.subscribers:
                subscriber.on_step_end(self.current.step)
        self.current = None

    def recording(self) -> _StepState | None:
        """The step to record into, if this model is running a wanted training step."""
        if self.depth == 0 or self.current is None or not self.model.training or _tracing():
            return None
        return self.current

    # -- activations ------------------------------------------------------------------------------------------------
    def _output_hook(self, path: str):
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            tapper = _tapper()
            if tapper is not None and tapper.subscription is self:
                tapper.tap_output(path, output)
                return
            state = self.recording()
            if state is not None:
                for leaf_path, tensor in _tensor_leaves(output):
                    self.record(state, path + leaf_path, tensor)

        return hook

    def record(self, state: _StepState, name: str, tensor: torch.Tensor) -> None:
        """Deliver a forward activation now and its gradient when autograd computes it."""
        deliver_forward(state, name, tensor)
        if tensor.requires_grad and torch.is_grad_enabled():
            tensor.register_hook(lambda grad: deliver_backward(state, name, grad))

    def remove(self) -> None:
        self.end_step()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for subscriber in self.subscribers:
            subscriber.on_unsubscribe(self.model)

    def __deepcopy__(self, memo: dict) -> _Subscription:
        # A copy of the model (ortcore's deepcopy before export, say) keeps reporting to the same subscription:
        # subscribers hold files and state that must not be copied.
        return self


def deliver_forward(state: _StepState, name: str, tensor: torch.Tensor) -> None:
    """Hand a forward activation of ``state``'s step to its subscribers, numbered in execution order."""
    order = state.next_order()
    with torch.no_grad():
        for subscriber in state.subscribers:
            subscriber.on_forward(state.step, order, name, tensor.detach())


def deliver_backward(state: _StepState, name: str, grad: torch.Tensor) -> None:
    """Hand the gradient of the activation ``name`` to the subscribers of ``state``'s step."""
    order = state.next_order()
    with torch.no_grad():
        for subscriber in state.subscribers:
            subscriber.on_backward(state.step, order, name, grad.detach())


_local = threading.local()


@contextlib.contextmanager
def tapping(subscription: _Subscription) -> Iterator[Tapper]:
    """While an ORTModule exports ``subscription``'s model: every submodule output and every
    :func:`inspect_activation` is collected, to become an extra output of the graph."""
    previous = _tapper()
    _local.tapper = tapper = Tapper(subscription)
    try:
        yield tapper
    finally:
        _local.tapper = previous


def subscription_of(model: torch.nn.Module) -> _Subscription | None:
    """The subscription of ``model`` (the model an ORTModule wraps), if it is subscribed."""
    found = GlobalSubscriberManager._subscriptions.get(id(model))
    return found if found is not None and found.model is model else None


@contextlib.contextmanager
def subscribers_paused(model: torch.nn.Module) -> Iterator[None]:
    """A run of ``model`` that is no step of its subscribers (a check's own PyTorch run): it neither starts a step
    nor records one."""
    subscription = subscription_of(model)
    if subscription is None:
        yield
        return
    with subscription.paused():
        yield


def _running() -> list[_Subscription]:
    """Subscribed models whose forward is running on this thread, innermost last."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _unwrapped(model: Any) -> Any:
    """The model an :class:`ortcore.ORTModule` wraps (subscriptions belong to it), else ``model`` itself. A wrapper
    says what it wraps by the class attribute ``__ortcore_wrapped__`` (a property), read on the class so that a
    wrapped model's own attributes never answer for it."""
    return model.__ortcore_wrapped__ if hasattr(type(model), "__ortcore_wrapped__") else model


# The process-wide plugin host, for subscriptions made without one: set by ortcore.module (which owns the host the
# ORTModules use), so that this module imports nothing above it.
_default_host: Callable[[], Any] | None = None


def use_default_host(provider: Callable[[], Any]) -> None:
    """Take subscriptions' plugin host from ``provider()`` when ``subscribe`` is given none."""
    global _default_host
    _default_host = provider


def _host(host: Any) -> Any:
    if host is not None:
        return host
    if _default_host is None:
        raise RuntimeError("ortcore.hooks: no plugin host: import ortcore (or pass host=)")
    return _default_host()


class GlobalSubscriberManager:
    """Attach subscribers to a model, plain PyTorch or :class:`ortcore.ORTModule` (process-wide; the seed's entry
    point). An ORTModule's subscription belongs to the model it wraps, so subscribing before or after wrapping is
    the same. On an ORTModule, the activations are ONNX Runtime's own tensors: the model is exported with its
    activations as extra outputs of the forward graph, and their gradients are fetched from the backward graph.

    Example::

        from ortcore.hooks import GlobalSubscriberManager, StatisticsSubscriber
        GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber(output_dir="pt_out", override_output_dir=True)])
    """

    _subscriptions: dict[int, _Subscription] = {}

    @classmethod
    def subscribe(cls, model: torch.nn.Module, subscribers: Iterable[SubscriberBase], *, host: Any = None) -> None:
        """Deliver ``model``'s activations to ``subscribers`` (and to those plugins contribute through the
        ``ortcore_activation_subscribers`` hook). Subscribing a model again adds subscribers to it.
        """
        model = _unwrapped(model)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"subscribe() takes a torch.nn.Module, not {type(model).__name__}")
        subscribers = list(subscribers)
        for subscriber in subscribers:
            if not isinstance(subscriber, SubscriberBase):
                raise TypeError(f"{type(subscriber).__name__} is not a SubscriberBase")
        host = _host(host)
        subscribers += host.hooks.activation_subscribers(model)
        for subscriber in subscribers:
            subscriber.on_subscribe(model)
        existing = cls._subscriptions.get(id(model))
        if existing is not None and existing.model is model:
            existing.subscribers.extend(subscribers)
        else:
            cls._subscriptions[id(model)] = _Subscription(model, subscribers)

    @classmethod
    def is_subscribed(cls, model: torch.nn.Module) -> bool:
        return subscription_of(_unwrapped(model)) is not None

    @classmethod
    def unsubscribe(cls, model: torch.nn.Module) -> None:
        """End the open step (``on_step_end``) and remove every hook from ``model``."""
        model = _unwrapped(model)
        found = subscription_of(model)
        if found is not None:
            del cls._subscriptions[id(model)]
            found.remove()


def inspect_activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Record an intermediate tensor of a ``forward`` (and its gradient) under ``name``; returns ``tensor``.

    Records only while a subscribed model's training step is running on this thread; otherwise does nothing.
    Keep names unique: records are named by ``name`` and their execution order.
    """
    tapper = _tapper()
    if tapper is not None and isinstance(tensor, torch.Tensor):
        tapper.tap(name, tensor)
        return tensor
    stack = _running()
    if stack and isinstance(tensor, torch.Tensor):
        subscription = stack[-1]
        state = subscription.recording()
        if state is not None:
            subscription.record(state, name, tensor)
    return tensor


def subscriber_classes(host: Any = None) -> dict[str, type]:
    """Subscriber classes contributed by plugins through ``ortcore_register`` (``register.subscriber_class``), by name."""
    return _host(host).hooks.subscriber_classes()
