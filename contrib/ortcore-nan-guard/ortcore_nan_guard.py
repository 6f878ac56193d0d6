"""nan_guard: stop at the first NaN or Inf in a model's outputs and name the module that produced it first.

An example of an out-of-tree ortcore plugin. Each step it checks the forward outputs ONNX Runtime computed (one
cheap reduction per output). When one is not finite, it replays that step's forward in PyTorch on a copy of the
model, with forward hooks on every submodule, to find the first module whose output was not finite.

Options (``[plugins.nan_guard]`` in ortcore.toml, or the environment)::

    [plugins.nan_guard]
    action = "raise"   # or "warn"; env ORTCORE_NAN_GUARD_ACTION
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from ortcore.api import ForwardInputs, OptionError, RuntimeInspector, hookimpl, option

logger = logging.getLogger("ortcore.nan_guard")

ACTIONS = ("raise", "warn")


class NonFiniteError(FloatingPointError):
    """A forward output was NaN or Inf; the message names the module that produced it first."""


def _parse_action(value: object, source: str) -> str:
    if value not in ACTIONS:
        raise OptionError(f"{source}={value!r} is not allowed; allowed: {', '.join(ACTIONS)}")
    return str(value)


@attrs.frozen
class NanGuardOptions:
    action: str = option("raise", _parse_action, "what to do at the first NaN/Inf", "ORTCORE_NAN_GUARD_ACTION")


def _finite(value: Any) -> bool:
    return all(
        torch.isfinite(t).all().item()
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


def first_non_finite_module(module: torch.nn.Module, inputs: ForwardInputs) -> str | None:
    """Replay a forward in PyTorch on a copy and return the first submodule whose output is not finite."""
    replica = copy.deepcopy(module)
    found: list[str] = []

    def hook(name: str):
        def check(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if not found and not _finite(output):
                found.append(name or type(module).__name__)

        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in replica.named_modules()]
    try:
        with torch.no_grad():
            replica(*inputs.args, **inputs.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found[0] if found else None


class NanGuard(RuntimeInspector):
    def __init__(self, module: torch.nn.Module, action: str):
        self.module = module
        self.action = action
        self._inputs: ForwardInputs | None = None

    def pre_forward(self, step: int, inputs: ForwardInputs) -> None:
        self._inputs = inputs

    def post_forward(self, step: int, outputs: list[torch.Tensor]) -> None:
        inputs, self._inputs = self._inputs, None
        if _finite(outputs):
            return
        culprit = first_non_finite_module(self.module, inputs) if inputs is not None else None
        message = f"step {step}: a forward output is NaN or Inf; first produced by module {culprit or '<unknown>'!r}"
        if self.action == "raise":
            raise NonFiniteError(message)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


@hookimpl
def ortcore_options_class() -> type:
    return NanGuardOptions


@hookimpl
def ortcore_runtime_inspectors(config, module: torch.nn.Module) -> list[RuntimeInspector]:
    return [NanGuard(module, config.plugin_options("nan_guard").action)]
