"""ONNX Runtime side: build the gradient (or inference) graph, create the session, run forward and backward.

Tensors cross into ORT and back by DLPack, never copied: parameters are fed by reference each step, so in-place
optimizer updates are seen without re-export, and ORT's outputs become torch tensors that share ORT's buffers
(the DLPack capsule keeps the underlying OrtValue alive).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import onnx
import onnxruntime
import torch
import torch.utils.dlpack
from onnxruntime.capi import _pybind_state as C

from .errors import GraphBuildError, PluginError, UnsupportedModelError
from .graph import (
    BN_INPUT_PREFIX,
    BUFFER_WRITE_PREFIX,
    StopGradientLowering,
    through_identities,
    value_dependencies,
)
from .options import LogLevel, write_executed_graph
from .output_integrity import outputs_at_risk

logger = logging.getLogger("ortcore")

_SEVERITY = {0: C.Severity.VERBOSE, 1: C.Severity.INFO, 2: C.Severity.WARNING, 3: C.Severity.ERROR, 4: C.Severity.FATAL}


def explain_ort_error(error: Exception) -> str:
    """ORT's message without the C++ location and signature, plus the module that owns the failing node."""
    original = text = str(error).strip()
    for marker in ("was false.", "] : "):
        if marker in text and text.rsplit(marker, 1)[1].strip():
            text = text.rsplit(marker, 1)[1]
    text = re.sub(r"^\d+ : \w+ : ", "", text.strip()) or original
    node = re.search(r"node (/\S+)", text)
    if node:
        text += module_of(node.group(1))
    return text


def module_of(node_name: str) -> str:
    """`` (in module encoder.layer.0)`` for the exporter's node name ``/module/encoder/layer.0/Det``."""
    scope = node_name.strip("/").split("/")[1:-1]
    return f" (in module {'.'.join(scope) or 'the model itself'})"


def _ort_device(device: torch.device) -> C.OrtDevice:
    if device.type == "cuda":
        return C.OrtDevice(C.OrtDevice.cuda(), C.OrtDevice.default_memory(), device.index or 0)
    return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


def default_providers(device: torch.device) -> list[tuple[str, dict[str, str]]]:
    """The execution providers of a session on ``device``, first preferred, with their options."""
    if device.type == "cuda":
        return [("CUDAExecutionProvider", {"device_id": str(device.index or 0)}), ("CPUExecutionProvider", {})]
    return [("CPUExecutionProvider", {})]


def to_ort(vector: C.OrtValueVector, tensor: torch.Tensor) -> None:
    """Append a tensor to an OrtValueVector without copying (bool travels as uint8 with a flag)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.dtype == torch.bool:
        vector.push_back(torch.utils.dlpack.to_dlpack(tensor.to(torch.uint8)), True)
    else:
        vector.push_back(torch.utils.dlpack.to_dlpack(tensor), False)


def from_ort(vector: C.OrtValueVector) -> list[torch.Tensor]:
    tensors = vector.to_dlpacks(torch._C._from_dlpack)
    for i in vector.bool_tensor_indices():
        tensors[i] = tensors[i].to(torch.bool)
    return tensors


@attrs.define
class BuildRequest:
    """What the gradient builder needs beyond the model: which inputs exist and which need gradients."""

    model: onnx.ModelProto
    input_names: list[str]  # every graph input: user inputs, parameters, buffers
    user_input_names: list[str]
    train_names: list[str]  # parameters and user inputs that need a gradient
    build_gradient: bool
    device: torch.device
    log_level: LogLevel
    transformer_config: object = None  # a C.TrainingGraphTransformerConfiguration, filled by plugins
    taps: list[tuple[str, str]] = attrs.Factory(list)  # (value, graph output exposing it) per tapped activation


@attrs.define(eq=False)
class BuiltGraph:
    """The graph ONNX Runtime's builder made for one :class:`BuildRequest`, before the session exists.

    Gradient-graph passes (``ortcore_gradient_graph_passes``) edit ``model`` in place and declare what the core must
    know of their edits (:meth:`hand_over_gradient`). ``purpose`` is ``"train"`` (the session steps run on) or
    ``"audit"`` (the gradient audit's session: passes that change how gradients reach torch leave it alone).
    """

    model: onnx.ModelProto
    request: BuildRequest
    purpose: str
    graph_info: Any
    user_output_names: list[str]
    non_differentiable: set[int]  # output indices ORT gives no gradient input
    torch_non_differentiable: set[int]  # what torch must treat as non-differentiable (also detached outputs)
    full_shape_grad: set[int]
    save_for_backward: list[int]
    output_feeds: list[frozenset[int]] = attrs.Factory(list)  # per output: the feed indices it depends on
    tap_gradients: list[int | None] = attrs.Factory(list)  # per tap: fetch index of its gradient, or None
    tap_outputs: list[frozenset[int]] = attrs.Factory(list)  # per tap: the model outputs its value reaches
    grads_handed_over: set[int] = attrs.Factory(set)
    # What passes recorded about their edits, by plugin name; read-only on the session (``session.notes``).
    notes: dict[str, Any] = attrs.Factory(dict)

    @property
    def kind(self) -> str:
        return "training" if self.request.build_gradient else "inference"

    @property
    def feed_names(self) -> list[str]:
        return [i.name for i in self.model.graph.input]

    def hand_over_gradient(self, feed_index: int) -> None:
        """Declare that a pass hands this feed's gradient to torch itself during ORT's backward: the core feeds the
        tensor detached and its backward returns None for it, so torch does not accumulate it twice."""
        self.grads_handed_over.add(feed_index)


def build_graph(
    request: BuildRequest, purpose: str = "train", lower_stop_gradients: Callable[[Any], None] | None = None
) -> BuiltGraph:
    """Run ONNX Runtime's gradient builder (or forward builder) on ``request.model``, plus the core's own edits of
    the result (activation taps). ``lower_stop_gradients`` (the hooks' ``ortcore_lower_stop_gradients``) first
    decides how the graph's detach() markers run; a graph that holds none needs no plugin for it."""
    try:
        return _GraphBuild(request, purpose, lower_stop_gradients).built
    except (GraphBuildError, UnsupportedModelError, PluginError):
        raise
    except Exception as e:  # pybind raises RuntimeError/Fail/InvalidGraph...: all mean "ORT cannot build this"
        kind = "training" if request.build_gradient else "inference"
        raise GraphBuildError(f"ONNX Runtime could not build the {kind} graph: {explain_ort_error(e)}") from e


# ORT's gradient builder on a name to train that no output depends on through ops with a gradient.
_UNREACHABLE = re.compile(r"Cannot compute the partial derivative for '([^']+)' as it's unreachable")


class _GraphBuild:
    """One run of ORT's graph builder and the core's edits of what it made."""

    def __init__(self, r: BuildRequest, purpose: str, lower_stop_gradients: Callable[[Any], None] | None):
        lowering = StopGradientLowering.of(r.model, r.train_names, r.build_gradient)
        if lower_stop_gradients is not None:
            lower_stop_gradients(lowering)
        plan = lowering.result()
        model, no_grad_outputs, train_names = plan.model, plan.no_grad_outputs, plan.train_names
        if r.build_gradient:
            _refuse_differentiated_control_flow(model)
        train_names = list(train_names)
        serialized = model.SerializeToString()  # once, however many builds the loop below needs
        while True:
            cfg = C.OrtModuleGraphBuilderConfiguration()
            cfg.initializer_names = list(r.input_names)
            cfg.initializer_names_to_train = list(train_names)
            cfg.input_names_require_grad = [n for n in r.user_input_names if n in set(train_names)]
            cfg.build_gradient_graph = r.build_gradient
            cfg.enable_caching = False
            cfg.use_memory_efficient_gradient = False
            cfg.loglevel = _SEVERITY[r.log_level.ort_severity]
            builder = C.OrtModuleGraphBuilder()
            builder.initialize(serialized, cfg)
            try:
                builder.build(r.transformer_config or C.TrainingGraphTransformerConfiguration())
                break
            except Exception as e:  # noqa: BLE001 (pybind's error types)
                # A name whose every path to the outputs crosses an op without a gradient (argmax, a comparison, an
                # index): torch gives it no gradient (None), ORT refuses to build. Build without it, as torch.
                unreachable = _UNREACHABLE.search(str(e))
                if unreachable is None or unreachable.group(1) not in train_names:
                    raise
                train_names.remove(unreachable.group(1))
                logger.debug("%s gets no gradient: no output depends on it differentiably", unreachable.group(1))
        info = builder.get_graph_info()
        model_bytes = builder.get_gradient_model() if r.build_gradient else builder.get_forward_model()
        self.model = onnx.load_model_from_string(model_bytes)
        self.user_output_names = list(info.user_output_names)
        self.non_differentiable = set(info.output_grad_indices_non_differentiable)
        self.full_shape_grad = set(info.output_grad_indices_require_full_shape)
        self.fetch_names = [o.name for o in self.model.graph.output]
        self.built = BuiltGraph(
            model=self.model,
            request=r,
            purpose=purpose,
            graph_info=info,
            user_output_names=self.user_output_names,
            non_differentiable=self.non_differentiable,
            torch_non_differentiable=set(),
            full_shape_grad=self.full_shape_grad,
            save_for_backward=[
                i for i in info.module_output_indices_requires_save_for_backward if i < len(self.user_output_names)
            ],
        )
        if r.build_gradient:
            feed_names = [i.name for i in self.model.graph.input]
            # Which feeds each output depends on: a parameter reached only by outputs that got no gradient gets
            # None, as in torch, not ORT's zeros (weight decay would move it otherwise).
            reach = value_dependencies(r.model, [o.name for o in r.model.graph.output])
            position = {name: i for i, name in enumerate(feed_names)}
            self.built.output_feeds = [
                frozenset(position[n] for n in reach.get(o.name, ()) if n in position) for o in r.model.graph.output
            ]
            self._detach_tap_outputs(r)
            self._fetch_tap_gradients(r)
        # What torch must treat as non-differentiable: ORT's set plus outputs computed only from detached values.
        self.built.torch_non_differentiable = self.non_differentiable | {
            i for i, name in enumerate(self.user_output_names) if name in no_grad_outputs
        }

    def _detach_tap_outputs(self, r: BuildRequest) -> None:
        """Take the taps' outputs out of the gradient graph: they are read, never differentiated.

        The gradient builder treats every graph output as differentiable, so each tap output gets a gradient input
        at the YieldOp (fed zeros each step), an Identity, and a place in a Sum of partial gradients. Here those
        go: the YieldOp marks the tap outputs non-differentiable and loses their gradient outputs, the Identities
        go, and each Sum loses that input. A tap whose zero gradient feeds anything but a Sum keeps it (that value
        reaches no model output, so the zero is its whole gradient).
        """
        graph = self.model.graph
        tap_outputs = {output for _, output in r.taps}
        yield_op = next((n for n in graph.node if n.op_type == "YieldOp"), None)
        if yield_op is None or not tap_outputs:
            return
        attributes = {a.name: a for a in yield_op.attribute}
        non_diff = (
            set(attributes["non_differentiable_outputs"].ints) if "non_differentiable_outputs" in attributes else set()
        )
        differentiable = [i for i in range(len(yield_op.input)) if i not in non_diff]
        grad_of = dict(zip(differentiable, yield_op.output))  # yield input index -> its gradient value
        consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)
        removed_nodes: list[onnx.NodeProto] = []
        detached = set()
        for i, name in enumerate(yield_op.input):
            grad = grad_of.get(i)
            if name not in tap_outputs or grad is None:
                continue
            users = consumers.get(grad, [])
            if not all(u.op_type == "Identity" for u in users):
                continue
            partials = [u.output[0] for u in users]
            if not all(all(c.op_type == "Sum" for c in consumers.get(p, [])) and consumers.get(p) for p in partials):
                continue
            for p in partials:
                for total in consumers[p]:
                    kept = [x for x in total.input if x != p]
                    del total.input[:]
                    total.input.extend(kept)
            removed_nodes.extend(users)
            detached.add(i)
        if not detached:
            return
        for total in graph.node:
            if total.op_type == "Sum" and len(total.input) == 1:
                total.op_type = "Identity"
        outputs = [grad_of[i] for i in differentiable if i not in detached]
        del yield_op.output[:]
        yield_op.output.extend(outputs)
        non_diff |= detached
        full_shape = (
            [i for i in attributes["full_shape_outputs"].ints if i not in detached]
            if ("full_shape_outputs" in attributes)
            else None
        )
        del yield_op.attribute[:]
        for name, attribute in attributes.items():
            if name not in ("non_differentiable_outputs", "full_shape_outputs"):
                yield_op.attribute.append(attribute)
        yield_op.attribute.append(onnx.helper.make_attribute("non_differentiable_outputs", sorted(non_diff)))
        if full_shape is not None:
            yield_op.attribute.append(onnx.helper.make_attribute("full_shape_outputs", full_shape))
        removed = {n.output[0] for n in removed_nodes}
        kept_nodes = [n for n in graph.node if n.output[0] not in removed]  # copies: edit no node after this
        del graph.node[:]
        graph.node.extend(kept_nodes)
        self.non_differentiable |= detached
        self.full_shape_grad -= detached

    def _fetch_tap_gradients(self, r: BuildRequest) -> None:
        """Make the gradient of each tapped value an extra output of the backward graph.

        ORT's optimizations rename values (a zero-rate Dropout goes, its output becomes its input's), so the
        tapped value is found again in the built graph: the input of the Identity that exposes it (Identities
        looked through). Its gradient is ``<value>_grad``. ``tap_gradients[k]`` is the fetch index of tap k's gradient (None: ORT computes none,
        as the value depends on nothing trained), ``tap_outputs[k]`` the model outputs the value reaches: torch
        calls a tensor's gradient hook only when one of those received a gradient, and so does ortcore.
        """
        self.tap_gradients: list[int | None] = [None] * len(r.taps)
        self.tap_outputs: list[frozenset[int]] = [frozenset()] * len(r.taps)
        self.built.tap_gradients, self.built.tap_outputs = self.tap_gradients, self.tap_outputs
        if not r.taps:
            return
        producer = {o: node for node in self.model.graph.node for o in node.output if o}
        fetch_index = {name: i for i, name in enumerate(self.fetch_names)}
        missing = []
        for k, (_, output) in enumerate(r.taps):
            value = through_identities(producer, output)
            grad = f"{value}_grad" if value != output else None  # no Identity left: ORT folded the exposure
            if grad not in fetch_index and grad in producer:
                fetch_index[grad] = len(self.fetch_names)
                self.fetch_names.append(grad)
                self.model.graph.output.append(onnx.helper.make_empty_tensor_value_info(grad))
            self.tap_gradients[k] = fetch_index.get(grad)
            if self.tap_gradients[k] is None:
                missing.append(output)
        outputs = [o.name for o in r.model.graph.output]
        reach = value_dependencies(r.model, outputs, sources={value for value, _ in r.taps})
        for k, (value, _) in enumerate(r.taps):
            self.tap_outputs[k] = frozenset(i for i, name in enumerate(outputs) if value in reach[name])
        if missing:
            logger.debug("no gradient in the backward graph for %d tapped values: %s", len(missing), missing)


class TrainingSession:
    """One built graph and its ORT session: a training graph (forward + backward) or an inference graph.

    Created once by the core's pipeline (:mod:`ortcore.pipeline`) from a :class:`BuiltGraph` and a session plan, and
    immutable from then on: setting an attribute raises. A plugin that needs another graph edits it in a
    gradient-graph pass; one that needs other settings contributes them to the plan.
    """

    def __init__(self, built: BuiltGraph, plan: Any):
        set_ = super().__setattr__
        set_("request", built.request)
        set_("device", built.request.device)
        set_("purpose", built.purpose)
        set_("model", built.model)
        set_("graph_info", built.graph_info)
        set_("user_output_names", list(built.user_output_names))
        set_("non_differentiable", frozenset(built.non_differentiable))
        set_("torch_non_differentiable", frozenset(built.torch_non_differentiable))
        set_("full_shape_grad", frozenset(built.full_shape_grad))
        set_("save_for_backward", tuple(built.save_for_backward))
        set_("output_feeds", tuple(built.output_feeds))
        set_("tap_gradients", tuple(built.tap_gradients))
        set_("tap_outputs", tuple(built.tap_outputs))
        # Feed indices whose gradient a pass hands to torch itself during ORT's backward (grad_management): the
        # backward returns None for them, so torch does not accumulate them twice.
        set_("grads_handed_over", frozenset(built.grads_handed_over))
        set_("notes", types.MappingProxyType(dict(built.notes)))
        feed_names = [i.name for i in built.model.graph.input]
        fetch_names = [o.name for o in built.model.graph.output]
        set_("feed_names", feed_names)
        set_("fetch_names", fetch_names)
        if built.request.build_gradient:
            # Gradient outputs are named "<input>_grad"; map each feed to its gradient's index (or None).
            position = {name: i for i, name in enumerate(fetch_names)}
            grad_index = [position.get(f"{name}_grad") for name in feed_names]
            set_("grad_index", grad_index)
            set_("_grad_producers", _grad_producers(built.model, feed_names, grad_index))
        set_("run_wrappers", tuple(name for name, _ in plan.run_wrappers))
        set_("_wrappers", tuple(wrapper for _, wrapper in plan.run_wrappers))
        # The graph ORT runs is read back once to find forward outputs ORT could write after handing them over
        # (ortcore.output_integrity: views, outputs computed in place, outputs a backward kernel may overwrite): from
        # where the plan (or a plugin's session-option setter) has ORT write it, else from a temporary file.
        executed_path = kept_path = None
        try:
            options = plan.session_options()
            kept_path = options.optimized_model_filepath or None
            if built.request.build_gradient and plan.prepared_model is None:
                executed_path = kept_path
                if not executed_path:
                    fd, executed_path = tempfile.mkstemp(prefix="ortcore_executed_", suffix=".onnx")
                    os.close(fd)
                    write_executed_graph(options, executed_path)
            model_bytes = plan.prepared_model if plan.prepared_model is not None else built.model.SerializeToString()
            sess = onnxruntime.InferenceSession(
                model_bytes,
                options,
                providers=[name for name, _ in plan.providers],
                provider_options=[o for _, o in plan.providers],
            )
            if built.request.build_gradient:
                executed = plan.prepared_model if executed_path is None else pathlib.Path(executed_path).read_bytes()
                # The core reads batch-norm inputs and buffers' new values as soon as the forward returns.
                at_once = [
                    k
                    for k, name in enumerate(self.user_output_names)
                    if name.startswith((BN_INPUT_PREFIX, BUFFER_WRITE_PREFIX))
                ]
                at_risk = outputs_at_risk(onnx.ModelProto.FromString(executed), options.enable_mem_reuse, at_once)
            else:
                at_risk = {}
            # Forward output index -> why the forward hands out a copy of it (see ortcore.output_integrity).
            set_("copy_reasons", types.MappingProxyType(at_risk))
            set_("copied_outputs", tuple(sorted(at_risk)))
        except Exception as e:
            raise GraphBuildError(
                f"ONNX Runtime could not create the {self.kind} session: {explain_ort_error(e)}"
            ) from e
        finally:
            if executed_path is not None and executed_path != kept_path:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(executed_path)
        set_("_sess", sess)
        device = _ort_device(built.request.device)
        if built.request.build_gradient:
            n_fw = len(self.user_output_names) + len(built.graph_info.frontier_node_arg_map)
            agent = C.TrainingAgent(
                sess._sess, feed_names, [device] * n_fw, fetch_names, [device] * len(fetch_names), 0
            )
            set_("_agent", agent)
        else:
            set_("_agent", None)
            set_("_fetch_devices", [device] * len(fetch_names))
            set_("_run_options", C.RunOptions())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"TrainingSession is immutable once created (setting {name!r}): edit the graph in a gradient-graph pass "
            "(ortcore_gradient_graph_passes) or add settings to the session plan (ortcore_session_plan); see "
            "docs/hooks.md"
        )

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)

    @property
    def kind(self) -> str:
        return "training" if self.request.build_gradient else "inference"

    @contextlib.contextmanager
    def _wrapped(self, what: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for wrapper in self._wrappers:
                stack.enter_context(wrapper(what))
            yield

    @property
    def agent(self) -> C.TrainingAgent | None:
        """ORT's TrainingAgent of a training session (None for inference); e.g. for its memory statistics."""
        return self._agent

    def end_profiling(self) -> str | None:
        """Stop ORT's profiler (on when the plan set ``profile_file_prefix``) and return the trace file it wrote,
        or None if profiling was off. Events' ``ts`` are microseconds after :attr:`profiling_start_ns`."""
        path = self._sess.end_profiling()
        return path or None

    @property
    def profiling_start_ns(self) -> int:
        """ORT's profiler start time in nanoseconds (0 when profiling is off)."""
        return int(self._sess.get_profiling_start_time_ns())

    # -- running -------------------------------------------------------------------------------------------
    def run_inference(self, feeds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inference graph's outputs for ``feeds`` (in ``feed_names`` order), inside the plan's run wrappers."""
        if self._wrappers:
            with self._wrapped("inference"):
                return self._run_inference(feeds)
        return self._run_inference(feeds)

    def run_forward(self, feeds: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], C.PartialGraphExecutionState]:
        """The training graph's forward: outputs, and ORT's state for the matching backward."""
        if self._wrappers:
            with self._wrapped("forward"):
                return self._run_forward(feeds)
        return self._run_forward(feeds)

    def run_backward(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """See :meth:`_run_backward`; inside the plan's run wrappers."""
        if self._wrappers:
            with self._wrapped("backward"):
                return self._run_backward(*args, **kwargs)
        return self._run_backward(*args, **kwargs)

    def _run_inference(self, feeds: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        inputs = C.OrtValueVector()
        inputs.reserve(len(feeds))
        for t in feeds:
            to_ort(inputs, t)
        outputs = C.OrtValueVector()
        self._sess._sess.run_with_ortvaluevector(
            self._run_options, self.feed_names, inputs, self.fetch_names, outputs, self._fetch_devices
        )
        return from_ort(outputs)

    def _run_forward(self, feeds: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], C.PartialGraphExecutionState]:
        inputs = C.OrtValueVector()
        inputs.reserve(len(feeds))
        for t in feeds:
            to_ort(inputs, t)
        outputs = C.OrtValueVector()
        state = C.PartialGraphExecutionState()
        self._agent.run_forward(inputs, outputs, state, None)
        results = from_ort(outputs)
        for i in self.copied_outputs:
            results[i] = results[i].clone()
        return results, state

    def _run_backward(
        self,
        grad_outputs: Sequence[torch.Tensor | None],
        outputs_meta: Sequence[tuple],
        state,
        tap_gradients: list[tuple[int, torch.Tensor]] | None = None,
        feed_shapes: Sequence[torch.Size] | None = None,
    ) -> list[torch.Tensor]:
        """The gradient of each feed (None where torch would give none). With ``tap_gradients``, also append
        ``(tap index, gradient)`` for each tap that received a gradient, last tap first (the backward's order).

        With ``feed_shapes`` (the shapes of the forward's feeds), every gradient must have its feed's shape:
        otherwise a :class:`GraphBuildError` names the feed and the gradient node that produced it. torch would
        silently sum a broadcastable wrong-shaped gradient down to the input's shape, hiding a wrong gradient graph.
        """
        inputs = C.OrtValueVector()
        for i, grad in enumerate(grad_outputs):
            if i in self.non_differentiable:
                continue
            if grad is None:
                shape, dtype = outputs_meta[i]
                shape = shape if i in self.full_shape_grad else ()
                grad = torch.zeros(shape, dtype=dtype, device=self.device)
            to_ort(inputs, grad)
        outputs = C.OrtValueVector()
        self._agent.run_backward(inputs, outputs, state)
        grads = from_ort(outputs)
        reached: set[int] = set()
        got_grad = {i for i, grad in enumerate(grad_outputs) if grad is not None}
        for i in got_grad:
            reached |= self.output_feeds[i]
        if feed_shapes is not None:
            self._check_grad_shapes(grads, feed_shapes)
        if tap_gradients is not None:
            for k in reversed(range(len(self.tap_gradients))):
                if self.tap_gradients[k] is not None and self.tap_outputs[k] & got_grad:
                    tap_gradients.append((k, grads[self.tap_gradients[k]]))
        return [
            grads[j] if j is not None and i in reached and i not in self.grads_handed_over else None
            for i, j in enumerate(self.grad_index)
        ]

    def _check_grad_shapes(self, grads: list[torch.Tensor], feed_shapes: Sequence[torch.Size]) -> None:
        for i, j in enumerate(self.grad_index):
            # A handed-over gradient went to torch during the run (checked there); its output is a placeholder.
            if j is not None and i not in self.grads_handed_over and grads[j].shape != feed_shapes[i]:
                name = self.feed_names[i]
                kind = "input" if name in self.request.user_input_names else "parameter"
                node = self._grad_producers.get(i)
                made_by = f" (made by gradient node {node[0]!r}, op {node[1]})" if node else ""
                raise GraphBuildError(
                    f"ONNX Runtime's gradient of {kind} {name!r} has shape {tuple(grads[j].shape)}, but {name!r} has "
                    f"shape {tuple(feed_shapes[i])}{made_by}: the gradient graph does not reduce a broadcast back to "
                    "the input's shape; a graph pass must fix this op's gradient (see the gradient_fixes plugin)"
                )


_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def _refuse_differentiated_control_flow(model: onnx.ModelProto) -> None:
    """ORT 1.19.2 aborts the whole process (a std::vector bounds assertion in its gradient builder) building a
    training graph that holds an If/Loop/Scan node, whether or not a gradient crosses it (seen with torch.diagonal's
    export and Reformer's LSH attention). Refuse such a graph first, naming the node and its module, so the user's
    process lives and the fallback policy applies; inference graphs run control flow as usual."""
    for node in model.graph.node:
        if node.op_type in _CONTROL_FLOW and node.domain in ("", "ai.onnx"):
            raise GraphBuildError(
                f"ONNX Runtime cannot build a training graph holding control flow: the {node.op_type} node "
                f"{node.name!r}{module_of(node.name)} would make ORT 1.19.2 abort the process (route the op that "
                "exported it: see docs/plugins/op_routing.md)"
            )


def _grad_producers(model: onnx.ModelProto, feed_names: list[str], grad_index: list[int | None]) -> dict[int, tuple]:
    """Feed index -> (name, op type) of the gradient-graph node that outputs ``<feed>_grad`` (for error messages)."""
    wanted = {f"{name}_grad": i for i, (name, j) in enumerate(zip(feed_names, grad_index)) if j is not None}
    return {wanted[o]: (node.name, node.op_type) for node in model.graph.node for o in node.output if o in wanted}
