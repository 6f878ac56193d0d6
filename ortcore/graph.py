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
from .errors import BufferWriteError, GraphBuildError, UnsupportedDataError, UnsupportedModelError, buffer_owners
from .exporter import Exporter, ExportRequest
from .graph_passes import GraphPass, PassContext
from .options import LogLevel
from .schema import Constant, InputSchema, OutputSchema, TensorConstant, flatten_outputs

logger = logging.getLogger("ortcore")

BN_INPUT_PREFIX = "ortcore.batch_norm_input::"
BUFFER_WRITE_PREFIX = "ortcore.buffer_write::"
TAP_OUTPUT_PREFIX = "ortcore.tap::"
# Metadata an exporter may write: the sizes each input dimension may take in the graph, JSON
# {input name: [[dim, low, high or null], ...]} (a dimension it fixed has low == high). The dynamo route writes it
# from torch.export's range constraints: a model that branches on a size (``if ids.shape[1] > 8``) gives a graph
# valid for some sizes only.
INPUT_RANGES_METADATA = "ortcore.input_ranges"
# A graph that holds a choice made for now only (a kernel choice not yet measured, or measured under load) carries
# this key, its value saying why: caches do not keep it, so the next process decides again.
PROVISIONAL_METADATA = "ortcore.provisional"
GRAPH_FORMAT = 2  # bump when ExportedGraph.to_bytes changes (2: JSON and ONNX bytes; 1 was a pickle)


class _FlatModule(torch.nn.Module):
    """The model seen as ``tensors -> tensors``, which is what exporters trace."""

    def __init__(self, module: torch.nn.Module, schema: InputSchema, tapper: Any = None):
        super().__init__()
        self.module = module
        self.schema = schema
        self.tapper = tapper  # collects a subscribed model's activations (ortcore.hooks), which become outputs too
        self.output_schema: OutputSchema | None = None
        self.written: list[str] = []  # the buffers the last call wrote in place, returned last (their new values)
        self.returned: dict[int, str] = {}  # model outputs (flat index) that are one of those buffers

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.tapper is not None:
            self.tapper.reset()
        args, kwargs = self.schema.rebuild(tensors)
        # The buffers as this call sees them: on the dynamo route the exporter substitutes its own tensors, whose
        # version counters move as the real ones would.
        skipped = _batch_norm_statistics(self.module)
        buffers = {n: b for n, b in self.module.named_buffers() if n not in skipped}
        versions = {n: v for n, b in buffers.items() if (v := _version(b)) is not None}
        self.output_schema, flat = flatten_outputs(self.module(*args, **kwargs))
        if not flat:
            raise UnsupportedDataError(f"{type(self.module).__name__}.forward returned no tensor; nothing to train")
        # A buffer written in place (an EMA, a counter, a codebook) is returned after everything else: the traced
        # value after the last write is the new value, which ortcore writes back after each run (BufferWrite).
        self.written = [n for n, v in versions.items() if _version(buffers[n]) != v]
        # Outputs that are a written buffer itself (``return out, self.count``): eager returns the buffer.
        self.returned = {k: n for k, t in enumerate(flat) for n in self.written if t is buffers[n]}
        taps = tuple(self.tapper.tensors) if self.tapper is not None else ()
        return tuple(flat) + taps + tuple(buffers[n] for n in self.written)


@attrs.define(eq=False)
class BatchNormStats:
    """A batch-norm module whose running statistics ortcore updates from the input ORT computed."""

    module: torch.nn.modules.batchnorm._BatchNorm
    output_name: str
    # ORT's training-mode kernel writes into its running-statistics inputs; these are fed as copies.
    buffer_names: tuple[str, str]
    module_path: str


@attrs.frozen
class BufferWrite:
    """A buffer the forward writes in place: graph output ``output`` (``ortcore.buffer_write::<buffer>``) holds its
    value after the forward, which ortcore copies into the buffer after each run, as PyTorch's forward leaves it."""

    buffer: str  # the buffer's name, as named_buffers gives it
    output: str
    # The model outputs (flat index) that are the buffer itself: the call returns the buffer there, as eager does.
    returned_as: tuple[int, ...] = ()


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
    from_cache: bool = False  # an export cache served it (ortcore_load_export): no export ran
    buffer_writes: list[BufferWrite] = attrs.Factory(list)  # buffers the forward writes in place, written back

    @property
    def buffer_write_outputs(self) -> list[int]:
        """The graph output index of each buffer write."""
        index = {o.name: i for i, o in enumerate(self.model.graph.output)}
        return [index[w.output] for w in self.buffer_writes]

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
            "buffer_writes": [
                {"buffer": w.buffer, "output": w.output, "returned_as": list(w.returned_as)} for w in self.buffer_writes
            ],
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
        buffers = dict(module.named_buffers())
        writes = []
        for entry in _records(state.get("buffer_writes", []), "buffer_writes", ("buffer", "output", "returned_as")):
            buffer, output = _strings([entry["buffer"], entry["output"]], "buffer_writes")
            returned = entry["returned_as"]
            if buffer not in buffers:
                raise ValueError(f"the model has no buffer {buffer!r}")
            if not isinstance(returned, list) or not all(isinstance(k, int) and k >= 0 for k in returned):
                raise ValueError(f"malformed buffer-write record {str(entry)[:80]!r}")
            writes.append(BufferWrite(buffer, output, tuple(returned)))
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
            buffer_writes=writes,
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


def _batch_norm_statistics(module: torch.nn.Module) -> set[str]:
    """The names of the batch norms' buffers (running statistics, batch counter), which ortcore updates itself."""
    return {
        f"{path}.{name}" if path else name
        for path, m in module.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        for name, _ in m.named_buffers(recurse=False)
    }


def written_buffers(module: torch.nn.Module, versions: dict[str, int]) -> list[str]:
    """The buffers of ``module`` whose version counter moved since ``versions`` was taken (written in place), less
    batch norm's running statistics, which ortcore updates itself (:class:`BatchNormStats`)."""
    batch_norm = _batch_norm_statistics(module)
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


def _constant_outputs(
    model: onnx.ModelProto, schema: OutputSchema, graph_inputs: set[str], tensors: list[torch.Tensor]
) -> OutputSchema:
    """Take the user outputs that are constants (``return out, torch.tensor(4096)``, a cache's maximum length in an
    HF model: the exporter makes them a ``Constant`` node or an initializer) out of the graph: ORT turns both into
    initializers, and its gradient builder refuses a graph output without a producer ("couldn't find the producer
    node"). Their values go into the returned schema (:class:`ortcore.schema.TensorConstant`), on the device of the
    call's tensors."""
    import onnx.numpy_helper

    values: dict[str, onnx.TensorProto] = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute:
            if node.attribute[0].name == "value":
                values[node.output[0]] = node.attribute[0].t
    device = str(tensors[0].device) if tensors else "cpu"
    constants: dict[int, TensorConstant] = {}
    outputs = list(model.graph.output)[: len(schema.names)]
    for k, output in enumerate(outputs):
        if output.name in values and output.name not in graph_inputs:
            value = torch.from_numpy(onnx.numpy_helper.to_array(values[output.name]).copy())
            constants[k] = TensorConstant(value, device=device)
    if not constants:
        return schema
    keep = [o for k, o in enumerate(model.graph.output) if k not in constants]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    # Their Constant nodes, now unread (ORT would warn of each as an unused initializer; drop_unread_initializers
    # removes the initializers).
    read = _read_names(model.graph, set()) | {o.name for o in keep}  # subgraphs (If/Loop bodies) read them too
    unread = [n for n in model.graph.node if n.op_type == "Constant" and not set(n.output) & read]
    for node in unread:
        model.graph.node.remove(node)
    logger.debug("outputs %s are constants: returned without ONNX Runtime", [schema.names[k] for k in constants])
    return schema.without_outputs(constants)


def _free_names(model: onnx.ModelProto, renames: dict[str, str]) -> None:
    """Rename the node outputs that already hold a name ``renames`` gives to another value: the dynamo route names
    values after their ops (``mean``, ``add``), and a buffer called ``mean`` would be defined twice."""
    graph = model.graph
    wanted = {new for old, new in renames.items() if old != new}
    clashes = {o for node in graph.node for o in node.output if o in wanted and o not in renames}
    if not clashes:
        return
    taken = {o for node in graph.node for o in node.output} | {i.name for i in graph.input} | wanted
    fresh = {}
    for name in sorted(clashes):
        k = 1
        while f"{name}.{k}" in taken:
            k += 1
        fresh[name] = f"{name}.{k}"
        taken.add(fresh[name])
    _rename_inputs(model, fresh)  # node inputs and graph outputs
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name in fresh:
                node.output[i] = fresh[name]
    for info in graph.value_info:
        if info.name in fresh:
            info.name = fresh[info.name]


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


def _take_buffer_writes(
    model: onnx.ModelProto, written: list[str], exporter: str, unchanged: set[str], module: torch.nn.Module
) -> list[tuple[str, onnx.ValueInfoProto]]:
    """Take the outputs holding the new values of the buffers ``written`` (the flat module returns them last) out of
    the graph's outputs, to be put back last (:func:`_add_buffer_write_outputs`), after the core's other outputs.

    A write the graph does not compute (the value after the forward is the buffer's own input: the exporter dropped
    the write, or it happened in code it did not trace) is refused, naming the buffers and their modules
    (:class:`BufferWriteError`): written back, the stale value would undo it. Less the buffers in ``unchanged``,
    whose traced write left the value as it was: nothing to write back.
    """
    if not written:
        return []
    graph = model.graph
    extras = list(graph.output[len(graph.output) - len(written) :])
    del graph.output[len(graph.output) - len(written) :]
    # Their types stay known (ORT cannot infer an ATen node's output types from its inputs).
    typed = {i.name for i in graph.value_info} | {i.name for i in graph.input} | {o.name for o in graph.output}
    for info in extras:
        if info.type.HasField("tensor_type") and info.name not in typed:
            graph.value_info.append(info)
            typed.add(info.name)
    producer = {o: node for node in graph.node for o in node.output if o}
    own = {n: through_identities(producer, info.name) == f"module.{n}" for n, info in zip(written, extras)}
    lost = [n for n in written if own[n] and n not in unchanged]
    if lost:
        raise BufferWriteError(lost, buffer_owners(lost), exporter)
    inputs = {i.name for i in graph.input}
    buffers = dict(module.named_buffers())
    # Each new value gets ``Identity(value) -> ortcore.buffer_write::<buffer>`` now, so that the renames to come
    # (arguments, state, user outputs: the value may be one) reach the node's input.
    taken = []
    for name, info in zip(written, extras):
        if own[name]:
            continue
        output = BUFFER_WRITE_PREFIX + name
        if _computed_from(producer, info.name, inputs) or buffers[name].dtype not in _ONNX_TYPES:
            graph.node.append(onnx.helper.make_node("Identity", [info.name], [output], name=output))
        else:
            # A value no input's data reaches (``fill_``, ``zero_``, a copy of a constant): ONNX Runtime would fold
            # it into an initializer and refuse it as a graph output ("couldn't find the producer node"). Chosen
            # against the buffer's own input under a false condition, it stays a node's output.
            source = f"module.{name}"
            if source not in inputs:
                buffer = buffers[name]
                graph.input.append(
                    onnx.helper.make_tensor_value_info(
                        source, _ONNX_TYPES[buffer.dtype], [int(d) for d in buffer.shape]
                    )
                )
                inputs.add(source)
            condition = f"{output}::keep"
            graph.node.append(
                onnx.helper.make_node(
                    "Constant",
                    [],
                    [condition],
                    name=condition,
                    value=onnx.helper.make_tensor(condition, onnx.TensorProto.BOOL, [], [False]),
                )
            )
            graph.node.append(onnx.helper.make_node("Where", [condition, source, info.name], [output], name=output))
        value = onnx.ValueInfoProto()
        value.CopyFrom(info)
        value.name = output
        taken.append((name, value))
    return taken


def _computed_from(producer: dict[str, onnx.NodeProto], value: str, inputs: set[str]) -> bool:
    """Whether the data of some graph input in ``inputs`` reaches ``value`` (not only its shape)."""
    seen, stack = set(), [value]
    while stack:
        name = stack.pop()
        if name in inputs:
            return True
        node = producer.get(name)
        if name in seen or node is None or node.op_type in ("Shape", "Size"):
            continue
        seen.add(name)
        stack.extend(n for n in node.input if n)
    return False


_ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float64: onnx.TensorProto.DOUBLE,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int64: onnx.TensorProto.INT64,
    torch.int32: onnx.TensorProto.INT32,
    torch.int16: onnx.TensorProto.INT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.uint8: onnx.TensorProto.UINT8,
    torch.bool: onnx.TensorProto.BOOL,
}


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaNs in the same places counting as equal."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def _add_buffer_write_outputs(
    model: onnx.ModelProto, written: list[tuple[str, onnx.ValueInfoProto]], returned: dict[int, str]
) -> list[BufferWrite]:
    """The new values of written buffers (:func:`_take_buffer_writes`) as the graph's last outputs, one each;
    ``returned`` maps the model outputs that are a written buffer to its name."""
    model.graph.output.extend(value for _, value in written)
    return [
        BufferWrite(name, value.name, tuple(sorted(k for k, n in returned.items() if n == name)))
        for name, value in written
    ]


def _returned_after_constants(returned: dict[int, str], names: list[str], kept: list[str]) -> dict[int, str]:
    """``returned`` (model output index -> buffer) re-indexed after :func:`_constant_outputs` took the constant
    outputs out of ``names`` (the outputs' names before), leaving ``kept`` in order (a constant is no buffer)."""
    if not returned or len(kept) == len(names):
        return returned
    index, j = {}, 0
    for k, name in enumerate(names):
        if j < len(kept) and kept[j] == name:
            index[k], j = j, j + 1
    return {index[k]: buffer for k, buffer in returned.items() if k in index}


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
    if _is_stop_gradient(node):
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
    graph that does not cross a detach (the exporter's stop-gradient marker) nor an index, shape or mask input. A
    source missing from a value's set gets no gradient from it, as in torch. It reads the exported graph, markers and
    all: to it, a lowered marker (an ATen stop-gradient) is an op like any other."""
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


def _differentiable(types: dict[str, int], value: str) -> bool:
    return types.get(value, onnx.TensorProto.FLOAT) in _FLOAT_TYPES


@attrs.define(eq=False)
class StopGradientLowering:
    """What ``ortcore_lower_stop_gradients`` receives: one forward graph about to be built, and the plan a plugin
    decides for its detach() markers (:meth:`decide`).

    ORT has no stop-gradient op, so each marker must become something its gradient builder knows before the build;
    how is a plugin's choice (gradient_fixes'). What requires grad (``requires_grad``, as torch's ``requires_grad``:
    detaches stop it) the core computes once, since a graph without markers needs it too: torch gives an output
    computed from nothing trained no gradient, and ortcore must treat that output the same way.
    """

    forward: onnx.ModelProto  # the exported graph, markers and all: decide on a copy, never edit it
    train_names: tuple[str, ...]  # the parameters and inputs asked to get a gradient
    build_gradient: bool  # False: an inference graph (every marker can go)
    requires_grad: frozenset[str]  # values that require grad; empty when no gradient graph is built
    types: dict[str, int] = attrs.Factory(dict)  # the element type of each value whose type the graph declares
    plan: StopGradientPlan | None = None  # the decision; None until a plugin decides
    refusal: UnsupportedModelError | None = None  # a plugin's reason this model cannot be built (:meth:`refuse`)

    @classmethod
    def of(cls, model: onnx.ModelProto, train_names: list[str], build_gradient: bool) -> StopGradientLowering:
        train = set(train_names) if build_gradient else set()
        types = _elem_types(model)
        carries = set(train)
        for node in model.graph.node:  # ONNX nodes are in topological order
            if any(i in carries for i in _gradient_inputs(node)):
                carries.update(o for o in node.output if o and _differentiable(types, o))
        return cls(model, tuple(train_names), build_gradient, frozenset(carries), types)

    @staticmethod
    def is_marker(node: onnx.NodeProto) -> bool:
        """Whether ``node`` is a stop-gradient marker (``STOP_GRADIENT`` in ``STOP_GRADIENT_DOMAIN``)."""
        return _is_stop_gradient(node)

    def differentiable(self, value: str) -> bool:
        """Whether ``value`` can carry a gradient (a floating-point type, or a type the graph does not declare)."""
        return _differentiable(self.types, value)

    @property
    def markers(self) -> list[onnx.NodeProto]:
        """The forward graph's stop-gradient markers."""
        return [n for n in self.forward.graph.node if _is_stop_gradient(n)]

    @property
    def no_grad_outputs(self) -> set[str]:
        """The forward graph's outputs that do not require grad."""
        return {o.name for o in self.forward.graph.output if o.name not in self.requires_grad}

    def decide(self, model: onnx.ModelProto, train_names: list[str], real_stop_gradients: int = 0) -> None:
        """The graph to build (no marker left in it) and the names to train in it; the outputs that do not require
        grad are the forward graph's, whatever became of the markers."""
        self.plan = StopGradientPlan(model, self.no_grad_outputs, list(train_names), real_stop_gradients)

    def refuse(self, error: UnsupportedModelError) -> None:
        """Refuse the model, which then falls back or fails as any unsupported model does (raised in a hook, the
        error would reach the user as the plugin's failure instead)."""
        self.refusal = error

    def result(self) -> StopGradientPlan:
        """The decision; for a graph without markers that no plugin decided on, the graph as it is. Markers left
        (no plugin lowered them) are a :class:`GraphBuildError` naming the plugin that does."""
        if self.refusal is not None:
            raise self.refusal
        plan = self.plan or StopGradientPlan(self.forward, self.no_grad_outputs, list(self.train_names), 0)
        left = [n.name or n.output[0] for n in plan.model.graph.node if _is_stop_gradient(n)]
        if left:
            raise GraphBuildError(
                f"the graph holds {len(left)} detach() marker(s) ({', '.join(left[:3])}) that no plugin lowered "
                "before ONNX Runtime's gradient build (hook ortcore_lower_stop_gradients): the essential "
                "gradient_fixes plugin does; a host composed without it cannot build a model that calls detach()"
            )
        return plan


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


def write_back_buffers(
    graph: ExportedGraph, values: list[torch.Tensor], buffers: dict[str, torch.Tensor], outputs: list[torch.Tensor]
) -> None:
    """Copy the new values ``values`` of the buffers the forward writes (``graph.buffer_writes``, in order) into the
    model's buffers ``buffers`` (by name), as PyTorch's forward leaves them; a model output that is such a buffer
    (``outputs``, the model's outputs, changed in place) becomes the buffer itself, as eager returns it."""
    for write in graph.buffer_writes:
        for k in write.returned_as:
            if not outputs[k].requires_grad:  # a buffer written with autograd on keeps ORT's differentiable value
                outputs[k] = buffers[write.buffer]
    with torch.no_grad():
        for write, value in zip(graph.buffer_writes, values):
            buffer = buffers[write.buffer]
            if value.shape != buffer.shape:
                raise UnsupportedModelError(
                    f"the forward's new value of buffer {write.buffer!r} has shape {list(value.shape)}, the buffer "
                    f"{list(buffer.shape)}: ortcore writes buffers back in place and cannot resize one"
                )
            buffer.copy_(value)


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
    dynamic_dims: dict[int, list[int]] | None = None,
) -> ExportedGraph:
    """Export ``module`` for the call described by ``schema`` and apply the core's post-export processing.

    ``dynamic_dims`` names, per tensor input (by position), the dimensions exported as dynamic; the others keep the
    call's sizes. None: every dimension is dynamic.

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
        initial = {name: b.detach().clone() for name, b in target.named_buffers()}
        request = ExportRequest(
            module=_FlatModule(target, schema, tapper),
            args=tuple(t.detach().requires_grad_(t.requires_grad) for t in tensors),
            input_names=user_names,
            output_names=[],
            dynamic_axes={
                n: {d: f"{n}_dim{d}" for d in dims}
                for i, (n, t) in enumerate(zip(user_names, tensors))
                if (dims := range(t.dim()) if dynamic_dims is None else dynamic_dims.get(i, ()))
            },
            training=training,
            opset=opset,
            log_level=log_level,
        )
        request.module.training = training  # not .train(): submodules keep their own modes (a frozen batch norm)
        model, versions = _export_flat(exporter, request, module)
        flat = request.module
        # A non-persistent buffer the forward writes must be a graph input, fed the value ortcore writes back; an
        # exporter that made it a constant (the TorchScript route does) exports again with it persistent, from the
        # state the first export started from.
        constant = [n for n in flat.written if n not in state_names and f"module.{n}" not in _input_names(model)]
        if constant:
            with torch.no_grad():
                for name, b in target.named_buffers():
                    b.copy_(initial[name])
            with _persistent(target, constant):
                model, versions = _export_flat(exporter, request, module)
        written_candidates = set(versions) - _batch_norm_statistics(target)
        before = {n: b for n, b in initial.items() if n in written_candidates}
        # Buffers whose values moved without their version counters (written through .data or numpy, which
        # nothing traces) or outside the call the flat module saw: the graph does not write them.
        moved = [n for n, b in target.named_buffers() if n in before and not _same_values(before[n], b)]
        in_place = written_buffers(target, versions)
        unseen = [n for n in dict.fromkeys(moved + in_place) if n not in flat.written and n in written_candidates]
        if unseen:
            raise BufferWriteError(unseen, buffer_owners(unseen), exporter.name)
        # A write the graph leaves at the buffer's own input is lost when the traced buffer moved, or when nothing
        # tells (the dynamo route traces substituted tensors); a traced write that left the value as it was
        # (``copy_`` of itself) needs nothing written back.
        unchanged = {n for n in in_place if n not in moved}
        written_values = _take_buffer_writes(model, flat.written, exporter.name, unchanged, target)
    output_schema = flat.output_schema
    raw_model = onnx.ModelProto.FromString(model.SerializeToString()) if keep_raw else None
    # Outputs get the user's names; parameters and buffers lose the wrapper's "module." prefix.
    # A non-persistent buffer the forward writes is fed like the others (a constant would never see its new value).
    state_names |= set(flat.written)
    renames = {f"module.{n}": n for n in state_names}
    graph_inputs = {i.name for i in model.graph.input}
    before_constants = [o.name for o in model.graph.output[: len(output_schema.names)]]
    output_schema = _constant_outputs(model, output_schema, graph_inputs, tensors)
    kept = [o.name for o in model.graph.output[: len(output_schema.names)]]
    returned = _returned_after_constants(flat.returned, before_constants, kept)
    renames.update(
        {o.name: name for o, name in zip(model.graph.output, output_schema.names) if o.name not in graph_inputs}
    )
    _free_names(model, renames)
    _rename_inputs(model, renames)
    for node in model.graph.node:
        for i, name in enumerate(node.output):
            if name in renames:
                node.output[i] = renames[name]
    _add_second_outputs(model)
    n_user = len(output_schema.names)
    taps = _expose_taps(model, n_user, list(tapper.names)) if tapper is not None and tapper.names else []
    batch_norms = _add_batch_norm_outputs(model, module) if training else []
    buffer_writes = _add_buffer_write_outputs(model, written_values, returned)
    context = PassContext(module=module, training=training, config=config)
    for graph_pass in graph_passes:
        graph_pass.run(model, context)
    drop_unread_initializers(model)
    graph = ExportedGraph(
        model=model,
        input_names=[i.name for i in model.graph.input],
        argument_names=schema.names,
        user_input_names=user_names,
        output_schema=output_schema,
        training=training,
        batch_norms=batch_norms,
        buffer_writes=buffer_writes,
        raw_model=raw_model,
        export_seconds=time.perf_counter() - start,
        taps=taps,
    )
    unknown = [n for n in graph.input_names if n not in state_names and n not in user_names]
    if unknown:
        raise UnsupportedModelError(f"exported graph has inputs that are neither arguments nor state: {unknown}")
    return graph


def _export_flat(exporter: Exporter, request: ExportRequest, module: torch.nn.Module) -> tuple[onnx.ModelProto, dict]:
    """``exporter.export(request)``, and the version counter of each buffer of the traced model before it."""
    target = request.module.module
    versions = {name: v for name, b in target.named_buffers() if (v := _version(b)) is not None}
    try:
        return exporter.export(request), versions
    except UnsupportedModelError as e:
        if isinstance(e, BufferWriteError):
            raise
        raise UnsupportedModelError(
            str(e).replace("_FlatModule", type(module).__name__), raised_in_forward=e.raised_in_forward
        ) from e.__cause__


def _input_names(model: onnx.ModelProto) -> set[str]:
    return {i.name for i in model.graph.input}


@contextlib.contextmanager
def _persistent(module: torch.nn.Module, names: list[str]) -> Iterator[None]:
    """The non-persistent buffers ``names`` of ``module`` are persistent meanwhile (in ``state_dict``, so the
    TorchScript exporter makes them graph inputs rather than constants)."""
    changed = []
    for name in names:
        path, _, attr = name.rpartition(".")
        owner = module.get_submodule(path)
        if attr in owner._non_persistent_buffers_set:
            owner._non_persistent_buffers_set.discard(attr)
            changed.append((owner, attr))
    try:
        yield
    finally:
        for owner, attr in changed:
            owner._non_persistent_buffers_set.add(attr)


def _read_names(graph: onnx.GraphProto, into: set[str]) -> set[str]:
    """Every value name a node of ``graph`` or of its subgraphs (If/Loop/Scan bodies) reads."""
    for node in graph.node:
        into.update(node.input)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _read_names(attribute.g, into)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _read_names(sub, into)
    return into


def drop_unread_initializers(model: onnx.ModelProto) -> int:
    """Remove the initializers no node reads and no graph output names: graph passes leave some behind (the dynamo
    route's constants, once a pass replaced their reader), and ONNX Runtime warns about each when it loads the graph.
    Returns how many were removed."""
    graph = model.graph
    # An initializer that is also a graph input (older IR versions) stays: the input would otherwise need a feed.
    read = _read_names(graph, set()) | {o.name for o in graph.output} | {i.name for i in graph.input}
    kept = [t for t in graph.initializer if t.name in read]
    removed = len(graph.initializer) - len(kept)
    if removed:
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return removed


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
