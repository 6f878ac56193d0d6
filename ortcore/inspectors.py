"""What plugins see of a step: runtime inspectors called around each step, and the first step of a new session.

Plugins return inspectors from ``ortcore_runtime_inspectors`` once per model; the core then calls only the methods
an inspector overrides, directly, so an idle phase costs nothing. ``ortcore_check_first_step`` receives a
:class:`FirstStep` once per newly built training session, before the step runs (the gradient audit).
"""

from __future__ import annotations

from collections.abc import Callable
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


@attrs.frozen
class FirstStep:
    """The first training step of a newly built session, as the core resolved it, before it runs.

    ``export`` exports the same call anew (no export cache), with activation taps collected by the tapper it is
    given (``ortcore.api.Tapper``) or none; ``build`` builds a session of the step's key for such a graph, counted
    by the state machine as a probe (no plugin session hooks). Nothing here may be changed: a check runs beside the
    step, on aliases and copies of the model's state."""

    model: Any  # the wrapped torch.nn.Module
    graph: Any  # the step's ExportedGraph
    session: Any  # the step's TrainingSession
    schema: Any  # the call's InputSchema
    tensors: list[Any]  # the call's tensor inputs, in schema order
    params: dict[str, Any]
    buffers: dict[str, Any]
    trainable: tuple[str, ...]  # the parameters that require grad
    export: Callable[[Any], Any]
    build: Callable[[Any], Any]
    # torch.autocast's state the graph was exported under (ortcore.amp.autocast_state): a check runs PyTorch's side
    # under it (``ortcore.api.autocast_as``) and ORT's runs under ``ortcore.api.running_graph``.
    autocast: tuple = ()


class RuntimeInspector:
    """Base class: override any of the four phases. ``step`` counts training forwards, from 0."""

    #: Names of attributes an engine sets on the model for its own bookkeeping at every step (DeepSpeed ZeRO-3's
    #: ``applied_pre_backward_ref_cnt``, say) that the model's forward never reads: setting one on the ORTModule
    #: passes it to the model without exporting again (any other attribute set there is a change of the model).
    untraced_attributes: frozenset[str] = frozenset()

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
