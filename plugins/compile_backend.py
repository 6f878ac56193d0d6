"""compile_backend: ONNX Runtime as a ``torch.compile`` backend for training, ``backend="ortcore"``.

``torch.compile(model, backend="ortcore")`` works without importing ortcore first: the backend is registered in the
entry-point group torch reads for backends (``torch_dynamo_backends``). Dynamo captures the model's Python into FX
graphs, breaking the capture where it must (a ``.item()``, a ``print``, a branch on a tensor's value, a
data-dependent shape) and running that Python in eager between graphs; each captured graph comes here, and runs as
an :class:`ortcore.api.ORTModule` of the graph module.

**Design: ORT's gradient builder per captured graph.** The graph module is exported (the configured exporter,
TorchScript by default), ORT builds its training graph and the forward and backward run in ORT's training engine, as
for any ORTModule: op routing, the ATen fallback, the gradient fixes, static-sizes-first, the export cache and the
gradient audit of the first step all apply per graph. Parameters reach the graph as inputs (dynamo lifts them), so
their gradients flow back through autograd to ``param.grad`` as eager's do; optimizers and ``state_dict`` see the
model's own parameters. Under ``torch.no_grad()`` dynamo compiles a graph of its own, which runs ORT's inference
graph. (The other design, AOTAutograd's joint graph with forward and backward each exported to ORT, would use
PyTorch's derivative formulas instead of ORT's gradient builder; it is not built: see docs/plugins/compile_backend.md.)

**Guards and recompiles are torch's**: a call that fails a guard is compiled again by dynamo and comes here as a new
graph module, with a new ORTModule; sizes dynamo marks dynamic arrive as integer inputs and are a dimension of the
ORT graph.

Options: ``torch.compile(..., options={...})`` takes the ORTModule arguments ``exporter``, ``fallback_policy``,
``verify_gradients``, ``opset`` for the graphs of that call; ``ortcore.toml`` and the ORTMODULE_*/ORTCORE_*
variables apply to these ORTModules as to any (``exporter = "dynamo"``, ``ORTCORE_VERIFY_GRADIENTS=0``, ...).
``[plugins.compile_backend] enable = false`` (or ``ORTCORE_DISABLE_PLUGINS=compile_backend``) makes
``backend="ortcore"`` an error naming the switch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch

from ortcore.api import OptionError, ORTCoreError, hookimpl, option, parse_bool

NAME = "compile_backend"
BACKEND = "ortcore"

logger = logging.getLogger("ortcore.compile_backend")

#: The ORTModule arguments ``torch.compile(..., options=...)`` may set.
ORTMODULE_OPTIONS = ("exporter", "fallback_policy", "verify_gradients", "opset")


@attrs.frozen
class CompileBackendOptions:
    """Options of the ``compile_backend`` plugin (defaults of ``torch.compile(backend="ortcore")``)."""

    enable: bool = option(
        True, parse_bool, "torch.compile(backend='ortcore') runs captured graphs in ORT", "ORTCORE_COMPILE_BACKEND"
    )


@hookimpl
def ortcore_options_class() -> type:
    return CompileBackendOptions


# -- the backend ---------------------------------------------------------------------------------------------------

_lock = threading.Lock()
#: Every graph this process compiled, oldest first (for ``compiled_graphs()`` and the report).
_compiled: list[CompiledGraph] = []


@attrs.define(eq=False)
class CompiledGraph:
    """One graph dynamo captured and this backend compiled: its FX module, the ORTModule running it, the options."""

    number: int
    graph_module: torch.fx.GraphModule
    ortmodule: Any
    options: dict[str, Any]
    kept: list[int] = attrs.Factory(list)  # the inputs the ORTModule takes (sizes it reads from shapes left out)
    # Why this graph runs in PyTorch (the graph module itself) since ortcore raised on it, or None.
    in_pytorch: str | None = None

    def __call__(self, *args: Any) -> Any:
        """Run the graph: in ORT, or, once ortcore raised on it (an export, build or audit failure the ORTModule's
        fallback policy let through), as dynamo's graph module in PyTorch, as torch.compile would break there."""
        if self.in_pytorch is None:
            try:
                return self.ortmodule(*(args[i] for i in self.kept) if self.kept else args)
            except ORTCoreError as e:
                self.in_pytorch = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                logger.warning(
                    "torch.compile(backend='ortcore'): graph %d runs in PyTorch from now on: %s",
                    self.number,
                    self.in_pytorch,
                )
        return self.graph_module(*args)

    @property
    def ops(self) -> int:
        return sum(1 for n in self.graph_module.graph.nodes if n.op in ("call_function", "call_method", "call_module"))

    def describe(self) -> str:
        counters = self.ortmodule.state_machine.counters
        why = self.reason_in_pytorch
        where = "PyTorch" if why else "ONNX Runtime"
        return (
            f"graph {self.number}: {self.ops} ops, runs in {where}; exports {counters.exports}, builds "
            f"{counters.builds}, ops on PyTorch's kernels {counters.routed_ops}"
            + (f"; in PyTorch: {why}" if why else "")
        )

    @property
    def reason_in_pytorch(self) -> str | None:
        """Why the graph runs in PyTorch (ortcore raised on it, or its ORTModule fell back), or None."""
        return self.in_pytorch or self.ortmodule.fallback_reason


def compiled_graphs() -> list[CompiledGraph]:
    """The graphs ``backend="ortcore"`` compiled in this process, oldest first."""
    with _lock:
        return list(_compiled)


def graph_break_reasons() -> dict[str, int]:
    """Why dynamo broke the capture, with how often, as torch counted it this process (``torch._dynamo.reset()``
    clears it)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # private API: a report without reasons rather than none
        return {}
    return dict(counters["graph_break"])


def report() -> str:
    """What ``backend="ortcore"`` did in this process: each graph it compiled (ops, where it ran, exports), where
    each op kind of it runs (ORT's kernel or PyTorch's, and why: the ORTModule's ``explain()``), and dynamo's graph
    breaks with torch's reasons."""
    graphs = compiled_graphs()
    lines = [f"torch.compile(backend='ortcore'): {len(graphs)} graph(s) compiled"]
    for graph in graphs:
        lines.append(graph.describe())
        if graph.ortmodule.state_machine.current is not None:
            lines.extend("    " + line for line in str(graph.ortmodule.explain()).splitlines())
    reasons = graph_break_reasons()
    lines.append(f"graph breaks: {sum(reasons.values())}")
    lines.extend(f"  {count} x {reason}" for reason, count in reasons.items())
    return "\n".join(lines)


def reset() -> None:
    """Forget the compiled graphs (``torch._dynamo.reset()`` calls this through the backend's ``reset``)."""
    with _lock:
        _compiled.clear()


def _ortmodule_kwargs(options: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for key, value in dict(options or {}).items():
        if key not in ORTMODULE_OPTIONS:
            raise OptionError(
                f"torch.compile(backend='ortcore', options={{{key!r}: ...}}): unknown option {key!r}; allowed: "
                + ", ".join(ORTMODULE_OPTIONS)
            )
        kwargs[key] = value
    return kwargs


def ortcore_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``torch.compile`` backend: ``gm`` runs as an ORTModule (see the module docstring)."""
    from ortcore.api import ORTModule, disabled_plugins

    if NAME in disabled_plugins():
        raise OptionError(
            "torch.compile(backend='ortcore'): the plugin 'compile_backend' is disabled ([plugins] disable or "
            "ORTCORE_DISABLE_PLUGINS); enable it, or compile with another backend"
        )
    kwargs = _ortmodule_kwargs(options)
    sources = size_sources(gm)
    # Sizes dynamo made symbolic arrive as ints; an ORTModule would export again for each value. They are read from
    # the tensors' shapes instead, a dimension of the ORT graph.
    wrapped = ORTModule(SizesFromShapes(gm, sources) if sources else gm, **kwargs)
    with _lock:
        graph = CompiledGraph(len(_compiled), gm, wrapped, kwargs, kept=[i for i, s in enumerate(sources) if s is None])
        _compiled.append(graph)
    logger.info("torch.compile(backend='ortcore'): %s", graph.describe())
    return graph


def size_sources(gm: torch.fx.GraphModule) -> list[tuple[int, int] | None]:
    """Per placeholder of ``gm``: for a size dynamo made symbolic (an int input), the (placeholder, dimension) of a
    tensor input with that size; None for the others (tensors, and ints no tensor input's shape holds). An empty
    list when no input is such a size."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    found: dict[str, tuple[int, int]] = {}
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt):
                    found.setdefault(str(size.node.expr), (i, d))
    sources = [found.get(str(v.node.expr)) if isinstance(v, torch.SymInt) else None for v in values]
    return sources if any(s is not None for s in sources) else []


class SizesFromShapes(torch.nn.Module):
    """``gm`` called with its tensor inputs only: each symbolic size input is read from the shape of a tensor input
    (:func:`size_sources`), so the exporter traces it as that dimension's size."""

    def __init__(self, gm: torch.fx.GraphModule, sources: list[tuple[int, int] | None]):
        super().__init__()
        self.gm = gm
        self.sources = sources
        self.kept = [i for i, s in enumerate(sources) if s is None]

    def forward(self, *inputs: Any) -> Any:
        full: list[Any] = [None] * len(self.sources)
        for i, value in zip(self.kept, inputs):
            full[i] = value
        for i, source in enumerate(self.sources):
            if source is not None:
                full[i] = full[source[0]].shape[source[1]]
        return self.gm(*full)


ortcore_backend.reset = reset  # torch._dynamo.reset() resets backends that have one
