"""Step and phase walls, shared by the ortcore and the eager side: :func:`phase` marks a part of a training step
(``forward``, ``zero_grad``, ``backward``, ``optimizer``) while a profile runs, and costs nothing otherwise.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

#: The phases a step is split into; :func:`phase` accepts these names.
PHASES: tuple[str, ...] = ("forward", "zero_grad", "backward", "optimizer")


class StepClock:
    """The wall time of each profiled step and of the phases marked in it, in nanoseconds."""

    def __init__(self, record_functions: bool = False):
        # On the eager side a phase is also a torch.profiler range, so the ops inside it are attributed to it.
        self.record_functions = record_functions
        self.steps: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    def begin_step(self) -> None:
        self._current = {"phases": {}, "start_ns": time.perf_counter_ns()}

    def end_step(self) -> None:
        record, self._current = self._current, None
        if record is not None:
            record["wall_ns"] = time.perf_counter_ns() - record.pop("start_ns")
            self.steps.append(record)

    @property
    def in_step(self) -> bool:
        return self._current is not None

    def add_phase(self, name: str, ns: int) -> None:
        if self._current is not None:
            phases = self._current["phases"]
            phases[name] = phases.get(name, 0) + ns

    def step_ms(self) -> list[float]:
        return [s["wall_ns"] / 1e6 for s in self.steps]

    def phase_ms(self, median: bool = False) -> dict[str, float]:
        """Wall per step of each phase marked in any step: the mean, or the median (robust to a disturbed step)."""
        names = {name for s in self.steps for name in s["phases"]}
        if not self.steps:
            return {}
        found = {}
        for name in sorted(names):
            values = [s["phases"].get(name, 0) / 1e6 for s in self.steps]
            found[name] = statistics.median(values) if median else sum(values) / len(values)
        return found


_ACTIVE: list[StepClock] = []


@contextlib.contextmanager
def active(clock: StepClock) -> Iterator[StepClock]:
    """Make ``clock`` the one :func:`phase` reports to while the block runs."""
    _ACTIVE.append(clock)
    try:
        yield clock
    finally:
        _ACTIVE.remove(clock)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a part of a training step for the op profiler; a no-op unless a profile is running.

    Example::

        from ortcore_plugins.op_profiler import phase

        def step():
            with phase("forward"):
                loss = model(**batch).loss
            with phase("backward"):
                loss.backward()
            with phase("optimizer"):
                optimizer.step()
    """
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; allowed: {', '.join(PHASES)}")
    if not _ACTIVE:
        yield
        return
    clock = _ACTIVE[-1]
    with contextlib.ExitStack() as stack:
        if clock.record_functions:
            import torch

            stack.enter_context(torch.profiler.record_function(f"op_profiler::{name}"))
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            clock.add_phase(name, time.perf_counter_ns() - start)
