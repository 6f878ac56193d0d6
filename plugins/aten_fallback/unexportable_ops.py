"""The unexportable-op fallback: ops the exporter cannot express become ATen nodes run by PyTorch, with a gradient.

An op without an ONNX symbolic (``torch.cummax``, ``torch.logcumsumexp``, ``torch.special.*``, ...) is exported as
one ATen node running the op itself (:func:`fallback_symbolic`), when option ``fallback_ops`` names it
(:func:`fallback_symbolics`) or names ``auto`` (:func:`symbolics_for_failure`, through ``ortcore_export_failed``, finds such ops from the exporter's error).
Its gradient re-runs the op under ``torch.autograd`` (:func:`ortcore_plugins.services.aten_nodes.register_vjp_gradient`)
with respect to the floating-point inputs PyTorch differentiates (:mod:`ortcore_plugins.services.differentiability`);
the others become stop-gradient edges.

On the dynamo route, :func:`program_pass` does the same in ``torch.export``'s program: calls of the listed ops, and
with ``auto`` every op the exporter has no onnxscript translation (nor decomposition) for, become wrapper ops written
as ATen nodes (:mod:`ortcore_plugins.services.aten_program`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ortcore.api import UnsupportedModelError
from ortcore_plugins.services import aten_program, routed_calls
from ortcore_plugins.services.aten_nodes import (
    FLOAT_TYPES,
    aten_node,
    constant_argument,
    is_none,
    is_string_constant,
    register_vjp_gradient,
    requires_grad,
    schema_type,
)
from ortcore_plugins.services.differentiability import differentiates
from ortcore_plugins.services.torch_kernels import prepare_runtime

from .options import AUTO

logger = logging.getLogger("ortcore.aten_fallback")

FALLBACK_REASON = "listed in fallback_ops (or found by auto): the exporter cannot express it"


def fallback_symbolic(op: str) -> Callable[..., Any]:
    """The TorchScript symbolic exporting ``aten::<op>`` as an ATen node run by PyTorch, with a gradient."""

    def symbolic(g: Any, *args: Any, **_kwargs: Any) -> Any:
        node = g.original_node
        parsed = _match_overload(op, args)
        if parsed is None:
            raise UnsupportedModelError(
                f"the aten_fallback plugin cannot run aten::{op}: no overload of it takes the {len(args)} arguments "
                "the exporter passed"
            )
        schema = str(parsed)
        operator, overload = op, parsed.overload_name
        if routed_calls.returns_tensor_list(parsed):  # split, unbind, meshgrid: op routing's wrapper, one output each
            return routed_calls.emit_call(g, operator, parsed, args, prepare_runtime)
        try:
            kinds = [schema_type(a.type, operator, a.name) for a in parsed.arguments]
        except TypeError as e:
            raise UnsupportedModelError(f"the aten_fallback plugin cannot run aten::{operator}: {e}") from e
        if len(args) != len(kinds):
            raise UnsupportedModelError(
                f"the aten_fallback plugin cannot run aten::{operator}: the exporter passed {len(args)} arguments "
                f"for the schema {schema}"
            )
        outputs_traced = list(node.outputs())
        if any(r.type.kind() != "TensorType" for r in parsed.returns):
            raise UnsupportedModelError(f"the aten_fallback plugin cannot run aten::{operator}: it returns non-tensors")
        tensor_args = [k for k, kind in enumerate(kinds) if kind in ("Tensor", "Tensor?")]
        # Float tensors PyTorch differentiates (fractional_max_pool2d's random_samples is a float it refuses to).
        float_inputs = tuple(
            k
            for k in tensor_args
            if not is_none(args[k]) and args[k].type().scalarType() in FLOAT_TYPES and differentiates(parsed, k)
        )
        differentiable = tuple(j for j, v in enumerate(outputs_traced) if v.type().scalarType() in FLOAT_TYPES)
        needs = [k for k in float_inputs if requires_grad(args[k]) is not False]
        if needs and (not tensor_args or tensor_args[0] not in needs):
            # ORT builds an ATen node's gradient only when its first input needs one: the call becomes op routing's
            # wrapper op, which takes such an input first (scatter_reduce's src, logaddexp(x, fc(x))).
            return routed_calls.emit_call(g, operator, parsed, args, prepare_runtime)
        for kind, value in zip(kinds, args, strict=True):
            if kind == "Tensor" and is_none(value):
                raise UnsupportedModelError(f"the aten_fallback plugin cannot run aten::{operator}: a tensor is None")
        inputs = [
            value if kind in ("Tensor", "Tensor?") else constant_argument(g, value, kind, operator, a.name)
            for kind, value, a in zip(kinds, args, parsed.arguments, strict=True)
        ]
        register_vjp_gradient(operator, overload, parsed, differentiable, float_inputs, prepare_runtime)
        return aten_node(g, operator, overload, inputs, outputs_traced)

    symbolic.__name__ = f"aten_fallback_{op}"
    return symbolic


def _match_overload(op: str, args: tuple[Any, ...]) -> Any:
    """The schema of the ``aten::<op>`` overload the traced call used (the exporter does not say which): the first,
    ``default`` first, that takes as many arguments, with a string exactly where the call passed one."""
    packet = getattr(torch.ops.aten, op)
    names = sorted(packet.overloads(), key=lambda n: n != "default")
    for name in names:
        schema = getattr(packet, name)._schema
        if len(schema.arguments) != len(args):
            continue
        fits = True
        for a, value in zip(schema.arguments, args, strict=True):
            kind = a.type.getElementType().kind() if a.type.kind() == "OptionalType" else a.type.kind()
            if is_none(value):
                fits = a.type.kind() == "OptionalType" or a.has_default_value()
            elif kind == "StringType":
                fits = is_string_constant(value)
            else:  # a traced number is a (constant) tensor too: only strings tell overloads apart here
                fits = not is_string_constant(value)
            if not fits:
                break
        if fits:
            return schema
    return None


def fallback_symbolics(ops: Iterable[str]) -> dict[str, Callable[..., Any]]:
    """``{"::<name>": symbolic}`` for each ``aten::<name>`` listed (``auto`` is not an op)."""
    return {f"::{op.split('::')[-1]}": fallback_symbolic(op.split("::")[-1]) for op in ops if op != AUTO}


_UNSUPPORTED_ATEN = re.compile(r"operator '?aten::(\w+)'?")


def symbolics_for_failure(error: UnsupportedModelError, symbolics: dict[str, Any]) -> dict[str, Any] | None:
    """``fallback_ops = ["auto"]`` on the TorchScript route (``ortcore_export_failed``): when the export stopped at
    an ``aten::`` op that has no ONNX symbolic, that op as an ATen node run by PyTorch (:func:`fallback_symbolic`);
    None for any other failure, or an op that has a symbolic already (the core then raises)."""
    cause = error.__cause__
    match = (
        _UNSUPPORTED_ATEN.search(str(cause)) if isinstance(cause, torch.onnx.errors.UnsupportedOperatorError) else None
    )
    name = f"::{match.group(1)}" if match else None
    if name is None or name in symbolics:
        return None
    logger.info("aten::%s has no ONNX symbolic: exporting it as an ATen node run by PyTorch", match.group(1))
    return {name: fallback_symbolic(match.group(1))}


def program_pass(listed: Iterable[str]) -> Callable[[Any, Any], int]:
    """The dynamo route's fallback (an ``ortcore_program_passes`` pass): calls of the ``aten::<name>`` ops listed
    become ATen nodes run by PyTorch, and with ``auto`` in ``listed`` every op the exporter cannot translate."""
    names = frozenset(op for op in listed if op != AUTO)
    auto = AUTO in listed

    def run(program: torch.export.ExportedProgram, context: Any) -> int:
        def decide(node: torch.fx.Node, reach: aten_program.GradientReach) -> str | None:
            name = node.target._schema.name
            if name in names:
                return "listed in fallback_ops"
            if auto and not aten_program.has_translation(node.target, context.translated, node):
                return "it has no onnxscript translation"
            return None

        routed = aten_program.route_calls(program, context.module, decide, prepare_runtime)
        for name, why in routed:
            if (name, why) not in _logged:
                _logged.add((name, why))
                logger.info("%s: %s, exporting it as an ATen node run by PyTorch", name, why)
        return len(routed)

    return run


_logged: set[tuple[str, str]] = set()
