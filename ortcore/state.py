"""The export state machine: the one component that decides whether a call reuses a graph, rebuilds the
session, or re-exports the model, and that logs and counts why.

A call is described by a :class:`GraphKey`. Its *export* fields (input structure, constants, dtypes, ranks,
train/eval, opset, exporter) shape the ONNX graph; its *build* fields (grad mode, which parameters and inputs need
gradients, device) shape only the gradient graph and the session. ``static_sizes`` holds the input sizes a graph is
exported for, a dimension ``None`` once it is dynamic (``dynamic_shapes``: the first call's sizes are exported,
a dimension a later call changes becomes dynamic, as torch.compile's automatic dynamic shapes do). Graphs and sessions are cached by key, so switching between
train and eval reuses what was built before.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs

from . import amp
from .errors import GraphBuildError
from .explain import routed_reasons

logger = logging.getLogger("ortcore")

EXPORT_FIELDS = (
    "structure",
    "constants",
    "inputs",
    "state_dtypes",
    "training",
    "module_modes",
    "opset",
    "exporter",
    "shape_class",
    "static_sizes",
    "repairs",
    "autocast",
    "taps",
)
BUILD_FIELDS = ("grad_enabled", "trainable", "input_requires_grad", "device")


@attrs.frozen
class GraphKey:
    """Everything that decides which graph and session serve a call."""

    structure: str
    constants: tuple
    inputs: tuple  # (name, dtype, rank, device) per tensor input
    state_dtypes: tuple  # (name, dtype) of every parameter and buffer
    training: bool
    module_modes: tuple  # the training flag of every submodule (a frozen batch norm inside a training model)
    opset: int
    exporter: str
    grad_enabled: bool
    trainable: tuple  # names of parameters that require grad
    input_requires_grad: tuple  # names of tensor inputs that require grad
    device: str
    taps: bool = False  # activation subscribers record this step: export with taps (ortcore.hooks)
    # Sizes outside the ranges a graph for this key was exported for (ortcore.graph.range_violations), one entry
    # per graph they fell outside of: such a call gets a graph of its own.
    shape_class: tuple = ()
    # The repairs (ortcore.repair) in force when the graph was exported: a repair exports the model again.
    repairs: tuple = ()
    # Per tensor input, the sizes the graph is exported for, None for each dynamic dimension; () when every
    # dimension is dynamic (dynamic_shapes = "always").
    static_sizes: tuple = ()
    # torch.autocast's state at the call (ortcore.amp.autocast_state): (device type, dtype name) per device type it
    # is on for. The graph follows autocast's cast policy, so another state is another graph.
    autocast: tuple = ()

    @property
    def sizes_family(self) -> tuple:
        """The calls that share one history of sizes (``dynamic_shapes = "auto"``): the export fields but the sizes,
        and grad mode (an evaluation batch of another size leaves the training graph static)."""
        return (attrs.evolve(self, static_sizes=()).export_key, self.grad_enabled)

    @property
    def dynamic_dims(self) -> dict[int, list[int]] | None:
        """Per tensor input (by position), its dynamic dimensions; None when every dimension is dynamic."""
        if not self.static_sizes:
            return None
        return {i: [d for d, size in enumerate(sizes) if size is None] for i, sizes in enumerate(self.static_sizes)}

    @property
    def export_key(self) -> tuple:
        return tuple(getattr(self, f) for f in EXPORT_FIELDS)

    @property
    def build_key(self) -> tuple:
        return (self.export_key, *(getattr(self, f) for f in BUILD_FIELDS))


def describe_violation(violation: tuple) -> str:
    """``ids dimension 1 below 9`` for ``("ids", 1, "below", 9, None)``."""
    name, dim, side, low, high = violation
    if low == high:
        return f"{name} dimension {dim} is not {low}"
    return f"{name} dimension {dim} {side} {low if side == 'below' else high}"


def describe_change(old: GraphKey | None, new: GraphKey) -> str:
    """A one-line reason naming what changed between two keys."""
    if old is None:
        return "first call"
    reasons = []
    if old.structure != new.structure:
        reasons.append("input structure changed (arguments, nesting or None-ness)")
    if old.constants != new.constants:
        before = {name: value for name, _type, value in old.constants}
        changed = [
            f"{name} {before.get(name, 'absent')}->{value}"
            for name, _type, value in new.constants
            if before.get(name) != value
        ]
        changed += [
            f"{name} {value}->absent" for name, value in before.items() if name not in {c[0] for c in new.constants}
        ]
        reasons.append(f"non-tensor input changed ({', '.join(changed)})")
    if old.inputs != new.inputs:
        before = dict((n, (d, r, dev)) for n, d, r, dev in old.inputs)
        for name, dtype, rank, dev in new.inputs:
            if name not in before:
                reasons.append(f"new tensor input {name!r}")
            elif before[name] != (dtype, rank, dev):
                b = before[name]
                what = [
                    f"{label} {x}->{y}"
                    for label, x, y in (("dtype", b[0], dtype), ("rank", b[1], rank), ("device", b[2], dev))
                    if x != y
                ]
                reasons.append(f"input {name!r} {', '.join(what)}")
    if old.state_dtypes != new.state_dtypes:
        before = dict(old.state_dtypes)
        changed = [f"{n} {before.get(n)}->{d}" for n, d in new.state_dtypes if before.get(n) != d]
        reasons.append(
            f"parameter or buffer dtype changed ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"
        )
    if old.training != new.training:
        reasons.append("train->eval" if old.training else "eval->train")
    elif old.module_modes != new.module_modes:
        reasons.append("train/eval mode of a submodule changed")
    if old.repairs != new.repairs:
        reasons.append(f"repaired: {new.repairs[-1] if new.repairs else 'no repair'}")
    if old.shape_class != new.shape_class:
        latest = new.shape_class[-1] if new.shape_class else ()
        reasons.append(
            "input sizes outside the ranges the graph was exported for ("
            + ", ".join(describe_violation(v) for v in latest)
            + ")"
            if latest
            else "input sizes back within the first graph's ranges"
        )
    if old.static_sizes != new.static_sizes and old.static_sizes and new.static_sizes:
        names = [name for name, *_ in new.inputs]
        changed = [
            f"{names[i] if i < len(names) else i} dimension {d}"
            for i, (a, b) in enumerate(zip(old.static_sizes, new.static_sizes))
            for d, (x, y) in enumerate(zip(a, b))
            if x != y
        ]
        reasons.append("input sizes changed: " + (f"now dynamic in {', '.join(changed)}" if changed else "sizes"))
    if old.autocast != new.autocast:
        reasons.append(f"autocast {amp.describe(old.autocast)}->{amp.describe(new.autocast)}")
    if old.taps != new.taps:
        reasons.append("activation subscribers " + ("started recording" if new.taps else "stopped recording"))
    for field in ("opset", "exporter", "device"):
        if getattr(old, field) != getattr(new, field):
            reasons.append(f"{field} {getattr(old, field)}->{getattr(new, field)}")
    if old.grad_enabled != new.grad_enabled:
        reasons.append("grad mode " + ("enabled" if new.grad_enabled else "disabled (no_grad)"))
    for field, what in (("trainable", "parameter"), ("input_requires_grad", "input")):
        a, b = set(getattr(old, field)), set(getattr(new, field))
        if a != b:
            flips = [f"{n} on" for n in sorted(b - a)] + [f"{n} off" for n in sorted(a - b)]
            reasons.append(f"requires_grad of {what} {', '.join(flips)}")
    return "; ".join(reasons) or "no change"


@attrs.define
class Counters:
    """How often each transition happened; tests assert on these."""

    exports: int = 0  # graphs exported or served by an export cache (cache_loads of them)
    cache_loads: int = 0  # graphs an export cache served instead of an export
    builds: int = 0
    reuses: int = 0
    fallbacks: int = 0
    routed_ops: int = 0  # op kinds run on PyTorch's kernels inside ORT's graph, summed over exports
    audits: int = 0  # gradient audits run (verify_gradients), one per newly built training graph
    probes: int = 0  # throw-away sessions created for analysis (a plugin's plan probe, the gradient audit's)
    repairs: int = 0  # parts moved to PyTorch (or optimizers switched off) after a stage failed (ortcore.repair)


@attrs.frozen
class Transition:
    action: str  # "export", "build", "reuse", "probe", "repair" or "reset"
    reason: str


class ExportStateMachine:
    """Decides, per call, between reuse, rebuild, re-export and fallback; caches graphs and sessions by key.

    Every session the build pipeline creates is recorded here with its cause (``history``, ``counters``): the
    sessions steps run on (``builds``), sessions made again for a reason (``record_build``) and throw-away sessions
    for analysis (``probes``). Calls that fell back to PyTorch are remembered by key with their reason, so such a
    call runs in PyTorch again without retrying ORT (unless the fallback policy retries).
    """

    def __init__(self, max_cached: int = 8):
        self.max_cached = max_cached
        self.counters = Counters()
        self.history: list[Transition] = []
        self._graphs: OrderedDict[tuple, Any] = OrderedDict()
        self._sessions: OrderedDict[tuple, Any] = OrderedDict()
        self._last: GraphKey | None = None
        # Calls that fell back, by GraphKey (or, for a call that failed before it had one, by its error), with the
        # reason; other calls try ORT.
        self.failed: dict[Any, str] = {}
        self.fallback_reason: str | None = None

    @property
    def last_key(self) -> GraphKey | None:
        return self._last

    def resolve(self, key: GraphKey, export: Callable[[], Any], build: Callable[[Any], Any]) -> tuple[Any, Any]:
        """Return ``(graph, session)`` for ``key``, exporting and building only when the key demands it."""
        cached = self._sessions.get(key.build_key)
        if cached is not None and key == self._last:
            self.counters.reuses += 1
            return cached
        reason = describe_change(self._last, key)
        graph, session = cached or (self._graphs.get(key.export_key), None)
        exported = graph is None
        if exported:
            self._record("export", reason)
            graph = self._export(key, export)
        if session is None:
            self._record("build", "after export" if exported else reason)
            try:
                session = build(graph)
            except GraphBuildError as e:
                if exported:
                    raise
                # A graph exported under other requires_grad flags can be unfit for this build (an exporter or
                # plugin may export differently when an input needs no gradient): export once more for this key.
                self._record("export", f"{reason}; the cached graph did not build for it ({e})")
                graph = self._export(key, export)
                session = build(graph)
            self.counters.builds += 1
            self._put(self._sessions, key.build_key, (graph, session))
        else:
            self._record("reuse", f"cached graph for: {reason}")
            self.counters.reuses += 1
        if key.export_key in self._graphs:
            self._graphs.move_to_end(key.export_key)
        self._sessions.move_to_end(key.build_key)
        self._last = key
        return graph, session

    @property
    def current(self) -> tuple[Any, Any] | None:
        """``(graph, session)`` of the last call that ran in ORT, or None."""
        if self._last is None:
            return None
        return self._sessions.get(self._last.build_key)

    def _export(self, key: GraphKey, export: Callable[[], Any]) -> Any:
        graph = export()
        self.counters.exports += 1
        self.counters.cache_loads += bool(getattr(graph, "from_cache", False))
        model = getattr(graph, "model", None)
        if model is not None:
            self.counters.routed_ops += len(routed_reasons(model))
        self._put(self._graphs, key.export_key, graph)
        return graph

    def reset(self, reason: str) -> None:
        """Forget every graph and session, and which calls fell back (the model's structure changed, say)."""
        self._graphs.clear()
        self._sessions.clear()
        self._last = None
        self.failed.clear()
        self._record("reset", reason)

    def drop_sessions(self, reason: str) -> None:
        """Forget every session but keep the exported graphs: the next call builds a session again without exporting
        (a plugin whose session settings changed: ORT's profiler, say, is a session setting)."""
        self._sessions.clear()
        self._record("reset", f"sessions only: {reason}")

    def graph_for(self, key: GraphKey) -> Any:
        """The exported graph cached for ``key``, or None (a build that failed still left its graph here)."""
        return self._graphs.get(key.export_key)

    def record_repair(self, what: str, why: str) -> None:
        """A failing stage was repaired by ``what`` (an op or a module moved to PyTorch, an optimizer off): the next
        call exports again under the repaired configuration."""
        self.counters.repairs += 1
        self.history.append(Transition("repair", f"{what}, because {why}"))
        logger.warning("repair: %s, because %s", what, why)

    def record_probe(self, cause: str) -> None:
        """A throw-away session is created for analysis (``SessionPlan.probe``, the gradient audit)."""
        self.counters.probes += 1
        self._record("probe", cause)

    def record_build(self, cause: str) -> None:
        """A session is created once more within one build (without a plugin's settings ORT refused, say)."""
        self.counters.builds += 1
        self._record("build", cause)

    # -- fallback to PyTorch ---------------------------------------------------------------------------------------
    def known_failure(self, key: Any) -> str | None:
        """Why the call with ``key`` fell back before, or None if it did not."""
        return self.failed.get(key)

    def record_fallback(self, key: Any, reason: str) -> bool:
        """The call with ``key`` runs in PyTorch for ``reason``; returns True the first time for this key."""
        self.fallback_reason = reason
        if key in self.failed:
            return False
        self.failed[key] = reason
        self.counters.fallbacks += 1
        return True

    def record_ort_run(self, key: Any) -> None:
        """The call with ``key`` ran in ORT (a retry that now works is no longer a fallback)."""
        self.failed.pop(key, None)
        self.fallback_reason = None

    def _record(self, action: str, reason: str) -> None:
        self.history.append(Transition(action, reason))
        logger.info("%s (%s)", action, reason)

    def _put(self, cache: OrderedDict, key: tuple, value: Any) -> None:
        cache[key] = value
        while len(cache) > self.max_cached:
            cache.popitem(last=False)
