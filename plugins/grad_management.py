"""Memory-efficient gradient management: each parameter's gradient goes to PyTorch as soon as ORT computes it.

Without this plugin ORT's backward run returns every gradient at its end, and torch accumulates them into
``param.grad`` after it (so every gradient is alive at once, and gradient hooks fire only after ORT's backward).
With it (``ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT=1``, or ``[plugins.grad_management] enabled = true``), the
training graph gets, after the node that computes each parameter's gradient ``<param>_grad``, a
``com.microsoft::PythonOp`` (run by the PythonOp service, :mod:`ortcore_plugins.services.python_op`) that copies the
gradient out of ORT's buffer and calls ``torch.autograd.backward(param, grad)``: a backward rooted at the leaf, which
fires the parameter's tensor hooks, accumulates into ``param.grad`` through its ``AccumulateGrad`` node and fires that
node's hooks (``register_post_accumulate_grad_hook``, DistributedDataParallel's reducer), while ORT's backward is still
running.
The graph output ``<param>_grad`` becomes the PythonOp's scalar output, and the session's
``grads_handed_over`` makes the core's backward return None for that parameter, so it is accumulated once.

A parameter is handed over only if every differentiable model output depends on it: torch gives a parameter no
gradient at all when no output it reaches received one, which only the core (seeing the output gradients) decides.
The other parameters' gradients come back the usual way, after ORT's backward, and so does the one whose gradient
ORT computes last when nothing else the core's autograd Function receives requires grad (its outputs must).

The core's autograd Function must have no autograd edge to a handed-over parameter (torch would call its hooks, and
DDP's, again with None): the plugin's inspector makes those parameters look frozen from ``pre_forward`` until the
Function has captured its edges (the start of ORT's forward run), then restores them.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import attrs
import onnx
import torch

from ortcore.api import Config, GraphPass, RuntimeInspector, UnsupportedModelError, hookimpl, option, parse_bool
from ortcore_plugins.services import python_op

logger = logging.getLogger("ortcore.grad_management")

NAME = "grad_management"
PASS_NAME = "grad_management.hand_over"
HANDOVER_SUFFIX = "/grad_management.in"  # the gradient's value, renamed: the PythonOp now produces "<param>_grad"
EXTRA_OUTPUT_PREFIX = "ortcore."  # outputs the core adds (batch-norm inputs, activation taps): never differentiated


@attrs.frozen
class GradManagementOptions:
    """Options of the ``grad_management`` plugin."""

    enabled: bool = option(
        False,
        parse_bool,
        "hand each parameter's gradient to torch as soon as ORT computes it (hooks fire during ORT's backward)",
        "ORTMODULE_ENABLE_MEM_EFFICIENT_GRAD_MGMT",
    )


def _enabled(config: Config) -> bool:
    options = config.plugin_options(NAME)
    return bool(options is not None and options.enabled)


# -- the hand-over --------------------------------------------------------------------------------------------------
class _Parameters:
    """One training session's handed-over parameters: the objects by name, set before each forward by the model's
    inspector (held weakly: the PythonOp nodes refer to this object for as long as the process lives)."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.by_name: weakref.WeakValueDictionary[str, torch.nn.Parameter] = weakref.WeakValueDictionary()

    def bind(self, module: torch.nn.Module) -> None:
        params = dict(module.named_parameters())
        for name in self.names:
            param = params.get(name)
            if param is not None and self.by_name.get(name) is not param:
                self.by_name[name] = param


class _Target:
    """What one PythonOp node hands its gradient to: a parameter, by name, of one session's model."""

    __slots__ = ("name", "parameters", "__weakref__")

    def __init__(self, name: str, parameters: _Parameters):
        self.name, self.parameters = name, parameters

    def hand_over(self, grad: torch.Tensor) -> None:
        param = self.parameters.by_name.get(self.name)
        if param is None:
            raise RuntimeError(f"grad_management: parameter {self.name!r} of this session's model is gone")
        # A backward rooted at the leaf: tensor hooks, AccumulateGrad (into param.grad), its post hooks.
        torch.autograd.backward(param, grad.to(param.dtype))


class HandOverGradient(torch.autograd.Function):
    """Run by the PythonOp after ``<param>_grad``: ``grad`` is already a copy of ORT's buffer (the runner clones
    every tensor input), so torch may keep it as ``param.grad``."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, target: _Target) -> torch.Tensor:
        target.hand_over(grad)
        return torch.zeros((), dtype=grad.dtype, device=grad.device)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # never differentiated: the node is added after the gradient build
        raise RuntimeError("grad_management's hand-over is not differentiable")


def _eligible_feeds(graph: Any) -> list[int]:
    """Feed indices of parameters whose gradient can be handed over: ORT computes one, and every differentiable
    model output depends on the parameter (so torch gives it a gradient whenever the backward runs)."""
    outputs = [o.name for o in graph.request.model.graph.output]
    differentiable = [
        i
        for i, name in enumerate(outputs)
        if not name.startswith(EXTRA_OUTPUT_PREFIX) and i not in graph.torch_non_differentiable
    ]
    if not differentiable:
        return []
    user_inputs = set(graph.request.user_input_names)
    trained = set(graph.request.train_names)
    fetched = {o.name for o in graph.model.graph.output}
    eligible = []
    for k, name in enumerate(graph.feed_names):
        if name in user_inputs or name not in trained or f"{name}_grad" not in fetched:
            continue
        if all(k in graph.output_feeds[i] for i in differentiable):
            eligible.append(k)
    return eligible


def insert_hand_overs(model: onnx.ModelProto, session: Any) -> int:
    """A gradient-graph pass: edit the training graph so that each eligible parameter's gradient is handed to torch by a
    PythonOp as soon as it is computed; returns how many parameters are handed over."""
    graph = model.graph
    producer = {o: (n, node) for n, node in enumerate(graph.node) for o in node.output if o}
    # A gradient nothing computes in ORT (a graph input passed through) stays with the core.
    feeds = [k for k in _eligible_feeds(session) if f"{session.feed_names[k]}_grad" in producer]
    if not feeds:
        return 0
    python_op.install_runners()
    key = python_op.registry.key(HandOverGradient)
    parameters = _Parameters([session.feed_names[k] for k in feeds])
    after: dict[int, list[onnx.NodeProto]] = {}
    for k in feeds:
        name = session.feed_names[k]
        grad = f"{name}_grad"
        value = grad + HANDOVER_SUFFIX
        for node in graph.node:  # the producer and any reader now use the renamed value
            for values in (node.output, node.input):
                for j, v in enumerate(values):
                    if v == grad:
                        values[j] = value
        typed = False
        for info in graph.value_info:
            if info.name == grad:
                info.name = value
                typed = True
        if not typed:
            # The gradient was typed only as a graph output: keep its type on the renamed value, for producers whose
            # output type ORT cannot infer (an ATen node of a routed op).
            for output in graph.output:
                if output.name == grad and output.type.HasField("tensor_type"):
                    info = graph.value_info.add()
                    info.CopyFrom(output)
                    info.name = value
        elem_type, rank = _input_type(model, name)
        hand_over = onnx.helper.make_node(
            python_op.PYTHON_OP,
            [value],
            [f"{grad}/grad_management.ctx", grad],
            name=f"grad_management/{name}",
            domain=python_op.PYTHON_OP_DOMAIN,
            func_name=key,
            input_convention="dc",
            input_tensor_types=[elem_type],
            input_tensor_ranks=[rank],
            input_requires_grads=[0, 0],  # one per argument
            input_pointer_scalars=[python_op.registry.keep(_Target(name, parameters))],
            input_pointer_scalar_positions=[1],
            output_tensor_types=[elem_type],
            output_tensor_ranks=[0],
            training_mode=0,  # no context: there is no PythonOpGrad for ORT to keep one for
            safe_run_mode=1,
        )
        after.setdefault(producer[grad][0], []).append(hand_over)
        for output in graph.output:  # the fetched "<param>_grad" is now the PythonOp's scalar
            if output.name == grad:
                output.CopyFrom(onnx.helper.make_tensor_value_info(grad, elem_type, []))
    nodes = []
    for position, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(after.get(position, []))
    del graph.node[:]
    graph.node.extend(nodes)
    for k in feeds:
        session.hand_over_gradient(k)  # the core feeds them detached and returns no gradient for them
    session.notes[NAME] = parameters
    return len(feeds)


def _input_type(model: onnx.ModelProto, name: str) -> tuple[int, int]:
    for value in model.graph.input:
        if value.name == name:
            return value.type.tensor_type.elem_type, len(value.type.tensor_type.shape.dim)
    raise UnsupportedModelError(f"grad_management: no graph input {name!r}")


class GradManagementInspector(RuntimeInspector):
    """Before each forward, tells the session's hand-over nodes which parameter objects are the model's now."""

    def __init__(self, module: torch.nn.Module):
        self.module = weakref.ref(module)

    def pre_forward(self, step: int, inputs: Any) -> None:
        parameters = inputs.session.notes.get(NAME) if inputs.session is not None else None
        module = self.module()
        if parameters is not None and module is not None:
            parameters.bind(module)


# -- hooks ----------------------------------------------------------------------------------------------------------
@hookimpl
def ortcore_options_class() -> type:
    return GradManagementOptions


@hookimpl
def ortcore_runtime_inspectors(config: Config, module: torch.nn.Module) -> list[RuntimeInspector]:
    return [GradManagementInspector(module)] if _enabled(config) else []


@hookimpl
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(PASS_NAME, run=_hand_over_pass)] if _enabled(config) else []


def _hand_over_pass(model: onnx.ModelProto, graph: Any) -> None:
    # The gradient audit compares gradients as ORT computes them: it keeps them in ORT's outputs.
    if graph.kind != "training" or graph.purpose != "train":
        return
    handed = insert_hand_overs(model, graph)
    logger.info("grad_management: %d parameter gradients are handed to torch during ORT's backward", handed)
