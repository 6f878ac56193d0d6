"""The PyTorch eager side: ``torch.profiler`` (CPU) over the same steps, self CPU time per op kind and phase.

Each aten op's self time is attributed to

- an **op kind**: the outermost aten op it runs under (``aten::linear`` owns its ``aten::addmm``,
  ``aten::cross_entropy_loss`` its ``log_softmax`` and ``nll_loss``), or in the backward the autograd node it runs
  for (``NativeLayerNormBackward0`` -> ``native_layer_norm``), so a kind matches what ONNX Runtime runs as one
  kernel or one gradient op;
- a **phase**: the innermost of the ranges it runs in: an autograd node (``autograd::engine::evaluate_function``)
  is the backward, ``Optimizer.step#...`` the optimizer, ``Optimizer.zero_grad#...`` zero_grad, a
  :func:`~ortcore_plugins.op_profiler.phase` range its phase; anything else is the forward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from .categories import CATEGORIES, aten_category, autograd_node_op
from .steps import StepClock, active

_EVALUATE = "autograd::engine::evaluate_function: "


def _is_autograd_node(name: str) -> bool:
    return name.endswith("AccumulateGrad") or (
        "Backward" in name and name.rstrip("0123456789").endswith("Backward") and " " not in name
    )


def classify(event: Any) -> tuple[str, str]:
    """``(op kind, phase)`` of an aten event of ``torch.profiler``'s event tree."""
    kind, locked, phase = event.name, False, None
    node = event.cpu_parent
    while node is not None:
        name = node.name
        if phase is None:
            if name.startswith(_EVALUATE):
                phase = "backward"
            elif name.startswith("Optimizer.step#"):
                phase = "optimizer"
            elif name.startswith("Optimizer.zero_grad#"):
                phase = "zero_grad"
            elif name.startswith("op_profiler::"):
                phase = name.removeprefix("op_profiler::")
        if not locked:
            if name.startswith("aten::"):
                kind = name
            elif _is_autograd_node(name) or name.startswith(_EVALUATE):
                kind, locked = autograd_node_op(name.removeprefix(_EVALUATE)) + " (backward)", True
            else:
                locked = True
        node = node.cpu_parent
    return kind, phase or "forward"


def _category(kind: str, phase: str) -> str:
    if phase in ("optimizer", "zero_grad"):
        return "optimizer"
    return aten_category(kind.removesuffix(" (backward)"))


def summarize(events: list[Any], clock: StepClock) -> dict[str, Any]:
    """The eager side's result (see :func:`profile_eager_steps`) from ``torch.profiler``'s events."""
    steps = max(len(clock.steps), 1)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    op_ms: dict[str, float] = defaultdict(float)
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        self_us = float(e.self_cpu_time_total)
        kind, phase = classify(e)
        op_ms[phase] += self_us / 1000 / steps
        category = _category(kind, phase)
        row = rows.setdefault(
            (kind, category), {"op": kind, "category": category, "fw_ms": 0.0, "bw_ms": 0.0, "other_ms": 0.0}
        )
        key = {"forward": "fw_ms", "backward": "bw_ms"}.get(phase, "other_ms")
        row[key] += self_us / 1000 / steps
    ops = sorted(rows.values(), key=lambda r: -(r["fw_ms"] + r["bw_ms"] + r["other_ms"]))
    for row in ops:
        row["total_ms"] = row["fw_ms"] + row["bw_ms"] + row["other_ms"]
    per_category: dict[str, dict[str, float]] = {}
    for row in ops:
        c = per_category.setdefault(row["category"], {"fw_ms": 0.0, "bw_ms": 0.0, "other_ms": 0.0, "total_ms": 0.0})
        for key in ("fw_ms", "bw_ms", "other_ms", "total_ms"):
            c[key] += row[key]
    step_ms = clock.step_ms()
    phases = clock.phase_ms()
    mean_step = sum(step_ms) / len(step_ms) if step_ms else 0.0
    outside: dict[str, Any] = {"step_ms": mean_step, "op_ms": sum(op_ms.values())}
    for name in ("forward", "backward", "optimizer", "zero_grad"):
        outside[f"{name}_op_ms"] = op_ms.get(name, 0.0)
        wall = phases.get(name)
        outside[f"{name}_ms"] = wall
        outside[f"{name}_outside_ops_ms"] = None if wall is None else wall - op_ms.get(name, 0.0)
    # Python, the autograd engine, the profiler's own cost and anything else between the ops.
    outside["outside_ops_ms"] = mean_step - outside["op_ms"]
    return {
        "side": "eager",
        "steps": len(clock.steps),
        "step_ms": step_ms,
        "phases_ms": phases,
        "ops": ops,
        "categories": {name: per_category[name] for name in CATEGORIES if name in per_category},
        "outside": outside,
    }


class EagerProfile:
    """Profiling eager steps one at a time (each under its own ``torch.profiler``), so that other work can run in
    between unprofiled; :meth:`finish` summarizes them. :func:`profile_eager_steps` is the usual way in."""

    def __init__(self) -> None:
        self.clock = StepClock(record_functions=True)
        self.events: list[Any] = []

    def step(self, step_fn: Callable[[], Any]) -> None:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with active(self.clock), self.clock.step():
                step_fn()
        self.events.extend(prof.events())

    def finish(self) -> dict[str, Any]:
        return summarize(self.events, self.clock)


def profile_eager_steps(step_fn: Callable[[], Any], steps: int, warmup: int = 1) -> dict[str, Any]:
    """Profile ``steps`` training steps of a model in PyTorch eager under ``torch.profiler`` (CPU).

    ``step_fn()`` runs one step; ``warmup`` steps run first, unprofiled. Optimizers' ``step`` and ``zero_grad`` are
    found by torch's own ranges; :func:`~ortcore_plugins.op_profiler.phase` ranges in ``step_fn`` also give each
    phase's wall, hence its time outside the ops.

    Example::

        from ortcore_plugins.op_profiler import profile_eager_steps

        result = profile_eager_steps(step, steps=3)
        for row in result["ops"][:10]:
            print(row["op"], row["fw_ms"], row["bw_ms"])

    Returns a JSON-able dict: ``ops`` (one row per op kind: ``op``, ``category``, ``fw_ms``, ``bw_ms``,
    ``other_ms`` (optimizer and zero_grad), ``total_ms``, self CPU ms per step), ``categories`` (the rows summed per
    category), ``outside`` (step wall, op time per phase, phase walls and their time outside ops), ``step_ms``,
    ``phases_ms``.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    for _ in range(warmup):
        step_fn()
    profile = EagerProfile()
    for _ in range(steps):
        profile.step(step_fn)
    return profile.finish()
