"""The audit of the user's own first step: PyTorch's side beside ORT's step as it runs, no step of the audit's own.

A first step the core lets a check watch (``FirstStep.watchable``: no engine shards the parameters, no activation
taps, no earlier watch of the session failed) is audited on the step itself when its graph draws no random numbers
and no plugin hands gradients to torch during ORT's backward: :func:`start` runs PyTorch's forward on the step's
inputs (detached aliases of the parameters, copies of the buffers) before ORT's, and returns an :class:`OwnStep`.
The core gives it ORT's outputs right after ORT's forward and ORT's gradients in the backward, for the user's own
output gradients; PyTorch's side is differentiated there for the same ones, and the two compared as a step of the
audit's own is (:func:`.audit.compare`, the same tolerances and count of compared tensors). What is saved: ORT's
forward and backward of a step of the audit's own.

Beyond the tolerance against PyTorch's float32 step: outputs that differ make the core run the call again, audited
by a step of its own (float64 judgement, the module located, a repair); gradients are judged against float64 in the
backward, as on a step of the audit's own, and only a difference that judgement confirms (or an output the backward
changed) gives this step PyTorch's gradients and has the session's next call audited by a step of its own. See
docs/gradient_audit.md, "The user's own step".
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from ortcore.api import StepWatch

from . import audit
from .audit import (
    AuditRequest,
    AuditResult,
    TorchRun,
    _grads_written,
    _rng_state,
    _set_rng_state,
    _Side,
    autocast_tolerance,
    changed_output,
    compare,
    compare_gradients,
    random_nodes,
    record_verdict,
    recorded_verdict,
    restore_buffers,
    saved_buffers,
    torch_forward,
    torch_gradients,
)

logger = logging.getLogger("ortcore")

LABEL = "the step's graph"


def watchable(req: AuditRequest) -> bool:
    """Whether ``req``'s step can be audited as it runs: its graph draws no random numbers (PyTorch cannot draw
    ORT's) and no plugin hands gradients to torch during ORT's backward (they would reach ``.grad`` unchecked)."""
    session = req.session
    return not (random_nodes(req.graph.model) or random_nodes(session.model) or session.grads_handed_over)


def start(req: AuditRequest, store: Any = None) -> AuditResult | OwnStep | None:
    """The recorded verdict of ``req``'s graph, a result that says why it is not audited, or an :class:`OwnStep`
    watching the step; None when the step needs a step of the audit's own (PyTorch's outputs are not the graph's)."""
    began = time.perf_counter()
    key, recorded = recorded_verdict(req, store)
    if recorded is not None:
        return recorded
    req = autocast_tolerance(req)
    common = {"rtol": req.rtol, "atol": req.atol}
    buffers = saved_buffers(req.model)
    rng = _rng_state()
    try:
        run = torch_forward(req, record=False)
    except Exception as e:  # the audit must never pass silently, nor stop training for its own failure
        return AuditResult(
            "not audited", LABEL, reason=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - began, **common
        )
    finally:
        _set_rng_state(rng)
        restore_buffers(req.model, buffers)
    if tuple(run.output_schema.names) != tuple(req.graph.output_schema.names):
        return None
    if not run.targets or not any(o.requires_grad for o in run.side.outputs):
        return AuditResult(
            "not audited",
            LABEL,
            reason="no output of the model needs a gradient, or nothing is trained",
            seconds=time.perf_counter() - began,
            **common,
        )
    return OwnStep(req, run, store, key, buffers, time.perf_counter() - began)


class OwnStep(StepWatch):
    """PyTorch's side of the user's first step, compared with ORT's as the core runs it."""

    def __init__(
        self, req: AuditRequest, run: TorchRun, store: Any, key: str | None, buffers: dict, seconds: float
    ) -> None:
        self.req = req
        self.run: TorchRun | None = run
        self.store = store
        self.key = key
        self.buffers = buffers  # the model's buffers before the step: put back when the call runs again
        self.seconds = seconds  # the audit's own time, not the step's
        self.ort_outputs: list[torch.Tensor] = []
        self.found: list[Any] = []  # the outputs' differences, found at the forward
        self.sums: list[float] = []  # each output's sum at the forward: changed by the backward if it differs then
        self.report: AuditResult | None = None

    def outputs(self, outputs: list[Any]) -> bool:
        began = time.perf_counter()
        run = self.run
        assert run is not None
        names = self.req.graph.output_schema.names
        found = [
            compare("output", name, ort, ref, self.req.rtol, self.req.atol)
            for name, ort, ref in zip(names, outputs, run.side.outputs)
        ]
        self.seconds += time.perf_counter() - began
        beyond = [d for d in found if d.exceeds]
        if beyond:
            logger.info(
                "gradient audit: the first step's outputs differ from PyTorch's (%s): the call runs again, audited by "
                "a step of its own",
                beyond[0].describe(),
            )
            restore_buffers(self.req.model, self.buffers)  # what parts run in PyTorch (regions) wrote during ORT's forward
            self.run = None
            return False
        # Detached aliases: the same memory (a later write into it is seen), no reference back to the step's graph.
        self.ort_outputs = [o.detach() for o in outputs]
        self.found = found
        self.sums = [_sum(o) for o in self.ort_outputs]
        return True

    def gradients(self, output_grads: list[Any], grads: dict[str, Any] | None) -> dict[str, Any] | None:
        began = time.perf_counter()
        req, run = self.req, self.run
        self.run = None  # PyTorch's graph and activations are freed with this step
        assert run is not None
        common = {"rtol": req.rtol, "atol": req.atol}
        with _grads_written(req.model) as written:
            torch_gradients(run, output_grads)
        if grads is None:  # ORT's backward failed: PyTorch's gradients, unless the model writes .grad itself
            return None if written else {name: run.side.grads.get(name) for name, _ in run.targets}
        if written:
            self.report = AuditResult(
                "not audited",
                LABEL,
                reason="the model's backward writes .grad itself (a custom autograd Function accumulating into "
                f"{', '.join(written[:3])}), so torch.autograd.grad cannot give PyTorch's gradients",
                seconds=self.seconds + time.perf_counter() - began,
                **common,
            )
            logger.warning("%s", self.report.message())
            return None
        ort = _Side(outputs=self.ort_outputs, grads=grads)
        names = req.graph.output_schema.names
        # An output whose values moved since the forward (ORT's backward writing into a buffer it handed out):
        # a sum in float64 per output, one pass, instead of a copy of each output kept from the forward.
        changed = [
            changed_output(names[i], math.inf, f"its sum moved from {before:.6g} to {now:.6g}")
            for i, (before, now) in enumerate(zip(self.sums, map(_sum, self.ort_outputs)))
            if not (before == now or (math.isnan(before) and math.isnan(now)))
        ]
        self.ort_outputs = []
        found = [*self.found, *changed, *compare_gradients(req, ort, run.side, output_grads)]
        if any(d.exceeds for d in found) and not changed:
            found = _judged(req, found, ort, run, output_grads)
        seconds = self.seconds + time.perf_counter() - began
        beyond = [d for d in found if d.exceeds]
        if not beyond:
            self.report = AuditResult(
                "passed",
                LABEL,
                compared=len(found),
                worst=max(found, key=lambda d: d.used),
                seconds=seconds,
                own_step=True,
                **common,
            )
            logger.info("%s", self.report.message())
            record_verdict(self.store, self.key, self.report)
            return None
        logger.info(
            "gradient audit: the first step's gradients differ from PyTorch's (%s%s): the step takes PyTorch's "
            "gradients, and the next call is audited by a step of its own (the module located and routed)",
            beyond[0].describe(),
            f", and {len(beyond) - 1} more" if len(beyond) > 1 else "",
        )
        return {name: run.side.grads.get(name) for name, _ in run.targets}


def _judged(req: AuditRequest, found: list, ort: _Side, run: TorchRun, output_grads: list) -> list:
    """``found`` judged against float64 (:func:`.audit._judged_against_float64`: rounding or a real difference), as
    a step of the audit's own is; on the judgement's own failure, ``found`` as it is."""
    rng = _rng_state()
    try:
        with torch.enable_grad():  # in the user's backward, where grad mode is off
            names = req.graph.output_schema.names
            return audit._judged_against_float64(req, found, ort, run.side, output_grads, names)
    except Exception as e:  # beyond PyTorch's float32 step, unjudged: decided by the next call's own step
        logger.info("gradient audit: the float64 judgement of the first step failed (%s: %s)", type(e).__name__, e)
        return found
    finally:
        _set_rng_state(rng)


def _sum(t: torch.Tensor) -> float:
    if t.is_complex():
        return float(t.abs().sum(dtype=torch.float64))
    return float(t.sum(dtype=torch.float64)) if t.is_floating_point() else float(t.sum())
