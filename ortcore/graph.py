"""Export of one input schema and the core's post-export processing.

:func:`export_graph` runs the exporter on a flat view of the model (tensors in, tensors out), names the graph
inputs after the user's arguments and the model's ``state_dict``, and returns an :class:`ExportedGraph` that knows
how to feed the graph and restore its outputs. The model's state (buffers, RNG) is left as it was: tracing runs
the forward once, and that run must not count as a training step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import onnx
import torch

from .domains import STOP_GRADIENT, STOP_GRADIENT_DOMAIN
from .errors import BufferWriteError, UnsupportedDataError, UnsupportedModelError, buffer_owners
from .exporter import Exporter, ExportRequest
from .graph_passes import GraphPass, PassContext
from .options import LogLevel
from .schema import Constant, InputSchema, OutputSchema, flatten_outputs

logger = logging.getLogger("ortcore")

BN_INPUT_PREFIX = "ortcore.batch_norm_input::"
TAP_OUTPUT_PREFIX = "ortcore.tap::"
# Metadata an exporter may write: the sizes each input dimension may take in the graph, JSON
# {input name: [[dim, low, high or null], ...]} (a dimension it fixed has low == high). The dynamo route writes it
# from torch.export's range constraints: a model that branches on a size (``if ids.shape[1] > 8``) gives a graph
# valid for some sizes only.
INPUT_RANGES_METADATA = "ortcore.input_ranges"
GRAPH_FORMAT = 2  # bump when ExportedGraph.to_bytes changes (2: JSON and ONNX bytes; 1 was a pickle)


class _FlatModule(torch.nn.Module):
    """The model seen as ``tensors -> tensors``, which is what exporters trace."""

    def __init__(self, module: torch.nn.Module, schema: InputSchema, tapper: Any = None):
        super().__init__()
        self.module = module
        self.schema = schema
        self.tapper = tapper  # collects a subscribed model's activations (ortcore.hooks), which become outputs too
        self.output_schema: OutputSchema | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.tapper is not None:
            self.tapper.reset()
        args, kwargs = self.schema.rebuild(tensors)
        self.output_schema, flat = flatten_outputs(self.module(*args, **kwargs))
        if not flat:
            raise UnsupportedDataError(f"{type(self.module).__name__}.forward returned no tensor; nothing to train")
        return tuple(flat) + (tuple(self.tapper.tensors) if self.tapper is not None else ())


@attrs.define(eq=False)
class BatchNormStats:
    """A batch-norm module whose running statistics ortcore updates from the input ORT computed."""

    module: torch.nn.modules.batchnorm._BatchNorm
    output_name: str
    # ORT's training-mode kernel writes into its running-statistics inputs; these are fed as copies.
    buffer_names: tuple[str, str]
    module_path: str


@attrs.frozen
class TapPoint:
    """An activation of a subscribed model: its name, the graph value holding it, and the extra output exposing it."""

    name: str
    value: str  # the tapped value, which flows on in the graph
    output: str  # the extra graph output ``ortcore.tap::<n>`` exposing it


@attrs.define(eq=False)
class ExportedGraph:
    """An exported, post-processed forward graph and what is needed to feed it and read it."""

    model: onnx.ModelProto
    input_names: list[str]  # graph inputs in order
    argument_names: tuple[str, ...]  # the schema's name of each tensor argument
    user_input_names: list[str]  # the graph input name of each tensor argument
    output_schema: OutputSchema
    training: bool
    batch_norms: list[BatchNormStats]
    raw_model: onnx.ModelProto | None = None  # the exporter's graph before processing, kept only to be saved
    export_seconds: float = 0.0
    taps: list[TapPoint] = attrs.Factory(list)  # in execution order; outputs after the batch-norm ones

    @functools.cached_property
    def input_ranges(self) -> dict[str, list[tuple[int, int, int | None]]]:
        """The sizes the graph's inputs may take (:func:`input_ranges`), read from the model once: every call checks
        them."""
        return input_ranges(self.model)

    @property
    def n_user_outputs(self) -> int:
        return len(self.output_schema.names)

    @property
    def tap_outputs(self) -> list[int]:
        """The graph output index of each tap."""
        index = {o.name: i for i, o in enumerate(self.model.graph.output)}
        return [index[tap.output] for tap in self.taps]

    def to_bytes(self) -> bytes:
        """Serialise for an export cache as data only: one line of JSON (names, output schema, batch norms, taps),
        then the ONNX model's bytes. Nothing in it runs code when read back.

        Raises ValueError naming the part that cannot be stored as data (an output type that cannot be found again
        by its import path, a constant of another type): such a graph is not cached.
        """
        state = {
            "format": GRAPH_FORMAT,
            "input_names": list(self.input_names),
            "argument_names": list(self.argument_names),
            "user_input_names": list(self.user_input_names),
            "output_schema": self.output_schema.to_json(),
            "training": bool(self.training),
            "batch_norms": [
                {"module": b.module_path, "output": b.output_name, "buffers": list(b.buffer_names)}
                for b in self.batch_norms
            ],
            "taps": [{"name": t.name, "value": t.value, "output": t.output} for t in self.taps],
        }
        # ensure_ascii: the JSON line holds no raw newline, so the first newline ends it
        header = json.dumps(state, sort_keys=True, ensure_ascii=True, allow_nan=True).encode()
        return header + b"\n" + self.model.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes, module: torch.nn.Module) -> ExportedGraph:
        """Inverse of :meth:`to_bytes`; raises ValueError for data of another format or another model."""
        line, newline, model_bytes = bytes(data).partition(b"\n")
        try:
            state = json.loads(line) if newline else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not an ortcore exported graph ({e})") from e
        if not isinstance(state, dict) or state.get("format") != GRAPH_FORMAT:
            raise ValueError(f"not an ortcore exported graph of format {GRAPH_FORMAT}")
        names = {k: _strings(state.get(k), k) for k in ("input_names", "argument_names", "user_input_names")}
        if not isinstance(state.get("training"), bool):
            raise ValueError("an exported graph's 'training' must be true or false")
        modules = dict(module.named_modules())
        batch_norms = []
        for entry in _records(state.get("batch_norms"), "batch_norms", ("module", "output", "buffers")):
            path, output_name, buffer_names = entry["module"], entry["output"], _strings(entry["buffers"], "buffers")
            if not isinstance(path, str) or not isinstance(output_name, str) or len(buffer_names) != 2:
                raise ValueError(f"malformed batch-norm record {str(entry)[:80]!r}")
            if not isinstance(modules.get(path), torch.nn.modules.batchnorm._BatchNorm):
                raise ValueError(f"the model has no batch-norm module {path!r}")
            batch_norms.append(BatchNormStats(modules[path], output_name, (buffer_names[0], buffer_names[1]), path))
        taps = []
        for entry in _records(state.get("taps"), "taps", ("name", "value", "output")):
            taps.append(TapPoint(*_strings([entry["name"], entry["value"], entry["output"]], "taps")))
        try:
            model = onnx.load_model_from_string(model_bytes)
        except Exception as e:  # protobuf's DecodeError, whatever the garbling
            raise ValueError(f"the ONNX model does not parse ({type(e).__name__}: {e})") from e
        return cls(
            model=model,
            input_names=names["input_names"],
            argument_names=tuple(names["argument_names"]),
            user_input_names=names["user_input_names"],
            output_schema=OutputSchema.from_json(state.get("output_schema")),
            training=state["training"],
            batch_norms=batch_norms,
            taps=taps,
        )


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"an exported graph's {what!r} must be a list of strings")
    return list(value)


def _records(value: Any, what: str, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(v, dict) and set(v) == set(keys) for v in value):
        raise ValueError(f"an exported graph's {what!r} must be a list of objects with keys {list(keys)}")
    return value


@contextlib.contextmanager
def _preserved_state(module: torch.nn.Module) -> Iterator[None]:
    """Restore buffers and RNG state after the exporter's tracing run."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def written_buffers(module: torch.nn.Module, versions: dict[str, int]) -> list[str]:
    """The buffers of ``module`` whose version counter moved since ``versions`` was taken (written in place), less
    batch norm's running statistics, which ortcore updates itself (:class:`BatchNormStats`)."""
    batch_norm = {
        f"{path}.{name}" if path else name
        for path, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        for name, _ in m.named_buffers(recurse=False)
    }
    return [
        name
        for name, b in module.named_buffers()
        if name in versions and _version(b) != versions[name] and name not in batch_norm
    ]


def _version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s version counter (bumped by each in-place write), or None for an inference tensor, which has none
    (and cannot be written in place outside inference mode)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _rename_inputs(model: onnx.ModelProto, renames: dict[str, str]) -> None:
    graph = model.graph
    for value in graph.input:
        if value.name in renames:
            value.name = renames[value.name]
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]
    for value in graph.output:
        if value.name in renames:
            value.name = renames[value.name]


# Ops whose ORT gradient reads a second output that the exporter may leave out: Dropout's mask, the loss's
# log-probabilities.
_GRADIENT_NEEDS_SECOND_OUTPUT = {"Dropout": "_mask", "SoftmaxCrossEntropyLoss": "_log_prob"}


def _add_second_outputs(model: onnx.ModelProto) -> None:
    """Give those ops their second output (ORT's gradient builder reads it)."""
    for node in model.graph.node:
        suffix = _GRADIENT_NEEDS_SECOND_OUTPUT.get(node.op_type)
        if suffix and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            node.output.append(f"{node.output[0]}{suffix}")


def _add_batch_norm_outputs(model: onnx.ModelProto, module: torch.nn.Module) -> list[BatchNormStats]:
    """Expose the input of each training-mode BatchNormalization, from which torch's running statistics follow.

    ONNX's running variance is biased and its momentum semantics differ from torch's, so ortcore updates the
    buffers itself, exactly as ``torch.nn.functional.batch_norm`` does.
    """
    modules = dict(module.named_modules())
    found = []
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or len(node.input) < 4:
            continue
        training_mode = next((a.i for a in node.attribute if a.name == "training_mode"), 0)
        owner = modules.get(node.input[3].rpartition(".")[0])  # "bn.running_mean" -> module "bn"
        if not training_mode or not isinstance(owner, torch.nn.modules.batchnorm._BatchNorm):
            continue
        name = BN_INPUT_PREFIX + node.input[3].rpartition(".")[0]
        model.graph.node.append(onnx.helper.make_node("Identity", [node.input[0]], [name], name=name))
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
        path = node.input[3].rpartition(".")[0]
        found.append(BatchNormStats(owner, name, (node.input[3], node.input[4]), path))
    return found


def through_identities(producer: dict[str, onnx.NodeProto], value: str) -> str:
    """The value ``value`` copies: its producers' inputs followed back while they are Identity nodes."""
    node = producer.get(value)
    while node is not None and node.op_type == "Identity" and node.domain in ("", "ai.onnx"):
        value = node.input[0]
        node = producer.get(value)
    return value


def _expose_taps(model: onnx.ModelProto, n_user: int, names: list[str]) -> list[TapPoint]:
    """Give the activations the exporter wrote as outputs after the model's own their place in the graph.

    Each becomes ``Identity(value) -> ortcore.tap::<n>``, where ``value`` is the activation's value with the
    exporter's Identities looked through. Model outputs get an Identity of their own, so that every value a tap
    reads is an inner value: ORT gives a graph output that is also read inside the graph a gradient that is only
    the outside part, while the inner value's ``<value>_grad`` is the whole gradient, as torch's tensor hook sees.
    """
    graph = model.graph
    producer = {o: node for node in graph.node for o in node.output if o}
    extras = list(graph.output[n_user : n_user + len(names)])
    tapped = [through_identities(producer, o.name) for o in extras]
    # The exporter's types of those values: ORT cannot infer some ops' (ATen's) from their inputs.
    typed = {i.name for i in graph.value_info} | {i.name for i in graph.input}
    for info, value in zip(extras, tapped):
        if info.type.HasField("tensor_type") and info.name == value and value not in typed:
            graph.value_info.append(info)
            typed.add(value)
    types = {o.name: o.type for o in (*extras, *graph.value_info, *graph.input)}
    user = [o.name for o in graph.output[:n_user]]
    kept = list(graph.output[:n_user]) + list(graph.output[n_user + len(names) :])
    del graph.output[:]
    graph.output.extend(kept)
    inner: dict[str, str] = {}  # model output -> the inner value it now copies
    for name in user:
        node = producer.get(name)
        if node is None:
            continue  # a graph input passed through: nothing computes it
        value = f"{name}::value"
        node.output[list(node.output).index(name)] = value
        user_info = next(o for o in graph.output if o.name == name)
        if user_info.type.HasField("tensor_type"):
            info = graph.value_info.add()
            info.CopyFrom(user_info)
            info.name = value
            types[value] = user_info.type
        for consumer in graph.node:
            for i, x in enumerate(consumer.input):
                if x == name:
                    consumer.input[i] = value
        graph.node.append(onnx.helper.make_node("Identity", [value], [name], name=f"{name}::output"))
        inner[name] = value
    taps = []
    exposed: dict[str, str] = {}  # one output per value: activations several modules return are one tensor
    for name, value in zip(names, tapped):
        value = inner.get(value, value)
        if value not in exposed:
            output = exposed[value] = f"{TAP_OUTPUT_PREFIX}{len(exposed)}"
            graph.node.append(onnx.helper.make_node("Identity", [value], [output], name=output))
            info = graph.output.add()
            info.name = output
            if value in types:
                info.type.CopyFrom(types[value])
        taps.append(TapPoint(name, value, exposed[value]))
    return taps


def _is_stop_gradient(node: onnx.NodeProto) -> bool:
    return node.domain == STOP_GRADIENT_DOMAIN and node.op_type == STOP_GRADIENT


def _is_real_stop_gradient(node: onnx.NodeProto) -> bool:
    return node.domain == ATEN_DOMAIN and node.op_type == "ATen" and node.name.startswith(REAL_STOP_GRADIENT_PREFIX)


def _to_identity(node: onnx.NodeProto) -> None:
    node.op_type, node.domain = "Identity", ""


def _drop_unused_domain(model: onnx.ModelProto) -> None:
    if not any(n.domain == STOP_GRADIENT_DOMAIN for n in model.graph.node):
        kept = [o for o in model.opset_import if o.domain != STOP_GRADIENT_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)


# Inputs through which neither torch nor ONNX Runtime's gradient builder passes a gradient: indices, shapes, masks,
# counts, running statistics (ORT's STOP_GRADIENT_EDGES, less Pow's exponent and Clip's bounds, which torch
# differentiates and ORT does not).
_NON_DIFFERENTIABLE_INPUTS: dict[str, frozenset[int]] = {
    op: frozenset(edges)
    for op, edges in {
        "Not": {0}, "And": {0, 1}, "Or": {0, 1}, "Xor": {0, 1}, "Equal": {0, 1}, "Less": {0, 1},
        "LessOrEqual": {0, 1}, "Greater": {0, 1}, "GreaterOrEqual": {0, 1}, "IsInf": {0}, "IsNaN": {0},
        "NonZero": {0}, "Gather": {1}, "GatherElements": {1}, "GatherND": {1}, "Shape": {0}, "Size": {0},
        "Reshape": {1}, "Expand": {1}, "Dropout": {1, 2}, "Slice": {1, 2, 3, 4}, "SoftmaxCrossEntropyLoss": {1, 2},
        "ConstantOfShape": {0}, "Scatter": {1}, "ScatterElements": {1}, "ScatterND": {1}, "OneHot": {0, 1, 2},
        "Where": {0}, "Range": {0, 1, 2}, "Tile": {1}, "TopK": {1}, "Squeeze": {1}, "Unsqueeze": {1},
        "ReduceSum": {1}, "Split": {1}, "BatchNormalization": {3, 4}, "Pad": {1, 2},
    }.items()
}  # fmt: skip
_FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)


def _gradient_inputs(node: onnx.NodeProto) -> list[str]:
    """The inputs of ``node`` that a gradient of its outputs flows back to."""
    if _is_stop_gradient(node) or _is_real_stop_gradient(node):
        return []
    if node.domain in ("", "ai.onnx"):
        if node.op_type == "Cast" and next((a.i for a in node.attribute if a.name == "to"), 0) not in _FLOAT_TYPES:
            return []
        stopped = _NON_DIFFERENTIABLE_INPUTS.get(node.op_type, frozenset())
        return [x for i, x in enumerate(node.input) if x and i not in stopped]
    return [x for x in node.input if x]


def value_dependencies(
    model: onnx.ModelProto, values: list[str], sources: set[str] | None = None
) -> dict[str, set[str]]:
    """For each value, the ``sources`` (default: the graph inputs) its gradient flows back to: a reverse walk of the
    graph that does not cross a detach (the exporter's stop-gradient marker, or its ATen form) nor an index, shape or
    mask input. A source missing from a value's set gets no gradient from it, as in torch."""
    producer = {out: node for node in model.graph.node for out in node.output if out}
    inputs = {i.name for i in model.graph.input} if sources is None else set(sources)
    memo: dict[str, frozenset[str]] = {}
    for value in values:
        stack, order = [value], []
        while stack:  # iterative post-order: deep graphs would overflow Python's recursion limit
            v = stack.pop()
            if v in memo or v in order:
                continue
            order.append(v)
            if v in producer:
                stack.extend(i for i in _gradient_inputs(producer[v]) if i not in memo)
        for v in reversed(order):
            found = {v} & inputs
            for i in _gradient_inputs(producer[v]) if v in producer else ():
                found |= memo.get(i, frozenset({i}) & inputs)
            memo[v] = frozenset(found)
    return {v: set(memo[v]) for v in values}


@attrs.frozen
class StopGradientPlan:
    """How the detaches of an exported graph are run: the graph to build, the outputs that do not require grad, and
    the names to train (``train_names`` less those that get a gradient only through a detach: torch gives them
    none, and ONNX Runtime refuses to differentiate a value that no output depends on)."""

    model: onnx.ModelProto
    no_grad_outputs: set[str]
    train_names: list[str]
    real_stop_gradients: int  # detaches run as a real stop-gradient (ATen nodes)


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    graph = model.graph
    return {
        v.name: v.type.tensor_type.elem_type
        for v in (*graph.input, *graph.value_info, *graph.output)
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
    }


def _scope(node: onnx.NodeProto) -> str:
    module = ".".join(node.name.strip("/").split("/")[1:-1])
    return f"module {module}" if module else "the model's own forward"


def plan_stop_gradients(model: onnx.ModelProto, train_names: list[str], build_gradient: bool) -> StopGradientPlan:
    """Decide, for each detach the exporter marked, how ONNX Runtime runs it, with torch's gradients exactly.

    ORT has no stop-gradient op, but its gradient builder never differentiates an input that is registered as a
    stop-gradient edge of an ATen node. Each detach becomes

    * an ``Identity`` where that is exact, which needs nothing at run time:

      - its input carries no gradient (a constant, a shape, ``torch.tensor(h.size(-1))``, an integer);
      - nothing downstream of it requires grad (a detached output): torch gives those outputs no gradient, so ORT
        is fed zeros for them;
      - every name to train upstream of it gets no gradient from the outputs anyway (a frozen teacher's
        ``teacher(x).detach()``): ORT computes a gradient for them that torch would not, and ortcore hands torch
        None for a name that no output depends on (:func:`value_dependencies` stops at the detach);

    * otherwise (``y * y.detach()``, ``w.detach() * a + w * b``) a real stop-gradient: an
      ``org.pytorch.aten::ATen`` node running ``aten::detach_copy``, whose input is registered with ORT
      (``register_custom_stop_gradient_edges``) as one no gradient crosses. It is run by the process's ATen
      executor, which the ``aten_fallback`` plugin installs; without it the model is refused, naming the plugin.

    Names to train whose every path to the outputs goes through a real stop-gradient get no gradient in torch and
    are left out of ``train_names``.
    """
    train = set(train_names) if build_gradient else set()
    types = _elem_types(model)

    def differentiable(value: str) -> bool:
        return types.get(value, onnx.TensorProto.FLOAT) in _FLOAT_TYPES

    carries = set(train)  # values that require grad, as torch's requires_grad (detaches stop it)
    for node in model.graph.node:  # ONNX nodes are in topological order
        if any(i in carries for i in _gradient_inputs(node)):
            carries.update(o for o in node.output if o and differentiable(o))
    no_grad_outputs = {o.name for o in model.graph.output if o.name not in carries}
    detaches = [n for n in model.graph.node if _is_stop_gradient(n)]
    if not detaches:
        return StopGradientPlan(model, no_grad_outputs, list(train_names), 0)
    model = onnx.ModelProto.FromString(model.SerializeToString())
    detaches = [n for n in model.graph.node if _is_stop_gradient(n)]
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
        _to_real_stop_gradients(model, real, types)
    _drop_unused_domain(model)
    if real:
        # ORT refuses to differentiate a name no output reaches; torch gives it None.
        reached = set().union(*value_dependencies(model, [o.name for o in model.graph.output], train).values())
        train_names = [n for n in train_names if n in reached]
    return StopGradientPlan(model, no_grad_outputs, list(train_names), len(real))


def resolve_stop_gradients(
    model: onnx.ModelProto, train_names: list[str], build_gradient: bool
) -> tuple[onnx.ModelProto, set[str]]:
    """:func:`plan_stop_gradients` for callers that train every name of ``train_names``: its graph and the outputs
    that do not require grad. Refuses a model whose plan leaves a name to train out (see the plan)."""
    plan = plan_stop_gradients(model, train_names, build_gradient)
    left_out = [n for n in train_names if n not in plan.train_names] if build_gradient else []
    if left_out:
        raise UnsupportedModelError(
            f"{', '.join(left_out)} reach the outputs only through a detach() whose upstream also has values that "
            "need a gradient; ortcore cannot leave them out of the gradient graph yet"
        )
    return plan.model, plan.no_grad_outputs


from .domains import ATEN_DOMAIN  # noqa: E402

REAL_STOP_GRADIENT_PREFIX = "ortcore.stop_gradient::"
_DETACH_OPERATOR = ("detach_copy", "default")  # a copy: ORT must own the output, not alias its input
_registered_edges = False
_executor_seen = False


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
    import onnxruntime

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
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # the failure below is the answer, not an error to log
    try:
        session = onnxruntime.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
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


def update_batch_norm(stats: BatchNormStats, x: torch.Tensor) -> None:
    """Update running statistics and the batch counter the way PyTorch's batch_norm does in training."""
    bn = stats.module
    with torch.no_grad():
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)
        var = x.var(dims, unbiased=True)
        if bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
        factor = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        bn.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        bn.running_var.mul_(1 - factor).add_(var, alpha=factor)


def _log_constant_inputs(schema: InputSchema) -> None:
    """One INFO line per non-tensor input the graph bakes in: another value is another graph, so a string that changes
    every step exports every step. Worded as upstream's ORTModule logs it, which code written for it looks for."""
    if not logger.isEnabledFor(logging.INFO):
        return
    for constant in schema.template:
        if isinstance(constant, Constant):
            logger.info(
                "Received input of type %s is treated as a constant by ORT by default. (input %r: baked into the "
                "graph; another value gets a graph of its own)",
                type(constant.value),
                constant.name,
            )


def export_graph(
    module: torch.nn.Module,
    schema: InputSchema,
    tensors: list[torch.Tensor],
    *,
    exporter: Exporter,
    opset: int,
    log_level: LogLevel,
    deepcopy: bool,
    graph_passes: list[GraphPass] = (),
    config: Any = None,
    keep_raw: bool = False,
    tapper: Any = None,
) -> ExportedGraph:
    """Export ``module`` for the call described by ``schema`` and apply the core's post-export processing.

    ``tapper`` (a :class:`ortcore.taps.Tapper`) collects a subscribed model's activations while
    tracing; they become extra outputs (:attr:`ExportedGraph.taps`).
    """
    import time

    start = time.perf_counter()
    _log_constant_inputs(schema)
    training = module.training
    state_names = set(module.state_dict(keep_vars=True))
    user_names = [n if n not in state_names else f"input.{n}" for n in schema.names]
    with _preserved_state(module):
        target = copy.deepcopy(module) if deepcopy else module
        versions = {name: v for name, b in target.named_buffers() if (v := _version(b)) is not None}
        flat = _FlatModule(target, schema, tapper)
        flat.training = training  # not .train(): submodules keep their own modes (a frozen batch norm, say)
        example = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors)
        try:
            model = exporter.export(
                ExportRequest(
                    module=flat,
                    args=example,
                    input_names=user_names,
                    output_names=[],
                    dynamic_axes={n: {d: f"{n}_dim{d}" for d in range(t.dim())} for n, t in zip(user_names, tensors)},
                    training=training,
                    opset=opset,
                    log_level=log_level,
                )
            )
        except UnsupportedModelError as e:
            if isinstance(e, BufferWriteError):
                raise
            raise UnsupportedModelError(
                str(e).replace("_FlatModule", type(module).__name__), raised_in_forward=e.raised_in_forward
            ) from e.__cause__
        written = written_buffers(target, versions)
        if written:
            raise BufferWriteError(written, buffer_owners(written), exporter.name)
    output_schema = flat.output_schema
    raw_model = onnx.ModelProto.FromString(model.SerializeToString()) if keep_raw else None
    # Outputs get the user's names; parameters and buffers lose the wrapper's "module." prefix.
    renames = {f"module.{n}": n for n in state_names}
    graph_inputs = {i.name for i in model.graph.input}
    renames.update(
        {o.name: name for o, name in zip(model.graph.output, output_schema.names) if o.name not in graph_inputs}
    )
    _rename_inputs(model, renames)
    for node in model.graph.node:
        for i, name in enumerate(node.output):
            if name in renames:
                node.output[i] = renames[name]
    _add_second_outputs(model)
    n_user = len(output_schema.names)
    taps = _expose_taps(model, n_user, list(tapper.names)) if tapper is not None and tapper.names else []
    batch_norms = _add_batch_norm_outputs(model, module) if training else []
    context = PassContext(module=module, training=training, config=config)
    for graph_pass in graph_passes:
        graph_pass.run(model, context)
    graph = ExportedGraph(
        model=model,
        input_names=[i.name for i in model.graph.input],
        argument_names=schema.names,
        user_input_names=user_names,
        output_schema=output_schema,
        training=training,
        batch_norms=batch_norms,
        raw_model=raw_model,
        export_seconds=time.perf_counter() - start,
        taps=taps,
    )
    unknown = [n for n in graph.input_names if n not in state_names and n not in user_names]
    if unknown:
        raise UnsupportedModelError(f"exported graph has inputs that are neither arguments nor state: {unknown}")
    return graph


def input_ranges(model: onnx.ModelProto) -> dict[str, list[tuple[int, int, int | None]]]:
    """The sizes the graph's inputs may take (:data:`INPUT_RANGES_METADATA`), ``{}`` if the exporter wrote none."""
    text = next((p.value for p in model.metadata_props if p.key == INPUT_RANGES_METADATA), "")
    return {name: [tuple(r) for r in dims] for name, dims in json.loads(text).items()} if text else {}


def range_violations(
    ranges: dict[str, list[tuple[int, int, int | None]]], names: list[str], tensors: list[torch.Tensor]
) -> tuple:
    """``(name, dim, "below" | "above", low, high)`` for each input size outside ``ranges`` (:func:`input_ranges`);
    ``()`` if the call fits the graph."""
    if not ranges:
        return ()
    found = []
    for name, tensor in zip(names, tensors):
        for dim, low, high in ranges.get(name, ()):
            if dim >= tensor.dim():
                continue
            size = tensor.shape[dim]
            if size < low:
                found.append((name, dim, "below", low, high))
            elif high is not None and size > high:
                found.append((name, dim, "above", low, high))
    return tuple(found)
