"""Region routing: chosen submodules run in PyTorch as one node of the ONNX Runtime graph.

Op routing (:mod:`ortcore_plugins.op_routing`) moves one op to PyTorch; some things are not one op: complex-valued
code, a Python loop, value-dependent Python, a block whose forward the exporter computes wrongly. A *region* is a
submodule the exporter does not trace into. Its call becomes one custom ``torch.autograd.Function``
(:class:`RegionFunction`) whose inputs are the call's tensors followed by the submodule's parameters, so
the ``autograd_function`` plugin exports it as a ``com.microsoft::PythonOp`` node that ORT calls back into. Forward
runs the submodule with PyTorch (``torch.func.functional_call`` on the tensors ORT feeds, which are the model's own
parameters, by DLPack); backward is PyTorch's autograd through that forward. Gradients of the region's parameters
leave the ORT graph as every parameter's gradient does and land in ``param.grad``; optimizers and ``state_dict`` see
the model unchanged. Everything around the region stays in ORT.

Regions come from option ``modules`` (``[plugins.region_routing] modules = ["encoder.layer.0.attn"]``, env
``ORTCORE_PYTORCH_MODULES``, comma-separated paths as ``named_modules()`` names them) and from repairs
(:func:`ortcore_repairs`): when export, the gradient build, a first run or the gradient audit fails inside a module,
the core asks plugins how to repair the failure, and this plugin answers by running the innermost module that holds
the failure in PyTorch (op routing, a smaller change, is asked first). Needs the ``autograd_function`` plugin (with
``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0`` the region is traced through, said once at WARNING).
"""

from __future__ import annotations

import contextlib
import difflib
import logging
from collections.abc import Iterator
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from ortcore.api import Config, Failure, OptionError, Repair, graph_autocast, hookimpl, option
from ortcore_plugins.services.python_op import untraced

logger = logging.getLogger("ortcore.region_routing")

NAME = "region_routing"
ENV_MODULES = "ORTCORE_PYTORCH_MODULES"


def parse_module_paths(value: object, source: str) -> tuple[str, ...]:
    """Submodule paths: a list, or one comma-separated string (``""`` names none)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise OptionError(
            f"{source}={value!r} must be a list of submodule paths as named_modules() names them, e.g. "
            '["encoder.layer.0.attention"]'
        )
    return tuple(dict.fromkeys(value))


@attrs.frozen
class RegionRoutingOptions:
    modules: tuple[str, ...] = option(
        (),
        parse_module_paths,
        "submodules (paths as in named_modules()) that run in PyTorch as one node of the ORT graph",
        ENV_MODULES,
    )


def _options(config: Config) -> RegionRoutingOptions:
    return config.plugin_options(NAME) or RegionRoutingOptions()


@attrs.define(eq=False)
class RegionCall:
    """One traced call of a region: which submodule of the user's model runs, how to rebuild its arguments from the
    node's tensors, and the structure of its outputs (learnt when the call first runs)."""

    path: str
    module: torch.nn.Module  # the user's submodule (not the traced copy): its own code runs at every step
    in_spec: Any
    leaves: list  # the call's non-tensor arguments in place; tensors are None here
    tensor_positions: list[int]
    state_names: list[tuple[str, ...]]  # each state input's names in the module (tied weights have several)
    out_spec: Any = None
    out_leaves: list | None = None  # non-tensor outputs in place; tensors are None here
    out_positions: list[int] = attrs.field(factory=list)

    def run(self, tensors: tuple[torch.Tensor, ...]) -> tuple:
        """The submodule's outputs, flat: its tensors' leaves, computed by PyTorch."""
        n = len(self.tensor_positions)
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors[:n]):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        with _own_forward(self.module), _state_swapped(self.module, self.state_names, tensors[n:]):
            output = self.module(*args, **kwargs)
        out_leaves, out_spec = pytree.tree_flatten(output)
        positions = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        if self.out_spec is None:
            self.out_spec, self.out_positions = out_spec, positions
            self.out_leaves = [None if i in positions else leaf for i, leaf in enumerate(out_leaves)]
        elif out_spec != self.out_spec or positions != self.out_positions:
            raise RuntimeError(
                f"region {self.path!r} returned another output structure than when it was exported "
                f"({out_spec} instead of {self.out_spec})"
            )
        return tuple(out_leaves[i] for i in positions)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        leaves = list(self.out_leaves or [])
        for position, tensor in zip(self.out_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.out_spec)


@contextlib.contextmanager
def _own_forward(module: torch.nn.Module) -> Iterator[None]:
    """The module's own ``forward`` while its call runs inside the export (where :func:`regions` replaced it)."""
    replaced = module.__dict__.get("forward")
    if not isinstance(replaced, _RegionForward):
        yield
        return
    del module.forward
    try:
        yield
    finally:
        module.forward = replaced


@contextlib.contextmanager
def _state_swapped(
    module: torch.nn.Module, names: list[tuple[str, ...]], tensors: tuple[torch.Tensor, ...]
) -> Iterator[None]:
    """``module``'s parameters replaced by ``tensors`` (each under every name it has: tied weights)
    for the call. ``torch.func.functional_call`` does the same but refuses to run inside a TorchScript trace."""
    saved = []
    try:
        for aliases, tensor in zip(names, tensors):
            for name in aliases:
                owner_path, _, attr = name.rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                table = owner._parameters
                saved.append((table, attr, table[attr]))
                table[attr] = tensor
        yield
    finally:
        for table, attr, before in reversed(saved):
            table[attr] = before



def _pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr() if tensor.numel() else None
    except RuntimeError:  # a fake tensor while torch.export traces: no storage to alias
        return None


class RegionFunction(torch.autograd.Function):
    """A region's call: forward with PyTorch, backward by PyTorch's autograd through that forward.

    ``forward(call, *tensors)``: ``tensors`` are the call's tensor arguments, then the submodule's parameters (graph
    inputs, so ORT feeds the model's own and returns their gradients)."""

    @staticmethod
    def forward(ctx: Any, call: RegionCall, *tensors: torch.Tensor) -> Any:
        tracing = torch._C._get_tracing_state() is not None
        with untraced(), torch.enable_grad():
            leaves = [
                t.detach().requires_grad_(t.requires_grad and (t.is_floating_point() or t.is_complex()))
                for t in tensors
            ]
            with graph_autocast():  # the module's code runs under the autocast state the graph was exported under
                outputs = call.run(tuple(leaves))
            pointers = {_pointer(t) for t in tensors} - {None}
            results = []
            for out in outputs:
                result = out.detach()
                if _pointer(result) in pointers:  # ORT must own its outputs: no aliases of inputs
                    result = result.clone()
                results.append(result)
        if tracing and tensors:
            # The TorchScript tracer records the Function's body as a subgraph and links its outputs to values it
            # traced: outputs made from an input (their values copied in untraced) are such values. The region's
            # own code ran untraced, as in PyTorch (code that traces differently from how it runs cannot break it).
            placeholders = [tensors[0].new_empty([int(d) for d in r.shape], dtype=r.dtype) for r in results]
            with untraced(), torch.no_grad():
                for placeholder, result in zip(placeholders, results):
                    placeholder.copy_(result)
            results = placeholders
        ctx.leaves, ctx.outputs = leaves, outputs
        ctx.mark_non_differentiable(*(r for r in results if not (r.is_floating_point() or r.is_complex())))
        return tuple(results) if len(results) != 1 else results[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, leaf in enumerate(ctx.leaves) if leaf.requires_grad and ctx.needs_input_grad[i + 1]]
        result: list[torch.Tensor | None] = [None] * len(ctx.leaves)
        if pairs and wanted:
            found = torch.autograd.grad(
                [o for o, _ in pairs], [ctx.leaves[i] for i in wanted], [g for _, g in pairs], allow_unused=True
            )
            for i, grad in zip(wanted, found):
                result[i] = grad
        ctx.leaves = ctx.outputs = None
        return (None, *result)


class _RegionForward:
    """Stands in for a region's ``forward`` while the model is exported. Deep copies (the exporter traces a copy)
    follow the copy: the traced parameters are the copy's, the code that runs at every step the user's module's."""

    def __init__(self, path: str, traced: torch.nn.Module, user_module: torch.nn.Module):
        self.path, self.traced, self.user_module = path, traced, user_module

    def __deepcopy__(self, memo: dict) -> _RegionForward:
        return _RegionForward(self.path, memo.get(id(self.traced), self.traced), self.user_module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        state: dict[int, tuple[torch.Tensor, list[str]]] = {}  # one input per tensor, with all its names
        # Parameters only: buffers stay the user's module's own, so that what the forward updates in place (batch
        # norm's running statistics) is updated in the model (ORT's PythonOp hands the Function copies of inputs).
        for name, tensor in self.traced.named_parameters(remove_duplicate=False):
            state.setdefault(id(tensor), (tensor, []))[1].append(name)
        call = RegionCall(
            path=self.path,
            module=self.user_module,
            in_spec=spec,
            leaves=[None if i in positions else leaf for i, leaf in enumerate(leaves)],
            tensor_positions=positions,
            state_names=[tuple(names) for _, names in state.values()],
        )
        outputs = RegionFunction.apply(call, *(leaves[i] for i in positions), *(t for t, _ in state.values()))
        return call.rebuild(outputs if isinstance(outputs, tuple) else (outputs,))


def _check_paths(module: torch.nn.Module, paths: tuple[str, ...]) -> None:
    known = [name for name, _ in module.named_modules() if name]
    for path in paths:
        if path not in known:
            close = difflib.get_close_matches(path, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {', '.join(known[:8]) or 'none'}"
            raise OptionError(f"region_routing: {type(module).__name__} has no submodule {path!r}{hint}")


@contextlib.contextmanager
def regions(module: torch.nn.Module, paths: tuple[str, ...]) -> Iterator[None]:
    """While exporting, each submodule named in ``paths`` is called as one :class:`RegionFunction`."""
    _check_paths(module, paths)
    patched = []
    try:
        for path in paths:
            sub = module.get_submodule(path)
            before = sub.__dict__.get("forward", _ABSENT)
            sub.forward = _RegionForward(path, sub, sub)
            patched.append((sub, before))
        if paths:
            logger.info("running in PyTorch inside the ORT graph: %s", ", ".join(paths))
        yield
    finally:
        for sub, before in reversed(patched):
            if before is _ABSENT:
                del sub.forward
            else:
                sub.forward = before


_ABSENT = object()


# -- hooks ----------------------------------------------------------------------------------------------------------


@hookimpl
def ortcore_options_class() -> type:
    return RegionRoutingOptions


@hookimpl
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any:
    paths = _options(config).modules
    return regions(module, paths) if paths else None


@hookimpl
def ortcore_export_key(config: Config) -> dict[str, Any]:
    paths = _options(config).modules
    return {"region_routing.modules": sorted(paths)} if paths else {}


@hookimpl(trylast=True)
def ortcore_repairs(config: Config, failure: Failure) -> list[Repair]:
    """The innermost module that holds the failure runs in PyTorch (never the whole model: that is the fallback)."""
    present = _options(config).modules
    repairs = []
    # First every innermost module found at once (one failure repeated in every layer is one repair), then each
    # candidate alone, innermost first.
    inner = [p for p in failure.innermost if p not in present and not any(p.startswith(q + ".") for q in present)]
    if len(inner) > 1:
        kept = [p for p in present if not any(p.startswith(q + ".") for q in inner)]
        repairs.append(
            Repair(
                description=f"modules {', '.join(inner)} run in PyTorch",
                plugin=NAME,
                options={"modules": [*kept, *inner]},
                region=", ".join(inner),
            )
        )
    for path in failure.modules:
        if not path or path in present:
            continue
        # A region inside another region is already in PyTorch; a region around one replaces it.
        kept = [p for p in present if not p.startswith(path + ".")]
        if any(path.startswith(p + ".") for p in kept):
            continue
        repairs.append(
            Repair(
                description=f"module {path} runs in PyTorch",
                plugin=NAME,
                options={"modules": [*kept, path]},
                region=path,
            )
        )
    return repairs
