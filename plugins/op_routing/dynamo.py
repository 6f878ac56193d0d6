"""The dynamo route of op routing: the same decisions taken in ``torch.export``'s program before it is translated
(a program pass): :data:`PROGRAM_ROUTES` names the calls each route applies to as the program holds them, ops without
an onnxscript translation are found from the exporter's registry, and each such call becomes a wrapper op written as
one ATen node (:mod:`ortcore_plugins.services.aten_program`); ``as_strided`` and ``embedding(max_norm=...)`` are
rewritten in the program as the TorchScript route's tracing mode writes them.

Everything the dynamo exporter alone needs is here: without that exporter, this module goes.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import attrs
import onnx
import torch

from ortcore.api import PassContext
from ortcore_plugins.services import aten_program
from ortcore_plugins.services.torch_kernels import prepare_runtime

from . import shared
from .shared import (
    _UNARY_WITHOUT_GRADIENT,
    AS_STRIDED_REASON,
    RENORM_REASON,
    ROUTES,
    Route,
    _gap_error,
    _note_routed,
    _number,
    _reads,
    renorm_op,
    storage_order,
)

EXPORTER_GAP_DYNAMO = "the dynamo exporter has no onnxscript translation for it"


# -- the dynamo route: calls of the exported program -----------------------------------------------------------------
#
# torch.export keeps CompositeImplicitAutograd ops whole (gru.input, group_norm, instance_norm, einsum,
# conv_transpose2d.input, upsample_bilinear2d.vec, ...): the dynamo route finds a route's calls at that level, in the
# exported program's FX graph, before torch.onnx decomposes anything, and turns each into a wrapper op that its
# translation writes as one ATen node (ortcore_plugins.services.aten_program).


def _flag(name: str) -> Callable[[dict[str, Any], Any], bool]:
    return lambda arguments, target: bool(arguments.get(name))


def _is_program_reduction(arguments: dict[str, Any], target: Any) -> bool:
    """``max``/``min`` over the whole tensor or a dim (ReduceMax/ReduceMin), not the binary ``max.other``."""
    return target._overloadname in ("default", "dim")


def _given_state(arguments: dict[str, Any], target: Any) -> bool:
    """An RNN call whose initial state is not the zeros torch makes when the model passes none."""
    states = arguments.get("hx")
    states = states if isinstance(states, list | tuple) else [states]
    zeros = (torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default)
    return any(not (isinstance(h, torch.fx.Node) and h.target in zeros) for h in states if h is not None)


@attrs.frozen
class ProgramRoute:
    """Which calls of the exported program a :class:`Route` applies to on the dynamo route."""

    route: Route
    ops: tuple[str, ...]  # aten op names as the program calls them
    when: Callable[[dict[str, Any], Any], bool] | None = None  # (arguments by name, OpOverload) -> route this call?


_BY_OP = {r.op: r for r in ROUTES}

PROGRAM_ROUTES: tuple[ProgramRoute, ...] = (
    *(
        ProgramRoute(_BY_OP[op], (op,))
        for op in ("hardswish", "hardsigmoid", "einsum", "cumsum", "instance_norm", "group_norm", "amax", "amin")
    ),
    ProgramRoute(_BY_OP["max"], ("max",), _is_program_reduction),
    ProgramRoute(_BY_OP["min"], ("min",), _is_program_reduction),
    *(ProgramRoute(_BY_OP[op], (op,), _flag("bidirectional")) for op in ("gru", "lstm")),
    *(
        ProgramRoute(
            Route(
                op,
                onnx_op,
                f"the dynamo exporter's {onnx_op} translation fails on an initial state the model passes (its batch "
                "size becomes a symbolic attribute)",
                gradient_only=False,
            ),
            (op,),
            _given_state,
        )
        for op, onnx_op in (("gru", "GRU"), ("lstm", "LSTM"))
    ),
    *(
        ProgramRoute(_BY_OP[op], (op,))
        for op in ("rnn_tanh", "rnn_relu", "softplus", "prelu", "pixel_shuffle", "grid_sampler")
    ),
    ProgramRoute(_BY_OP["grid_sampler"], ("grid_sampler_2d", "grid_sampler_3d")),
    ProgramRoute(_BY_OP["_convolution"], ("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")),
    ProgramRoute(_BY_OP["_convolution"], ("convolution", "_convolution"), _flag("transposed")),
    *(ProgramRoute(r, (r.op,)) for r in ROUTES if r.onnx_op == "Resize"),
    ProgramRoute(_BY_OP["flip"], ("flip",)),
    ProgramRoute(_BY_OP["multinomial"], ("multinomial",)),
    ProgramRoute(_BY_OP["diagonal"], ("diagonal",)),
    *(
        ProgramRoute(_BY_OP[op], (op,))
        for op in (
            "index_add",
            "scatter_add",
            "scatter_reduce",
            "topk",
            "fmod",
            "remainder",
            "round",
            "floor",
            "ceil",
            "trunc",
            "sign",
        )
    ),
    ProgramRoute(_BY_OP["index_put"], ("index_put",), _flag("accumulate")),
    ProgramRoute(
        _BY_OP["repeat_interleave"],
        ("repeat_interleave",),
        lambda arguments, target: target._overloadname in ("Tensor", "self_Tensor"),
    ),
    ProgramRoute(
        _BY_OP["div"],
        ("div",),
        lambda arguments, target: arguments.get("rounding_mode") is not None,
    ),
    *(ProgramRoute(_BY_OP[op], (op,)) for op in ("atan2", "atan", *_UNARY_WITHOUT_GRADIENT)),
    ProgramRoute(_BY_OP["pad"], ("pad",), lambda arguments, target: arguments.get("mode") not in (None, "constant")),
    ProgramRoute(
        Route(
            "linalg_vector_norm",
            "ReduceL1/ReduceMax",
            "ORT has no gradient builder for ReduceL1 and ReduceMax, the dynamo exporter's other norms than 2 mix "
            "integer and float types, and ORT's gradient of a norm over every dimension is an invalid graph",
        ),
        ("linalg_vector_norm",),
        lambda arguments, target: float(arguments.get("ord", 2)) != 2 or not arguments.get("dim"),
    ),
    ProgramRoute(_BY_OP["embedding_bag"], ("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")),
    ProgramRoute(
        Route(
            "argsort",
            "(no translation)",
            "the dynamo exporter decomposes argsort(stable=True) into sort.stable, which it cannot translate",
            gradient_only=False,
        ),
        ("argsort",),
        lambda arguments, target: bool(arguments.get("stable")),
    ),
    ProgramRoute(
        Route(
            "hypot",
            "(no translation)",
            "the dynamo exporter decomposes hypot into prims.hypot, which it cannot translate",
            gradient_only=False,
        ),
        ("hypot",),
    ),
    ProgramRoute(
        Route(
            "cumprod",
            "(no translation)",
            "the dynamo exporter decomposes cumprod into prims.prod, which it cannot translate",
            gradient_only=False,
        ),
        ("cumprod",),
    ),
    # The dynamo exporter writes grouped-query attention (an Unsqueeze and Expand of the key and value heads), but
    # ORT's gradient of that Unsqueeze fails at run time (a Squeeze given a scalar axes tensor).
    ProgramRoute(
        Route(
            "scaled_dot_product_attention",
            "Unsqueeze/Expand",
            "ORT's Unsqueeze gradient fails on the dynamo exporter's grouped-query attention (enable_gqa=True)",
        ),
        ("scaled_dot_product_attention",),
        _flag("enable_gqa"),
    ),
)


def _program_reason(
    node: torch.fx.Node,
    routes: dict[str, list[ProgramRoute]],
    reach: aten_program.GradientReach,
    gaps: bool,
    translated: frozenset = frozenset(),
) -> str | None:
    """Why ``node`` runs on PyTorch's kernel (None: it stays in ORT): the first of its op's routes that applies."""
    target = node.target
    candidates = routes.get(target._schema.name.rpartition("::")[2], []) if target.namespace == "aten" else []
    for program_route in candidates:
        route = program_route.route
        if program_route.when is not None:
            try:
                arguments = dict(zip([a.name for a in target._schema.arguments], aten_program.bind(node), strict=True))
            except aten_program.Unroutable:
                continue
            if not program_route.when(arguments, target):
                continue
        device = aten_program.device_of(node)
        if device is not None and device not in route.devices:
            continue
        if route.gradient_only and not aten_program.may_need_gradient(node, reach):
            continue
        return route.reason
    if not candidates and gaps and not aten_program.has_translation(target, translated, node):
        return EXPORTER_GAP_DYNAMO
    return None


def route_program(program: torch.export.ExportedProgram, context: PassContext, never: Collection[str] = ()) -> int:
    """The dynamo route's routing: calls the routes apply to and ops the exporter cannot translate become wrapper ops
    exported as ATen nodes (routes and rewrites named in ``never`` left out)."""
    by_op: dict[str, list[ProgramRoute]] = {}
    for r in PROGRAM_ROUTES:
        if r.route.op not in never:
            for op in r.ops:
                by_op.setdefault(op, []).append(r)

    def decide(node: torch.fx.Node, reach: aten_program.GradientReach) -> str | None:
        return _program_reason(node, by_op, reach, gaps=True, translated=context.translated)

    if "as_strided" not in never:
        as_strided_program(program)
    renormed = set(renorm_program(program)) if "embedding_renorm" not in never else set()

    def decide_all(node: torch.fx.Node, reach: aten_program.GradientReach) -> str | None:
        return RENORM_REASON if node in renormed else decide(node, reach)

    routed = aten_program.route_calls(program, context.module, decide_all, prepare_runtime)
    _decided.clear()
    for name, reason in routed:
        _note_routed(name.removeprefix("aten::"), reason)
        _decided.setdefault(name.rpartition("::")[2], reason)
    return len(routed)


# The reasons the last program pass routed each op for (an op has several routes: gru's direction, its given state),
# which the metadata pass of the same export records.
_decided: dict[str, str] = {}


# The reason of each op's first program route, what explain() shows when the last pass recorded none.
PROGRAM_REASONS: dict[str, str] = {}
for _route in PROGRAM_ROUTES:
    for _op in _route.ops:
        PROGRAM_REASONS.setdefault(_op, _route.route.reason)


def add_reasons(model: onnx.ModelProto) -> None:
    """The reasons of a dynamo export's ATen nodes (:func:`.shared.add_reasons`)."""
    shared.add_reasons(model, PROGRAM_REASONS, EXPORTER_GAP_DYNAMO, _decided)


# -- as_strided and embedding(max_norm=...) as torch computes them (see .shared) ------------------------------------


def renorm_program(program: torch.export.ExportedProgram, reach: Any = None) -> list[torch.fx.Node]:
    """The dynamo route's :func:`embedding_exact`: an ``embedding_renorm_`` of (a detached alias of) a weight makes
    the later lookups of that weight read :func:`renorm_op`'s result instead; returns the nodes made."""
    graph = program.graph_module.graph
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    made = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding_renorm_.default:
            continue
        alias, indices, max_norm, norm_type = node.args[:4]
        weight = alias
        while isinstance(weight, torch.fx.Node) and weight.target in (aten.detach.default, aten.alias.default):
            weight = weight.args[0]
        lookups = [
            user
            for user in weight.users
            if user.target is aten.embedding.default and user.args[0] is weight and order[user] > order[node]
        ]
        with graph.inserting_before(node):
            renormed = graph.call_function(renorm_op().default, (weight, indices, float(max_norm), float(norm_type)))
        renormed.meta["val"] = weight.meta.get("val")
        for user in lookups:
            user.replace_input_with(weight, renormed)
        graph.erase_node(node)
        if isinstance(alias, torch.fx.Node) and alias is not weight and not alias.users:
            graph.erase_node(alias)
        made.append(renormed)
    if made:
        program.graph_module.recompile()
    return made


def _view_root(node: torch.fx.Node) -> torch.fx.Node:
    while (
        node.op == "call_function"
        and getattr(node.target, "is_view", False)
        and node.args
        and isinstance(node.args[0], torch.fx.Node)
    ):
        node = node.args[0]
    return node


def as_strided_program(program: torch.export.ExportedProgram) -> int:
    """The dynamo route's :func:`as_strided_exact`: each ``aten.as_strided`` call of ``program`` whose input is not
    contiguous from its storage's start reads from the tensor owning the memory, in storage order (from the fake
    tensors' strides and offsets)."""
    graph = program.graph_module.graph
    aten = torch.ops.aten
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.as_strided.default:
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        size, stride = node.args[1], node.args[2]
        given = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
        start = _number(value.storage_offset())
        if value.is_contiguous() and (given is None or start == 0):
            continue
        root = _view_root(source)
        owner = root.meta.get("val")
        if not isinstance(owner, torch.Tensor):
            continue
        order = storage_order(
            tuple(_number(n) for n in owner.shape),
            tuple(_number(s) for s in owner.stride()),
            _number(owner.storage_offset()),
        )
        if order is None:
            raise _gap_error("of a tensor whose memory has gaps (a strided slice)")
        offset = start if given is None else _number(given)
        first, last = _reads(size, stride, offset)
        if first < order.start or last >= order.start + order.numel:
            raise _gap_error(f"{first}..{last}, outside the {order.numel} its owner covers from {order.start}")
        with graph.inserting_before(node):
            flat = root
            for d in order.drop:
                flat = graph.call_function(aten.select.int, (flat, d, 0))
            if order.permutation != tuple(range(len(order.permutation))):
                flat = graph.call_function(aten.permute.default, (flat, list(order.permutation)))
            flat = graph.call_function(aten.reshape.default, (flat, [-1]))
            replacement = graph.call_function(aten.as_strided.default, (flat, size, stride, offset - order.start))
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        changed += 1
    if changed:
        _note_routed("as_strided", AS_STRIDED_REASON, kind="written in storage order")
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return changed
