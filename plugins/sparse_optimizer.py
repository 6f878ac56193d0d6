"""sparse_optimizer: let ONNX Runtime skip padded labels in the loss (label sparsity); report embedding sparsity.

**Label sparsity.** ORT's ``InsertGatherBeforeSceLoss`` transformer (part of the compute optimizer) gathers the
rows whose label is not ``ignore_index`` before a ``SoftmaxCrossEntropyLossInternal`` node, so the loss and its
gradient skip padded tokens (``Sub``/``NonZero``/``Squeeze`` find the rows, two ``ShrunkenGather`` nodes take
them). In onnxruntime-training 1.19.2 the transformer acts only on a loss whose labels come straight from a
``PythonOp`` named ``onnxruntime.training.ortmodule._runtime_inspector.FlagAndPrintDensity`` (the marker
ORT's own front end inserted), and it removes that marker. The transformer configuration has no switch for it.
So this plugin contributes a graph pass that rewrites each eligible ``SoftmaxCrossEntropyLoss`` of a training-mode
export into marker + ``SoftmaxCrossEntropyLossInternal``. Eligible: logits of rank 2 whose class dimension is known,
labels of rank 1, ``ignore_index`` set (torch always sets it, -100 by default), reduction ``mean`` or ``sum``, and
the log-probabilities output unused. On CPU the result is slower, not faster: ORT's CPU ``GatherGrad``, which puts
the gradient of the kept rows back into the logits' gradient, costs more than the loss saves (measured in
``docs/plugins/sparse_optimizer.md``).

ORT runs its graph transformers only when it builds a gradient graph. A session built without one (a call under
``torch.no_grad()`` on a model in training mode, which reuses the training-mode export) would keep the marker,
which has no kernel here; this plugin rebuilds such a session from the graph without markers.

**Embedding sparsity.** ORT's ``PaddingElimination`` (drop padded tokens after an embedding) is compiled only into
CUDA/ROCm builds of ONNX Runtime ("depends on PadAndUnflatten CUDA/ROCM kernel"), and ORT's front end inspected
embeddings only on CUDA devices. ortcore does not drive it: the option is accepted so configurations carry over,
changes no graph, and says so in a warning when switched on.

Both switches are ANDed with the ``compute_optimizer`` plugin's ``enable``, as ORT's front end did.

Options (``[plugins.sparse_optimizer]`` in ortcore.toml, or the environment)::

    [plugins.sparse_optimizer]
    label = true        # env ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER
    embedding = false   # env ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER (no effect in this build)
    # enable = ...      # env ORTMODULE_ENABLE_SPARSE_OPTIMIZER: the older switch for both

``enable`` sets both ``label`` and ``embedding``. A specific switch set at the same level or a higher one wins over
``enable`` (levels, lowest first: default, ortcore.toml, environment): ``ORTMODULE_ENABLE_SPARSE_OPTIMIZER=0`` turns
off a ``label = true`` from the file, while ``ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER=1`` keeps label sparsity on
under ``ORTMODULE_ENABLE_SPARSE_OPTIMIZER=0``.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import onnx
from onnx import TensorProto, helper

from ortcore.api import Config, GraphPass, OptionError, PassContext, hookimpl, option, parse_bool

logger = logging.getLogger("ortcore.sparse_optimizer")

NAME = "sparse_optimizer"
COMPUTE_OPTIMIZER = "compute_optimizer"
UNMARK_PASS = "sparse_optimizer.unmark"
PASS_NAME = "sparse_optimizer.flag_label_sparsity"
# The marker ORT 1.19.2's InsertGatherBeforeSceLoss looks for (and removes) on a loss's label input.
FLAG_FUNCTION = "onnxruntime.training.ortmodule._runtime_inspector.FlagAndPrintDensity"
MS_DOMAIN = "com.microsoft"


def _parse_optional_bool(value: object, source: str) -> bool | None:
    if value is None:
        return None
    return parse_bool(value, source)


@attrs.frozen
class SparseOptimizerOptions:
    """Options of the ``sparse_optimizer`` plugin; see the module docstring for how ``enable`` combines."""

    # Off by default, unlike upstream: on ORT's CPU build it made GPT-2 steps 19-40% slower (its GatherGrad
    # costs more than the loss saves; docs/plugins/sparse_optimizer.md has the measurements).
    label: bool = option(
        False,
        parse_bool,
        "skip padded labels (ignore_index) in cross-entropy: ORT's InsertGatherBeforeSceLoss",
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER",
    )
    embedding: bool = option(
        False,
        parse_bool,
        "embedding padding elimination: CUDA/ROCm builds of ORT only; no effect here",
        "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER",
    )
    enable: bool | None = option(
        None,
        _parse_optional_bool,
        "older switch for both label and embedding (a specific switch at the same or a higher level wins)",
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER",
    )


@attrs.frozen
class SparsitySwitches:
    """What the options resolve to: the requested switches, the compute optimizer, and what is in effect."""

    label_requested: bool
    embedding_requested: bool
    compute_optimizer: bool

    @property
    def label(self) -> bool:
        """Label sparsity is in effect: requested and the compute optimizer (which runs the transformer) is on."""
        return self.label_requested and self.compute_optimizer


def _level(source: str) -> int:
    """Precedence level of an option's source, as ``Config.sources`` spells it: default < file < environment."""
    if source == "default":
        return 0
    return 2 if source.startswith("env ") else 1


def resolve(config: Config) -> SparsitySwitches:
    """Combine ``label``/``embedding`` with the older ``enable`` switch and with the compute optimizer."""
    options: SparseOptimizerOptions = config.plugin_options(NAME)
    if options is None:
        raise OptionError(f"plugin {NAME!r} is not loaded in this configuration")
    sources = config.sources

    def switch(field: str) -> bool:
        specific = getattr(options, field)
        if options.enable is None:
            return specific
        specific_level = _level(sources.get(f"plugins.{NAME}.{field}", "default"))
        enable_level = _level(sources.get(f"plugins.{NAME}.enable", "default"))
        return specific if specific_level >= enable_level else options.enable

    compute = config.plugin_options(COMPUTE_OPTIMIZER)
    return SparsitySwitches(
        label_requested=switch("label"),
        embedding_requested=switch("embedding"),
        compute_optimizer=bool(compute is not None and compute.enable),
    )


# -- the graph pass ---------------------------------------------------------------------------------------------
def _attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _inferred_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Types of every value, with ONNX's data propagation so ``view(-1, x.size(-1))`` keeps its class dimension."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as e:  # inference is a best effort; without it no loss qualifies and the graph stays as it is
        logger.info("label sparsity: shape inference failed (%s: %s); no loss is rewritten", type(e).__name__, e)
        return {}
    graph = inferred.graph
    return {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}


def _shape(types: dict[str, onnx.TypeProto], name: str) -> list[onnx.TensorShapeProto.Dimension] | None:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return list(t.tensor_type.shape.dim)


def _eligible(node: onnx.NodeProto, types: dict[str, onnx.TypeProto], consumed: set[str]) -> str | None:
    """Why ``node`` cannot carry the marker, or None if it can (the conditions InsertGatherBeforeSceLoss checks)."""
    if _attribute(node, "reduction", b"mean") not in (b"mean", b"sum"):
        return "reduction is 'none'"
    if _attribute(node, "ignore_index") is None:
        return "no ignore_index"
    if len(node.output) > 1 and node.output[1] and node.output[1] in consumed:
        return "its log-probabilities are used"
    logits, labels = _shape(types, node.input[0]), _shape(types, node.input[1])
    if logits is None or labels is None or len(logits) != 2 or len(labels) != 1:
        return "logits are not [tokens, classes] with labels [tokens]"
    if not logits[1].HasField("dim_value"):
        return "the number of classes is not known statically"
    if types[node.input[1]].tensor_type.elem_type != TensorProto.INT64:
        return "labels are not int64"
    return None


def flag_label_sparsity(model: onnx.ModelProto, context: PassContext) -> None:
    """Rewrite each eligible ``SoftmaxCrossEntropyLoss`` into marker ``PythonOp`` + ``SoftmaxCrossEntropyLossInternal``.

    The internal loss takes ``ignore_index`` as a constant input, which is what the transformer reads. The logits get
    a shape entry with their class dimension, because the transformer gives the gathered logits that shape and fails
    on a dimension it cannot name (ORT infers none through ``Reshape(x, Concat(-1, Shape(x)[-1:]))``). A guard on the
    labels keeps a batch without any valid label from gathering zero rows (see :func:`_flagged_loss`).
    """
    if not context.training:
        # Eval-mode graphs mostly run without a gradient, where ORT keeps the marker and the session must be rebuilt.
        return
    graph = model.graph
    losses = [n for n in graph.node if n.op_type == "SoftmaxCrossEntropyLoss" and n.domain in ("", "ai.onnx")]
    if not losses:
        if any(n.op_type == "ATen" and b"cross_entropy" in _attribute(n, "operator", b"") for n in graph.node):
            logger.info(
                "label sparsity: cross_entropy runs as an ATen op (PyTorch's kernel, the aten_fallback plugin), "
                "not as ORT's loss; nothing to mark"
            )
        else:
            logger.info(
                "label sparsity: the graph has no SoftmaxCrossEntropyLoss (the loss is computed outside the model, or "
                "the exporter wrote it as its parts); nothing to mark"
            )
        return
    types = _inferred_types(model)
    consumed = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    loss_ids = {id(n) for n in losses}
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in graph.node:
        if id(node) not in loss_ids:
            nodes.append(node)
            continue
        reason = _eligible(node, types, consumed)
        if reason is not None:
            logger.info("label sparsity: loss %s left as it is: %s", node.name or node.output[0], reason)
            nodes.append(node)
            continue
        rewritten += 1
        nodes.extend(_flagged_loss(graph, node, types, rewritten))
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        logger.info("label sparsity: %d cross-entropy loss(es) marked for ORT's InsertGatherBeforeSceLoss", rewritten)


def _flagged_loss(
    graph: onnx.GraphProto, node: onnx.NodeProto, types: dict[str, onnx.TypeProto], index: int
) -> list[onnx.NodeProto]:
    """The nodes that replace one eligible loss: guard, marker, internal loss, and the guard's scale."""
    logits, labels = node.input[0], node.input[1]
    weight = node.input[2] if len(node.input) > 2 else ""
    loss_type = types[logits].tensor_type.elem_type
    p = f"ortcore_label_sparsity_{index}"  # prefix of every name this rewrite adds

    def const(name: str, dtype: int, dims: list[int], values: list[Any]) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [f"{p}_{name}"], name=f"{p}_{name}", value=helper.make_tensor(name, dtype, dims, values)
        )

    def op(op_type: str, inputs: list[str], output: str, **attributes: Any) -> onnx.NodeProto:
        return helper.make_node(op_type, inputs, [f"{p}_{output}"], name=f"{p}_{output}", **attributes)

    # Guard: ORT's CPU loss kernels divide by the row count, so a batch whose labels are all ignore_index would
    # gather zero rows and kill the process with SIGFPE. If no label is valid, label 0 becomes class 0 (one row is
    # gathered) and the loss is multiplied by 0; otherwise the labels are unchanged and the loss is multiplied by 1.
    nodes = [
        const("ignore_index", TensorProto.INT64, [], [_attribute(node, "ignore_index")]),
        const("zero", TensorProto.INT64, [1], [0]),
        const("one", TensorProto.INT64, [1], [1]),
        const("end", TensorProto.INT64, [1], [2**62]),
        op("Equal", [labels, f"{p}_ignore_index"], "ignored"),
        op("Not", [f"{p}_ignored"], "valid"),
        op("Cast", [f"{p}_valid"], "valid_count_items", to=TensorProto.INT64),
        op("ReduceSum", [f"{p}_valid_count_items"], "valid_count", keepdims=0),
        op("Greater", [f"{p}_valid_count", f"{p}_zero"], "any_valid_1d"),
        op("Slice", [labels, f"{p}_zero", f"{p}_one"], "first_label"),
        op("Slice", [labels, f"{p}_one", f"{p}_end"], "other_labels"),
        op("Where", [f"{p}_any_valid_1d", f"{p}_first_label", f"{p}_zero"], "first_label_guarded"),
        op("Concat", [f"{p}_first_label_guarded", f"{p}_other_labels"], "labels", axis=0),
        op("Cast", [f"{p}_any_valid_1d"], "scale_1d", to=loss_type),
        op("Squeeze", [f"{p}_scale_1d"], "scale"),
        helper.make_node(
            "PythonOp",
            [f"{p}_labels"],
            [f"{p}_ctx", f"{p}_marked_labels"],
            name=f"{p}_marker",
            domain=MS_DOMAIN,
            func_name=FLAG_FUNCTION,
            input_convention="d",
            input_tensor_types=[TensorProto.INT64],
            input_tensor_ranks=[1],
            input_requires_grads=[0],
            output_tensor_types=[TensorProto.INT64],
            output_tensor_ranks=[1],
            training_mode=1,
            comment="ortcore sparse_optimizer: ORT's InsertGatherBeforeSceLoss removes this marker",
        ),
        helper.make_node(
            "SoftmaxCrossEntropyLossInternal",
            [logits, f"{p}_marked_labels", weight, f"{p}_ignore_index"],
            [f"{p}_loss", f"{p}_log_prob"],
            name=node.name or f"{p}_loss",
            domain=MS_DOMAIN,
            reduction=_attribute(node, "reduction", b"mean").decode(),
        ),
        helper.make_node("Mul", [f"{p}_loss", f"{p}_scale"], [node.output[0]], name=f"{p}_guarded_loss"),
    ]
    classes = _shape(types, logits)[1].dim_value
    for i, value in enumerate(graph.value_info):
        if value.name == logits:
            del graph.value_info[i]
            break
    graph.value_info.append(helper.make_tensor_value_info(logits, loss_type, [None, classes]))
    return nodes


def _is_marker(node: onnx.NodeProto) -> bool:
    return (
        node.op_type == "PythonOp"
        and node.domain == MS_DOMAIN
        and _attribute(node, "func_name") == FLAG_FUNCTION.encode()
    )


def strip_markers(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` without label-sparsity markers (their consumers read the labels), or None if it has none."""
    if not any(_is_marker(n) for n in model.graph.node):
        return None
    stripped = onnx.ModelProto()
    stripped.CopyFrom(model)
    renames = {n.output[1]: n.input[0] for n in stripped.graph.node if _is_marker(n)}
    kept = [n for n in stripped.graph.node if not _is_marker(n)]
    for n in kept:
        for i, name in enumerate(n.input):
            n.input[i] = renames.get(name, name)
    del stripped.graph.node[:]
    stripped.graph.node.extend(kept)
    return stripped


# -- hooks --------------------------------------------------------------------------------------------------------
@hookimpl
def ortcore_options_class() -> type:
    return SparseOptimizerOptions


@hookimpl
def ortcore_configure(config: Config) -> None:
    switches = resolve(config)
    if switches.label_requested and not switches.compute_optimizer:
        logger.info("label sparsity is off: it needs the compute_optimizer plugin loaded and enabled")
    if switches.embedding_requested:
        logger.warning(
            "embedding sparsity has no effect: ORT's PaddingElimination is compiled only into CUDA/ROCm builds of "
            "ONNX Runtime, and ortcore does not drive it; set ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER=0 to "
            "silence this"
        )


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    return {"sparse_optimizer.label": resolve(config).label}


@hookimpl
def ortcore_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(PASS_NAME, run=flag_label_sparsity)] if resolve(config).label else []


def markers_to_identities(model: onnx.ModelProto, graph: Any) -> None:
    """A gradient-graph pass: ORT removes the markers only while building a gradient graph, and a session that kept
    one would fail at its first run, so each marker left in the built graph (an inference build) becomes an
    Identity from the labels to the value its consumers read."""
    count = 0
    for node in model.graph.node:
        if _is_marker(node):
            labels, value = node.input[0], node.output[1]
            node.Clear()
            node.CopyFrom(onnx.helper.make_node("Identity", [labels], [value], name=f"{PASS_NAME}/unmarked/{value}"))
            count += 1
    if count:
        logger.info("label sparsity: %d markers ORT kept in the %s graph became Identities", count, graph.kind)


@hookimpl
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass]:
    return [GraphPass(UNMARK_PASS, run=markers_to_identities)] if resolve(config).label else []
