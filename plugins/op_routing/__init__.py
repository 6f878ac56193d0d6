"""Per-op routing: an op ONNX Runtime cannot export, differentiate or run becomes one ATen node run by PyTorch.

One op that ORT cannot handle should not send the whole model back to PyTorch. This plugin decides, while the model
is exported, which ops ORT cannot serve on the model's device, and exports each of them as an
``org.pytorch.aten::ATen`` node that the ATen executor (:mod:`ortcore_plugins.services.aten_executor`) runs with PyTorch's
kernel; its gradient is PyTorch's autograd gradient (a VJP node per floating-point input PyTorch differentiates,
:mod:`ortcore_plugins.services.differentiability`). Everything else stays in ORT. Three sources of decisions:

* **ORT gaps** (:data:`ROUTES`): ops whose ONNX form ORT 1.19.2 has no gradient builder for (HardSwish, Einsum,
  CumSum, InstanceNormalization, ReduceMax, Softplus, PRelu, DepthToSpace, GridSample, RNN, ...), no CPU kernel for
  the gradient (ConvTransposeGrad, ResizeGrad),
  a kernel that rejects the case (bidirectional GRU/LSTM, Multinomial of rank > 2) or a kernel known to fail or
  abort the process (negative-step SliceGrad of ``flip``, ``diagonal``). Each entry names the reason and, where only
  some calls are affected, the condition (a transposed convolution, a bidirectional RNN). Every entry is checked
  against ORT in ``tests/plugins/test_op_routing.py``: a test fails when ORT starts handling the op itself.
* **Exporter gaps**: an ``aten::`` op without an ONNX symbolic (``histc``, ``ctc_loss``, ``cummax``, ...) is found by
  the exporter's "not supported" error and exported as an ATen node too (the ``aten_fallback`` plugin's ``auto``
  mode, on by default here).
* Ops the ``aten_fallback`` plugin runs on PyTorch's kernels for speed.

Calls rather than single ops: a packed sequence (``_pack_padded_sequence``, the RNN's ``.data`` overload over it,
``_pad_packed_sequence``) is routed as a whole, a connected region of ATen nodes (:data:`.shared.PACKED_REASON`); on
the TorchScript route an aten call whose symbolic writes a Loop or If, or raises anything (a shape-inference
assertion included), is routed as an export failure; tuple and tensor-list results are one ATen output per tensor.

Each routed op is logged once per export at INFO with its reason and recorded in the exported model's metadata
(``ortcore.routed::<op>``), which :func:`ortcore.explain.explain` and ``ortcore explain`` read.

Two ATen-node limits of ORT 1.19.2 are lifted by exporting a *wrapper op* (``ortcore_route::*``, defined once per
signature with ``torch.library``) instead of the op itself: ORT builds an ATen node's gradient only when its first
input needs one, so the wrapper takes first an input that does; and the executor passes tensors one by one, so a
tensor list (``einsum``'s operands, an RNN's weights) becomes separate inputs. The wrapper also copies outputs that
alias an input (``diagonal``'s view), which ORT must own.

On the dynamo route the same decisions are taken in ``torch.export``'s program, before it is translated
(``ortcore_program_passes``): :data:`PROGRAM_ROUTES` names the calls each route applies to as the program holds them
(``torch.export`` keeps CompositeImplicitAutograd ops such as ``gru.input``, ``group_norm`` and
``conv_transpose2d.input`` whole), ops without an onnxscript translation are found from the exporter's registry, and
each such call becomes a wrapper op whose translation (``ortcore_export_translations``) writes one ATen node
(:mod:`ortcore_plugins.services.aten_program`).

The plugin is split by route, so that dropping an exporter means deleting its module: :mod:`.shared` (the routes
table, the log and the reasons ``explain`` reads, the storage-order and renormalization forms), :mod:`.torchscript`
(symbolics, routing on export failure, exact tracing) and :mod:`.dynamo` (the program pass); this module holds the
options and the hooks, and re-exports the names tests use.
"""

from __future__ import annotations

from typing import Any

import attrs
import onnx
import torch

from ortcore.api import (
    DYNAMO,
    TORCHSCRIPT,
    Config,
    GraphPass,
    OptionError,
    PassContext,
    aten_kind,
    exporter_name,
    hookimpl,
    operator_of,
    option,
    parse_bool,
)
from ortcore_plugins.services import aten_nodes, aten_program
from ortcore_plugins.services.aten_nodes import type_aten_outputs
from ortcore_plugins.services.torch_kernels import prepare_runtime

from . import dynamo, torchscript
from .dynamo import EXPORTER_GAP_DYNAMO, PROGRAM_ROUTES, ProgramRoute
from .shared import (
    AS_STRIDED_REASON,
    FASTER_IN_TORCH,
    METADATA_PREFIX,
    PACKED_REASON,
    RENORM_OP,
    RENORM_REASON,
    REWRITES,
    ROUTE_OPS,
    ROUTES,
    WRAPPER_NAMESPACE,
    Route,
    StorageOrder,
    storage_order,
)
from .torchscript import EXPORTER_FAILED, EXPORTER_GAP

# The names tests use, wherever they live in the package.
__all__ = [
    "AS_STRIDED_REASON",
    "EXPORTER_FAILED",
    "EXPORTER_GAP",
    "EXPORTER_GAP_DYNAMO",
    "FASTER_IN_TORCH",
    "LISTED_REASON",
    "METADATA_PREFIX",
    "NAME",
    "PACKED_REASON",
    "PROGRAM_ROUTES",
    "RENORM_OP",
    "RENORM_REASON",
    "REWRITES",
    "ROUTES",
    "ROUTE_OPS",
    "WRAPPER_NAMESPACE",
    "OpRoutingOptions",
    "ProgramRoute",
    "Route",
    "StorageOrder",
    "parse_never",
    "storage_order",
    "symbolics",
]

NAME = "op_routing"
ENV_ENABLED = "ORTCORE_OP_ROUTING"
ENV_NEVER = "ORTCORE_OP_ROUTING_NEVER"
REASONS_PASS = "op_routing.reasons"
TYPES_PASS = "op_routing.typed_outputs"
DISTINCT_PASS = "op_routing.distinct_inputs"
PROGRAM_PASS = "op_routing.program"


# -- options --------------------------------------------------------------------------------------------------------


def parse_never(value: object, source: str) -> tuple[str, ...]:
    """Op names of :data:`ROUTES` that stay in ORT, as a list or a comma-separated string."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise OptionError(f"{source}={value!r} must be a list of op names (or a comma-separated string)")
    names = []
    for item in items:
        name = item.rpartition("::")[2]
        if name not in ROUTE_OPS:
            import difflib

            close = difflib.get_close_matches(name, sorted(ROUTE_OPS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise OptionError(
                f"{source}={value!r}: {item!r} is not an op this plugin routes; allowed: "
                f"{', '.join(sorted(ROUTE_OPS))}.{hint}"
            )
        names.append(name)
    return tuple(dict.fromkeys(names))


@attrs.frozen
class OpRoutingOptions:
    """Options of the ``op_routing`` plugin (``[plugins.op_routing]`` in ortcore.toml)."""

    enabled: bool = option(
        True, parse_bool, "route ops ORT cannot export, differentiate or run to PyTorch's kernels", env=ENV_ENABLED
    )
    never: tuple[str, ...] = option(
        (), parse_never, "ops of the routing table that stay in ORT even where ORT lacks them", env=ENV_NEVER
    )


def _options(config: Config) -> OpRoutingOptions:
    return config.plugin_options(NAME) or OpRoutingOptions()


def symbolics(config: Config) -> dict[str, Any]:
    """The TorchScript route's symbolics (:func:`.torchscript.symbolics`), none when the plugin is off."""
    options = _options(config)
    return torchscript.symbolics(options.never) if options.enabled else {}


def _route_program(program: torch.export.ExportedProgram, context: PassContext) -> int:
    return dynamo.route_program(program, context, _options(context.config).never)


def _reasons_pass(model: onnx.ModelProto, context: PassContext | None = None) -> int:
    """After the other passes (tanh-GELU adds ATen nodes): every ATen node's op has a recorded reason."""
    before = len(model.metadata_props)
    if context is not None:
        _listed_reasons(model, context.config)
    if context is not None and exporter_name(context.config) == DYNAMO:
        dynamo.add_reasons(model)
    else:
        torchscript.add_reasons(model)
    return len(model.metadata_props) - before


LISTED_REASON = "listed in aten_fallback's fallback_ops: run on PyTorch's kernel by choice"


def _listed_reasons(model: onnx.ModelProto, config: Config) -> None:
    """The reason of an ATen node whose op the user listed in ``aten_fallback``'s ``fallback_ops`` (that plugin
    exports it; the option is read from the configuration, no plugin is imported)."""
    listed = {op.rpartition("::")[2] for op in getattr(config.plugin_options("aten_fallback"), "fallback_ops", ())}
    if not listed:
        return
    known = {p.key for p in model.metadata_props}
    for node in model.graph.node:
        if node.op_type != "ATen" or node.domain != aten_nodes.ATEN_DOMAIN:
            continue
        op = aten_kind(operator_of(node))
        if op in listed and METADATA_PREFIX + op not in known:
            model.metadata_props.add(key=METADATA_PREFIX + op, value=LISTED_REASON)
            known.add(METADATA_PREFIX + op)


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return OpRoutingOptions


@hookimpl
def ortcore_configure(config: Config) -> None:
    if _options(config).enabled:
        prepare_runtime()


@hookimpl
def ortcore_export_symbolics(config: Config) -> dict[str, Any]:
    return symbolics(config)


@hookimpl
def ortcore_export_failed(config: Config, error: Any, symbolics: dict[str, Any]) -> dict[str, Any] | None:
    if not _options(config).enabled or exporter_name(config) != TORCHSCRIPT:
        return None  # routing by symbolics is the TorchScript route's
    return torchscript.symbolics_for_failure(error, symbolics)


@hookimpl
def ortcore_export_context(config: Config, module: Any) -> Any:
    if not _options(config).enabled or exporter_name(config) != TORCHSCRIPT:
        return None
    return torchscript.exact_tracing(frozenset(_options(config).never))


@hookimpl
def ortcore_program_passes(config: Config) -> list[GraphPass]:
    """The dynamo route: routed calls and ops the exporter cannot translate become wrapper ops (ATen nodes)."""
    if not _options(config).enabled:
        return []
    return [GraphPass(PROGRAM_PASS, run=_route_program)]


@hookimpl
def ortcore_export_translations(config: Config) -> dict[Any, Any]:
    """The translations of the wrapper ops the program passes made (one ATen node each)."""
    if not _options(config).enabled:
        return {}
    return aten_program.translations()


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    if not _options(config).enabled:
        return []
    # type_aten_outputs is idempotent: aten_fallback may run it too.
    return [
        GraphPass(TYPES_PASS, run=type_aten_outputs),
        GraphPass(REASONS_PASS, run=_reasons_pass),
        GraphPass(DISTINCT_PASS, run=_distinct_inputs),
    ]


def _distinct_inputs(model: onnx.ModelProto, context: PassContext) -> int:
    """No value read by two ATen nodes (ORT would define a gradient of it twice), and on the dynamo route, whose
    optimizer merges equal values, no value twice among an ATen node's inputs (idempotent: aten_fallback may run it
    too)."""
    separated = aten_program.separate_shared_aten_inputs(model)
    if exporter_name(context.config) != DYNAMO:
        return separated
    return separated + aten_program.distinct_aten_inputs(model)


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    options = _options(config)
    return {
        "op_routing": {"enabled": options.enabled, "never": sorted(options.never)},
        "op_routing.never_rewritten": sorted(frozenset(options.never) & REWRITES),
    }


@hookimpl
def ortcore_session_plan(config: Config, graph: Any, plan: Any) -> None:
    """Executor failures in a graph with ATen nodes are raised from the run, and the gradients a routed op's helper
    nodes share are cleared around it (the ATen node service's guard, as ``aten_fallback`` installs it), also when
    that plugin is disabled."""
    if _options(config).enabled:
        aten_nodes.guard_runs(graph, plan)
