"""dynamo_exporter: the ``dynamo`` exporter, ``torch.export`` + onnxscript (``torch.onnx.export(dynamo=True)``)
behind the core's exporter seam.

Chosen by name: ``exporter = "dynamo"`` in ortcore.toml, ``ORTCORE_EXPORTER=dynamo``, or
``ORTModule(model, exporter="dynamo")``; ortcore also takes it by itself on a torch without the TorchScript exporter.

The seam's contract (``ortcore.exporter.Exporter``) holds as on the TorchScript route:

* **Parameters and buffers are graph inputs** under their ``state_dict`` names. ``torch.export`` would lift them
  into initializers; instead the module is called through ``torch.func.functional_call`` with them as arguments, so
  the graph takes them as inputs (tied parameters once, under their first name, as ``named_parameters`` gives them).
* **Input dimensions are dynamic where the model allows it** (``torch.export.Dim.AUTO``): batch and sequence
  changes reuse the graph; a dimension the model fixes (a feature size a weight multiplies) stays static.
* **ORT's gradient builders' expectations**: ``LayerNormalization`` gets its mean and inverse-std outputs and
  ``SoftmaxCrossEntropyLoss`` its log-probability output when the exporter left them out (their gradients read
  them).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import time
import warnings
from typing import Any

import onnx
import torch

from ortcore.errors import UnsupportedModelError
from ortcore.exporter import DYNAMO, raised_in
from ortcore.hookspecs import hookimpl
from ortcore.options import LogLevel

NAME = "dynamo_exporter"

logger = logging.getLogger("ortcore")

# Outputs ORT's gradient builders read, by op type: (outputs the op must have, names of the ones added).
_REQUIRED_OUTPUTS = {"LayerNormalization": 3, "SoftmaxCrossEntropyLoss": 2}


class _ParametersAsInputs(torch.nn.Module):
    """``module`` called with its parameters and buffers taken from the trailing arguments."""

    def __init__(self, module: torch.nn.Module, n_inputs: int, state_names: list[str]):
        super().__init__()
        object.__setattr__(self, "target", module)  # not a submodule: its tensors must not be lifted as constants
        self.n_inputs = n_inputs
        self.state_names = state_names

    def forward(self, *args: torch.Tensor) -> Any:
        inputs, state = args[: self.n_inputs], args[self.n_inputs :]
        return torch.func.functional_call(self.target, dict(zip(self.state_names, state)), inputs)


def _missing_package() -> str | None:
    for package in ("onnxscript",):
        try:
            importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return package
    return None


def add_required_outputs(model: onnx.ModelProto) -> int:
    """Give ``LayerNormalization`` and ``SoftmaxCrossEntropyLoss`` nodes the outputs ORT's gradients read; returns
    how many outputs were added."""
    added = 0
    for index, node in enumerate(model.graph.node):
        wanted = _REQUIRED_OUTPUTS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if wanted is None:
            continue
        for k in range(len(node.output), wanted):
            node.output.append(f"ortcore.dynamo::{node.op_type}_{index}_out{k}")
            added += 1
        for k in range(wanted):
            if node.output[k] == "":
                node.output[k] = f"ortcore.dynamo::{node.op_type}_{index}_out{k}"
                added += 1
    return added


class DynamoExporter:
    """``torch.onnx.export(dynamo=True)`` with parameters as inputs; see the module docstring."""

    name = DYNAMO

    def __init__(self, optimize: bool = True):
        self.optimize = optimize

    def fingerprint(self) -> dict[str, Any]:
        versions = {}
        for package in ("onnxscript", "onnx-ir"):
            try:
                versions[package] = importlib.metadata.version(package)
            except importlib.metadata.PackageNotFoundError:
                versions[package] = None
        return {"optimize": self.optimize, **versions}

    def export(
        self,
        module: torch.nn.Module,
        args: tuple[torch.Tensor, ...],
        *,
        input_names: list[str],
        output_names: list[str],
        dynamic_axes: dict[str, dict[int, str]],
        training: bool,
        opset: int,
        log_level: LogLevel,
    ) -> onnx.ModelProto:
        missing = _missing_package()
        if missing is not None:
            raise UnsupportedModelError(
                f"the dynamo exporter needs the package {missing!r}, which is not installed: pip install {missing} "
                '(or ortcore[all]), or choose exporter = "torchscript"'
            )
        state: dict[str, torch.Tensor] = dict(module.named_parameters())
        state.update(module.named_buffers())
        names = list(state)
        wrapper = _ParametersAsInputs(module, len(args), names)
        wrapper.training = training
        values = tuple(state[n].detach() for n in names)
        dims = tuple(
            {d: torch.export.Dim.AUTO for d in range(t.dim())} if name in dynamic_axes else None
            for name, t in zip(input_names, args)
        )
        quiet = contextlib.ExitStack()
        if log_level > LogLevel.INFO:
            quiet.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            for name in ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes"):
                quiet.enter_context(_level(logging.getLogger(name), logging.ERROR))
        start = time.perf_counter()
        try:
            with quiet:
                program = torch.onnx.export(
                    wrapper,
                    tuple(args) + values,
                    dynamo=True,
                    input_names=list(input_names) + names,
                    output_names=list(output_names) or None,
                    dynamic_shapes=(dims + (None,) * len(values),),
                    opset_version=max(opset, 18),
                    optimize=self.optimize,
                    verbose=log_level == LogLevel.VERBOSE,
                    report=False,
                )
        except UnsupportedModelError:
            raise
        except Exception as e:  # torch.export and onnxscript raise many types; all mean "this model did not export"
            text = _first_line(e)
            raise UnsupportedModelError(
                f"the dynamo exporter could not export {type(module).__name__}: {text}",
                raised_in_forward=e if raised_in(e, type(module).forward) else None,
            ) from e
        model = program.model_proto
        added = add_required_outputs(model)
        logger.log(
            15, "dynamo export: %.2f s, %d nodes, %d outputs added for ORT's gradients", time.perf_counter() - start,
            len(model.graph.node), added,
        )  # fmt: skip
        return model


def _first_line(error: BaseException) -> str:
    """The line of a torch.export / onnxscript error that says what failed (their messages open with advice)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("<class ") or "Error" in line.split(":")[0]:
            return line
    cause = error.__cause__
    if cause is not None and str(cause).strip():
        return str(cause).strip().splitlines()[0]
    return lines[0] if lines else type(error).__name__


@contextlib.contextmanager
def _level(log: logging.Logger, level: int):
    previous = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(previous)


@hookimpl
def ortcore_exporters(config: Any) -> dict[str, Any]:
    return {DYNAMO: lambda config: DynamoExporter()}
