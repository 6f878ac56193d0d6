"""efficient_attention: run attention with PyTorch's fused CPU kernel inside ONNX Runtime's training graph.

The TorchScript export of a transformer's attention is a chain of ONNX nodes,
``MatMul(q, kᵀ) → scale → Add(mask) → Softmax → Dropout → MatMul(·, v)``, which ORT runs unfused: it keeps the
``batch × heads × seq × seq`` probabilities from forward to backward and its backward is several kernels. The graph
pass of this plugin finds that chain (Hugging Face's ``eager`` attention; the ``sdpa`` attention, which the exporter
writes out with ``√scale`` on each side and a NaN guard after the softmax; with or without a mask) and replaces it
with one ``org.pytorch.aten::ATen`` node running PyTorch's fused CPU kernel
``aten::_scaled_dot_product_flash_attention_for_cpu``, whose gradient definition runs
``aten::_scaled_dot_product_flash_attention_for_cpu_backward``. The ATen executor shared with ``aten_fallback``
(:mod:`ortcore_plugins.services.aten_executor`) runs them; this plugin installs it itself.

ORT 1.19.2 keeps only the first output of each node of a gradient definition, while the backward kernel computes the
gradients of q, k and v together. So q, k and v are flattened and packed into one tensor (a ``Concat``, whose gradient
ORT splits again), the forward node (``ortcore_attention::sdpa_packed``) reads the packed tensor, and its gradient is
one node (``ortcore_attention::sdpa_packed_backward``) returning the packed gradient. Graphs exported in eval mode get
the same nodes: ortcore builds a gradient graph from them too when grad is enabled.

Off by default, as upstream::

    [plugins.efficient_attention]
    enable = true        # env ORTMODULE_USE_EFFICIENT_ATTENTION=1

Run ``python benchmarks/efficient_attention_bench.py`` for step time and peak memory with and without it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ortcore.api import ATEN_DOMAIN, Config, GraphPass, OptionError, PassContext, hookimpl, option
from ortcore_plugins.services import aten_executor as executor

logger = logging.getLogger("ortcore.efficient_attention")

NAME = "efficient_attention"
ENV = "ORTMODULE_USE_EFFICIENT_ATTENTION"
PASS_NAME = "efficient_attention.fuse"
# The torch.library namespace of the packed forward and backward ops.
NAMESPACE = "ortcore_attention"
FORWARD_OP = f"{NAMESPACE}::sdpa_packed"
BACKWARD_OP = f"{NAMESPACE}::sdpa_packed_backward"
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def parse_switch(value: object, source: str) -> bool:
    """``0``/``1`` (a TOML boolean too). Only these: ``import onnxruntime`` reads the variable with ``int()``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return value.strip() == "1"
    raise OptionError(
        f"{source}={value!r} is not a switch; allowed: 0 or 1 (true/false in ortcore.toml). onnxruntime reads "
        f"{ENV} with int() when it is imported, so no other spelling works in the environment"
    )


@attrs.frozen
class EfficientAttentionOptions:
    """Options of the ``efficient_attention`` plugin (``[plugins.efficient_attention]`` in ortcore.toml)."""

    enable: bool = option(
        False,
        parse_switch,
        "replace the attention pattern with PyTorch's fused CPU attention kernel (forward and backward)",
        env=ENV,
    )


def enabled(config: Config) -> bool:
    options = config.plugin_options(NAME)
    return bool(options is not None and options.enable)


# -- the kernels ------------------------------------------------------------------------------------------------------


def _unpack(
    qkv: torch.Tensor, q_shape: list[int], k_shape: list[int], v_shape: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sizes = [math.prod(q_shape), math.prod(k_shape), math.prod(v_shape)]
    if sum(sizes) != qkv.numel():
        raise ValueError(
            f"packed q/k/v has {qkv.numel()} elements, shapes {q_shape}, {k_shape}, {v_shape} need {sum(sizes)}"
        )
    q, k, v = qkv.split(sizes)
    return q.view(q_shape), k.view(k_shape), v.view(v_shape)


def _broadcast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v with one batch and head size: a size 1 that ``MatMul`` broadcasts (one shared key/value head, say)
    is expanded, as a copy. The kernel assumes equal sizes and reads out of bounds otherwise."""
    lead = torch.broadcast_shapes(q.shape[:2], k.shape[:2], v.shape[:2])
    return tuple(t if t.shape[:2] == lead else t.expand(*lead, *t.shape[2:]).contiguous() for t in (q, k, v))


def _as_4d(mask: torch.Tensor | None) -> torch.Tensor | None:
    # The kernel takes a mask broadcastable to (batch, heads, q_len, k_len) with all four dimensions.
    while mask is not None and mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def _sdpa_packed(
    qkv: torch.Tensor,
    q_shape: list[int],
    k_shape: list[int],
    v_shape: list[int],
    attn_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the packed, flattened q, k, v: ``(output, logsumexp)``, as the fused CPU kernel computes them."""
    q, k, v = _broadcast(*_unpack(qkv, q_shape, k_shape, v_shape))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=_as_4d(attn_mask), scale=scale
    )


def _sdpa_packed_backward(
    grad: torch.Tensor,
    qkv: torch.Tensor,
    q_shape: list[int],
    k_shape: list[int],
    v_shape: list[int],
    attn_mask: torch.Tensor | None,
    scale: float,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
) -> torch.Tensor:
    """The gradient of :func:`_sdpa_packed` with respect to the packed q, k, v (packed the same way)."""
    q, k, v = _broadcast(*_unpack(qkv, q_shape, k_shape, v_shape))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.contiguous(), q, k, v, out, logsumexp, 0.0, False, attn_mask=_as_4d(attn_mask), scale=scale
    )
    # An input broadcast over batch or heads gets the sum of the gradients of its copies.
    return torch.cat([g.sum_to_size(shape).reshape(-1) for g, shape in zip(grads, (q_shape, k_shape, v_shape))])


_SHAPES = "SymInt[] q_shape, SymInt[] k_shape, SymInt[] v_shape, Tensor? attn_mask, float scale"
HELPER_OPS: dict[str, tuple[str, Callable[..., Any]]] = {
    "sdpa_packed": (f"(Tensor qkv, {_SHAPES}) -> (Tensor output, Tensor logsumexp)", _sdpa_packed),
    "sdpa_packed_backward": (
        f"(Tensor grad, Tensor qkv, {_SHAPES}, Tensor out, Tensor logsumexp) -> Tensor",
        _sdpa_packed_backward,
    ),
}

# Forward inputs: qkv, q_shape, k_shape, v_shape, attn_mask, scale; outputs: output, logsumexp.
GRADIENT = [
    (
        ("ATen", ATEN_DOMAIN),
        ["GO(0)", "I(0)", "I(1)", "I(2)", "I(3)", "I(4)", "I(5)", "O(0)", "O(1)"],
        ["GI(0)"],
        {"operator": {"value": BACKWARD_OP, "dtype": "string"}},
    )
]
# Only the packed q/k/v gets a gradient: shapes and the scale are constants, and the pass replaces no attention whose
# mask is on a gradient path.
STOP_GRADIENT_EDGES = {1, 2, 3, 4, 5}

_library: torch.library.Library | None = None
_registered = False
_prepare_lock = threading.Lock()


def _gradient_key(operator: str) -> str:
    return f"{ATEN_DOMAIN}::ATen::{operator}::"


def _register_gradient() -> None:
    from onnxruntime.capi import _pybind_state as C

    definition = []
    for (op_type, domain), inputs, outputs, attributes in GRADIENT:
        node = C.GradientNodeDefinition()
        node.op_type, node.domain, node.inputs, node.outputs = op_type, domain, inputs, outputs
        node_attributes = []
        for name, spec in attributes.items():
            attribute = C.GradientNodeAttributeDefinition()
            attribute.name, attribute.value_json = name, json.dumps(spec["value"])
            attribute.dtype, attribute.is_tensor = spec["dtype"], False
            node_attributes.append(attribute)
        node.attributes = node_attributes
        definition.append(node)
    C.register_gradient_definition(_gradient_key(FORWARD_OP), definition)
    C.register_custom_stop_gradient_edges(_gradient_key(FORWARD_OP), STOP_GRADIENT_EDGES)


def prepare_runtime() -> None:
    """Define the packed ops, register their gradient and install the ATen executor (once per process)."""
    global _library, _registered
    with _prepare_lock:
        if _library is None:
            lib = torch.library.Library(NAMESPACE, "FRAGMENT")
            for name, (schema, fn) in HELPER_OPS.items():
                lib.define(f"{name}{schema}")
                lib.impl(name, fn, "CompositeExplicitAutograd")
            _library = lib
        if not _registered:
            _register_gradient()
            _registered = True
        executor.install()


# -- matching -----------------------------------------------------------------------------------------------------


class _Index:
    """Producers, consumers, constant values and element types/ranks of a graph."""

    def __init__(self, model: onnx.ModelProto):
        graph = model.graph
        self.nodes: list[onnx.NodeProto] = list(graph.node)
        self.producer = {name: n for n in self.nodes for name in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.initializers = {t.name: t for t in graph.initializer}
        self.graph_inputs = {v.name for v in graph.input}
        self.graph_outputs = {v.name for v in graph.output}
        try:
            inferred = list(onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info)
        except Exception:  # inference is a help: values it cannot type are handled as unknown below
            inferred = []
        self.declared = {v.name for v in (*graph.value_info, *graph.input, *graph.output)}
        self.types: dict[str, onnx.TypeProto] = {}
        for v in (*inferred, *graph.value_info, *graph.input, *graph.output):
            if v.type.tensor_type.elem_type:
                self.types[v.name] = v.type

    def node(self, name: str, *op_types: str) -> onnx.NodeProto | None:
        n = self.producer.get(name)
        return n if n is not None and n.op_type in op_types else None

    def only_user(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.graph_outputs else None

    def elem_type(self, name: str) -> int:
        t = self.types.get(name)
        return t.tensor_type.elem_type if t is not None else 0

    def rank(self, name: str) -> int | None:
        t = self.types.get(name)
        if t is None or not t.tensor_type.HasField("shape"):
            return None
        return len(t.tensor_type.shape.dim)

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a constant: an initializer, a Constant node, or Sqrt/Cast/Reciprocal of one."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        n = self.producer.get(name)
        if n is None:
            return None
        if n.op_type == "Constant":
            value = next((a for a in n.attribute if a.name == "value"), None)
            return numpy_helper.to_array(value.t) if value is not None else None
        if n.op_type in ("Sqrt", "Cast", "Reciprocal", "Identity"):
            x = self.constant(n.input[0])
            if x is None:
                return None
            return {"Sqrt": np.sqrt, "Reciprocal": np.reciprocal}.get(n.op_type, lambda a: a)(x.astype(np.float64))
        return None

    def scalar(self, name: str) -> float | None:
        value = self.constant(name)
        return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


@attrs.define
class AttentionMatch:
    """One attention found in the graph: its q, kᵀ, v and mask values, scale, output, and the nodes it replaces."""

    q: str
    k_t: str
    v: str
    mask: str | None
    scale: float
    output: str
    nodes: list[onnx.NodeProto]


class _NoMatch(Exception):
    """The chain around a Softmax is not an attention this pass can replace (the message says why)."""


def _scaled(index: _Index, name: str, nodes: list[onnx.NodeProto]) -> tuple[str, float]:
    """``name`` as ``x * c`` or ``x / c`` (c constant, the product used only here): ``(x, c)``; else ``(name, 1)``."""
    n = index.node(name, "Mul", "Div")
    if n is None or index.only_user(name) is None:
        return name, 1.0
    for i in (1, 0) if n.op_type == "Mul" else (1,):
        c = index.scalar(n.input[i])
        if c is not None and c != 0.0:
            nodes.append(n)
            return n.input[1 - i], (c if n.op_type == "Mul" else 1.0 / c)
    return name, 1.0


def _single_user(index: _Index, name: str, what: str) -> onnx.NodeProto:
    user = index.only_user(name)
    if user is None:
        raise _NoMatch(f"the {what} is used outside the attention")
    return user


def match_attention(index: _Index, softmax: onnx.NodeProto) -> AttentionMatch:
    """The attention around ``softmax``, or :class:`_NoMatch` saying why it is not one this pass replaces."""
    nodes: list[onnx.NodeProto] = [softmax]
    logits = softmax.input[0]
    if index.only_user(logits) is None:
        raise _NoMatch("the softmax input is used elsewhere")
    # Before the softmax: [Add(scores, mask)] <- [Mul/Div scale] <- MatMul([q * c], [kᵀ * c]).
    mask = None
    add = index.node(logits, "Add")
    if add is not None:
        for i in (0, 1):
            scores = index.node(add.input[i], "MatMul", "Mul", "Div")
            if scores is not None and index.only_user(add.input[i]) is not None:
                logits, mask = add.input[i], add.input[1 - i]
                nodes.append(add)
                break
        else:
            raise _NoMatch("the softmax input is an Add without a MatMul operand")
    scores, scale = _scaled(index, logits, nodes)
    matmul = index.node(scores, "MatMul")
    if matmul is None:
        raise _NoMatch("no MatMul(q, kᵀ) before the softmax")
    nodes.append(matmul)
    q, q_scale = _scaled(index, matmul.input[0], nodes)
    k_t, k_scale = _scaled(index, matmul.input[1], nodes)
    scale *= q_scale * k_scale
    rank = index.rank(softmax.input[0])
    axis = next((helper.get_attribute_value(a) for a in softmax.attribute if a.name == "axis"), -1)
    if rank != 4 or axis not in (-1, 3):
        raise _NoMatch(f"softmax over axis {axis} of a rank-{rank} tensor, not the last axis of 4")
    if any(index.rank(x) != 4 for x in (q, k_t)):
        raise _NoMatch("q or kᵀ is not 4-D")
    # After the softmax: [Cast to the same type], [Where(IsNaN(p), 0, p)], [Dropout that keeps everything], MatMul(p, v).
    probs = softmax.output[0]
    cast = index.only_user(probs)
    if cast is not None and cast.op_type == "Cast":
        to = next(helper.get_attribute_value(a) for a in cast.attribute if a.name == "to")
        if to != index.elem_type(softmax.input[0]):
            raise _NoMatch("the probabilities are cast to another type")
        nodes.append(cast)
        probs = cast.output[0]
    users = index.consumers.get(probs, [])
    is_nan = next((u for u in users if u.op_type == "IsNaN"), None)
    if is_nan is not None:
        where = next((u for u in users if u.op_type == "Where"), None)
        if (
            len(users) != 2
            or where is None
            or list(where.input) != [is_nan.output[0], where.input[1], probs]
            or index.scalar(where.input[1]) != 0.0
            or index.only_user(is_nan.output[0]) is None
        ):
            raise _NoMatch("the softmax output is used outside the attention")
        nodes += [is_nan, where]
        probs = where.output[0]
    user = _single_user(index, probs, "softmax output")
    if user.op_type == "Dropout":
        ratio = index.scalar(user.input[1]) if len(user.input) > 1 and user.input[1] else 0.5
        training = len(user.input) > 2 and user.input[2] and index.scalar(user.input[2])
        if training is None or (training and ratio != 0.0):
            what = "with a ratio that is not a constant" if ratio is None else str(ratio)
            raise _NoMatch(
                f"attention dropout {what} is active: the fused CPU kernel has no dropout (set the attention "
                "dropout to 0, or train in eval mode)"
            )
        if len(user.output) > 1 and user.output[1] and index.consumers.get(user.output[1]):
            raise _NoMatch("the dropout mask is used")
        nodes.append(user)
        probs = user.output[0]
        user = _single_user(index, probs, "dropout output")
    if user.op_type != "MatMul" or user.input[0] != probs:
        raise _NoMatch(f"the probabilities feed {user.op_type}, not MatMul(p, v)")
    nodes.append(user)
    v = user.input[1]
    if index.rank(v) != 4:
        raise _NoMatch("v is not 4-D")
    for name in (q, k_t, v):
        if index.elem_type(name) not in FLOAT_TYPES:
            raise _NoMatch("q, k and v are not float, double, float16 or bfloat16")
    return AttentionMatch(q, k_t, v, mask, scale, user.output[0], nodes)


def _mask_gradient_source(index: _Index, mask: str, parameters: set[str], trainable: set[str]) -> str | None:
    """The graph input through which the mask could need a gradient, or None.

    That is a trainable parameter, or a float user input (whether it requires grad is not known at export). Gradients
    flow only through float values, so the walk follows float values only: the boolean and integer paths Hugging
    Face builds its masks from (comparisons, casts of an integer attention_mask) end it.
    """
    seen: set[str] = set()
    stack = [mask]
    while stack:
        name = stack.pop()
        elem_type = index.elem_type(name)
        if name in seen or (elem_type and elem_type not in FLOAT_TYPES):
            continue
        seen.add(name)
        if name in index.graph_inputs and name not in index.initializers:
            if name in trainable or name not in parameters:
                return name
            continue
        producer = index.producer.get(name)
        if producer is not None:
            stack.extend(i for i in producer.input if i)
    return None


def _perm(node: onnx.NodeProto) -> list[int] | None:
    return next((list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"), None)


# -- rewriting ----------------------------------------------------------------------------------------------------


@attrs.define
class AttentionReport:
    """What the pass did with one graph: how many attentions it replaced, and why others were left alone."""

    replaced: int = 0
    skipped: list[str] = attrs.Factory(list)


_last_report: AttentionReport | None = None


def last_report() -> AttentionReport | None:
    """The report of the last run of the pass in this process (tests and the benchmark read it)."""
    return _last_report


def _untransposed_k(index: _Index, k_t: str, name: str, new_nodes: list[onnx.NodeProto]) -> str:
    """k in (batch, heads, k_len, head_dim) from kᵀ: undo the export's Transpose where there is one."""
    producer = index.node(k_t, "Transpose")
    perm = _perm(producer) if producer is not None else None
    if perm is not None:
        swapped = [*perm[:-2], perm[-1], perm[-2]]
        if swapped == list(range(len(swapped))):
            return producer.input[0]
        source = producer.input[0]
    else:
        swapped, source = [0, 1, 3, 2], k_t
    out = f"{name}/k"
    new_nodes.append(helper.make_node("Transpose", [source], [out], name=out, perm=swapped))
    return out


def _constant(name: str, value: Any, dtype: Any) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], name=name, value=numpy_helper.from_array(np.array(value, dtype=dtype))
    )


def _replacement(index: _Index, m: AttentionMatch, name: str) -> tuple[list[onnx.NodeProto], list[onnx.ValueInfoProto]]:
    """The nodes computing ``m.output`` with the fused kernel, and the value types ORT cannot infer for them."""
    new: list[onnx.NodeProto] = []
    k = _untransposed_k(index, m.k_t, name, new)
    scale = _constant(f"{name}/scale", m.scale, np.float64)
    new.append(scale)
    lse = f"{name}/logsumexp"
    minus_one = _constant(f"{name}/minus_one", [-1], np.int64)
    new.append(minus_one)
    parts, shapes = [], []
    for what, value in (("q", m.q), ("k", k), ("v", m.v)):
        shape, flat = f"{name}/{what}_shape", f"{name}/{what}_flat"
        new.append(helper.make_node("Shape", [value], [shape], name=shape))
        new.append(helper.make_node("Reshape", [value, minus_one.output[0]], [flat], name=flat))
        shapes.append(shape)
        parts.append(flat)
    qkv = f"{name}/qkv"
    new.append(helper.make_node("Concat", parts, [qkv], name=qkv, axis=0))
    inputs = [qkv, *shapes, m.mask or "", scale.output[0]]
    new.append(
        helper.make_node(
            "ATen", inputs, [m.output, lse], name=name, domain=ATEN_DOMAIN, operator=FORWARD_OP, overload_name=""
        )
    )
    elem = index.elem_type(m.q) or TensorProto.FLOAT
    # ORT cannot infer an ATen node's output types: declare them (the output keeps what inference knew of it).
    # logsumexp is float32 for float32, float16 and bfloat16 inputs, float64 for float64 ones.
    infos = [
        helper.make_tensor_value_info(
            lse, TensorProto.DOUBLE if elem == TensorProto.DOUBLE else TensorProto.FLOAT, None
        )
    ]
    if m.output not in index.declared:
        info = helper.make_tensor_value_info(m.output, elem, [None] * 4)
        if m.output in index.types:
            info.type.CopyFrom(index.types[m.output])
        infos.append(info)
    return new, infos


def _remove_dead(graph: onnx.GraphProto, candidates: set[str]) -> None:
    """Drop nodes whose outputs nobody reads any more, starting from the values the replaced nodes read."""
    outputs = {o.name for o in graph.output}
    while candidates:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [
            n
            for n in graph.node
            if n.output and any(o in candidates for o in n.output) and not any(o in read for o in n.output if o)
        ]
        if not dead:
            return
        candidates = {i for n in dead for i in n.input if i}
        for n in dead:
            graph.node.remove(n)


def fuse_attention(model: onnx.ModelProto, context: PassContext | None = None) -> AttentionReport:
    """Replace every attention of ``model`` that the fused kernel can run; returns what was done and skipped."""
    global _last_report
    index = _Index(model)
    module = getattr(context, "module", None)
    parameters: set[str] = set()
    trainable: set[str] = set()
    if module is not None:
        parameters = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    report = AttentionReport()
    device = next((p.device for p in module.parameters()), None) if module is not None else None
    if device is not None and device.type != "cpu":
        report.skipped.append(f"the model is on {device}: the fused kernel is PyTorch's CPU kernel")
        logger.warning("efficient_attention: %s; attention left to ORT's kernels", report.skipped[0])
        _last_report = report
        return report
    replacements: dict[int, list[onnx.NodeProto]] = {}
    removed: set[int] = set()
    infos: list[onnx.ValueInfoProto] = []
    for softmax in index.nodes:
        if softmax.op_type != "Softmax":
            continue
        try:
            m = match_attention(index, softmax)
            if m.mask is not None:
                source = _mask_gradient_source(index, m.mask, parameters, trainable)
                if source is not None:
                    raise _NoMatch(f"the mask depends on {source!r}, which may need a gradient")
        except _NoMatch as e:
            report.skipped.append(f"{softmax.name or softmax.output[0]}: {e}")
            continue
        name = f"{softmax.name or softmax.output[0]}/ortcore_sdpa"
        new, new_infos = _replacement(index, m, name)
        # The fused node goes where the last node of the chain was: everything it reads is computed before.
        replacements[id(m.nodes[-1])] = new
        removed.update(id(n) for n in m.nodes)
        infos += new_infos
        report.replaced += 1
    _last_report = report
    if not report.replaced and not report.skipped:
        # Enabled but nothing to do: say so, so that an exporter writing attention in another form is noticed.
        logger.info("efficient_attention: the graph has no Softmax, so no attention to fuse")
    if report.skipped:
        # One warning per export (a model's layers usually share the reason), every softmax's reason at INFO.
        logger.warning(
            "efficient_attention: %d of %d softmax(es) left to ORT's kernels, e.g. %s",
            len(report.skipped),
            len(report.skipped) + report.replaced,
            report.skipped[0],
        )
        for reason in report.skipped:
            logger.info("attention left unfused: %s", reason)
    if not report.replaced:
        return report
    graph = model.graph
    read_by_removed = {i for n in index.nodes if id(n) in removed for i in n.input if i}
    kept: list[onnx.NodeProto] = []
    for n in index.nodes:
        if id(n) in replacements:
            kept.extend(replacements[id(n)])
        elif id(n) not in removed:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            kept.append(copy)
    del graph.node[:]
    graph.node.extend(kept)
    _remove_dead(graph, read_by_removed)
    graph.value_info.extend(infos)
    if not any(o.domain == ATEN_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(ATEN_DOMAIN, 1))
    logger.debug("replaced %d attention(s) with the fused CPU kernel", report.replaced)
    return report


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return EfficientAttentionOptions


@hookimpl
def ortcore_configure(config: Config) -> None:
    if enabled(config):
        prepare_runtime()


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    if not enabled(config):
        return []
    prepare_runtime()  # idempotent; hosts that skip ortcore_configure still get the ops, gradient and executor
    return [GraphPass(PASS_NAME, run=fuse_attention)]


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    return {"efficient_attention.enable": enabled(config)}


@hookimpl
def ortcore_session_plan(graph: Any, plan: Any) -> None:
    executor.guard_runs(graph, plan)
