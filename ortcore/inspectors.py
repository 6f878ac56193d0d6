"""Runtime inspectors: objects called around each step of an ORTModule.

Plugins return inspectors from ``ortcore_runtime_inspectors`` once per model; the core then calls only the methods
an inspector overrides, directly, so an idle phase costs nothing.
"""

from __future__ import annotations

from typing import Any

import attrs

PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward")


@attrs.frozen
class ForwardInputs:
    """The call being run: the user's ``args``/``kwargs``, its tensors by graph input name, and the
    :class:`ortcore.session.TrainingSession` that runs it (its graph, its ORT session)."""

    args: tuple
    kwargs: dict
    tensors: dict[str, Any]
    session: Any = None


class RuntimeInspector:
    """Base class: override any of the four phases. ``step`` counts training forwards, from 0."""

    def pre_forward(self, step: int, inputs: ForwardInputs) -> None:
        """Before ORT's forward, with the call's arguments and its tensors by graph input name."""

    def post_forward(self, step: int, outputs: list[Any]) -> None:
        """After ORT's forward, with the model's flat output tensors (not the extra outputs the core adds for
        batch-norm statistics and activation subscribers)."""

    def pre_backward(self, step: int) -> None:
        """Before ORT's backward."""

    def post_backward(self, step: int) -> None:
        """After ORT's backward (gradients are handed to torch right after)."""


def phase_callbacks(inspectors: list[Any]) -> dict[str, list]:
    """For each phase, the bound methods that some inspector really overrides."""
    calls: dict[str, list] = {phase: [] for phase in PHASES}
    for inspector in inspectors:
        for phase in PHASES:
            method = getattr(inspector, phase, None)
            base = getattr(RuntimeInspector, phase)
            if method is not None and getattr(method, "__func__", None) is not base:
                calls[phase].append(method)
    return calls
