"""The gradient audit: the first training step of each newly built graph is checked against PyTorch.

With ``verify_gradients`` on (``ortcore.toml``, ``ORTCORE_VERIFY_GRADIENTS=1`` or
``ORTModule(model, verify_gradients=True)``), the first time a training step resolves to a session the audit has
not seen, ortcore runs, before the user's step and independently of it:

- ONNX Runtime's forward and backward of that graph on the step's inputs, parameters and buffers, with fixed
  pseudo-random output gradients ``g``;
- the wrapped model in PyTorch on the same inputs (parameters and buffers as detached aliases and copies, so no
  ``.grad``, hook, batch-norm statistic or optimizer state of the user's changes), and ``torch.autograd.grad`` of
  the same ``g`` with respect to every trained parameter and every input that requires grad;

and compares the outputs, the loss ``sum(output * g)`` and every gradient. torch's RNG state is restored afterwards,
so the user's step draws the same random numbers as without the audit. A difference beyond the tolerance is judged
against a float64 run: it is float32 rounding when ORT is no farther from float64 than float32 itself lands (10x the
tensor's distance over PyTorch's float32 runs, plus the model's float32 spread; :func:`_judged_against_float64`).
Every returned output is copied when ORT's forward returns it; one the backward wrote into is reported as
``output X changed after the call``.

A graph with active random ops (a Dropout with a non-zero rate in training, ``Random*``, ``Bernoulli``, ATen random
ops) cannot be compared directly: the audit then checks the same model with every ``torch.nn.Dropout`` module's
``p`` set to 0 on both sides (a graph of its own, exported and built for the audit). If random ops remain, the graph
is reported as not audited, never as passed.

On a mismatch the audit exports the graph once more with every module's output as an extra graph output (the
activation taps the subscribers use, :mod:`ortcore.hooks`), runs it, and compares each module's output and its
gradient with PyTorch's forward and tensor hooks: it names the first module, in execution order, whose output
differs, or else the first quantity, in backward order, whose gradient differs, and the ORT ops of that module.
Then :class:`GradientMismatchError` is raised. See docs/gradient_audit.md.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import onnx
import onnx.numpy_helper
import torch

from ortcore.api import (
    Constant,
    InputSchema,
    Tapper,
    autocast_as,
    flatten_outputs,
    node_module,
    running_graph,
    subscribers_paused,
    tapping,
)

from . import kinks, verdicts

logger = logging.getLogger("ortcore")

# The seed of the audit's output gradients: fixed, so an audit is reproducible; drawn from a private generator, so
# torch's global RNG stream is not touched.
OUTPUT_GRADIENT_SEED = 20240917

# Ops that draw random numbers (ONNX, ORT contrib), and ATen operators (run by PyTorch inside the graph) that do.
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
_DROPOUT_INPUTS = {  # op type -> (index of ratio, index of training_mode)
    "Dropout": (1, 2),
    "BitmaskDropout": (1, 2),
    "BiasDropout": (3, 4),
    "BitmaskBiasDropout": (3, 4),
}
ATEN_RANDOM_OPS = frozenset(
    {
        "dropout",
        "native_dropout",
        "feature_dropout",
        "alpha_dropout",
        "feature_alpha_dropout",
        "bernoulli",
        "rand",
        "randn",
        "rand_like",
        "randn_like",
        "randint",
        "randint_like",
        "randperm",
        "multinomial",
        "normal",
        "uniform",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "poisson",
        "rrelu",
        "rrelu_with_noise",
    }
)
_LEAF = "|"  # separates a module's path from the pytree path of a leaf of its output in tap names


#: The kind of a :class:`Difference` for a returned output whose tensor changed after the call returned it.
CHANGED_AFTER_CALL = "output changed after the call"


@attrs.frozen
class Difference:
    """How one of ORT's tensors differs from PyTorch's."""

    kind: str  # "output", "loss", "gradient of parameter", "gradient of input", "module output", ...
    name: str
    max_abs: float
    max_rel: float  # max_abs over the largest magnitude of PyTorch's tensor
    exceeds: bool
    detail: str = ""  # a shape or dtype difference
    used: float = 0.0  # max_abs over the allowed difference: above 1 is beyond the tolerance

    def describe(self) -> str:
        what = f"{self.kind} {self.name!r}"
        if self.kind == CHANGED_AFTER_CALL:
            return f"output {self.name!r} changed after the call: {self.detail}"
        if self.detail:
            return f"{what}: {self.detail}"
        return (
            f"{what}: max abs difference {self.max_abs:.3g} (relative to its largest value {self.max_rel:.3g}; "
            f"{self.used:.2g} of the tolerance)"
        )


@attrs.frozen
class Location:
    """The module the audit names: the first whose output or gradient differs."""

    module: str  # module path ("" for the model itself)
    module_type: str
    difference: Difference
    ort_ops: tuple[str, ...]  # op types of the module's own nodes in the exported graph
    note: str = ""

    def describe(self) -> str:
        name = repr(self.module) if self.module else "the model's own forward"
        ops = f"; its ONNX Runtime ops: {', '.join(self.ort_ops)}" if self.ort_ops else ""
        return f"module {name} ({self.module_type}): {self.difference.describe()}{ops}{self.note}"


@attrs.frozen
class AuditResult:
    """What one audit found. ``status`` is ``"passed"``, ``"mismatch"`` or ``"not audited"``."""

    status: str
    graph: str  # which graph was audited: "the step's graph" or "the step's graph with dropout off"
    reason: str = ""  # why it was not audited
    compared: int = 0  # tensors compared
    worst: Difference | None = None  # the largest relative difference among the compared tensors
    differences: tuple[Difference, ...] = ()  # those beyond the tolerance, in the order compared
    location: Location | None = None
    seconds: float = 0.0
    rtol: float = 0.0
    atol: float = 0.0
    # ONNX Runtime's own failure running the step (status "not audited"): the step would fail the same way.
    error: BaseException | None = attrs.field(default=None, eq=False, repr=False)
    # A passed verdict taken from an earlier audit of the same graph on this machine (the file it was read from):
    # nothing was run this time; ``seconds`` is the earlier audit's (see .verdicts).
    recorded: str = ""
    # Checked on the user's own step (its ORT run and its output gradients), not on a step of the audit's own.
    own_step: bool = False

    def message(self) -> str:
        if self.status == "not audited":
            return f"gradient audit: not audited ({self.reason})"
        tolerance = f"rtol {self.rtol:g} of the largest value, atol {self.atol:g}"
        if self.status == "passed":
            worst = f"; largest difference: {self.worst.describe()}" if self.worst else ""
            when = f" [{self.seconds:.2f} s{', the step itself' if self.own_step else ''}]"
            if self.recorded:
                when = f" [recorded by an earlier audit of this graph on this machine, {self.recorded}]"
            return (
                f"gradient audit passed on {self.graph}: outputs, loss and gradients match PyTorch ({self.compared} "
                f"compared; {tolerance}){worst}{when}"
            )
        changed = [d for d in self.differences if d.kind == CHANGED_AFTER_CALL]
        if changed:
            where = "; ".join(d.describe() for d in changed) + (
                " (a forward value ONNX Runtime keeps for the backward was handed out without a copy: ortcore's "
                "bug, not the model's; no module to route)"
            )
            if self.location:
                where += f"; first difference in {self.location.describe()}"
        elif self.location:
            where = f"first difference in {self.location.describe()}"
        else:
            where = "no single module named"
        others = [d for d in self.differences if d.kind != CHANGED_AFTER_CALL]
        listed = "; ".join(d.describe() for d in others[:5]) or "nothing else"
        more = f" (and {len(others) - 5} more)" if len(others) > 5 else ""
        if changed and not others:
            return (
                f"gradient audit: ONNX Runtime differs from PyTorch on {self.graph}: {where}. Outputs, loss and "
                f"gradients otherwise match ({self.compared} compared; {tolerance}). What to do: train this model "
                "in PyTorch, or copy that output right after the call (before backward) and switch the audit off "
                "for it (verify_gradients=False); report the model and the output with the saved graphs "
                "(ORTMODULE_SAVE_ONNX_PATH). See docs/gradient_audit.md"
            )
        return (
            f"gradient audit: ONNX Runtime differs from PyTorch on {self.graph} ({tolerance}): {where}. "
            f"Beyond the tolerance: {listed}{more}. What to do: train this model in PyTorch until it is fixed (or wrap "
            "only the parts without that module); if the module's op is embedding, gelu, layer_norm, cross_entropy "
            "or linear, [plugins.aten_fallback] torch_kernels runs it with PyTorch's kernel inside the graph; check "
            "that the gradient_fixes plugin is enabled; report the module and its ops with the saved graphs "
            "(ORTMODULE_SAVE_ONNX_PATH). If the difference is rounding, raise verify_gradients_rtol or "
            "verify_gradients_atol. See docs/gradient_audit.md"
        )


@attrs.define
class AuditRequest:
    """One training step to audit, as ORTModule resolved it."""

    model: torch.nn.Module  # the wrapped model
    graph: Any  # the step's ExportedGraph
    session: Any  # the step's TrainingSession
    schema: InputSchema
    tensors: list[torch.Tensor]  # the step's tensor inputs, in schema order
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    trainable: tuple[str, ...]  # parameters that require grad
    export: Callable[[Tapper | None], Any]  # a fresh ExportedGraph of the same call (no export cache)
    build: Callable[[Any], Any]  # a TrainingSession of the step's build key for a graph (no plugin session hooks)
    rtol: float = 1e-3
    atol: float = 1e-6
    autocast: tuple = ()  # torch.autocast's state of the step (ortcore.amp): PyTorch's side runs under it


# -- randomness -----------------------------------------------------------------------------------------------------


def _constants(model: onnx.ModelProto) -> dict[str, Any]:
    values: dict[str, Any] = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = node.attribute[0].t
    return values


def _constant(values: dict[str, Any], name: str) -> Any:
    tensor = values.get(name)
    if tensor is None:
        return None
    try:
        return onnx.numpy_helper.to_array(tensor)
    except Exception:  # an external or odd tensor: unknown, so treated as not constant
        return None


def random_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of ``model`` that draw random numbers when run (a zero-rate or inference Dropout does not)."""
    values = _constants(model)
    found = []
    for node in model.graph.node:
        if node.op_type in _DROPOUT_INPUTS:
            ratio_at, mode_at = _DROPOUT_INPUTS[node.op_type]
            mode = node.input[mode_at] if len(node.input) > mode_at else ""
            training = _constant(values, mode) if mode else False
            ratio_name = node.input[ratio_at] if len(node.input) > ratio_at else ""
            ratio = _constant(values, ratio_name) if ratio_name else 0.5
            if (training is not None and not bool(training)) or (ratio is not None and float(ratio) == 0.0):
                continue
            found.append(node)
        elif node.op_type in RANDOM_OPS:
            found.append(node)
        elif node.op_type == "ATen":
            operator = next((a.s.decode() for a in node.attribute if a.name == "operator"), "")
            if operator.removeprefix("aten::").rstrip("_") in ATEN_RANDOM_OPS:
                found.append(node)
    return found


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module) -> Iterator[int]:
    """Set ``p`` of every ``torch.nn.Dropout``-like module to 0 (restored afterwards); yields how many."""
    changed = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p != 0]
    saved = [m.p for m in changed]
    for m in changed:
        m.p = 0.0
    try:
        yield len(changed)
    finally:
        for m, p in zip(changed, saved):
            m.p = p


# -- module paths of ONNX nodes -------------------------------------------------------------------------------------


def _module_ops(model: onnx.ModelProto, module: str, module_paths: set[str]) -> tuple[str, ...]:
    owned = [n.op_type for n in model.graph.node if node_module(n.name, module_paths) == module]
    if not owned:  # nothing of its own: its descendants' ops
        prefix = f"{module}." if module else ""
        owned = [n.op_type for n in model.graph.node if (node_module(n.name, module_paths) or "\0").startswith(prefix)]
    return tuple(sorted(set(owned) - {"Constant", "Identity"}))


# -- comparison -----------------------------------------------------------------------------------------------------


def compare(
    kind: str, name: str, ort: torch.Tensor | None, ref: torch.Tensor | None, rtol: float, atol: float
) -> Difference:
    """Compare ORT's tensor with PyTorch's: beyond tolerance when ``max|ort - ref| > atol + rtol * max|ref|``.

    A missing gradient (None) counts as zeros; NaNs must sit at the same places; for half-precision tensors rtol is
    at least 8 ulp of their dtype.
    """
    if ort is None and ref is None:
        return Difference(kind, name, 0.0, 0.0, False)
    if ort is None:
        ort = torch.zeros_like(ref)
    if ref is None:
        ref = torch.zeros_like(ort)
    if ort.shape != ref.shape:
        detail = f"shape {tuple(ort.shape)} in ONNX Runtime, {tuple(ref.shape)} in PyTorch"
        return Difference(kind, name, float("inf"), float("inf"), True, detail)
    if not (ort.is_floating_point() or ort.is_complex()):
        differ = int((ort.to(ref.dtype) != ref).sum()) if ort.numel() else 0
        detail = f"{differ} of {ref.numel()} values differ" if differ else ""
        return Difference(kind, name, float(differ > 0), float(differ > 0), differ > 0, detail, float("inf") * differ)
    if ref.dtype in (torch.float16, torch.bfloat16):
        rtol = max(rtol, 8 * torch.finfo(ref.dtype).eps)
    a, b = ort.detach().to(ref.dtype), ref.detach()
    if not a.numel():
        return Difference(kind, name, 0.0, 0.0, False)
    if b.dtype in (torch.float32, torch.float64):
        # max|x| as max(-min x, max x): one pass over each tensor and one temporary, not abs()'s second copy (GPT-2's
        # logits: 1.7x less CPU). A NaN in either propagates to the careful way below.
        low, high = (a - b).aminmax()
        max_abs = max(-float(low), float(high))
        low, high = b.aminmax()
        scale = max(-float(low), float(high))
    else:
        max_abs = float((a - b).abs().max())
        scale = float(b.abs().max())
    if not (math.isfinite(max_abs) and math.isfinite(scale)):  # NaN or infinity somewhere: the careful way
        a, b = a.double(), b.double()
        if bool((a.isnan() ^ b.isnan()).any()):
            return Difference(
                kind, name, float("inf"), float("inf"), True, "NaN in one and not the other", float("inf")
            )
        same = (a.isnan() & b.isnan()) | (a == b)
        max_abs = float(torch.where(same, 0.0, (a - b).abs()).max())
        finite = b[b.isfinite()].abs()
        scale = float(finite.max()) if finite.numel() else 0.0
    allowed = atol + rtol * scale
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    used = max_abs / allowed if allowed > 0 else (0.0 if max_abs == 0 else float("inf"))
    return Difference(kind, name, max_abs, max_rel, max_abs > allowed, used=used)


# -- the two sides --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _module_taps(model: torch.nn.Module, tapper: Tapper) -> Iterator[None]:
    """Collect every module's output (each tensor leaf) into ``tapper``, named ``<module path>|<leaf path>``."""

    def hook_for(path: str) -> Callable[..., None]:
        # A closure, not a partial: a deep copy of the model (traced by the exporter) keeps calling this tapper.
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            tapper.tap_output(path + _LEAF, output)

        return hook

    handles = [m.register_forward_hook(hook_for(path)) for path, m in model.named_modules()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@attrs.define
class _Side:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]  # by parameter name or graph input name
    tap_names: list[str] = attrs.Factory(list)
    tap_values: list[torch.Tensor | None] = attrs.Factory(list)
    tap_grads: dict[int, torch.Tensor] = attrs.Factory(dict)
    # Taps whose tensor a later in-place op changed (a batch norm's output under ReLU(inplace=True), and the ReLU's
    # output, the same tensor): the two sides do not report the same value for them, so they are not compared.
    tap_changed: set[int] = attrs.Factory(set)
    # ORT's side: (index, largest change) of each returned output whose tensor the backward wrote into; ``outputs``
    # then holds the values as the forward returned them.
    outputs_changed: list[tuple[int, float]] = attrs.Factory(list)


class _VersionedTapper(Tapper):
    """A tapper that remembers each tapped tensor's version counter, to tell which ones were changed in place."""

    def __init__(self) -> None:
        super().__init__(None)
        self.versions: list[int] = []

    def tap(self, name: str, tensor: torch.Tensor) -> None:
        super().tap(name, tensor)
        self.versions.append(tensor._version)


@contextlib.contextmanager
def _grads_written(model: torch.nn.Module) -> Iterator[list[str]]:
    """Yields the names of the parameters whose ``.grad`` the block changed (a Function's backward accumulating into
    the module it received); their ``.grad`` is put back as it was."""
    before = {name: (p.grad, p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    written: list[str] = []
    try:
        yield written
    finally:
        for name, p in model.named_parameters():
            grad, copy = before.get(name, (None, None))
            changed = p.grad is not grad or (copy is not None and not torch.equal(p.grad, copy))
            if changed:
                written.append(name)
                if grad is not None and copy is not None:
                    grad.copy_(copy)
                p.grad = grad


def _output_gradients(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    generator = torch.Generator().manual_seed(OUTPUT_GRADIENT_SEED)
    grads: list[torch.Tensor | None] = []
    for o in outputs:
        if o.requires_grad and o.is_floating_point():
            g = torch.randn(o.shape, generator=generator, dtype=torch.float32)
            grads.append(g.to(dtype=o.dtype, device=o.device))
        else:
            grads.append(None)
    return grads


@attrs.define
class TorchRun:
    """PyTorch's forward of the step, ready to be differentiated (:func:`torch_forward`, :func:`torch_gradients`)."""

    side: _Side
    output_schema: Any
    targets: list[tuple[str, torch.Tensor]]  # what is differentiated: trained parameters, inputs that need grad


def torch_forward(req: AuditRequest, record: bool) -> TorchRun:
    """The model's forward in PyTorch on the step's inputs, on detached aliases of its parameters and copies of its
    buffers (batch-norm statistics move in the copies); with ``record``, every module's output tapped."""
    inputs = [t.detach().requires_grad_(t.requires_grad) for t in req.tensors]
    params = {n: p.detach().requires_grad_(p.requires_grad) for n, p in req.params.items()}
    buffers = {n: b.clone() for n, b in req.buffers.items()}
    args, kwargs = req.schema.rebuild(inputs)
    collector = _VersionedTapper()
    taps = _module_taps(req.model, collector) if record else contextlib.nullcontext()
    with subscribers_paused(req.model), torch.enable_grad(), taps, autocast_as(req.autocast):
        result = torch.func.functional_call(req.model, (params, buffers), args, kwargs, tie_weights=True, strict=False)
    output_schema, outputs = flatten_outputs(result)
    graph_schema = getattr(req.graph, "output_schema", None)
    if graph_schema is not None and len(graph_schema.names) < len(output_schema.names):
        # Outputs the graph returns as constants (not ORT's: ExportedGraph.output_schema holds their values).
        kept = set(graph_schema.names)
        dropped = {k: Constant(None) for k, name in enumerate(output_schema.names) if name not in kept}
        outputs = [t for k, t in enumerate(outputs) if k not in dropped]
        output_schema = output_schema.without_outputs(dropped)
    side = _Side(outputs=outputs, grads={})
    if record:
        side.tap_names = list(collector.names)
        side.tap_values = list(collector.tensors)
        # A tensor changed in place after it was tapped, and every other tap of that tensor (the in-place op's own
        # output is the same tensor): ORT's graph has one value for them, PyTorch's tensor holds the last.
        changed = {id(t) for t, v in zip(collector.tensors, collector.versions) if t._version != v}
        side.tap_changed = {i for i, t in enumerate(collector.tensors) if id(t) in changed}
        for i, tensor in enumerate(collector.tensors):
            if tensor.requires_grad:
                tensor.register_hook(lambda grad, i=i: side.tap_grads.__setitem__(i, grad))
    targets = [(n, params[n]) for n in req.trainable if n in params]
    targets += [(name, t) for name, t in zip(req.graph.user_input_names, inputs) if t.requires_grad]
    return TorchRun(side, output_schema, targets)


def torch_gradients(run: TorchRun, output_grads: Sequence[torch.Tensor | None]) -> None:
    """PyTorch's gradients of ``run`` for ``output_grads`` (None: an output not differentiated), into its side."""
    outputs = run.side.outputs
    used = [
        i
        for i, g in enumerate(output_grads)
        if g is not None and i < len(outputs) and outputs[i].requires_grad and outputs[i].shape == g.shape
    ]
    if used and run.targets:
        # The gradients of sum(output * g): the same as passing g as the outputs' gradients, but a scalar's
        # backward, which does not make torch import its symbolic-shape machinery (and sympy, 0.5 s) on this path.
        # Grad mode on: this may run inside the user's backward (the watched step, .own_step), where it is off.
        with torch.enable_grad():
            total = sum((outputs[i] * output_grads[i]).sum() for i in used)
            grads = torch.autograd.grad(total, [t for _, t in run.targets], allow_unused=True)
        run.side.grads = {name: g for (name, _), g in zip(run.targets, grads)}


def _run_torch(
    req: AuditRequest, record: bool, output_grads: list[torch.Tensor | None] | None = None
) -> tuple[_Side, list[torch.Tensor | None], Any]:
    """The model in PyTorch on the step's inputs; gradients of the audit's output gradients."""
    run = torch_forward(req, record)
    output_grads = _output_gradients(run.side.outputs) if output_grads is None else output_grads
    torch_gradients(run, output_grads)
    return run.side, output_grads, run.output_schema


def _feeds(req: AuditRequest, session: Any) -> list[torch.Tensor]:
    by_name = dict(zip(req.graph.user_input_names, req.tensors))
    by_name.update(req.params)
    by_name.update({n: b.clone() for n, b in req.buffers.items()})  # ORT's batch norm writes its statistics inputs
    return [by_name[name] for name in session.feed_names]


def _run_ort(req: AuditRequest, graph: Any, session: Any, output_grads: list[torch.Tensor | None]) -> _Side:
    with running_graph(req.autocast):
        outputs, state = session.run_forward(_feeds(req, session))
    n = graph.n_user_outputs
    # The outputs as the call returned them (a tensor handed to the user must not change afterwards), and the taps
    # as the forward computed them.
    returned = [o.detach().clone() for o in outputs]
    grads_in = list(output_grads[:n]) + [None] * (len(outputs) - n)
    tap_grads: list[tuple[int, torch.Tensor]] = []
    with running_graph(req.autocast):
        grads = session.run_backward(grads_in, [(o.shape, o.dtype) for o in outputs], state, tap_gradients=tap_grads)
    del state
    side = _Side(outputs=returned[:n], grads=dict(zip(session.feed_names, grads)))
    side.outputs_changed = changed_after_call(returned[:n], outputs[:n])
    if graph.taps:
        side.tap_names = [t.name for t in graph.taps]
        side.tap_values = [returned[i] for i in graph.tap_outputs]
        side.tap_grads = dict(tap_grads)
    return side


def changed_after_call(returned: Sequence[torch.Tensor], now: Sequence[torch.Tensor]) -> list[tuple[int, float]]:
    """``(index, largest absolute change)`` of each tensor of ``now`` that no longer holds what ``returned`` (its copy
    taken when the call returned) holds, bit for bit; NaNs at the same places are the same. An integer or boolean
    tensor's change is counted in differing elements."""
    changed = []
    for i, (before, after) in enumerate(zip(returned, now)):
        after = after.detach()
        if before.shape != after.shape or before.dtype != after.dtype:  # resized in place
            changed.append((i, math.inf))
            continue
        if not before.numel() or torch.equal(before, after):  # one pass, no temporary: the usual case
            continue
        if before.is_floating_point() or before.is_complex():
            same = (before == after) | (before.isnan() & after.isnan())
            if not bool(same.all()):
                delta = (after.to(torch.complex128 if before.is_complex() else torch.float64) - before).abs()
                changed.append((i, float(torch.where(same, 0.0, delta).nan_to_num(math.inf).max())))
        elif not torch.equal(before, after):
            changed.append((i, float((before != after).sum())))
    return changed


def _loss(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple[float, float]:
    """``sum(output * g)`` and the sum of ``|output * g|`` (its scale); float32 rounding of the sums is far below the
    tolerance, which is relative to that scale."""
    total, scale = 0.0, 0.0
    for o, g in zip(outputs, grads):
        if g is not None and o.shape == g.shape and o.numel() and o.is_floating_point():
            o = o.detach()
            if o.dtype == g.dtype == torch.float32:
                # The products in float32 (each rounded by 6e-8 of itself: 1e-4 of the tolerance at most), summed in
                # float64: one temporary instead of four float64 copies (GPT-2's logits, 8 M values).
                products = o * g
                total += float(products.sum(dtype=torch.float64))
                scale += float(products.abs_().sum(dtype=torch.float64))
            else:
                # float64: an autocast step's outputs may be bfloat16 and the gradients given float32, or the reverse
                o, g = o.reshape(-1).double(), g.reshape(-1).double()
                total += float(torch.dot(o, g))
                scale += float(torch.dot(o.abs(), g.abs()))
    return total, scale


def _compare_sides(
    req: AuditRequest, ort: _Side, ref: _Side, output_grads: list, names: Sequence[str]
) -> list[Difference]:
    rtol, atol = req.rtol, req.atol
    found = [compare("output", name, a, b, rtol, atol) for name, a, b in zip(names, ort.outputs, ref.outputs)]
    for i, change in ort.outputs_changed:
        amount = "in place: resized" if math.isinf(change) else f"by up to {change:.3g}"
        if not ort.outputs[i].is_floating_point() and not ort.outputs[i].is_complex() and math.isfinite(change):
            amount = f"in {int(change)} element(s)"
        found.append(changed_output(names[i], change, amount))
    return found + compare_gradients(req, ort, ref, output_grads)


def changed_output(name: str, change: float, amount: str) -> Difference:
    """The difference of a returned output the backward wrote into, by ``change`` (described by ``amount``)."""
    return Difference(
        CHANGED_AFTER_CALL,
        name,
        change,
        math.inf,
        True,
        f"ONNX Runtime's backward wrote into the tensor the forward returned ({amount}); the values compared "
        "are those returned",
        math.inf,
    )


def compare_gradients(req: AuditRequest, ort: _Side, ref: _Side, output_grads: list) -> list[Difference]:
    """The loss ``sum(outputs * g)`` for ``output_grads``, and every gradient PyTorch's side computed."""
    rtol, atol = req.rtol, req.atol
    ort_loss, _ = _loss(ort.outputs, output_grads)
    ref_loss, scale = _loss(ref.outputs, output_grads)
    loss_diff = abs(ort_loss - ref_loss)
    allowed = atol + rtol * scale
    found = [
        Difference(
            "loss",
            "sum(outputs * g)",
            loss_diff,
            loss_diff / scale if scale else 0.0,
            loss_diff > allowed,
            used=loss_diff / allowed if allowed else 0.0,
        )
    ]
    inputs = set(req.graph.user_input_names)
    for name in ref.grads:
        kind = "gradient of input" if name in inputs else "gradient of parameter"
        found.append(compare(kind, name, ort.grads.get(name), ref.grads[name], rtol, atol))
    return found


# -- float32 rounding or a real difference --------------------------------------------------------------------------
#: ORT's error against a float64 run may be this many times PyTorch's own float32 error before it is ORT's fault.
F64_FACTOR = 10.0


def _precision(req: AuditRequest) -> str:
    """What PyTorch's own run rounds in: ``float32``, or ``bfloat16 autocast`` for an autocast step."""
    if req.autocast:
        return " and ".join(sorted({dtype for _device, dtype in req.autocast})) + " autocast"
    return "float32"


def _float64_side(
    req: AuditRequest, output_grads: list[torch.Tensor | None], wide_grads: list[torch.Tensor | None] | None = None
) -> _Side:
    """The model in float64 (a copy: parameters, buffers, inputs and the default dtype), the same output gradients."""

    def wide(t: torch.Tensor) -> torch.Tensor:
        return t.detach().double() if t.is_floating_point() else t.detach().clone()

    model = copy.deepcopy(req.model).double()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        exact = attrs.evolve(
            req,
            model=model,
            tensors=[wide(t).requires_grad_(t.requires_grad) for t in req.tensors],
            params={n: wide(p).requires_grad_(p.requires_grad) for n, p in req.params.items()},
            buffers={n: wide(b) for n, b in req.buffers.items()},
            autocast=(),  # the exact run: no low precision anywhere
        )
        if wide_grads is None:
            wide_grads = [None if g is None else g.double() for g in output_grads]
        with _Float32AsFloat64():
            side, _, _ = _run_torch(exact, record=False, output_grads=wide_grads)
    finally:
        torch.set_default_dtype(previous)
    return side


class _Float32AsFloat64(torch.overrides.TorchFunctionMode):
    """Every float32 a model asks for by name becomes float64: ``x.to(torch.float32)``, ``x.float()``,
    ``softmax(x, dtype=torch.float32)``, ``torch.zeros(n, dtype=torch.float32)``. Models upcast half precision to
    float32 this way (RMS norms, attention softmaxes), and a graph captured by torch.compile carries such casts on
    its inputs; the float64 run would otherwise round to float32 there and be no better than PyTorch's own run."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


#: PyTorch's float32 runs beside the step's own that measure how far float32 alone lands from float64, run one at a
#: time only while a difference is left unexplained: every floating parameter one ulp up, then one ulp down (each
#: rounds differently and changes each weight by less than float32 can represent), then every 4-D and 5-D tensor
#: (images, convolution weights, batch-norm inputs) in channels-last memory format: the same mathematics summed in
#: another order by other kernels (convolutions, batch-norm statistics), as another framework's kernels sum it.
#: (Inputs are not moved: a sum that nearly cancels changes by far more than its rounding when its terms move by
#: one ulp.) Last, the batch in reverse order (batch-norm statistics and weight gradients summed in another order),
#: only for a model whose inputs share their first dimension and whose float64 run in that order gives float64's
#: results (every output and gradient within 1e-6 of its largest value): a model that mixes the rows of a batch
#: otherwise than by sums (a contrastive loss's B x B logits) is not run so. A run that would change nothing (no 4-D
#: or 5-D tensor; no batch) is not made.
ROUNDING_RUNS = (
    "parameters one ulp up",
    "parameters one ulp down",
    "channels-last memory format",
    "batch in reverse order",
)

#: The model's float32 spread (:func:`model_spread`) counts tensors whose float64 values reach this fraction of the
#: largest among the tensors of their kind (outputs, gradients): a gradient 1000x smaller than the model's largest
#: moves nothing in a step, and its relative error is rounding noise over a near-zero value (a bias before a
#: normalisation, 1e-15 in float64).
SPREAD_SCALE = 1e-3
#: ... and is at most this: where float32 is more than half off float64, no difference can be judged by it.
SPREAD_CAP = 0.5


def _nudged(t: torch.Tensor, towards: float) -> torch.Tensor:
    if not t.is_floating_point():
        return t.detach()
    with torch.no_grad():
        return torch.nextafter(t.detach(), torch.full_like(t, towards)).requires_grad_(t.requires_grad)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` in channels-last memory format if it is a floating 4-D or 5-D tensor, else ``t`` itself."""
    if not t.is_floating_point() or t.dim() not in (4, 5):
        return t
    layout = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    with torch.no_grad():
        moved = t.detach().contiguous(memory_format=layout)
    return moved.requires_grad_(t.requires_grad)


#: A float64 run with the batch reversed must give float64's results within this (relative to each tensor's
#: largest value) for the float32 run in that order to count: float64's own rounding is far below it, a model that
#: is not indifferent to the order of its rows far above.
BATCH_ORDER_RTOL = 1e-6


def _flip_batch(values: Sequence[Any], batch: int) -> list[Any]:
    return [v.flip(0) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == batch else v for v in values]


def _reversed_batch_side(req: AuditRequest, output_grads: list[torch.Tensor | None], exact: _Side) -> _Side | None:
    """PyTorch's float32 run on the batch in reverse order, results put back in order; None when the inputs share
    no batch dimension or when float64 on the reversed batch is not float64 on the batch (see :data:`ROUNDING_RUNS`)."""
    sizes = {t.shape[0] for t in req.tensors if t.dim()}
    if len(sizes) != 1 or next(iter(sizes)) < 2:
        return None
    batch = sizes.pop()
    reversed_req = attrs.evolve(
        req, tensors=[t.detach().flip(0).requires_grad_(t.requires_grad) if t.dim() else t for t in req.tensors]
    )
    flipped_grads = _flip_batch(output_grads, batch)
    inputs = set(req.graph.user_input_names)

    def put_back(side: _Side) -> _Side:
        grads = {n: (g.flip(0) if n in inputs and g is not None and g.dim() else g) for n, g in side.grads.items()}
        return _Side(outputs=_flip_batch(side.outputs, batch), grads=grads)

    wide = put_back(_float64_side(reversed_req, flipped_grads))
    for pairs in (
        list(zip(wide.outputs, exact.outputs)),
        [(wide.grads.get(n), g) for n, g in exact.grads.items()],
    ):
        pairs = [
            (None if a is None else a.detach(), b.detach())
            for a, b in pairs
            if b is not None and b.is_floating_point() and b.numel()
        ]
        # A near-zero tensor (a bias before a normalisation, 1e-15) is judged at the scale of its kind's largest.
        largest = max((float(b.abs().max()) for _a, b in pairs), default=0.0)
        for a, b in pairs:
            if a is None or a.shape != b.shape:
                return None
            scale = max(float(b.abs().max()), SPREAD_SCALE * largest)
            if float((a - b).abs().max()) > BATCH_ORDER_RTOL * scale:
                return None
    side, _, _ = _run_torch(reversed_req, record=False, output_grads=flipped_grads)
    return put_back(side)


def _rounding_side(
    req: AuditRequest, output_grads: list[torch.Tensor | None], run: str, exact: _Side | None = None
) -> _Side | None:
    """PyTorch's float32 run ``run`` (one of :data:`ROUNDING_RUNS`); None if it cannot run or is not made."""
    try:
        if run.startswith("batch"):
            return _reversed_batch_side(req, output_grads, exact) if exact is not None else None
        if run.startswith("channels-last"):
            if not any(_channels_last(t) is not t for t in [*req.params.values(), *req.tensors]):
                return None
            changed = attrs.evolve(
                req,
                params={n: _channels_last(p) for n, p in req.params.items()},
                tensors=[_channels_last(t) for t in req.tensors],
                buffers={n: _channels_last(b) for n, b in req.buffers.items()},
            )
        else:
            towards = math.inf if run.endswith("up") else -math.inf
            changed = attrs.evolve(req, params={n: _nudged(p, towards) for n, p in req.params.items()})
        side, _, _ = _run_torch(changed, record=False, output_grads=output_grads)
        return side
    except Exception as e:
        logger.info("gradient audit: no float32 run with %s (%s: %s)", run, type(e).__name__, e)
        return None


def _perturbed_side(req: AuditRequest, output_grads: list[torch.Tensor | None]) -> _Side | None:
    """PyTorch's float32 run with every floating parameter moved one ulp up (None if it cannot run)."""
    return _rounding_side(req, output_grads, ROUNDING_RUNS[0])


def model_spread(errors: dict[str, tuple[float, float]]) -> float:
    """The model's float32 spread on this step: the largest relative distance ``error / scale`` of PyTorch's float32
    from float64 over the tensors given (``key -> (error, scale)``, keys ``kind:name``) whose scale reaches
    :data:`SPREAD_SCALE` of the largest scale of their kind, at most :data:`SPREAD_CAP`."""
    largest: dict[str, float] = {}
    for key, (_error, scale) in errors.items():
        kind = key.partition(":")[0]
        largest[kind] = max(largest.get(kind, 0.0), scale)
    spread = 0.0
    for key, (error, scale) in errors.items():
        if scale > 0 and scale >= SPREAD_SCALE * largest[key.partition(":")[0]] and math.isfinite(error):
            spread = max(spread, error / scale)
    return min(spread, SPREAD_CAP)


def _judged_against_float64(
    req: AuditRequest, found: list[Difference], ort: _Side, ref: _Side, output_grads: list, names: Sequence[str]
) -> list[Difference]:
    """A difference beyond the tolerance is float32 rounding, not ORT's error, when ORT is no farther from a float64
    run than float32 itself lands (see docs/gradient_audit.md, "rounding or error?"): per tensor,

        max|ort - f64| <= F64_FACTOR * max|torch32 - f64| + spread * max|f64| + atol + rtol * max|f64|

    where ``torch32`` ranges over PyTorch's float32 runs (the step's, then :data:`ROUNDING_RUNS` one at a time while
    something is left) and ``spread`` is the model's float32 spread (:func:`model_spread`) over every tensor
    compared. What is left is tried against ReLU kinks (:mod:`.kinks`). Runs only when something exceeds the
    tolerance; if the float64 run fails, every verdict stands."""
    try:
        exact = _float64_side(req, output_grads)
    except Exception as e:  # a model that cannot run in float64: the float32 verdicts stand
        logger.info("gradient audit: no float64 run to judge rounding (%s: %s)", type(e).__name__, e)
        return found
    index = {name: i for i, name in enumerate(names)}
    wide_grads = [None if g is None else g.double() for g in output_grads]

    def value(side: _Side, d: Difference, wide: bool = False) -> torch.Tensor | None:
        if d.kind == "output":
            return side.outputs[index[d.name]]
        if d.kind == "loss":
            return torch.tensor(_loss(side.outputs, wide_grads if wide else output_grads)[0])
        return side.grads.get(d.name)

    # Every floating tensor compared, beyond the tolerance or not: (ORT's, float64's) in double, and float32's error.
    values: dict[str, tuple[Difference, torch.Tensor, torch.Tensor]] = {}
    torch_errors: dict[str, float] = {}
    for d in found:
        if d.detail and d.exceeds:  # a shape or dtype difference, or an output changed after the call
            continue
        a, b, x = value(ort, d), value(ref, d), value(exact, d, wide=True)
        if any(v is None or not v.is_floating_point() for v in (a, b, x)):
            continue
        a, b, x = (v.detach().double() for v in (a, b, x))
        if a.shape != x.shape or b.shape != x.shape or not x.numel():
            continue
        values[_value_key(d)] = (d, a, x)
        torch_errors[_value_key(d)] = float((b - x).abs().max())

    def allowed(key: str, spread: float) -> float:
        _d, _a, x = values[key]
        scale = float(x.abs().max())
        return F64_FACTOR * torch_errors[key] + spread * scale + req.atol + req.rtol * scale

    def spread_now() -> float:
        # The loss is one number made of the outputs: it does not measure a tensor's conditioning of its own.
        return model_spread(
            {k: (torch_errors[k], float(x.abs().max())) for k, (d, _a, x) in values.items() if d.kind != "loss"}
        )

    def left(spread: float) -> list[str]:
        return [
            k for k, (d, a, x) in values.items() if d.exceeds and not float((a - x).abs().max()) <= allowed(k, spread)
        ]

    spread = spread_now()
    runs = 0
    for run in ROUNDING_RUNS:
        if not left(spread):
            break
        other = _rounding_side(req, output_grads, run, exact)
        if other is None:
            continue
        runs += 1
        for key, (d, _a, x) in values.items():
            v = value(other, d)
            if v is not None and v.shape == x.shape:
                torch_errors[key] = max(torch_errors[key], float((v.detach().double() - x).abs().max()))
        spread = spread_now()
    failing = set(left(spread))
    precision = _precision(req)
    judged = []
    pending: dict[str, tuple[torch.Tensor, float]] = {}  # still beyond: ORT's value, the distance allowed
    for d in found:
        key = _value_key(d)
        if not d.exceeds or key not in values:
            judged.append(d)
            continue
        _d, a, x = values[key]
        ort_error = float((a - x).abs().max())
        if key not in failing:
            note = (
                f"{precision} rounding: ONNX Runtime is {ort_error:.3g} from a float64 run, PyTorch's {precision} "
                f"{torch_errors[key]:.3g} ({1 + runs} runs)"
            )
            if spread > req.rtol:
                note += f"; the model's {precision} spread is {spread:.2g} of a tensor's largest value"
            judged.append(attrs.evolve(d, exceeds=False, detail=note))
        else:
            judged.append(d)
            if math.isfinite(ort_error) and d.kind != "loss":
                pending[key] = (a, allowed(key, spread))
    return _judged_by_kinks(req, judged, pending, output_grads, names) if pending else judged


def _value_key(d: Difference) -> str:
    return f"{d.kind}:{d.name}"


def _judged_by_kinks(
    req: AuditRequest,
    judged: list[Difference],
    pending: dict[str, tuple[torch.Tensor, float]],
    output_grads: list,
    names: Sequence[str],
) -> list[Difference]:
    """The differences still beyond float64's judgement are float32 rounding too when float64, with a few ReLU inputs
    that lie within rounding of zero taken on the other side of the kink, lands as close to ONNX Runtime as PyTorch's
    float32 lands to float64 (:mod:`.kinks`): in a batch-norm network one such element moves a whole channel's
    gradients. Only every pending difference explained at once counts."""
    wide_grads = [None if g is None else g.double() for g in output_grads]

    def run(mode: kinks.ReluKinks) -> dict[str, torch.Tensor]:
        with mode:
            side = _float64_side(req, output_grads, wide_grads)
        values = {f"output:{n}": o for n, o in zip(names, side.outputs)}
        for d in judged:
            if _value_key(d) in pending and d.kind != "output" and side.grads.get(d.name) is not None:
                values[_value_key(d)] = side.grads[d.name]
        return values

    target = {k: v for k, (v, _) in pending.items()}
    allowed = {k: a for k, (_, a) in pending.items()}
    try:
        recorder = kinks.ReluKinks(record=True)
        recorded = recorder, run(recorder)  # the float64 run both checks below start from
    except Exception as e:  # the verdicts stand
        logger.info("gradient audit: no kink check (%s: %s)", type(e).__name__, e)
        return judged
    if not recorder.calls:  # no ReLU call: no kink to explain anything
        return judged
    note = None
    try:
        note = _kinks_as_ort_took(req, run, target, allowed, output_grads)
    except Exception as e:  # the search below still runs
        logger.info("gradient audit: no check of ONNX Runtime's own kinks (%s: %s)", type(e).__name__, e)
    if note is None:
        try:
            found = kinks.explain_by_kinks(run, target, allowed, recorded)
        except Exception as e:  # the verdicts stand
            logger.info("gradient audit: no kink check (%s: %s)", type(e).__name__, e)
            return judged
        if not found.explained:
            logger.info("gradient audit: %s", found.describe())
            return judged
        note = found.describe()
    note = f"float32 rounding: {note}"
    return [attrs.evolve(d, exceeds=False, detail=note) if _value_key(d) in pending else d for d in judged]


def _kinks_as_ort_took(
    req: AuditRequest,
    run: Callable[[Any], dict[str, torch.Tensor]],
    target: dict[str, torch.Tensor],
    allowed: dict[str, float],
    output_grads: list,
) -> str | None:
    """Does float64, taking every ReLU element near zero on the side ONNX Runtime took, land within what is allowed
    of ORT's values? The graph is exported once more with each ReLU call's output as a tap (:class:`kinks.ReluTaps`),
    ORT runs it, and the float64 run follows its signs (:class:`kinks.KinksAsTaken`): however many elements a deep
    network's float32 forward moved across zero, one float64 run tests them all. Returns what explains the
    difference, or None (logged) when it does not."""
    with tapping(None) as tapper:
        relus = kinks.ReluTaps(tapper)
        with relus:
            graph = req.export(tapper)
    changed = relus.changed()
    if not graph.taps:
        return None
    session = req.build(graph)
    ort = _run_ort(req, graph, session, output_grads)
    positive = {}
    for name, value in zip(ort.tap_names, ort.tap_values):
        call = kinks.relu_call(name)
        if call is not None and call not in changed and value is not None:
            positive[call] = value.detach() > 0
    mode = kinks.KinksAsTaken(positive)
    distances = kinks.max_distances(target, run(mode))
    explained = all(distances[n] <= allowed[n] for n in target)
    what = (
        f"{len(mode.taken)} ReLU input(s) within {kinks.TAKEN_BAND:g} of their call's largest from zero, taken in float64 "
        f"on the side ONNX Runtime took ({len(positive)} ReLU calls read from its run; {mode.refused} elements "
        f"beyond that band left as float64 has them), {'explain' if explained else 'do not explain'} the difference "
        f"({', '.join(f'{n}: {d:.3g}' for n, d in distances.items())})"
    )
    if not explained:
        logger.info("gradient audit: %s", what)
        return None
    return what


# -- locating -------------------------------------------------------------------------------------------------------


def _split(tap_name: str) -> tuple[str, str]:
    module, _, leaf = tap_name.partition(_LEAF)
    return module, leaf


def _occurrences(names: Sequence[str]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    keys = []
    for name in names:
        keys.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return keys


def _locate(req: AuditRequest, differences: list[Difference], variant: bool) -> Location | None:
    """Export the graph with every module's output tapped, run both sides again, and name the first module."""
    model = req.model
    module_types = {path: type(m).__name__ for path, m in model.named_modules()}
    paths = set(module_types)
    with contextlib.ExitStack() as stack:
        if variant:
            stack.enter_context(dropout_off(model))
        with tapping(None) as tapper, _module_taps(model, tapper):
            graph = req.export(tapper)
        session = req.build(graph)
        ref, output_grads, _ = _run_torch(req, record=True)
        ort = _run_ort(req, graph, session, output_grads)

    def location(module: str, difference: Difference, note: str = "") -> Location:
        return Location(
            module, module_types.get(module, "?"), difference, _module_ops(graph.model, module, paths), note
        )

    ref_index = {key: i for i, key in enumerate(_occurrences(ref.tap_names))}
    pairs = []  # (ORT tap index, torch tap index) in execution order
    for k, key in enumerate(_occurrences(ort.tap_names)):
        if key in ref_index and ref_index[key] not in ref.tap_changed:
            pairs.append((k, ref_index[key]))

    def tap_label(name: str) -> str:
        module, leaf = _split(name)
        return (module or type(model).__name__) + leaf

    # Forward: the first module, in execution order (children before their parent), whose output differs.
    for k, j in pairs:
        d = compare(
            "output of module", tap_label(ort.tap_names[k]), ort.tap_values[k], ref.tap_values[j], req.rtol, req.atol
        )
        if d.exceeds:
            return location(_split(ort.tap_names[k])[0], d)
    # Backward: gradients in the order autograd computes them (the last module's output first).
    last_index: dict[str, int] = {}
    for k, _ in pairs:
        last_index[_split(ort.tap_names[k])[0]] = k
    candidates: list[tuple[float, str, Difference]] = []
    for k, j in pairs:
        if k in ort.tap_grads and j in ref.tap_grads:
            d = compare(
                "gradient of the output of module",
                tap_label(ort.tap_names[k]),
                ort.tap_grads[k],
                ref.tap_grads[j],
                req.rtol,
                req.atol,
            )
            candidates.append((k, ort.tap_names[k], d))
    inputs = set(req.graph.user_input_names)
    for name, ref_grad in ref.grads.items():
        if name in inputs:
            d = compare("gradient of input", name, ort.grads.get(name), ref_grad, req.rtol, req.atol)
            candidates.append((-1.0, name, d))
        else:
            owner = name.rpartition(".")[0]
            d = compare("gradient of parameter", name, ort.grads.get(name), ref_grad, req.rtol, req.atol)
            # A module's parameters get their gradients in its backward: after its output's gradient.
            candidates.append((last_index.get(owner, len(ort.tap_names)) - 0.5, name, d))
    candidates.sort(key=lambda c: -c[0])
    for _key, name, d in candidates:
        if not d.exceeds:
            continue
        if d.kind == "gradient of parameter":
            return location(name.rpartition(".")[0], d)
        # The gradient of a value is computed by the backward of the ops that read it: name their module.
        value = name if d.kind == "gradient of input" else next(t.value for t in graph.taps if t.name == name)
        exposures = {t.output for t in graph.taps}
        readers = [
            node_module(n.name, paths)
            for n in graph.model.graph.node
            if value in n.input and not (n.op_type == "Identity" and n.output[0] in exposures)
        ]
        readers = list(dict.fromkeys(r for r in readers if r is not None))
        module = readers[0] if readers else ""
        others = f"; also read by {', '.join(repr(r) for r in readers[1:])}" if len(readers) > 1 else ""
        return location(module, d, f" (its backward computes this gradient{others})")
    worst = next((d for d in differences if d.exceeds), None)
    if worst is not None and worst.kind == "gradient of parameter":
        return location(worst.name.rpartition(".")[0], worst, " (the graph with every module tapped did not show it)")
    return None


# -- the audit ------------------------------------------------------------------------------------------------------


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _describe_nodes(nodes: list[onnx.NodeProto], model: torch.nn.Module) -> str:
    paths = {path for path, _ in model.named_modules()}
    where = sorted({f"{n.op_type} in {node_module(n.name, paths) or 'the model'}" for n in nodes})
    return ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")


#: Under autocast, ORT and PyTorch round in the low type at the same places but accumulate in other orders: the
#: relative tolerance is at least this many units of the low type's rounding (bfloat16: 3.1e-2, float16: 3.9e-3).
#: A wrong gradient is off by far more; a difference beyond it is judged against float64 as any other.
AUTOCAST_ULPS = 4


def autocast_tolerance(req: AuditRequest) -> AuditRequest:
    """``req`` with its relative tolerance raised to :data:`AUTOCAST_ULPS` of the coarsest type autocast computes
    in; unchanged outside autocast."""
    if not req.autocast:
        return req
    eps = max(torch.finfo(getattr(torch, dtype)).eps for _device, dtype in req.autocast)
    return attrs.evolve(req, rtol=max(req.rtol, AUTOCAST_ULPS * eps))


def audit_with_verdicts(req: AuditRequest, store: Any = None) -> AuditResult:
    """:func:`audit`, or the passed verdict ``store`` (a :class:`.verdicts.VerdictStore`, or None) recorded for the
    same graph on this machine; a new passed verdict is recorded there."""
    key, recorded = recorded_verdict(req, store)
    if recorded is not None:
        return recorded
    result = audit(req)
    record_verdict(store, key, result)
    return result


def recorded_verdict(req: AuditRequest, store: Any) -> tuple[str | None, AuditResult | None]:
    """``(key, result)``: the key of ``req``'s verdict in ``store`` (None without a store, or when no key can be
    made), and the passed verdict recorded there, if any."""
    if store is None:
        return None, None
    try:
        key = verdicts.verdict_key(req)
    except Exception as e:  # no key: audited, not recorded
        logger.info("gradient audit: no verdict key (%s: %s)", type(e).__name__, e)
        return None, None
    record = store.load(key)
    if record is None:
        return key, None
    worst = record.get("worst")
    return key, AuditResult(
        "passed",
        record["graph"],
        compared=record["compared"],
        worst=None
        if worst is None
        else Difference(worst["kind"], worst["name"], worst["max_abs"], worst["max_rel"], False, used=worst["used"]),
        seconds=float(record["seconds"]),
        rtol=req.rtol,
        atol=req.atol,
        recorded=str(store.path(key)),
    )


def record_verdict(store: Any, key: str | None, result: AuditResult) -> None:
    """Record ``result`` under ``key`` in ``store`` if it passed (and both are given)."""
    if store is None or key is None or result.status != "passed" or result.error is not None:
        return
    w = result.worst
    store.store(
        key,
        {
            "status": "passed",
            "graph": result.graph,
            "compared": result.compared,
            "seconds": result.seconds,
            "worst": None
            if w is None
            else {"kind": w.kind, "name": w.name, "max_abs": w.max_abs, "max_rel": w.max_rel, "used": w.used},
            "versions": verdicts.versions(),
        },
    )


def audit(req: AuditRequest) -> AuditResult:
    """Audit one training step's graph against PyTorch (see the module docstring). Never changes the user's state."""
    # Parts of the graph that run in PyTorch (regions) update the model's own buffers in place: restore them.
    buffers = saved_buffers(req.model)
    try:
        return _audit(autocast_tolerance(req))
    finally:
        restore_buffers(req.model, buffers)


def saved_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each of the model's buffers, by name, for :func:`restore_buffers`."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def restore_buffers(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """The model's buffers put back to ``saved`` (:func:`saved_buffers`) in place."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved:
                b.copy_(saved[name])


def _audit(req: AuditRequest) -> AuditResult:
    start = time.perf_counter()
    rng = _rng_state()
    graph, session = req.graph, req.session
    label = "the step's graph"
    common = {"rtol": req.rtol, "atol": req.atol}
    try:
        random = random_nodes(graph.model) + random_nodes(session.model)
        variant = bool(random)
        separate = variant or bool(session.grads_handed_over)
        with dropout_off(req.model) if variant else contextlib.nullcontext() as changed:
            if variant:
                label = "the step's graph with dropout off"
                if not changed:
                    return AuditResult(
                        "not audited",
                        label,
                        reason=f"the graph draws random numbers ({_describe_nodes(random, req.model)}) outside "
                        "torch.nn.Dropout modules",
                        seconds=time.perf_counter() - start,
                        **common,
                    )
            if separate:
                # Its own graph: dropout off, or no plugin session hooks (gradients handed to torch would reach
                # the user's .grad).
                graph = req.export(None)
                left = random_nodes(graph.model)
                if left:
                    return AuditResult(
                        "not audited",
                        label,
                        reason=f"random ops remain with every torch.nn.Dropout at p=0 ({_describe_nodes(left, req.model)})",
                        seconds=time.perf_counter() - start,
                        **common,
                    )
                session = req.build(graph)
                req = attrs.evolve(req, graph=graph, session=session)
            with _grads_written(req.model) as written:
                ref, output_grads, output_schema = _run_torch(req, record=False)
            _set_rng_state(rng)
            if written:
                return AuditResult(
                    "not audited",
                    label,
                    reason="the model's backward writes .grad itself (a custom autograd Function accumulating into "
                    f"{', '.join(written[:3])}), so torch.autograd.grad cannot give PyTorch's gradients",
                    seconds=time.perf_counter() - start,
                    **common,
                )
            if not any(g is not None for g in output_grads) or not ref.grads:
                return AuditResult(
                    "not audited",
                    label,
                    reason="no output of the model needs a gradient, or nothing is trained",
                    seconds=time.perf_counter() - start,
                    **common,
                )
            if tuple(output_schema.names) != tuple(graph.output_schema.names):
                raise RuntimeError(
                    f"PyTorch's outputs {output_schema.names} are not the graph's {graph.output_schema.names}"
                )
            try:
                ort = _run_ort(req, graph, session, output_grads)
            except Exception as e:  # pybind's errors: ORT cannot run this graph on these inputs
                return AuditResult(
                    "not audited",
                    label,
                    reason=f"ONNX Runtime failed to run it ({type(e).__name__}: {e}); the step itself fails the same way",
                    seconds=time.perf_counter() - start,
                    error=e,
                    **common,
                )
            _set_rng_state(rng)
            found = _compare_sides(req, ort, ref, output_grads, graph.output_schema.names)
            if any(d.exceeds for d in found):
                found = _judged_against_float64(req, found, ort, ref, output_grads, graph.output_schema.names)
                _set_rng_state(rng)
        beyond = tuple(d for d in found if d.exceeds)
        worst = max(found, key=lambda d: d.used)
        location = None
        if any(d.kind != CHANGED_AFTER_CALL for d in beyond):
            try:
                location = _locate(req, list(beyond), variant)
            except Exception as e:  # the mismatch is reported either way; only the module stays unnamed
                logger.warning("gradient audit: could not locate the difference (%s: %s)", type(e).__name__, e)
        return AuditResult(
            "mismatch" if beyond else "passed",
            label,
            compared=len(found),
            worst=worst,
            differences=beyond,
            location=location,
            seconds=time.perf_counter() - start,
            **common,
        )
    except Exception as e:  # the audit must never pass silently, nor stop training for its own failure
        return AuditResult(
            "not audited", label, reason=f"{type(e).__name__}: {e}", seconds=time.perf_counter() - start, **common
        )
    finally:
        _set_rng_state(rng)
