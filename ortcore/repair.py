"""Repair by routing: when a stage fails, find where, move that part to PyTorch, and try again.

A model ORT cannot serve whole usually fails in one place: an op the exporter cannot express for these inputs, an
op ORT has no gradient for, a graph optimizer that throws, a module whose gradients the audit finds wrong. Instead of
sending the whole model back to PyTorch, the core

1. **locates** the failure (:func:`locate`): the ``aten::`` ops and ONNX nodes its message names, the modules that
   hold them (from ONNX node names, which carry the module scope, and from one eager run that records which
   innermost module calls which op and where complex tensors live: :class:`ModuleTrace`), or the module the gradient
   audit names;
2. asks plugins how to repair it (``ortcore_repairs``): each answer is a :class:`Repair`, a change of one plugin's
   options (route this op; run this module in PyTorch; switch this graph optimizer off), tried smallest first
   (switches, then ops, then regions innermost first);
3. applies the first repair that changes anything, exports and builds again, and audits again; at most
   :data:`MAX_REPAIRS` times per model.

A repair is configuration: the repaired model runs with exactly the options it would run with if the user had
written them in ``ortcore.toml`` (``ORTModule.repairs`` lists them; ``ortcore explain`` shows what runs in PyTorch
and why). The decision to re-export belongs to the state machine: repairs are part of the graph key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger("ortcore")

MAX_REPAIRS = 6  # routing repairs (switches, ops, regions) per model; an exporter switch is not counted
EXPORTER_KINDS = frozenset({"exporter", "exporter_after_regions"})
KIND_ORDER = {"switch": 0, "op": 1, "exporter": 2, "region": 3, "exporter_after_regions": 4}
# A repair whose ``plugin`` is this sets core options (another exporter), over every other layer.
CORE_REPAIR = "core"


@attrs.frozen
class Failure:
    """Where and how a stage failed.

    ``stage`` is ``"export"``, ``"build"``, ``"run"`` or ``"audit"``; ``ops`` the ``aten::`` ops implicated,
    ``onnx_ops`` the ONNX op types, ``nodes`` the ONNX node names; ``modules`` the module paths that hold the
    failure, innermost first, then their enclosing modules (never ``""``: the whole model is the fallback, not a
    repair)."""

    stage: str
    message: str
    ops: tuple[str, ...] = ()
    onnx_ops: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    innermost: tuple[str, ...] = ()  # the modules found holding the failure, before their enclosing ones

    def describe(self) -> str:
        where = []
        if self.ops:
            where.append(f"op {', '.join(self.ops)}")
        if self.nodes:
            where.append(f"node {', '.join(self.nodes[:3])}")
        if self.modules:
            where.append(f"module {self.modules[0]}")
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.stage} failed{' at ' + '; '.join(where) if where else ''}: {first[:300]}"


@attrs.frozen(eq=False)
class Repair:
    """One way to repair a failure: new values for some of ``plugin``'s options (what ``[plugins.<plugin>]`` in
    ortcore.toml would say).

    ``kind`` orders the candidates: ``"switch"`` (an optimizer off), ``"op"`` (one op on PyTorch), ``"exporter"``
    (another exporter for the whole model, everything still in ORT), ``"region"`` (a module on PyTorch),
    ``"exporter_after_regions"`` (another exporter, once no region helped). ``plugin``
    ``"core"`` (:data:`CORE_REPAIR`) sets core options instead, over the environment too. ``reason`` is filled by
    the core with the failure it repairs."""

    description: str
    plugin: str
    options: Mapping[str, Any]
    kind: str = "region"
    region: str | None = None
    op: str | None = None
    reason: str = ""

    @property
    def key(self) -> tuple:
        return (self.plugin, tuple(sorted((k, repr(v)) for k, v in self.options.items())))


# -- locating -------------------------------------------------------------------------------------------------------

_ATEN = re.compile(r"aten::([A-Za-z0-9_]+)")
_OPERATOR = re.compile(
    r"(?:export of operator|the operator|operator '?)(?:aten::)?(?!(?:with|that|in|of|for|is|to|on)\b)([a-z][a-z0-9_]*)",
    re.IGNORECASE,
)
_NODE = re.compile(r"[Nn]ode\s*\(?'?([/\w.:\-]+)'?\)?")
_OP_TYPE = re.compile(r"(?:Op\s*\(|op(?:_| )type[:= ]*\(?'?|for op(?: type)?:? '?)([A-Z][A-Za-z0-9]+)")
_GRADIENT_OP = re.compile(r"(?:gradient|Grad)\w*\s+(?:builder\s+)?(?:for|of)\s+(?:op\s+)?'?([A-Z][A-Za-z0-9]+)")


def _unique(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(i for i in items if i))


def ops_named(text: str) -> tuple[str, ...]:
    """The ``aten::`` ops a message names."""
    found = [f"aten::{m}" for m in _ATEN.findall(text)]
    found += [f"aten::{m}" for m in _OPERATOR.findall(text) if m not in ("the", "is")]
    return _unique(found)


_NAMED = re.compile(r"\bName:\s*'([^']+)'")  # ORT's run errors: "... running Gemm node. Name:'<node>' Status ..."
_SCOPED = re.compile(r"(/module/[\w./\-]+)")  # a TorchScript node or value name: /module/<scope>/<op>[_output_0]


def onnx_named(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(node names, ONNX op types)`` a message of ONNX Runtime names (``Node (name)``, or any value or node name
    with a module scope, such as ``Duplicate definition of name (/module/enc/conv1/Constant_1_output_0_grad)``)."""
    nodes = _NAMED.findall(text) + [n for n in _NODE.findall(text) if "/" in n or "_" in n] + _SCOPED.findall(text)
    types = _OP_TYPE.findall(text) + _GRADIENT_OP.findall(text)
    return _unique(nodes), _unique(types)


def with_ancestors(paths: Sequence[str]) -> tuple[str, ...]:
    """The paths themselves first, then their enclosing modules one level up at a time (``a.b.c``, ``x.y``, then
    ``a.b``, ``x``, then ``a``), never ``""``: every innermost module is tried before any enclosing one."""
    split = [path.split(".") for path in paths if path]
    depth = max((len(parts) for parts in split), default=0)
    out: list[str] = []
    for up in range(depth):
        out.extend(".".join(parts[: len(parts) - up]) for parts in split if len(parts) > up)
    return _unique(out)


@attrs.define
class ModuleTrace:
    """What one eager forward shows: the ``aten::`` ops each module calls itself (not through a child), and the
    modules whose own ops produce complex tensors while their inputs and outputs are real."""

    ops: dict[str, set[str]] = attrs.field(factory=dict)  # module path -> aten ops it calls directly
    complex_inside: set[str] = attrs.field(factory=set)  # modules whose own ops touch complex tensors
    complex_boundary: set[str] = attrs.field(factory=set)  # modules with a complex input or output
    order: list[str] = attrs.field(factory=list)  # modules in the order their forward started
    ran: bool = False  # the eager forward completed (an error raised only while tracing is then not the model's)

    def modules_calling(self, op: str) -> list[str]:
        return [m for m in self.order if op in self.ops.get(m, ())]

    def complex_regions(self) -> list[str]:
        """For each module whose own ops touch complex tensors, the innermost enclosing module (itself included)
        with real inputs and outputs: a region PyTorch can run whole."""
        found = []
        for path in self.order:
            if path not in self.complex_inside:
                continue
            for candidate in with_ancestors([path]):
                if candidate not in self.complex_boundary:
                    found.append(candidate)
                    break
        return list(dict.fromkeys(found))


def _is_complex(value: Any) -> bool:
    leaves = torch.utils._pytree.tree_leaves(value)
    return any(isinstance(t, torch.Tensor) and t.is_complex() for t in leaves)


_NAMESPACES = {"torch.fft": "fft_", "torch.linalg": "linalg_", "torch.special": "special_"}


def aten_names(func: Any) -> set[str]:
    """The ``aten::`` names a torch function is known by in errors (``torch.fft.rfft`` is ``aten::fft_rfft``;
    ``Tensor.index_add_`` is ``aten::index_add_`` and ``aten::index_add``)."""
    name = getattr(func, "__name__", "")
    if not name or name.startswith("__"):
        return set()
    prefix = _NAMESPACES.get(getattr(func, "__module__", "") or "", "")
    names = {f"aten::{prefix}{name}", f"aten::{name}"}
    if name.endswith("_"):
        names.add(f"aten::{prefix}{name[:-1]}")
    return names


class _Recorder(TorchFunctionMode):
    """Records torch functions per innermost module. A function mode, not a dispatch mode: torch.cond (and other
    higher-order ops) run in eager under it, where a dispatch mode leaves torch.compile's state broken for the
    process."""

    def __init__(self, trace: ModuleTrace, stack: list[str]):
        super().__init__()
        self.trace, self.stack = trace, stack

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.stack:
            path = self.stack[-1]
            self.trace.ops.setdefault(path, set()).update(aten_names(func))
            if _is_complex(out) or _is_complex(args):
                self.trace.complex_inside.add(path)
        return out


def trace_modules(model: torch.nn.Module, args: tuple, kwargs: dict) -> ModuleTrace:
    """Run ``model(*args, **kwargs)`` once eagerly, without gradients, recording :class:`ModuleTrace`. The model's
    buffers and the random state are restored afterwards."""
    trace = ModuleTrace()
    stack: list[str] = []
    handles = []

    def pre(path: str):
        def hook(_module: torch.nn.Module, inputs: Any, kw: Any = None) -> None:
            stack.append(path)
            trace.order.append(path)
            if _is_complex(inputs) or _is_complex(kw):
                trace.complex_boundary.add(path)

        return hook

    def post(path: str):
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if _is_complex(output):
                trace.complex_boundary.add(path)
            if stack and stack[-1] == path:
                stack.pop()

        return hook

    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(pre(path), with_kwargs=True))
            handles.append(module.register_forward_hook(post(path), always_call=True))
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    rng = torch.random.get_rng_state()
    try:
        with torch.no_grad(), _Recorder(trace, stack):
            model(*args, **kwargs)
        trace.ran = True
    except Exception as e:  # the trace is evidence, not a requirement: an empty trace locates less
        logger.debug("module trace for repair failed: %s: %s", type(e).__name__, e)
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        torch.random.set_rng_state(rng)
    return trace


def modules_in_traceback(error: BaseException, model: torch.nn.Module) -> list[str]:
    """The modules whose ``forward`` was running where ``error`` (or an error it was raised from) was raised,
    innermost first, as paths of ``model``. The exporter traces a deep copy: frames are matched to paths through
    the copy's (or the model's) own ``named_modules``."""
    frames: list[torch.nn.Module] = []
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            owner = tb.tb_frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                frames.append(owner)
            tb = tb.tb_next
        error = getattr(error, "raised_in_forward", None) or error.__cause__ or error.__context__
    roots = [m for m in frames if type(m) is type(model)]
    paths: dict[int, str] = {}
    for root in roots or [model]:
        paths.update({id(m): p for p, m in root.named_modules()})
    found = [paths[id(m)] for m in reversed(frames) if paths.get(id(m))]
    return list(dict.fromkeys(found))


def node_module(node_name: str, module_paths: set[str]) -> str | None:
    """The module path of an exported node (``/module/encoder/layer.0/attention/MatMul`` -> ``encoder.layer.0
    .attention``), matched against the model's module paths; None if the name carries no scope."""
    start = node_name.find("/module/")
    if start < 0:
        return None
    parts = node_name[start + len("/module/") :].split("/")[:-1]
    path = ""
    for part in parts:
        candidates = [f"{path}.{part}" if path else part]
        if "." in part:  # the tracer names numbered children "<parent attribute>.<index>"
            tail = part.split(".", 1)[1]
            candidates.append(f"{path}.{tail}" if path else tail)
        found = next((c for c in candidates if c in module_paths), None)
        if found is None:
            break
        path = found
    return path


def _node_modules(nodes: Sequence[Any], module_paths: set[str]) -> list[str]:
    return [m for m in (node_module(n, module_paths) for n in nodes) if m]


def locate(
    stage: str,
    error: BaseException | str,
    model: torch.nn.Module,
    *,
    trace: ModuleTrace | None = None,
    onnx_model: Any = None,
    module: str | None = None,
) -> Failure:
    """A :class:`Failure` for ``error`` at ``stage``: the ops and nodes its message names and the modules that hold
    them. ``onnx_model`` (the exported graph, when the failure came after export) maps ONNX op types to node names;
    ``module`` is a module already named (the gradient audit's); ``trace`` an eager :class:`ModuleTrace`."""
    text = error if isinstance(error, str) else _chain_text(error)
    ops = ops_named(text)
    nodes, onnx_ops = onnx_named(text)
    paths = {p for p, _ in model.named_modules()}
    if onnx_model is not None and onnx_ops and not nodes:
        nodes = _unique([n.name for n in onnx_model.graph.node if n.op_type in onnx_ops])
    if onnx_model is not None and nodes:
        ops = _unique([*ops, *_exported_from(onnx_model, nodes)])
    modules: list[str] = [module] if module else []
    if not isinstance(error, str):
        modules += [m for m in getattr(error, "modules", ()) or () if isinstance(m, str)]  # BufferWriteError's owners
    modules += _node_modules(nodes, paths)
    if not isinstance(error, str):
        modules += modules_in_traceback(error, model)
    if trace is not None:
        for op in ops:
            modules += trace.modules_calling(op)
        if "omplex" in text or not modules:
            modules += trace.complex_regions()
    found = _unique([m for m in modules if m in paths])
    innermost = [m for m in found if not any(_encloses(m, other) for other in found)]
    return Failure(stage, text, ops, onnx_ops, nodes, with_ancestors(innermost), tuple(innermost))


# The dynamo exporter records on each node the aten op it was translated from: ``namespace`` ends with
# ``: aten.nll_loss.default``.
_NODE_ATEN = re.compile(r":\s*aten\.(\w+)\.\w+$")


def _exported_from(onnx_model: Any, nodes: Sequence[str]) -> list[str]:
    """The ``aten::`` ops the named nodes of ``onnx_model`` were exported from, where the graph records it. A node of
    ORT's gradient graph (``node_MatMul_340_Grad/Gemm_10/...``) stands for the forward node it differentiates."""
    wanted = set(nodes) | {name.partition("_Grad/")[0] for name in nodes if "_Grad/" in name}
    found = []
    for node in onnx_model.graph.node:
        if node.name in wanted:
            for prop in node.metadata_props:
                match = _NODE_ATEN.search(prop.value) if prop.key == "namespace" else None
                if match:
                    found.append(f"aten::{match.group(1)}")
    return found


def _encloses(path: str, other: str) -> bool:
    """Whether module ``path`` strictly encloses module ``other`` (``""`` is the model itself)."""
    return other != path and (path == "" or other.startswith(path + "."))


def _chain_text(error: BaseException) -> str:
    """The message of an exception and of every exception it was raised from."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return "\n".join(parts)


def order_repairs(repairs: Sequence[Repair]) -> list[Repair]:
    """Smallest change first: switches, then ops, then another exporter, then regions (innermost first, as plugins
    listed them), then another exporter offered as a last resort."""
    return sorted(repairs, key=lambda r: KIND_ORDER.get(r.kind, len(KIND_ORDER)))
