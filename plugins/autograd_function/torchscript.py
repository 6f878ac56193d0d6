"""The TorchScript route of the plugin: the traced ``prim::PythonOp`` of a Function call, exported by the
``prim::PythonOp`` symbolic (the handler's ``export``), becomes the PythonOp node, its types and ranks read from the
TorchScript values.

Everything the TorchScript exporter alone needs is here: without that exporter, this module goes.
"""

from __future__ import annotations

import torch

from ortcore.api import UnsupportedModelError
from ortcore_plugins.services.autograd_functions import function_name
from ortcore_plugins.services.python_op import PYTHON_OP, PYTHON_OP_DOMAIN, install_runners, registry

from .shared import BOOL, _dim_sources, python_op_attributes


def _onnx_dtype(value) -> int:
    from torch.onnx._internal.torchscript_exporter import _type_utils

    return int(_type_utils.JitScalarType.from_value(value, _type_utils.JitScalarType.UNDEFINED).onnx_type())


def _sizes(value) -> list[int | None]:
    try:
        return list(value.type().sizes() or [])
    except (RuntimeError, AttributeError):  # no shape was recorded
        return []


def export_python_op(function: type, g, node, args):
    """One traced call of ``function`` as the PythonOp node (the handler's ``export``): boolean outputs leave it as
    uint8 and are cast back."""
    install_runners()
    convention = node.cconv()
    if len(convention) != len(args):
        raise UnsupportedModelError(
            f"{function_name(function)}: {len(args)} arguments but calling convention {convention!r}"
        )
    tensors = [arg for arg, kind in zip(args, convention) if kind == "d"]
    types = [_onnx_dtype(arg) for arg in tensors]
    bool_inputs = tuple(i for i, kind in enumerate(convention) if kind == "d" and _onnx_dtype(args[i]) == BOOL)
    outputs = list(node.outputs())
    attributes = python_op_attributes(
        registry.key(function, bool_inputs),
        convention,
        [a for a, kind in zip(args, convention) if kind != "d"],
        types,
        [arg.type().dim() or 0 for arg in tensors],
        [_onnx_dtype(o) for o in outputs],
        [o.type().dim() or 0 for o in outputs],
        _dim_sources([_sizes(v) for v in node.inputs()], [_sizes(o) for o in outputs]),
    )
    typed = {f"{name}_s" if isinstance(value, str) else f"{name}_i": value for name, value in attributes.items()}
    results = g.op(f"{PYTHON_OP_DOMAIN}::{PYTHON_OP}", *tensors, outputs=len(outputs) + 1, **typed)
    results[0].setType(torch._C.TensorType.get().with_dtype(torch.int64))
    values = []
    for result, output in zip(results[1:], outputs):
        if _onnx_dtype(output) == BOOL:
            result.setType(output.type().with_dtype(torch.uint8))
            result = g.op("Cast", result, to_i=BOOL)
        result.setType(output.type())
        values.append(result)
    return values if len(values) > 1 else values[0]
