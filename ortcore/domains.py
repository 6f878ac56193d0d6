"""The ONNX domains of the nodes that run PyTorch inside ORT's graph, and the marker of a traced ``detach``,
defined once for the core and every plugin (through :mod:`ortcore.api`)."""

from __future__ import annotations

# ``org.pytorch.aten::ATen``: one aten op run by PyTorch's kernel (ONNX Runtime's ATen op, run by the ATen executor).
ATEN_DOMAIN = "org.pytorch.aten"
# ``com.microsoft::PythonOp`` / ``PythonOpGrad``: a custom autograd Function's forward and backward run by PyTorch.
PYTHON_OP_DOMAIN = "com.microsoft"
# ``com.ortcore::StopGradient``: a ``detach`` the exporters keep (ONNX, inference-only, would erase it); the core
# resolves it before the gradient build (a detached output becomes non-differentiable).
STOP_GRADIENT_DOMAIN = "com.ortcore"
STOP_GRADIENT = "StopGradient"
