"""Input and output schemas: the one place where user arguments and results are flattened and restored.

Everything goes through :mod:`torch.utils._pytree`: a call ``model(*args, **kwargs)`` is bound to the forward
signature (defaults filled in), flattened to leaves, and split into tensors (graph inputs) and constants (baked
into the graph, so a changed constant is a changed schema). Outputs are flattened the same way after export and
restored into the original structure, Hugging Face ``ModelOutput`` types included.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.utils._pytree as pytree

from .errors import UnsupportedDataError

# Non-tensor leaves that can be baked into a graph as constants (and compared by value).
_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, enum.Enum)

def register_dataclass(cls: type) -> bool:
    """Dataclasses are flattened field by field."""
    if dataclasses.is_dataclass(cls):
        pytree.register_dataclass(cls)
        return True
    return False


# Called with the type of an object that pytree treats as a leaf but that is neither a tensor nor a constant;
# returns True if it registered the type with pytree (a Hugging Face cache, say). Plugins append to this list.
LEAF_ADAPTERS: list[Callable[[type], bool]] = [register_dataclass]


def adapt(cls: type) -> bool:
    """Offer ``cls`` to the leaf adapters; True once pytree knows it."""
    return cls in pytree.SUPPORTED_NODES or any(adapter(cls) for adapter in LEAF_ADAPTERS)


@attrs.frozen
class TensorSpec:
    """What of a tensor shapes the graph: dtype, rank, device and requires_grad; never the sizes (dynamic axes)."""

    dtype: torch.dtype
    ndim: int
    device: str
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tensor.dtype, tensor.dim(), str(tensor.device), tensor.requires_grad)


@attrs.frozen
class Constant:
    """A non-tensor leaf; its value is part of the schema."""

    value: Any
    name: str = ""

    @property
    def key(self) -> tuple:
        return (self.name, type(self.value).__name__, repr(self.value))


def _path_name(path: tuple, root: str = "input") -> str:
    text = ".".join(re.sub(r"^[\[.(']+|[\])']+$", "", pytree.keystr((k,))) for k in path)
    return re.sub(r"[^0-9A-Za-z_.]", "_", text) or root


def flatten_adapted(tree: Any, what: str = "value") -> tuple[list[tuple[tuple, Any]], pytree.TreeSpec]:
    """Flatten with paths, offering leaf types pytree does not know to LEAF_ADAPTERS (a Hugging Face cache, say)
    and flattening again while one of them registers something. Leaves no adapter takes are returned as they are."""
    for _ in range(8):
        leaves, spec = pytree.tree_flatten_with_path(tree)
        unknown = {type(v) for _, v in leaves if not isinstance(v, (torch.Tensor, *_CONSTANT_TYPES))}
        if not any(adapt(t) for t in unknown):
            return leaves, spec
    raise UnsupportedDataError(f"{what} has leaf types that could not be adapted")


def _flatten(tree: Any, what: str) -> tuple[list[tuple[tuple, Any]], pytree.TreeSpec]:
    """Flatten with paths and adapted leaf types (:func:`flatten_adapted`); name the first leaf ortcore cannot pass."""
    leaves, spec = flatten_adapted(tree, what)
    for path, value in leaves:
        if not isinstance(value, (torch.Tensor, *_CONSTANT_TYPES)):
            raise UnsupportedDataError(
                f"{what} {_path_name(path, what)!r} is a {type(value).__module__}.{type(value).__qualname__}, which "
                "ortcore cannot pass through an ONNX graph; allowed: tensors, nested tuples/lists/dicts, dataclasses "
                "and ModelOutputs of them, None, and int/float/bool/str constants (register other types with "
                "torch.utils._pytree.register_pytree_node)"
            )
    return leaves, spec


@attrs.frozen(eq=False)
class InputSchema:
    """The structure of one call: tree spec, the template of leaves, and a hashable key for the state machine."""

    spec: pytree.TreeSpec
    template: tuple  # TensorSpec for tensor slots, Constant for constant leaves
    names: tuple[str, ...]  # graph input name of each tensor slot
    signature: inspect.Signature | None

    @property
    def structure(self) -> str:
        return repr(self.spec)

    @property
    def constants(self) -> tuple:
        """The constant leaves as ``(name, type, repr)``, compared by name, type and value."""
        return tuple(t.key for t in self.template if isinstance(t, Constant))

    @property
    def tensors(self) -> tuple:
        """``(name, dtype, rank, device)`` per tensor slot; requires_grad is kept apart (it needs no re-export)."""
        return tuple((n, t.dtype, t.ndim, t.device) for n, t in zip(self.names, self.tensor_specs))

    @property
    def tensor_specs(self) -> list[TensorSpec]:
        return [t for t in self.template if isinstance(t, TensorSpec)]

    @property
    def requires_grad(self) -> tuple[bool, ...]:
        return tuple(t.requires_grad for t in self.tensor_specs)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        """Put tensors back into their slots and return ``(args, kwargs)`` for the wrapped module."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(t, TensorSpec) else t.value for t in self.template]
        tree = pytree.tree_unflatten(leaves, self.spec)
        if self.signature is None:
            return tree
        bound = inspect.BoundArguments(self.signature, tree)
        return bound.args, bound.kwargs


def flatten_inputs(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[InputSchema, list]:
    """Bind a call to the signature, flatten it, and return its schema and its tensors in slot order."""
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise UnsupportedDataError(f"arguments do not match forward{signature}: {e}") from e
        bound.apply_defaults()
        tree: Any = dict(bound.arguments)
    else:
        tree = (tuple(args), dict(kwargs))
    leaves, spec = _flatten(tree, "input")
    template, names, tensors = [], [], []
    for path, value in leaves:
        if isinstance(value, torch.Tensor):
            template.append(TensorSpec.of(value))
            names.append(_path_name(path))
            tensors.append(value)
        else:
            template.append(Constant(value, _path_name(path)))
    return InputSchema(spec, tuple(template), _unique(names), signature), tensors


def _unique(names: list[str]) -> tuple[str, ...]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n] - 1}")
    return tuple(out)


@attrs.frozen(eq=False)
class OutputSchema:
    """How to restore the module's outputs: the tree spec and the constants between the tensor leaves."""

    spec: pytree.TreeSpec
    template: tuple  # None for a tensor slot, Constant otherwise
    names: tuple[str, ...]

    def register_types(self) -> None:
        """Make sure pytree knows every container type in the outputs (a process that loaded this schema from a
        cache never flattened them); raises UnsupportedDataError naming those no adapter knows."""
        stack, missing = [self.spec], []
        while stack:
            spec = stack.pop()
            if not spec.is_leaf():
                if not adapt(spec.type):
                    missing.append(f"{spec.type.__module__}.{spec.type.__qualname__}")
                stack.extend(spec.children())
        if missing:
            raise UnsupportedDataError(f"output types {missing} are not registered with torch.utils._pytree")

    def restore(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t is None else t.value for t in self.template]
        return pytree.tree_unflatten(leaves, self.spec)


def flatten_outputs(outputs: Any) -> tuple[OutputSchema, list[torch.Tensor]]:
    """Flatten a module's outputs into tensors and a schema that restores them."""
    leaves, spec = _flatten(outputs, "output")
    template, names, tensors = [], [], []
    for path, value in leaves:
        if isinstance(value, torch.Tensor):
            template.append(None)
            names.append("output." + _path_name(path) if path else "output")
            tensors.append(value)
        else:
            template.append(Constant(value))
    return OutputSchema(spec, tuple(template), _unique(names)), tensors
