"""autograd_function on the dynamo route: custom torch.autograd.Functions run as PythonOp (their own backward) when
the model is exported by torch.export + onnxscript, compared with PyTorch itself.

Every model runs with ``ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE`` (nothing falls back to PyTorch silently) and
is compared with an eager deep copy. Tolerances are the parity suite's (fp32: rtol 1e-4, atol 1e-5 for outputs and
gradients; loss curves rtol 1e-4).
"""

from __future__ import annotations

import logging
from typing import Any

import onnx
import pytest
import torch
import torch.utils.checkpoint
from models import (
    ATOL,
    RTOL,
    assert_close,
    assert_grads_match,
    assert_losses_match,
    assert_outputs_match,
    assert_ran_in_ort,
    check_step_and_training,
    make_batches,
    ort_and_torch,
)
from torch import nn
from torch.autograd import Function

import ortcore_plugins.autograd_function as plugin
import ortcore_plugins.dynamo_exporter as dynamo
import ortcore_plugins.services.python_op as python_op
from ortcore import ORTModule
from ortcore.config import Config
from ortcore.errors import UnsupportedModelError
from ortcore.host import PluginHost
from ortcore_plugins.services.autograd_functions import function_name

from .test_autograd_function import (  # the TorchScript route's test models
    BlockNet,
    InplaceScale,
    KeepWhere,
    SignMask,
    bloom_batch,
    bloom_step,
    checkpoint_step,
    step,
)

pytest.importorskip("onnxscript")

PLUGINS = {plugin.NAME: plugin, dynamo.NAME: dynamo}
NO_FALLBACK = {"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}


@pytest.fixture
def host(ortcore_host, monkeypatch):
    """``host(env=...)``: the two plugins, fallback disabled (in the host's environment and the process's)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

    def factory(env: dict[str, str] | None = None) -> Any:
        return ortcore_host(PLUGINS, env={**NO_FALLBACK, **(env or {})})

    return factory


def on_dynamo(model: nn.Module, host: Any) -> tuple[ORTModule, nn.Module]:
    return ort_and_torch(model, host=host, exporter="dynamo")


def python_ops(ort: ORTModule) -> list[onnx.NodeProto]:
    """The PythonOp nodes of the forward graph the last call ran."""
    graph = ort.state_machine.current[0]
    return [n for n in graph.model.graph.node if n.op_type == "PythonOp" and n.domain == "com.microsoft"]


def func_names(ort: ORTModule) -> list[str]:
    return [next(a.s.decode() for a in n.attribute if a.name == "func_name") for n in python_ops(ort)]


# -- the Functions --------------------------------------------------------------------------------------------------
class Double(Function):
    """Forward doubles, backward triples: differentiating the forward would give 2, the Function's backward 3."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3


class Tag:
    """An object passed to a Function by reference."""

    def __init__(self, factor: float):
        self.factor = factor


class Mix(Function):
    """Two tensor inputs, two outputs; int, float, tuple, None and object arguments; save_for_backward and
    needs_input_grad; a backward that scales the product's gradient by 1.5 (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x, w, offset: int, scale: float, dims: tuple, nothing: None, tag: Tag):
        assert isinstance(offset, int) and dims == (1,) and nothing is None and isinstance(tag, Tag)
        ctx.save_for_backward(x, w)
        ctx.scale, ctx.dim, ctx.factor = scale, dims[0], tag.factor
        return x * w * scale + offset, (x * x).sum(dims) * tag.factor

    @staticmethod
    def backward(ctx, grad_y, grad_s):
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = 1.5 * grad_y * w * ctx.scale + 2 * x * ctx.factor * grad_s.unsqueeze(ctx.dim)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y * x * ctx.scale).sum(0)
        return grad_x, grad_w, None, None, None, None, None


class SetupContextMul(Function):
    """The forward-without-ctx style, called with a keyword argument."""

    @staticmethod
    def forward(x, w, bias=None):
        out = x * w
        return out if bias is None else out + bias

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, _bias = inputs
        ctx.save_for_backward(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0), None


FUNCTION_NAMES = sorted(function_name(f) for f in (Double, Mix, InplaceScale, SignMask, SetupContextMul))


class FunctionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.w = nn.Parameter(torch.randn(16) * 0.5)
        self.out = nn.Linear(16, 4)
        self.tag = Tag(0.5)

    def forward(self, x):
        h = self.inp(x)
        h, s = Mix.apply(h, self.w, 2, 0.1, (1,), None, self.tag)
        h = InplaceScale.apply(h, 1.5)
        h, mask, index = SignMask.apply(h)
        h = Double.apply(h * 0.2)
        h = SetupContextMul.apply(h, self.w, bias=None)
        return self.out(torch.tanh(h)) + 0.01 * s.unsqueeze(-1) + 0.0 * mask.sum(-1, keepdim=True), index


def batch(gen: torch.Generator, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 12, generator=gen), torch.randn(n, 4, generator=gen)


class UsesDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Double.apply(self.fc(x)).sum()


# -- PythonOp -------------------------------------------------------------------------------------------------------


def steps_match(ort: nn.Module, ref: nn.Module, sizes: tuple[int, ...]) -> None:
    """One step per batch size on ``randn(n, 4)``: loss and every gradient equal torch's."""
    for n in sizes:
        x = torch.randn(n, 4)
        loss, loss_ref = ort(x), ref(x)
        assert_losses_match(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(ort, ref)
        ort.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_backward_is_the_functions_own_not_the_forwards_derivative(host):
    ort, ref = on_dynamo(UsesDouble(), host())
    x = torch.randn(3, 4)
    loss, loss_ref = ort(x), ref(x)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    torch.testing.assert_close(ort.fc.bias.grad, torch.full((4,), 9.0))  # 3 rows x backward's 3, not forward's 2
    assert func_names(ort) == [f"{__name__}.Double"]
    assert_ran_in_ort(ort, exports=1)


def test_functions_match_torch_with_python_ops(host):
    ort, ref = on_dynamo(FunctionNet(), host())
    x = torch.randn(16, 12, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    (out, index), (out_ref, index_ref) = ort(x), ref(x_ref)
    assert_outputs_match((out, index), (out_ref, index_ref))
    loss, loss_ref = out.square().mean(), out_ref.square().mean()
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert_close(x.grad, x_ref.grad, "grad of the input", "grads")
    assert sorted(func_names(ort)) == FUNCTION_NAMES
    assert_ran_in_ort(ort, exports=1)


def test_batch_size_change_reuses_the_graph(host):
    ort, ref = on_dynamo(FunctionNet(), host())
    gen = torch.Generator().manual_seed(0)
    for n in (16, 5, 9):
        data = batch(gen, n)
        (out, _), loss = step(ort, data)
        (out_ref, _), loss_ref = step(ref, data)
        assert out.shape == (n, 4)
        assert_outputs_match(out, out_ref)
        assert_losses_match(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(ort, ref)
        ort.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert_ran_in_ort(ort, exports=2)  # the first call's sizes, then one graph dynamic in the batch
    graph = ort.state_machine.current[0].model
    batch_dims = {i.type.tensor_type.shape.dim[0].dim_param for i in graph.graph.input if i.name.startswith("x")}
    assert all(batch_dims), batch_dims  # the batch dimension is symbolic, through every PythonOp


def test_adamw_loss_curve_matches_torch(host):
    ort, ref = on_dynamo(FunctionNet(), host())
    check_step_and_training(ort, ref, make_batches(batch, 9), step, steps=8)
    assert_ran_in_ort(ort, exports=1)


def test_needs_input_grad_follows_what_ort_differentiates(host):
    seen = []

    class Record(Function):
        @staticmethod
        def forward(ctx, x, w):
            seen.append(tuple(ctx.needs_input_grad))
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            assert ctx.needs_input_grad[0] == x.requires_grad
            return (grad * w if ctx.needs_input_grad[0] else None), (grad * x).sum(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))

        def forward(self, x):
            return Record.apply(x, self.w).sum()

    ort, ref = on_dynamo(Model(), host())
    x = torch.randn(2, 3)
    ort(x).backward()
    ref(x).backward()
    assert seen[-2:] == [(False, True), (False, True)]  # ORT's call and torch's
    x_grad, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    ort(x_grad).backward()
    ref(x_ref).backward()
    assert seen[-2:] == [(True, True), (True, True)]
    assert_close(x_grad.grad, x_ref.grad, "grad of the input", "grads")
    assert_grads_match(ort, ref)


def test_inference_matches_torch_and_keeps_no_context(host):
    ort, ref = on_dynamo(FunctionNet(), host())
    x = torch.randn(5, 12)
    with torch.no_grad():
        assert_outputs_match(ort(x), ref(x))
    ort.eval()
    ref.eval()
    with torch.no_grad():
        assert_outputs_match(ort(x), ref(x))
    assert python_op.held_contexts() == []
    assert_ran_in_ort(ort)


class BoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 4)

    def forward(self, x):
        kept, strong = KeepWhere.apply(self.inp(x), x[:, :4] > 0)
        return torch.where(strong, 2.0 * kept, kept), strong.sum(-1)


def test_boolean_tensors_in_and_out_match_torch(host):
    ort, ref = on_dynamo(BoolNet(), host())
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)


class Outer(Function):
    """Calls another Function in its forward: that one runs in PyTorch, inside the outer PythonOp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return Double.apply(x) + 1.0

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 5 * torch.ones_like(x)


def test_function_calling_a_function_runs_as_one_python_op(host):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return Outer.apply(self.fc(x)).sum()

    ort, ref = on_dynamo(Model(), host())
    x = torch.randn(3, 4)
    loss, loss_ref = ort(x), ref(x)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert func_names(ort) == [f"{__name__}.Outer"]


def test_node_is_the_torchscript_routes(ortcore_host):
    """The same attributes on both routes, except the addresses of objects passed by reference."""
    nodes = {}
    for route in ("torchscript", "dynamo"):
        ort = ORTModule(FunctionNet(), host=ortcore_host(PLUGINS), exporter=route, fallback_policy="FALLBACK_DISABLE")
        ort(torch.randn(6, 12))
        nodes[route] = {
            name: [
                {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute if a.name != "input_pointer_scalars"}
                for n in python_ops(ort)
                if next(a.s.decode() for a in n.attribute if a.name == "func_name") == name
            ]
            for name in FUNCTION_NAMES
        }
    assert all(len(found) == 1 for found in nodes["dynamo"].values()), nodes["dynamo"]
    assert nodes["dynamo"] == nodes["torchscript"]


class Relu6(Function):
    """Has its own TorchScript ``symbolic``, which the dynamo route cannot use; its backward is not the forward's
    derivative at 6 (it lets the gradient through there)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(0.0, 6.0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ((x > 0) & (x <= 6)).to(grad.dtype)

    @staticmethod
    def symbolic(g, x):
        return g.op("Clip", x, g.op("Constant", value_t=torch.tensor(0.0)), g.op("Constant", value_t=torch.tensor(6.0)))


def test_function_with_a_symbolic_runs_as_python_op(host):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return Relu6.apply(self.fc(x) * 4).sum()

    ort, ref = on_dynamo(Model(), host())
    x = torch.randn(8, 4)
    loss, loss_ref = ort(x), ref(x)
    assert_losses_match(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    assert_grads_match(ort, ref)
    assert func_names(ort) == [f"{__name__}.Relu6"]


class Normalize(Function):
    """Reads a value from its input (``.item()``): a symbol of the export's shape computation, a float in ORT's call;
    its backward treats that value as a constant (not the forward's derivative)."""

    @staticmethod
    def forward(ctx, x):
        ctx.peak = x.abs().max().item()
        return x / ctx.peak

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.peak


class Positive(Function):
    """An output whose length depends on the input's values."""

    @staticmethod
    def forward(ctx, x):
        mask = x > 0
        ctx.save_for_backward(mask)
        return x[mask]

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return torch.zeros(mask.shape, dtype=grad.dtype).masked_scatter(mask, grad)


def test_value_dependent_forwards_match_torch(host):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = Normalize.apply(self.fc(x))
            return (Positive.apply(h) ** 2).sum()

    ort, ref = on_dynamo(Model(), host())
    steps_match(ort, ref, (6, 9))
    assert sorted(func_names(ort)) == [f"{__name__}.Normalize", f"{__name__}.Positive"]
    assert_ran_in_ort(ort, exports=2)  # the first call's sizes, then one graph dynamic in the batch


def test_with_every_installed_plugin_functions_match_torch(monkeypatch):
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
    host = PluginHost(Config.from_table({}, env=NO_FALLBACK))
    try:
        assert host.records[plugin.NAME].enabled and host.records[dynamo.NAME].enabled
        ort, ref = on_dynamo(FunctionNet(), host)
        check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
        assert sorted(func_names(ort)) == FUNCTION_NAMES
    finally:
        host.close()


# -- traced through -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env",
    [
        {"ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS": f"{__name__}.Double"},
        {"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0"},
    ],
    ids=["skipped", "enable=0"],
)
def test_traced_through_functions_get_the_forwards_derivative(host, env):
    # Not torch's gradient on purpose (the Function's own backward is skipped): the audit would rightly refuse it.
    ort = ORTModule(UsesDouble(), host=host({**env, "ORTCORE_VERIFY_GRADIENTS": "0"}), exporter="dynamo")
    ort(torch.randn(3, 4)).backward()
    torch.testing.assert_close(ort.fc.bias.grad, torch.full((4,), 6.0))  # 3 rows x forward's 2
    assert func_names(ort) == []
    assert_ran_in_ort(ort)


def test_skipped_function_is_traced_through_and_the_others_run_as_python_op(host):
    ort, ref = on_dynamo(FunctionNet(), host({"ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS": function_name(InplaceScale)}))
    check_step_and_training(ort, ref, make_batches(batch, 3), step, steps=2)
    assert sorted(func_names(ort)) == [n for n in FUNCTION_NAMES if not n.endswith(".InplaceScale")]


def test_function_receiving_a_module_is_traced_through(host, caplog):
    ort, ref = on_dynamo(BlockNet(), host())
    with caplog.at_level(logging.INFO, logger="ortcore.autograd_function"):
        check_step_and_training(ort, ref, make_batches(batch, 3), step, steps=2)
    assert func_names(ort) == []  # the block's parameters are the model's
    assert "RunBlock receives Sequential with parameters: traced through" in caplog.text


# -- activation checkpointing ---------------------------------------------------------------------------------------
class CheckpointNet(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, torch.relu(self.inp(x)), use_reentrant=self.reentrant)
        return self.out(h)


def test_reentrant_checkpoint_is_refused_when_switched_off(host):
    ort = ORTModule(
        CheckpointNet(reentrant=True), host=host({"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "0"}), exporter="dynamo"
    )
    with pytest.raises(UnsupportedModelError, match="ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=0"):
        ort(torch.randn(4, 12))


@pytest.mark.parametrize(
    ("reentrant", "env"),
    [(True, {"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "inline"}), (False, {})],
    ids=["reentrant-inline", "non-reentrant"],
)
def test_checkpoint_is_traced_through_and_matches_torch(host, reentrant, env):
    ort, ref = on_dynamo(CheckpointNet(reentrant), host(env))
    check_step_and_training(ort, ref, make_batches(batch, 4), checkpoint_step, steps=3)
    assert func_names(ort) == []  # the checkpointed layers run in ORT
    assert sum(n.op_type == "Tanh" for n in ort.state_machine.current[0].model.graph.node) == 1


def test_reentrant_checkpoint_runs_as_a_recompute_region_matching_torch(host):
    ort, ref = on_dynamo(CheckpointNet(True), host())
    check_step_and_training(ort, ref, make_batches(batch, 4), checkpoint_step, steps=3)
    assert func_names(ort) == ["ortcore_plugins.autograd_function.checkpoint.CheckpointRegion"]
    assert sum(n.op_type == "Tanh" for n in ort.state_machine.current[0].model.graph.node) == 0


# -- what a PythonOp cannot take ------------------------------------------------------------------------------------
class Scale(Function):
    seen: list = []  # the Python ints it was called with

    @staticmethod
    def forward(ctx, x, n):
        if type(n) is int:  # a SymInt while the exporter computes shapes
            Scale.seen.append(n)
        ctx.n = n
        return x * n

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.n, None


class ScaleBySize(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Scale.apply(self.fc(x), x.shape[0]).sum()


def test_size_of_a_dynamic_dimension_as_argument_follows_the_batch(host):
    """``x.shape[0]`` is an int64 input of the node (not an attribute fixed at export): the Function gets each
    batch's size as a Python int, without a re-export."""
    Scale.seen.clear()
    ort, ref = on_dynamo(ScaleBySize(), host(env={"ORTCORE_DYNAMIC_SHAPES": "always"}))  # one graph for both sizes
    steps_match(ort, ref, (3, 7))
    assert_ran_in_ort(ort, exports=1)
    (node,) = python_ops(ort)
    assert next(a.s for a in node.attribute if a.name == "input_convention") == b"dd"
    # The first batch: the gradient audit's PyTorch run beside the step's ORT run (the audit checks the step itself),
    # then torch's; the second batch reuses the audited graph.
    assert Scale.seen == [3, 3, 3, 7, 7]


def test_error_in_backward_fails_the_step_and_is_logged(host, caplog):
    class Broken(Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("broken backward")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return Broken.apply(self.fc(x)).sum()

    loss = ORTModule(Model(), host=host(), exporter="dynamo")(torch.randn(2, 3))
    with (
        caplog.at_level(logging.ERROR, logger="ortcore.autograd_function"),
        pytest.raises(RuntimeError, match="PythonOpGrad"),
    ):
        loss.backward()
    assert "broken backward" in caplog.text


def test_tolerances_are_the_parity_suites():
    assert (RTOL, ATOL) == (1e-4, 1e-5)


# -- a Hugging Face model -------------------------------------------------------------------------------------------
def tiny_bloom() -> nn.Module:
    """``BloomForCausalLM`` (its MLP's GELU is the custom Function ``GeLUFunction`` in training mode): 2 layers."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0)
    return BloomForCausalLM(config).train()


def test_hugging_face_bloom_trains_with_parity(host):
    pytest.importorskip("transformers")
    ort, ref = on_dynamo(tiny_bloom(), host())
    check_step_and_training(ort, ref, make_batches(bloom_batch, 4), bloom_step, steps=3)
    gen = torch.Generator().manual_seed(0)
    for n, length in ((2, 7), (5, 9)):  # other batch and sequence lengths: one graph dynamic in both, for both
        ids = torch.randint(0, 128, (n, length), generator=gen)
        data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        (logits, loss), (logits_ref, loss_ref) = bloom_step(ort, data), bloom_step(ref, data)
        assert_outputs_match(logits, logits_ref)
        assert_losses_match(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        assert_grads_match(ort, ref)
        ort.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert func_names(ort) == ["transformers.models.bloom.modeling_bloom.GeLUFunction"] * 2  # one per layer
    assert_ran_in_ort(ort, exports=2)
