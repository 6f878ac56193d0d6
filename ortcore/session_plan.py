"""What one ONNX Runtime session is created with: :class:`SessionPlan`, filled by the ``ortcore_session_plan``
hooks, and the core's base session options. A module of its own, below the pipeline that creates sessions, so that
the hook specifications can name the plan's type without importing the pipeline."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import onnxruntime
import torch

from .errors import GraphBuildError
from .options import LogLevel, write_executed_graph

if TYPE_CHECKING:
    from .session import TrainingSession


RunWrapper = Callable[[str], contextlib.AbstractContextManager]


@attrs.define(eq=False)
class _Optional:
    """Session settings a plugin contributes on condition that ORT accepts them (a memory plan, say)."""

    owner: str
    config_entries: dict[str, str]
    execution_order: Any = None


@attrs.define(eq=False)
class SessionPlan:
    """Everything the core needs to create one session, filled by the ``ortcore_session_plan`` hooks.

    Attributes:
        config_entries: ORT session config entries (``SessionOptions.add_session_config_entry``).
        execution_order: an ``onnxruntime.ExecutionOrder``, or None for ORT's default.
        providers: execution providers with their options, first preferred.
        optimized_model_filepath: where ORT writes the graph it runs (``save_onnx``), or None.
        run_wrappers: ``(name, wrapper)``: ``wrapper(what)`` is a context manager entered around each run.
        prepared_model: ONNX bytes ORT already optimized for exactly this graph and plan (a cache's copy of what it
            wrote to ``optimized_model_filepath`` before): the session loads them with graph optimizations off, which
            skips most of session creation. If ORT refuses them, the core creates the session from the graph.
        profile_file_prefix: when set, ORT's profiler records every kernel the session runs into
            ``<prefix>_<date>.json`` (Chrome trace format), written by :meth:`TrainingSession.end_profiling`.
    """

    device: torch.device
    log_level: LogLevel
    providers: list[tuple[str, dict[str, str]]]
    config_entries: dict[str, str] = attrs.Factory(dict)
    execution_order: Any = None
    optimized_model_filepath: str | None = None
    run_wrappers: list[tuple[str, RunWrapper]] = attrs.Factory(list)
    prepared_model: bytes | None = None
    profile_file_prefix: str | None = None
    optional: list[_Optional] = attrs.Factory(list)
    session_option_setters: list[Callable[[onnxruntime.SessionOptions], None]] = attrs.Factory(list)
    temporary_files: list[str] = attrs.Factory(list)
    prober: Callable[[SessionPlan, str], TrainingSession] | None = None

    def add_run_wrapper(self, name: str, wrapper: RunWrapper) -> None:
        """Enter ``wrapper(what)`` around every run of the session (``what``: forward, backward or inference).
        A name already added is kept once: plugins that share a service (the ATen executor) add it by one name."""
        if all(existing != name for existing, _ in self.run_wrappers):
            self.run_wrappers.append((name, wrapper))

    def set_session_options(self, setter: Callable[[onnxruntime.SessionOptions], None]) -> None:
        """Call ``setter(session_options)`` on the ``onnxruntime.SessionOptions`` the plan describes, last (after the
        core's defaults, the config entries and the execution order): for settings the plan has no field for."""
        self.session_option_setters.append(setter)

    def add_optional(self, owner: str, config_entries: dict[str, str], execution_order: Any = None) -> None:
        """Settings the session gets if ORT accepts them; if creating the session fails with them, the core logs a
        warning naming ``owner`` and creates the session without (counted as a second build)."""
        self.optional.append(_Optional(owner, dict(config_entries), execution_order))

    def temporary_file(self, text: str, suffix: str = ".json") -> str:
        """A file holding ``text`` that exists until the session is created (ORT reads some settings from files)."""
        fd, path = tempfile.mkstemp(prefix="ortcore_plan_", suffix=suffix)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        self.temporary_files.append(path)
        return path

    def probe(self, cause: str) -> TrainingSession:
        """A throw-away session of the graph with the plan as it stands (no run wrappers), for analysis (ORT's
        memory statistics, say). Counted and logged by the state machine with ``cause``."""
        if self.prober is None:
            raise GraphBuildError("this session plan cannot create probe sessions")
        return self.prober(self, cause)

    def session_options(self, with_optional: bool = True) -> onnxruntime.SessionOptions:
        """The ``onnxruntime.SessionOptions`` the plan describes (the core's defaults, then the plan, then the
        setters plugins added with :meth:`set_session_options`)."""
        so = base_session_options(self.log_level)
        entries = dict(self.config_entries)
        order = self.execution_order
        if with_optional:
            for extra in self.optional:
                entries.update(extra.config_entries)
                order = extra.execution_order if extra.execution_order is not None else order
        for key, value in entries.items():
            so.add_session_config_entry(key, value)
        if order is not None:
            so.execution_order = order
        if self.optimized_model_filepath:
            write_executed_graph(so, self.optimized_model_filepath)
        if self.prepared_model is not None:
            so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        if self.profile_file_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = self.profile_file_prefix
        for setter in self.session_option_setters:
            setter(so)
        return so

    def remove_temporary_files(self) -> None:
        for path in self.temporary_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.temporary_files.clear()


def base_session_options(log_level: LogLevel) -> onnxruntime.SessionOptions:
    """The settings measured best for training on CPU (ENGINE-NOTES): no memory patterns, no prepacking, no spin."""
    so = onnxruntime.SessionOptions()
    so.enable_mem_pattern = False
    so.enable_mem_reuse = False
    so.log_severity_level = log_level.ort_severity
    # Sequential execution: kernels that call back into Python hold the GIL.
    so.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
    so.use_deterministic_compute = torch.are_deterministic_algorithms_enabled()
    so.add_session_config_entry("session.disable_prepacking", "1")
    # A spinning idle ORT worker steals the core the torch optimizer step needs.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # As many threads as torch uses (OMP_NUM_THREADS, torch.set_num_threads): torchrun gives each of several ranks
    # on a machine one thread, and ORT's own default (one per physical core) would give each rank every core.
    so.intra_op_num_threads = torch.get_num_threads()
    return so
