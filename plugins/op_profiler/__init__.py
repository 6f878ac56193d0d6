"""op_profiler: where a training step's time goes, per op kind, ortcore against PyTorch eager.

Off unless asked for; when off the plugin adds no run wrapper and turns no profiler on. Ask for it

- from code, on any ORTModule (``profile_steps``) or eager model (``profile_eager_steps``), or for the benchmark's
  models, both sides at once (``explain_bench`` and ``render_explain``, used by ``ortcore bench --explain``)::

      from ortcore_plugins.op_profiler import profile_steps, render_profile
      result = profile_steps(model, step, steps=3, optimizer=optimizer)

- or for a whole training script, which then logs the table once after ``warmup + steps`` training steps::

      ORTCORE_PROFILE_OPS=1 python train.py            # [plugins.op_profiler] enable = true

The package, one module per part (docs/plugins/op_profiler.md):

- ``categories``: op categories shared by both sides (matmul/gemm, layer_norm, gelu, ...), without torch;
- ``steps``: step and phase walls, :func:`phase`;
- ``ort_side``: ORT's profiler on a session, the wall of each ORT call, kernels per op kind; :func:`profile_steps`;
- ``eager_side``: ``torch.profiler`` over eager steps, self time per op kind and phase; :func:`profile_eager_steps`;
- ``explain``: :func:`explain_bench` (eager and ortcore on a benchmark model), :func:`render_explain`,
  :func:`render_profile`, :func:`format_profile`.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
from typing import Any

import attrs

from ortcore.api import ForwardInputs, OptionError, RuntimeInspector, hookimpl, int_at_least, option, parse_bool

NAME = "op_profiler"

logger = logging.getLogger("ortcore.op_profiler")

# name -> the module of this package that defines it, imported on first access (PEP 562)
_PUBLIC = {
    "explain_bench": "explain",
    "render_explain": "explain",
    "render_profile": "explain",
    "format_profile": "explain",
    "profile_steps": "ort_side",
    "OrtProfile": "ort_side",
    "profile_eager_steps": "eager_side",
    "EagerProfile": "eager_side",
    "phase": "steps",
    "PHASES": "steps",
    "CATEGORIES": "categories",
}

__all__ = [*_PUBLIC, "OpProfilerOptions"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def _path(value: object, source: str) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{source}={value!r} is not allowed; allowed: a file path, or empty for none")
    return value.strip()


@attrs.frozen
class OpProfilerOptions:
    """Options of ``[plugins.op_profiler]``: profiling a whole training script."""

    enable: bool = option(
        False,
        parse_bool,
        "profile ORT's kernels per op kind for `steps` training steps after `warmup`, then log the table once",
        env="ORTCORE_PROFILE_OPS",
    )
    warmup: int = option(2, int_at_least(0), "training steps before profiling starts", env="ORTCORE_PROFILE_OPS_WARMUP")
    steps: int = option(3, int_at_least(1), "training steps profiled", env="ORTCORE_PROFILE_OPS_STEPS")
    output: str = option("", _path, "also write the result as JSON to this file", env="ORTCORE_PROFILE_OPS_OUTPUT")


def _options(config: Any) -> OpProfilerOptions:
    return config.plugin_options(NAME) or OpProfilerOptions()


class StepProfiler(RuntimeInspector):
    """``ORTCORE_PROFILE_OPS=1``: profiles training steps ``warmup`` .. ``warmup + steps - 1`` of one model, each
    step from one training forward to the next, then logs the table (and writes the JSON) once."""

    def __init__(self, options: OpProfilerOptions):
        from .steps import StepClock

        self.options = options
        self.clock = StepClock()
        self.session: Any = None
        self.recorder: Any = None
        self.done = False

    def pre_forward(self, step: int, inputs: ForwardInputs) -> None:
        if self.done or inputs.session is None or inputs.session.kind != "training":
            return
        first, last = self.options.warmup, self.options.warmup + self.options.steps
        if step == first:
            self._start(inputs.session)
        elif first < step < last:
            self.clock.end_step()
            self.clock.begin_step()
        elif step >= last and self.recorder is not None:
            self.clock.end_step()
            self.report()

    def _start(self, session: Any) -> None:
        from .ort_side import recorder_of

        self.recorder = recorder_of(session)
        if self.recorder is None or self.recorder.ended:
            self.done = True
            logger.warning("op profiler: the session of this model was not planned with ORT's profiler on")
            return
        self.session = session
        self.recorder.active = True
        self.clock.begin_step()
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if not self.done and self.recorder is not None:
            self.clock.end_step()  # the last step ends with its last ORT call: no next forward came
            self.report()

    def report(self) -> None:
        """Stop profiling, log the table, write the JSON if asked."""
        from ortcore.api import atomic_writer

        from .explain import format_profile
        from .ort_side import finish

        self.done = True
        atexit.unregister(self._at_exit)
        try:
            result = finish(self.session, self.recorder, self.clock)
        except Exception as e:  # a profile that cannot be read must never stop training
            logger.warning("op profiler: could not read ORT's trace: %s: %s", type(e).__name__, e)
            return
        finally:
            self.session = None
        logger.info("op profiler: %d training steps\n%s", result["steps"], format_profile(result))
        if self.options.output:
            with atomic_writer(self.options.output) as f:
                json.dump(result, f, indent=1)


@hookimpl
def ortcore_options_class() -> type:
    return OpProfilerOptions


@hookimpl
def ortcore_session_plan(config: Any, graph: Any, plan: Any) -> None:
    from .ort_side import is_armed

    if graph.purpose != "train" or not (is_armed() or _options(config).enable):
        return
    from .ort_side import NOTE, WRAPPER, new_recorder

    recorder = new_recorder()
    plan.profile_file_prefix = recorder.prefix
    plan.add_run_wrapper(WRAPPER, recorder.wrapper)
    graph.notes[NOTE] = recorder


@hookimpl
def ortcore_runtime_inspectors(config: Any, module: Any) -> list[RuntimeInspector]:
    options = _options(config)
    if not options.enable:
        return []
    if logger.level == logging.NOTSET:  # the user asked for this table: show it at ortcore's default level too
        logger.setLevel(logging.INFO)
    return [StepProfiler(options)]
