"""Hook specifications: everything a plugin can contribute to ortcore, grouped by lifecycle.

Every hook is named ``ortcore_*`` and called by keyword, so argument names are API: a plugin implements a hook
with any subset of the arguments, in any order. Hooks run last-registered-first; where order matters (graph
passes) it is declared explicitly, never left to registration order. The core calls hooks through
:class:`ortcore.host.Hooks`, and per-step paths never go through pluggy: inspectors and subscribers are
collected once per model and then called directly.

The build pipeline (docs/architecture.md), in the order data flows, with the hook at each stage:

    export (ortcore_exporter, ortcore_export_symbolics, ortcore_export_context, ortcore_export_failed,
            ortcore_load_export / ortcore_export_done)
      → pre-gradient graph passes (ortcore_graph_passes)
      → detach() markers lowered (ortcore_lower_stop_gradients: gradient_fixes)
      → gradient build (ortcore_graph_transformer_config)
      → gradient-graph passes (ortcore_gradient_graph_passes)
      → session plan (ortcore_session_plan: providers, config entries, session options)
      → session created once (ortcore_session_created: inspect only; the session is immutable)
      → the first step of a new session checked (ortcore_check_first_step: the gradient audit, on the step itself)
      → steps (ortcore_runtime_inspectors, ortcore_activation_subscribers; run wrappers from the plan)
    a stage that fails on a new graph → ortcore_repairs (route the failing op or module, export again)

Only the core creates sessions; what needs another session asks the state machine (``ORTModule.state_machine``),
which counts and logs every build with its cause.

Each hook's docstring here is one line; its reference (when it is called, each argument, what it returns, an
example) is written once, in docs/hooks.md (tests/test_hooks_meta.py keeps the two in step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .markers import (
    hookimpl,  # noqa: F401 (re-exported: the import plugins and their docs use)
    hookspec,
)

if TYPE_CHECKING:
    import torch

    from .config import Config
    from .errors import UnsupportedModelError
    from .exporter import Exporter
    from .graph import ExportedGraph, StopGradientLowering
    from .graph_passes import GraphPass
    from .inspectors import FirstStep, RuntimeInspector
    from .registry import Registry
    from .repair import Failure, Repair
    from .session import BuiltGraph, SessionPlan, TrainingSession


# -- configure ----------------------------------------------------------------------------------------------------
@hookspec
def ortcore_options_class() -> type | None:
    """This plugin's options class (attrs, fields made with ortcore.api.option)."""


@hookspec
def ortcore_register(config: Config, register: Registry) -> None:
    """Contribute named things: ``register.exporter``, ``.subscriber_class``, ``.optimizer``, ``.data_utility``."""


@hookspec
def ortcore_configure(config: Config) -> None:
    """The configuration is loaded and validated; read ``config.plugin_options(name)`` here."""


# -- export -------------------------------------------------------------------------------------------------------
@hookspec(firstresult=True)
def ortcore_exporter(config: Config) -> Exporter | None:
    """An exporter to use instead of the one the ``exporter`` option names, or None."""


@hookspec(firstresult=True)
def ortcore_export_failed(config: Config, error: UnsupportedModelError, symbolics: dict[str, Any]) -> dict | None:
    """Symbolics that let a failed TorchScript export of an op the exporter cannot express succeed, or None."""


@hookspec
def ortcore_export_symbolics(config: Config) -> dict[str, Any] | None:
    """Extra TorchScript symbolics, by ``domain::op`` name."""


@hookspec
def ortcore_export_translations(config: Config) -> dict[Any, Callable[..., Any]] | None:
    """Extra onnxscript translations for the dynamo route, by op."""


@hookspec
def ortcore_program_passes(config: Config) -> list[GraphPass] | None:
    """Passes over torch.export's program on the dynamo route, before translation to ONNX."""


@hookspec
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any | None:
    """A context manager entered around tracing ``module``, or None."""


@hookspec
def ortcore_graph_passes(config: Config) -> list[GraphPass] | None:
    """Post-export graph passes (ortcore.graph_passes.GraphPass)."""


@hookspec
def ortcore_export_key(config: Config) -> dict[str, Any] | None:
    """Values that shape the exported graph beyond the core's key (a pass's options), for caches."""


@hookspec(firstresult=True)
def ortcore_load_export(config: Config, module: torch.nn.Module, fingerprint: str) -> ExportedGraph | None:
    """A previously exported graph for ``fingerprint`` (an export cache), or None to export."""


@hookspec
def ortcore_export_done(config: Config, module: torch.nn.Module, fingerprint: str, graph: ExportedGraph) -> None:
    """A graph was exported and post-processed (not loaded from a cache): inspect or store it."""


# -- graph build ----------------------------------------------------------------------------------------------------
@hookspec
def ortcore_lower_stop_gradients(config: Config, lowering: StopGradientLowering) -> None:
    """Decide how the forward graph's detach() markers run before ONNX Runtime's gradient build: ``lowering.decide``."""


@hookspec
def ortcore_graph_transformer_config(config: Config, transformer_config: Any, training: bool) -> None:
    """Adjust ORT's TrainingGraphTransformerConfiguration in place."""


@hookspec
def ortcore_gradient_graph_passes(config: Config) -> list[GraphPass] | None:
    """Passes over the graph ONNX Runtime's gradient builder made."""


# -- session --------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_session_plan(config: Config, graph: BuiltGraph, plan: SessionPlan) -> None:
    """Contribute to the plan of the session the core is about to create for ``graph``."""


@hookspec
def ortcore_session_created(config: Config, session: TrainingSession) -> None:
    """A TrainingSession was created for the model's steps: inspect it (it is immutable)."""


# -- step -----------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_runtime_inspectors(config: Config, module: torch.nn.Module) -> list[RuntimeInspector] | None:
    """Objects called around each step (ortcore.api.RuntimeInspector)."""


@hookspec
def ortcore_activation_subscribers(config: Config, module: torch.nn.Module) -> list[Any] | None:
    """Subscribers that receive activation tensors (forward outputs and their gradients) during each step."""


@hookspec
def ortcore_check_first_step(config: Config, step: FirstStep) -> Any | None:
    """Check a new training session's first step (before it runs, or as it runs: a StepWatch); raise StepCheckError."""


@hookspec
def ortcore_explain_notes(config: Config, module: Any) -> list[str] | None:
    """Lines printed below ``ORTModule.explain()``'s table for ``module`` (the ORTModule)."""


@hookspec(firstresult=True)
def ortcore_autograd_function_handler(config: Config, function: type) -> Any | None:
    """Who runs this torch.autograd.Function subclass inside the graph: a handler, INLINE, or None."""


# -- repair ---------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_repairs(config: Config, failure: Failure) -> list[Repair] | None:
    """Ways to repair a failing stage (ortcore.repair.Repair), or None."""


@hookspec(firstresult=True)
def ortcore_load_repairs(config: Config, module: torch.nn.Module, fingerprint: str) -> list[dict] | None:
    """The repairs an earlier process found for this model and call, or None."""


@hookspec
def ortcore_repairs_found(config: Config, module: torch.nn.Module, fingerprint: str, repairs: list[dict]) -> None:
    """Repairs made a model's first step pass: store them for the next process."""


# -- command line --------------------------------------------------------------------------------------------------
@hookspec
def ortcore_commands(subparsers: Any) -> None:
    """Add ``ortcore`` subcommands to ``subparsers`` (argparse)."""


# -- teardown -------------------------------------------------------------------------------------------------------
@hookspec
def ortcore_unconfigure(config: Config) -> None:
    """The plugin host is shutting down."""
