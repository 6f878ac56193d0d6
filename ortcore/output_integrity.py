"""Which forward outputs of a training graph ORT could write after handing them to torch, so the core copies them.

ORT hands each forward output to torch through DLPack as the ``OrtValue`` YieldOp received: no copy. That tensor
stays right only if no later computation writes into its buffer, and ORT's allocation planner does not see the user
as a reader of it. ORT 1.19's planner lets a value share another's buffer in three ways:

* **alias** kernels (``Reshape``, ``Squeeze``, ``Identity``, ...: ``KernelDefBuilder().Alias``) always output a view
  of their input's buffer;
* **in-place** kernels (``MayInplace``: elementwise math, activations, ``Clip``, most gradient kernels) reuse an
  input's buffer for their output when that input is at its last use and has the output's size. ORT's training build
  skips this for a node whose *first* consumer is YieldOp, but a node that feeds the loss before the YieldOp
  (``scale = ...clamp_min(1e-5)`` read by ``x / scale`` and returned) is not spared;
* a value kept for the backward is read there by such an in-place kernel at its last use, which then writes its
  result into the buffer the user holds.

A forward output whose buffer belongs to another value (the first two) is handed out as a tensor that does not own
its memory: ORT frees the owner when its last reader ran (after the forward, or in the backward) and the backward's
allocations overwrite what the user kept (a time-series model's returned ``scale`` read ``[-0.116, -0.150]`` instead
of ``[1.788, 1.916]`` after ``loss.backward()``). The third writes into it directly.

:func:`outputs_at_risk` finds these from the graph ORT runs (read back once per session), conservatively: the
planner's exact choices (execution order, which kernels declare ``MayInplace``) are not visible from Python, so
every kernel is taken as possibly in place, and only the size test (element size, static shape) and the order forced
by the graph (a reader that must run before the YieldOp cannot reuse a buffer the YieldOp still reads) rule a case
out. A returned graph input (an input, a parameter or a buffer returned as it is) is not at risk (ORT never writes
the caller's buffers, and the OrtValue handed back holds the caller's tensor) and is not copied: PyTorch returns it
as it is too. A *view* of a graph input is copied: ORT's view holds no reference to the tensor it views, so a caller
who drops a temporary input would keep a view of freed memory.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

# ORT's CPU kernels whose output is a view of their input's buffer (KernelDefBuilder().Alias(0, 0)).
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "ExpandDims", "View", "PassThrough"})
_ONNX_DOMAINS = ("", "ai.onnx", "com.microsoft")
# Kernels that never compute in another value's buffer: products, reductions, normalisations, gathers and joins
# (their ORT CPU kernels declare no MayInplace), and nodes whose outputs PyTorch allocates (ATen, PythonOp: ORT
# plans them as external outputs, never reused). Every other kernel is taken as possibly in place.
NOT_IN_PLACE = frozenset(
    {
        "MatMul",
        "FusedMatMul",
        "Gemm",
        "FusedGemm",
        "Conv",
        "FusedConv",
        "ConvTranspose",
        "ConvGrad",
        "Einsum",
        "Concat",
        "ConcatTraining",
        "Split",
        "SplitTraining",
        "Gather",
        "GatherElements",
        "GatherND",
        "GatherGrad",
        "Slice",
        "SliceGrad",
        "Transpose",
        "Tile",
        "Pad",
        "Shape",
        "Size",
        "ConstantOfShape",
        "Range",
        "NonZero",
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL2",
        "ReduceLogSumExp",
        "ArgMax",
        "ArgMin",
        "TopK",
        "Softmax",
        "LogSoftmax",
        "SoftmaxGrad",
        "SoftmaxGrad_13",
        "LogSoftmaxGrad",
        "LogSoftmaxGrad_13",
        "LayerNormalization",
        "SimplifiedLayerNormalization",
        "SkipLayerNormalization",
        "LayerNormalizationGrad",
        "SimplifiedLayerNormalizationGrad",
        "InvertibleLayerNormalizationGrad",
        "SoftmaxCrossEntropyLoss",
        "SoftmaxCrossEntropyLossInternal",
        "SoftmaxCrossEntropyLossGrad",
        "SoftmaxCrossEntropyLossInternalGrad",
        "MaxPool",
        "AveragePool",
        "GlobalAveragePool",
        "MaxPoolGrad",
        "ATen",
        "PythonOp",
        "PythonOpGrad",
        "YieldOp",
    }
)

# Why an output is copied (the values of outputs_at_risk's mapping).
VIEW = "a view of a buffer ORT frees after the forward"
IN_PLACE = "computed in place in another value's buffer, which ORT frees after the forward"
WRITTEN_IN_BACKWARD = "read by a backward kernel that may write its result into the same buffer"
REUSED = "in a buffer ORT's memory reuse (enable_mem_reuse) may give to a later value"
# Kernels whose outputs PyTorch allocates: ORT plans them as external outputs, never freed or reused.
_EXTERNAL_OUTPUTS = frozenset({"ATen", "PythonOp", "PythonOpGrad"})


def _is_view(node: onnx.NodeProto) -> bool:
    return node.op_type in VIEW_OPS and node.domain in _ONNX_DOMAINS


def _may_write_in_place(node: onnx.NodeProto) -> bool:
    return not _is_view(node) and node.op_type not in NOT_IN_PLACE


def _element_sizes(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, tuple | None]]:
    """Per value name: its element size in bytes and its static shape (a tuple of ints and dim_param names; None
    where a dimension is neither), where the graph records them."""
    sizes: dict[str, int] = {}
    shapes: dict[str, tuple | None] = {}
    g = model.graph
    for info in (*g.input, *g.output, *g.value_info):
        t = info.type.tensor_type
        if not info.type.HasField("tensor_type") or t.elem_type == 0:
            continue
        try:
            sizes[info.name] = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
        except (KeyError, TypeError, ValueError):
            pass
        if t.HasField("shape"):
            dims = []
            for d in t.shape.dim:
                if d.HasField("dim_value"):
                    dims.append(d.dim_value)
                elif d.dim_param:
                    dims.append(d.dim_param)
                else:
                    dims = None
                    break
            shapes[info.name] = tuple(dims) if dims is not None else None
    return sizes, shapes


def _may_share(a: str, b: str, sizes: dict[str, int], shapes: dict[str, tuple | None]) -> bool:
    """Whether ORT's planner could put values ``a`` and ``b`` in one buffer by size (same element size and static
    shape). Unknown counts as possible: the graph read back does not record every value's type."""
    if a in sizes and b in sizes and sizes[a] != sizes[b]:
        return False
    sa, sb = shapes.get(a), shapes.get(b)
    return sa is None or sb is None or sa == sb


def _ancestors(node_index: int, producer_index: dict[str, int], nodes: list[onnx.NodeProto]) -> set[int]:
    seen: set[int] = set()
    stack = [node_index]
    while stack:
        for name in nodes[stack.pop()].input:
            j = producer_index.get(name)
            if j is not None and j not in seen:
                seen.add(j)
                stack.append(j)
    return seen


def outputs_at_risk(
    executed: onnx.ModelProto, memory_reuse: bool = False, read_before_backward: Iterable[int] = ()
) -> dict[int, str]:
    """The forward outputs of a training graph, as ORT runs it (YieldOp's inputs, by position), that ORT could write
    after the forward returned them, each with the reason (:data:`VIEW`, :data:`IN_PLACE`,
    :data:`WRITTEN_IN_BACKWARD`, :data:`REUSED`). Empty for a graph without a YieldOp (an inference graph).

    ``memory_reuse``: the session's ``enable_mem_reuse`` (off in ortcore's plan). With it, ORT's planner gives a
    buffer whose last reader ran to a later value, an output's too, so every output ORT allocated is at risk.

    ``read_before_backward``: positions of outputs the core reads as soon as the forward returns and never hands out
    (batch-norm inputs, buffers' new values): a backward that writes into them comes too late to matter, so only
    the other reasons copy them."""
    nodes = list(executed.graph.node)
    yield_at = next((i for i, n in enumerate(nodes) if n.op_type == "YieldOp"), None)
    if yield_at is None:
        return {}
    producer_index = {name: i for i, n in enumerate(nodes) for name in n.output if name}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            if name:
                readers.setdefault(name, []).append(i)
    graph_inputs = {v.name for v in executed.graph.input} | {t.name for t in executed.graph.initializer}
    sizes, shapes = _element_sizes(executed)
    # Nodes that must run before the YieldOp: while they run, the YieldOp still reads every forward output, so none
    # of them can take an output's buffer in place.
    before_yield = _ancestors(yield_at, producer_index, nodes)

    def view_closure(name: str) -> set[str]:
        """``name`` and every value that views its buffer (through alias kernels, either way)."""
        found = {name}
        stack = [name]
        while stack:
            v = stack.pop()
            j = producer_index.get(v)
            if j is not None and _is_view(nodes[j]) and nodes[j].input and nodes[j].input[0] not in found:
                found.add(nodes[j].input[0])
                stack.append(nodes[j].input[0])
            for r in readers.get(v, ()):
                if _is_view(nodes[r]) and nodes[r].input and nodes[r].input[0] == v:
                    for out in nodes[r].output:
                        if out and out not in found:
                            found.add(out)
                            stack.append(out)
        return found

    read_before_backward = frozenset(read_before_backward)
    at_risk: dict[int, str] = {}
    for k, name in enumerate(nodes[yield_at].input):
        if not name or name in graph_inputs:  # the caller's tensor itself, kept alive by its OrtValue
            continue
        j = producer_index.get(name)
        if j is None:
            continue
        producer = nodes[j]
        if _is_view(producer):
            at_risk[k] = VIEW
            continue
        if memory_reuse and producer.op_type not in _EXTERNAL_OUTPUTS:
            at_risk[k] = REUSED
            continue
        # In place at its producer: ORT's guard spares a node whose first consumer is the YieldOp; with no other
        # consumer of any of its outputs, the YieldOp is that first one.
        other_readers = any(r != yield_at for out in producer.output if out for r in readers.get(out, ()))
        if (
            other_readers
            and _may_write_in_place(producer)
            and any(
                src and src not in graph_inputs and src in producer_index and _may_share(src, name, sizes, shapes)
                for src in producer.input
            )
        ):
            at_risk[k] = IN_PLACE
            continue
        if k in read_before_backward:
            continue
        # Written by a later reader of its buffer that may run after the YieldOp.
        buffer = view_closure(name)
        if any(
            r != yield_at
            and r not in before_yield
            and _may_write_in_place(nodes[r])
            and any(out and _may_share(v, out, sizes, shapes) for out in nodes[r].output)
            for v in buffer
            for r in readers.get(v, ())
        ):
            at_risk[k] = WRITTEN_IN_BACKWARD
    return at_risk


def describe(at_risk: dict[int, str], names: Iterable[str]) -> dict[str, str]:
    """``outputs_at_risk``'s result keyed by output name (``names``: the graph's forward output names in order)."""
    names = list(names)
    return {names[k] if k < len(names) else f"forward output {k}": why for k, why in at_risk.items()}


def copied_outputs(session: object) -> dict[str, str]:
    """The forward outputs a training session hands out as copies, by output name, each with why ORT could have
    written it after the call (the reasons of :func:`outputs_at_risk`); empty for an inference session. What is not
    listed is handed out as ORT's own buffer: a tool that finds such an output changed after the call has found a
    case this analysis misses."""
    return describe(getattr(session, "copy_reasons", {}), getattr(session, "user_output_names", ()))
