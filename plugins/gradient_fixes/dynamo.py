"""The dynamo route's part of gradient_fixes: program passes over ``torch.export``'s program (broadcasts the exported
shapes hide; ``detach`` and ``no_grad`` regions as stop-gradient markers) and the marker's onnxscript translation."""

from __future__ import annotations

import functools
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from ortcore.api import PassContext

logger = logging.getLogger("ortcore.gradient_fixes")

# -- the dynamo route: broadcasts the exported shapes hide ------------------------------------------------------------


def hidden_broadcasts(program: Any) -> list[str]:
    """Dimensions of user inputs that ``torch.export`` took to be equal although they differ in this call.

    The dynamo route captures as ``torch.onnx`` does, size-obliviously: a dimension of size 1 is a symbol like any
    other, and broadcasting it against another input's dimension is taken to mean the two are equal. The exported
    graph then gives both the same symbolic size, so the broadcast is invisible to :func:`fix_broadcast_gradients`
    (and to ORT's gradient builders, whose gradient keeps the larger shape). Found by comparing the program's symbolic
    sizes with the example inputs it was captured from; one sentence per symbol.
    """
    examples = getattr(program, "example_inputs", None)
    if not examples or not examples[0]:
        return []
    user = set(program.graph_signature.user_inputs)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user]
    uses: dict[str, list[tuple[int, int, int]]] = {}  # symbol -> (input position, dimension, size in this call)
    for position, (node, example) in enumerate(zip(placeholders, examples[0])):
        value = node.meta.get("val")
        if value is None or not hasattr(example, "shape") or not hasattr(value, "shape"):
            continue
        for dim, (size, actual) in enumerate(zip(value.shape, example.shape)):
            if not isinstance(size, int):
                uses.setdefault(str(size), []).append((position, dim, int(actual)))
    found = []
    for symbol, where in uses.items():
        if len({size for _, _, size in where}) < 2:
            continue
        described = ", ".join(f"input {position} dimension {dim} (size {size})" for position, dim, size in where)
        found.append(f"{described} were all exported as {symbol}")
    return found


def _warn_hidden_broadcasts(program: Any, context: PassContext) -> None:
    found = hidden_broadcasts(program)
    if found and context.training:
        logger.warning(
            "gradient_fixes: on the dynamo route %s: torch.export assumed these user inputs do not broadcast "
            "against each other, so no graph pass can see the broadcast, and ORT's gradient for an input among "
            "them that requires grad keeps the larger shape (ortcore's gradient-shape check then refuses the step). "
            "Pass inputs of equal shapes, or use exporter='torchscript'",
            "; ".join(found),
        )


# -- detach and no_grad regions on the dynamo route ------------------------------------------------------------------

STOP_NAMESPACE = "ortcore_gradient_fixes"
STOP_PASS_NAME = "gradient_fixes.stop_gradients"
_stop_library: torch.library.Library | None = None
_stop_lock = threading.Lock()


def stop_gradient_op() -> Any:
    """``ortcore_gradient_fixes::stop_gradient(x)``: ``x``'s values, translated to the exporter's stop-gradient marker
    (the node the TorchScript route's ``detach`` symbolic writes, which the core turns into a cut of the gradient)."""
    global _stop_library
    with _stop_lock:
        if _stop_library is None:
            _stop_library = torch.library.Library(STOP_NAMESPACE, "FRAGMENT")
            _stop_library.define("stop_gradient(Tensor x) -> Tensor")
            _stop_library.impl("stop_gradient", lambda x: x.clone(), "CompositeExplicitAutograd")
    return torch.ops.ortcore_gradient_fixes.stop_gradient.default


@functools.cache
def _stop_gradient_translation() -> Callable[..., Any]:
    import onnxscript
    from onnx.defs import OpSchema

    from ortcore.api import STOP_GRADIENT, STOP_GRADIENT_DOMAIN

    types = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]
    types += ["tensor(int64)", "tensor(int32)", "tensor(bool)"]
    op = onnxscript.values.Op(
        onnxscript.values.Opset(STOP_GRADIENT_DOMAIN, 1),
        STOP_GRADIENT,
        OpSchema(
            STOP_GRADIENT,
            STOP_GRADIENT_DOMAIN,
            1,
            inputs=[OpSchema.FormalParameter("input", "T")],
            outputs=[OpSchema.FormalParameter("output", "T")],
            type_constraints=[("T", types, "")],
        ),
    )

    def stop_gradient(x: Any) -> Any:
        return op(x)

    return stop_gradient


def mark_stop_gradients(program: Any, context: PassContext | None = None) -> int:
    """Make the exported program's ``detach`` calls, and every value leaving a ``torch.no_grad()`` block, calls of
    :func:`stop_gradient_op`. ``torch.onnx`` translates ``aten.detach`` to ``Identity`` and inlines no_grad blocks
    (``wrap_with_set_grad_enabled(False, ...)``), so without this ORT differentiates through both: ``w.detach() *
    w.detach()`` in a loss gets the gradient of ``w * w``. Returns how many values were marked."""
    graph = program.graph_module.graph
    stop = None
    marked = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.detach.default:
            if any(_writes(user, node) for user in node.users):
                continue  # an alias written in place (F.embedding's max_norm renormalises the weight through one)
            stop = stop or stop_gradient_op()
            node.target = stop
            marked += 1
        elif node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and node.args and node.args[0] is False:
            stop = stop or stop_gradient_op()
            for user in list(node.users):
                if user.op != "call_function" or user.target is not operator.getitem:
                    continue
                value = user.meta.get("val")
                if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                    continue
                with graph.inserting_after(user):
                    stopped = graph.call_function(stop, (user,))
                stopped.meta.update(user.meta)
                user.replace_all_uses_with(stopped, delete_user_cb=lambda u, stopped=stopped: u is not stopped)
                marked += 1
    if marked:
        program.graph_module.recompile()
    return marked


def _writes(user: Any, value: Any) -> bool:
    """Whether the call ``user`` writes in place into its argument ``value`` (the schema marks it ``Tensor(a!)``)."""
    schema = getattr(user.target, "_schema", None)
    if user.op != "call_function" or schema is None:
        return False
    for argument, given in zip(schema.arguments, user.args):
        if given is value and argument.alias_info is not None and argument.alias_info.is_write:
            return True
    return False


def _run_stop_gradients(program: Any, context: PassContext) -> None:
    mark_stop_gradients(program, context)


