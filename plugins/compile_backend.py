"""compile_backend: ONNX Runtime as a ``torch.compile`` backend for training, ``backend="ortcore"``.

``torch.compile(model, backend="ortcore")`` works without importing ortcore first: the backend is registered in the
entry-point group torch reads for backends (``torch_dynamo_backends``). Dynamo captures the model's Python into FX
graphs, breaking the capture where it must (a ``.item()``, a ``print``, a branch on a tensor's value, a
data-dependent shape) and running that Python in eager between graphs; each captured graph comes here, and runs as
an :class:`ortcore.api.ORTModule` of the graph module.

**Two designs** (``design``). ``ort_gradients``, the default: ORT's gradient builder per captured graph. The graph
module is exported (the configured exporter, TorchScript by default), ORT builds its training graph and the forward
and backward run in ORT's training engine, as for any ORTModule: op routing, the ATen fallback, the gradient fixes,
static-sizes-first, the export cache and the gradient audit of the first step all apply per graph. ``aot_autograd``:
AOTAutograd splits each captured graph into ATen-level forward and backward graphs with PyTorch's derivative
formulas, and each runs as an ORT inference graph (no ORT gradient builder). Parameters reach the graphs as inputs
(dynamo lifts them), so their gradients flow back through autograd to ``param.grad`` as eager's do; optimizers and
``state_dict`` see the model's own parameters. Under ``torch.no_grad()`` dynamo compiles a graph of its own, which
runs ORT's inference graph. Numbers a graph returns are recomputed per call from its tensors' shapes
(:class:`ScalarOutputs`), not traced.

**Guards and recompiles are torch's**: a call that fails a guard is compiled again by dynamo and comes here as a new
graph module, with a new ORTModule; sizes dynamo marks dynamic arrive as integer inputs and are a dimension of the
ORT graph.

Options: ``torch.compile(..., options={...})`` takes ``design`` and the ORTModule arguments ``exporter``,
``fallback_policy``, ``verify_gradients``, ``opset`` for the graphs of that call; ``ortcore.toml`` and the ORTMODULE_*/ORTCORE_*
variables apply to these ORTModules as to any (``exporter = "dynamo"``, ``ORTCORE_VERIFY_GRADIENTS=0``, ...).
``[plugins.compile_backend] enable = false`` (or ``ORTCORE_DISABLE_PLUGINS=compile_backend``) makes
``backend="ortcore"`` an error naming the switch.
"""

from __future__ import annotations

import concurrent.futures
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
#: ``design``: ORT's gradient builder on each captured graph, or AOTAutograd's forward and backward graphs.
ORT_GRADIENTS, AOT_AUTOGRAD = "ort_gradients", "aot_autograd"
DESIGNS = (ORT_GRADIENTS, AOT_AUTOGRAD)


def parse_design(value: Any, source: str = "options['design']") -> str:
    text = str(value).strip().lower()
    if text not in DESIGNS:
        raise OptionError(f"{source}={value!r} is not a compile_backend design; allowed: {', '.join(DESIGNS)}")
    return text


@attrs.frozen
class CompileBackendOptions:
    """Options of the ``compile_backend`` plugin (defaults of ``torch.compile(backend="ortcore")``)."""

    enable: bool = option(
        True, parse_bool, "torch.compile(backend='ortcore') runs captured graphs in ORT", "ORTCORE_COMPILE_BACKEND"
    )
    design: str = option(
        ORT_GRADIENTS,
        parse_design,
        "ort_gradients: ORT's gradient builder per captured graph; aot_autograd: PyTorch's derivatives, AOTAutograd's "
        "forward and backward graphs each an ORT inference graph",
        "ORTCORE_COMPILE_DESIGN",
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
    # "graph" (a captured graph, trained by ORT's gradient builder), or AOTAutograd's "forward", "backward" or
    # "inference" graph (each run by ORT as an inference graph).
    kind: str = "graph"
    kept: list[int] = attrs.Factory(list)  # the inputs the ORTModule takes (sizes it reads from shapes left out)
    # Why this graph runs in PyTorch (the graph module itself) since ortcore raised on it, or None.
    in_pytorch: str | None = None
    # The numbers it returns, recomputed per call from its tensors' shapes (None: they cannot be, see ScalarOutputs).
    scalars: ScalarOutputs | None = attrs.field(
        default=attrs.Factory(lambda self: ScalarOutputs.of(self.graph_module), takes_self=True)
    )

    def __call__(self, *args: Any) -> Any:
        """Run the graph: in ORT, or, once ortcore raised on it (an export, build or audit failure the ORTModule's
        fallback policy let through), as dynamo's graph module in PyTorch, as torch.compile would break there."""
        if self.in_pytorch is None and self.scalars is None:
            self._to_pytorch("it returns a number that depends on a size no tensor input or output of it carries")
        if self.in_pytorch is None:
            try:
                inputs = tuple(args[i] for i in self.kept) if self.kept else args
                if self.kind == "graph":
                    outputs = self.ortmodule(*inputs)
                elif self.ortmodule.state_machine.current is None:
                    # The first call exports. AOTAutograd runs its forward graph inside an autograd.Function's
                    # forward, below autograd, where torch.export's functionalization fails ("Attempting to use
                    # FunctionalTensor on its own"): that call runs in a thread of its own, with fresh dispatch state.
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        outputs = pool.submit(self._inference, inputs).result()
                    mismatch = self._first_call_differs(args, outputs)
                    if mismatch is not None:
                        self._to_pytorch(mismatch)
                        return self.graph_module(*args)
                else:
                    outputs = self._inference(inputs)
                return self.scalars.fill(args, outputs)
            except ORTCoreError as e:
                self._to_pytorch(f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        return self.graph_module(*args)

    def _to_pytorch(self, reason: str) -> None:
        """From now on the graph runs as dynamo's graph module in PyTorch, for ``reason`` (logged at WARNING)."""
        self.in_pytorch = reason
        logger.warning(
            "torch.compile(backend='ortcore'): graph %d runs in PyTorch from now on: %s", self.number, reason
        )

    def _first_call_differs(self, args: tuple, outputs: Any) -> str | None:
        """The check of an AOTAutograd graph's first call, the design's counterpart of the gradient audit (switched
        by ``verify_gradients`` and its tolerances): every output of ORT's run against the graph module run by PyTorch
        on the same inputs. A translation that computes something else than torch (the dynamo exporter's
        ``nll_loss_forward`` total weight, say) would otherwise pass wrong numbers between the forward and backward
        graphs. Returns what differs, or None."""
        core = self.ortmodule.ortcore_config.core
        if not core.verify_gradients:
            return None
        with torch.no_grad():
            expected = self.graph_module(*args)
        expected = expected if isinstance(expected, (tuple, list)) else (expected,)
        actual = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for k, (a, b) in enumerate(zip(actual, expected)):
            if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                return f"output {k} of its first call: {a.dtype}{tuple(a.shape)} in ONNX Runtime, {b.dtype}{tuple(b.shape)} in PyTorch"
            if not b.numel():
                continue
            if b.is_floating_point():
                worst = float((a.double() - b.double()).abs().max())
                allowed = core.verify_gradients_atol + core.verify_gradients_rtol * float(b.abs().max())
                if not worst <= allowed:  # NaN is a difference too
                    return (
                        f"output {k} of its first call differs from PyTorch's: max abs difference {worst:.3g}, allowed "
                        f"{allowed:.3g} (verify_gradients_rtol/atol)"
                    )
            elif not torch.equal(a, b):
                return f"output {k} of its first call differs from PyTorch's ({int((a != b).sum())} values)"
        return None

    def _inference(self, inputs: tuple) -> Any:
        with torch.no_grad():  # AOTAutograd differentiates around these graphs itself
            return self.ortmodule(*inputs)

    @property
    def ops(self) -> int:
        return sum(1 for n in self.graph_module.graph.nodes if n.op in ("call_function", "call_method", "call_module"))

    def describe(self) -> str:
        counters = self.ortmodule.state_machine.counters
        why = self.reason_in_pytorch
        where = "PyTorch" if why else "ONNX Runtime"
        kind = "" if self.kind == "graph" else f" ({self.kind}, AOTAutograd)"
        return (
            f"graph {self.number}{kind}: {self.ops} ops, runs in {where}; exports {counters.exports}, builds "
            f"{counters.builds}, ops on PyTorch's kernels {counters.routed_ops}"
            + (f"; in PyTorch: {why}" if why else "")
        )

    @property
    def reason_in_pytorch(self) -> str | None:
        """Why the graph runs in PyTorch (ortcore raised on it, or its ORTModule fell back), or None."""
        return self.in_pytorch or self.ortmodule.fallback_reason


_NUMBERS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


@attrs.frozen
class ScalarOutputs:
    """How to compute the Python numbers a graph returns (a size the code after a break needs, a data-dependent
    count ``kept.shape[0]``, sizes AOTAutograd saves for the backward) from the shapes of the call's tensors: an
    export would trace each as the constant it was on the exporting call. ``exprs`` maps an output position to its
    value or symbolic expression; ``sources`` maps each symbol to ``("input" | "output", position, dimension)``."""

    exprs: dict[int, Any]
    sources: dict[Any, tuple[str, int, int]]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> ScalarOutputs | None:
        """The plan for ``gm`` (an empty one when it returns no numbers); None when a number depends on a size no
        tensor input or output carries (the graph then runs in PyTorch)."""
        nodes = list(gm.graph.nodes)
        output = next(n for n in reversed(nodes) if n.op == "output")
        values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        vals = [getattr(v, "meta", {}).get("val", getattr(v, "meta", {}).get("example_value")) for v in values]
        exprs = {k: v for k, v in enumerate(vals) if isinstance(v, _NUMBERS)}
        if not exprs:
            return cls({}, {})
        sources: dict[Any, tuple[str, int, int]] = {}
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for side, metas in (
            ("input", [n.meta.get("val", n.meta.get("example_value")) for n in placeholders]),
            ("output", vals),
        ):
            for i, value in enumerate(metas):
                if isinstance(value, torch.Tensor):
                    for d, size in enumerate(value.shape):
                        if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                            sources.setdefault(size.node.expr, (side, i, d))
        for k, value in list(exprs.items()):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                expr = value.node.expr
                if any(symbol not in sources for symbol in expr.free_symbols):
                    return None
                exprs[k] = expr
        return cls(exprs, sources)

    def fill(self, inputs: tuple, outputs: Any) -> Any:
        """``outputs`` with each number recomputed for this call."""
        if not self.exprs:
            return outputs
        import sympy

        values = {
            symbol: sympy.Integer((inputs if side == "input" else outputs)[i].shape[d])
            for symbol, (side, i, d) in self.sources.items()
        }
        filled = list(outputs)
        for k, expr in self.exprs.items():
            if isinstance(expr, (int, float, bool)):
                filled[k] = expr
            else:
                number = expr.xreplace(values)
                filled[k] = bool(number) if number.is_Boolean else int(number) if number.is_Integer else float(number)
        return type(outputs)(filled) if isinstance(outputs, tuple) else filled


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
        if key == "design":
            continue
        if key not in ORTMODULE_OPTIONS:
            raise OptionError(
                f"torch.compile(backend='ortcore', options={{{key!r}: ...}}): unknown option {key!r}; allowed: "
                + ", ".join(("design", *ORTMODULE_OPTIONS))
            )
        kwargs[key] = value
    return kwargs


def _design(options: Mapping[str, Any] | None) -> str:
    """``options["design"]``, else ``[plugins.compile_backend] design`` / ``ORTCORE_COMPILE_DESIGN``."""
    if options and "design" in options:
        return parse_design(options["design"], "torch.compile(backend='ortcore', options={'design': ...})")
    from ortcore.api import load_host

    host, error = load_host()
    if error is not None:
        raise error
    return host.config.plugin_options(NAME).design


def ortcore_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The ``torch.compile`` backend: ``gm`` runs as an ORTModule (see the module docstring)."""
    from ortcore.api import disabled_plugins

    if NAME in disabled_plugins():
        raise OptionError(
            "torch.compile(backend='ortcore'): the plugin 'compile_backend' is disabled ([plugins] disable or "
            "ORTCORE_DISABLE_PLUGINS); enable it, or compile with another backend"
        )
    kwargs = _ortmodule_kwargs(options)
    if _design(options) == AOT_AUTOGRAD:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        # AOTAutograd's graphs are ATen-level (native_layer_norm_backward's bool lists, symbolic scalars): the
        # TorchScript tracer refuses much of them, torch.export takes them.
        aot_kwargs = {"exporter": "dynamo", **kwargs}

        def compiler(kind: str) -> Callable[..., Any]:
            return lambda graph_module, _inputs: make_boxed_func(_compile_graph(graph_module, aot_kwargs, kind))

        return aot_autograd(
            fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), inference_compiler=compiler("inference")
        )(gm, example_inputs)
    return _compile_graph(gm, kwargs, "graph")


def _compile_graph(gm: torch.fx.GraphModule, kwargs: dict[str, Any], kind: str) -> CompiledGraph:
    """``gm`` as an ORTModule: trained by ORT (``kind`` "graph"), or one of AOTAutograd's graphs run as ORT's
    inference graph."""
    from ortcore.api import ORTModule

    sources = size_sources(gm)
    scalars = ScalarOutputs.of(gm)
    numbers = frozenset(scalars.exprs) if scalars is not None else frozenset()
    # Sizes dynamo made symbolic arrive as ints; an ORTModule would export again for each value. They are read from
    # the tensors' shapes instead, a dimension of the ORT graph. Numbers the graph returns are left out of the export
    # (it would trace them as constants) and recomputed per call.
    wrapped = ORTModule(SizesFromShapes(gm, sources, numbers) if sources or numbers else gm, **kwargs)
    with _lock:
        graph = CompiledGraph(
            len(_compiled),
            gm,
            wrapped,
            kwargs,
            kind=kind,
            kept=[i for i, s in enumerate(sources) if s is None],
            scalars=scalars,
        )
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

    def __init__(
        self, gm: torch.fx.GraphModule, sources: list[tuple[int, int] | None], numbers: frozenset[int] = frozenset()
    ):
        super().__init__()
        self.gm = gm
        self.sources = sources
        self.kept = [i for i, s in enumerate(sources) if s is None] if sources else None
        self.numbers = numbers  # outputs that are Python numbers: None here, recomputed per call (ScalarOutputs)

    def forward(self, *inputs: Any) -> Any:
        if self.kept is None:
            full: list[Any] = list(inputs)
        else:
            full = [None] * len(self.sources)
            for i, value in zip(self.kept, inputs):
                full[i] = value
            for i, source in enumerate(self.sources):
                if source is not None:
                    full[i] = full[source[0]].shape[source[1]]
        outputs = self.gm(*full)
        if not self.numbers:
            return outputs
        return type(outputs)(None if k in self.numbers else o for k, o in enumerate(outputs))


ortcore_backend.reset = reset  # torch._dynamo.reset() resets backends that have one
