"""control_flow: ``torch.cond`` on the dynamo route, run by PyTorch inside ONNX Runtime's training graph.

``torch.export`` cannot follow Python control flow on a tensor's value; ``torch.cond(pred, true_fn, false_fn,
operands)`` is how a model says it, and the dynamo exporter writes it as an ONNX ``If``. ONNX Runtime 1.19.2 aborts
the process building a training graph that holds an ``If`` (ortcore refuses such a graph first), so this plugin
runs each ``cond`` call with PyTorch instead, as one ``org.pytorch.aten::ATen`` node:

* a program pass (``ortcore_program_passes``) turns each ``cond`` call of the exported program into a call of an op
  of its own, ``ortcore_cond::cond_<n>(Tensor pred, Tensor[] operands) -> (Tensor, ...)``, whose kernel evaluates
  ``pred`` and runs the branch it picks (the branch's graph, as ``torch.export`` captured it); while a program is
  traced with fake tensors it runs the true branch, whose outputs ``torch.cond`` requires to match the false one's;
* the services' ATen routing (:func:`ortcore_plugins.services.aten_program.route_calls`) makes that call one ATen
  node whose gradient re-runs it under ``torch.autograd``: the branch taken gets its gradients, the parameters it
  reads included (``torch.export`` passes them as operands);
* the translations of the routed calls go to ``ortcore_export_translations``.

Each routed ``cond`` is logged once at INFO and recorded in the model's metadata (``ortcore.routed::cond``) like the
op_routing plugin's routes. ``ORTCORE_CONTROL_FLOW=0`` (or ``[plugins.control_flow] enabled = false``) leaves
``cond`` to the exporter (its ``If`` is then refused in training graphs, and runs in inference ones). Other
higher-order ops (``while_loop``, ``scan``, ``map``) are not handled: a training graph holding their ``Loop`` or
``Scan`` is refused, naming the node.
"""

from __future__ import annotations

import itertools
import logging
import operator
import re
import threading
from typing import Any

import attrs
import onnx
import torch

from ortcore.api import ROUTED_METADATA_PREFIX, Config, GraphPass, PassContext, hookimpl, option, parse_bool
from ortcore_plugins.services import aten_nodes, aten_program

logger = logging.getLogger("ortcore.control_flow")

NAME = "control_flow"
ENV_ENABLED = "ORTCORE_CONTROL_FLOW"
NAMESPACE = "ortcore_cond"
PROGRAM_PASS = "control_flow.cond"
REASONS_PASS = "control_flow.reasons"
REASON = "ONNX Runtime cannot build a training graph holding an If (torch.cond)"


@attrs.frozen
class ControlFlowOptions:
    """``[plugins.control_flow]`` in ortcore.toml."""

    enabled: bool = option(
        True, parse_bool, "run torch.cond with PyTorch inside the ORT graph (dynamo route)", env=ENV_ENABLED
    )


def _options(config: Config) -> ControlFlowOptions:
    return config.plugin_options(NAME)


# -- one op per cond call site ----------------------------------------------------------------------------------------

_library: torch.library.Library | None = None
_lock = threading.Lock()
_numbers = itertools.count()


def _is_fake(value: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(value)


def define_cond_op(true_branch: torch.fx.GraphModule, false_branch: torch.fx.GraphModule, n_outputs: int) -> Any:
    """Define ``ortcore_cond::cond_<n>`` running ``true_branch`` or ``false_branch`` on the operands; returns its
    default overload."""
    global _library
    with _lock:
        if _library is None:
            _library = torch.library.Library(NAMESPACE, "FRAGMENT")
        name = f"cond_{next(_numbers)}"
        returns = ", ".join(["Tensor"] * n_outputs)
        _library.define(f"{name}(Tensor pred, Tensor[] operands) -> ({returns})")

        def run(pred: torch.Tensor, operands: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            if _is_fake(pred):
                branch = true_branch  # torch.cond requires both branches to give outputs of the same metadata
            else:
                branch = true_branch if bool(pred) else false_branch
            result = branch(*operands)
            results = tuple(result) if isinstance(result, tuple | list) else (result,)
            # ORT owns what the executor hands back: an operand returned as it is, or a view of one, is copied.
            ids = {id(o) for o in operands}
            results = tuple(r.clone() if id(r) in ids or r._is_view() else r for r in results)
            return results if n_outputs > 1 else results[0]

        # CompositeImplicitAutograd: the call decomposes into the branch's ops, so autograd differentiates it.
        _library.impl(name, run, "CompositeImplicitAutograd")
    return getattr(torch.ops, NAMESPACE).__getattr__(name).default


def _branch(program: torch.export.ExportedProgram, node: Any) -> torch.fx.GraphModule:
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        raise ValueError(f"a torch.cond branch is {node!r}, not a subgraph")
    module = program.graph_module
    for part in node.target.split("."):
        module = getattr(module, part)
    return module


def replace_conds(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """Make each ``torch.cond`` call of ``program`` call an op of its own (:func:`define_cond_op`); returns the
    changed nodes. A call whose operands are not all tensors stays as it is (logged at WARNING)."""
    changed = []
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.higher_order.cond:
            continue
        pred, true_node, false_node, operands = node.args[:4]
        operands = list(operands)
        if not all(isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) for o in operands):
            logger.warning("a torch.cond call with non-tensor operands stays as the exporter writes it (an If)")
            continue
        val = node.meta.get("val")
        outputs = list(val) if isinstance(val, tuple | list) else [val]
        op = define_cond_op(_branch(program, true_node), _branch(program, false_node), len(outputs))
        node.target = op
        node.args = (pred, operands)
        node.kwargs = {}
        if len(outputs) == 1:  # the op returns its one output itself; the cond's users took item 0 of a list
            node.meta["val"] = outputs[0]
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem and user.args[1] == 0:
                    user.replace_all_uses_with(node)
                    graph.erase_node(user)
        else:
            node.meta["val"] = tuple(outputs)
        for branch in (true_node, false_node):
            if not branch.users:
                graph.erase_node(branch)
        changed.append(node)
    return changed


def route_conds(program: torch.export.ExportedProgram, context: PassContext) -> int:
    """The program pass: every ``cond`` call becomes one ATen node run by PyTorch; returns how many."""
    changed = set(replace_conds(program))
    if not changed:
        return 0
    routed = aten_program.route_calls(program, context.module, lambda node, reach: REASON if node in changed else None)
    if routed:
        logger.info("torch.cond runs with PyTorch inside the ORT graph (%d call(s)): %s", len(routed), REASON)
    program.graph_module.recompile()
    return len(routed)


_COND_WRAPPER = re.compile(r"::cond_\d+__")


def add_reasons(model: onnx.ModelProto, _context: Any = None) -> None:
    """Record ``ortcore.routed::cond`` in the model's metadata when one of its ATen nodes runs a cond op (the
    wrapper ops of ``ortcore_cond::cond_<n>`` are named ``cond_<n>__...``)."""
    key = f"{ROUTED_METADATA_PREFIX}cond"
    for node in model.graph.node:
        operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
        if node.op_type == "ATen" and _COND_WRAPPER.search(operator):
            if not any(p.key == key for p in model.metadata_props):
                model.metadata_props.add(key=key, value=REASON)
            return


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return ControlFlowOptions


@hookimpl
def ortcore_program_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(PROGRAM_PASS, run=route_conds)] if _options(config).enabled else []


@hookimpl
def ortcore_export_translations(config: Config) -> dict[Any, Any]:
    return aten_program.translations() if _options(config).enabled else {}


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(REASONS_PASS, run=add_reasons)] if _options(config).enabled else []


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    return {"control_flow.enabled": _options(config).enabled}


@hookimpl
def ortcore_session_plan(config: Config, graph: Any, plan: Any) -> None:
    """The ATen node service's run guard (executor failures raised from the run, gradients shared by a node's helper
    nodes cleared around it), also when no other ATen plugin is enabled."""
    if _options(config).enabled:
        aten_nodes.guard_runs(graph, plan)
