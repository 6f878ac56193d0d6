"""subscriber_manager: activation subscribers on any model, plain PyTorch or ORTModule (``ortcore.hooks``).

:class:`GlobalSubscriberManager` puts forward hooks on every submodule of a model and tensor hooks on their outputs;
each activation then goes to the model's subscribers (:class:`ortcore.api.SubscriberBase` objects), called
directly, never through pluggy. On an ORTModule the activations are ONNX Runtime's own tensors: the subscription is
the model's :class:`ortcore.api.StepRecorder`, so a step it records is exported with its activations as extra graph
outputs (``ortcore.api.tapping``), and their gradients come from ORT's backward. Subscriber classes contributed by
plugins (``StatisticsSubscriber``) are found through the plugin host (``ortcore.hooks``). Users import from
``ortcore.hooks``; see docs/convergence.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ortcore.api import (
    PluginError,
    SubscriberBase,
    attach_recorder,
    contributed_subscribers,
    current_tapper,
    detach_recorder,
    disabled_plugins,
    is_tracing,
    tensor_leaves,
)

__all__ = ["GlobalSubscriberManager", "inspect_activation"]

PLUGIN = "subscriber_manager"

_local = threading.local()


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
    """The hooks and step counter of one subscribed model; the :class:`ortcore.api.StepRecorder` an ORTModule
    wrapping it asks each step."""

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
        if self.depth > 1 or is_tracing():
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
        if self.depth == 0 and not is_tracing():
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
        if self.depth == 0 or self.current is None or not self.model.training or is_tracing():
            return None
        return self.current

    # -- activations ------------------------------------------------------------------------------------------------
    def _output_hook(self, path: str):
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            tapper = current_tapper()
            if tapper is not None and tapper.owner is self:
                tapper.tap_output(path, output)
                return
            state = self.recording()
            if state is not None:
                for leaf_path, tensor in tensor_leaves(output):
                    self.record(state, path + leaf_path, tensor)

        return hook

    def record(self, state: _StepState, name: str, tensor: torch.Tensor) -> None:
        """Deliver a forward activation now and its gradient when autograd computes it."""
        self.deliver_forward(state, name, tensor)
        if tensor.requires_grad and torch.is_grad_enabled():
            tensor.register_hook(lambda grad: self.deliver_backward(state, name, grad))

    @staticmethod
    def deliver_forward(state: _StepState, name: str, tensor: torch.Tensor) -> None:
        """Hand a forward activation of ``state``'s step to its subscribers, numbered in execution order."""
        order = state.next_order()
        with torch.no_grad():
            for subscriber in state.subscribers:
                subscriber.on_forward(state.step, order, name, tensor.detach())

    @staticmethod
    def deliver_backward(state: _StepState, name: str, grad: torch.Tensor) -> None:
        """Hand the gradient of the activation ``name`` to the subscribers of ``state``'s step."""
        order = state.next_order()
        with torch.no_grad():
            for subscriber in state.subscribers:
                subscriber.on_backward(state.step, order, name, grad.detach())

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
        if host is None and PLUGIN in disabled_plugins():
            raise PluginError(
                f"cannot subscribe {type(model).__name__}: the {PLUGIN} plugin is disabled ([plugins] disable or "
                "ORTCORE_DISABLE_PLUGINS); enable it to record activations"
            )
        subscribers = list(subscribers)
        for subscriber in subscribers:
            if not isinstance(subscriber, SubscriberBase):
                raise TypeError(f"{type(subscriber).__name__} is not a SubscriberBase")
        subscribers += contributed_subscribers(model, host)
        for subscriber in subscribers:
            subscriber.on_subscribe(model)
        existing = cls._subscriptions.get(id(model))
        if existing is not None and existing.model is model:
            existing.subscribers.extend(subscribers)
        else:
            cls._subscriptions[id(model)] = subscription = _Subscription(model, subscribers)
            attach_recorder(model, subscription)

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
            detach_recorder(model)
            found.remove()


def subscription_of(model: torch.nn.Module) -> _Subscription | None:
    """The subscription of ``model`` (the model an ORTModule wraps), if it is subscribed."""
    found = GlobalSubscriberManager._subscriptions.get(id(model))
    return found if found is not None and found.model is model else None


def inspect_activation(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Record an intermediate tensor of a ``forward`` (and its gradient) under ``name``; returns ``tensor``.

    Records only while a subscribed model's training step is running on this thread; otherwise does nothing.
    Keep names unique: records are named by ``name`` and their execution order.
    """
    tapper = current_tapper()
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
