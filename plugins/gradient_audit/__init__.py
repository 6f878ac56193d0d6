"""gradient_audit: the first training step of each newly built graph is checked against PyTorch.

With ``verify_gradients`` on (``ortcore.toml``, ``ORTCORE_VERIFY_GRADIENTS=1`` or
``ORTModule(model, verify_gradients=True)``), the core hands the first step of each new training session to
``ortcore_check_first_step``; this plugin compares ORT's outputs, loss and every gradient with PyTorch's: on the
user's own step where the core lets it watch it (:mod:`.own_step`: PyTorch's side run beside ORT's step), else on a
step of its own on both engines beside the user's (:mod:`.audit`), and on a mismatch names the module (:class:`ortcore.api.GradientMismatchError`,
which the core's repair loop routes). :mod:`.kinks` tells a difference caused by ReLU-family kinks (where torch and
ORT may both be right) from a real one. The option switches and tolerances are the core's (``verify_gradients``,
``verify_gradients_rtol``, ``verify_gradients_atol``): they decide whether first steps are checked at all, by this
plugin or another. A passed verdict is kept beside the export cache (:mod:`.verdicts`): a later process does not
audit the same graph again on this machine (removing that directory, or ``ORTCORE_AUDIT_RECORDED_VERDICTS=0``,
audits it again). See docs/gradient_audit.md.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs

from ortcore.api import ExportedGraph, FirstRunError, FirstStep, GradientMismatchError, hookimpl, option, parse_bool

from . import audit, own_step, verdicts
from .audit import AuditRequest, AuditResult

logger = logging.getLogger("ortcore")


@attrs.frozen
class GradientAuditOptions:
    """This plugin's own options; whether first steps are checked at all, and the tolerances, are the core's."""

    recorded_verdicts: bool = option(
        True,
        parse_bool,
        "a passed verdict is recorded beside the export cache and a later process does not audit that graph again "
        "(false: audit every process's first step)",
        "ORTCORE_AUDIT_RECORDED_VERDICTS",
    )


@hookimpl
def ortcore_options_class() -> type:
    return GradientAuditOptions


def mismatched_module(result: AuditResult) -> str | None:
    """The module a repair should route: the one the audit located, else the owner of the first differing parameter
    gradient (the tapped graph did not show the module), else None."""
    location = result.location
    if location is not None and location.module:
        return location.module
    owners = [d.name.rpartition(".")[0] for d in result.differences if d.kind == "gradient of parameter"]
    return next((o for o in owners if o), None)


@hookimpl(wrapper=True)
def ortcore_load_export(config: Any, module: Any, fingerprint: str) -> Any:
    """Remember the fingerprint of a graph an export cache served (the key of its recorded verdict)."""
    graph = yield
    if graph is not None:
        verdicts.remember_fingerprint(graph, fingerprint)
    return graph


@hookimpl
def ortcore_export_done(config: Any, module: Any, fingerprint: str, graph: ExportedGraph) -> None:
    """Remember the fingerprint of a graph just exported."""
    verdicts.remember_fingerprint(graph, fingerprint)


@hookimpl
def ortcore_check_first_step(config: Any, step: FirstStep) -> AuditResult | own_step.OwnStep:
    req = AuditRequest(
        model=step.model,
        graph=step.graph,
        session=step.session,
        schema=step.schema,
        tensors=step.tensors,
        params=step.params,
        buffers=step.buffers,
        trainable=step.trainable,
        export=step.export,
        build=step.build,
        autocast=getattr(step, "autocast", ()),
        rtol=config.core.verify_gradients_rtol,
        atol=config.core.verify_gradients_atol,
    )
    store = verdicts.VerdictStore.for_config(config) if _recorded_verdicts(config) else None
    if getattr(step, "watchable", False) and own_step.watchable(req):
        started = own_step.start(req, store)
        if isinstance(started, own_step.OwnStep):
            return started  # the core gives it the step's outputs and gradients
        if started is not None:
            return _reported(started)
    return _reported(audit.audit_with_verdicts(req, store))


def _reported(result: AuditResult) -> AuditResult:
    """``result`` logged; a mismatch or ORT's own failure raised for the core's repair loop."""
    if result.status == "not audited" and result.error is None:
        logger.warning("%s", result.message())
    elif result.status == "passed":
        logger.info("%s", result.message())
    if result.status == "mismatch":
        raise GradientMismatchError(result.message(), result=result, module=mismatched_module(result))
    if result.error is not None:
        failed = FirstRunError(f"ONNX Runtime failed to run the first step: {result.error}")
        failed.result = result  # listed by ORTModule.gradient_audits, as a passed audit's report is
        raise failed from result.error
    return result


def _recorded_verdicts(config: Any) -> bool:
    options = config.plugin_options("gradient_audit")
    return bool(getattr(options, "recorded_verdicts", True))
