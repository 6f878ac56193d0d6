"""Which side of each ReLU's kink ortcore's float32 took: read through the public API (an activation subscriber, the
ReLU outputs tapped while the ORTModule exports: ``ortcore_plugins.gradient_audit.kinks.ReluTaps``).

Used by the zoo's judge (``tests.zoo.run_model``) and by ``tests/test_kinks.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ortcore_plugins.gradient_audit.kinks import ReluTaps, relu_call


def ortcore_relu_signs(model: torch.nn.Module, step: Callable[[torch.nn.Module], Any]) -> dict[int, torch.Tensor]:
    """ReLU call number -> ``output > 0`` as ONNX Runtime computed it, in ``step(ORTModule(model))`` (the first call
    of a fresh ORTModule, audit off; ``model`` is trained by it: pass a copy). Calls whose output a later in-place op
    overwrote are left out (their tap holds that later value)."""
    from ortcore import ORTModule
    from ortcore.hooks import GlobalSubscriberManager, SubscriberBase

    class Signs(SubscriberBase):
        def __init__(self) -> None:
            super().__init__(end_step=1)
            self.positive: dict[int, torch.Tensor] = {}

        def on_forward(self, step: int, order: int, name: str, tensor: torch.Tensor) -> None:
            call = relu_call(name)
            if call is not None:
                self.positive[call] = tensor.detach() > 0

    signs = Signs()
    relus = ReluTaps()
    GlobalSubscriberManager.subscribe(model, [signs])
    try:
        with relus:
            step(ORTModule(model, verify_gradients=False))
    finally:
        GlobalSubscriberManager.unsubscribe(model)
    changed = relus.changed()
    return {c: p for c, p in signs.positive.items() if c not in changed}
