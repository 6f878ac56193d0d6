"""The lowering of traced ``detach()`` markers before ONNX Runtime's gradient build (``ortcore_lower_stop_gradients``).

A host composed without gradient_fixes (``ortcore.testing.make_host``) registers this module alone: the core hands
every host's builds to it, and a model calling ``detach()`` must train there with torch's gradients too.
"""

from __future__ import annotations

from typing import Any

import onnx

from ortcore.api import (
    ATEN_DOMAIN,
    STOP_GRADIENT_DOMAIN,
    Config,
    StopGradientLowering,
    UnsupportedModelError,
    hookimpl,
    probe_session,
    value_dependencies,
)

REAL_STOP_GRADIENT_PREFIX = "ortcore.stop_gradient::"
_DETACH_OPERATOR = ("detach_copy", "default")  # a copy: ORT must own the output, not alias its input
_registered_edges = False
_executor_seen = False


@hookimpl
def ortcore_lower_stop_gradients(config: Config, lowering: StopGradientLowering) -> None:
    if lowering.plan is None:  # a plugin registered later decided its own way
        try:
            lower(lowering)
        except UnsupportedModelError as e:
            lowering.refuse(e)


def _to_identity(node: onnx.NodeProto) -> None:
    node.op_type, node.domain = "Identity", ""


def _drop_unused_domain(model: onnx.ModelProto) -> None:
    if not any(n.domain == STOP_GRADIENT_DOMAIN for n in model.graph.node):
        kept = [o for o in model.opset_import if o.domain != STOP_GRADIENT_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)


def _scope(node: onnx.NodeProto) -> str:
    module = ".".join(node.name.strip("/").split("/")[1:-1])
    return f"module {module}" if module else "the model's own forward"


def plan_stop_gradients(model: onnx.ModelProto, train_names: list[str], build_gradient: bool) -> Any:
    """:func:`lower` on ``model`` alone: the ``StopGradientPlan`` a build of it gets."""
    lowering = StopGradientLowering.of(model, train_names, build_gradient)
    lower(lowering)
    return lowering.plan


def lower(lowering: StopGradientLowering) -> None:
    """Decide, for each detach the exporter marked, how ONNX Runtime runs it, with torch's gradients exactly.

    ORT has no stop-gradient op, but its gradient builder never differentiates an input that is registered as a
    stop-gradient edge of an ATen node. Each detach becomes

    * an ``Identity`` where that is exact, which needs nothing at run time:

      - its input carries no gradient (a constant, a shape, ``torch.tensor(h.size(-1))``, an integer);
      - nothing downstream of it requires grad (a detached output): torch gives those outputs no gradient, so ORT
        is fed zeros for them;
      - every name to train upstream of it gets no gradient from the outputs anyway (a frozen teacher's
        ``teacher(x).detach()``): ORT computes a gradient for them that torch would not, and ortcore hands torch
        None for a name that no output depends on (``value_dependencies`` stops at the detach);

    * otherwise (``y * y.detach()``, ``w.detach() * a + w * b``) a real stop-gradient: an
      ``org.pytorch.aten::ATen`` node running ``aten::detach_copy``, whose input is registered with ORT
      (``register_custom_stop_gradient_edges``) as one no gradient crosses. It is run by the process's ATen
      executor, which the ``aten_fallback`` plugin installs; without it the model is refused, naming the plugin.

    Names to train whose every path to the outputs goes through a real stop-gradient get no gradient in torch and
    are left out of the names to train.
    """
    train_names = list(lowering.train_names)
    if not lowering.markers:
        lowering.decide(lowering.forward, train_names)
        return
    train = set(train_names) if lowering.build_gradient else set()
    carries = lowering.requires_grad
    model = onnx.ModelProto.FromString(lowering.forward.SerializeToString())
    types = lowering.types  # by value name: the same in the copy
    differentiable = lowering.differentiable
    detaches = [n for n in model.graph.node if lowering.is_marker(n)]
    outputs = [o.name for o in model.graph.output if o.name in carries]
    reach = value_dependencies(model, outputs + [n.input[0] for n in detaches], sources=train)
    trained = set().union(*(reach[o] for o in outputs))  # names that get a gradient from some output
    real = []
    for node in detaches:
        if node.input[0] not in carries or not differentiable(node.output[0]) or not reach[node.input[0]] & trained:
            _to_identity(node)
            continue
        downstream = {node.output[0]}
        for later in model.graph.node:
            if any(i in downstream for i in later.input):
                downstream.update(o for o in later.output if o)
        if downstream & carries:
            real.append(node)
        else:
            _to_identity(node)
    if real:
        _require_aten_executor(sorted({_scope(n) for n in real}))
        # ORT refuses to differentiate a name no output reaches; torch gives it None. Read while the real ones are
        # still markers, which the walk stops at as ORT's builder stops at their ATen form.
        reached = set().union(*value_dependencies(model, [o.name for o in model.graph.output], train).values())
        train_names = [n for n in train_names if n in reached]
        _to_real_stop_gradients(model, real, types)
    _drop_unused_domain(model)
    lowering.decide(model, train_names, len(real))


def resolve_stop_gradients(
    model: onnx.ModelProto, train_names: list[str], build_gradient: bool
) -> tuple[onnx.ModelProto, set[str]]:
    """:func:`plan_stop_gradients` for callers that train every name of ``train_names``: its graph and the outputs
    that do not require grad. Refuses a model whose plan leaves a name to train out (see :func:`lower`)."""
    plan = plan_stop_gradients(model, train_names, build_gradient)
    left_out = [n for n in train_names if n not in plan.train_names] if build_gradient else []
    if left_out:
        raise UnsupportedModelError(
            f"{', '.join(left_out)} reach the outputs only through a detach() whose upstream also has values that "
            "need a gradient; ortcore cannot leave them out of the gradient graph yet"
        )
    return plan.model, plan.no_grad_outputs


def _to_real_stop_gradients(model: onnx.ModelProto, nodes: list[onnx.NodeProto], types: dict[str, int]) -> None:
    """Make each marker an ATen ``detach_copy`` whose input no gradient crosses."""
    global _registered_edges
    if not _registered_edges:
        from onnxruntime.capi import _pybind_state as C

        # Process-wide and first-registration-wins in ORT; the key is one no other ATen node uses.
        C.register_custom_stop_gradient_edges(f"{ATEN_DOMAIN}::ATen::{'::'.join(_DETACH_OPERATOR)}", {0})
        _registered_edges = True
    graph = model.graph
    graph_inputs = {i.name for i in graph.input}
    copies = []
    for node in nodes:
        name, source, output = f"{REAL_STOP_GRADIENT_PREFIX}{node.name}", node.input[0], node.output[0]
        if source in graph_inputs:
            # ORT's builder counts every consumer of a trained input as a gradient contribution, stop edge or not:
            # read a copy instead, whose Identity no gradient reaches.
            copied = f"{name}::input"
            copies.append(onnx.helper.make_node("Identity", [source], [copied], name=copied))
            node.input[0] = copied
        node.op_type, node.domain, node.name = "ATen", ATEN_DOMAIN, name
        del node.attribute[:]
        node.attribute.extend(
            [
                onnx.helper.make_attribute("operator", _DETACH_OPERATOR[0]),
                onnx.helper.make_attribute("overload_name", _DETACH_OPERATOR[1]),
            ]
        )
        if output not in types and source in types:  # ORT cannot infer an ATen node's output type
            graph.value_info.append(onnx.helper.make_tensor_value_info(output, types[source], None))
    if copies:  # they read graph inputs only: first in topological order
        nodes_in_order = copies + [onnx.NodeProto.FromString(n.SerializeToString()) for n in graph.node]
        del graph.node[:]
        graph.node.extend(nodes_in_order)
    if not any(o.domain == ATEN_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(ATEN_DOMAIN, 1))


def _require_aten_executor(scopes: list[str]) -> None:
    """Refuse the model, naming the plugin, if no ATen executor is registered with ORT in this process.

    ORT cannot be asked; running one ``detach_copy`` node tells (about 10 ms, once: an executor stays registered).
    """
    global _executor_seen
    if _executor_seen:
        return
    import numpy as np

    helper = onnx.helper
    node = helper.make_node("ATen", ["x"], ["y"], domain=ATEN_DOMAIN, operator=_DETACH_OPERATOR[0],
                            overload_name=_DETACH_OPERATOR[1])  # fmt: skip
    probe = helper.make_model(
        helper.make_graph(
            [node],
            "ortcore_aten_executor_probe",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        ),
        ir_version=8,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ATEN_DOMAIN, 1)],
    )
    try:  # the failure below is the answer, not an error to log
        session = probe_session(probe, "gradient_fixes: is an ATen executor registered", quiet=True)
        _executor_seen = session.run(None, {"x": np.ones(1, np.float32)})[0].tolist() == [1.0]
    except Exception:  # ORT: "ATenOperatorExecutor is not initialized"
        _executor_seen = False
    if not _executor_seen:
        raise UnsupportedModelError(
            f"a detach() in {', '.join(scopes)} stops a gradient that also flows on (as in y * y.detach()); "
            "ONNX Runtime runs that stop-gradient as an ATen node, and no ATen executor is registered in this "
            "process: enable the aten_fallback plugin, which registers PyTorch's (op_routing and efficient_attention "
            "do too)"
        )
