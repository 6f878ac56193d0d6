"""Which tensor arguments of an ATen op PyTorch's autograd differentiates: a service for every plugin that gives an
op run by PyTorch a gradient (``aten_fallback``'s unexportable-op fallback, ``op_routing``'s routed calls, on both
exporters' routes).

A floating-point tensor argument is not always differentiable: ``fractional_max_pool2d``'s ``random_samples`` and
``binary_cross_entropy``'s ``weight`` are float tensors, yet their autograd kernels raise ("not differentiable with
respect to argument 'random_samples'") when they require grad. A gradient that re-runs such an op under
``torch.autograd`` must leave those arguments alone.

PyTorch's autograd kernels are generated from ``derivatives.yaml``, which torch ships in ``torchgen``: an op listed
there is differentiable with respect to exactly the arguments its entry gives a formula for (``non_differentiable``
is no formula). An op not listed (a composite op, differentiated through what it calls), or not of the ``aten``
namespace, is taken to be differentiable with respect to every floating-point tensor argument.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger("ortcore.aten")

_ENTRY = re.compile(r"^- name: ([A-Za-z0-9_]+)(?:\.([A-Za-z0-9_]+))?\(")
_KEY = re.compile(r"^( +)([A-Za-z_][A-Za-z0-9_, ]*):\s*(.*)$")


def _derivatives_file() -> Path | None:
    spec = importlib.util.find_spec("torchgen")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "packaged" / "autograd" / "derivatives.yaml"
    return path if path.is_file() else None


def parse_derivatives(text: str) -> dict[tuple[str, str], frozenset[str]]:
    """``{(op, overload): names with a gradient formula}`` from the text of ``derivatives.yaml`` (overload
    ``"default"`` for an entry without one). Keys of the ``Default`` dispatch count; other dispatch keys (nested
    tensors) do not. Names that are not arguments (outputs' forward derivatives, ``output_differentiability``) are
    kept: callers intersect with the op's arguments."""
    table: dict[tuple[str, str], set[str]] = {}
    current: set[str] | None = None
    section = ""  # "" at the entry's top level, else the dispatch key being read
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        entry = _ENTRY.match(line)
        if entry:
            current = table.setdefault((entry.group(1), entry.group(2) or "default"), set())
            section = ""
            continue
        key = _KEY.match(line)
        if current is None or key is None:
            continue
        indent, names, formula = len(key.group(1)), key.group(2), key.group(3).strip()
        if indent == 2:
            section = "dispatch" if names == "dispatch" else ""
        elif indent == 4 and section.startswith("dispatch"):
            section = f"dispatch:{names}"
            continue
        if names == "dispatch" or (section.startswith("dispatch") and section != "dispatch:Default"):
            continue
        if formula and formula != "non_differentiable":
            current.update(n.strip() for n in names.split(","))
    return {k: frozenset(v) for k, v in table.items()}


@functools.cache
def _table() -> dict[tuple[str, str], frozenset[str]]:
    path = _derivatives_file()
    if path is None:
        logger.debug("torchgen's derivatives.yaml not found: every float tensor argument is taken as differentiable")
        return {}
    return parse_derivatives(path.read_text(encoding="utf-8"))


def differentiable_arguments(schema: Any) -> frozenset[str] | None:
    """The names of the arguments of the ATen op with ``schema`` (a ``torch.FunctionSchema``) that PyTorch's autograd
    has a gradient formula for, or None when its autograd table does not list the op, or the op is not of the ``aten``
    namespace (then any floating-point tensor argument may be differentiable).

    >>> import torch
    >>> sorted(differentiable_arguments(torch.ops.aten.fractional_max_pool2d.default._schema))
    ['self']
    """
    namespace, _, name = schema.name.rpartition("::")
    if namespace != "aten":
        return None  # the table is aten's (a custom op, a wrapper op: its own autograd)
    names = _table().get((name, schema.overload_name or "default"))
    if names is None:
        return None
    return frozenset(a.name for a in schema.arguments) & names


def differentiates(schema: Any, argument: int) -> bool:
    """May PyTorch's autograd differentiate the ATen op with ``schema`` with respect to its argument number
    ``argument``: has its table a formula for it, or does the table not list the op? (Whether the argument is a
    floating-point tensor is the caller's to check.)

    >>> import torch
    >>> schema = torch.ops.aten.fractional_max_pool2d.default._schema
    >>> [differentiates(schema, k) for k in range(len(schema.arguments))]
    [True, False, False, False]
    """
    names = differentiable_arguments(schema)
    return names is None or schema.arguments[argument].name in names
