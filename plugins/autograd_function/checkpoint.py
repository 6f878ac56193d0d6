"""Reentrant activation checkpointing as a recompute region: the checkpointed function runs in PyTorch as one
PythonOp node of ORT's graph, without keeping its activations, and runs again in backward.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` (the older default, ``checkpoint_sequential``,
Hugging Face's ``gradient_checkpointing_enable()`` with ``use_reentrant=True``) calls
``torch.utils.checkpoint.CheckpointFunction``. While the model is exported, that call is replaced by one call of
:class:`CheckpointRegion`, a Function the plugin exports as PythonOp like any other, whose inputs are the call's
tensors followed by the parameters of the modules ``fn`` reaches (graph inputs: ORT feeds the model's own and returns
their gradients). ``forward`` runs ``fn`` under ``torch.no_grad()`` (nothing of it is kept but its inputs), after
saving the RNG state; ``backward`` restores that state, runs ``fn`` again with autograd and differentiates it: the
same masks as the forward, PyTorch's own recipe.

``fn`` belongs to the copy of the model the exporter traces. After the export it is rebound to the user's modules
(a module, a bound method, a ``functools.partial``, a closure's cells, lists and tuples of these), found through the
deep copy's memo (:func:`export_origin`), and the copy is let go; what cannot be rebound keeps the copy, whose
parameters and buffers are replaced by the user's for each call. Either way the function runs on the model's state:
the parameter inputs' slots hold the tensors ORT feeds in forward and the model's parameters (as fresh leaves) in the
recompute, and in-place updates of buffers (batch norm's running statistics) reach the model, twice per step as in
PyTorch (forward and recompute).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils import _pytree as pytree

from ortcore.api import ROUTED_METADATA_PREFIX, UnsupportedModelError, graph_autocast
from ortcore_plugins.services.autograd_functions import function_apply_replaced, function_name
from ortcore_plugins.services.python_op import untraced

logger = logging.getLogger("ortcore.autograd_function")

TORCH_CHECKPOINT_FUNCTION = "torch.utils.checkpoint.CheckpointFunction"
_ORIGIN_ATTRIBUTE = "_ortcore_export_origin"
_current = threading.local()


# -- the user's tensors behind the traced copy ----------------------------------------------------------------------
class _Origin:
    """Put in the user's module's ``__dict__`` while it is exported. The exporter's ``copy.deepcopy`` hands it the
    copy's memo (``id(user object) -> copy``), which maps every parameter, buffer and module of the traced copy back
    to the user's; without a deep copy (``ORTMODULE_DEEPCOPY_BEFORE_MODEL_EXPORT=0``) the traced model is the user's."""

    # No __dict__: whatever describes the user's module while it is exported sees only the repr.
    __slots__ = ("module", "memo", "calls", "_state", "_users", "_modules")

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.memo: dict | None = None
        self.calls: list[CheckpointCall] = []  # the checkpoint calls traced in this export
        self._state: list | None = None
        self._users: dict[int, torch.Tensor] | None = None
        self._modules: dict[int, torch.nn.Module] | None = None

    def __deepcopy__(self, memo: dict) -> _Origin:
        self.memo = memo
        return self

    def __repr__(self) -> str:
        return "<ortcore export origin>"

    def _copy_of(self, obj: Any) -> Any:
        return obj if self.memo is None else self.memo.get(id(obj), obj)

    def user_module(self, traced: torch.nn.Module) -> torch.nn.Module:
        if self.memo is None:
            return traced
        if self._modules is None:
            self._modules = {id(self._copy_of(m)): m for m in self.module.modules()}
        return self._modules.get(id(traced), traced)

    def to_user(self, obj: Any, depth: int = 0) -> Any:
        """``obj`` (the checkpointed function, or what it holds) with the traced copy's modules replaced by the
        user's: a module, a bound method's object, a ``functools.partial``'s function and arguments, a closure's
        cells, lists and tuples of these. What it cannot rebind keeps the copy's modules, which run on the user's
        state (:meth:`state`)."""
        if self.memo is None or depth > 6:
            return obj
        if isinstance(obj, torch.nn.Module):
            return self.user_module(obj)
        if isinstance(obj, types.MethodType):
            return types.MethodType(obj.__func__, self.to_user(obj.__self__, depth + 1))
        if isinstance(obj, functools.partial):
            return functools.partial(
                self.to_user(obj.func, depth + 1),
                *(self.to_user(a, depth + 1) for a in obj.args),
                **{k: self.to_user(v, depth + 1) for k, v in obj.keywords.items()},
            )
        if isinstance(obj, types.FunctionType) and obj.__closure__:
            cells = []
            for cell in obj.__closure__:
                try:
                    cells.append(types.CellType(self.to_user(cell.cell_contents, depth + 1)))
                except ValueError:  # an empty cell
                    cells.append(cell)
            function = types.FunctionType(obj.__code__, obj.__globals__, obj.__name__, obj.__defaults__, tuple(cells))
            function.__kwdefaults__ = obj.__kwdefaults__
            function.__dict__.update(obj.__dict__)
            return function
        if type(obj) in (list, tuple):
            return type(obj)(self.to_user(item, depth + 1) for item in obj)
        return obj

    def release(self) -> None:
        """After the export: each call's function and parameter slots rebound to the user's modules. When no
        rebound function reaches the traced copy any more, the copy is let go (the graph's calls live as long as the
        process, and the copy holds a full copy of the weights); otherwise its slots keep the user's state
        swapped in at each run (:meth:`state`)."""
        if self.memo is None:
            return
        for call in self.calls:
            call.rebind()
        copies = {id(self._copy_of(m)) for m in self.module.modules()} - {id(m) for m in self.module.modules()}
        if not any(id(m) in copies for call in self.calls for m in reached_modules(call.function)):
            self._state = []
            self.memo = self._users = self._modules = None
            for call in self.calls:
                call.copy_slots = []

    def state(self) -> list[tuple[dict, str, torch.Tensor]]:
        """Every parameter and buffer slot of the traced copy, with the user's tensor for it."""
        if self._state is None:
            self._state = [
                (getattr(self._copy_of(user), table), name, tensor)
                for user in self.module.modules()
                for table in ("_parameters", "_buffers")
                for name, tensor in getattr(user, table).items()
                if tensor is not None
            ]
        return self._state

    def user_tensor(self, traced: torch.Tensor) -> torch.Tensor:
        """The user's tensor behind a traced copy's parameter."""
        if self._users is None:
            self._users = {id(table[name]): user for table, name, user in self.state() if name in table}
        return self._users.get(id(traced), traced)


@contextlib.contextmanager
def export_origin(module: torch.nn.Module) -> Iterator[None]:
    """Around one export of ``module`` (the plugin's ``ortcore_export_context``): lets checkpoint calls traced in the
    copy find the user's tensors."""
    origin = _Origin(module)
    previous = getattr(_current, "origin", None)
    module.__dict__[_ORIGIN_ATTRIBUTE] = origin
    _current.origin = origin
    try:
        yield
    finally:
        module.__dict__.pop(_ORIGIN_ATTRIBUTE, None)
        _current.origin = previous
        origin.release()


@contextlib.contextmanager
def _slots(entries: list[tuple[dict, str, torch.Tensor]]) -> Iterator[None]:
    """Each ``table[name]`` set to its tensor for the block, restored after."""
    saved = []
    try:
        for table, name, tensor in entries:
            saved.append((table, name, table.get(name)))
            table[name] = tensor
        yield
    finally:
        for table, name, before in reversed(saved):
            table[name] = before


# -- what the checkpointed function reaches -------------------------------------------------------------------------
def reached_modules(function: Any, extra: tuple = ()) -> list[torch.nn.Module]:
    """The modules ``function`` can call: itself, the object of a bound method, what a ``functools.partial`` binds,
    a closure's cells, defaults, the module-level names its code reads, and containers of these, recursively."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.setdefault(id(obj), obj)
            return
        if isinstance(obj, torch.Tensor | str | bytes | int | float | bool | type(None)):
            return
        if isinstance(obj, list | tuple | set | frozenset):
            for item in obj:
                visit(item, depth + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
            return
        if isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
            visit(obj.args, depth + 1)
            visit(obj.keywords, depth + 1)
            return
        owner = getattr(obj, "__self__", None)
        if owner is not None and not isinstance(owner, type):
            visit(owner, depth + 1)
        inner = getattr(obj, "__func__", None) or getattr(obj, "__wrapped__", None)
        if inner is not None:
            visit(inner, depth + 1)
        code = getattr(obj, "__code__", None)
        if code is not None:
            for cell in getattr(obj, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            visit(getattr(obj, "__defaults__", None), depth + 1)
            visit(getattr(obj, "__kwdefaults__", None), depth + 1)
            names = getattr(obj, "__globals__", {})
            for name in code.co_names:
                value = names.get(name)
                if isinstance(value, torch.nn.Module | list | tuple | dict):
                    visit(value, depth + 1)
        elif not callable(obj) or owner is not None:
            return
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):  # a callable object: its attributes
            visit(vars(obj), depth + 1)

    visit(function, 0)
    visit(extra, 0)
    return list(found.values())


def _parameters(modules: list[torch.nn.Module]) -> list[tuple[torch.Tensor, list[tuple[torch.nn.Module, str]]]]:
    """The parameters of ``modules`` and their submodules, once each, with every slot naming it (frozen ones too:
    whether one requires grad is not known while torch.export traces; ORT says which gradients it needs)."""
    owners: dict[int, tuple[torch.Tensor, list[tuple[torch.nn.Module, str]]]] = {}
    for module in modules:
        for sub in module.modules():
            for name, param in sub._parameters.items():
                if param is not None:
                    owners.setdefault(id(param), (param, []))[1].append((sub, name))
    return list(owners.values())


# -- one call -------------------------------------------------------------------------------------------------------
@attrs.define(eq=False)
class CheckpointCall:
    """One traced ``checkpoint(function, *args)`` call: how to rebuild the arguments from the node's tensors, which
    parameter slots the node's parameter inputs fill, and the structure of the outputs (learnt at export)."""

    function: Callable[..., Any]
    preserve_rng_state: bool
    origin: _Origin
    in_spec: Any
    leaves: list  # non-tensor arguments in place; tensors are None here
    tensor_positions: list[int]
    slots: list[list[tuple[torch.nn.Module, str]]]  # per parameter input, the traced copy's slots it fills
    out_spec: Any = None
    out_leaves: list | None = None
    out_positions: list[int] = attrs.field(factory=list)
    warned: bool = False  # no tensor argument required grad: said once
    checked: bool = False  # the first recompute checked that no other parameter of the model is reached
    cell_indices: list[int] = attrs.field(factory=list)  # closure cells holding tensors, fed as inputs
    rebound: bool = False  # function and slots are the user's (after the export)
    copy_slots: list = attrs.field(factory=list)  # the traced copy's slots, while a rebound function still reaches it

    def arguments(self, tensors: tuple) -> tuple[tuple, dict, tuple]:
        """The positional and keyword arguments (a ``functools.partial``'s included) and the closure cells' tensors."""
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        args, kwargs, cells = pytree.tree_unflatten(leaves, self.in_spec)
        return args, kwargs, cells

    def call_function(self, tensors: tuple) -> Any:
        args, kwargs, cells = self.arguments(tensors)
        function = self.function
        if self.cell_indices:  # tensors the function closes over: this call's, not the export's
            closure = list(function.__closure__)
            for index, tensor in zip(self.cell_indices, cells):
                closure[index] = types.CellType(tensor)
            function = types.FunctionType(
                function.__code__, function.__globals__, function.__name__, function.__defaults__, tuple(closure)
            )
        return function(*args, **kwargs)

    def state(self, params: tuple, running: bool) -> list[tuple[dict, str, torch.Tensor]]:
        """The slots to fill for one run: at a step, the traced copy's with the user's state and the parameter
        inputs' slots in both the copy and the user's model; while exporting, the copy's parameter inputs."""
        entries = list(self.origin.state()) if running else []
        for k, tensor in enumerate(params):
            slots = self.slots[k] + (self.copy_slots[k] if running and self.copy_slots else [])
            entries.extend((module._parameters, name, tensor) for module, name in slots)
        return entries

    def rebind(self) -> None:
        """The function and the parameter slots on the user's modules (:meth:`_Origin.release`)."""
        if not self.rebound:
            self.function = self.origin.to_user(self.function)
            self.leaves = [self.origin.to_user(leaf) for leaf in self.leaves]  # a partial's module argument, say
            self.copy_slots = self.slots
            self.slots = [[(self.origin.user_module(m), name) for m, name in slots] for slots in self.slots]
            self.rebound = True

    def traced_parameter(self, k: int) -> torch.Tensor:
        module, name = self.slots[k][0]
        return module._parameters[name]

    def run(self, tensors: tuple, params: tuple, running: bool) -> list[torch.Tensor]:
        if running:
            self.rebind()
        with _slots(self.state(params, running)), graph_autocast():
            output = self.call_function(tensors)
        out_leaves, out_spec = pytree.tree_flatten(output)
        positions = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, torch.Tensor)]
        if self.out_spec is None:
            self.out_spec, self.out_positions = out_spec, positions
            self.out_leaves = [None if i in positions else leaf for i, leaf in enumerate(out_leaves)]
        elif out_spec != self.out_spec or positions != self.out_positions:
            raise RuntimeError(
                f"the checkpointed function {_name(self.function)} returned another output structure than when it "
                f"was exported ({out_spec} instead of {self.out_spec})"
            )
        return [out_leaves[i] for i in positions]

    def rebuild(self, tensors: tuple) -> Any:
        leaves = list(self.out_leaves or [])
        for position, tensor in zip(self.out_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.out_spec)


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__qualname__


def _exporting(tensors: tuple) -> bool:
    """Whether this run traces the model (TorchScript's tracer, or torch.export's fake tensors)."""
    if torch._C._get_tracing_state() is not None:
        return True
    return any(isinstance(t, torch._subclasses.FakeTensor) for t in tensors) or (
        torch._guards.detect_fake_mode() is not None
    )



def _rng_states(tensors: tuple) -> tuple[torch.Tensor, list, list]:
    devices = sorted({t.device for t in tensors if t.device.type not in ("cpu", "meta")}, key=str)
    gpu = [d for d in devices if d.type == "cuda"]
    return torch.get_rng_state(), gpu, [torch.cuda.get_rng_state(d) for d in gpu]


@contextlib.contextmanager
def _rng_restored(states: tuple[torch.Tensor, list, list] | None) -> Iterator[None]:
    """The forward's RNG state for the recompute (the same dropout masks), the caller's kept (forked) after."""
    if states is None:
        yield
        return
    cpu, devices, device_states = states
    with torch.random.fork_rng(devices=devices, enabled=True, device_type="cuda" if devices else "cpu"):
        torch.set_rng_state(cpu)
        for device, state in zip(devices, device_states):
            torch.cuda.set_rng_state(state, device)
        yield


def _pointer(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.data_ptr() if tensor.numel() else None
    except RuntimeError:  # a fake tensor
        return None


class CheckpointRegion(torch.autograd.Function):
    """A checkpointed call: ``forward(call, *tensors)``, ``tensors`` being the call's tensor arguments then the
    parameter inputs. Forward keeps only the tensor arguments; backward runs the function again and differentiates
    it (as ``torch.utils.checkpoint.CheckpointFunction`` does)."""

    @staticmethod
    def forward(ctx: Any, call: CheckpointCall, *tensors: torch.Tensor) -> Any:
        n = len(call.tensor_positions)
        args, params = tensors[:n], tensors[n:]
        exporting = _exporting(tensors)
        tracing = torch._C._get_tracing_state() is not None
        ctx.rng = _rng_states(args) if call.preserve_rng_state and not exporting else None
        with untraced(), torch.no_grad():
            outputs = call.run(tuple(a.detach() for a in args), tuple(p.detach() for p in params), not exporting)
            pointers = {_pointer(t) for t in tensors} - {None}
            results = [o.detach().clone() if _pointer(o) in pointers else o.detach() for o in outputs]
        if tracing and tensors:
            # As region routing does: the tracer links outputs made from inputs to values it traced; the function ran
            # untraced, so hand it fresh tensors holding the values.
            placeholders = [tensors[0].new_empty([int(d) for d in r.shape], dtype=r.dtype) for r in results]
            with untraced(), torch.no_grad():
                for placeholder, result in zip(placeholders, results):
                    placeholder.copy_(result)
            results = placeholders
        ctx.call = call
        ctx.save_for_backward(*args)
        ctx.mark_non_differentiable(*(r for r in results if not (r.is_floating_point() or r.is_complex())))
        return tuple(results) if len(results) != 1 else results[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        call: CheckpointCall = ctx.call
        n = len(call.tensor_positions)
        args = tuple(
            a.detach().requires_grad_(ctx.needs_input_grad[1 + i] and (a.is_floating_point() or a.is_complex()))
            for i, a in enumerate(ctx.saved_tensors)
        )
        # PyTorch's reentrant checkpoint differentiates nothing when no tensor argument requires grad (its
        # parameters get no gradient from it, with a warning): the same here, ORT saying which inputs need one.
        differentiable = any(a.requires_grad for a in args)
        if not differentiable and call.slots and not call.warned:
            call.warned = True
            logger.warning(
                "checkpoint(%s): none of its tensor arguments requires grad, so (as in PyTorch's reentrant "
                "checkpoint) its parameters get no gradient from it",
                _name(call.function),
            )
        params = tuple(
            call.origin.user_tensor(call.traced_parameter(k))
            .detach()
            .requires_grad_(differentiable and ctx.needs_input_grad[1 + n + k])
            for k in range(len(call.slots))
        )
        with _rng_restored(ctx.rng), torch.enable_grad():
            outputs = call.run(args, params, True)
        if not call.checked:
            _check_reached(call, outputs)
            call.checked = True
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        leaves = [*args, *params]
        wanted = [i for i, leaf in enumerate(leaves) if leaf.requires_grad]
        result: list[torch.Tensor | None] = [None] * len(leaves)
        if pairs and wanted:
            found = torch.autograd.grad(
                [o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs], allow_unused=True
            )
            for i, grad in zip(wanted, found):
                result[i] = grad
        ctx.call = ctx.rng = None
        return (None, *result)


def _check_reached(call: CheckpointCall, outputs: list[torch.Tensor], traced: bool = False) -> None:
    """The function reached no parameter of the model that is not an input of the node (its gradient would be
    lost): a function that finds its modules in a way :func:`reached_modules` does not follow is named. ``traced``:
    ``outputs`` were computed with the traced copy's parameters (at export), else with the user's."""
    origin = call.origin
    names = {
        id(origin._copy_of(t) if traced else t): f"{path}.{name}" if path else name
        for path, m in origin.module.named_modules()
        for name, t in m._parameters.items()
        if t is not None
    }
    missed: list[str] = []
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in names:
            missed.append(names[id(variable)])
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    if missed:
        raise UnsupportedModelError(
            f"the checkpointed function {_name(call.function)} uses parameters {', '.join(sorted(set(missed)))} that "
            "ortcore did not find among the modules it reaches (its object, closure, defaults or module globals), so "
            "their gradients would be lost. Pass the module as the checkpointed function (checkpoint(module, x)) or "
            "close over it, or set ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=inline to export the checkpointed layers into "
            "the graph"
        )


def _refuse_captured_tensors(function: Any) -> None:
    """A tensor a function defined in the forward holds elsewhere than in a partial or its own closure (a default
    argument, a nested closure) would be the export's value at every step: refused, naming where."""
    seen: set[int] = set()

    def visit(obj: Any, where: str, depth: int) -> None:
        if depth > 6 or id(obj) in seen or isinstance(obj, torch.nn.Module | torch.nn.Parameter | type):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            raise UnsupportedModelError(
                f"the checkpointed function {_name(function)} holds a tensor in {where}: as a recompute region it "
                "would use the value it had when the model was exported at every step. Pass the tensor as an "
                "argument of checkpoint(fn, *args), bind it with functools.partial, or close over it directly"
            )
        if isinstance(obj, list | tuple):
            for k, item in enumerate(obj):
                visit(item, f"{where}[{k}]", depth + 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                visit(item, f"{where}[{key!r}]", depth + 1)
        elif isinstance(obj, types.MethodType):
            visit(obj.__func__, where, depth + 1)
        elif isinstance(obj, types.FunctionType) and "<locals>" in obj.__qualname__:
            # (A function defined once, at module or class level, holds the same tensors at every call.)
            visit(obj.__defaults__ or (), f"{where} defaults", depth + 1)
            visit(obj.__kwdefaults__ or {}, f"{where} keyword defaults", depth + 1)
            if depth:  # the outer function's own cells are fed as inputs
                for cell in obj.__closure__ or ():
                    try:
                        visit(cell.cell_contents, f"{where} closure", depth + 1)
                    except ValueError:
                        pass

    visit(function, "the function", 0)


def _check_at_export(call: CheckpointCall, tensors: tuple) -> None:
    """One untraced run of the function with autograd on the traced copy, to name a parameter it reaches that is not
    an input of the node before the model runs (RNG and autograd state left as they were)."""
    with untraced(), torch.random.fork_rng(), torch.enable_grad():
        args = tuple(t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors)
        params = tuple(call.traced_parameter(k).detach().requires_grad_(True) for k in range(len(call.slots)))
        outputs = call.run(args, params, False)
        _check_reached(call, outputs, traced=True)
    call.checked = True


def checkpoint_region(args: tuple, kwargs: dict) -> Any:
    """In place of ``CheckpointFunction.apply(function, preserve_rng_state, *args)`` while a model is exported: one
    :class:`CheckpointRegion` call."""
    if kwargs:
        raise UnsupportedModelError(
            f"torch.utils.checkpoint's CheckpointFunction was called with keyword arguments {sorted(kwargs)}: "
            "reentrant checkpointing passes positional arguments only"
        )
    function, preserve_rng_state, *rest = args
    # PyTorch's rule on what is differentiated looks at the call's own tensor arguments.
    differentiable = any(t.requires_grad for t in pytree.tree_leaves(rest) if isinstance(t, torch.Tensor))
    # Tensors bound in a functools.partial (Hugging Face binds a layer's keyword arguments, its attention mask among
    # them) or held in the function's closure change at every call: they are inputs of the node, not constants.
    positional, keywords = tuple(rest), {}
    while isinstance(function, functools.partial):
        positional, keywords = function.args + positional, {**function.keywords, **keywords}
        function = function.func
    cell_indices, cells = [], []
    for index, cell in enumerate(getattr(function, "__closure__", None) or ()):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(content, torch.Tensor) and not isinstance(content, torch.nn.Parameter):
            cell_indices.append(index)
            cells.append(content)
    _refuse_captured_tensors(function)
    origin = getattr(_current, "origin", None)
    if origin is None:
        raise UnsupportedModelError(
            "reentrant activation checkpointing was met outside an ortcore export (no export origin): cannot map the "
            "checkpointed function's parameters"
        )
    leaves, spec = pytree.tree_flatten((positional, keywords, tuple(cells)))
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in positions]
    params = _parameters(reached_modules(function, (positional, keywords)))
    call = CheckpointCall(
        function=function,
        preserve_rng_state=bool(preserve_rng_state),
        origin=origin,
        in_spec=spec,
        leaves=[None if i in positions else leaf for i, leaf in enumerate(leaves)],
        tensor_positions=positions,
        slots=[slots for _, slots in params],
        cell_indices=cell_indices,
    )
    origin.calls.append(call)
    if torch._C._get_tracing_state() is not None:  # the TorchScript route checks now, the dynamo route at the recompute
        _check_at_export(call, tuple(tensors))
    inputs = [p for p, _ in params]
    if torch._C._get_tracing_state() is not None and not differentiable:
        # PyTorch's reentrant checkpoint differentiates nothing when no tensor argument requires grad: its outputs
        # do not require grad either, so neither do later checkpoints fed only by them. The TorchScript tracer knows
        # what requires grad: the parameters enter detached, and ORT differentiates nothing through the node. (The
        # dynamo route's fake tensors do not say; there backward gives these parameters no gradient.)
        inputs = [p.detach() for p in inputs]
    outputs = CheckpointRegion.apply(call, *tensors, *inputs)
    return call.rebuild(outputs if isinstance(outputs, tuple) else (outputs,))


@contextlib.contextmanager
def checkpoints_run_directly() -> Iterator[None]:
    """Inside, on this thread, a reentrant checkpoint call runs its function directly (PyTorch's reentrant
    checkpoint refuses ``torch.autograd.grad``, which the gradient audit's PyTorch side uses; the values and
    gradients are the same, recomputation aside)."""

    def apply(cls, original, args, kwargs):
        if function_name(cls) == TORCH_CHECKPOINT_FUNCTION and not kwargs:
            function, _preserve_rng_state, *rest = args
            if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(rest)):
                with torch.no_grad():  # as the reentrant checkpoint: nothing differentiated
                    return function(*rest)
            return function(*rest)
        return original(cls, *args, **kwargs)

    with function_apply_replaced(apply):
        yield


REGION_REASON = (
    "checkpointed functions (torch.utils.checkpoint, use_reentrant=True): run in PyTorch without keeping their "
    "activations, recomputed in backward (autograd_function)"
)


def describe_regions(model: Any, _context: Any) -> None:
    """A graph pass: ``model.explain()`` gives checkpoint regions' PythonOp nodes their reason."""
    qualified = f"{CheckpointRegion.__module__}.{CheckpointRegion.__qualname__}"
    props = {p.key for p in model.metadata_props}
    for node in model.graph.node:
        if node.op_type != "PythonOp":
            continue
        name = next((a.s.decode() for a in node.attribute if a.name == "func_name"), "")
        if not name.startswith(qualified):
            continue
        key = ROUTED_METADATA_PREFIX + name.split(":")[0].rpartition(".")[2]  # the name explain shows
        if key not in props:
            model.metadata_props.add(key=key, value=REGION_REASON)
            props.add(key)
