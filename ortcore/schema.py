"""Input and output schemas: the one place where user arguments and results are flattened and restored.

Everything goes through :mod:`torch.utils._pytree`: a call ``model(*args, **kwargs)`` is bound to the forward
signature (which names each argument), flattened to leaves, and split into tensors (graph inputs) and constants
(baked into the graph, so a changed constant is a changed schema). The model's forward is then called the way the
user called it (:class:`CallForm`): positional arguments positionally, keyword arguments by keyword, omitted
defaults omitted, so that decorators reading ``kwargs`` (Hugging Face's) see the call they would see in PyTorch.
Outputs are flattened the same way after export and restored into the original structure, Hugging Face
``ModelOutput`` types included.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import inspect
import re
import sys
import types
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

    def restored(self) -> Any:
        """The value an output gets back: the constant itself (immutable)."""
        return self.value


@attrs.frozen
class ObjectConstant(Constant):
    """An output object of a class pytree does not know, holding no tensor and no module (a result class with
    flags, an empty cache): its value is the traced one, as for an int or str output. Each call gets a deep copy,
    since PyTorch returns a new object per call and one call's change to it must not reach the next."""

    def restored(self) -> Any:
        return copy.deepcopy(self.value)


@attrs.frozen(eq=False)
class TensorConstant(Constant):
    """A tensor output whose value does not depend on the inputs (``return out, torch.tensor(4096)``): the exporter
    folds it into a constant, which ORT's gradient builder refuses as a graph output, so it leaves the graph and
    returns from here. Each call gets a copy, as PyTorch makes a new tensor per call."""

    device: str = "cpu"

    @property
    def key(self) -> tuple:
        return (self.name, "Tensor", str(self.value.dtype), tuple(self.value.shape), self.value.flatten().tolist())

    def restored(self) -> Any:
        return self.value.to(self.device, copy=True)


def _tensor_or_module_inside(value: Any) -> str | None:
    """Where a tensor or an ``nn.Module`` is inside ``value`` (through containers, ``__dict__`` and ``__slots__``),
    as ``"attribute 'cache.keys' is a Tensor"``; None if there is none."""
    stack: list[tuple[Any, str]] = [(value, "")]
    seen: set[int] = set()
    while stack:
        item, where = stack.pop()
        if isinstance(item, torch.Tensor | torch.nn.Module):
            return f"attribute {where.lstrip('.')!r} is a {type(item).__name__}" if where else type(item).__name__
        if id(item) in seen or isinstance(item, (*_CONSTANT_TYPES, type, types.FunctionType, types.ModuleType)):
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend((v, f"{where}[{k!r}]") for k, v in item.items())
            stack.extend((k, f"{where}<key>") for k in item)
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
        else:
            state = dict(getattr(item, "__dict__", {}))
            for cls in type(item).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(item, slot):
                        state[slot] = getattr(item, slot)
            stack.extend((v, f"{where}.{k}") for k, v in state.items())
    return None


def _output_object(path: tuple, value: Any) -> ObjectConstant:
    """An output leaf of a class pytree does not know, as a constant if nothing in it can change between calls of
    one graph; otherwise an UnsupportedDataError naming the class and how to register it."""
    cls = type(value)
    name = f"{cls.__module__}.{cls.__qualname__}"
    where = "output " + repr("output." + _path_name(path) if path else "output")
    held = _tensor_or_module_inside(value)
    if held is None:
        try:
            copy.deepcopy(value)
        except Exception as e:  # any failure means: cannot be handed out per call
            held = f"it cannot be deep-copied ({type(e).__name__}: {e})"
    else:
        held = f"it holds tensors or modules ({held})"
    if held is not None:
        raise UnsupportedDataError(
            f"ORTModule does not support the following model output type {cls} ({where}): {held}, and ortcore cannot "
            "pass an object of an unknown class through an ONNX graph. Register the class with "
            f"torch.utils._pytree.register_pytree_node({cls.__qualname__}, flatten_fn, unflatten_fn) (or make it a "
            f"dataclass), so that its tensors become graph outputs; {name} is returned as PyTorch returns it only when "
            "it holds no tensor and no module"
        )
    return ObjectConstant(value)


def _path_name(path: tuple, root: str = "input") -> str:
    text = ".".join(re.sub(r"^[\[.(']+|[\])']+$", "", pytree.keystr((k,))) for k in path)
    return re.sub(r"[^0-9A-Za-z_.]", "_", text) or root


def flatten_adapted(tree: Any, what: str = "value") -> tuple[list[tuple[tuple, Any]], pytree.TreeSpec]:
    """Flatten with paths, offering leaf types pytree does not know to LEAF_ADAPTERS (a Hugging Face cache, say)
    and flattening again while one of them registers something. Leaves no adapter takes are returned as they are."""
    for _ in range(8):
        leaves, spec = list(_key_paths((), tree)), pytree.tree_structure(tree)
        unknown = {type(v) for _, v in leaves if not isinstance(v, (torch.Tensor, *_CONSTANT_TYPES))}
        if not any(adapt(t) for t in unknown):
            return leaves, spec
    raise UnsupportedDataError(f"{what} has leaf types that could not be adapted")


def _key_paths(path: tuple, tree: Any) -> Any:
    """``(key path, leaf)`` pairs in ``tree_flatten``'s order, as ``tree_flatten_with_path`` gives them, except that a
    class registered without a ``flatten_with_keys_fn`` (``register_pytree_node(cls, flatten, unflatten)``, which
    error messages advise) numbers its children instead of failing."""
    handler = pytree.SUPPORTED_NODES.get(pytree._get_node_type(tree))  # the one lookup pytree's flatten makes
    if handler is None:
        yield path, tree
        return
    if handler.flatten_with_keys_fn is not None:
        keyed = handler.flatten_with_keys_fn(tree)[0]
    else:
        keyed = [(pytree.SequenceKey(i), c) for i, c in enumerate(handler.flatten_fn(tree)[0])]
    for key, child in keyed:
        yield from _key_paths((*path, key), child)


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


@attrs.frozen
class CallForm:
    """How a call was spelled: the number of positional arguments and the keyword names, in the caller's order.

    Two calls that bind to the same arguments can still differ for the forward: a decorator reading ``kwargs``
    (Hugging Face's ``use_cache`` and ``return_dict`` handling) sees a keyword argument but not a positional one, and
    ``forward(x, use_cache=True)`` called as ``forward(x, True)`` raises "got multiple values" there. So the form is
    part of the schema: each form of call is traced as it was made.
    """

    positional: int
    keywords: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.positional} positional, keywords ({', '.join(self.keywords)})"

    def arguments(self, signature: inspect.Signature, bound: dict[str, Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` as the caller spelled them, from ``bound`` (``BoundArguments.arguments`` of the call,
        with new values)."""
        params = signature.parameters
        args: list[Any] = []
        for name, p in params.items():
            if len(args) >= self.positional:
                break
            if p.kind is p.VAR_POSITIONAL:
                args.extend(bound.get(name, ()))
                break
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                break
            args.append(bound[name])
        var_keyword = next((n for n, p in params.items() if p.kind is p.VAR_KEYWORD), None)
        named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        kwargs = {k: bound[k] if k in named else bound[var_keyword][k] for k in self.keywords}
        return tuple(args), kwargs


@attrs.frozen(eq=False)
class InputSchema:
    """The structure of one call: tree spec, the template of leaves, and a hashable key for the state machine."""

    spec: pytree.TreeSpec
    template: tuple  # TensorSpec for tensor slots, Constant for constant leaves
    names: tuple[str, ...]  # graph input name of each tensor slot
    signature: inspect.Signature | None
    form: CallForm | None = None  # how the call was spelled; None without a signature (the tree is (args, kwargs))

    @property
    def structure(self) -> str:
        """The tree spec and the call's form: a call spelled differently is traced on its own."""
        return repr(self.spec) if self.form is None else f"{self.spec!r} called with {self.form.describe()}"

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
        """Put tensors back into their slots and return ``(args, kwargs)`` for the wrapped module, spelled as the
        call was (:class:`CallForm`)."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(t, TensorSpec) else t.value for t in self.template]
        tree = pytree.tree_unflatten(leaves, self.spec)
        if self.signature is None or self.form is None:
            return tree
        return self.form.arguments(self.signature, tree)


def flatten_inputs(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> tuple[InputSchema, list]:
    """Bind a call to the signature, flatten it, and return its schema and its tensors in slot order.

    Only the arguments the caller passed are bound (defaults are the forward's own business, as in PyTorch); each is
    named after its parameter (``x``, ``args.0``, ``kwargs.attention_mask``) however it was passed."""
    form = None
    if signature is not None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise UnsupportedDataError(f"arguments do not match forward{signature}: {e}") from e
        tree: Any = dict(bound.arguments)
        form = CallForm(len(args), tuple(kwargs))
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
    return InputSchema(spec, tuple(template), _unique(names), signature, form), tensors


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

    def without_outputs(self, constants: dict[int, Constant]) -> OutputSchema:
        """This schema with the tensor outputs numbered in ``constants`` (among the tensor outputs) made constants."""
        template, names, k = [], [], 0
        for slot in self.template:
            if slot is None:
                if k in constants:
                    template.append(constants[k])
                else:
                    template.append(None)
                    names.append(self.names[k])
                k += 1
            else:
                template.append(slot)
        return OutputSchema(self.spec, tuple(template), tuple(names))

    def restore(self, tensors: Sequence[torch.Tensor]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t is None else t.restored() for t in self.template]
        return pytree.tree_unflatten(leaves, self.spec)

    def to_json(self) -> dict[str, Any]:
        """The schema as JSON-able data (for an export cache: data, never code to run).

        Raises ValueError naming what cannot be stored as data: a container type that cannot be found again by its
        import path (a class defined inside a function), a tree context that is not plain data, a constant of
        another type. Example::

            OutputSchema.from_json(json.loads(json.dumps(schema.to_json())))
        """
        data = {
            "spec": treespec_to_json(self.spec),
            "template": [None if t is None else _template_to_json(t) for t in self.template],
            "names": list(self.names),
        }
        if treespec_from_json(data["spec"]) != self.spec:
            raise ValueError(f"the output structure {self.spec} does not survive a round trip through JSON")
        return data

    @classmethod
    def from_json(cls, data: Any) -> OutputSchema:
        """Inverse of :meth:`to_json`. Imports nothing: every container type must already be imported in this
        process (the model's own module imports it). Raises ValueError for malformed data or unknown types."""
        if not isinstance(data, dict) or not isinstance(data.get("template"), list):
            raise ValueError("an output schema must be an object with 'spec', 'template' and 'names'")
        names = data.get("names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("an output schema's 'names' must be a list of strings")
        template = tuple(None if t is None else _template_from_json(t) for t in data["template"])
        spec = treespec_from_json(data.get("spec"))
        if spec.num_leaves != len(template) or sum(t is None for t in template) != len(names):
            raise ValueError(
                f"an output schema with {spec.num_leaves} leaves, {len(template)} template slots and {len(names)} "
                "tensor names is inconsistent"
            )
        return cls(spec, template, tuple(names))


def flatten_outputs(outputs: Any) -> tuple[OutputSchema, list[torch.Tensor]]:
    """Flatten a module's outputs into tensors and a schema that restores them.

    A leaf of a class pytree does not know (after the leaf adapters) is returned as the traced run returned it
    (:class:`ObjectConstant`: a deep copy per call) when it holds no tensor and no module, like an int or str output
    whose value is the trace's; one holding tensors raises UnsupportedDataError naming the class and how to register
    it with ``torch.utils._pytree.register_pytree_node``.
    """
    leaves, spec = flatten_adapted(outputs, "output")
    template, names, tensors = [], [], []
    for path, value in leaves:
        if isinstance(value, torch.Tensor):
            template.append(None)
            names.append("output." + _path_name(path) if path else "output")
            tensors.append(value)
        elif isinstance(value, _CONSTANT_TYPES):
            template.append(Constant(value))
        else:
            template.append(_output_object(path, value))
    return OutputSchema(spec, tuple(template), _unique(names)), tensors


# -- JSON form of tree specs and constants (export caches store data only) --------------------------------------------
# torch's treespec_dumps needs a serialized_type_name on every registration (dataclasses registered by
# register_dataclass have none) and imports the module of any enum it reads back; this form names types by import
# path and resolves them only among modules already imported.
_JSON_SCALARS = (type(None), bool, int, float, str)


def type_path(cls: type) -> str:
    """``module:qualname`` of a class that can be found again by that path; ValueError otherwise."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = resolve_type(path)
    except ValueError:
        found = None
    if found is not cls:
        raise ValueError(f"the type {cls.__module__}.{cls.__qualname__} cannot be found again by its import path")
    return path


def resolve_type(path: Any) -> type:
    """The class named ``module:qualname`` in a module this process has already imported (nothing is imported)."""
    if not isinstance(path, str) or path.count(":") != 1:
        raise ValueError(f"{path!r} is not a type path 'module:qualname'")
    module_name, qualname = path.split(":")
    found: Any = sys.modules.get(module_name)
    if found is None:
        raise ValueError(f"the type {path!r} belongs to module {module_name!r}, which this process has not imported")
    for part in qualname.split("."):
        # The namespace itself, not getattr: a module's __getattr__ (lazy packages) could import more code.
        found = vars(found).get(part) if isinstance(found, type | types.ModuleType) else None
    if not isinstance(found, type):
        raise ValueError(f"the type {path!r} is not a class of module {module_name!r}")
    return found


def _context_to_json(value: Any) -> Any:
    if isinstance(value, _JSON_SCALARS):
        return {"v": value}
    if isinstance(value, list | tuple):
        return {type(value).__name__: [_context_to_json(v) for v in value]}
    if isinstance(value, dict) and type(value) is dict:
        return {"dict": [[_context_to_json(k), _context_to_json(v)] for k, v in value.items()]}
    if isinstance(value, type):
        return {"type": type_path(value)}
    raise ValueError(f"a tree context holds a {type(value).__qualname__}, which is not plain data")


def _context_from_json(data: Any) -> Any:
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"malformed tree context {str(data)[:80]!r}")
    [(tag, value)] = data.items()
    if tag == "v" and isinstance(value, _JSON_SCALARS):
        return value
    if tag in ("list", "tuple") and isinstance(value, list):
        items = [_context_from_json(v) for v in value]
        return items if tag == "list" else tuple(items)
    if tag == "dict" and isinstance(value, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in value):
        return {_context_from_json(k): _context_from_json(v) for k, v in value}
    if tag == "type":
        return resolve_type(value)
    raise ValueError(f"malformed tree context {str(data)[:80]!r}")


def treespec_to_json(spec: pytree.TreeSpec) -> Any:
    """A pytree spec as JSON-able data: each node's type path, context and children (None for a leaf)."""
    if spec.is_leaf():
        return None
    return {
        "type": type_path(spec.type),
        "context": _context_to_json(spec._context),  # TreeSpec keeps the flatten context there; no public accessor
        "children": [treespec_to_json(c) for c in spec.children()],
    }


def treespec_from_json(data: Any) -> pytree.TreeSpec:
    """Inverse of :func:`treespec_to_json`; container types are registered with pytree through the leaf adapters
    (a process that loads a spec never flattened them). Raises ValueError for malformed data or unknown types."""
    if data is None:
        return pytree.tree_structure(0)
    if not isinstance(data, dict) or set(data) != {"type", "context", "children"}:
        raise ValueError(f"malformed tree spec {str(data)[:80]!r}")
    if not isinstance(data["children"], list):
        raise ValueError(f"malformed tree spec {str(data)[:80]!r}")
    cls = resolve_type(data["type"])
    if not adapt(cls):
        raise ValueError(f"the output type {data['type']!r} is not registered with torch.utils._pytree")
    return pytree.TreeSpec(cls, _context_from_json(data["context"]), [treespec_from_json(c) for c in data["children"]])


def _template_to_json(slot: Constant) -> Any:
    if isinstance(slot, TensorConstant):
        value = slot.value
        return {
            "tensor": {
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "values": value.flatten().tolist(),
                "device": slot.device,
            }
        }
    return _constant_to_json(slot.value)


def _template_from_json(data: Any) -> Constant:
    if isinstance(data, dict) and set(data) == {"tensor"} and isinstance(data["tensor"], dict):
        spec = data["tensor"]
        dtype = getattr(torch, str(spec.get("dtype")), None)
        shape, values, device = spec.get("shape"), spec.get("values"), spec.get("device")
        if (
            isinstance(dtype, torch.dtype)
            and isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(values, list)
            and isinstance(device, str)
        ):
            try:
                return TensorConstant(torch.tensor(values, dtype=dtype).reshape(shape), device=device)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"malformed output tensor constant: {e}") from e
        raise ValueError(f"malformed output tensor constant {str(data)[:80]!r}")
    return Constant(_constant_from_json(data))


def _constant_to_json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return {"enum": type_path(type(value)), "name": value.name}
    if isinstance(value, _JSON_SCALARS):
        return {"v": value}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    raise ValueError(f"an output constant of type {type(value).__qualname__} cannot be stored as data")


def _constant_from_json(data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"malformed output constant {str(data)[:80]!r}")
    if set(data) == {"v"} and isinstance(data["v"], _JSON_SCALARS):
        return data["v"]
    if set(data) == {"dtype"} and isinstance(getattr(torch, str(data["dtype"]), None), torch.dtype):
        return getattr(torch, data["dtype"])
    if set(data) == {"device"} and isinstance(data["device"], str):
        return torch.device(data["device"])
    if set(data) == {"enum", "name"}:
        cls = resolve_type(data["enum"])
        if issubclass(cls, enum.Enum) and data["name"] in cls.__members__:
            return cls[data["name"]]
    raise ValueError(f"malformed output constant {str(data)[:80]!r}")
