"""runtime_inspector: per-step input density and memory statistics, printed as small tables.

Two switches, both off by default (when both are off the plugin contributes no inspector and inspects no graph)::

    [plugins.runtime_inspector]
    print_input_density = true   # env ORTMODULE_PRINT_INPUT_DENSITY=1
    print_memory_stats = true    # env ORTMODULE_PRINT_MEMORY_STATS=1
    all_steps = false            # print every step, not only steps 0-9 and then powers of two

**Input density.** When a session is built, the graph ORT runs is searched for the tensors whose padding matters:
the indices gathered by an embedding (an ONNX ``Gather`` of a parameter, or an ATen ``embedding`` node) and the
labels read by a cross-entropy loss (``SoftmaxCrossEntropyLoss``, ``SoftmaxCrossEntropyLossInternal``,
``NegativeLogLikelihoodLoss``, ATen ``cross_entropy`` and ``nll_loss``). Each is traced back to the user inputs it is computed from; when it is not a user
input itself (GPT-2 shifts and reshapes its labels), that slice of the graph is cut out and run on its own, so the
density is that of the very tensor the embedding or the loss consumes. Density = share of values that are not the
embedding's ``padding_idx`` (read from the ``nn.Embedding`` that owns the weight) or not the loss's
``ignore_index``.

**Memory statistics.** Memory at each phase of a step (pre/post forward, pre/post backward), one table per step:
the process's resident set size and its peak on any device (ORT's CPU arena and torch's CPU tensors both live
there; ONNX Runtime 1.19.2's Python bindings expose no allocator statistics), and on CUDA also torch's allocator
(allocated, reserved, their peaks) and the device's used memory, which includes ORT's own CUDA arena.

Tables are logged at INFO on the logger ``ortcore.runtime_inspector``; switching an option on enables that logger
at INFO, so the tables appear at the default log level too, with or without a terminal.
"""

from __future__ import annotations

import logging
import resource
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import onnx
import onnxruntime
import psutil
import torch
from onnx import numpy_helper

from ortcore.api import ForwardInputs, RuntimeInspector, format_table, hookimpl, option, parse_bool, probe_session

NAME = "runtime_inspector"

logger = logging.getLogger("ortcore.runtime_inspector")

MIB = float(1 << 20)
LABEL_LOSSES = {
    ("", "SoftmaxCrossEntropyLoss"),
    ("com.microsoft", "SoftmaxCrossEntropyLossInternal"),
    ("", "NegativeLogLikelihoodLoss"),
}
# ATen losses (as exported when losses run on torch's kernels): (self, target, weight, reduction, ignore_index, ...).
ATEN_LABEL_LOSSES = {"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"}


@attrs.frozen
class RuntimeInspectorOptions:
    """Options of ``[plugins.runtime_inspector]``; each has an ``ORTMODULE_*`` twin as upstream had."""

    print_input_density: bool = option(
        False,
        parse_bool,
        "log, per step, the share of non-padding values fed to embeddings and of non-ignored labels fed to losses",
        env="ORTMODULE_PRINT_INPUT_DENSITY",
    )
    print_memory_stats: bool = option(
        False,
        parse_bool,
        "log, per step, memory before and after forward and backward (process RSS; torch.cuda on CUDA)",
        env="ORTMODULE_PRINT_MEMORY_STATS",
    )
    all_steps: bool = option(False, parse_bool, "log every step, not only steps 0-9 and then powers of two")


def _options(config: Any) -> RuntimeInspectorOptions:
    return config.plugin_options(NAME) or RuntimeInspectorOptions()


def should_log(step: int, all_steps: bool) -> bool:
    """Steps 0-9, then powers of two (as upstream's memory observer did), or every step."""
    return all_steps or step < 10 or (step & (step - 1)) == 0


def _rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _enable_logger() -> None:
    # The user asked for these tables explicitly: show them even when ortcore's log level is WARNING.
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


# -- input density: finding what embeddings and losses consume -----------------------------------------------------


@attrs.frozen
class DensitySource:
    """One tensor whose padding matters: what consumes it, the padding value, and how to compute it."""

    tensor: str  # the graph tensor the embedding or loss reads
    kind: str  # "embedding" or "label"
    consumer: str  # the embedding weight's name, or the loss node's op type
    inputs: tuple[str, ...]  # the user inputs it is computed from
    pad_value: int | None  # ignore_index, or an ATen embedding's padding_idx; None: ask the module (embeddings)
    weight: str | None = None  # embeddings: the weight parameter, to find its nn.Embedding's padding_idx


@attrs.define(eq=False)
class DensityProbe:
    """The density sources of one built graph, and a small ORT session that computes the derived ones."""

    user_inputs: tuple[str, ...]
    parameters: dict[str, tuple[int, ...] | None]  # graph inputs that are not user inputs, with static shapes
    sources: list[DensitySource]
    derived: list[str]  # tensors computed by ``session`` (the others are user inputs themselves)
    session: onnxruntime.InferenceSession | None = None
    session_inputs: tuple[str, ...] = ()

    def values(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The tensors each source consumes, for this step's inputs."""
        values: dict[str, Any] = {t: tensors[t] for t in {s.tensor for s in self.sources} if t in tensors}
        if self.session is not None:
            feeds = {name: tensors[name].detach().cpu().numpy() for name in self.session_inputs}
            values.update(zip(self.derived, self.session.run(self.derived, feeds)))
        return values


def _constant_int(model: onnx.ModelProto, name: str) -> int | None:
    """The integer value of an initializer or Constant node output, or None."""
    for init in model.graph.initializer:
        if init.name == name:
            array = numpy_helper.to_array(init)
            return int(array.reshape(-1)[0]) if array.size == 1 else None
    for node in model.graph.node:
        if node.op_type == "Constant" and name in node.output:
            for attr in node.attribute:
                if attr.name == "value":
                    array = numpy_helper.to_array(attr.t)
                    return int(array.reshape(-1)[0]) if array.size == 1 else None
                if attr.name == "value_int":
                    return int(attr.i)
    return None


def _attribute(node: onnx.NodeProto, name: str) -> Any:
    for attr in node.attribute:
        if attr.name == name:
            return onnx.helper.get_attribute_value(attr)
    return None


def _aten_name(node: onnx.NodeProto) -> str:
    """An ATen node's operator without its namespace (``ortcore_aten::cross_entropy`` -> ``cross_entropy``)."""
    name = _attribute(node, "operator")
    name = name.decode() if isinstance(name, bytes) else str(name or "")
    return name.rsplit("::", 1)[-1]


def find_sources(
    model: onnx.ModelProto, user_inputs: Sequence[str]
) -> list[tuple[str, str, str, int | None, str | None]]:
    """``(tensor, kind, consumer, pad_value, weight)`` for each embedding index and loss label tensor in ``model``."""
    graph_inputs = {i.name for i in model.graph.input}
    parameters = graph_inputs - set(user_inputs)
    # With label sparsity (sparse_optimizer), ORT's InsertGatherBeforeSceLoss feeds the loss only the valid labels
    # through a ShrunkenGather: the density that matters is that of the labels before it.
    gathered = {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.domain == "com.microsoft" and n.op_type == "ShrunkenGather"
    }
    found: dict[tuple[str, str], tuple[str, str, str, int | None, str | None]] = {}
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type == "Gather" and node.input[0] in parameters:
            found.setdefault(
                (node.input[1], node.input[0]), (node.input[1], "embedding", node.input[0], None, node.input[0])
            )
        elif node.op_type == "ATen" and _aten_name(node) == "embedding":
            padding = _constant_int(model, node.input[2]) if len(node.input) > 2 and node.input[2] else None
            pad = padding if padding is not None and padding >= 0 else None
            found.setdefault(
                (node.input[1], node.input[0]), (node.input[1], "embedding", node.input[0], pad, node.input[0])
            )
        elif node.op_type == "ATen" and _aten_name(node) in ATEN_LABEL_LOSSES and len(node.input) > 1:
            ignore = _constant_int(model, node.input[4]) if len(node.input) > 4 and node.input[4] else None
            found.setdefault(
                (node.input[1], _aten_name(node)), (node.input[1], "label", _aten_name(node), ignore, None)
            )
        elif (node.domain if node.domain != "ai.onnx" else "", node.op_type) in LABEL_LOSSES and len(node.input) > 1:
            ignore = _attribute(node, "ignore_index")
            if ignore is None and node.op_type.endswith("Internal") and len(node.input) > 3 and node.input[3]:
                ignore = _constant_int(model, node.input[3])
            labels = gathered.get(node.input[1], node.input[1])
            found.setdefault((labels, node.op_type), (labels, "label", node.op_type, ignore, None))
    return list(found.values())


def _trace(model: onnx.ModelProto, tensor: str, user_inputs: set[str]) -> tuple[list[onnx.NodeProto], set[str]] | None:
    """The nodes computing ``tensor`` from user inputs and constants, and the user inputs reached.

    None when the tensor depends on a parameter or on a node with subgraphs (those cannot be cut out cheaply).
    """
    producers = {out: node for node in model.graph.node for out in node.output}
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = {i.name for i in model.graph.input}
    nodes: dict[int, onnx.NodeProto] = {}
    reached: set[str] = set()
    stack, seen = [tensor], set()
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in user_inputs:
            reached.add(name)
        elif name in initializers:
            continue
        elif name in graph_inputs or name not in producers:
            return None
        else:
            node = producers[name]
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                return None
            nodes[id(node)] = node
            stack.extend(node.input)
    ordered = [n for n in model.graph.node if id(n) in nodes]  # the graph's own topological order
    return ordered, reached


def build_probe(model: onnx.ModelProto, user_inputs: Sequence[str]) -> DensityProbe:
    """Find the density sources of a built graph and cut out the nodes that compute the derived ones."""
    user = set(user_inputs)
    sources: list[DensitySource] = []
    nodes: dict[int, onnx.NodeProto] = {}
    derived: list[str] = []
    needed_inputs: set[str] = set()
    for tensor, kind, consumer, pad, weight in find_sources(model, user_inputs):
        traced = _trace(model, tensor, user)
        if traced is None or not traced[1]:
            logger.debug("input density: %s %s is not computed from user inputs only; not reported", kind, consumer)
            continue
        path, reached = traced
        if path and tensor not in derived:
            derived.append(tensor)
            nodes.update((id(n), n) for n in path)
            needed_inputs |= reached
        sources.append(DensitySource(tensor, kind, consumer, tuple(sorted(reached)), pad, weight))
    shapes: dict[str, tuple[int, ...] | None] = {}
    for value in model.graph.input:
        if value.name not in user:
            dims = value.type.tensor_type.shape.dim
            static = all(d.HasField("dim_value") for d in dims)
            shapes[value.name] = tuple(d.dim_value for d in dims) if static else None
    probe = DensityProbe(tuple(user_inputs), shapes, sources, derived)
    if derived:
        probe.session_inputs = tuple(n for n in user_inputs if n in needed_inputs)
        probe.session = _probe_session(
            model, [n for n in model.graph.node if id(n) in nodes], probe.session_inputs, derived
        )
    return probe


def _probe_session(
    model: onnx.ModelProto, nodes: list[onnx.NodeProto], inputs: Sequence[str], outputs: Sequence[str]
) -> onnxruntime.InferenceSession:
    used = {name for n in nodes for name in n.input}
    graph = onnx.helper.make_graph(
        nodes,
        "ortcore_input_density",
        [v for v in model.graph.input if v.name in inputs],
        [onnx.ValueInfoProto(name=name) for name in outputs],  # ORT infers their types
        [i for i in model.graph.initializer if i.name in used],
    )
    sub = onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    # A few integer ops per step: threads would cost more than they save.
    return probe_session(sub, "runtime_inspector input density", threads=1)


# The probe of each built graph, by the session that runs it; a session going away takes its probe with it.
PROBES: weakref.WeakKeyDictionary[Any, DensityProbe] = weakref.WeakKeyDictionary()


def _padding_idx(module: torch.nn.Module, weight: str) -> int | None:
    """The padding_idx of the nn.Embedding (or subclass) that owns parameter ``weight``, if any."""
    path = weight.rsplit(".", 1)[0] if "." in weight else ""
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return None
    padding = getattr(owner, "padding_idx", None)
    return int(padding) if isinstance(padding, int) else None


class InputDensityInspector(RuntimeInspector):
    """Logs, per training step, the density of the tensors that embeddings and losses consume."""

    def __init__(self, module: torch.nn.Module, all_steps: bool):
        self.module = module
        self.all_steps = all_steps
        self._warned = False

    def pre_forward(self, step: int, inputs: ForwardInputs) -> None:
        if not (self.module.training and torch.is_grad_enabled()) or not should_log(step, self.all_steps):
            return
        if _rank()[0] != 0:
            return
        probe = PROBES.get(inputs.session) if inputs.session is not None else None
        rows = self.measure(probe, inputs.tensors) if probe is not None else []
        if not rows:
            if not self._warned:
                self._warned = True
                logger.info(
                    "input density: no embedding with a padding_idx and no loss with labels found in %s's graph",
                    type(self.module).__name__,
                )
            return
        table = format_table(
            ("input", "consumer", "pad", "density", "valid/total"),
            [
                (
                    ",".join(r["inputs"]),
                    r["source"],
                    r["pad"],
                    f"{r['density']:.3f}",
                    f"{r['valid']}/{r['total']}",
                )
                for r in rows
            ],
        )
        logger.info("input density at step %d (share of values that are not padding / ignore_index):\n%s", step, table)

    def measure(self, probe: DensityProbe, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        """One row per source: its consumer, padding value, valid and total counts, density."""
        values = probe.values(tensors)
        rows = []
        for source in probe.sources:
            pad = source.pad_value
            if source.kind == "embedding" and pad is None and source.weight is not None:
                pad = _padding_idx(self.module, source.weight)
                if pad is None:
                    continue  # an embedding without padding is always dense: nothing to report
            value = values.get(source.tensor)
            if value is None:
                continue
            total = int(value.numel() if isinstance(value, torch.Tensor) else value.size)
            if pad is None:
                valid = total
            elif isinstance(value, torch.Tensor):
                valid = int(torch.count_nonzero(value != pad).item())
            else:
                valid = int(np.count_nonzero(value != pad))
            label = f"embedding {source.consumer}" if source.kind == "embedding" else f"labels of {source.consumer}"
            rows.append(
                {
                    "source": label,
                    "inputs": source.inputs,
                    "pad": "-" if pad is None else pad,
                    "valid": valid,
                    "total": total,
                    "density": valid / total if total else 1.0,
                }
            )
        return rows


# -- memory statistics ---------------------------------------------------------------------------------------------


def _peak_rss() -> int:
    """The process's peak resident set size in bytes (never reset: the peak since the process started)."""
    info = psutil.Process().memory_info()
    if hasattr(info, "peak_wset"):  # Windows
        return int(info.peak_wset)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


@attrs.frozen
class MemorySample:
    """Memory at one phase of a step, in bytes."""

    phase: str
    rss: int
    peak_rss: int
    cuda: dict[str, int] | None = None


def sample_memory(phase: str, device: torch.device | None) -> MemorySample:
    """Process memory, and torch's CUDA allocator and the device's used memory on a CUDA device."""
    process = psutil.Process()
    cuda = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        cuda = {
            "allocated": torch.cuda.memory_allocated(device),
            "max allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "max reserved": torch.cuda.max_memory_reserved(device),
            "inactive": int(stats.get("inactive_split_bytes.all.current", 0)),
            # Everything on the device, ORT's own CUDA arena included (torch's numbers do not see it).
            "device used": total - free,
        }
    return MemorySample(phase, process.memory_info().rss, _peak_rss(), cuda)


class MemoryStatsInspector(RuntimeInspector):
    """Samples memory at each phase and logs one table per step (after backward, or after a no-grad forward).

    Training steps are numbered by ``step``; forwards without gradient (evaluation) have their own count, so an
    evaluation loop is throttled like training (first ten, then powers of two) instead of flooding the log.
    """

    def __init__(self, module: torch.nn.Module, all_steps: bool, sample: Callable[..., MemorySample] = sample_memory):
        self.module = module
        self.all_steps = all_steps
        self.sample = sample
        self._samples: list[MemorySample] = []
        self._label = ""
        self._no_grad_forwards = 0
        self._device: torch.device | None = None

    def _first_call(self, inputs: ForwardInputs) -> None:
        tensors = [*inputs.tensors.values(), *self.module.parameters()]
        self._device = tensors[0].device if tensors else torch.device("cpu")
        if self._device.type == "cuda":
            # Peaks from before the first step (loading the model) would hide the training peak, as upstream noted.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self._device)

    def pre_forward(self, step: int, inputs: ForwardInputs) -> None:
        self._flush(" (no backward)")  # the previous forward's backward never came
        if self._device is None:
            self._first_call(inputs)
        if torch.is_grad_enabled():
            number, self._label = step, f"step {step}"
        else:
            number, self._label = self._no_grad_forwards, f"forward {self._no_grad_forwards} without gradient"
            self._no_grad_forwards += 1
        # Steps that will not be logged are not sampled either.
        active = _rank()[0] == 0 and should_log(number, self.all_steps)
        self._samples = [self.sample("pre_forward", self._device)] if active else []

    def post_forward(self, step: int, outputs: list[Any]) -> None:
        if self._samples:
            self._samples.append(self.sample("post_forward", self._device))
            if not any(isinstance(o, torch.Tensor) and o.requires_grad for o in outputs):
                self._flush()

    def pre_backward(self, step: int) -> None:
        if self._samples:
            self._samples.append(self.sample("pre_backward", self._device))

    def post_backward(self, step: int) -> None:
        if self._samples:
            self._samples.append(self.sample("post_backward", self._device))
            self._flush()

    def _flush(self, note: str = "") -> None:
        samples, self._samples = self._samples, []
        if samples:
            logger.info("memory at %s%s (MiB):\n%s", self._label, note, self.format(samples))

    def format(self, samples: list[MemorySample]) -> str:
        """The table: one row per phase; module sizes and, on CUDA, torch's allocator in extra columns."""
        header = ["phase", "rss", "peak rss", "rss delta"]
        cuda_keys = list(samples[0].cuda) if samples[0].cuda else []
        header += cuda_keys
        rows = []
        previous = samples[0].rss
        for s in samples:
            # The kernel's peak lags the current RSS by a few pages of accounting: never show a peak below it.
            peak = max(s.peak_rss, s.rss)
            row = [s.phase, f"{s.rss / MIB:.1f}", f"{peak / MIB:.1f}", f"{(s.rss - previous) / MIB:+.1f}"]
            row += [f"{s.cuda[k] / MIB:.1f}" for k in cuda_keys] if s.cuda else []
            rows.append(row)
            previous = s.rss
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.module.parameters() if p.grad is not None)
        buffers = sum(b.numel() * b.element_size() for b in self.module.buffers())
        rank, world = _rank()
        where = f" [rank {rank}/{world}]" if world > 1 else ""
        return (
            format_table(header, rows)
            + f"\n  parameters {params / MIB:.1f}, gradients {grads / MIB:.1f}, buffers {buffers / MIB:.1f}{where}"
        )


# -- hooks -----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return RuntimeInspectorOptions


@hookimpl
def ortcore_session_created(config: Any, session: Any) -> None:
    if not _options(config).print_input_density:
        return
    try:
        PROBES[session] = build_probe(session.model, list(session.request.user_input_names))
    except Exception as e:  # a graph the probe cannot cut out must never stop training: report and go on
        logger.warning("input density: could not analyse the %s graph: %s: %s", session.kind, type(e).__name__, e)


@hookimpl
def ortcore_runtime_inspectors(config: Any, module: torch.nn.Module) -> list[RuntimeInspector]:
    options = _options(config)
    inspectors: list[RuntimeInspector] = []
    if options.print_input_density:
        inspectors.append(InputDensityInspector(module, options.all_steps))
    if options.print_memory_stats:
        inspectors.append(MemoryStatsInspector(module, options.all_steps))
    if inspectors:
        _enable_logger()
    return inspectors
