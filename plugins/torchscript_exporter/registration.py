"""The exporter's symbolics in torch's process-wide registry of TorchScript symbolics, one model's set at a time."""

from __future__ import annotations

from typing import Any

import torch

_registered: dict[tuple[str, int], Any] = {}


def _drop_if_empty(name: str) -> None:
    """Forget torch's entry for an op left with no symbolic at all (one only a plugin's symbolic exported, such as
    aten_fallback's ``::cummax``): torch's lookup would fail on it with "min() arg is an empty sequence" instead of
    the "operator 'aten::cummax' ... is not supported" error that names the op."""
    try:
        from torch.onnx._internal.torchscript_exporter import registration
    except ImportError:  # another torch layout: its registry then keeps the empty entry (errors name the op less well)
        return
    qualified = f"aten{name}" if name.startswith("::") else name
    group = registration.registry.get_function_group(qualified)
    if group is not None and not list(group._functions):
        registration.registry._registry.pop(qualified, None)


def register_symbolics(symbolics: dict[str, Any], opset: int) -> None:
    """Make exactly ``symbolics`` ortcore's custom symbolics for ``opset``.

    torch's registry is process-wide: symbolics another ORTModule's plugins registered are removed first, so one
    model's plugins never change how another model exports. That includes those registered for other opsets: a
    symbolic registered for opset 14 serves every later opset too.
    """
    for name, registered_opset in list(_registered):
        if registered_opset != opset or name not in symbolics:
            torch.onnx.unregister_custom_op_symbolic(name, registered_opset)
            _drop_if_empty(name)
            del _registered[(name, registered_opset)]
    for name, fn in symbolics.items():
        if _registered.get((name, opset)) is not fn:
            torch.onnx.register_custom_op_symbolic(name, fn, opset)
            _registered[(name, opset)] = fn
