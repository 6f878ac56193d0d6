"""The ortcore side: ONNX Runtime's profiler on one session, the wall of each ORT call, and the kernels per op kind.

A :class:`Recorder` is attached to a session when it is planned (``graph.notes["op_profiler"]``, read back as
``session.notes["op_profiler"]``): the plan turns ORT's profiler on and adds the recorder's run wrapper, which times
every forward, backward and inference call while the recorder is active. ORT's trace (Chrome trace JSON) holds one
``<node>_kernel_time`` event per kernel run; a kernel belongs to the call whose wall-clock window contains it (both
clocks are the system clock: ``ts`` counts microseconds from :attr:`TrainingSession.profiling_start_ns`). That rule
is exact where a rule over graph names is not: ORT renames the nodes it fuses, and memory-saving recomputation runs
forward nodes again in the backward call, where their time is really spent.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from ortcore.api import ATEN_DOMAIN, operator_of

from .categories import CATEGORIES, aten_category, ort_category
from .steps import StepClock, active

NOTE = "op_profiler"  # the key of the recorder in graph.notes / session.notes
WRAPPER = "op_profiler"  # the run wrapper's name in the session plan
KERNEL_SUFFIX = "_kernel_time"
# A kernel event's end may pass its call's end by ORT's rounding to whole microseconds.
SLACK_NS = 2_000


@attrs.frozen
class Run:
    """One ORT call: ``what`` is forward, backward or inference; times in ns of ``time.time_ns()``."""

    what: str
    start_ns: int
    end_ns: int


class _Timed:
    __slots__ = ("recorder", "what", "start")

    def __init__(self, recorder: Recorder, what: str):
        self.recorder, self.what = recorder, what

    def __enter__(self) -> None:
        self.start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self.recorder.runs.append(Run(self.what, self.start, time.time_ns()))


_IDLE = contextlib.nullcontext()


class Recorder:
    """The profiling state of one session: where ORT writes its trace, and the calls timed while active."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.active = False
        self.ended = False
        self.runs: list[Run] = []

    def wrapper(self, what: str) -> contextlib.AbstractContextManager:
        """The run wrapper: times the call while the recorder is active, does nothing otherwise."""
        return _Timed(self, what) if self.active else _IDLE


@attrs.frozen
class Kernel:
    """One kernel run of ORT's trace: the node's name, its op type and provider, start and duration in µs."""

    node: str
    op_type: str
    provider: str
    ts_us: int
    dur_us: int


def kernel_events(events: Iterable[dict[str, Any]]) -> list[Kernel]:
    """The kernel runs of an ORT trace (``cat`` "Node", names ending ``_kernel_time``), in time order."""
    kernels = [
        Kernel(
            e["name"][: -len(KERNEL_SUFFIX)],
            str(e.get("args", {}).get("op_name", "")),
            str(e.get("args", {}).get("provider", "")),
            int(e["ts"]),
            int(e.get("dur", 0)),
        )
        for e in events
        if e.get("cat") == "Node" and str(e.get("name", "")).endswith(KERNEL_SUFFIX)
    ]
    kernels.sort(key=lambda k: k.ts_us)
    return kernels


def assign_runs(kernels: Iterable[Kernel], start_ns: int, runs: list[Run]) -> tuple[list[tuple[Kernel, Run]], int]:
    """Each kernel with the timed call it ran in; kernels outside every call (warm-up steps, calls made while the
    recorder was idle) are left out. Also returns how many kernels ran partly outside their call (0 expected)."""
    ordered = sorted(runs, key=lambda r: r.start_ns)
    starts = [r.start_ns for r in ordered]
    found, straddling = [], 0
    for k in kernels:
        begin = start_ns + k.ts_us * 1000
        i = bisect.bisect_right(starts, begin + SLACK_NS) - 1
        if i < 0:
            continue
        run = ordered[i]
        if begin > run.end_ns + SLACK_NS:
            continue
        if begin + k.dur_us * 1000 > run.end_ns + SLACK_NS:
            straddling += 1
        found.append((k, run))
    return found, straddling


def node_kind(kernel: Kernel, nodes: dict[str, Any]) -> tuple[str, str, str]:
    """``(op kind, category, runs on)`` of a kernel: an ATen node by the aten op it runs (``aten::gelu``), a PythonOp
    by its Function, any other node by its op type."""
    node = nodes.get(kernel.node)
    if kernel.op_type == "ATen" and (node is None or node.domain == ATEN_DOMAIN):
        operator = operator_of(node) if node is not None else ""
        if not operator:
            return "ATen", "other", "PyTorch"
        kind = operator if "::" in operator else f"aten::{operator}"
        return kind, aten_category(operator), "PyTorch"
    if kernel.op_type.startswith("PythonOp"):
        func = ""
        if node is not None:
            func = next((a.s.decode() for a in node.attribute if a.name == "func_name"), "")
        return f"{kernel.op_type} {func}".strip(), "other", "PyTorch (Python)"
    return kernel.op_type, ort_category(kernel.op_type), "ORT"


def aggregate(
    kernels: list[tuple[Kernel, Run]], nodes: dict[str, Any], steps: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per op kind: count per step, forward and backward ms per step, where it runs; and kernel ms per call kind."""
    rows: dict[str, dict[str, Any]] = {}
    kernel_ns: dict[str, float] = defaultdict(float)
    n = max(steps, 1)
    for k, run in kernels:
        kind, category, runs_on = node_kind(k, nodes)
        row = rows.get(kind)
        if row is None:
            row = rows[kind] = {
                "op": kind,
                "category": category,
                "runs_on": runs_on,
                "provider": k.provider,
                "count": 0,
                "fw_count": 0,
                "bw_count": 0,
                "fw_ms": 0.0,
                "bw_ms": 0.0,
            }
        side = "bw" if run.what == "backward" else "fw"  # an inference call is a forward
        row["count"] += 1
        row[f"{side}_count"] += 1
        row[f"{side}_ms"] += k.dur_us / 1000
        kernel_ns[run.what] += k.dur_us * 1000
    for row in rows.values():
        for key in ("count", "fw_count", "bw_count"):
            row[key] = row[key] / n if row[key] % n else row[key] // n
        row["fw_ms"] /= n
        row["bw_ms"] /= n
        row["total_ms"] = row["fw_ms"] + row["bw_ms"]
    ordered = sorted(rows.values(), key=lambda r: -r["total_ms"])
    return ordered, {what: ns / n / 1e6 for what, ns in kernel_ns.items()}


def categories(ops: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The op-kind rows summed per category; ``runs_on`` joins the places its kernels run."""
    found: dict[str, dict[str, Any]] = {}
    for row in ops:
        c = found.setdefault(row["category"], {"count": 0, "fw_ms": 0.0, "bw_ms": 0.0, "total_ms": 0.0, "runs_on": []})
        for key in ("count", "fw_ms", "bw_ms", "total_ms"):
            c[key] += row[key]
        if row["runs_on"] not in c["runs_on"]:
            c["runs_on"].append(row["runs_on"])
    for c in found.values():
        c["runs_on"] = " + ".join(sorted(c["runs_on"]))
    return {name: found[name] for name in CATEGORIES if name in found}


def summarize(
    trace_events: list[dict[str, Any]],
    start_ns: int,
    runs: list[Run],
    nodes: dict[str, Any],
    clock: StepClock,
) -> dict[str, Any]:
    """The ortcore side's result (see :func:`profile_steps`) from ORT's trace and the recorded calls and steps."""
    steps = max(len(clock.steps), 1)
    kernels, straddling = assign_runs(kernel_events(trace_events), start_ns, runs)
    ops, kernel_ms = aggregate(kernels, nodes, steps)
    calls: dict[str, dict[str, float]] = {}
    for what in ("forward", "backward", "inference"):
        mine = [r for r in runs if r.what == what]
        if mine:
            wall = sum(r.end_ns - r.start_ns for r in mine) / steps / 1e6
            kernel = kernel_ms.get(what, 0.0)
            calls[what] = {
                "calls": len(mine) / steps,
                "wall_ms": wall,
                "kernel_ms": kernel,
                "outside_kernels_ms": wall - kernel,
            }
    step_ms = clock.step_ms()
    phases = clock.phase_ms()
    mean_step = sum(step_ms) / len(step_ms) if step_ms else 0.0
    ort_calls = sum(c["wall_ms"] for c in calls.values())
    optimizer, zero_grad = phases.get("optimizer"), phases.get("zero_grad")
    outside = {
        "step_ms": mean_step,
        "ort_calls_ms": ort_calls,
        "kernel_ms": sum(kernel_ms.values()),
        "forward_call_ms": calls.get("forward", {}).get("wall_ms", 0.0),
        "forward_kernel_ms": calls.get("forward", {}).get("kernel_ms", 0.0),
        "forward_outside_kernels_ms": calls.get("forward", {}).get("outside_kernels_ms", 0.0),
        "backward_call_ms": calls.get("backward", {}).get("wall_ms", 0.0),
        "backward_kernel_ms": calls.get("backward", {}).get("kernel_ms", 0.0),
        "backward_outside_kernels_ms": calls.get("backward", {}).get("outside_kernels_ms", 0.0),
        "optimizer_ms": optimizer,
        "zero_grad_ms": zero_grad,
        # Autograd, Python, DLPack and the model's own torch code around the ORT calls.
        "glue_ms": mean_step - ort_calls - (optimizer or 0.0) - (zero_grad or 0.0),
    }
    return {
        "side": "ortcore",
        "steps": len(clock.steps),
        "step_ms": step_ms,
        "phases_ms": phases,
        "calls": calls,
        "ops": ops,
        "categories": categories(ops),
        "outside": outside,
        "kernels_straddling_calls": straddling,
    }


# -- arming: sessions planned while armed get a recorder -------------------------------------------------------------

_ARMED: list[bool] = []


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """Sessions planned while the block runs are profiled (the op_profiler plugin's ``ortcore_session_plan``)."""
    _ARMED.append(True)
    try:
        yield
    finally:
        _ARMED.pop()


def is_armed() -> bool:
    return bool(_ARMED)


_made = itertools.count()


def new_recorder() -> Recorder:
    # ORT writes <prefix>_<date>.json only when profiling ends (end_profiling, or the session going away).
    return Recorder(os.path.join(tempfile.gettempdir(), f"ortcore_op_profiler_{os.getpid()}_{next(_made)}"))


def recorder_of(session: Any) -> Recorder | None:
    """The recorder the op_profiler plugin attached to ``session`` when it was planned, or None."""
    notes = getattr(session, "notes", None) or {}
    recorder = notes.get(NOTE)
    return recorder if isinstance(recorder, Recorder) else None


def finish(session: Any, recorder: Recorder, clock: StepClock, trace_dir: str | None = None) -> dict[str, Any]:
    """Stop ORT's profiler on ``session``, read its trace and summarize it; the trace is removed, or moved into
    ``trace_dir`` (its path is then ``result["trace_file"]``)."""
    recorder.active = False
    recorder.ended = True
    path = session.end_profiling()
    if not path:
        raise RuntimeError("ONNX Runtime's profiler was off on this session: no trace to read")
    try:
        with open(path, encoding="utf-8") as f:
            events = json.load(f)
        nodes = {n.name: n for n in session.model.graph.node if n.op_type == "ATen" or n.op_type.startswith("Python")}
        result = summarize(events, session.profiling_start_ns, recorder.runs, nodes, clock)
        result["trace_file"] = None
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            result["trace_file"] = shutil.move(path, os.path.join(trace_dir, os.path.basename(path)))
    finally:
        if os.path.exists(path):
            os.remove(path)
    return result


def _current_session(model: Any) -> Any:
    current = model.state_machine.current
    return current[1] if current is not None else None


class OrtProfile:
    """Profiling one ORTModule step by step: :meth:`warm_up` (builds the profiled session), :meth:`step` any number
    of times, :meth:`finish` for the result. :func:`profile_steps` is the usual way in; this class lets steps of
    other work (an eager model) run in between, as ``explain_bench`` does."""

    def __init__(self, model: Any, optimizer: Any = None, trace_dir: str | None = None):
        if not hasattr(model, "state_machine"):
            raise TypeError(f"profile_steps profiles an ORTModule, not {type(model).__name__}; see profile_eager_steps")
        self.model, self.optimizer, self.trace_dir = model, optimizer, trace_dir
        self.clock = StepClock()
        self.session: Any = None
        self.recorder: Recorder | None = None
        session = _current_session(model)
        recorder = recorder_of(session)
        self.needs_build = recorder is None or recorder.ended
        if session is not None and self.needs_build:
            model.state_machine.drop_sessions("op_profiler: ORT's profiler is a session setting")

    def warm_up(self, step_fn: Callable[[], Any]) -> None:
        """One unprofiled step; sessions built in it are planned with ORT's profiler on."""
        with armed():
            step_fn()

    def step(self, step_fn: Callable[[], Any]) -> None:
        """One profiled step."""
        if self.session is None:
            self.session = _current_session(self.model)
            self.recorder = recorder_of(self.session)
            if self.recorder is None or self.recorder.ended:
                raise RuntimeError(
                    "no profiled ORT session after the warm-up steps: is the op_profiler plugin disabled "
                    "(ORTCORE_DISABLE_PLUGINS), or did the model fall back to PyTorch "
                    f"({self.model.fallback_reason or 'no fallback recorded'})?"
                )
        hooks = _optimizer_timing(self.optimizer, self.clock) if self.optimizer is not None else []
        self.recorder.active = True
        try:
            with armed(), active(self.clock), self.clock.step():
                step_fn()
        finally:
            self.recorder.active = False
            for handle in hooks:
                handle.remove()

    def finish(self) -> dict[str, Any]:
        """Stop ORT's profiler and summarize the profiled steps."""
        if self.session is None:
            raise RuntimeError("no step was profiled")
        if _current_session(self.model) is not self.session:
            raise RuntimeError("the model built another session during the profiled steps (input structure changed?)")
        return finish(self.session, self.recorder, self.clock, self.trace_dir)


def profile_steps(
    model: Any,
    step_fn: Callable[[], Any],
    steps: int,
    warmup: int = 1,
    optimizer: Any = None,
    trace_dir: str | None = None,
) -> dict[str, Any]:
    """Profile ``steps`` training steps of an ``ORTModule``: where each step's time goes, per op kind.

    ``step_fn()`` runs one training step (forward, backward, optimizer). ``warmup`` steps run first; a model without
    a profiled session gets one there (a model that already ran builds its session again, without exporting:
    ORT's profiler is a session setting). Mark the parts of the step with :func:`ortcore_plugins.op_profiler.phase` to split the time outside
    the ORT calls; with ``optimizer``, its ``step()`` is timed through the optimizer's own hooks.

    Example::

        from ortcore_plugins.op_profiler import profile_steps, render_profile

        def step():
            loss = model(**next(batches)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        result = profile_steps(model, step, steps=3, optimizer=optimizer)
        rich.print(render_profile(result))

    Returns a JSON-able dict: ``ops`` (one row per op kind: ``op``, ``category``, ``runs_on``, ``provider``,
    ``count``, ``fw_count``, ``bw_count`` per step, ``fw_ms``, ``bw_ms``, ``total_ms`` per step), ``categories``
    (the rows summed per category), ``calls`` (per ORT call kind: calls, wall, kernel and outside-kernel ms per
    step), ``outside`` (the step split: ORT calls, their kernels, optimizer, zero_grad, glue), ``step_ms``,
    ``phases_ms``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    profile = OrtProfile(model, optimizer, trace_dir)
    if profile.needs_build and warmup < 1:
        raise ValueError("warmup must be >= 1 to build the profiled session (the model's next step exports)")
    for _ in range(warmup):
        profile.warm_up(step_fn)
    for _ in range(steps):
        profile.step(step_fn)
    return profile.finish()


def _optimizer_timing(optimizer: Any, clock: StepClock) -> list[Any]:
    """Time ``optimizer.step()`` through its step hooks (a phase the step function did not mark itself)."""
    started: list[int] = []

    def pre(*_: Any) -> None:
        started.append(time.perf_counter_ns())

    def post(*_: Any) -> None:
        if started:
            clock.add_phase("optimizer", time.perf_counter_ns() - started.pop())

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
