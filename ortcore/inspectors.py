"""What plugins see of a step: runtime inspectors called around each step, and the first step of a new session.

Plugins return inspectors from ``ortcore_runtime_inspectors`` once per model; the core then calls only the methods
an inspector overrides, directly, so an idle phase costs nothing. ``ortcore_check_first_step`` receives a
:class:`FirstStep` once per newly built training session, before the step runs (the gradient audit); a check may
return a :class:`StepWatch` to check the user's own step as it runs instead of running one of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs

PHASES = ("pre_call", "pre_forward", "post_forward", "pre_backward", "post_backward")


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
    # Whether a check may return a StepWatch: False when an engine shards the parameters between the forward and
    # the backward (RuntimeInspector.shards_parameters), the step records activations, or an earlier watch of this
    # session found a difference or was dropped without a backward (the check then runs a step of its own).
    watchable: bool = False


class StepWatch:
    """What a first-step check returns to check the user's own step instead of running one of its own.

    The core runs the step in ORT as usual and calls :meth:`outputs` right after ORT's forward, then
    :meth:`gradients` in the backward, after ORT's backward and before the gradients reach torch. When both accept,
    :attr:`report` is listed with the checks' reports and the session counts as checked; when either does not,
    the session is checked again at its next call by a check that runs a step of its own
    (``FirstStep.watchable`` False). A watch whose step is never differentiated counts as not accepted.
    """

    #: The check's report once :meth:`gradients` accepted (listed by ``ORTModule.gradient_audits``).
    report: Any = None

    def outputs(self, outputs: list[Any]) -> bool:
        """ORT's forward outputs of the step (the model's flat outputs). False: the core drops this forward and
        runs the call again, checked by a step of the check's own (the call's outputs then come from a graph
        that passed, or a repaired one)."""
        return True

    def gradients(self, output_grads: list[Any], grads: dict[str, Any] | None) -> dict[str, Any] | None:
        """ORT's gradients of the step by feed name (parameters by name, inputs by graph input name; None where
        ORT gives none) for the user's ``output_grads`` (None for outputs not differentiated); ``grads`` None when
        ORT's backward failed. Return None to accept, or the gradients to use instead (by the same names; the
        check's own, right ones): the step then takes them and the session is checked again at its next call."""
        return None


class RuntimeInspector:
    """Base class: override any of the five phases. ``step`` counts training forwards, from 0."""

    #: Names of attributes an engine sets on the model for its own bookkeeping at every step (DeepSpeed ZeRO-3's
    #: ``applied_pre_backward_ref_cnt``, say) that the model's forward never reads: setting one on the ORTModule
    #: passes it to the model without exporting again (any other attribute set there is a change of the model).
    untraced_attributes: frozenset[str] = frozenset()

    #: A predicate over module hooks (e.g. ``hook_defined_in("torch.distributed.fsdp")``): the hooks an engine installs
    #: to gather or shard parameters, which the export sets aside (:func:`hooks_set_aside`) and which never change what
    #: the forward computes. The graph's fingerprint names such a hook by its code only, not by the engine's state it
    #: is bound to (which holds per-instance handles and counters): a second job with the same model finds its graph
    #: in the export cache. None: every hook is part of the fingerprint with everything it refers to.
    untraced_hooks: Callable[[Any], bool] | None = None

    #: True for an engine that gathers the parameters for the step and shards them again before a later backward
    #: could read them (FSDP2, ZeRO-3): a first-step check then finishes its PyTorch side within the check
    #: (``FirstStep.watchable`` is False) instead of differentiating it in the user's backward.
    shards_parameters: bool = False

    def pre_call(self, step: int, module: Any) -> None:
        """At the start of a call of the ORTModule ``module``, before the step reads the model's parameters and
        buffers (which it then feeds to the graph, or hands to PyTorch on a fallback): an engine that puts other
        parameter objects in place for the step does it here (FSDP2 registers its unsharded parameters)."""

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


#: The hook dictionaries of a ``torch.nn.Module`` that :func:`hooks_set_aside` looks in.
MODULE_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def hook_defined_in(package: str) -> Callable[[Any], bool]:
    """A predicate for :func:`hooks_set_aside`: the hook (a function, a bound method, a ``functools.partial`` or an
    object a module's hook dictionary holds) is code of ``package`` (``"deepspeed"``, ``"torch.distributed.fsdp"``)."""

    def owned(hook: Any) -> bool:
        name = str(getattr(hook_code(hook), "__module__", "") or "")
        return name == package or name.startswith(package + ".")

    return owned


def hook_code(hook: Any) -> Any:
    """The function a module hook runs, unwrapped from what holds it."""
    target = getattr(hook, "hook", hook)  # torch wraps some (state-dict hooks) in an object holding the function
    target = getattr(target, "func", target)  # functools.partial
    return getattr(target, "__func__", target)  # bound method


@contextlib.contextmanager
def hooks_set_aside(module: Any, owned: Callable[[Any], bool]) -> Iterator[None]:
    """The module hooks ``owned`` selects set aside on ``module`` and every submodule (forward, backward and
    state-dict hooks), put back after: the model as it runs without the engine that registered them (DeepSpeed's
    parameter gathering, FSDP2's unshard and reshard), for tracing it and for running it as a reference."""
    saved: list[tuple[Any, str, Any]] = []
    for sub in module.modules():
        for attr in MODULE_HOOK_DICTS:
            hooks = getattr(sub, attr, None)
            if hooks and any(owned(h) for h in hooks.values()):
                saved.append((sub, attr, hooks))
                setattr(sub, attr, type(hooks)((k, h) for k, h in hooks.items() if not owned(h)))
    try:
        yield
    finally:
        for sub, attr, hooks in reversed(saved):
            setattr(sub, attr, hooks)
