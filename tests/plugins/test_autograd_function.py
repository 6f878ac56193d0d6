"""autograd_function: custom torch.autograd.Functions run as PythonOp inside ORT, compared with PyTorch itself.

Tolerances are the parity suite's (fp32: rtol 1e-4, atol 1e-5 for outputs and gradients; loss curves rtol 1e-4).
"""

from __future__ import annotations

import copy
import glob
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
import torch.utils.checkpoint
from models import (
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
import ortcore_plugins.services.python_op as python_op
from ortcore import DebugOptions, FallbackPolicy, LogLevel, ORTModule
from ortcore.config import Config
from ortcore.errors import OptionError, UnsupportedModelError
from ortcore.graph_passes import GraphPass
from ortcore.hookspecs import hookimpl
from ortcore.host import PluginError, PluginHost
from ortcore_plugins.torchscript_exporter import TorchScriptExporter

PLUGINS = {"autograd_function": plugin}
FUNCTION_NAMES = (
    f"{__name__}.ScaledProduct",
    f"{__name__}.InplaceScale",
    f"{__name__}.SignMask",
    f"{__name__}.ClampedExp",
)


# -- the Functions --------------------------------------------------------------------------------------------------
class ScaledProduct(Function):
    """Two outputs, tensors and non-tensor arguments (float, int tuple, bool, str), save_for_backward,
    needs_input_grad."""

    @staticmethod
    def forward(ctx, x, w, scale: float, dims: tuple, square: bool, tag: str):
        ctx.save_for_backward(x, w)
        ctx.scale, ctx.dim, ctx.square = scale, dims[0], square
        assert tag == "product" and square is True and dims == (1,)
        assert torch.jit.is_tracing() or scale == 0.1  # the Python float itself, not a float32 attribute
        return x * w * scale, (x * x if square else x).sum(dims)

    @staticmethod
    def backward(ctx, grad_y, grad_s):
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y * w * ctx.scale + (2 * x if ctx.square else 1) * grad_s.unsqueeze(ctx.dim)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y * x * ctx.scale).sum(0)
        return grad_x, grad_w, None, None, None, None


class InplaceScale(Function):
    """An in-place op on its input (mark_dirty)."""

    @staticmethod
    def forward(ctx, x, alpha: float):
        ctx.alpha = alpha
        x.mul_(alpha)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.alpha, None


class SignMask(Function):
    """Three outputs, two of them marked non-differentiable (a float mask and int64 indices)."""

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        index = x.argmax(-1)
        ctx.mark_non_differentiable(mask, index)
        ctx.save_for_backward(mask)
        return x * mask, mask, index

    @staticmethod
    def backward(ctx, grad, _grad_mask, _grad_index):
        (mask,) = ctx.saved_tensors
        return grad * mask


class ClampedExp(Function):
    """Saves its own output for backward."""

    @staticmethod
    def forward(ctx, x):
        y = x.clamp(max=3.0).exp()
        ctx.save_for_backward(y, x)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, x = ctx.saved_tensors
        return grad * y * (x < 3.0).to(grad.dtype)


class Relu6(Function):
    """A Function with its own symbolic: exported through it, never as PythonOp."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(0.0, 6.0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ((x > 0) & (x < 6)).to(grad.dtype)

    @staticmethod
    def symbolic(g, x):
        zero = g.op("Constant", value_t=torch.tensor(0.0))
        six = g.op("Constant", value_t=torch.tensor(6.0))
        return g.op("Clip", x, zero, six)


class FunctionNet(nn.Module):
    def __init__(self, n_in: int = 12, hidden: int = 16, n_out: int = 4):
        super().__init__()
        self.inp = nn.Linear(n_in, hidden)
        self.w = nn.Parameter(torch.randn(hidden) * 0.5)
        self.out = nn.Linear(hidden, n_out)

    def forward(self, x):
        h = self.inp(x)
        h, s = ScaledProduct.apply(h, self.w, 0.1, (1,), True, "product")
        h = InplaceScale.apply(h, 1.5)
        h, mask, index = SignMask.apply(h)
        h = ClampedExp.apply(h * 0.2)
        return self.out(Relu6.apply(h)) + 0.01 * s.unsqueeze(-1) + 0.0 * mask.sum(-1, keepdim=True), index


def batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 12, generator=gen), torch.randn(16, 4, generator=gen)


def step(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    x, y = data
    out, index = model(x)
    return (out, index), ((out - y) ** 2).mean()


def saved_op_types(path: Path) -> Counter:
    files = sorted(glob.glob(str(path / "*pre_grad_training.onnx")))
    assert files, f"no graph saved in {path}"
    return Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in onnx.load(files[-1]).graph.node)


def python_op_names(path: Path) -> list[str]:
    files = sorted(glob.glob(str(path / "*pre_grad_training.onnx")))
    names = []
    for node in onnx.load(files[-1]).graph.node:
        if node.op_type == "PythonOp":
            names += [a.s.decode() for a in node.attribute if a.name == "func_name"]
    return names


def debug(tmp_path: Path) -> DebugOptions:
    return DebugOptions(log_level=LogLevel.WARNING, save_onnx=True, onnx_prefix="af", save_path=str(tmp_path))


# -- PythonOp -------------------------------------------------------------------------------------------------------
def test_functions_run_as_python_op_with_torch_gradients(ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS)
    ort, ref = ort_and_torch(FunctionNet(), host=host, debug_options=debug(tmp_path))
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
    assert_ran_in_ort(ort, exports=1)
    assert sorted(python_op_names(tmp_path)) == sorted(FUNCTION_NAMES)
    ops = saved_op_types(tmp_path)
    assert ops["com.microsoft::PythonOp"] == 4 and ops["Clip"] == 1  # Relu6 keeps its own symbolic


def test_adamw_loss_curve_matches_torch(ortcore_host):
    host = ortcore_host(PLUGINS)
    ort, ref = ort_and_torch(FunctionNet(), host=host)
    curve, curve_ref = check_step_and_training(ort, ref, make_batches(batch, 13), step, steps=12)
    assert curve[-1] < curve[0]  # it trains
    assert_ran_in_ort(ort, exports=1)


def test_needs_input_grad_follows_what_ort_differentiates(ortcore_host):
    seen = []

    class Record(Function):
        @staticmethod
        def forward(ctx, x, w):
            if ctx.needs_input_grad is not None:  # None while the exporter traces
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

    ort, ref = ort_and_torch(Model(), host=ortcore_host(PLUGINS))
    x = torch.randn(2, 3)
    ort(x).backward()
    ref(x).backward()
    assert seen[-2:] == [(False, True), (False, True)]  # ORT's call and torch's
    x_grad = x.clone().requires_grad_()
    x_ref = x.clone().requires_grad_()
    ort(x_grad).backward()
    ref(x_ref).backward()
    assert seen[-2:] == [(True, True), (True, True)]
    assert_close(x_grad.grad, x_ref.grad, "grad of the input", "grads")
    assert_grads_match(ort, ref)


def test_inference_runs_keep_no_context(ortcore_host):
    ort, ref = ort_and_torch(FunctionNet(), host=ortcore_host(PLUGINS))
    x = torch.randn(5, 12)
    with torch.no_grad():
        assert_outputs_match(ort(x), ref(x))
    ort.eval()
    ref.eval()
    with torch.no_grad():
        assert_outputs_match(ort(x), ref(x))
    assert python_op.held_contexts() == []  # no context was made for ORT to hold
    assert_ran_in_ort(ort)


def test_error_in_backward_fails_the_step_and_is_logged(ortcore_host, caplog):
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
            self.l = nn.Linear(3, 3)

        def forward(self, x):
            return Broken.apply(self.l(x)).sum()

    ort = ORTModule(Model(), host=ortcore_host(PLUGINS), fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    loss = ort(torch.randn(2, 3))
    with (
        caplog.at_level(logging.ERROR, logger="ortcore.autograd_function"),
        pytest.raises(RuntimeError, match="PythonOpGrad"),
    ):
        loss.backward()
    assert "broken backward" in caplog.text and "Broken" in caplog.text


# -- switches -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env",
    [{"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0"}, {"ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT": "1"}],
    ids=["enable=0", "legacy-disable=1"],
)
def test_disabled_custom_autograd_traces_through(ortcore_host, tmp_path, env):
    host = ortcore_host(PLUGINS, env=env)
    ort, ref = ort_and_torch(FunctionNet(), host=host, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
    ops = saved_op_types(tmp_path)
    assert ops["com.microsoft::PythonOp"] == 0 and ops["Exp"] == 1 and ops["Clip"] == 2  # clamp and Relu6


def test_disabled_in_ortcore_toml_traces_through(ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS, table={"plugins": {"autograd_function": {"enable_custom_autograd": False}}})
    ort, ref = ort_and_torch(FunctionNet(), host=host, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 3), step, steps=2)
    assert saved_op_types(tmp_path)["com.microsoft::PythonOp"] == 0


def test_skipped_functions_are_traced_through(ortcore_host, tmp_path):
    skipped = f"{FUNCTION_NAMES[0]}, {FUNCTION_NAMES[3]}"
    host = ortcore_host(PLUGINS, env={"ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS": skipped})
    ort, ref = ort_and_torch(FunctionNet(), host=host, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
    assert sorted(python_op_names(tmp_path)) == sorted([FUNCTION_NAMES[1], FUNCTION_NAMES[2]])


@pytest.mark.parametrize(
    ("env", "table", "needle"),
    [
        ({"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "maybe"}, {}, "ORTMODULE_ENABLE_CUSTOM_AUTOGRAD='maybe'"),
        ({"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "2"}, {}, "ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT='2'"),
        ({"ORTMODULE_SKIPPED_AUTOGRAD_FUNCTIONS": "Gelu"}, {}, "'Gelu' is not a fully qualified class name"),
        ({}, {"plugins": {"autograd_function": {"skiped_functions": []}}}, "did you mean 'skipped_functions'"),
        (
            {"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "1", "ORTMODULE_DISABLE_CUSTOM_AUTOGRAD_SUPPORT": "1"},
            {},
            "contradict",
        ),
    ],
)
def test_bad_options_name_the_value_and_what_is_allowed(ortcore_host, env, table, needle):
    with pytest.raises((OptionError, PluginError)) as info:
        ortcore_host(PLUGINS, env=env, table=table)
    assert needle.lower() in str(info.value).lower()


# -- activation checkpointing ---------------------------------------------------------------------------------------
class CheckpointNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.block, torch.relu(self.inp(x)), use_reentrant=True)
        return self.out(h)


def checkpoint_step(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    out = model(data[0])
    return out, ((out - data[1]) ** 2).mean()


def test_reentrant_checkpoint_is_refused_when_switched_off(ortcore_host):
    host = ortcore_host(PLUGINS, env={"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "0"})
    ort = ORTModule(CheckpointNet(), host=host, fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    with pytest.raises(UnsupportedModelError, match="ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=0"):
        ort(torch.randn(4, 12))


def test_reentrant_checkpoint_inline_matches_torch(ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS, env={"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "inline"})
    ort, ref = ort_and_torch(CheckpointNet(), host=host, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 6), checkpoint_step, steps=5)
    ops = saved_op_types(tmp_path)
    assert ops["com.microsoft::PythonOp"] == 0 and ops["Tanh"] == 1  # the checkpointed layers run in ORT


@pytest.mark.parametrize("env", [{}, {"ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT": "1"}], ids=["default", "allowed"])
def test_reentrant_checkpoint_runs_as_a_recompute_region_matching_torch(ortcore_host, tmp_path, env):
    ort, ref = ort_and_torch(CheckpointNet(), host=ortcore_host(PLUGINS, env=env), debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 6), checkpoint_step, steps=5)
    ops = saved_op_types(tmp_path)
    assert ops["com.microsoft::PythonOp"] == 1 and ops["Tanh"] == 0  # the checkpointed layers run in PyTorch


# -- without the plugin ---------------------------------------------------------------------------------------------
def test_without_the_plugin_a_function_is_an_error_naming_it(ortcore_host):
    ort = ORTModule(FunctionNet(), host=ortcore_host({}), fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    with pytest.raises(UnsupportedModelError, match="enable the 'autograd_function' plugin") as info:
        ort(torch.randn(4, 12))
    assert "ScaledProduct" in str(info.value)


def test_without_the_plugin_the_default_policy_falls_back_naming_it(ortcore_host):
    ort, ref = ort_and_torch(FunctionNet(), host=ortcore_host({}), fallback_policy=FallbackPolicy.default())
    x = torch.randn(4, 12)
    with pytest.warns(RuntimeWarning, match="enable the 'autograd_function' plugin"):
        out = ort(x)
    assert_outputs_match(out, ref(x))
    assert "autograd_function" in (ort.fallback_reason or "")


def test_without_the_plugin_disabled_custom_autograd_traces_through(ortcore_host, tmp_path):
    host = ortcore_host({}, env={"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0"})
    ort, ref = ort_and_torch(FunctionNet(), host=host, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 3), step, steps=2)
    assert saved_op_types(tmp_path)["com.microsoft::PythonOp"] == 0


# -- a Hugging Face model -------------------------------------------------------------------------------------------
def tiny_bloom(seed: int = 0) -> nn.Module:
    """``BloomForCausalLM`` (its MLP's GELU is the custom Function ``GeLUFunction``): hidden 64, 2 layers."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    config = BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=2, hidden_dropout=0.0, attention_dropout=0.0)
    return BloomForCausalLM(config).train()


def bloom_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (3, 12), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def bloom_step(model: nn.Module, data: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    out = model(**data, use_cache=False)
    return out.logits, out.loss


def test_hugging_face_bloom_trains_with_parity(ortcore_host, tmp_path):
    host = ortcore_host(PLUGINS)
    ort, ref = ort_and_torch(tiny_bloom(), host=host, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(bloom_batch, 6), bloom_step, steps=5)
    names = python_op_names(tmp_path)
    assert names and all(n == "transformers.models.bloom.modeling_bloom.GeLUFunction" for n in names)
    assert len(names) == 2  # one per layer
    assert RTOL == 1e-4


# -- through the entry points ---------------------------------------------------------------------------------------
def autoloaded_host(table: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> PluginHost:
    return PluginHost(Config.from_table(table or {}, env=env or {}))


def test_with_every_installed_plugin_functions_match_torch():
    host = autoloaded_host()
    assert host.records["autograd_function"].enabled
    ort, ref = ort_and_torch(FunctionNet(), host=host)
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
    host.close()


@pytest.mark.parametrize(
    ("table", "env"),
    [({}, {"ORTCORE_DISABLE_PLUGINS": "autograd_function"}), ({"plugins": {"disable": ["autograd_function"]}}, {})],
    ids=["ORTCORE_DISABLE_PLUGINS", "ortcore.toml"],
)
def test_switched_off_plugin_is_named_in_the_error(table, env):
    host = autoloaded_host(table, env)
    assert host.records["autograd_function"].status == "disabled"
    ort = ORTModule(FunctionNet(), host=host, fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    with pytest.raises(UnsupportedModelError, match="enable the 'autograd_function' plugin"):
        ort(torch.randn(4, 12))
    host.close()


# -- more Function styles and training patterns ---------------------------------------------------------------------
class SetupContextMul(Function):
    """The forward-without-ctx style: ``setup_context`` saves what backward needs; an optional (None) argument."""

    @staticmethod
    def forward(x, w, bias):
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


class SetupContextNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 8)
        self.w = nn.Parameter(torch.randn(8))
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        return self.out(torch.tanh(SetupContextMul.apply(self.inp(x), self.w, None))), self.w.sum().detach()


@pytest.mark.parametrize("env", [{}, {"ORTMODULE_ENABLE_CUSTOM_AUTOGRAD": "0"}], ids=["python-op", "traced-through"])
def test_setup_context_style_function_matches_torch(ortcore_host, tmp_path, env):
    ort, ref = ort_and_torch(SetupContextNet(), host=ortcore_host(PLUGINS, env=env), debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
    assert saved_op_types(tmp_path)["com.microsoft::PythonOp"] == (0 if env else 1)


def test_gradient_accumulation_and_eval_mode_with_grad_match_torch(ortcore_host):
    ort, ref = ort_and_torch(FunctionNet(), host=ortcore_host(PLUGINS))
    batches = make_batches(batch, 2)
    for model in (ort, ref):  # two forwards before either backward: each call keeps its own context
        losses = [step(model, b)[1] for b in batches]
        sum(losses).backward()
    assert_grads_match(ort, ref)
    for model in (ort, ref):
        model.zero_grad(set_to_none=True)
        model.eval()
        step(model, batches[0])[1].backward()
    assert_grads_match(ort, ref)
    assert python_op.held_contexts() == []  # the last backward released what the last forward kept


class KeepWhere(Function):
    """A boolean tensor argument and a boolean output (ORT's DLPack has no boolean: they travel as uint8)."""

    @staticmethod
    def forward(ctx, x, mask):
        assert mask.dtype == torch.bool
        ctx.save_for_backward(mask)
        return x.masked_fill(~mask, 0.0), mask & (x > 0.5)

    @staticmethod
    def backward(ctx, grad, _grad_mask):
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(~mask, 0.0), None


class BoolNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 4)

    def forward(self, x):
        h = self.inp(x)
        kept, strong = KeepWhere.apply(h, x[:, :4] > 0)
        return torch.where(strong, 2.0 * kept, kept), strong.sum(-1)


def test_boolean_tensors_in_and_out_match_torch(ortcore_host):
    ort, ref = ort_and_torch(BoolNet(), host=ortcore_host(PLUGINS))
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)


class OnlyScaledProduct:
    """Another plugin's answer to the handler hook: ScaledProduct as PythonOp, no answer for the others."""

    @hookimpl
    def ortcore_autograd_function_handler(self, function: type) -> Any:
        return plugin.PythonOpHandler(function) if function is ScaledProduct else None

    @hookimpl
    def ortcore_graph_passes(self) -> list:
        return [GraphPass(plugin.SHAPES_PASS, run=plugin.relate_output_shapes)]  # PythonOp outputs need it


def test_exporter_asks_the_handler_hook_per_function_class(ortcore_host, tmp_path):
    host = ortcore_host({"only_scaled_product": OnlyScaledProduct()})
    exporter = TorchScriptExporter(inline_autograd_functions=True)  # no answer: traced through
    exporter.use_function_handlers(host.hooks.autograd_function_handler)
    ort, ref = ort_and_torch(FunctionNet(), host=host, exporter=exporter, debug_options=debug(tmp_path))
    check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
    assert python_op_names(tmp_path) == [FUNCTION_NAMES[0]]


class RunBlock(Function):
    """Receives a module and recomputes it in backward, accumulating into its parameters itself (as reversible or
    checkpointing Functions do)."""

    @staticmethod
    def forward(ctx, x, block):
        ctx.block = block
        ctx.save_for_backward(x)
        with torch.no_grad():
            return block(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.block(x), grad)
        return x.grad, None


class BlockNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(RunBlock.apply(self.inp(x), self.block)), x.sum().detach()


def test_function_receiving_a_module_is_traced_through(ortcore_host, tmp_path, caplog):
    ort, ref = ort_and_torch(BlockNet(), host=ortcore_host(PLUGINS), debug_options=debug(tmp_path))
    with caplog.at_level(logging.INFO, logger="ortcore.autograd_function"):
        check_step_and_training(ort, ref, make_batches(batch, 4), step, steps=3)
    assert saved_op_types(tmp_path)["com.microsoft::PythonOp"] == 0  # the block's parameters are the model's
    assert "RunBlock receives Sequential with parameters: traced through" in caplog.text


def test_error_in_forward_fails_the_step_and_is_logged(ortcore_host, caplog):
    class FailsInOrt(Function):
        @staticmethod
        def forward(ctx, x):
            if not torch.jit.is_tracing():  # the export traces it once; the failure is ORT's call
                raise ValueError("broken forward")
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(3, 3)

        def forward(self, x):
            return FailsInOrt.apply(self.l(x)).sum()

    ort = ORTModule(Model(), host=ortcore_host(PLUGINS), fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    with (
        caplog.at_level(logging.ERROR, logger="ortcore.autograd_function"),
        pytest.raises(RuntimeError, match="PythonOp"),
    ):
        ort(torch.randn(2, 3))
    assert "broken forward" in caplog.text and "FailsInOrt" in caplog.text


def test_runners_need_x86_64_linux_and_say_so(ortcore_host, monkeypatch):
    import ortcore_plugins.services.python_op as runner

    monkeypatch.setattr(runner, "_installed", None)
    monkeypatch.setattr(runner.platform, "machine", lambda: "aarch64")
    ort = ORTModule(FunctionNet(), host=ortcore_host(PLUGINS), fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    with pytest.raises(
        UnsupportedModelError, match="needs x86-64 Linux.*'aarch64'.*ORTMODULE_ENABLE_CUSTOM_AUTOGRAD=0"
    ):
        ort(torch.randn(4, 12))


def test_export_cache_never_serves_a_graph_with_python_ops(ortcore_host, tmp_path, caplog):
    import ortcore_plugins.export_cache as export_cache

    env = {"ORTMODULE_CACHE_DIR": str(tmp_path / "cache")}
    host = ortcore_host({"export_cache": export_cache, **PLUGINS}, env=env)
    x = torch.randn(4, 12)
    caplog.set_level(logging.INFO, logger="ortcore.autograd_function")
    caplog.set_level(logging.INFO, logger="ortcore.export_cache")
    first, ref = ort_and_torch(FunctionNet(), host=host)
    first(x)
    second = ORTModule(copy.deepcopy(ref), host=host, fallback_policy=FallbackPolicy.FALLBACK_DISABLE)
    assert_outputs_match(second(x), ref(x))
    assert caplog.text.count("runs custom autograd Functions: exported again") == 1
    plain = nn.Linear(12, 4)  # a graph without PythonOp is still served from the cache
    ORTModule(copy.deepcopy(plain), host=host)(x)
    hits = caplog.text.count("skipping an export")
    ORTModule(copy.deepcopy(plain), host=host)(x)
    assert caplog.text.count("skipping an export") == hits + 1
    assert caplog.text.count("runs custom autograd Functions: exported again") == 1
