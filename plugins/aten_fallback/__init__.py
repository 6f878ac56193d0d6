"""aten_fallback: run chosen ops with PyTorch's own kernels inside ONNX Runtime's training graph.

Three features, one module each; this module holds the plugin's hooks and re-exports the names other code uses:

* **kernel routing** (:mod:`.kernel_routing`): embedding, GELU, LayerNorm and the softmax cross-entropy loss (and,
  on request, linear) are exported as ``org.pytorch.aten::ATen`` nodes with ATen-node gradients, because PyTorch's CPU
  kernels are several times faster than ORT's for them (see ``docs/plugins/aten_fallback.md`` for the numbers).
  Option ``[plugins.aten_fallback] torch_kernels`` (env ``ORTCORE_TORCH_KERNELS``, a comma list; ``""`` or
  ``"none"`` routes nothing, ``"all"`` every op) chooses the ops; with none, the exported graphs contain no ATen node.
  With ``"auto"`` (:mod:`.kernel_choice`) each call is routed only where PyTorch measured faster on the model's own
  shapes, decided once per machine and recorded in the graph (:func:`kernel_choices`, :func:`explain_kernel_choices`).
* **the unexportable-op fallback** (:mod:`.unexportable_ops`): ops the exporter cannot express at all
  (``torch.cummax``, ``torch.logcumsumexp``, ``torch.special.*``, ...) are run the same way when option
  ``fallback_ops`` (env ``ORTCORE_ATEN_FALLBACK_OPS``) names them, or names ``auto``: each becomes one ATen node
  running the op, whose gradient re-runs it under ``torch.autograd`` with respect to the inputs PyTorch
  differentiates (:mod:`ortcore_plugins.services.differentiability`; see :func:`fallback_symbolic`). Off by default:
  without it such a model falls back to PyTorch, as without the plugin. On the dynamo route the listed ops,
  and with ``auto`` the ops the exporter cannot translate, are found in ``torch.export``'s program instead
  (:func:`.unexportable_ops.program_pass`); kernel routing covers embedding, GELU, LayerNorm and cross-entropy
  there (:func:`.kernel_routing.translations_for`, :func:`.kernel_routing.program_kernels`), not ``linear`` or
  ``auto`` (said once at INFO).
* **repairs** (:mod:`.repairs`): when an export fails on an op the exporter cannot write for those inputs, or the
  session on an ONNX node ORT has no kernel for in its types, the plugin offers to list the op in ``fallback_ops``
  (``ortcore_repairs``), the smallest repair there is.
* **graph passes** (:mod:`.graph_passes`): the written-out tanh-GELU becomes one ATen gelu node.

Options are in :mod:`.options`. The ATen executor that runs the nodes, the ATen node builder (and the pass that gives
ATen outputs types ORT can use) and PyTorch's kernels for the routable ops with their gradient definitions are shared
services (:mod:`ortcore_plugins.services.aten_executor`, :mod:`ortcore_plugins.services.aten_nodes`,
:mod:`ortcore_plugins.services.torch_kernels`): ``op_routing`` needs them too.
"""

from __future__ import annotations

import logging
from typing import Any

from ortcore.api import (
    DYNAMO,
    PROVISIONAL_METADATA,
    TORCHSCRIPT,
    Config,
    GraphPass,
    exporter_name,
    hookimpl,
)
from ortcore_plugins.services import aten_nodes, aten_program
from ortcore_plugins.services.aten_nodes import ATEN_DOMAIN, HELPER_NAMESPACE, type_aten_outputs
from ortcore_plugins.services.torch_kernels import prepare_runtime

from . import kernel_choice
from .graph_passes import TANH_GELU_PASS, TYPE_OUTPUTS_PASS, replace_tanh_gelu
from .kernel_choice import explain_kernel_choices, kernel_choices
from .kernel_routing import (
    DYNAMO_OPS,
    auto_symbolics,
    program_kernels,
    symbolics_for,
    take_tanh_sizes,
    translations_for,
)
from .options import (
    ALL,
    AUTO,
    DEFAULT_OPS,
    NAME,
    ROUTABLE_OPS,
    AtenFallbackOptions,
    fallback_ops,
    is_auto,
    measure_mode,
    parse_fallback_ops,
    routed_ops,
)
from .repairs import repairs_for
from .unexportable_ops import fallback_symbolic, fallback_symbolics, program_pass, symbolics_for_failure

# What tests use.
__all__ = [
    "ATEN_DOMAIN",
    "DEFAULT_OPS",
    "HELPER_NAMESPACE",
    "NAME",
    "ROUTABLE_OPS",
    "ALL",
    "explain_kernel_choices",
    "fallback_symbolic",
    "kernel_choices",
    "parse_fallback_ops",
    "prepare_runtime",
    "routed_ops",
    "type_aten_outputs",
]

logger = logging.getLogger("ortcore.aten_fallback")


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return AtenFallbackOptions


@hookimpl
def ortcore_explain_notes(module: Any) -> list[str] | None:
    """With kernel choice by measurement: each measured call's decision for this model, and what measuring cost."""
    if not kernel_choices(module):
        return None
    return [explain_kernel_choices(module), kernel_choice.measurement_summary()]


@hookimpl
def ortcore_configure(config: Config) -> None:
    ops = routed_ops(config)
    if ops or fallback_ops(config):
        prepare_runtime()
    logger.debug("ops run with PyTorch's kernels: %s", sorted(ops) or "none")


@hookimpl
def ortcore_export_symbolics(config: Config) -> dict[str, Any] | None:
    if exporter_name(config) != TORCHSCRIPT:
        return None  # symbolics are the TorchScript route's; the dynamo route routes in its program pass
    ops = routed_ops(config)
    listed = fallback_ops(config)
    if ops or listed:
        prepare_runtime()  # idempotent; ortcore_configure did it already for hosts that configure plugins
    routing = auto_symbolics(config) if is_auto(config) else symbolics_for(ops)
    return {**routing, **fallback_symbolics(listed)}


@hookimpl(tryfirst=True)
def ortcore_export_failed(config: Config, error: Any, symbolics: dict[str, Any]) -> dict[str, Any] | None:
    """With ``fallback_ops = ["auto"]`` on the TorchScript route: an ``aten::`` op without an ONNX symbolic becomes
    an ATen node (asked before op_routing, which routes calls whose symbolic refuses them)."""
    if AUTO not in fallback_ops(config) or exporter_name(config) != TORCHSCRIPT:
        return None
    return symbolics_for_failure(error, symbolics)


PROGRAM_PASS = "aten_fallback.unexportable_ops"
KERNELS_PASS = "aten_fallback.torch_kernels"
DISTINCT_PASS = "aten_fallback.distinct_inputs"
_told_torchscript_only = False


@hookimpl
def ortcore_program_passes(config: Config) -> list[GraphPass]:
    """The dynamo route: ``fallback_ops`` in the exported program, and the LayerNorm and cross-entropy calls of
    ``torch_kernels`` (embedding and GELU need only translations). ``linear`` and ``auto`` are TorchScript-only: on
    this route those ops stay in ORT (said once, at INFO)."""
    global _told_torchscript_only
    ops = dynamo_routed_ops(config)
    torchscript_only = sorted(set(routed_ops(config)) - set(DYNAMO_OPS)) if not is_auto(config) else []
    if (torchscript_only or is_auto(config)) and not _told_torchscript_only:
        _told_torchscript_only = True
        logger.info(
            "aten_fallback: %s on the TorchScript route only; on the dynamo route %s",
            "torch_kernels = auto measures"
            if is_auto(config)
            else f"torch_kernels ({', '.join(torchscript_only)}) runs on PyTorch's kernels",
            f"the default list runs on PyTorch's kernels ({', '.join(sorted(ops))})"
            if is_auto(config)
            else f"{', '.join(torchscript_only)} stays in ORT (the written-out tanh GELU is still replaced)",
        )
    listed = fallback_ops(config)
    if ops or listed:
        prepare_runtime()
    passes = [GraphPass(PROGRAM_PASS, run=program_pass(listed))] if listed else []
    if ops & {"layer_norm", "cross_entropy"}:
        passes.append(GraphPass(KERNELS_PASS, run=program_kernels(ops)))
    return passes


def dynamo_routed_ops(config: Config) -> frozenset[str]:
    """The ops the dynamo route runs on PyTorch's kernels: the ones listed that it can route (:data:`DYNAMO_OPS`);
    with ``auto``, which measures on the TorchScript route only, the default list's."""
    ops = frozenset(DEFAULT_OPS) if is_auto(config) else routed_ops(config)
    return ops & frozenset(DYNAMO_OPS)


@hookimpl
def ortcore_export_translations(config: Config) -> dict[Any, Any]:
    """Embedding and GELU on PyTorch's kernels (``torch_kernels``; with ``auto``, the default list's), and the
    translations of the wrapper ops the program passes made (one ATen node each)."""
    table = translations_for(dynamo_routed_ops(config))
    if fallback_ops(config):
        table.update(aten_program.translations())
    return table


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    ops = routed_ops(config)
    if not ops and not fallback_ops(config):
        return []
    passes = [GraphPass(TYPE_OUTPUTS_PASS, run=type_aten_outputs)]
    if fallback_ops(config):
        passes.append(GraphPass(DISTINCT_PASS, run=_distinct_inputs))
    if is_auto(config):
        passes.append(GraphPass(TANH_GELU_PASS, run=_measured_tanh_gelu, before=(TYPE_OUTPUTS_PASS,)))
        passes.append(GraphPass(KERNEL_CHOICE_PASS, run=_record_choices, after=(TANH_GELU_PASS,)))
    elif "gelu" in ops:
        passes.append(GraphPass(TANH_GELU_PASS, run=replace_tanh_gelu, before=(TYPE_OUTPUTS_PASS,)))
    return passes


KERNEL_CHOICE_PASS = "aten_fallback.kernel_choice"


def _distinct_inputs(model: Any, context: Any) -> int:
    """No value read by two ATen nodes (ORT would define a gradient of it twice), and on the dynamo route, whose
    optimizer merges equal values, no value twice among an ATen node's inputs."""
    separated = aten_program.separate_shared_aten_inputs(model)
    if exporter_name(context.config) != DYNAMO:
        return separated
    return separated + aten_program.distinct_aten_inputs(model)


def _measured_tanh_gelu(model: Any, context: Any) -> int:
    """The tanh-GELU pass of ``auto``: each written-out formula becomes an ATen gelu only where PyTorch measured
    faster, on the sizes traced at its Tanh."""
    route = kernel_choice.tanh_gelu_route(context.config, model, take_tanh_sizes())
    return replace_tanh_gelu(model, context, route=route)


def _record_choices(model: Any, context: Any) -> int:
    """The export's kernel decisions go into the graph's metadata (so a cached graph carries them); a graph holding
    a choice for now only (deferred, provisional) is marked, so that caches keep it apart from final graphs."""
    decisions = kernel_choice.take_pending()
    kernel_choice.record(model, decisions)
    waiting = sorted({d.source for d in decisions if d.source in (kernel_choice.DEFERRED, kernel_choice.PROVISIONAL)})
    if waiting and not any(p.key == PROVISIONAL_METADATA for p in model.metadata_props):
        model.metadata_props.add(key=PROVISIONAL_METADATA, value=f"kernel choices not final ({', '.join(waiting)})")
    return len(decisions)


@hookimpl
def ortcore_runtime_inspectors(config: Config, module: Any) -> list[Any]:
    """With ``torch_kernels = "auto"`` and ``measure = "later"``: the cases decided by the default list are timed
    on a later step (:class:`.kernel_choice.LaterMeasurement`); with ``"export"`` too, for the cases of a graph
    measured under load (provisional, perhaps by an earlier process whose graph the export cache served)."""
    if is_auto(config) and measure_mode(config) in ("later", "export"):
        return [kernel_choice.LaterMeasurement(config, module)]
    return []


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    if is_auto(config):
        # The choice depends on the machine and threads as well: a graph exported elsewhere is not reused here.
        key: dict[str, Any] = {
            "aten_fallback.torch_kernels": AUTO,
            "aten_fallback.kernel_choice": kernel_choice.environment(),
        }
    else:
        key = {"aten_fallback.torch_kernels": sorted(routed_ops(config))}
    listed = fallback_ops(config)
    if listed:  # only then: the keys (and export caches) of models without fallback ops stay as they were
        key["aten_fallback.fallback_ops"] = sorted(listed)
    return key


@hookimpl
def ortcore_repairs(config: Config, failure: Any) -> list[Any]:
    """An op the export failed on, or one exported as a node ORT has no kernel for, becomes an ATen node
    (``fallback_ops``): see :mod:`.repairs`."""
    return repairs_for(config, failure)


@hookimpl
def ortcore_session_plan(graph: Any, plan: Any) -> None:
    """Executor failures in a graph with ATen nodes are raised from the run that hit them, naming the op; a routed
    op's shared gradients do not outlive a run."""
    aten_nodes.guard_runs(graph, plan)
